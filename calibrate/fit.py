"""Fit the step-time model (docs/model.md, "Calibration") to recorded steps and write a profile.

    duration = fixed_s + per_request_s*num_reqs + per_token_s*num_tokens
               + per_prefill_pair_s*prefill_pairs + per_decode_ctx_s*decode_ctx

Steps come from steps files (`validate.step_log`): a capture grid on a quiet
engine, steps recorded under load (a live capacity run, a validation point),
or several of them combined; each file is one data source.

Two parts, summed into the profile's coefficients (the simulator runs one
step after another, so its step time is the engine's step-to-step interval):
  * the forward step: the five features above fitted to each step's recorded
    duration (start to end), by non-negative least squares
    (scipy.optimize.nnls), weighted by `weights`: ``time`` (plain residuals in
    seconds: the fit gets the sum of step times right, which is what sets the
    rate an engine sustains and what the simulator integrates; steps recorded
    under load range from 2 ms decodes to 100 ms full chunks) or ``relative``
    (each row divided by its measured duration: the fit minimises squared
    relative error, which is what the per-step MAPE reports, and favours the
    many short steps);
  * the engine loop's time outside the step while work is waiting (output
    processing, streaming, taking in new requests): the gap from a step's end
    to the next one's start, where the next followed immediately (`interval_s`
    of the row), fitted as a term per step and one per request (nnls on the
    gaps, least squares: the mean gap is what sets the sustained step rate).
    It adds to fixed_s and per_request_s.

Held-out split: whole grid cells (phases), every `holdout_every`-th one in
capture order, so no held-out step has a neighbour from the same batch in the
training set; steps recorded under load (no grid cell) are cut into blocks of
`BLOCK_STEPS` consecutive steps, which serve as the cells. Errors: MAPE per
step, and MAPE of step-time sums over windows of `window` consecutive held-out
steps (what a simulation integrates), for the forward step (against durations)
and for the profile (forward + loop, against intervals).
"""
from __future__ import annotations

import datetime

import numpy as np
from scipy.optimize import nnls

from sim.capacity import capacity_protocol
from sim.engine.step_time import COEFFICIENTS, StepTimeModel
from sim.profile import from_dict
from sim.scenario import get_scenario
from sim.steps import FEATURES, design, predict
from validate.step_log import read_steps

__all__ = ["FEATURES", "design", "predict", "nnls_fit", "fit_report", "build_profile", "load_sources"]

BLOCK_STEPS = 50          # consecutive steps recorded under load that form one held-out cell


def load_sources(paths: list[str]) -> tuple[dict, list[dict], list[dict]]:
    """Steps files combined: (meta of the first file that names the engine's
    KV cache size, else of the first; all rows; one source description per
    file: kind, path, steps, date, hardware). Rows without a grid cell get
    blocks of BLOCK_STEPS as cells; with several files, cells are prefixed by
    the file's position so they stay distinct."""
    if not paths:
        raise ValueError("no steps files given")
    metas, rows, sources = [], [], []
    for n, path in enumerate(paths):
        meta, rs = read_steps(path)
        if not rs:
            raise ValueError(f"{path}: no steps")
        src = meta.get("source")
        src = src if isinstance(src, dict) else ({"note": src} if src else {})
        kind = src.get("kind") or ("grid" if meta.get("grid") else "live run")
        for k, r in enumerate(rs):
            cell = r.get("phase") or "other"
            if cell == "other":
                cell = f"{kind} block {k // BLOCK_STEPS}"
            rows.append(dict(r, phase=f"{n}: {cell}" if len(paths) > 1 else cell))
        metas.append(meta)
        sources.append({"kind": kind, "path": str(path), "steps": len(rs), "date": meta.get("date"),
                        **{k: v for k, v in src.items() if k != "kind"}})
    meta = next((m for m in metas if (m.get("engine") or {}).get("kv_cache_tokens")), metas[0])
    return meta, rows, sources


WEIGHTS = ("time", "relative")


