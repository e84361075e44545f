"""A profile from a serving vLLM's own log: the ``--enable-logging-iteration-details``
lines (context and generation requests and tokens, elapsed time per iteration),
no plugin and no capture grid.

What the log identifies and what it cannot: each line gives a step's request
and token counts, so the per-step, per-request and per-token terms are fitted
to the elapsed times (nnls, weighted as `calibrate.fit` weights steps:
``time`` by default, ``relative`` on request; held-out blocks of up to
`BLOCK_LINES` consecutive iterations, every `holdout_every`-th one). It does
not give a prefill chunk's context before it nor a decode request's context
length, so the attention terms (per prefill query-key pair, per decode context
token) cannot be separated from the per-token and per-request terms: they are
taken from the roofline prior of the model's shape (`--config`, `--gpu`;
`calibrate.prior`) and their predicted time is subtracted before the fit,
with each step's pairs and context estimated from the log's counts: a context
request's chunk as a whole prompt at context 0, a generation request's
context as the log's mean prompt tokens per context request plus half its
mean generation tokens per context request. Without `--config` the attention
terms are 0 and their time is absorbed by the fitted terms.
"""
from __future__ import annotations

import re

import numpy as np
from scipy.optimize import nnls

from sim.engine.step_time import COEFFICIENTS, StepTimeModel, prefill_pairs
from validate.step_log import parse_iteration_line, parse_kv_tokens

from .fit import WEIGHTS, mape, protocol_capacity, window_mape
from .prior import GPUS, ModelShape, prior_profile

BLOCK_LINES = 50
_FLAG = {"max_num_seqs": ("max-num-seqs", "max_num_seqs"),
         "max_num_batched_tokens": ("max-num-batched-tokens", "max_num_batched_tokens"),
         "max_model_len": ("max-model-len", "max_model_len"), "block_size": ("block-size", "block_size")}


class LogError(ValueError):
    """The log cannot give a profile (one line: what is wrong, what to do)."""


def parse_log(text: str) -> tuple[list[dict], int]:
    """(iteration lines, malformed lines): a line that names an Iteration(N)
    but does not parse is malformed; other log lines are not counted."""
    its, bad = [], 0
    for line in text.splitlines():
        d = parse_iteration_line(line)
        if d is not None:
            its.append(d)
        elif "Iteration(" in line:
            bad += 1
    return its, bad


def engine_settings(text: str) -> dict:
    """Engine flags the log states (the launch command line llmsim writes,
    or vLLM's ``non-default args`` line), by profile key."""
    out = {}
    for key, (flag, arg) in _FLAG.items():
        m = re.search(rf"--{flag}[ =](\d+)", text) or re.search(rf"'{arg}': (\d+)", text)
        if m:
            out[key] = int(m.group(1))
    return out


