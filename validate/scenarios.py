"""Validation scenarios: the workload and client of SPEC §1–§2 (every constant a
`sim.scenario.Scenario` parameter), the engine flags the live engine is started
with, and the seed of the trace.

- `paper`: SPEC as written (947 s of arrivals, 120 s deadline) — the default
  for `--engine gpu`, where a point takes ~17 minutes live.
- `cpu-small`: the same dynamics on the tiny CPU engine in about 6 minutes a
  point. All times are SPEC's divided by 4 (base 30 s, pulse 26.75 s at 2.7 Ĉ,
  hold 180 s, deadline 30 s, 15 s recovery windows, horizon 210 s; the
  queue-growth bound of the recovery rule scales the other way, to 0.04/s), so
  the pulse's backlog still exceeds one deadline (1.7 x 26.75 s = 45 s of work
  at capacity against a 30 s deadline) and the hold still spans six deadlines. Prompts are 3,600 ±
  360 tokens with a 600-token shared prefix and responses median 90 / mean 120
  tokens (SPEC's ratios, 30:1 prompt to response, at 0.3 of its lengths), which
  keeps the call rate at the CPU engine's capacity low enough (a few calls/s)
  that the load generator and proxy, sharing two cores with the engine, do not
  starve it. The client's backoff wait (0.25–3 s) is kept: it is a client
  constant, not a time scale of the engine. Sized with the simulator on the
  measured `vllm-cpu-tiny` profile (Ĉ 4.29 calls/s under this workload), seed 0:
  no-control does not recover (hold delivered 0%), no-retry recovers 165 s
  after the pulse (62%), no-retry+cancel at 105 s (92%), coalesce at 165 s
  (100%) — the reference's ordering. At times / 6 the 10 s windows held too
  few calls (~25) for the recovery rule's 98% and queue-growth tests to be
  stable. The proxy's own times (deferral
  W = 10 s, the retry budget's 60 s window) are divided by 4 too.
- `cpu-tiny`: cpu-small's workload at times / 16: a 3-minute smoke test of the
  harness (CI runs it), too short to judge the model by.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from sim.conditions import Condition
from sim.scenario import PAPER, Scenario

SCALE = 4.0


@dataclass(frozen=True)
class ValidationScenario:
    name: str
    scenario: Scenario
    engine_args: list[str] = field(default_factory=list)   # extra flags for the live engine
    seed: int = 0
    time_scale: float = 1.0          # SPEC's times are divided by this
    about: str = ""

    def condition(self, cond: Condition) -> Condition:
        """The condition with the proxy's own times (deferral W, the retry
        budget's window) divided by the time scale, like the workload's."""
        if self.time_scale == 1.0:
            return cond
        p = cond.proxy
        return replace(cond, proxy=replace(p, defer_s=p.defer_s / self.time_scale,
                                           budget_window_s=p.budget_window_s / self.time_scale))

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "engine_args": list(self.engine_args),
                "time_scale": self.time_scale, "about": self.about, **self.scenario.to_dict()}


def _scaled(k: float) -> Scenario:
    return PAPER.with_(base_s=PAPER.base_s / k, pulse_s=PAPER.pulse_s / k, hold_s=PAPER.hold_s / k,
                       deadline_s=PAPER.deadline_s / k, max_retry_after_s=PAPER.max_retry_after_s / k,
                       delivery_horizon_s=PAPER.delivery_horizon_s / k, primary_skip_s=PAPER.primary_skip_s / k,
                       window_s=PAPER.window_s / k, recovery_queue_growth=PAPER.recovery_queue_growth * k,
                       prompt_mean=3600.0, prompt_sd=360.0, shared_prefix=600, mixed_prompt_len=900,
                       response_median=90.0, response_mean=120.0)


SCENARIOS: dict[str, ValidationScenario] = {s.name: s for s in [
    ValidationScenario("paper", PAPER, about="SPEC §1-§2 as written"),
    ValidationScenario("cpu-small", _scaled(SCALE), time_scale=SCALE,
                       about="SPEC's times / 4, prompts and responses x 0.3, for the tiny CPU engine"),
    ValidationScenario("cpu-tiny", _scaled(16.0), time_scale=16.0,
                       about="cpu-small's workload at SPEC's times / 16 (7.5 s deadline): a smoke test of "
                             "the harness in about 3 minutes a point, not a validation"),
]}


def get_scenario(name: str) -> ValidationScenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}") from None