def nnls_fit(rows: list[dict], weights: str = "time") -> StepTimeModel:
    """The forward step: the five features fitted to `duration_s`."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; valid: {', '.join(WEIGHTS)}")
    X, y = design(rows)
    if len(rows) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(rows)}")
    if np.any(y <= 0):
        raise ValueError("step durations must be positive")
    w = 1.0 / y if weights == "relative" else np.ones_like(y)
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


def with_intervals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("interval_s") is not None and r["interval_s"] >= r["duration_s"]]


def loop_fit(rows: list[dict]) -> dict:
    """The engine loop's time between steps while work is waiting: gap =
    interval_s - duration_s = per_step_s + per_request_s * num_reqs (nnls);
    zeros when no row has an interval."""
    ok = with_intervals(rows)
    if len(ok) < 2:
        return {"per_step_s": 0.0, "per_request_s": 0.0, "steps": len(ok), "mean_gap_s": None}
    X = np.array([[1.0, r["num_reqs"]] for r in ok])
    gap = np.array([r["interval_s"] - r["duration_s"] for r in ok])
    s = X.max(axis=0)
    coef, _ = nnls(X / s, gap)
    coef = coef / s
    return {"per_step_s": float(coef[0]), "per_request_s": float(coef[1]), "steps": len(ok),
            "mean_gap_s": float(gap.mean()), "mean_interval_s": float(np.mean([r["interval_s"] for r in ok]))}


def combine(forward: StepTimeModel, loop: dict) -> StepTimeModel:
    """The profile's step time: the forward step plus the loop's gap terms."""
    d = forward.to_dict()
    d["fixed_s"] += loop["per_step_s"]
    d["per_request_s"] += loop["per_request_s"]
    return StepTimeModel(**d)


def _interval_errors(model: StepTimeModel, rows: list[dict], window: int) -> tuple[float, float]:
    ok = with_intervals(rows)
    if not ok:
        return None, None
    y = np.array([r["interval_s"] for r in ok])
    p = predict(model, ok)
    return mape(p, y), window_mape(p, y, window)


def fit_report(rows: list[dict], holdout_every: int = 4, window: int = 10,
               loop: bool = True, weights: str = "time") -> tuple[StepTimeModel, dict]:
    """Fit on the training split, report errors on both; the returned model is
    refitted on all steps (the report's held-out figures are of the split
    fit). With `loop`, the model includes the engine loop's time between
    steps (`loop_fit`) and the report its error against step-to-step intervals."""
    train, test = split(rows, holdout_every)
    m = nnls_fit(train, weights)
    _, ytr = design(train)
    _, yte = design(test) if test else (None, np.array([]))
    pte = predict(m, test) if test else np.array([])
    report = {
        "method": f"scipy.optimize.nnls on {'relative residuals' if weights == 'relative' else 'residuals in s'}; "
                  "held-out = every "
                  f"{holdout_every}th grid cell (steps under load: blocks of {BLOCK_STEPS} steps); "
                  f"window sums over {window} consecutive held-out steps",
        "steps": len(rows), "train_steps": len(train), "heldout_steps": len(test),
        "max_num_reqs": max((r["num_reqs"] for r in rows), default=0),     # the busiest step fitted
        "heldout_phases": sorted({r.get("phase", "other") for r in test}),
        "train_mape": mape(predict(m, train), ytr),
        "heldout_mape": mape(pte, yte),
        "heldout_window_mape": window_mape(pte, yte, window),
        "window_steps": window,
        "split_fit": m.to_dict(),
    }
    report["weights"] = weights
    report["train_sum_ratio"] = float(ytr.sum() / predict(m, train).sum())
    report["heldout_sum_ratio"] = float(yte.sum() / pte.sum()) if len(yte) else None
    full = nnls_fit(rows, weights)
    _, yall = design(rows)
    report["all_mape"] = mape(predict(full, rows), yall)
    if not loop:
        report["loop"] = None
        return full, report
    split_loop = loop_fit(train)
    report["heldout_interval_mape"], report["heldout_interval_window_mape"] = \
        _interval_errors(combine(m, split_loop), test, window)
    lp = loop_fit(rows)
    report["forward"] = full.to_dict()
    report["loop"] = dict(lp, note="the engine loop's time from a step's end to the next one's start while work "
                                   "was waiting, added to fixed_s (per_step_s) and per_request_s")
    return combine(full, lp), report


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


FIT_ERROR_KEYS = ("heldout_mape", "heldout_window_mape", "train_mape", "heldout_interval_mape",
                  "heldout_interval_window_mape")


def build_profile(name: str, model: StepTimeModel, report: dict, meta: dict, capacity_stage_s: float = 300.0,
                  log=None, scenario: str | None = None, sources: list[dict] | None = None) -> dict:
    """A measured profile from a fit: its step time, the engine's settings
    and KV cache from `meta`, provenance (engine, the hardware the steps were
    recorded on, `sources` — where the data came from — and the held-out
    error), and Ĉ from the simulator's capacity protocol."""
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
                           "fit_error": {k: report[k] for k in FIT_ERROR_KEYS if k in report},
                           "data": sources or [{"kind": "grid", "steps": report["steps"], "date": meta.get("date")}],
                           "capture": {k: meta.get(k) for k in ("steps", "capture_wall_s", "seed")}}}
    prof.update(protocol_capacity(prof, scenario or default_capacity_scenario(meta), log=log,
                                  stage_s=capacity_stage_s))
    return prof


def fit_profile(paths: list[str], name: str, window: int = 10, scenario: str | None = None, log=None,
                loop: bool = True, weights: str = "time") -> dict:
    """Fit steps files (alone or combined) into a profile (`build_profile`)."""
    meta, rows, sources = load_sources(paths)
    model, rep = fit_report(rows, window=window, loop=loop, weights=weights)
    return build_profile(name, model, rep, meta, log=log, scenario=scenario, sources=sources)


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
