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
    assert len({dataclasses.replace(c, name="") for c in cands}) == len(cands)     # no setting runs twice
    assert set(CONDITIONS) <= set(names)
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

    def ax(c):
        return {"axes": [{"axis": "speed", "baseline": 1.0, "crossing": c, "recovers_at_baseline": True}]}

    g = A.gives_up(s, s, ax(1.41), ax(1.59))
    assert g == ["margin on speed: flips at 1.41 vs 1.59 (now 1)"]
    assert A.gives_up(s, s, ax(1.59), ax(1.41)) == [] and A.gives_up(s, s, ax(1.58), ax(1.59)) == []


def test_pick_skips_a_setting_that_adds_controls_for_nothing():
    from sim.conditions import compose
    by = {"a": compose("no-retry", cancel="now", proxy_cap=10, queue="lifo", name="a"),
          "b": compose("no-retry", cancel="now", proxy_cap=10, queue="lifo", engine_cap=10, name="b"),
          "c": compose("no-control", cancel="now", budget=0.1, name="c"),
          "d": compose("no-control", name="d")}

    def sc(t):
        return {"p": 1.0, "timely": t, "delivered": t, "burst": t}

    scored = {"a": sc(0.864), "b": sc(0.8645), "c": sc(0.86), "d": sc(0.5)}
    assert A.pick(["a", "b", "c", "d"], scored, by, 3) == ["a", "c", "d"]


# ------------------------------------------------------------------ the search's rounds and screening runs
def test_the_rounds_halve_towards_the_finalists():
    cut = (10.0, 100.0)
    assert A.stages(10, 2, 12, cut) == [(1, False, None), (2, False, 24), (2, True, 12), (10, True, 0)]
    assert A.stages(10, 2, 12, None) == [(1, True, None), (2, True, 12), (10, True, 0)]
    assert A.stages(3, 1, 3, None) == [(1, True, 3), (3, True, 0)]
    assert A.stages(1, 2, 3, cut) == [(1, False, None), (1, True, 3), (1, True, 0)]


def test_a_screening_run_keeps_the_burst_and_cuts_before_and_after():
    from sim.scenario import Phase
    from sim.workload import make_trace
    sc = NS.scenario.with_(phases=(Phase(NS.scenario.base_s, load=0.6, name="a"),
                                   Phase(NS.scenario.pulse_s, load=2.0, name="b"),
                                   Phase(NS.scenario.hold_s / 2, load=0.6, name="c"),
                                   Phase(NS.scenario.hold_s / 2, load=0.5, name="d")))
    base, hold = NS.scenario.base_s / 4, NS.scenario.hold_s / 4
    cut = A.screen_cut(sc, base, hold)
    assert cut == (sc.pulse_start - base, sc.pulse_end + hold)
    short = A.cut_scenario(sc, cut)
    assert (short.base_s, short.pulse_s, short.hold_s) == (base, sc.pulse_s, hold)
    assert [p.name for p in short.phases] == ["a", "b", "c"]
    assert sum(p.duration_s for p in short.phases) == pytest.approx(cut[1] - cut[0])
    tr = make_trace(PROF.capacity, sc, 3)
    t = A.cut_trace(tr, cut)
    inside = (tr.arrival >= cut[0]) & (tr.arrival < cut[1])
    assert len(t) == inside.sum() > 0
    assert t.arrival == pytest.approx(tr.arrival[inside] - cut[0])
    assert (t.prompt_len == tr.prompt_len[inside]).all() and (t.max_tokens == tr.max_tokens[inside]).all()
    assert A.screen_cut(sc, None, None) is None and A.screen_cut(sc, 1e9, 1e9) is None
    assert A.screen_cut(sc.with_(stalls=((1.0, 1.0),)), base, hold) is None
    assert A.cut_tag(None) == "" and A.cut_tag(cut).startswith("advise-screen:")


def test_screening_runs_rank_like_the_full_runs_and_the_finalists_run_in_full(tmp_path):
    """With cut screening runs the advice on the client layer is the one the
    full screen gives: the same first setting, and every finalist's rows are
    full runs on every seed."""
    kw = dict(only="client", adapt=NS.condition, margin_axes=(), progress=False, finalists=3)
    full = A.advise(PROF, NS.scenario, SEEDS, **kw)
    base, hold = A.default_cut(NS.scenario)
    out = str(tmp_path / "cut.parquet")
    cut = A.advise(PROF, NS.scenario, SEEDS, out=out, screen_base_s=NS.scenario.base_s / 2, screen_hold_s=hold,
                   **kw)
    assert cut["screen_cut"] is not None and full["screen_cut"] is None
    assert cut["top"][0]["condition"] == full["top"][0]["condition"]
    from sim.experiments.sweep import read_rows
    rows = read_rows(out)
    tags = {(r["condition"], r["seed"], r.get("scenario_hash") or "") for r in rows}
    for x in cut["ranking"]:
        assert all((x["condition"], s, "") in tags for s in SEEDS)
    assert any(t[2] for t in tags)


