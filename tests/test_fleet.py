"""Replicas behind a router: one replica is the single engine, whatever the
routing; call affinity with coalescing never leaves a call with live
executions on two replicas (and without affinity the record counts the calls
that had them); calls are conserved across replicas; a replica's record is
a single engine's result record; [fleet] in scenario files and the queues figure."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import golden
from llmsim.cli import main
from sim.conditions import compose
from sim.deployment import load
from sim.fleet import RECORD_KEYS, run_fleet, simulate_fleet
from sim.model import simulate
from sim.policy.router import ROUTERS, ReplicaView, Router, RouterConfig
from sim.profile import from_dict, load_profile
from sim.run import run_one
from sim.scenario import SCENARIOS
from sim.workload import Trace, make_trace

PLACEMENTS = ("deployment", "replica")
TINY = SCENARIOS["cpu-tiny"].scenario
PROFILE = load_profile("vllm-cpu-tiny")


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("LLMSIM_CACHE_DIR", "")


@pytest.fixture(scope="module")
def tiny():
    dep = load("cpu-tiny")
    return dep.capacity, dep.trace(0)


@pytest.fixture(scope="module")
def tiny3(tiny):
    """Three replicas' worth of the cpu-tiny workload (at 3 x Ĉ)."""
    cap = tiny[0]
    return [cap] * 3, make_trace(3 * cap, TINY, 0)


def without(rec: dict, keys=("wall_s",) + RECORD_KEYS) -> dict:
    return {k: v for k, v in rec.items() if k not in keys}


def keys_of(x, path=""):
    """Every key path of a nested record (list items not entered)."""
    if isinstance(x, dict):
        out = set()
        for k, v in x.items():
            out.add(path + "/" + k)
            out |= keys_of(v, path + "/" + k)
        return out
    return set()


# --------------------------------------------------------------- one replica
@pytest.mark.parametrize("condition", [compose("no-control"), compose("cancel"), compose("deadline-check"),
                                       compose("engine-cap-100", engine_cap=20),
                                       compose("cancel", coalesce=True, budget=0.2)], ids=lambda c: c.name)
def test_one_replica_is_the_single_engine_under_every_router(tiny, condition):
    cap, trace = tiny
    cond = condition
    single = run_one(PROFILE, cond, None, 0, trace=trace, scenario=TINY, capacity=cap)
    for policy in ROUTERS:
        for placement in PLACEMENTS:
            rec = run_fleet([PROFILE], cond, trace, TINY, [cap], RouterConfig(policy, 2, placement))
            assert golden.differences(without(single), without(rec)) == [], (policy, placement)


def test_a_replica_record_has_the_single_engine_keys(tiny, tiny3):
    cap, trace = tiny
    single = run_one(PROFILE, "cancel", None, 0, trace=trace, scenario=TINY, capacity=cap)
    caps, trace3 = tiny3
    rec = run_fleet([PROFILE] * 3, "cancel", trace3, TINY, caps, RouterConfig("least-kv"))
    assert len(rec["replicas"]) == 3
    for r in rec["replicas"]:
        assert keys_of(r) == keys_of(single)
    assert keys_of(without(rec, RECORD_KEYS)) == keys_of(single)


def small_case(draw_arrivals, prompts, outputs, deadline):
    arrival = np.sort(np.asarray(draw_arrivals, dtype=float))
    n = len(arrival)
    trace = Trace(arrival, np.asarray(prompts[:n], dtype=np.int64), np.asarray(outputs[:n], dtype=np.int64), 100)
    sc = TINY.with_(base_s=1.0, pulse_s=2.0, hold_s=4.0, deadline_s=deadline, delivery_horizon_s=30.0,
                    primary_skip_s=1.0, window_s=1.0)
    return trace, sc


