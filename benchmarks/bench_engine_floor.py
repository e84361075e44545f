"""How much of one run is the engine's own work: a full run of the reference
scenario (qwen2.5-7b, pulse 2.7, seed 0) records every input its engine
gets (each execution added, each abort, at its simulated time); the same
inputs are then replayed into a fresh engine on its own clock, with no
client, proxy, timers or run log around it. Prints, per condition, the
median wall and CPU seconds of the full run and of the engine alone, and the
engine steps of each (the replay knows every input's time in advance, so its
fast-forward is never cut by a timer that brings no input: it takes at most
the full run's steps).

The engine alone is a floor for one run at one event per engine step: what
the run would cost if everything around the engine cost nothing. With
`--replicas N`, the same for a fleet's engines: the trace drawn at N x Ĉ is
split by call affinity (the calls `Router.home` sends each replica, as
`bench_fleet.py`'s "singles on own calls"), and the figures are sums over
the N replicas.

    python benchmarks/bench_engine_floor.py [--reps 5] [--model qwen2.5-7b] [--seed 0] [--replicas N]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_fleet import own_calls  # noqa: E402
from sim.clock import Clock  # noqa: E402
from sim.conditions import get_condition  # noqa: E402
from sim.engine.core import EngineCore  # noqa: E402
from sim.engine.request import Request  # noqa: E402
from sim.model import Run, engine_config  # noqa: E402
from sim.policy.router import RouterConfig  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.runlog import ExecutionRecord  # noqa: E402
from sim.scenario import PAPER  # noqa: E402
from sim.workload import make_trace  # noqa: E402

CONDITIONS = ("cancel", "no-control")
INF = float("inf")


def recorded_inputs(run: Run) -> list[tuple]:
    """Run `run`, recording its engine's inputs: (t, "add", request fields)
    and (t, "abort", request id)."""
    engine, inputs = run.engine, []
    add, abort = engine.add_request, engine.abort_request

    def add_request(r: Request, now: float) -> bool:
        ok = add(r, now)
        if ok:
            inputs.append((now, "add", (r.request_id, r.call_id, r.num_prompt_tokens, r.max_tokens,
                                        r.shared_prefix, r.prefix_group)))
        return ok

    def abort_request(r: Request, now: float) -> None:
        inputs.append((now, "abort", r.request_id))
        abort(r, now)

    engine.add_request, engine.abort_request = add_request, abort_request
    run.run()
    return inputs


def replay(profile, condition, inputs: list[tuple], until: float) -> tuple[EngineCore, float, float]:
    """The engine alone, fed `inputs` at their times, run to `until` (where
    the full run ended: every call over, orphans possibly still running) with
    the garbage collector off, as a run has it. Returns the engine and the
    wall and CPU seconds of its run; the requests (with their execution
    records, as the driver makes them) are made before, untimed."""
    env = Clock()
    engine = EngineCore(env, engine_config(profile, condition, scenario=PAPER), profile.step_time,
                        next_input_time=lambda: times[at[0]],
                        next_abort_time=(lambda: INF) if condition.proxy.cancellation == "off" else None)
    requests: dict[int, Request] = {}
    times, groups = [], []          # the inputs' distinct times; per time, (engine method, request) in order
    for t, op, arg in inputs:
        if op == "add":
            rid, call_id, prompt, max_tokens, prefix, group = arg
            r = requests[rid] = Request(rid, call_id, prompt, max_tokens, prefix,
                                        record=ExecutionRecord(rid, call_id, 0, prompt, max_tokens, t),
                                        prefix_group=group)
            item = (engine.add_request, r)
        else:
            item = (engine.abort_request, requests[arg])
        if times and times[-1] == t:
            groups[-1].append(item)
        else:
            times.append(t)
            groups.append([item])
    times.append(INF)
    at = [0]                        # index of the next input time

    def feed(_event) -> None:
        i = at[0]
        for fn, r in groups[i]:
            fn(r, env.now)
        at[0] = i = i + 1
        if i < len(groups):
            env.call_later(times[i] - env.now, feed)

    if groups:
        env.call_later(times[0], feed)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        env.run(until)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if gc_was_enabled:
            gc.enable()
    return engine, wall, cpu


def measure(profile, trace, condition, seed: int) -> tuple:
    """(full run wall s, CPU s, step events; engine alone wall s, CPU s,
    step events; adds, aborts) for one engine on `trace`."""
    run = Run(profile, trace, condition, PAPER, seed, snapshot_times=(PAPER.pulse_end, PAPER.hold_end))
    t0, c0 = time.perf_counter(), time.process_time()
    inputs = recorded_inputs(run)
    fw, fc = time.perf_counter() - t0, time.process_time() - c0
    engine, aw, ac = replay(profile, condition, inputs, run.env.now)
    if engine.scheduler.counters != run.engine.scheduler.counters:
        raise SystemExit(f"{condition.name}: the engine alone computed other tokens than in the full run "
                         f"({engine.scheduler.counters} vs {run.engine.scheduler.counters})")
    return (fw, fc, run.engine.num_step_events, aw, ac, engine.num_step_events,
            sum(op == "add" for _, op, _ in inputs), sum(op == "abort" for _, op, _ in inputs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=1, help="engines fed a fleet's calls by call affinity")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.replicas < 1:
        ap.error("--reps and --replicas must be at least 1")
    profile = load_profile(args.model)
    n = args.replicas
    trace = make_trace(n * profile.capacity, PAPER, args.seed)
    traces = [trace] if n == 1 else own_calls(trace, RouterConfig("call-affinity", 0, "replica"), n)
    print(f"{args.model}, pulse {PAPER.pulse}, seed {args.seed}, {len(trace)} calls on {n} engine(s)"
          f"{' (sums over the engines)' if n > 1 else ''}: median of {args.reps}")
    for name in CONDITIONS:
        condition = get_condition(name)
        reps = [[sum(x) for x in zip(*(measure(profile, t, condition, args.seed) for t in traces))]
                for _ in range(args.reps)]
        fw, fc, fe, aw, ac, ae, adds, aborts = (statistics.median(r[i] for r in reps) for i in range(8))
        print(f"{name:11s} full run {fw:.3f} s wall, {fc:.3f} s CPU, {fe:.0f} step events | "
              f"engine alone {aw:.3f} s wall, {ac:.3f} s CPU, {ae:.0f} step events, "
              f"{adds:.0f} adds, {aborts:.0f} aborts | engine share {ac / fc:.0%} of CPU")


if __name__ == "__main__":
    main()
