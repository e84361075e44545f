"""The capacity protocol of SPEC §6 on the simulator: one continuous run of
300 s stages without retries, the first at `start_rate` calls/s and each later
one 1.5x the previous, until the engine's waiting queue grows by at least 0.1
calls/s over a stage (least-squares slope of the queue sampled every second).
Ĉ = that stage's realised arrival rate minus the queue's growth rate."""
from __future__ import annotations

import math

import numpy as np

from .conditions import get_condition
from .model import Run
from .profile import Profile
from .scenario import Scenario, PAPER
from .workload import make_trace


def queue_growth(t: np.ndarray, q: np.ndarray) -> float:
    """Least-squares slope of q(t) (per second)."""
    if len(t) < 2:
        return 0.0
    return float(np.polyfit(t, q, 1)[0])


def capacity_protocol(profile: Profile, scenario: Scenario = PAPER, seed: int = 0, start_rate: float = 1.0,
                      factor: float = 1.5, stage_s: float = 300.0, threshold: float = 0.1,
                      max_stages: int = 12, max_batched_tokens: int | None = None, progress=None) -> dict:
    if start_rate <= 0 or factor <= 1 or stage_s <= 0:
        raise ValueError("need start_rate > 0, factor > 1, stage_s > 0")
    rates = [start_rate * factor ** k for k in range(max_stages)]
    phases = [(k * stage_s, (k + 1) * stage_s, r) for k, r in enumerate(rates)]
    trace = make_trace(1.0, scenario, seed, phases=phases)
    run = Run(profile, trace, get_condition("no-retry"), scenario, seed, max_batched_tokens)
    stages = []
    for k, r in enumerate(rates):
        a, b = k * stage_s, (k + 1) * stage_s
        run.env.run(until=b)
        log = run.engine.gauge_log
        g = np.array(log, dtype=float)
        ts = np.arange(a, b, 1.0)
        idx = np.searchsorted(g[:, 0], ts, side="right") - 1
        q = np.where(idx >= 0, g[np.maximum(idx, 0), 1], 0.0)
        growth = queue_growth(ts, q)
        arrived = int(np.count_nonzero((trace.arrival >= a) & (trace.arrival < b)))
        realised = arrived / stage_s
        stage = {"stage": k, "start_s": a, "rate": r, "realised_rate": realised,
                 "queue_growth": growth, "queue_end": float(q[-1])}
        stages.append(stage)
        if progress:
            progress(stage)
        if growth >= threshold:
            return {"capacity": realised - growth, "stages": stages, "saturated_stage": k,
                    "protocol": {"start_rate": start_rate, "factor": factor, "stage_s": stage_s,
                                 "threshold": threshold, "seed": seed}}
    raise RuntimeError(f"the waiting queue never grew by {threshold}/s within {max_stages} stages "
                       f"(last rate {rates[-1]:.2f} calls/s)")
