"""The embedded profiles on the public H100 fitting set (calibrate/data/peer-h100)
with the workload as inference-perf ran it (a pool of 100 whole prompts sent in
turn, Poisson arrivals with an exact count, each stage run whole, the next once
the one before has drained, the prefix cache carried over) against the
description the profiles were fitted to (a fixed interval 1/rate, groups of
calls sharing a system prompt, a steady-state window of each stage): per
stage, measured and predicted TTFT and E2E means (the profile's time outside
the engine added) and the errors predicted / measured - 1.

    python benchmarks/bench_workload_as_run.py [--measurements DIR] [--models llama-3.1-8b,qwen2.5-7b]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from calibrate import measurements as ms
from sim.profile import load_profile


def old_description(e: ms.Experiment, recorded: dict) -> ms.Experiment:
    """`e` as the profile's fit described it (`as_recorded`), or for an
    experiment it did not take, as the earlier copy of the set described
    them: constant arrivals, the groups sharing a system prompt, no pool, a
    steady-state window of each stage."""
    if e.exp_id in recorded:
        return recorded[e.exp_id]
    return replace(e, arrivals="constant", pool=None, drained=False,
                   stages=tuple(replace(s, as_run_s=None) for s in e.stages))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", default="calibrate/data/peer-h100")
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b")
    a = ap.parse_args(argv)
    exps = ms.read_experiments(a.measurements)
    for name in a.models.split(","):
        prof = load_profile(name)
        pm = prof.provenance.get("measurements") or {}
        sim = pm.get("simulation") or {}
        dur, warm, fs = sim.get("duration_s", 90.0), sim.get("warmup_s", 20.0), ms.unsimulated_frontend(prof)
        mine = ms.experiments_for(exps, prof)
        recorded = {e.exp_id: e for e in ms.as_recorded(prof, exps)} if pm else {}
        t0 = time.perf_counter()
        new = ms.compare(prof, mine, dur, warm, frontend_s=fs)
        t1 = time.perf_counter()
        old = ms.compare(prof, [old_description(e, recorded) for e in mine], dur, warm, frontend_s=fs)
        t2 = time.perf_counter()
        print(f"== {name}: experiments {', '.join(e.exp_id for e in mine)}; time outside the engine "
              f"{fs * 1e3:.2f} ms added; simulated as run in {t1 - t0:.1f} s, as described before in {t2 - t1:.1f} s")
        head = (f"{'exp':>4} {'stage':>5} {'rate':>5} | {'TTFT meas':>9} {'as run':>7} {'err':>7} {'before':>7} "
                f"{'err':>7} | {'E2E meas':>8} {'as run':>7} {'err':>7} {'before':>7} {'err':>7}")
        print(head)
        print("-" * len(head))
        for r, o in zip(new, old):
            print(f"{r['exp_id']:>4} {r['stage']:>5} {r['rate']:>5g} | {r['ttft_mean_measured'] * 1e3:>9.1f} "
                  f"{r['ttft_mean_simulated'] * 1e3:>7.1f} {r['ttft_residual']:>+7.1%} "
                  f"{o['ttft_mean_simulated'] * 1e3:>7.1f} {o['ttft_residual']:>+7.1%} | "
                  f"{r['e2e_mean_measured'] * 1e3:>8.0f} {r['e2e_mean_simulated'] * 1e3:>7.0f} "
                  f"{r['e2e_residual']:>+7.1%} {o['e2e_mean_simulated'] * 1e3:>7.0f} {o['e2e_residual']:>+7.1%}")
        for label, rows in (("as run", new), ("as described before", old)):
            print(f"mean |error| {label}: TTFT {sum(abs(x['ttft_residual']) for x in rows) / len(rows):.1%}, "
                  f"E2E {sum(abs(x['e2e_residual']) for x in rows) / len(rows):.1%}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
