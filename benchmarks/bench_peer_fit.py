"""Predicted against measured on the fitting set of published H100
measurements (calibrate/data/peer-h100 by default): every stage of every
experiment simulated with the embedded profile of its model, beside the
residuals of the profile before its refit (from its provenance; with
`--compare NAME=FILE`, of that profile instead, e.g. an earlier version of
it), then the step-time coefficients before and after, the fitted time
outside the engine, the published figures, and the simulator's wall time.

    python benchmarks/bench_peer_fit.py [--measurements DIR] [--models llama-3.1-8b,qwen2.5-7b]
                                        [--compare llama-3.1-8b=old-llama.json ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from calibrate import measurements as ms
from sim.profile import load_profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", default="calibrate/data/peer-h100")
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds simulated per stage")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=FILE",
                    help="the residuals of this profile file in the 'before' columns of model NAME")
    a = ap.parse_args(argv)
    other = dict(c.split("=", 1) for c in a.compare)
    exps = ms.read_experiments(a.measurements)
    for name in a.models.split(","):
        prof = load_profile(name)
        mine = ms.experiments_for(exps, prof)
        pm = prof.provenance.get("measurements") or {}
        frontend_s = pm.get("frontend_s", 0.0)      # the fit's, simulated where the profile says so
        t0 = time.perf_counter()
        rows = ms.compare(prof, mine, duration_s=a.duration, frontend_s=ms.unsimulated_frontend(prof))
        wall = time.perf_counter() - t0
        before = pm.get("stages_before")
        if name in other:
            old = load_profile(other[name])
            before = ms.compare(old, mine, duration_s=a.duration,
                                frontend_s=ms.unsimulated_frontend(old))
        print(f"== {name}: {len(rows)} stages of experiments {', '.join(e.exp_id for e in mine)} "
              f"(vLLM {', '.join(sorted({e.vllm for e in mine}))}); simulated in {wall:.2f} s")
        print(f"step time: {prof.step_time.form}; time outside the engine added to the simulated means: "
              f"{frontend_s * 1e3:.2f} ms; before: {other.get(name, 'the prior of the refit')}")
        print(ms.stage_table(rows, before))
        worst = max(max(abs(r["ttft_residual"]), abs(r["e2e_residual"])) for r in rows)
        print(f"largest |residual| {worst:.1%}; stages within 5 %: "
              f"{sum(abs(r['ttft_residual']) <= 0.05 and abs(r['e2e_residual']) <= 0.05 for r in rows)}/{len(rows)}")
        if pm:
            print()
            print(ms.coefficient_table(pm["prior_step_time"], prof.step_time.to_dict(), pm.get("standard_error"),
                                       pm.get("held_by_prior", ())))
        sim = prof.provenance.get("simulated") or {}
        print("published figures: " + ", ".join(f"{k} {v:.3f}" for k, v in sim.items())
              + f" (published {prof.provenance.get('published')})")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
