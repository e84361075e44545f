"""`llmsim calibrate from-log`: a profile from vLLM's --enable-logging-iteration-details
lines, on a checked-in excerpt of a real CPU-engine log (tests/data/vllm_cpu_iteration_excerpt.log:
the start-up args and KV lines and 240 iteration lines of a live capacity run) and on
synthetic iterations of known coefficients."""
import json
from pathlib import Path

import numpy as np
import pytest

from calibrate.from_log import LogError, engine_settings, fit_log, parse_log, profile_from_log
from calibrate.prior import prior_profile, shape_from_config
from llmsim.cli import main
from sim.profile import from_dict

DATA = Path(__file__).parent / "data"
EXCERPT = DATA / "vllm_cpu_iteration_excerpt.log"
TINY_CONFIG = Path(__file__).parent.parent / "validate" / "models" / "tiny-qwen2" / "config.json"


def _line(i, cr, ct, gr, gt, ms):
    return (f"(APIServer pid=1) INFO 12-01 10:30:00 [loggers.py:199] Engine 000: Iteration({i}): {cr} context "
            f"requests, {ct} context tokens, {gr} generation requests, {gt} generation tokens, iteration elapsed "
            f"time: {ms:.3f} ms, CPU KV cache usage: 0.1%")


def test_parse_counts_malformed_iteration_lines_and_skips_them():
    text = EXCERPT.read_text()
    its, bad = parse_log(text)
    assert len(its) == 240 and bad == 0
    broken = text + "\n" + _line(9000, 1, 10, 0, 0, 5.0).replace("elapsed time: 5.000", "elapsed time: ?") \
        + "\nEngine 000: Iteration(9001): 1 context requests\nan unrelated line\n"
    its2, bad2 = parse_log(broken)
    assert len(its2) == 240 and bad2 == 2


def test_engine_settings_from_the_logs_args_line():
    assert engine_settings(EXCERPT.read_text()) == {"max_num_seqs": 64, "max_num_batched_tokens": 1024,
                                                    "max_model_len": 32768}
    assert engine_settings("# python -m vllm ... --max-num-seqs 16 --max-num-batched-tokens 512") == \
        {"max_num_seqs": 16, "max_num_batched_tokens": 512}


def test_fit_recovers_known_terms_from_synthetic_iterations():
    rng = np.random.default_rng(0)
    fixed, per_req, per_tok = 0.003, 2e-4, 5e-5
    its = []
    for i in range(400):
        cr = int(rng.integers(0, 2))
        ct = int(rng.integers(50, 1000)) * cr
        gr = int(rng.integers(0, 40))
        gt = gr
        if cr + gr == 0:
            gr = gt = 1
        its.append({"i": i, "ctx_reqs": cr, "ctx_tokens": ct, "gen_reqs": gr, "gen_tokens": gt,
                    "elapsed_ms": 1e3 * (fixed + per_req * (cr + gr) + per_tok * (ct + gt))})
    model, rep = fit_log(its)
    assert model.fixed_s == pytest.approx(fixed, rel=1e-6)
    assert model.per_request_s == pytest.approx(per_req, rel=1e-6)
    assert model.per_token_s == pytest.approx(per_tok, rel=1e-6)
    assert rep["heldout_mape"] < 1e-6 and rep["heldout_steps"] > 0
    # a held attention term is subtracted with the estimated pairs, not fitted
    m2, rep2 = fit_log(its, attention=(1e-9, 1e-8))
    assert (m2.per_prefill_pair_s, m2.per_decode_ctx_s) == (1e-9, 1e-8) and rep2["attention_share"] > 0


def test_profile_from_the_excerpt_says_what_it_cannot_separate():
    prof, parsed = profile_from_log(EXCERPT.read_text(), "excerpt", capacity=False, source=str(EXCERPT))
    p = from_dict(prof)
    assert parsed == {"iterations": 240, "malformed": 0}
    assert p.engine["max_num_seqs"] == 64 and p.engine["max_num_batched_tokens"] == 1024
    assert p.engine["depth"] == 1 and prof["kv_cache"]["kv_cache_tokens"] == 1_048_576
    assert (p.step_time.per_prefill_pair_s, p.step_time.per_decode_ctx_s) == (0.0, 0.0)
    assert p.step_time.fixed_s > 0 and p.step_time.per_token_s > 0
    rep = prof["fit"]
    assert "no per-request context lengths" in rep["cannot_separate"]
    assert np.isfinite(rep["heldout_mape"]) and rep["heldout_steps"] == 60         # blocks 4 and 8 of 30 lines
    assert prof["provenance"]["data"][0]["kind"] == "log"
    assert prof["provenance"]["fit_error"]["heldout_mape"] == rep["heldout_mape"]


def test_attention_terms_come_from_the_prior_of_the_models_shape():
    shape = shape_from_config(json.loads(TINY_CONFIG.read_text()))
    prof, _ = profile_from_log(EXCERPT.read_text(), "excerpt", shape, "a100", capacity=False)
    prior = prior_profile(shape, "a100")["step_time"]
    assert prof["step_time"]["per_prefill_pair_s"] == prior["per_prefill_pair_s"]
    assert prof["step_time"]["per_decode_ctx_s"] == prior["per_decode_ctx_s"]
    assert "roofline prior" in prof["fit"]["attention_from"]


def test_log_without_iteration_lines_is_refused():
    with pytest.raises(LogError, match="no iteration lines"):
        profile_from_log("INFO starting\nINFO ready\n", "x", capacity=False)


def test_cli_from_log(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "from-log", str(EXCERPT), "-o", str(out), "--no-capacity"]) == 0
    text = capsys.readouterr().out
    assert "240 iteration lines (0 malformed, skipped)" in text and "cannot be fitted from it" in text
    assert from_dict(json.loads(out.read_text())).name == "vllm_cpu_iteration_excerpt"


def test_cli_from_log_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    empty = tmp_path / "server.log"
    empty.write_text("INFO nothing here\n")
    out = tmp_path / "p.json"
    assert main(["calibrate", "from-log", str(empty), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no iteration lines" in err and len(err.splitlines()) == 1 and not out.exists()
    assert main(["calibrate", "from-log", str(tmp_path / "missing.log"), "-o", str(out)]) == 2
    assert "cannot read" in capsys.readouterr().err and not out.exists()
    nokv = tmp_path / "nokv.log"
    nokv.write_text("\n".join(_line(i, 0, 0, 4, 4, 3.0 + i % 3) for i in range(40)))
    assert main(["calibrate", "from-log", str(nokv), "-o", str(out), "--no-capacity"]) == 2
    assert "KV cache size" in capsys.readouterr().err and not out.exists()
