"""Predicted against measured for every experiment of a measurements folder
(the format of calibrate/data/peer-h100/), each engine derived from its
model's config.json, its GPU and its tensor parallelism with one set of
hardware efficiencies (calibrate.efficiencies): no profile of any of them.

    python benchmarks/bench_peer.py                        # the fitted efficiencies on the handed folder
    python benchmarks/bench_peer.py --measurements DIR     # any folder in that format
    python benchmarks/bench_peer.py --fit -o eff.json      # fit the efficiencies first (progress shown),
                                                           # from --efficiencies (default: the embedded fit)

Prints one row per stage (E2E and TTFT means, measured and predicted, and
the error predicted / measured - 1), the medians of |error| (and without
the stages of servers run with what the simulated engine leaves out, marked
*), a line for each experiment whose engine cannot be derived or simulated
(the rest are predicted), the KV blocks the model derives against those the
servers reported, and the reference design's published figures against the
derived engines'."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate import efficiencies as ef, measurements as ms  # noqa: E402


def table(rows: list[dict], experiments: list) -> str:
    by_id = {e.exp_id: e for e in experiments}
    out = [f"{'exp':>16} {'model':<30} {'tp':>2} {'rate':>5}  {'E2E ms':>8} {'pred':>8} {'err':>6}  "
           f"{'TTFT ms':>8} {'pred':>8} {'err':>6}"]
    for r in rows:
        e = by_id[r["exp_id"]]
        out.append(f"{r['exp_id']:>16} {e.model.rsplit('/', 1)[-1][:30]:<30} {e.tp:>2} {r['rate']:>5g}  "
                   f"{r['e2e_mean_measured'] * 1e3:>8.0f} {r['e2e_mean_simulated'] * 1e3:>8.0f} "
                   f"{r['e2e_residual']:>+6.1%}  {r['ttft_mean_measured'] * 1e3:>8.1f} "
                   f"{r['ttft_mean_simulated'] * 1e3:>8.1f} {r['ttft_residual']:>+6.1%}"
                   + ("  *" if e.unsimulated else ""))
    e2e, ttft = [abs(r["e2e_residual"]) for r in rows], [abs(r["ttft_residual"]) for r in rows]
    out.append(f"median |E2E error| {statistics.median(e2e):.1%} (max {max(e2e):.1%}), "
               f"median |TTFT error| {statistics.median(ttft):.1%} (max {max(ttft):.1%}) over {len(rows)} stages")
    plain = [r for r in rows if not by_id[r["exp_id"]].unsimulated]
    if len(plain) < len(rows):
        e2e, ttft = [abs(r["e2e_residual"]) for r in plain], [abs(r["ttft_residual"]) for r in plain]
        out.append(f"  without the {len(rows) - len(plain)} stages marked *: median |E2E error| "
                   f"{statistics.median(e2e):.1%} (max {max(e2e):.1%}), median |TTFT error| "
                   f"{statistics.median(ttft):.1%} (max {max(ttft):.1%})")
    shown = {r["exp_id"] for r in rows}
    out += [f"  * {e.exp_id} ran with what the simulated engine leaves out: {'; '.join(e.unsimulated)}"
            for e in experiments if e.unsimulated and e.exp_id in shown]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", default=ef.PEER_FOLDER, help="a measurements folder (default: the handed one)")
    ap.add_argument("--efficiencies", default=ef.FITTED,
                    help="a file of fitted efficiencies (default: the embedded); with --fit, where the fit starts")
    ap.add_argument("--fit", action="store_true", help="fit the efficiencies on the folder first")
    ap.add_argument("--from-defaults", action="store_true",
                    help="with --fit: start from calibrate.efficiencies.Efficiencies()'s defaults instead")
    ap.add_argument("-o", "--out", default=None, help="with --fit: write the fitted efficiencies here")
    a = ap.parse_args(argv)
    experiments = ms.read_experiments(a.measurements)
    t = time.perf_counter()
    if a.fit:
        start, source = ((ef.Efficiencies(), "the defaults") if a.from_defaults
                         else (ef.load(a.efficiencies), os.path.relpath(a.efficiencies, ROOT)))
        doc = ef.fitted_document(experiments, a.measurements, log=lambda s: print(s, file=sys.stderr, flush=True),
                                 start=start, start_source=source)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
        eff = ef.Efficiencies(**doc["efficiencies"])
        print(f"fitted in {time.perf_counter() - t:.0f} s: {doc['efficiencies']}; not identified: "
              f"{', '.join(doc['not_identified']) or 'none'}")
    else:
        eff = ef.load(a.efficiencies)
    print(f"efficiencies: {ef.describe(eff)}")
    skipped = []
    rows = ef.predict(experiments, a.measurements, eff, skipped=skipped)
    if not rows:
        raise ms.MeasurementsError(f"none of the {len(skipped)} experiments of {a.measurements} could be "
                                   f"predicted; experiment {skipped[0][0]}: {skipped[0][1]}")
    print(table(rows, experiments))
    for exp_id, why in skipped:
        print(f"  not predicted: experiment {exp_id}: {why}")
    print("KV blocks derived against those the servers reported (the simulation uses the reported):")
    for r in ef.kv_check(experiments, a.measurements, eff):
        print(f"  {r['exp_id']:>16} {r['model'].rsplit('/', 1)[-1][:30]:<30} tp {r['tp']}  derived {r['derived']:>6}  "
              f"reported {r['reported']:>6}  {r['ratio'] - 1:+.1%}")
    print("the reference design's published figures (one H100, 12,000-token prompts; SPEC):")
    for r in ef.reference(eff):
        print(f"  {r['model']:<14} {r['figure']:<9} published {r['published']:>7.3f}  derived "
              f"{r['simulated']:>7.3f}  {r['residual']:+.1%}")
    print(f"({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError, ms.MeasurementsError) as err:     # a bad folder or file: one line, no trace
        sys.exit(f"bench_peer.py: {err}")
