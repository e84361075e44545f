"""[[layer]]s on a [fleet]: the client preset and the gateways stand
between the application and the proxy or the router, whichever placement
the fleet names, through `Deployment.run` and `llmsim run`; each replica's
record is cut from the fleet's as without layers. The scenario is the tiny
one of test_preset_client, on two replicas of its engine."""
from __future__ import annotations

import numpy as np
import pytest

import golden
from llmsim.cli import main
from sim.deployment import from_document
from sim.fleet import RECORD_KEYS, fleet_log, run_fleet
from sim.model import Run
from sim.runlog import column
from test_fleet import _no_step_events, without
from test_gateway_run import NGINX, SDK
from test_preset_client import TINY

LITELLM = {"preset": "litellm", "timeout_s": 2.0, "max_retries": 1, "backoff": "none"}


def _dep(layers, placement="deployment", replicas=2, condition="no-control"):
    doc = {**TINY, "proxy": {"condition": condition},
           "fleet": {"replicas": replicas, "profiles": ["vllm-cpu-tiny"] * replicas, "proxy": placement}}
    if layers:
        doc["layer"] = layers
    return from_document(doc, "tiny.toml")


def _fleet_run(dep, seed=0):
    cond = dep.condition_for()
    run = Run(list(dep.fleet.profiles), dep.trace(seed), cond, dep.scenario, seed, stack=dep.stack_for(cond))
    return run, fleet_log(run, run.run())


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_the_sdk_retries_the_504s_of_nginx_before_a_fleet_of_two(placement):
    rec = _dep([SDK, NGINX], placement).run(0)
    (nginx,) = rec["extra"]["layers"]
    att = rec["attempts"]
    assert nginx["preset"] == "nginx" and nginx["upstream_timeout"] > 0
    assert att["refused_gateway"] == nginx["upstream_timeout"]      # each 504 is an attempt's answer
    assert att["timeout"] == 0 and att["retries"] > 0               # the SDK retries them
    assert nginx["upstream_attempts"] == att["sent"]
    assert rec["fleet"]["replicas"] == 2 and rec["fleet"]["proxy"] == placement
    # per replica as without layers: every attempt reached one replica, each replica's calls its own
    reps = rec["replicas"]
    assert all(r["attempts"]["sent"] > 0 for r in reps)
    assert sum(r["attempts"]["sent"] for r in reps) == att["sent"]
    assert sum(r["attempts"]["refused_gateway"] for r in reps) == att["refused_gateway"]
    for cohort in ("pulse", "hold"):         # each call counted on the one replica it landed on first
        assert sum(r["cohorts"][cohort]["offered"] for r in reps) == rec["cohorts"][cohort]["offered"]


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_an_attempt_lands_where_its_execution_ran_though_a_gateway_retries_it(placement):
    run, log = _fleet_run(_dep([SDK, LITELLM], placement))
    (gw,) = run.layers
    assert gw.counts["retries"] > 0         # the proxy saw more attempts than the client sent
    ex = column(log.fleet.attempts, "execution")
    has = ex >= 0
    assert has.sum() > 0
    assert np.array_equal(log.attempt_replica[has], log.execution_replica[ex[has]])
    assert set(log.attempt_replica[has].tolist()) == {0, 1}


def test_a_fleet_of_one_with_layers_is_the_one_engine_run():
    layers = [SDK, NGINX]
    one = from_document({**TINY, "proxy": {"condition": "no-control"}, "layer": layers}, "tiny.toml").run(0)
    fleet = _dep(layers, replicas=1).run(0)
    assert fleet["extra"]["layers"][0]["upstream_timeout"] > 0
    skip = ("wall_s", "deployment") + RECORD_KEYS           # the document names the fleet
    assert golden.differences(without(one, skip), without(fleet, skip)) == []
    # the replica's record is the engine's; the layers stand above the router, in the fleet's record alone
    rep = fleet["replicas"][0]
    assert "layers" not in rep["extra"]
    assert golden.differences(without(one, skip + ("extra",)), without(rep, skip + ("extra",))) == []


