"""Named conditions of SPEC §3: a client configuration, a proxy
configuration and an engine cap."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .policy.client import ClientConfig
from .policy.proxy import ProxyConfig
from .scenario import Scenario


@dataclass(frozen=True)
class Condition:
    name: str
    retries: bool
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    engine_cap: int | None = None      # Q: the engine refuses beyond it (503)

    def client_config(self, scenario: Scenario) -> ClientConfig:
        return ClientConfig(deadline_s=scenario.deadline_s,
                            max_retries=scenario.max_retries if self.retries else 0,
                            backoff_min_s=scenario.backoff_min_s, backoff_max_s=scenario.backoff_max_s,
                            max_retry_after_s=scenario.max_retry_after_s)

    def settings(self) -> dict:
        return {"retries": "on" if self.retries else "off", "cancellation": self.proxy.cancellation,
                "engine_cap": self.engine_cap}


def _c(name, retries, cancellation="off", engine_cap=None) -> Condition:
    return Condition(name, retries, ProxyConfig(cancellation=cancellation), engine_cap)


CONDITIONS: dict[str, Condition] = {c.name: c for c in [
    _c("no-retry", False),
    _c("no-retry+cancel", False, "now"),
    _c("no-control", True),
    _c("cancel", True, "now"),
    _c("engine-cap-338", True, engine_cap=338),
    _c("engine-cap-338+cancel", True, "now", engine_cap=338),
    _c("engine-cap-100", True, engine_cap=100),
]}

DIAGNOSTIC = ("no-control", "cancel", "no-retry+cancel", "no-retry")


def engine_cap_for(capacity: float, scenario: Scenario) -> int:
    """⌈deadline · Ĉ⌉: the queue a deadline's worth of capacity drains."""
    return math.ceil(scenario.deadline_s * capacity)


def get_condition(name: str) -> Condition:
    try:
        return CONDITIONS[name]
    except KeyError:
        raise ValueError(f"unknown condition {name!r}; valid: {', '.join(CONDITIONS)}") from None
