"""Live: the real inference-perf (its own venv) against the real CPU engine
with the tiny model's tokenizer, and `llmsim calibrate from-bench` on the
report folder it just wrote: the layout pinned in
`calibrate.inference_perf_reports` holds for the tool as installed, and the
fit runs on it. Deselect with `-m "not live"`.

Time: engine start-up ~40-130 s, two stages of 20 and 32 calls ~25 s, the fit ~5 s."""
from __future__ import annotations

import json
import subprocess

import pytest

from calibrate import bench_reports as B, inference_perf_reports as IP
from llmsim.cli import main
from validate import engine as E, loadtest as L
from validate.tokenizer import write_tokenizer

pytestmark = pytest.mark.live
STAGES = [(4.0, 5), (8.0, 4)]

# the installed tool's own config model: its keys, as the resolved config.yaml writes them
KEYS = ("import json; from inference_perf.config import Config, LoadConfig; "
        "print(json.dumps([list(Config.model_fields), list(LoadConfig.model_fields)]))")


def test_inference_perf_report_folder_is_read_and_fitted(tmp_path, cpu_engine_installed, inference_perf_installed):
    r = subprocess.run([str(inference_perf_installed), "-c", KEYS], capture_output=True, text=True, check=True)
    config_keys, load_keys = json.loads(r.stdout)
    assert tuple(config_keys) == IP.CONFIG_KEYS and tuple(load_keys) == IP.LOAD_KEYS
    assert L.inference_perf_installed() == IP.SUPPORTED
    tok = write_tokenizer(tmp_path / "tokenizer", E.TINY_MODEL)
    eng = E.start_cpu(timeout=600, tokenizer=tok, record_steps=False)
    try:
        cfg = L.inference_perf_config(eng.url, tok, tmp_path / "report", STAGES, 16, system_prompt_len=128,
                                      question_len=64, num_groups=2, prompts_per_group=8)
        out = L.run_inference_perf(cfg, tmp_path / "config.yml", timeout=300)
    finally:
        eng.stop()
    stages = B.read_reports([str(out)])
    assert [(s.stage.rate, s.stage.measured["completed"], s.stage.measured["failed"]) for s in stages] == [
        (4.0, 20, 0), (8.0, 32, 0)]
    assert {(s.prompt_len, s.output_len, s.shared_prefix, s.groups) for s in stages} == {(192, 16, 128, 2)}
    assert all(s.stage.measured["prompt_tokens_mean"] == 192 for s in stages)
    fitted = tmp_path / "fitted.json"
    assert main(["calibrate", "from-bench", str(out), "--profile", "vllm-cpu-tiny", "-o", str(fitted),
                 "--max-evals", "20"]) == 0
    pm = json.loads(fitted.read_text())["provenance"]["measurements"]
    assert [r["rate"] for r in pm["stages"]] == [s[0] for s in STAGES]
