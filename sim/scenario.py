"""The constants of SPEC §1, §2 and §5 as one value, so that every one of them
is a parameter (the live harness runs scaled-down scenarios)."""
from __future__ import annotations

from dataclasses import dataclass, asdict, replace


@dataclass(frozen=True)
class Scenario:
    # §1 workload phases (seconds) and rates (multiples of capacity)
    base_s: float = 120.0
    pulse_s: float = 107.0
    hold_s: float = 720.0
    base_load: float = 0.6
    hold_load: float = 0.6
    pulse: float = 2.7
    # §1 prompts and responses (tokens)
    prompt_mean: float = 12_000.0
    prompt_sd: float = 1_200.0
    shared_prefix: int = 2_000
    mixed_prompt_len: int = 3_000
    response_median: float = 300.0
    response_mean: float = 400.0
    # §2 client
    deadline_s: float = 120.0
    max_retries: int = 3
    backoff_min_s: float = 0.25
    backoff_max_s: float = 3.0
    max_retry_after_s: float = 120.0
    # §5 measures
    delivery_horizon_s: float = 840.0
    primary_skip_s: float = 120.0   # primary cohort starts this long after the pulse ends
    window_s: float = 60.0
    recovery_delivery: float = 0.98
    recovery_queue_mean: float = 2.0
    recovery_queue_growth: float = 0.01

    @property
    def pulse_start(self) -> float:
        return self.base_s

    @property
    def pulse_end(self) -> float:
        return self.base_s + self.pulse_s

    @property
    def hold_end(self) -> float:
        return self.pulse_end + self.hold_s

    @property
    def primary_start(self) -> float:
        return self.pulse_end + self.primary_skip_s

    def cohorts(self) -> dict[str, tuple[float, float]]:
        return {
            "pulse": (self.pulse_start, self.pulse_end),
            "hold": (self.pulse_end, self.hold_end),
            "primary": (self.primary_start, self.hold_end),
        }

    def with_(self, **kw) -> "Scenario":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)


PAPER = Scenario()
