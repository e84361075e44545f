"""Fit the step-time model (docs/model.md, "Calibration") to captured steps and write a profile.

    duration = fixed_s + per_request_s*num_reqs + per_token_s*num_tokens
               + per_prefill_pair_s*prefill_pairs + per_decode_ctx_s*decode_ctx

Non-negative least squares (scipy.optimize.nnls) on relative residuals (each
row divided by its measured duration, so the fit minimises squared relative
error, which is what the MAPE reports). Held-out split: whole grid cells
(phases), every `holdout_every`-th one in capture order, so no held-out step
has a neighbour from the same batch in the training set. Errors: MAPE per
step, and MAPE of step-time sums over windows of `window` consecutive held-out
steps (what a simulation integrates).
"""
from __future__ import annotations

import datetime
import math

import numpy as np
from scipy.optimize import nnls

from sim.capacity import capacity_protocol
from sim.profile import from_dict
from sim.scenario import get_scenario
from sim.engine.step_time import COEFFICIENTS, StepTimeModel
from sim.steps import FEATURES, design, predict

__all__ = ["FEATURES", "design", "predict", "nnls_fit", "fit_report", "build_profile"]


def nnls_fit(rows: list[dict]) -> StepTimeModel:
    X, y = design(rows)
    if len(rows) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(rows)}")
    if np.any(y <= 0):
        raise ValueError("step durations must be positive")
    w = 1.0 / y
    # scale columns so nnls is well conditioned, then unscale
    s = np.abs(X).max(axis=0)
    s[s == 0] = 1.0
    coef, _ = nnls((X / s) * w[:, None], y * w)
    return StepTimeModel(**dict(zip(COEFFICIENTS, (coef / s).tolist())))


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y)) if len(y) else float("nan")


def window_mape(pred: np.ndarray, y: np.ndarray, window: int) -> float:
    n = len(y) // window
    if n == 0:
        return mape(np.array([pred.sum()]), np.array([y.sum()])) if len(y) else float("nan")
    ps = pred[: n * window].reshape(n, window).sum(axis=1)
    ys = y[: n * window].reshape(n, window).sum(axis=1)
    return mape(ps, ys)


def split(rows: list[dict], holdout_every: int = 4) -> tuple[list[dict], list[dict]]:
    """Hold out every `holdout_every`-th phase (grid cell) in capture order;
    with fewer than `holdout_every` phases, every `holdout_every`-th step."""
    phases = list(dict.fromkeys(r.get("phase", "other") for r in rows))
    if len(phases) >= holdout_every:
        held = {p for k, p in enumerate(phases) if k % holdout_every == holdout_every - 1}
        train = [r for r in rows if r.get("phase", "other") not in held]
        test = [r for r in rows if r.get("phase", "other") in held]
    else:
        train = [r for k, r in enumerate(rows) if k % holdout_every != holdout_every - 1]
        test = [r for k, r in enumerate(rows) if k % holdout_every == holdout_every - 1]
    return train, test


def fit_report(rows: list[dict], holdout_every: int = 4, window: int = 10) -> tuple[StepTimeModel, dict]:
    """Fit on the training split, report errors on both; the returned model is
    refitted on all steps (the report's held-out figures are of the split fit)."""
    train, test = split(rows, holdout_every)
    m = nnls_fit(train)
    _, ytr = design(train)
    _, yte = design(test) if test else (None, np.array([]))
    pte = predict(m, test) if test else np.array([])
    report = {
        "method": "scipy.optimize.nnls on relative residuals; held-out = every "
                  f"{holdout_every}th grid cell; window sums over {window} consecutive held-out steps",
        "steps": len(rows), "train_steps": len(train), "heldout_steps": len(test),
        "heldout_phases": sorted({r.get("phase", "other") for r in test}),
        "train_mape": mape(predict(m, train), ytr),
        "heldout_mape": mape(pte, yte),
        "heldout_window_mape": window_mape(pte, yte, window),
        "window_steps": window,
        "split_fit": m.to_dict(),
    }
    full = nnls_fit(rows)
    _, yall = design(rows)
    report["all_mape"] = mape(predict(full, rows), yall)
    return full, report


