"""The open-loop trace of SPEC §1: every call's planned arrival, prompt and
response length, fixed by a seed and replayed identically across conditions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scenario import Scenario


@dataclass(frozen=True)
class Trace:
    arrival: np.ndarray       # planned arrival time of each call (s), sorted
    prompt_len: np.ndarray    # prompt tokens (int64), shared prefix included
    max_tokens: np.ndarray    # response tokens (int64); generated to full length
    shared_prefix: int        # leading prompt tokens identical across calls

    def __len__(self) -> int:
        return len(self.arrival)


def lognormal_params(median: float, mean: float) -> tuple[float, float]:
    """mu, sigma of a lognormal with the given median and mean."""
    mu = np.log(median)
    sigma = float(np.sqrt(2.0 * np.log(mean / median)))
    return float(mu), sigma


def poisson_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """Poisson process on [start, end): the count is Poisson, times uniform."""
    if rate <= 0 or end <= start:
        return np.empty(0)
    n = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, n))


def make_trace(capacity: float, scenario: Scenario, seed: int, mixed_prompts: bool = False,
               phases: list[tuple[float, float, float]] | None = None) -> Trace:
    """The trace for one seed. `phases` is a list of (start, end, rate calls/s);
    by default the base / pulse / hold phases of the scenario at capacity."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    s = scenario
    if phases is None:
        phases = [
            (0.0, s.base_s, s.base_load * capacity),
            (s.pulse_start, s.pulse_end, s.pulse * capacity),
            (s.pulse_end, s.hold_end, s.hold_load * capacity),
        ]
    rng = np.random.default_rng(seed)
    arrival = np.concatenate([poisson_arrivals(rng, r, a, b) for a, b, r in phases])
    n = len(arrival)
    prompt = np.rint(rng.normal(s.prompt_mean, s.prompt_sd, n)).astype(np.int64)
    if mixed_prompts:
        short = rng.random(n) < 0.5
        prompt[short] = s.mixed_prompt_len
    prompt = np.maximum(prompt, s.shared_prefix + 1)
    mu, sigma = lognormal_params(s.response_median, s.response_mean)
    resp = np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)
    return Trace(arrival=arrival, prompt_len=prompt, max_tokens=resp, shared_prefix=s.shared_prefix)
