"""A profile against every published figure of the reference design (vLLM on one
H100, Qwen2.5-7B-Instruct; docs/calibration.md, "The default against the
published figures"): the capacity protocol's Ĉ on trace 0 and its mean and
spread over --cap-seeds traces; the median TTFT and E2E at 1.52 calls/s on
trace 0 and their means over --lat-seeds traces, plus the profile's time
outside the engine (`provenance.reference_fit.frontend_s`); and, on the
reference trace (phases in multiples of the profile's Ĉ), each diagnostic
row's hold delivery (median over --seeds) and recovery against the published
range. With --per-token M[,M...] the same for the profile with `per_token_s`
times each M: the scan the reference fit was read from.

    python benchmarks/bench_reference.py [--model qwen2.5-7b] [--per-token 1.0,0.95,0.925]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from calibrate.published import PUBLISHED  # noqa: E402
from sim.capacity import capacity_protocol  # noqa: E402
from sim.engine.step_time import step_time_model  # noqa: E402
from sim.experiments import reference  # noqa: E402
from sim.latency import latency  # noqa: E402
from sim.profile import Profile, load_profile  # noqa: E402
from sim.run import run_one  # noqa: E402


def figures(prof: Profile, cap_seeds: int = 16, lat_seeds: int = 8, seeds=range(10)) -> dict:
    """The simulated figures beside the published ones (module docstring)."""
    pub = PUBLISHED["qwen2.5-7b"]
    caps = [capacity_protocol(prof, seed=s)["capacity"] for s in range(cap_seeds)]
    lat = [latency(prof, pub["latency"]["rate"], seed=s) for s in range(lat_seeds)]
    front = (prof.provenance.get("reference_fit") or {}).get("frontend_s", 0.0)
    out = {"capacity_seed0": caps[0], "capacity_mean": statistics.fmean(caps), "capacity_sd": statistics.stdev(caps),
           "frontend_s": front}
    for k in ("ttft_p50", "e2e_p50"):
        out[k + "_seed0"] = lat[0][k] + front
        out[k + "_mean"] = statistics.fmean(r[k] for r in lat) + front
    rows = {}
    for name, ref in reference.REFERENCE.items():
        recs = [run_one(prof, name, reference.PULSE, s) for s in seeds]
        held = [reference.hold_delivered_pct(r) for r in recs]
        times = [r["recovery_time_s"] for r in recs if r["recovered"]]
        rows[name] = {"hold_median": statistics.median(held), "hold_mean": statistics.fmean(held),
                      "recovered": len(times), "runs": len(recs),
                      "recovery_median_s": statistics.median(times) if times else None,
                      "recovery_mean_s": statistics.fmean(times) if times else None,
                      "reference_hold": list(ref.hold_delivered),
                      "reference_recovery_s": list(ref.recovery_s) if ref.recovery_s else None}
    out["rows"] = rows
    return out


def report(label: str, f: dict) -> list[str]:
    pub = PUBLISHED["qwen2.5-7b"]
    lat = pub["latency"]
    lines = [f"{label}: capacity protocol seed 0 {f['capacity_seed0']:.3f}, mean {f['capacity_mean']:.3f} "
             f"(sd {f['capacity_sd']:.3f}) calls/s, published {pub['capacity']} "
             f"({f['capacity_mean'] / pub['capacity'] - 1:+.1%} on the mean); "
             f"at {lat['rate']} calls/s with {f['frontend_s'] * 1e3:.0f} ms outside the engine: "
             f"TTFT p50 {f['ttft_p50_seed0']:.3f} / {f['ttft_p50_mean']:.3f} s (seed 0 / mean; published "
             f"{lat['ttft_p50']}), E2E p50 {f['e2e_p50_seed0']:.2f} / {f['e2e_p50_mean']:.2f} s "
             f"(published {lat['e2e_p50']})"]
    for name, r in f["rows"].items():
        lo, hi = r["reference_hold"]
        inside = lo - 2.0 <= r["hold_median"] <= hi + 2.0
        rec = (f"recovered {r['recovered']}/{r['runs']}" + (f", median {r['recovery_median_s']:.0f} s"
                                                            if r["recovered"] else ""))
        want = (f"{r['reference_recovery_s'][0]:.0f}-{r['reference_recovery_s'][1]:.0f} s"
                if r["reference_recovery_s"] else "no")
        lines.append(f"  {name:16s} hold median {r['hold_median']:5.1f}% (mean {r['hold_mean']:5.1f}%), "
                     f"published {lo}-{hi}% {'inside +-2' if inside else 'OUTSIDE +-2'}; {rec} (published {want})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", help="embedded profile or profile file")
    ap.add_argument("--per-token", default="1.0", help="multipliers of per_token_s to scan, comma-separated")
    ap.add_argument("--cap-seeds", type=int, default=16)
    ap.add_argument("--lat-seeds", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=10, help="diagnostic seeds 0..N-1")
    a = ap.parse_args(argv)
    base = load_profile(a.model)
    for m in (float(x) for x in a.per_token.split(",")):
        st = base.step_time.to_dict()
        prof = replace(base, step_time=step_time_model(dict(st, per_token_s=st["per_token_s"] * m)))
        f = figures(prof, a.cap_seeds, a.lat_seeds, range(a.seeds))
        print("\n".join(report(f"{base.name} per_token_s x {m:g}", f)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
