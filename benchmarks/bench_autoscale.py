"""Wall time of an autoscaled fleet against the fixed fleet at its largest
size, on the same calls: a scenario with an [autoscaler] (default
examples/autoscale.toml) run as it is, and with min = max = max_replicas
(the fixed fleet at its largest size), and at min = max = its smallest size.
Prints, per condition, the median wall and CPU seconds of the simulation
and its measures over `--reps` runs, engine steps and SimPy step events
summed over the replicas, replica-seconds, and the autoscaled run's cost
over the largest fixed fleet's.

    python benchmarks/bench_autoscale.py [--scenario examples/autoscale.toml] [--reps 3]
                                         [--conditions no-control cancel] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sim.deployment import load  # noqa: E402
from sim.fleet import run_fleet  # noqa: E402


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=os.path.join(ROOT, "examples", "autoscale.toml"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conditions", nargs="+", default=["no-control", "cancel"], metavar="NAME")
    a = ap.parse_args(argv)
    dep = load(a.scenario)
    fleet = dep.fleet
    if fleet is None or fleet.autoscaler is None:
        print(f"{a.scenario}: no [autoscaler] section", file=sys.stderr)
        return 2
    cfg, s = fleet.autoscaler, dep.scenario
    trace = dep.trace(a.seed)
    caps = fleet.capacities(s)
    lo, hi = cfg.min_replicas, cfg.max_replicas
    variants = [(f"autoscaled {lo}..{hi}", cfg),
                (f"fixed at {hi}", dataclasses.replace(cfg, min_replicas=hi, initial_replicas=hi)),
                (f"fixed at {lo}", None)]
    print(f"{dep.name}: {len(trace)} calls, {hi} replicas at most of {fleet.profiles[0].name}, router "
          f"{fleet.router.policy}, seed {a.seed}, {a.reps} reps (median)")
    print(f"{'condition':<12} {'fleet':<16} {'wall s':>8} {'cpu s':>8} {'steps':>8} {'events':>8} "
          f"{'replica-s':>10} {'recovered':>9}")
    for c in a.conditions:
        cond = dep.condition_for(c)
        walls = {}
        for label, sc in variants:
            n = lo if sc is None else hi
            w, cpu, rec = [], [], None
            for _ in range(a.reps):
                rec, dw, dc = timed(lambda: run_fleet(list(fleet.profiles[:n]), cond, trace, s, caps[:n],
                                                      fleet.router, a.seed, autoscaler=sc))
                w.append(dw)
                cpu.append(dc)
            walls[label] = statistics.median(w)
            rs = rec["autoscaler"]["replica_seconds"] if "autoscaler" in rec else n * rec["end_time"]
            print(f"{c:<12} {label:<16} {statistics.median(w):8.3f} {statistics.median(cpu):8.3f} "
                  f"{rec['engine']['steps']:8d} {rec['extra']['step_events']:8d} {rs:10.0f} "
                  f"{str(rec['recovered']):>9}")
        print(f"{'':<12} autoscaled / fixed at {hi}: {walls[variants[0][0]] / walls[variants[1][0]]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
