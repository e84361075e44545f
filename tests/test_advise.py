"""The advisor on a scaled-down deployment: cpu-tiny's workload (7.5 s
deadline, 45 s hold) on the tiny CPU engine's profile with Ĉ taken as 4
calls/s, where retries without control keep the engine overloaded after the
pulse and turning them off restores service."""
import dataclasses

import pytest

from sim.conditions import CONDITIONS
from sim.experiments import advise as A
from sim.experiments.margin import cell
from sim.profile import load_profile
from sim.scenario import get_scenario

NS = get_scenario("cpu-tiny")
PROF = dataclasses.replace(load_profile("vllm-cpu-tiny"), capacity=4.0)
SEEDS = range(6)


def test_the_deployment_is_one_where_no_retry_recovers_and_no_control_does_not():
    assert cell(PROF, NS.scenario, CONDITIONS["no-control"], SEEDS)["p"] == 0.0
    assert cell(PROF, NS.scenario, CONDITIONS["no-retry"], SEEDS)["lo"] > 0.5


def test_advise_ranks_a_recovering_setting_first_and_resumes(tmp_path):
    out = str(tmp_path / "advice.parquet")
    r = A.advise(PROF, NS.scenario, SEEDS, only="client", out=out, adapt=NS.condition, margin_axes=(),
                 progress=False)
    first = r["ranking"][0]
    assert first["lo"] > 0.5 and first["condition"] != "no-control"
    assert r["top"][0]["condition"] == first["condition"]
    ranked = {x["condition"]: x for x in r["ranking"]}
    assert ranked.get("no-control", {"p": 0.0})["p"] == 0.0
    again = A.advise(PROF, NS.scenario, SEEDS, only="client", out=out, adapt=NS.condition, margin_axes=(),
                     progress=False)
    assert again["ranking"] == r["ranking"]
    other = dataclasses.replace(PROF, capacity=5.0)
    with pytest.raises(ValueError, match="another deployment"):
        A.advise(other, NS.scenario, SEEDS, only="client", out=out, margin_axes=(), progress=False)


def test_candidates_prune_settings_without_effect():
    cands = A.candidates(NS.scenario, PROF.capacity)
    names = [c.name for c in cands]
    assert len(names) == len(set(names))
    for c in cands:
        s = c.settings()
        if s["retries"] == "off" and c.name not in CONDITIONS:
            assert not s["coalesce"] and s["budget"] is None
    only_engine = A.candidates(NS.scenario, PROF.capacity, "engine")
    assert all(c.retries and c.proxy == CONDITIONS["no-control"].proxy for c in only_engine)
    assert {c.engine_cap for c in only_engine} >= {None, 30}      # ⌈7.5 s x 4/s⌉
    with pytest.raises(ValueError):
        A.candidates(NS.scenario, PROF.capacity, "kernel")


def test_gives_up_names_the_worse_measures():
    s = {"p": 0.9, "timely": 0.8, "delivered": 0.9, "burst": 0.5, "recovery_time": {"median": 200.0}}
    alt = {"p": 1.0, "timely": 0.8, "delivered": 0.95, "burst": 0.5, "recovery_time": {"median": 100.0}}
    g = A.gives_up(s, alt)
    assert len(g) == 3 and g[0].startswith("P(recovered)") and "delivered" in g[1] and "recovery" in g[2]
    assert A.gives_up(alt, s) == []


def test_gives_up_a_smaller_margin():
    s = {"p": 1.0, "timely": 0.8, "delivered": 0.9, "burst": 0.5, "recovery_time": {"median": 100.0}}
    ax = lambda c: {"axes": [{"axis": "speed", "baseline": 1.0, "crossing": c, "recovers_at_baseline": True}]}
    g = A.gives_up(s, s, ax(1.41), ax(1.59))
    assert g == ["margin on speed: flips at 1.41 vs 1.59 (now 1)"]
    assert A.gives_up(s, s, ax(1.59), ax(1.41)) == [] and A.gives_up(s, s, ax(1.58), ax(1.59)) == []


def test_pick_skips_a_setting_that_adds_controls_for_nothing():
    from sim.conditions import compose
    by = {"a": compose("no-retry", cancel="now", proxy_cap=10, queue="lifo", name="a"),
          "b": compose("no-retry", cancel="now", proxy_cap=10, queue="lifo", engine_cap=10, name="b"),
          "c": compose("no-control", cancel="now", budget=0.1, name="c"),
          "d": compose("no-control", name="d")}
    sc = lambda t: {"p": 1.0, "timely": t, "delivered": t, "burst": t}
    scored = {"a": sc(0.864), "b": sc(0.8645), "c": sc(0.86), "d": sc(0.5)}
    assert A.pick(["a", "b", "c", "d"], scored, by, 3) == ["a", "c", "d"]