case = st.integers(1, 14).flatmap(lambda n: st.tuples(
    st.lists(st.floats(0.0, 3.0, allow_nan=False), min_size=n, max_size=n),
    st.lists(st.integers(300, 6000), min_size=n, max_size=n),
    st.lists(st.integers(5, 300), min_size=n, max_size=n)))


def _no_step_events(rec: dict) -> dict:
    """A record without what the closed-form fast-forward saves (SimPy step events) and wall times."""
    out = without(rec, ("wall_s", "extra", "replicas"))
    out["replicas"] = [without(r, ("wall_s", "extra")) for r in rec["replicas"]]
    return out


@pytest.mark.parametrize("policy, placement, cond", [
    ("least-outstanding", "deployment", compose("proxy-cap", proxy_cap=12)),
    ("call-affinity", "replica", compose("deadline-check", coalesce=True, proxy_cap=6)),
    ("least-kv", "deployment", compose("no-control", engine_cap=30)),
], ids=["least-outstanding", "call-affinity", "least-kv"])
def test_fast_forward_matches_stepping_in_a_fleet(tiny3, policy, placement, cond):
    caps, trace = tiny3
    rc = RouterConfig(policy, 1, placement)
    fast = run_fleet([PROFILE] * 3, cond, trace, TINY, caps, rc)
    slow = run_fleet([PROFILE] * 3, cond, trace, TINY, caps, rc, fast_forward=False)
    assert golden.differences(_no_step_events(fast), _no_step_events(slow)) == []


def _with_frontend(profile, frontend_s: float):
    if not frontend_s:
        return profile
    return from_dict(dict(profile.raw, engine=dict(profile.raw["engine"], frontend_s=frontend_s)), "frontend")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case, deadline=st.sampled_from([0.2, 1.0]), n=st.integers(2, 3), placement=st.sampled_from(PLACEMENTS),
       policy=st.sampled_from(ROUTERS), proxy_cap=st.sampled_from([0, 1, 3]), engine_cap=st.sampled_from([0, 2]),
       coalesce=st.booleans(), frontend_s=st.sampled_from([0.0, 0.0, 0.004, 0.05]))
def test_fast_forward_matches_stepping_in_small_fleets(case, deadline, n, placement, policy, proxy_cap, engine_cap,
                                                       coalesce, frontend_s):
    trace, sc = small_case(*case, deadline)
    cond = compose("no-control", coalesce=coalesce, proxy_cap=proxy_cap, engine_cap=engine_cap)
    rc = RouterConfig(policy, 1, placement)
    prof = _with_frontend(PROFILE, frontend_s)         # (engine.frontend_s: each request's way in)
    fast = run_fleet([prof] * n, cond, trace, sc, [1.0] * n, rc)
    slow = run_fleet([prof] * n, cond, trace, sc, [1.0] * n, rc, fast_forward=False)
    assert golden.differences(_no_step_events(fast), _no_step_events(slow)) == []


def test_with_call_affinity_and_sidecars_a_replica_runs_as_one_engine_on_its_calls(tiny3):
    """No retries, a sidecar per replica and call affinity: nothing one
    replica does reaches another, so each runs as a single engine fed only
    the calls it is home to, step event for step event (another replica's
    arrivals do not cut its fast-forwards)."""
    caps, trace = tiny3
    cond = compose("no-retry+cancel")
    n = 3
    router = Router(RouterConfig("call-affinity"), n)
    home = np.array([router.home(c) for c in range(len(trace))])
    log = simulate_fleet([PROFILE] * n, trace, cond, TINY, RouterConfig("call-affinity", 0, "replica"))
    assert (log.call_replica == home).all()
    for r in range(n):
        mine = np.flatnonzero(home == r)
        sub = Trace(trace.arrival[mine], trace.prompt_len[mine], trace.max_tokens[mine], trace.shared_prefix)
        single = simulate(PROFILE, sub, cond, TINY)
        rl = log.replicas[r]
        assert rl.engine == single.engine and rl.counters == single.counters
        assert rl.extra["step_events"] == single.extra["step_events"]
        assert rl.extra["busy_s"] == pytest.approx(single.extra["busy_s"], rel=1e-12)   # a sum of step times
        assert [(e.call, e.fate, e.first_token_at, e.finished_at, e.tokens_generated) for e in rl.executions] == \
            [(int(mine[e.call]), e.fate, e.first_token_at, e.finished_at, e.tokens_generated)
             for e in single.executions]
    assert sum(rl.extra["step_events"] for rl in log.replicas) == log.fleet.extra["step_events"]


