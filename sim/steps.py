"""Step rows: recorded engine steps (one dict per step with its composition
and `duration_s`, the schema of `calibrate/capture.py`) as the step-time
model's features, and the model's prediction of them."""
from __future__ import annotations

import numpy as np

from .engine.step_time import COEFFICIENTS, StepTimeModel

FEATURES = ("const", "num_reqs", "num_tokens", "prefill_pairs", "decode_ctx")


def design(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The FEATURES of step rows (one row per step) and their durations."""
    X = np.array([[1.0, r["num_reqs"], r["num_tokens"], r["prefill_pairs"], r["decode_ctx"]] for r in rows],
                 dtype=float)
    y = np.array([r["duration_s"] for r in rows], dtype=float)
    return X, y


def predict(model: StepTimeModel, rows: list[dict]) -> np.ndarray:
    """The model's duration of each step row."""
    if model.form != "linear":
        return np.array([model.duration(r["num_reqs"], r["num_tokens"], r["prefill_pairs"], r["decode_ctx"])
                         for r in rows], dtype=float)
    X, _ = design(rows)
    return X @ np.array([getattr(model, k) for k in COEFFICIENTS])
