"""Predicted against measured on the fitting set of published H100
measurements (calibrate/data/peer-h100 by default): every stage of every
experiment simulated with the embedded profile of its model, beside the
residuals of the profile before its refit (from its provenance), then the
step-time coefficients before and after and the published figures, and the
simulator's wall time.

    python benchmarks/bench_peer_fit.py [--measurements DIR] [--models llama-3.1-8b,qwen2.5-7b]
"""
from __future__ import annotations

import argparse
import time

from calibrate import measurements as ms
from sim.profile import load_profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", default="calibrate/data/peer-h100")
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds simulated per stage")
    a = ap.parse_args(argv)
    exps = ms.read_experiments(a.measurements)
    for name in a.models.split(","):
        prof = load_profile(name)
        mine = ms.experiments_for(exps, prof)
        pm = prof.provenance.get("measurements") or {}
        t0 = time.perf_counter()
        rows = ms.compare(prof, mine, duration_s=a.duration)
        wall = time.perf_counter() - t0
        print(f"== {name}: {len(rows)} stages of experiments {', '.join(e.exp_id for e in mine)} "
              f"(vLLM {', '.join(sorted({e.vllm for e in mine}))}); simulated in {wall:.2f} s")
        print(ms.stage_table(rows, pm.get("stages_before")))
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