# ----------------------------------------------------------------- conservation
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "call-affinity"])
def test_calls_attempts_and_executions_are_conserved_across_replicas(tiny3, policy, placement):
    caps, trace = tiny3
    cond = compose("deadline-check", engine_cap=8)
    rec = run_fleet([PROFILE] * 3, cond, trace, TINY, caps, RouterConfig(policy, 1, placement))
    f, reps = rec["fleet"], rec["replicas"]
    assert sum(f["calls"]) + f["calls_unrouted"] == len(trace)
    for cohort in ("pulse", "hold", "primary"):
        for k in ("offered", "delivered", "within_deadline"):
            assert sum(r["cohorts"][cohort][k] for r in reps) <= rec["cohorts"][cohort][k]
        assert sum(r["cohorts"][cohort]["offered"] for r in reps) >= \
            rec["cohorts"][cohort]["offered"] - f["calls_unrouted"]
    assert sum(f["attempts_landed"]) == sum(r["attempts"]["sent"] for r in reps) <= rec["attempts"]["sent"]
    placed = sum(r["executions"]["created"] for r in reps)
    assert placed <= rec["executions"]["created"]
    assert sum(r["counters"]["prompt_tokens_total"] for r in reps) == rec["counters"]["prompt_tokens_total"]
    assert sum(r["engine"]["steps"] for r in reps) == rec["engine"]["steps"]
    if placement == "replica":       # every attempt lands and every execution is placed
        assert f["calls_unrouted"] == 0 and sum(f["attempts_landed"]) == rec["attempts"]["sent"]
        assert placed == rec["executions"]["created"]
        for cohort in ("pulse", "hold"):
            assert sum(r["cohorts"][cohort]["offered"] for r in reps) == rec["cohorts"][cohort]["offered"]
    assert all(0 <= h <= 1 for h in f["prefix_hit_share"] if h is not None)


# -------------------------------------------------------------- split calls
def live_intervals(log):
    """(call, replica, start, stop) of every placed execution, recomputed
    from the records alone."""
    out = []
    for e in log.fleet.executions:
        r = int(log.execution_replica[e.id])
        start = float(log.execution_placed[e.id])
        ends = [x for x in (e.finished_at, e.cancel_requested_at) if x == x]
        stop = min(ends) if ends else log.fleet.end_time
        if r >= 0 and stop > start:
            out.append((e.call, r, start, stop))
    return out


def split_by_hand(log) -> int:
    iv = live_intervals(log)
    calls = set()
    for i, (c, r, a, b) in enumerate(iv):
        for c2, r2, a2, b2 in iv[i + 1:]:
            if c == c2 and r != r2 and a < b2 and a2 < b:
                calls.add(c)
    return len(calls)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case, deadline=st.sampled_from([0.15, 0.4, 1.5]), n=st.integers(2, 4),
       placement=st.sampled_from(PLACEMENTS), retries=st.integers(0, 2),
       cancel=st.sampled_from(["off", "now", "deferred:0.3"]), engine_cap=st.sampled_from([0, 1, 3]),
       queue=st.sampled_from([None, "deadline"]))
@example(case=([1.0, 1.5, 1.5, 1.5, 1.5, 1.25], [300] * 6, [138, 143, 5, 5, 5, 5]), deadline=0.15, n=2,
         placement="replica", retries=1, cancel="off", engine_cap=1, queue=None)   # moved by the router on 503