def features(its: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Per iteration: [1, num_reqs, num_tokens], the estimated (prefill pairs,
    decode context), elapsed seconds, and the estimates' basis."""
    ctx_reqs = sum(d["ctx_reqs"] for d in its)
    prompt = sum(d["ctx_tokens"] for d in its) / ctx_reqs if ctx_reqs else 0.0
    gen = sum(d["gen_tokens"] for d in its) / ctx_reqs if ctx_reqs else 0.0
    X = np.array([[1.0, d["ctx_reqs"] + d["gen_reqs"], d["ctx_tokens"] + d["gen_tokens"]] for d in its])
    A = np.array([[d["ctx_reqs"] * prefill_pairs(d["ctx_tokens"] / d["ctx_reqs"], 0) if d["ctx_reqs"] else 0.0,
                   d["gen_reqs"] * (prompt + gen / 2.0)] for d in its])
    y = np.array([d["elapsed_ms"] / 1e3 for d in its])
    return X, A, y, {"mean_prompt_tokens_per_context_request": prompt,
                     "mean_generation_tokens_per_context_request": gen}


def _fit(X, r, y, weights: str) -> np.ndarray:
    w = 1.0 / y if weights == "relative" else np.ones_like(y)
    s = X.max(axis=0)
    s[s == 0] = 1.0
    coef, _ = nnls((X / s) * w[:, None], r * w)
    return coef / s


def fit_log(its: list[dict], attention: tuple[float, float] = (0.0, 0.0), holdout_every: int = 4,
            window: int = 10, weights: str = "time") -> tuple[StepTimeModel, dict]:
    """Fit per-step, per-request and per-token terms to the iterations'
    elapsed times with the attention terms `attention` = (per prefill pair,
    per decode context token) held fixed; held-out error on blocks of
    consecutive iterations (every `holdout_every`-th; BLOCK_LINES long, shorter
    in a log too short for two held-out blocks of that length, `window` at least)."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; valid: {', '.join(WEIGHTS)}")
    its = [d for d in its if d["elapsed_ms"] > 0 and d["ctx_tokens"] + d["gen_tokens"] > 0]
    if len(its) < 3 * holdout_every:
        raise LogError(f"{len(its)} usable iteration lines: too few to fit (need {3 * holdout_every})")
    X, A, y, basis = features(its)
    att = A @ np.array(attention)
    r = np.maximum(y - att, 0.0)
    block = min(BLOCK_LINES, max(window, len(its) // (2 * holdout_every)))     # at least two held-out blocks
    held = np.array([(k // block) % holdout_every == holdout_every - 1 for k in range(len(its))])
    if held.all() or not held.any():
        held = np.arange(len(its)) % holdout_every == holdout_every - 1
    c_tr = _fit(X[~held], r[~held], y[~held], weights)
    pte = X[held] @ c_tr + att[held]
    c = _fit(X, r, y, weights)
    model = StepTimeModel(**dict(zip(COEFFICIENTS, [float(c[0]), float(c[1]), float(c[2]),
                                                    float(attention[0]), float(attention[1])])))
    report = {
        "method": f"scipy.optimize.nnls on {'relative residuals' if weights == 'relative' else 'residuals in s'} "
                  "of vLLM's iteration elapsed times, attention terms "
                  f"held fixed; held-out = every {holdout_every}th block of {block} consecutive iterations; "
                  f"window sums over {window} consecutive held-out iterations",
        "steps": len(its), "train_steps": int((~held).sum()), "heldout_steps": int(held.sum()),
        "train_mape": mape(X[~held] @ c_tr + att[~held], y[~held]),
        "heldout_mape": mape(pte, y[held]), "heldout_window_mape": window_mape(pte, y[held], window),
        "window_steps": window, "all_mape": mape(X @ c + att, y), "weights": weights,
        "heldout_sum_ratio": float(y[held].sum() / pte.sum()),
        "attention_estimates": basis,
        "cannot_separate": "the log gives no per-request context lengths: the attention terms (per prefill "
                           "query-key pair, per decode context token) are not identified by it; they are the "
                           "roofline prior's (or 0 without --config) and the fitted per-step, per-request and "
                           "per-token terms absorb whatever the prior misses",
        "attention_share": float(att.sum() / y.sum()),
    }
    return model, report


def profile_from_log(text: str, name: str, shape: ModelShape | None = None, gpu: str = "h100",
                     settings: dict | None = None, source: str | None = None, capacity: bool = True,
                     log=None, weights: str = "time") -> tuple[dict, dict]:
    """A measured profile from a server log's iteration lines: (profile,
    parse summary {iterations, malformed}). Raises LogError when the log has
    no iteration lines or lacks what the profile needs."""
    its, bad = parse_log(text)
    if not its:
        raise LogError("no iteration lines (vLLM's --enable-logging-iteration-details 'Iteration(N): ...') in the "
                       "log: start the server with --enable-logging-iteration-details")
    cpu = "CPU KV cache size" in text
    prior = prior_profile(shape, gpu) if shape is not None else None
    att = (prior["step_time"]["per_prefill_pair_s"], prior["step_time"]["per_decode_ctx_s"]) if prior else (0.0, 0.0)
    model, rep = fit_log(its, att, weights=weights)
    rep["malformed_lines"] = bad
    rep["attention_from"] = (f"roofline prior of {shape.name} on {GPUS[gpu].name}" if prior
                             else "none given (--config): 0")
    st = {**engine_settings(text), **(settings or {})}
    kv_tokens = parse_kv_tokens(text)
    block = st.get("block_size", 128 if cpu else 16)
    if kv_tokens is None:
        if prior is None:
            raise LogError("the log has no 'KV cache size: N tokens' line: give --config (and --gpu) for the "
                           "prior's KV capacity, or a log that includes the server's start-up")
        kv_tokens = prior["kv_cache"]["kv_tokens"]
        kv_src = f"roofline prior's KV sizing ({GPUS[gpu].name})"
    else:
        kv_src = "the log's start-up line 'KV cache size: N tokens'"
    engine = {"max_num_seqs": st.get("max_num_seqs", 256), "max_num_batched_tokens": st.get("max_num_batched_tokens",
                                                                                             8192),
              "block_size": block, "num_gpu_blocks": kv_tokens // block, "depth": 1 if cpu else 2,
              "max_model_len": st.get("max_model_len", 32768)}
    prof = {"name": name, "step_time": model.to_dict(), "engine": engine, "capacity": 1.0,
            "kv_cache": {"kv_cache_tokens": kv_tokens, "block_size": block, "num_gpu_blocks": kv_tokens // block,
                         "source": kv_src},
            "fit": rep,
            "provenance": {"kind": "measured", "engine_kind": "cpu" if cpu else "gpu", "hardware": None,
                           "fit_error": {k: rep[k] for k in ("heldout_mape", "heldout_window_mape", "train_mape")},
                           "data": [{"kind": "log", "path": source, "steps": rep["steps"],
                                     "malformed_lines": bad}],
                           "note": "fitted from vLLM's iteration log: the machine it ran on is not recorded there"}}
    if capacity:
        prof.update(protocol_capacity(prof, "scaled" if cpu else "paper", log=log))
    return prof, {"iterations": len(its), "malformed": bad}
