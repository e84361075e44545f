"""A synthetic day of traffic on one profile: 24 h at a steady 0.6 Ĉ with a
burst of 2.7 Ĉ for 107 s every hour (120 s into the hour), the reference
scenario's prompts, responses and client, one condition. Prints the calls,
attempts, engine steps and SimPy step events, the wall time of the
simulation and of the result record, simulated calls and engine steps per
wall second, and the peak memory of the process (resident set, from
resource.getrusage) against the memory before the run.

    python benchmarks/bench_day.py [--model qwen2.5-7b] [--condition deferred] [--hours 24] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim import measures  # noqa: E402
from sim.conditions import get_condition  # noqa: E402
from sim.model import simulate  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.scenario import PAPER  # noqa: E402
from sim.workload import make_trace  # noqa: E402

HOUR = 3600.0


def day_phases(capacity: float, hours: int, steady: float = 0.6, burst: float = 2.7, burst_at: float = 120.0,
               burst_s: float = 107.0) -> list[tuple[float, float, float]]:
    """(start, end, calls/s) of every phase: each hour steady load, a burst
    `burst_at` seconds into it lasting `burst_s`, then steady load again."""
    out = []
    for h in range(hours):
        t0 = h * HOUR
        out += [(t0, t0 + burst_at, steady * capacity),
                (t0 + burst_at, t0 + burst_at + burst_s, burst * capacity),
                (t0 + burst_at + burst_s, t0 + HOUR, steady * capacity)]
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", help="profile name or path (default qwen2.5-7b)")
    ap.add_argument("--condition", default="deferred", help="condition name (default deferred)")
    ap.add_argument("--hours", type=int, default=24, help="hours of traffic (default 24)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.hours < 1:
        ap.error("--hours must be at least 1")
    try:
        condition = get_condition(args.condition)
    except ValueError as e:
        ap.error(str(e))
    profile = load_profile(args.model)
    # the first hour's burst is the scenario's pulse; its hold runs to the end of the day
    scenario = PAPER.with_(hold_s=args.hours * HOUR - PAPER.pulse_end)
    trace = make_trace(profile.capacity, scenario, args.seed, phases=day_phases(profile.capacity, args.hours))
    rss0 = peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    log = simulate(profile, trace, condition, scenario, seed=args.seed)
    sim_s, sim_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_sim = peak_rss_mb()
    t0 = time.perf_counter()
    rec = measures.record(log, scenario, profile.capacity, {"model": profile.name, "condition": condition.name,
                                                            "pulse": 2.7, "seed": args.seed})
    rec_s = time.perf_counter() - t0
    steps = log.engine["steps"]
    print(f"{profile.name} / {condition.name}, seed {args.seed}: {args.hours} h of traffic, {len(trace)} calls "
          f"(Ĉ {profile.capacity} calls/s), simulated to {log.end_time:.0f} s")
    print(f"  attempts {rec['attempts']['sent']}, executions {rec['executions']['created']}, "
          f"delivered {sum(c.outcome == 'delivered' for c in log.calls)}, engine steps {steps}, "
          f"step events {log.extra.get('step_events')}")
    print(f"  simulation {sim_s:.2f} s wall ({sim_cpu:.2f} s CPU), record {rec_s:.2f} s wall")
    print(f"  {len(trace) / sim_s:,.0f} simulated calls per wall second, {steps / sim_s:,.0f} steps per wall "
          f"second, {log.end_time / sim_s:,.0f} simulated seconds per wall second")
    print(f"  peak resident memory: {rss0:.0f} MB before the run, {rss_sim:.0f} MB after the simulation, "
          f"{peak_rss_mb():.0f} MB after the record")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