def test_call_affinity_with_coalescing_never_splits_a_call(case, deadline, n, placement, retries, cancel,
                                                           engine_cap, queue):
    trace, sc = small_case(*case, deadline)
    cond = compose("no-control", coalesce=True, cancel=cancel, engine_cap=engine_cap,
                   **({"proxy_cap": 2, "queue": queue} if queue else {}))
    log = simulate_fleet([PROFILE] * n, trace, cond, sc, RouterConfig("call-affinity", retries, placement))
    assert split_by_hand(log) == 0
    rec = run_fleet([PROFILE] * n, cond, trace, sc, [1.0] * n, RouterConfig("call-affinity", retries, placement))
    assert rec["fleet"]["split_calls"] == 0
    assert sum(rec["fleet"]["calls"]) + rec["fleet"]["calls_unrouted"] == len(trace)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case, n=st.integers(2, 4), placement=st.sampled_from(PLACEMENTS),
       policy=st.sampled_from(["round-robin", "least-outstanding", "least-kv"]))
def test_the_record_counts_split_calls_as_the_records_show_them(case, n, placement, policy):
    trace, sc = small_case(*case, 0.3)
    log = simulate_fleet([PROFILE] * n, trace, compose("no-control"), sc, RouterConfig(policy, 0, placement))
    from sim.fleet import split_calls
    assert split_calls(log) == split_by_hand(log)


def test_split_calls_compared_at_once_or_pair_by_pair_agree(tiny3, monkeypatch):
    import sim.fleet as fleet_module
    caps, trace = tiny3
    log = simulate_fleet([PROFILE] * 3, trace, compose("no-control"), TINY, RouterConfig("round-robin"))
    at_once = fleet_module.split_calls(log)
    monkeypatch.setattr(fleet_module, "_PAIRWISE", 1)
    assert at_once == fleet_module.split_calls(log) == split_by_hand(log) > 0


def test_without_affinity_a_call_can_run_on_two_replicas(tiny3):
    caps, trace = tiny3
    for placement in PLACEMENTS:
        rec = run_fleet([PROFILE] * 3, "no-control", trace, TINY, caps, RouterConfig("round-robin", 0, placement))
        assert rec["fleet"]["split_calls"] > 0 and rec["fleet"]["attempts_moved"] > 0
        aff = run_fleet([PROFILE] * 3, compose("no-control", coalesce=True), trace, TINY, caps,
                        RouterConfig("call-affinity", 0, placement))
        assert aff["fleet"]["split_calls"] == 0 and aff["fleet"]["attempts_moved"] == 0


# ------------------------------------------------------------------- router
def test_router_policies_pick_as_documented():
    rr = Router(RouterConfig("round-robin"), 3)
    assert [rr.pick(i) for i in range(5)] == [0, 1, 2, 0, 1]
    assert rr.pick(9, exclude=[2]) == 0
    views = {0: ReplicaView(5, 0.9), 1: ReplicaView(2, 0.1), 2: ReplicaView(2, 0.5)}
    lo = Router(RouterConfig("least-outstanding"), 3, view=views.__getitem__)
    assert lo.pick(0) == 1 and lo.pick(0, exclude=[1]) == 2
    kv = Router(RouterConfig("least-kv"), 3, view=views.__getitem__)
    assert kv.pick(0) == 1 and kv.pick(0, exclude=[1]) == 2
    pa = Router(RouterConfig("prefix-affinity"), 4, prefix_group=lambda c: c % 2)
    assert pa.pick(0) == pa.pick(2) and pa.pick(1) == pa.pick(3)
    ca = Router(RouterConfig("call-affinity", retries=1), 4)
    assert ca.home(7) == ca.home(7) and ca.last == {}         # home reads and changes nothing
    home = ca.pick(7)
    assert ca.home(7) == home
    assert ca.pick(7) == home
    moved = ca.pick(7, exclude=[home])
    assert moved != home and ca.pick(7) == moved          # a retry follows the call's last replica
    assert ca.may_retry([home]) and not ca.may_retry([home, moved])
    assert ca.home(7) == moved and pa.home(2) == pa.pick(2)
    assert rr.home(0) is None and lo.home(0) is None and kv.home(0) is None   # their pick depends on the moment
    assert Router(RouterConfig("least-kv"), 1).home(5) == 0
    with pytest.raises(ValueError, match="router must be one of"):
        RouterConfig("random")


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5), steps=st.lists(st.tuples(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.25, 0.5, 1.0])), min_size=5, max_size=5),
    st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6))
