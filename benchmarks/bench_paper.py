"""Wall time of the whole `llmsim paper` grid on this machine: runs every block
(or --blocks) on the three embedded models (or --models) into a fresh
directory, then prints the grid's wall time (sweep and report), cells per
second and the per-run median/min/max of the simulator's own wall time.

    python benchmarks/bench_paper.py [--seeds 3] [--workers N] [--ray auto]
        [--blocks diagnostic,trigger,...] [--models qwen2.5-7b,...] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from sim.experiments import paper as pp, sweep as sw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=pp.DEFAULT_SEEDS)
    ap.add_argument("--workers", type=int, default=None, help="local processes (default: all cores)")
    ap.add_argument("--ray", default=None, metavar="ADDRESS|auto|local")
    ap.add_argument("--blocks", default=None, help=f"comma-separated, of {','.join(pp.BLOCK_NAMES)}")
    ap.add_argument("--models", default=",".join(pp.MODELS))
    ap.add_argument("--keep", default=None, metavar="DIR", help="write here (must not hold results yet)")
    a = ap.parse_args(argv)
    blocks = a.blocks.split(",") if a.blocks else None
    models = a.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = a.keep or tmp
        if os.path.exists(os.path.join(out, "results.parquet")):
            ap.error(f"{out} already holds results.parquet; the benchmark needs a fresh directory")
        t0 = time.perf_counter()
        res = pp.paper(out, seeds=a.seeds, workers=a.workers, ray_address=a.ray, blocks=blocks, models=models,
                       progress=False)
        total = time.perf_counter() - t0
        runs = [r["wall_s"] for r in sw.read_rows(os.path.join(out, "results.parquet"))]
    print(f"paper grid: {res['ran']} runs ({len(models)} models, {a.seeds} seeds, "
          f"blocks {','.join(blocks or pp.BLOCK_NAMES)}) on {a.workers or os.cpu_count()} "
          f"{'Ray' if a.ray else 'local'} workers")
    print(f"wall time: {total:.1f} s total, sweep {res['wall_s']:.1f} s, report {total - res['wall_s']:.1f} s; "
          f"{res['ran'] / res['wall_s']:.2f} runs/s")
    print(f"per run (simulator wall_s): median {statistics.median(runs):.2f} s, "
          f"min {min(runs):.2f} s, max {max(runs):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
