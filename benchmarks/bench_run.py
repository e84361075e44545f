"""Wall time of full paper-scenario runs (the reference scenario at pulse 2.7 on the embedded
qwen2.5-7b profile, seed 0): the `cancel` and `no-control` conditions, with the
closed-form fast-forward of decode-only stretches and stepping one engine step
at a time. Prints, per condition and mode, the median wall seconds and CPU
seconds (the process's, steadier than wall time on a shared machine) over the
repetitions, the engine steps, the engine's step events and every SimPy event
of the run, the simulated seconds (the run's end time) and simulated seconds
per wall second.

    python benchmarks/bench_run.py [--reps 5] [--model qwen2.5-7b] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sim.conditions import get_condition  # noqa: E402
from sim.model import Run  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.scenario import PAPER  # noqa: E402
from sim.workload import make_trace  # noqa: E402

CONDITIONS = ("cancel", "no-control")


def bench(profile, trace, condition_name: str, seed: int, reps: int, fast_forward: bool) -> dict:
    condition = get_condition(condition_name)
    walls, cpus, steps, ends, events, simpy_events = [], [], set(), set(), set(), set()
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        run = Run(profile, trace, condition, PAPER, seed, fast_forward=fast_forward,
                  snapshot_times=(PAPER.pulse_end, PAPER.hold_end))
        log = run.run()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        steps.add(log.engine["steps"])
        ends.add(log.end_time)
        events.add(log.extra.get("step_events", -1))
        simpy_events.add(run.env.events_scheduled)
    if len(steps) != 1 or len(ends) != 1:
        raise SystemExit(f"{condition_name}: repetitions differ (steps {sorted(steps)}, end {sorted(ends)})")
    wall = statistics.median(walls)
    end = ends.pop()
    return {"condition": condition_name, "fast_forward": fast_forward, "wall_s": wall,
            "wall_min_s": min(walls), "cpu_s": statistics.median(cpus), "steps": steps.pop(),
            "step_events": max(events), "simpy_events": max(simpy_events), "simulated_s": end,
            "sim_per_wall": end / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions per condition and mode (default 5)")
    ap.add_argument("--model", default="qwen2.5-7b", help="profile name or path (default qwen2.5-7b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), metavar="NAME")
    ap.add_argument("--no-stepping", action="store_true",
                    help="skip the fast_forward=False comparison runs")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    for name in args.conditions:
        try:
            get_condition(name)
        except ValueError as e:
            ap.error(str(e))

    profile = load_profile(args.model)
    scenario = PAPER                # pulse 2.7
    t0 = time.perf_counter()
    trace = make_trace(profile.capacity, scenario, args.seed)
    print(f"{profile.name}: capacity {profile.capacity} calls/s, pulse {scenario.pulse}, seed {args.seed}, "
          f"{len(trace)} calls (trace {time.perf_counter() - t0:.3f} s), {args.reps} repetitions")
    modes = (True,) if args.no_stepping else (True, False)
    header = f"{'condition':<12} {'mode':<13} {'median wall s':>13} {'min wall s':>10} {'median CPU s':>12} " \
             f"{'steps':>9} {'step events':>11} {'SimPy events':>12} {'simulated s':>11} {'sim s / wall s':>14}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.conditions:
        for ff in modes:
            r = bench(profile, trace, name, args.seed, args.reps, ff)
            rows.append(r)
            mode = "fast-forward" if ff else "step-by-step"
            ev = str(r["step_events"]) if r["step_events"] >= 0 else "n/a"
            print(f"{name:<12} {mode:<13} {r['wall_s']:>13.3f} {r['wall_min_s']:>10.3f} {r['cpu_s']:>12.3f} "
                  f"{r['steps']:>9d} {ev:>11} {r['simpy_events']:>12d} {r['simulated_s']:>11.1f} "
                  f"{r['sim_per_wall']:>14.0f}", flush=True)
    if not args.no_stepping:
        print()
        for name in args.conditions:
            ff, step = (r for r in rows if r["condition"] == name)
            print(f"{name}: fast-forward is {step['wall_s'] / ff['wall_s']:.2f}x faster than stepping")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