def test_least_routers_pick_the_first_least_in_pointer_order(n, steps):
    """least-kv picks the first replica, in the pointer's order, with the
    least (KV usage, outstanding); least-outstanding the least outstanding;
    the same with the driver's own field readers as with `view` alone."""
    for policy, key in (("least-kv", lambda v: (v.kv_usage, v.outstanding)), ("least-outstanding",
                                                                             lambda v: v.outstanding)):
        state = {}
        by_view = Router(RouterConfig(policy, retries=4), n, view=lambda r: state[r])
        by_field = Router(RouterConfig(policy, retries=4), n, view=lambda r: state[r],
                          outstanding=lambda r: state[r].outstanding, kv_usage=lambda r: state[r].kv_usage)
        for views, exclude in steps:
            state.update({r: ReplicaView(*views[r]) for r in range(n)})
            exclude = sorted({x for x in exclude if x < n})[:n - 1]
            order = [r for r in list(range(by_view.next, n)) + list(range(by_view.next)) if r not in exclude]
            least = min(key(state[r]) for r in order)
            want = next(r for r in order if key(state[r]) == least)
            assert by_view.pick(0, exclude) == want and by_field.pick(0, exclude) == want


# ---------------------------------------------------------- scenario files
FLEET_TOML = """name = "f"
[model]
profile = "vllm-cpu-tiny"
[workload]
phases = [{name = "base", duration_s = 7.5, load = 0.6}, {name = "pulse", duration_s = 6.7, load = 2.7},
          {name = "hold", duration_s = 45.0, load = 0.6}]
prompt = {dist = "normal", mean = 3600.0, sd = 360.0}
response = {dist = "lognormal", median = 90.0, mean = 120.0}
shared_prefix = 600
[client]
deadline_s = 7.5
[measures]
burst = "pulse"
window_s = 3.75
[fleet]
"""


def test_fleet_section_round_trips_and_runs(tmp_path, capsys):
    f = tmp_path / "f.toml"
    f.write_text(FLEET_TOML + 'replicas = 2\nrouter = "call-affinity"\nrouter_retries = 1\nproxy = "replica"\n')
    dep = load(str(f))
    assert dep.fleet.replicas == 2 and dep.fleet.router == RouterConfig("call-affinity", 1, "replica")
    assert dep.capacity == pytest.approx(2 * load(str(f)).fleet.capacities(dep.scenario)[0], rel=1e-12)
    g = tmp_path / "g.toml"
    g.write_text(dep.to_toml())
    assert load(str(g)).content_hash == dep.content_hash
    out, png = tmp_path / "r.json", tmp_path / "q.png"
    assert main(["run", "--scenario", str(f), "--json", str(out), "--queues-png", str(png)]) == 0
    rec = json.load(open(out))
    assert len(rec["replicas"]) == 2 and rec["fleet"]["router"] == "call-affinity"
    assert rec["deployment"]["content_hash"] == dep.content_hash
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "replica 1" in capsys.readouterr().out


