"""The autoscaler: the HPA's rule as documented (ratio, tolerance, replicas
without a metric, stabilisation windows, scaling policies, bounds); a fleet
whose autoscaler has min == max is the fixed fleet; replicas stay within
their bounds, take no call before their provisioning delay has passed nor
while off or draining, and a drain loses no call; [autoscaler] in scenario
files."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import golden
from llmsim.cli import main
from sim.autoscale import DRAINING, OFF, READY
from sim.conditions import compose
from sim.deployment import load
from sim.fleet import run_fleet, simulate_fleet
from sim.policy.autoscaler import Autoscaler, AutoscalerConfig, ProvisioningDelay, ScalingDriver
from sim.policy.router import ROUTERS, Router, RouterConfig
from sim.profile import load_profile
from sim.runlog import CALL_OUTCOMES, column
from sim.scenario import SCENARIOS
from sim.workload import Trace, make_trace

TINY = SCENARIOS["cpu-tiny"].scenario
PROFILE = load_profile("vllm-cpu-tiny")


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("LLMSIM_CACHE_DIR", "")


@pytest.fixture(scope="module")
def tiny3():
    cap = load("cpu-tiny").capacity
    return [cap] * 3, make_trace(3 * cap, TINY, 0)


# ------------------------------------------------------------- the HPA rule
def hpa(**kw) -> Autoscaler:
    return Autoscaler(AutoscalerConfig(**{"min_replicas": 1, "max_replicas": 20, **kw}))


def test_desired_is_the_ceiling_of_current_times_the_ratio():
    a = hpa(target=10.0)
    # 3 ready replicas averaging 15 against 10: ceil(3 x 1.5) = 5
    assert a.decide(0.0, [10.0, 15.0, 20.0], 3, 0) == 5
    # proxy_queue is one total against target x current replicas: 50 / (10 x 2) -> ceil(2 x 2.5) = 5
    assert hpa(metric="proxy_queue", target=10.0).decide(0.0, [50.0], 2, 0) == 5


@pytest.mark.parametrize("avg, stays", [(10.9, True), (9.1, True), (11.2, False), (7.0, False)])
def test_within_the_tolerance_the_count_stays(avg, stays):
    a = hpa(target=10.0, scale_down_stabilization_s=0.0)
    n = a.decide(0.0, [avg] * 4, 4, 0)
    assert (n == 4) == stays


def test_replicas_starting_count_as_using_nothing_on_a_scale_up():
    # 2 ready at 15 (target 10), 2 starting: over all 4 the ratio is 30/40 < 1: no change
    assert hpa(target=10.0).recommend([15.0, 15.0], 2, 2) == 4
    # 2 ready at 40, 1 starting: 80/(10 x 3) = 2.67 -> ceil(2.67 x 3) = 8
    assert hpa(target=10.0).recommend([40.0, 40.0], 2, 1) == 8


def test_scale_down_waits_out_its_stabilisation_window():
    a = hpa(target=10.0)                    # default: 300 s
    assert a.decide(0.0, [30.0], 1, 0) == 3
    for t in range(15, 300, 15):            # the load gone: the highest recommendation of 300 s holds
        assert a.decide(float(t), [0.0, 0.0, 0.0], 3, 0) == 3
    assert a.decide(315.0, [0.0, 0.0, 0.0], 3, 0) == 1


def test_scale_up_is_limited_by_the_default_policies():
    # max(+100 %, +4) per 15 s: from 2, 6 at most; from 10, 20
    assert hpa(target=1.0, max_replicas=100).decide(0.0, [50.0, 50.0], 2, 0) == 6
    a = hpa(target=1.0, max_replicas=100)
    assert a.decide(0.0, [100.0] * 10, 10, 0) == 20
    # within the same period the replicas added count against the limit
    assert a.decide(10.0, [100.0] * 10, 10, 10) == 20
    assert a.decide(15.0, [100.0] * 20, 20, 0) == 40


def test_the_count_stays_within_min_and_max():
    assert hpa(target=1.0, max_replicas=3).decide(0.0, [100.0], 1, 0) == 3
    a = hpa(target=10.0, min_replicas=2, scale_down_stabilization_s=0.0)
    assert a.decide(0.0, [0.0] * 5, 5, 0) == 2


def test_provisioning_delays_are_drawn_from_their_distribution():
    rng = np.random.default_rng(0)
    u = ProvisioningDelay(AutoscalerConfig(provisioning="uniform", provisioning_s=60.0, provisioning_max_s=90.0), rng)
    xs = [u.draw() for _ in range(200)]
    assert all(60.0 <= x <= 90.0 for x in xs) and max(xs) - min(xs) > 15.0
    ln = ProvisioningDelay(AutoscalerConfig(provisioning="lognormal", provisioning_s=100.0,
                                            provisioning_sigma=0.3), np.random.default_rng(1))
    ys = np.array([ln.draw() for _ in range(2000)])
    assert 90.0 < np.median(ys) < 110.0 and (ys > 0).all()
    assert ProvisioningDelay(AutoscalerConfig(provisioning_s=42.0), rng).draw() == 42.0


def test_the_router_picks_among_ready_replicas_only():
    for policy in ROUTERS:
        r = Router(RouterConfig(policy, 2), 4)
        r.ready = [True, False, True, False]
        picks = {r.pick(c) for c in range(40)}
        assert picks <= {0, 2}, policy
        assert r.pick(7, exclude=[0]) == 2
        assert not r.may_retry([0, 2])


class _Driver(ScalingDriver):
    """A driver on no clock: the test says the time, the readings and when a started replica is ready."""

    def __init__(self, config, waiting):
        super().__init__(config)
        self.router = Router(RouterConfig("round-robin", 2), config.max_replicas)
        self.waiting_on, self.held_on, self.did = waiting, [0] * config.max_replicas, []

    def waiting(self, r):
        return self.waiting_on[r]

    def held(self, r):
        return self.held_on[r]

    def start(self, t, r):
        self.did.append(("start", t, r))

    def drain(self, t, r):
        self.did.append(("drain", t, r, self.router.ready[r]))

    def stopped(self, t, r):
        self.did.append(("stopped", t, r))


def test_the_driver_logic_starts_masks_drains_and_stops_a_replica_once_empty():
    cfg = AutoscalerConfig(target=4.0, min_replicas=1, max_replicas=3, scale_down_stabilization_s=0.0)
    d = _Driver(cfg, waiting=[12.0, 0.0, 0.0])
    d.apply_mask()
    assert d.router.ready == [True, False, False]
    d.sync(15.0)                         # 12 waiting on one replica at target 4: three replicas
    assert d.did == [("start", 15.0, 1), ("start", 15.0, 2)] and d.router.ready == [True, False, False]
    d.became_ready(40.0, 1)
    d.became_ready(41.0, 2)
    assert d.router.ready is None        # every replica ready: no mask
    d.waiting_on, d.held_on = [0.0, 0.0, 0.0], [0, 0, 2]
    d.did.clear()
    d.sync(45.0)                         # nothing waiting: down to one, replica 2 holds two requests
    assert d.did == [("drain", 45.0, 2, False), ("drain", 45.0, 1, False), ("stopped", 45.0, 1)]
    assert d.replicas.state == [READY, OFF, DRAINING] and d.router.ready == [True, False, False]
    d.held_on[2] = 0
    d.did.clear()
    d.sync(60.0)
    assert d.did == [("stopped", 60.0, 2)] and d.replicas.state == [READY, OFF, OFF]
    assert d.replicas.counts[-1] == (60.0, 1, 0, 0)


# ------------------------------------------------------ min == max: fixed
FIXED_CASES = [("round-robin", "deployment", "cancel"), ("least-outstanding", "deployment", "no-control"),
               ("least-kv", "replica", "cancel"), ("call-affinity", "replica", "no-control"),
               ("prefix-affinity", "replica", "coalesce")]


@pytest.mark.parametrize("policy, placement, cond", FIXED_CASES)
def test_min_equal_to_max_gives_the_fixed_fleets_record(tiny3, policy, placement, cond):
    caps, trace = tiny3
    rc = RouterConfig(policy, 1, placement)
    fixed = run_fleet([PROFILE] * 3, compose(cond), trace, TINY, caps, rc)
    scaled = run_fleet([PROFILE] * 3, compose(cond), trace, TINY, caps, rc,
                       autoscaler=AutoscalerConfig(min_replicas=3, max_replicas=3, target=0.5))
    a = scaled.pop("autoscaler")
    assert golden.differences({k: v for k, v in fixed.items() if k != "wall_s"},
                              {k: v for k, v in scaled.items() if k != "wall_s"}) == []
    assert a["scale_ups"] == [] and a["replicas"]["ready"] == [3]
    assert a["replica_seconds"] == pytest.approx(3 * fixed["end_time"], rel=1e-12)


# ------------------------------------------------------------- scaling runs
def scaled_run(trace, sc, cond, rc, cfg, seed=0):
    log = simulate_fleet([PROFILE] * cfg.max_replicas, trace, cond, sc, rc, seed, autoscaler=cfg)
    return log


def check_invariants(log, cfg):
    """Replicas within [min, max]; calls placed on a replica only while it
    is ready (never before its provisioning delay, never while off or
    draining); every call over once."""
    sc = log.scaling
    ready, starting = np.array(sc.counts)[:, 1], np.array(sc.counts)[:, 2]
    assert ((ready + starting) <= cfg.max_replicas).all() and ((ready + starting) >= cfg.min_replicas).all()
    assert (ready >= 1).all()
    rep, placed = log.execution_replica, log.execution_placed
    for r in range(cfg.max_replicas):
        lives = [(lf.ready_at, lf.stopped_at if lf.stopped_at is not None else np.inf)
                 for lf in sc.lives if lf.replica == r and lf.ready_at is not None]
        for p in placed[(rep == r) & ~np.isnan(placed)]:
            assert any(a <= p <= b for a, b in lives), (r, p, lives)
    for lf in sc.lives:
        if lf.ready_at is not None:
            assert lf.ready_at - lf.decided_at >= 0.0
    # every call ended (delivered or failed: no outcome left unset), each once
    outcome = column(log.fleet.calls, "outcome")
    assert (outcome != CALL_OUTCOMES.index("")).all()
    ids = column(log.fleet.calls, "id")
    assert sorted(ids.tolist()) == list(range(len(ids)))
    # and each on the replica that got it first, once
    assert sum((log.call_replica == r).sum() for r in range(cfg.max_replicas)) == (log.call_replica >= 0).sum()


def burst_case(n_base, n_burst, prompts, outputs):
    base = np.linspace(0.0, 20.0, n_base, endpoint=False)
    burst = np.linspace(20.0, 25.0, n_burst, endpoint=False)
    hold = np.linspace(25.0, 80.0, n_base)
    arrival = np.concatenate([base, burst, hold])
    n = len(arrival)
    pl = np.resize(np.asarray(prompts, dtype=np.int64), n)
    ot = np.resize(np.asarray(outputs, dtype=np.int64), n)
    trace = Trace(arrival, pl, ot, 100)
    sc = TINY.with_(base_s=20.0, pulse_s=5.0, hold_s=55.0, deadline_s=8.0, delivery_horizon_s=60.0,
                    primary_skip_s=8.0, window_s=5.0)
    return trace, sc


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_base=st.integers(4, 12), n_burst=st.integers(10, 40),
       prompts=st.lists(st.integers(3000, 12000), min_size=1, max_size=5),
       outputs=st.lists(st.integers(20, 200), min_size=1, max_size=5),
       policy=st.sampled_from(ROUTERS), placement=st.sampled_from(("deployment", "replica")),
       cond=st.sampled_from(["no-control", "cancel", "coalesce", "proxy-cap"]),
       drain=st.sampled_from(["finish", "cancel"]), metric=st.sampled_from(["waiting", "in_flight", "kv",
                                                                            "proxy_queue"]),
       provisioning=st.sampled_from([("fixed", 3.0, None), ("uniform", 1.0, 9.0), ("lognormal", 4.0, None)]),
       maxr=st.integers(2, 4), seed=st.integers(0, 3))
def test_replicas_stay_in_bounds_take_no_call_before_ready_and_drains_lose_none(
        n_base, n_burst, prompts, outputs, policy, placement, cond, drain, metric, provisioning, maxr, seed):
    trace, sc = burst_case(n_base, n_burst, prompts, outputs)
    kind, lo, hi = provisioning
    target = {"kv": 0.2, "proxy_queue": 1.0}.get(metric, 1.0)
    # a heavy enough burst that about half the cases scale up (and most of those back down)
    cfg = AutoscalerConfig(metric=metric, target=target, min_replicas=1, max_replicas=maxr, sync_period_s=1.0,
                           scale_down_stabilization_s=6.0, provisioning=kind, provisioning_s=lo,
                           provisioning_max_s=hi, drain=drain)
    cnd = compose(cond, proxy_cap=2) if cond == "proxy-cap" else compose(cond)
    log = scaled_run(trace, sc, cnd, RouterConfig(policy, 1, placement), cfg, seed)
    check_invariants(log, cfg)


def test_a_burst_scales_up_and_the_hold_scales_back_down(tiny3):
    trace, sc = burst_case(10, 60, [1500], [40])
    cfg = AutoscalerConfig(metric="in_flight", target=2.0, max_replicas=3, sync_period_s=2.0,
                           scale_down_stabilization_s=10.0, provisioning_s=5.0)
    log = scaled_run(trace, sc, compose("cancel"), RouterConfig("least-outstanding"), cfg)
    check_invariants(log, cfg)
    counts = np.array(log.scaling.counts)
    assert counts[:, 1].max() > 1                   # more replicas came up
    assert counts[-1, 1] < counts[:, 1].max()       # and went again
    from sim.fleet import fleet_record
    rec = fleet_record(log, sc, [1.0] * 3, {})
    a = rec["autoscaler"]
    assert a["scale_ups"] and a["scale_ups"][0]["since_burst_s"] >= 0.0
    started = [s for s in a["started"] if s["first_call_at"] is not None]
    assert started and all(s["first_call_at"] >= s["ready_at"] >= s["decided_at"] + 5.0 - 1e-9 for s in started)
    # replica-seconds: more than the one replica's, less than the maximum's
    assert log.fleet.end_time < a["replica_seconds"] < 3 * log.fleet.end_time


def test_a_drain_that_cancels_ends_running_requests_and_loses_no_call():
    trace, sc = burst_case(10, 60, [1500], [60])
    cfg = AutoscalerConfig(metric="in_flight", target=2.0, max_replicas=3, sync_period_s=2.0,
                           scale_down_stabilization_s=2.0, provisioning_s=2.0, drain="cancel")
    log = scaled_run(trace, sc, compose("no-control"), RouterConfig("round-robin"), cfg)
    check_invariants(log, cfg)
    assert any(s.stopped_at is not None for s in log.scaling.lives)
    assert log.scaling.state.count(READY) + log.scaling.state.count(DRAINING) >= 1


def test_the_same_seed_scales_the_same_way():
    trace, sc = burst_case(8, 40, [1200], [30])
    cfg = AutoscalerConfig(metric="in_flight", target=2.0, max_replicas=3, sync_period_s=2.0, provisioning="lognormal",
                           provisioning_s=4.0, provisioning_sigma=0.5)
    a = scaled_run(trace, sc, compose("cancel"), RouterConfig(), cfg, seed=1)
    b = scaled_run(trace, sc, compose("cancel"), RouterConfig(), cfg, seed=1)
    assert ([(x.decided_at, x.ready_at) for x in a.scaling.lives]
            == [(x.decided_at, x.ready_at) for x in b.scaling.lives])


# ---------------------------------------------------------------- scenarios
AUTOSCALED_TOML = """name = "as"
[model]
profile = "vllm-cpu-tiny"
[workload]
phases = [
  { name = "base", duration_s = 30.0, load = 0.6 },
  { name = "pulse", duration_s = 20.0, load = 2.5 },
  { name = "hold", duration_s = 60.0, load = 0.6 },
]
[client]
deadline_s = 20.0
max_retries = 2
[proxy]
condition = "cancel"
[measures]
burst = "pulse"
[autoscaler]
"""


def test_autoscaler_section_round_trips_and_runs(tmp_path, capsys):
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + 'max_replicas = 3\ntarget = 4.0\nprovisioning_s = 10.0\nsync_period_s = 5.0\n')
    dep = load(str(f))
    assert dep.fleet.replicas == 3 and dep.fleet.autoscaler.max_replicas == 3
    # loads are multiples of the Ĉ of the replicas the autoscaler starts with
    assert dep.capacity == pytest.approx(dep.fleet.capacities(dep.scenario)[0], rel=1e-12)
    g = tmp_path / "g.toml"
    g.write_text(dep.to_toml())
    assert load(str(g)).content_hash == dep.content_hash
    out = tmp_path / "r.json"
    assert main(["run", "--scenario", str(f), "--json", str(out)]) == 0
    rec = json.load(open(out))
    assert rec["autoscaler"]["max_replicas"] == 3 and rec["autoscaler"]["scale_ups"]
    assert "autoscaler" in capsys.readouterr().out


@pytest.mark.parametrize("body, words", [
    ('metric = "cpu"\n', ("autoscaler.metric", "waiting")),
    ("target = 0\n", ("autoscaler.target",)),
    ("min_replicas = 3\nmax_replicas = 2\n", ("autoscaler.max_replicas", "min_replicas")),
    ("max_replicas = 2\ninitial_replicas = 3\n", ("autoscaler.initial_replicas",)),
    ('provisioning = "uniform"\n', ("autoscaler.provisioning_max_s", "missing")),
    ("provisioning_s = 50\nprovisioning_max_s = 10\n", ("autoscaler.provisioning_max_s",)),
    ('drain = "kill"\n', ("autoscaler.drain", "cancel")),
    ("sync_period = 15\n", ("autoscaler.sync_period", "sync_period_s")),
    ("max_replicas = 3\n[fleet]\nreplicas = 2\n", ("fleet.replicas", "max_replicas")),
])
def test_bad_autoscaler_section_is_one_line_and_exit_2(tmp_path, capsys, body, words):
    f = tmp_path / "bad.toml"
    f.write_text(AUTOSCALED_TOML + body)
    out = tmp_path / "r.json"
    assert main(["run", "--scenario", str(f), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(f) in err
    for w in words:
        assert w in err
    assert not os.path.exists(out)


# ------------------------------------------------------------- questions
def test_margin_axes_change_the_autoscalers_provisioning_and_target():
    from sim.experiments.margin import AXIS
    cfg = AutoscalerConfig(provisioning="uniform", provisioning_s=60.0, provisioning_max_s=90.0, target=4.0)
    p = AXIS["provisioning"].scaler(cfg, 120.0)
    assert (p.provisioning_s, p.provisioning_max_s, p.target) == (120.0, 180.0, 4.0)
    t = AXIS["target"].scaler(cfg, 9.0)
    assert (t.target, t.provisioning_s) == (9.0, 60.0)
    assert AXIS["speed"].scaler(cfg, 2.0) is cfg


def test_margin_along_the_provisioning_delay_runs_each_probe_at_its_delay(tmp_path, monkeypatch):
    from sim.experiments import margin as margin_mod
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + "max_replicas = 3\ntarget = 2.0\nprovisioning_s = 5.0\nsync_period_s = 5.0\n"
                 'metric = "in_flight"\n')
    dep = load(str(f))
    seen = []
    real = margin_mod.run_task

    def spy(task, full=False):
        seen.append(task[5][3].provisioning_s)
        return real(task, full)
    monkeypatch.setattr(margin_mod, "run_task", spy)
    prof = __import__("dataclasses").replace(dep.profile, capacity=dep.capacity)
    res = margin_mod.margin(prof, dep.scenario, dep.condition_for("no-control"), [0], ["provisioning"],
                            rel_tol=0.2, workers=1, fleet=dep.fleet)
    ax = res["axes"][0]
    assert ax["axis"] == "provisioning" and ax["baseline"] == 5.0
    assert sorted(set(seen)) == sorted({p["x"] for p in ax["probes"]})


def test_margin_or_map_on_the_autoscaler_without_one_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["margin", "--scenario", "cpu-tiny", "--condition", "cancel", "--axes", "provisioning",
                 "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[autoscaler]" in err


def test_map_over_provisioning_and_burst_size(tmp_path):
    from sim.experiments import phasemap
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + "max_replicas = 2\ntarget = 2.0\nsync_period_s = 5.0\n")
    dep = load(str(f))
    prof = __import__("dataclasses").replace(dep.profile, capacity=dep.capacity)
    x, y = phasemap.parse_range("provisioning=5,200"), phasemap.parse_range("pulse=1.5,3")
    rows = phasemap.phase_map(prof, dep.scenario, dep.condition_for("cancel"), x, y, [0], workers=1,
                              fleet=dep.fleet)
    assert [(r["x"], r["y"]) for r in rows] == [(5.0, 1.5), (200.0, 1.5), (5.0, 3.0), (200.0, 3.0)]
    with pytest.raises(ValueError):
        phasemap.parse_range("provisioning=0,10")


def test_advise_rows_carry_replica_seconds(tmp_path):
    from sim.experiments.advise import _rows_task, score
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + "max_replicas = 2\ntarget = 2.0\nsync_period_s = 5.0\n")
    dep = load(str(f))
    prof = __import__("dataclasses").replace(dep.profile, capacity=dep.capacity)
    fl = dep.fleet
    fleet = (fl.profiles, fl.capacities(dep.scenario), fl.autoscaler)
    rows = _rows_task((prof, dep.scenario, fleet, "autoscaled", None,        # a key of its own: traces are kept per key
                       [(dep.condition_for("cancel"), fl.router, None, s) for s in (0, 1)]))
    rs = [r["autoscaler_replica_seconds"] for r in rows]
    assert all(r["end_time"] <= x <= 2 * r["end_time"] for r, x in zip(rows, rs))
    assert score(rows, "timely")["replica_seconds"] == pytest.approx(sum(rs) / 2)


def test_the_queues_figure_of_an_autoscaled_fleet(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + "max_replicas = 2\ntarget = 2.0\nsync_period_s = 5.0\n")
    png = tmp_path / "q.png"
    assert main(["run", "--scenario", str(f), "--queues-png", str(png)]) == 0
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _no_step_events(rec: dict) -> dict:
    out = {k: v for k, v in rec.items() if k not in ("wall_s", "extra", "replicas")}
    out["replicas"] = [{k: v for k, v in r.items() if k not in ("wall_s", "extra")} for r in rec["replicas"]]
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_burst=st.integers(10, 40), policy=st.sampled_from(ROUTERS),
       placement=st.sampled_from(("deployment", "replica")), cond=st.sampled_from(["no-control", "cancel",
                                                                                   "proxy-cap"]),
       drain=st.sampled_from(["finish", "cancel"]), metric=st.sampled_from(["in_flight", "kv"]))
# a replica just made ready and given a queued execution, whose finish dispatches the next one to another
@example(n_burst=10, policy="round-robin", placement="deployment", cond="proxy-cap", drain="finish", metric="in_flight")
def test_fast_forward_matches_stepping_while_replicas_come_and_go(n_burst, policy, placement, cond, drain, metric):
    """Replicas made ready and drained between the engines' steps: the
    timers' horizon and the engines' next input bound them as they must."""
    trace, sc = burst_case(8, n_burst, [4000, 9000], [40, 150])
    cfg = AutoscalerConfig(metric=metric, target={"kv": 0.2}.get(metric, 1.0), max_replicas=3, sync_period_s=1.0,
                           scale_down_stabilization_s=4.0, provisioning_s=3.0, drain=drain)
    cnd = compose(cond, proxy_cap=2) if cond == "proxy-cap" else compose(cond)
    rc = RouterConfig(policy, 1, placement)
    fast = run_fleet([PROFILE] * 3, cnd, trace, sc, [1.0] * 3, rc, autoscaler=cfg)
    slow = run_fleet([PROFILE] * 3, cnd, trace, sc, [1.0] * 3, rc, fast_forward=False, autoscaler=cfg)
    assert fast["autoscaler"]["scale_ups"] == slow["autoscaler"]["scale_ups"]
    assert golden.differences(_no_step_events(fast), _no_step_events(slow)) == []


def test_advise_searches_the_autoscalers_target_and_reports_replica_seconds(tmp_path):
    from sim.experiments import advise as A
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML + "max_replicas = 2\ntarget = 2.0\nsync_period_s = 5.0\nprovisioning_s = 10.0\n")
    dep = load(str(f))
    prof = __import__("dataclasses").replace(dep.profile, capacity=dep.capacity)
    res = A.advise(prof, dep.scenario, [0, 1], only="router", adapt=dep.condition_for, margin_axes=(),
                   progress=False, finalists=40, fleet=dep.fleet, base=dep.condition, screen_base_s=None,
                   screen_hold_s=None, out=str(tmp_path / "a.parquet"))
    names = [r["condition"] for r in res["ranking"]]
    # every router, and the scenario's controls under the target halved and doubled
    assert res["candidates"] == len(A.router_settings(dep.fleet)) + 2
    assert any(";autoscaler=target:" in n for n in names)
    assert all(r["replica_seconds"] > 0 for r in res["ranking"])
    assert res["autoscaler"]["target"] == 2.0
    for t in res["top"]:
        want = 2.0 if "autoscaler=" not in t["condition"] else float(t["condition"].rsplit(":", 1)[1])
        assert t["autoscaler"]["target"] == want
    assert "replica-seconds" in A.report(res)


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_an_autoscaled_fleet_runs_under_gateway_layers(tmp_path, placement):
    """The SDK above nginx above an autoscaled fleet: the replicas it starts
    take the gateway's upstream attempts, each of the gateway's 504s is an
    attempt's answer the SDK may retry, and fast-forward gives the stepped
    run's record."""
    f = tmp_path / "a.toml"
    f.write_text(AUTOSCALED_TOML.replace("[autoscaler]", f'[fleet]\nproxy = "{placement}"\n[autoscaler]')
                 + "max_replicas = 3\ntarget = 2.0\nprovisioning_s = 5.0\nsync_period_s = 5.0\n"
                 + '[[layer]]\npreset = "openai-python"\ntimeout_s = 8.0\n'
                 + '[[layer]]\npreset = "nginx"\ntimeout_s = 6.0\n')
    dep = load(str(f))
    rec = dep.run(0)
    a, (nginx,), att = rec["autoscaler"], rec["extra"]["layers"], rec["attempts"]
    assert rec["fleet"]["proxy"] == placement and a["scale_ups"]
    started = [s["first_call_since_burst_s"] for s in a["started"]]
    assert started and all(t is not None for t in started)           # every replica started took calls
    assert nginx["preset"] == "nginx" and nginx["upstream_attempts"] == att["sent"]
    assert att["refused_gateway"] == nginx["upstream_timeout"] > 0 and att["retries"] > 0
    assert sum(r["attempts"]["sent"] for r in rec["replicas"]) == att["sent"]
    assert all(r["attempts"]["sent"] > 0 for r in rec["replicas"])
    cond, s = dep.condition_for(), dep.scenario
    recs = [run_fleet(list(dep.fleet.profiles), cond, dep.trace(0), s, dep.fleet.capacities(s), dep.fleet.router, 0,
                      stack=dep.stack_for(cond), autoscaler=dep.fleet.autoscaler, fast_forward=ff)
            for ff in (True, False)]
    assert recs[0]["autoscaler"]["scale_ups"] == a["scale_ups"]
    assert golden.differences(_no_step_events(recs[0]), _no_step_events(recs[1])) == []
    assert recs[0]["extra"]["layers"] == recs[1]["extra"]["layers"]
