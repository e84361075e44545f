"""The capacity protocol of docs/model.md: one continuous run of 300 s stages
without retries, the first at `start_rate` calls/s and each later one 1.5x the
previous, until the engine's waiting queue grows by at least 0.1 calls/s over
a stage (least-squares slope of the queue sampled every second).
Ĉ = that stage's realised arrival rate minus the queue's growth rate.

The protocol itself (stage schedule, per-stage growth, stop rule, Ĉ) is
`CapacityProtocol`; it is driven either by the simulator
(`capacity_protocol`, here) or by a live engine
(`calibrate.live_capacity`), which feed it each stage's arrivals and queue
samples.
"""
from __future__ import annotations

import numpy as np

from .conditions import get_condition
from .model import Run
from .profile import Profile
from .runlog import sample_log
from .scenario import PAPER, Scenario
from .workload import make_trace


def queue_growth(t: np.ndarray, q: np.ndarray) -> float:
    """Least-squares slope of q(t) (per second)."""
    if len(t) < 2:
        return 0.0
    return float(np.polyfit(t, q, 1)[0])


class CapacityProtocol:
    """The protocol logic, independent of what runs the load.

    A driver iterates `schedule()` (stage k, start, end, rate), runs stage k's
    arrivals of the shared trace, then calls `observe(k, arrived, t, q)` with
    the number of calls sent in [start, end) and the waiting queue sampled
    every second (sample times `t` relative to the run's start, values `q`);
    `observe` returns True once the stop rule fires, after which `result()`
    holds Ĉ."""

    def __init__(self, start_rate: float = 1.0, factor: float = 1.5, stage_s: float = 300.0,
                 threshold: float = 0.1, max_stages: int = 12, seed: int = 0, progress=None):
        if start_rate <= 0 or factor <= 1 or stage_s <= 0:
            raise ValueError("need start_rate > 0, factor > 1, stage_s > 0")
        self.start_rate, self.factor, self.stage_s = start_rate, factor, stage_s
        self.threshold, self.max_stages, self.seed, self.progress = threshold, max_stages, seed, progress
        self.rates = [start_rate * factor ** k for k in range(max_stages)]
        self.stages: list[dict] = []
        self.capacity: float | None = None

    def phases(self) -> list[tuple[float, float, float]]:
        """(start, end, rate) of every stage: the trace's phases."""
        return [(k * self.stage_s, (k + 1) * self.stage_s, r) for k, r in enumerate(self.rates)]

    def schedule(self):
        for k, (a, b, r) in enumerate(self.phases()):
            yield k, a, b, r

    def observe(self, k: int, arrived: int, t: np.ndarray, q: np.ndarray, **extra) -> bool:
        a = k * self.stage_s
        growth = queue_growth(t, q)
        realised = arrived / self.stage_s
        stage = {"stage": k, "start_s": a, "rate": self.rates[k], "realised_rate": realised,
                 "queue_growth": growth, "queue_end": float(q[-1]) if len(q) else 0.0, **extra}
        self.stages.append(stage)
        if self.progress:
            self.progress(stage)
        if growth >= self.threshold:
            self.capacity = realised - growth
            return True
        return False

    def result(self) -> dict:
        if self.capacity is None:
            raise RuntimeError(f"the waiting queue never grew by {self.threshold}/s within {len(self.stages)} "
                               f"stages (last rate {self.rates[len(self.stages) - 1]:.2f} calls/s)")
        return {"capacity": self.capacity, "stages": self.stages, "saturated_stage": len(self.stages) - 1,
                "protocol": {"start_rate": self.start_rate, "factor": self.factor, "stage_s": self.stage_s,
                             "threshold": self.threshold, "seed": self.seed}}


def capacity_protocol(profile: Profile, scenario: Scenario = PAPER, seed: int = 0, start_rate: float = 1.0,
                      factor: float = 1.5, stage_s: float = 300.0, threshold: float = 0.1,
                      max_stages: int = 12, max_batched_tokens: int | None = None, progress=None) -> dict:
    """The protocol on the simulator: one run, the whole trace planned up front."""
    proto = CapacityProtocol(start_rate, factor, stage_s, threshold, max_stages, seed, progress)
    trace = make_trace(1.0, scenario, seed, phases=proto.phases())
    run = Run(profile, trace, get_condition("no-retry"), scenario, seed, max_batched_tokens)
    for k, a, b, r in proto.schedule():
        run.env.run(until=b)
        ts = np.arange(a, b, 1.0)
        q = sample_log(run.engine.gauge_log, ts)
        arrived = int(np.count_nonzero((trace.arrival >= a) & (trace.arrival < b)))
        if proto.observe(k, arrived, ts, q):
            break
    return proto.result()