def test_diagnose_runs_a_fleet(tmp_path, capsys):
    f = tmp_path / "f.toml"
    f.write_text(FLEET_TOML + 'replicas = 2\nrouter = "least-kv"\n')
    out = tmp_path / "d.json"
    assert main(["diagnose", "--scenario", str(f), "--seed", "0", "--json", str(out)]) == 0
    runs = json.load(open(out))["runs"]
    assert [r["condition"] for r in runs] == ["no-control", "cancel", "no-retry+cancel", "no-retry"]
    assert all(len(r["replicas"]) == 2 and r["fleet"]["router"] == "least-kv" for r in runs)
    assert all(r["fleet"]["split_calls"] == 0 for r in runs if r["condition_settings"]["cancellation"] == "now")
    assert "replica 1" in capsys.readouterr().out


@pytest.mark.parametrize("body, words", [
    ('router = "random"\n', ("fleet.router", "call-affinity")),
    ("replicas = 0\n", ("fleet.replicas",)),
    ('replicas = 2\nprofiles = ["vllm-cpu-tiny"]\n', ("fleet.profiles", "one per replica")),
    ('proxy = "sidecar"\n', ("fleet.proxy", "replica")),
    ("router_retries = -1\n", ("fleet.router_retries",)),
    ("replica = 2\n", ("fleet.replica", "replicas")),
    ('profiles = ["no-such-profile"]\n', ("fleet.profiles",)),
])
def test_bad_fleet_section_is_one_line_and_exit_2(tmp_path, capsys, body, words):
    f = tmp_path / "bad.toml"
    f.write_text(FLEET_TOML + body)
    out = tmp_path / "r.json"
    assert main(["run", "--scenario", str(f), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for w in words:
        assert w in err
    assert not os.path.exists(out)


def test_queues_figure_needs_a_fleet(tmp_path, capsys):
    png = tmp_path / "q.png"
    assert main(["run", "--scenario", "cpu-tiny", "--queues-png", str(png)]) == 2
    assert "[fleet]" in capsys.readouterr().err and not png.exists()


def _one_replica_and_single(tmp_path, router: str):
    """Two scenario files of FLEET_TOML's deployment: a fleet of one replica
    behind `router`, and the single engine (no [fleet])."""
    one, single = tmp_path / "one.toml", tmp_path / "single.toml"
    one.write_text(FLEET_TOML + f'replicas = 1\nrouter = "{router}"\n')
    single.write_text(FLEET_TOML.replace("[fleet]\n", ""))
    return one, single


def test_margin_of_a_fleet_of_one_is_the_single_engines_and_perturbs_every_replica(tmp_path, monkeypatch):
    """`llmsim margin` on a fleet: a fleet of one replica gives the single
    engine's margin (the same probes, P and crossing); on two replicas a
    probe of the speed axis runs the fleet with every replica's step times
    scaled by the probe's factor (the runs' tasks are read as they are
    handed to the workers)."""
    import dataclasses

    from sim import verdict
    from sim.experiments.margin import margin
    one, single = _one_replica_and_single(tmp_path, "round-robin")
    recs = []
    for f in (one, single):
        out = tmp_path / (f.stem + ".json")
        assert main(["margin", "--scenario", str(f), "--condition", "cancel", "--seeds", "3", "--axes", "speed",
                     "--workers", "1", "--quiet", "--json", str(out)]) == 0
        recs.append(json.loads(out.read_text()))
    fl, sg = recs
    assert fl["fleet"]["replicas"] == 1 and "fleet" not in sg
    fa, sa = fl["axes"][0], sg["axes"][0]
    assert [(p["x"], p["p"]) for p in fa["probes"]] == [(p["x"], p["p"]) for p in sa["probes"]]
    assert len(fa["probes"]) > 2 and (fa["crossing"] is None) == (sa["crossing"] is None)
    if fa["crossing"] is not None:
        assert fa["crossing"] == pytest.approx(sa["crossing"], rel=1e-12)

    two = tmp_path / "two.toml"
    two.write_text(FLEET_TOML + 'replicas = 2\nrouter = "call-affinity"\nproxy = "replica"\n')
    dep = load(str(two))
    prof = dataclasses.replace(dep.profile, capacity=dep.capacity)
    cond = dep.condition_for("cancel")
    from sim.experiments import margin as margin_mod
    seen = []
    run_many = margin_mod.run_many

    def spy(tasks, *a, **k):
        seen.extend(tasks)
        return run_many(tasks, *a, **k)
    monkeypatch.setattr(margin_mod, "run_many", spy)
    res = margin(prof, dep.scenario, cond, [0, 1], ["speed"], fleet=dep.fleet)
    xs = [p["x"] for p in res["axes"][0]["probes"]]
    assert len(xs) > 2 and len(seen) == 2 * len(xs)
    base_fixed = [p.step_time.fixed_s for p in dep.fleet.profiles]
    for i, x in enumerate(xs):                            # the probes' runs, two seeds each, in probe order
        for task in seen[2 * i:2 * i + 2]:
            profiles, caps, router = task[5]
            assert [q.step_time.fixed_s for q in profiles] == pytest.approx([f * x for f in base_fixed], rel=1e-12)
            assert router == dep.fleet.router and task[4] == pytest.approx(dep.capacity, rel=1e-12)
    runs = [dep.run(s, cond, trace=dep.trace(s)) for s in (0, 1)]
    assert res["baseline"]["p"] == verdict.summarize(runs)["p"]


def test_phase_map_of_a_fleet_of_one_is_the_single_engines(tmp_path):
    """`llmsim map` on a fleet: one replica gives the single engine's map."""
    import pyarrow.parquet as pq
    one, single = _one_replica_and_single(tmp_path, "least-kv")
    tables = []
    for f in (one, single):
        out = tmp_path / (f.stem + ".parquet")
        assert main(["map", "--scenario", str(f), "--condition", "cancel", "--x", "speed=0.8,1.6",
                     "--y", "hold_load=0.4,0.8", "--seeds", "2", "--workers", "1", "--quiet", "--out", str(out)]) == 0
        tables.append(pq.read_table(out).to_pylist())
    a, b = tables
    assert len(a) == 4 and [(r["x"], r["y"], r["p"]) for r in a] == [(r["x"], r["y"], r["p"]) for r in b]
    assert [r["hold_within_deadline_median"] for r in a] == pytest.approx(
        [r["hold_within_deadline_median"] for r in b], rel=1e-12)
    assert len({r["p"] for r in a}) > 1 or len({r["hold_within_deadline_median"] for r in a}) > 1


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_replica_records_from_the_fleets_columns_are_those_of_their_records(tiny3, placement):
    """A replica's executions are a slice of the fleet's, their columns cut
    from the fleet's; the result record measured from them is the one
    measured from the records."""
    import dataclasses

    from sim import measures
    from sim.fleet import replica_log
    from sim.runlog import ExecutionTable, column
    caps, trace = tiny3
    log = simulate_fleet([PROFILE] * 3, trace, compose("cancel"), TINY, RouterConfig("least-outstanding", 1, placement))
    logs = [log.fleet] + log.replicas
    assert sum(len(rl.executions) for rl in log.replicas) == int((log.execution_replica >= 0).sum())
    for r, rl in enumerate(log.replicas):
        again = replica_log(log.fleet, r, log.attempt_replica, log.execution_replica, log.call_replica, rl.series,
                            rl.counters, rl.counters_at, rl.engine, rl.extra)
        assert list(again.executions) == list(rl.executions)
    for rl in logs:
        ex = rl.executions
        for name, _, _ in ExecutionTable.FIELDS:       # the columns cut from the fleet's are the records'
            col, read = column(ex, name), column(list(ex), name)
            assert col.dtype == read.dtype and np.array_equal(col, read, equal_nan=col.dtype.kind == "f"), name
        plain = dataclasses.replace(rl, executions=list(ex))
        a = measures.record(rl, TINY, caps[0], {})
        b = measures.record(plain, TINY, caps[0], {})
        assert golden.differences(a, b) == [] and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
