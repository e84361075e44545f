"""Wall time of a sweep grid on this machine: runs the grid into a fresh
Parquet file (local processes, or Ray with --ray) and prints the total wall
time, cells per second and the per-run median/min/max of the simulator's own
wall time (`wall_s` of each record).

    python benchmarks/bench_sweep.py [--models qwen2.5-7b] [--conditions no-control,cancel,...]
        [--pulses 2.7] [--seeds 0-4] [--max-batched-tokens 8192,2048] [--workers N] [--ray auto]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from sim.conditions import CONDITIONS
from sim.experiments import sweep as sw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-7b")
    ap.add_argument("--conditions", default="no-retry,no-control,cancel,budget,coalesce,proxy-cap,engine-cap-338")
    ap.add_argument("--pulses", default="2.7")
    ap.add_argument("--seeds", default="0-2")
    ap.add_argument("--max-batched-tokens", default=None)
    ap.add_argument("--mixed-prompts", action="store_true")
    ap.add_argument("--workers", type=int, default=None, help="local processes (default: all cores)")
    ap.add_argument("--ray", default=None, metavar="ADDRESS|auto|local")
    args = ap.parse_args(argv)
    conds = [c for c in args.conditions.split(",") if c]
    for c in conds:
        if c not in CONDITIONS:
            ap.error(f"unknown condition {c!r}")
    mbt = [int(x) for x in args.max_batched_tokens.split(",")] if args.max_batched_tokens else [None]
    cells = sw.grid(args.models.split(","), conds, [float(x) for x in args.pulses.split(",")],
                    sw.parse_seeds(args.seeds), mbt, [args.mixed_prompts])
    workers = args.workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.parquet")
        t0 = time.perf_counter()
        res = sw.sweep(cells, out, workers=workers, ray_address=args.ray, progress=False)
        wall = time.perf_counter() - t0
        runs = [r["wall_s"] for r in sw.read_rows(out)]
    where = f"ray {args.ray}" if args.ray else f"{workers} local processes"
    print(f"{len(cells)} cells ({args.models}; {len(conds)} conditions; pulses {args.pulses}; seeds {args.seeds}; "
          f"budgets {args.max_batched_tokens or 'profile'}) on {where}, {os.cpu_count()} cores")
    print(f"sweep wall time {wall:.1f} s ({res['ran'] / wall:.2f} cells/s)")
    print(f"per run: median {statistics.median(runs):.3f} s, min {min(runs):.3f} s, max {max(runs):.3f} s, "
          f"sum {sum(runs):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