# ------------------------------------------------------------------ fleets: the router's layer
def slow_fleet():
    """Three replicas of cpu-tiny's engine, one 2.5x slower, behind round
    robin: without retries, round robin gives the slow replica a third of
    the load after the burst, more than it serves, and it never recovers;
    routing by outstanding requests or KV usage sends it less."""
    from sim.deployment import load
    from sim.fleet import FleetSpec
    from sim.policy.router import RouterConfig
    from sim.verdict import perturbed
    dep = load("cpu-tiny")
    fleet = FleetSpec(RouterConfig("round-robin"), (dep.profile, dep.profile, perturbed(dep.profile, speed=2.5)))
    cap = sum(fleet.capacities(dep.scenario))
    return dataclasses.replace(dep.profile, capacity=cap), dep.scenario, fleet, dep


def test_advise_chooses_a_fleets_router_and_says_which():
    from sim.policy.router import ROUTERS
    prof, sc, fleet, dep = slow_fleet()
    base = CONDITIONS["no-retry"]
    r = A.advise(prof, sc, range(4), only="router", adapt=dep.condition_for, base=base, fleet=fleet,
                 margin_axes=(), progress=False, finalists=4)
    assert r["candidates"] == len(A.router_settings(fleet)) == 1 + len(ROUTERS) * 4 - 1
    ranked = {x["condition"]: x for x in r["ranking"]}
    assert ranked.get("no-retry", {"p": 0.0})["p"] == 0.0           # the scenario's own router
    first = r["top"][0]
    assert first["summary"]["lo"] > 0.5 and ";router=" in first["condition"]
    chosen = r["router"]["chosen"]
    assert r["router"]["changed"] and chosen == first["router"] and chosen["policy"] != "round-robin"
    assert first["settings"] == dep.condition_for(base).settings()
    text = A.report(r)
    assert f"router: {chosen['policy']} (retries {chosen['retries']}, proxy per {chosen['proxy']}) instead of the " \
           "scenario's round-robin" in text


def test_a_fleets_full_search_puts_the_named_conditions_under_every_router():
    prof, sc, fleet, dep = slow_fleet()
    conds = A.candidates(sc, prof.capacity, None, dep.condition_for, CONDITIONS["cancel"])
    first = A.first_settings(conds, fleet, None, CONDITIONS["cancel"])
    routers = A.router_settings(fleet)
    assert routers[0] == fleet.router and len(set(routers)) == len(routers)
    assert {(c.name, r) for c, r in first} >= {(c.name, fleet.router) for c in conds}
    for name in CONDITIONS:
        assert {r for c, r in first if c.name == name} == set(routers)
    assert len(first) == len(conds) + len(CONDITIONS) * (len(routers) - 1)
    only = A.first_settings(conds, fleet, "client", None)
    assert {r for _, r in only} == {fleet.router}
    assert A.routed(conds[0], fleet.router, fleet.router) is conds[0]
    assert A.routed(conds[0], routers[1], fleet.router).name.startswith(conds[0].name + ";router=")


def test_only_router_needs_a_fleet():
    with pytest.raises(ValueError, match="--only router"):
        A.advise(PROF, NS.scenario, SEEDS, only="router", margin_axes=(), progress=False)


def test_a_fleets_full_search_crosses_the_best_controls_with_every_router(monkeypatch, tmp_path):
    """On a smaller grid: the first round runs the grid under the scenario's
    router and the named conditions under every router; the best controls
    then meet every router too, and the rows say which router each ran."""
    for k, v in (("CANCELS", ("now",)), ("BUDGETS", (0.0,)), ("QUEUES", (("fifo", None),)),
                 ("CAP_FRACTIONS", (1.0,))):
        monkeypatch.setattr(A, k, v)
    prof, sc, fleet, dep = slow_fleet()
    out = str(tmp_path / "fleet.parquet")
    r = A.advise(prof, sc, range(2), adapt=dep.condition_for, base=CONDITIONS["no-retry"], fleet=fleet, out=out,
                 margin_axes=("speed",), progress=False, finalists=3, screen=1)
    routers = A.router_settings(fleet)
    conds = A.candidates(sc, prof.capacity, None, dep.condition_for, CONDITIONS["no-retry"])
    first = len(conds) + len(CONDITIONS) * (len(routers) - 1)
    assert first < r["candidates"] <= first + A.CROSSED * (len(routers) - 1)
    from sim.experiments.sweep import read_rows
    ran = {x["condition"] for x in read_rows(out)}
    grid_routed = {n for n in ran if ";router=" in n and n.split(";")[0] not in CONDITIONS}
    assert grid_routed                                  # a grid setting crossed with the routers
    # the margin of a fleet's setting: its controls on the fleet under the setting's router
    assert r["top"][0]["summary"]["p"] == 1.0 and r["top"][0]["margin"]["axes"][0]["axis"] == "speed"
    assert r["top"][0]["margin"]["axes"][0]["probes"][0]["p"] == 1.0
    assert "   margin: " in A.report(r) and "router: " in A.report(r)