def test_a_gateway_that_lets_requests_run_on_orphans_executions_on_the_fleet():
    layers = [{"preset": "openai-python", "timeout_s": 2.0, "max_retries": 0}, {"preset": "haproxy", "timeout_s": 30.0}]
    rec = _dep(layers, "replica", condition="cancel").run(0)
    (h,) = rec["extra"]["layers"]
    assert rec["attempts"]["timeout"] > 0
    assert rec["executions"]["aborted"] == 0
    assert rec["executions"]["orphaned"] == h["run_on"] > 0
    assert sum(r["executions"]["orphaned"] for r in rec["replicas"]) == rec["executions"]["orphaned"]


def test_llmsim_run_runs_layers_on_a_fleet(tmp_path, capsys):
    f = tmp_path / "tiny.toml"
    f.write_text(_dep([SDK, NGINX], "replica").to_toml())
    assert main(["run", "--scenario", str(f)]) == 0
    out = capsys.readouterr().out
    assert "pulse" in out and "fleet: 2 replicas" in out


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_layers_on_a_fleet_run_the_same_with_and_without_fast_forward(placement):
    gw = {"preset": "haproxy", "timeout_s": 3.0, "max_connections": 3, "queue_timeout_s": 1.0}
    dep = _dep([SDK, gw], placement, condition="cancel")
    cond, s = dep.condition_for(), dep.scenario
    caps = dep.fleet.capacities(s)
    recs = [run_fleet(list(dep.fleet.profiles), cond, dep.trace(0), s, caps, dep.fleet.router, 0,
                      stack=dep.stack_for(cond), fast_forward=ff) for ff in (True, False)]
    assert recs[0]["extra"]["layers"][0]["queue_timeout"] > 0
    assert golden.differences(_no_step_events(recs[0]), _no_step_events(recs[1])) == []
    assert recs[0]["extra"]["layers"] == recs[1]["extra"]["layers"]


def test_margin_and_advise_runs_on_a_fleet_take_its_layers():
    from dataclasses import replace

    from sim.experiments.advise import _rows_task
    from sim.experiments.margin import run_task
    dep = _dep([SDK, NGINX], "replica")
    cond, s = dep.condition_for(), dep.scenario
    fl = dep.fleet
    ref = dep.run(0)
    rec = run_task((dep.profile, s, cond, 0, dep.capacity, (fl.profiles, fl.capacities(s), fl.router),
                    dep.run_layers()), full=True)
    assert rec["extra"]["layers"] == ref["extra"]["layers"] and rec["attempts"] == ref["attempts"]
    (row,) = _rows_task((replace(dep.profile, capacity=dep.capacity), s, (fl.profiles, fl.capacities(s)), "k", None,
                         [(cond, fl.router, dep.run_layers(), 0)]))
    assert row["attempts_refused_gateway"] == ref["attempts"]["refused_gateway"] > 0


def test_advise_searches_a_gateways_keys_above_a_fleet(tmp_path):
    """advise on a fleet with [[layer]]s: `--only gateway` keeps the
    controls and the router and tries the gateway's keys, each setting run
    above the fleet (its records carry the layer's counts)."""
    from dataclasses import replace

    from sim.experiments import advise as A
    dep = _dep([SDK, NGINX], "deployment")
    prof = replace(dep.profile, capacity=dep.capacity)
    res = A.advise(prof, dep.scenario, [0], only="gateway", adapt=dep.condition_for, margin_axes=(),
                   progress=False, finalists=40, fleet=dep.fleet, base=dep.condition, screen_base_s=None,
                   screen_hold_s=None, layers=dep.run_layers(), out=str(tmp_path / "a.parquet"))
    names = [r["condition"] for r in res["ranking"]]
    assert res["candidates"] > 1 and any(";gateway=" in n for n in names)
    assert all(n.split(";")[0] == "no-control" for n in names)       # the controls kept
    changed = [t["layers"] for t in res["top"] if t["layers"]]
    assert all(set(ch) == {"gateway"} for ch in changed)          # only the gateway's keys move
    rows = [r for r in A.read_table(str(tmp_path / "a.parquet")).to_pylist() if r["condition"] == "no-control"]
    assert rows and all(r["attempts_refused_gateway"] > 0 for r in rows)   # nginx's 504s, in the fleet's runs