def capacity_scenario(name: str):
    """The workload the capacity protocol runs for a fitted profile: `scaled`
    (the small CPU engine's) or `paper` (the reference's, for a GPU), from the
    scenario registry."""
    if name not in ("scaled", "paper"):
        raise ValueError(f"unknown capacity scenario {name!r}; valid: scaled, paper")
    return get_scenario(name).scenario


def default_capacity_scenario(meta: dict) -> str:
    """`paper` for steps timed on a GPU, `scaled` otherwise."""
    gpu = meta.get("device") == "cuda" or meta.get("engine", {}).get("kind") == "gpu"
    return "paper" if gpu else "scaled"


def build_profile(name: str, model: StepTimeModel, report: dict, meta: dict, capacity_stage_s: float = 300.0,
                  log=None, scenario: str | None = None) -> dict:
    eng_meta = meta.get("engine", {})
    flags = eng_meta.get("flags", {})
    block = int(flags.get("block-size", 128))       # CPU backend: 128
    kv_tokens = eng_meta.get("kv_cache_tokens")
    if not kv_tokens:
        raise ValueError("the capture's meta has no engine KV cache size (engine.kv_cache_tokens)")
    engine = {"max_num_seqs": int(flags.get("max-num-seqs", 256)),
              "max_num_batched_tokens": int(flags.get("max-num-batched-tokens", 8192)),
              "block_size": block, "num_gpu_blocks": int(kv_tokens) // block,
              "depth": 1 if eng_meta.get("kind") == "cpu" else 2,
              "max_model_len": int(flags.get("max-model-len", 32768))}
    prof = {"name": name, "step_time": model.to_dict(), "engine": engine, "capacity": 1.0,
            "kv_cache": {"kv_cache_tokens": int(kv_tokens), "block_size": block,
                         "num_gpu_blocks": int(kv_tokens) // block,
                         "source": "the engine's start-up log line 'KV cache size: N tokens'"},
            "fit": report,
            "provenance": {"kind": "measured", "engine_version": eng_meta.get("version"),
                           "engine_kind": eng_meta.get("kind"), "hardware": meta.get("hardware"),
                           "date": meta.get("date"),
                           "fit_error": {k: report[k] for k in ("heldout_mape", "heldout_window_mape",
                                                                "train_mape")},
                           "capture": {k: meta.get(k) for k in ("steps", "capture_wall_s", "seed")}}}
    prof.update(protocol_capacity(prof, scenario or default_capacity_scenario(meta), log=log,
                                  stage_s=capacity_stage_s))
    return prof


def protocol_capacity(prof: dict, scenario: str = "scaled", log=None, stage_s: float = 300.0) -> dict:
    """The simulator's capacity protocol on a measured profile under a
    capacity scenario: `capacity` and the `capacity_protocol` record to store
    in the profile."""

    p = from_dict(prof)
    model, engine = p.step_time, p.engine
    sc = capacity_scenario(scenario)
    # start well below capacity: a call's prefill alone at full chunks bounds it
    chunk = engine["max_num_batched_tokens"]
    t_chunk = model.duration(1, chunk, chunk * (chunk + 1) / 2.0, 0.0)
    bound = 1.0 / (sc.prompt_mean / chunk * t_chunk + sc.response_mean * model.duration(1, 1, 0, sc.prompt_mean)
                   / max(1, engine["max_num_seqs"] // 4))
    cap = capacity_protocol(p, sc, seed=0, start_rate=0.25 * bound, stage_s=stage_s, progress=log)
    return {"capacity": cap["capacity"],
            "capacity_protocol": {"scenario_name": scenario, "scenario": {k: getattr(sc, k) for k in
                                               ("prompt_mean", "prompt_sd", "shared_prefix", "response_median",
                                                "response_mean")},
                                  "note": "capacity protocol on the simulator with the fitted step-time model "
                                          + ("and the scaled scenario above" if scenario == "scaled"
                                             else "and the paper workload"),
                                  **{k: cap[k] for k in ("protocol", "saturated_stage", "stages")}}}


def today() -> str:
    return datetime.date.today().isoformat()
