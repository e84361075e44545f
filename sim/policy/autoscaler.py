"""The autoscaler before a fleet of replicas, as a clock-free policy object:
Kubernetes' Horizontal Pod Autoscaler (HPA) on one metric.

At each sync period the driver reads the metric and calls
`Autoscaler.decide(t, ...)`, which returns the replica count the HPA sets
(docs/autoscaling.md cites the HPA's documented algorithm):

1. The metric's usage ratio to its target. A per-replica metric
   (`waiting`: engine waiting requests, `kv`: KV cache usage 0..1,
   `in_flight`: requests a replica holds) is averaged over the ready
   replicas (the pods with metrics); `proxy_queue` (the proxy's queue, an
   external metric with an average-value target) is the total over the
   target times the current replicas.
2. desired = ceil(ready x ratio); within the tolerance (|ratio - 1| <=
   0.1) the current count stays. Replicas still starting have no metric:
   on a scale-up they count as using 0, and the ratio is taken again over
   them too; if that ratio falls within the tolerance or reverses the
   direction, the current count stays (the HPA's rule for pods not yet
   ready or missing metrics).
3. Stabilisation: the recommendation is the lowest of the recommendations
   made over the last `scale_up_stabilization_s` (a scale-up) and the
   highest over the last `scale_down_stabilization_s` (a scale-down),
   then the scaling policies limit the change from the count at the start
   of each policy's period (default: up by max(100 %, 4 replicas) per 15 s,
   down by 100 % per 15 s), then [min, max] replicas.

`ProvisioningDelay` draws a new replica's time to become ready (model load
and warm-up) from the run's seeded generator: fixed, uniform or lognormal.
Nothing here reads a clock: times are the caller's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

METRICS = ("waiting", "kv", "in_flight", "proxy_queue")
PER_REPLICA = ("waiting", "kv", "in_flight")
PROVISIONING = ("fixed", "uniform", "lognormal")
DRAIN = ("finish", "cancel")


@dataclass(frozen=True)
class AutoscalerConfig:
    """The HPA's settings (defaults: the HPA's own, see docs/autoscaling.md)
    and the replicas' provisioning delay and drain."""
    metric: str = "waiting"
    target: float = 8.0
    min_replicas: int = 1
    max_replicas: int = 4
    initial_replicas: int | None = None       # replicas ready at the start (None: min_replicas)
    tolerance: float = 0.1
    sync_period_s: float = 15.0
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    scale_up_percent: float = 100.0           # scale-up policies (selectPolicy Max): +100 % ...
    scale_up_pods: int = 4                    # ... or +4 replicas per scale_up_period_s, whichever is more
    scale_up_period_s: float = 15.0
    scale_down_percent: float = 100.0         # scale-down policy: -100 % per scale_down_period_s
    scale_down_period_s: float = 15.0
    provisioning: str = "fixed"
    provisioning_s: float = 120.0             # fixed: the delay; uniform: its low end; lognormal: its median
    provisioning_max_s: float | None = None   # uniform: its high end
    provisioning_sigma: float = 0.25          # lognormal: the log's standard deviation
    drain: str = "finish"                     # a drained replica's running requests: finish, or cancel (503)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(msg)
        if self.metric not in METRICS:
            bad(f"metric must be one of {', '.join(METRICS)}; got {self.metric!r}")
        if not self.target > 0:
            bad(f"target must be positive; got {self.target!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            bad(f"replicas need 1 <= min_replicas <= max_replicas; got {self.min_replicas}, {self.max_replicas}")
        if not self.min_replicas <= self.initial <= self.max_replicas:
            bad(f"initial_replicas must lie in [min_replicas, max_replicas]; got {self.initial_replicas}")
        if self.provisioning not in PROVISIONING:
            bad(f"provisioning must be one of {', '.join(PROVISIONING)}; got {self.provisioning!r}")
        if self.drain not in DRAIN:
            bad(f"drain must be one of {', '.join(DRAIN)}; got {self.drain!r}")
        if not self.sync_period_s > 0:
            bad(f"sync_period_s must be positive; got {self.sync_period_s!r}")
        if self.provisioning == "uniform" and (self.provisioning_max_s is None
                                               or self.provisioning_max_s < self.provisioning_s):
            bad("provisioning = uniform needs provisioning_max_s >= provisioning_s")

    @property
    def initial(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas

    @property
    def fixed(self) -> bool:
        """min == max: the fleet never changes."""
        return self.min_replicas == self.max_replicas

    def document(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None}
        d["initial_replicas"] = self.initial
        return d


class ProvisioningDelay:
    """A new replica's provisioning delay, drawn from `rng` (a numpy
    Generator): fixed, uniform(provisioning_s, provisioning_max_s), or
    lognormal with median provisioning_s and log sd provisioning_sigma."""

    def __init__(self, config: AutoscalerConfig, rng):
        self.config, self.rng = config, rng

    def draw(self) -> float:
        c = self.config
        if c.provisioning == "fixed":
            return float(c.provisioning_s)
        if c.provisioning == "uniform":
            return float(self.rng.uniform(c.provisioning_s, c.provisioning_max_s))
        return float(c.provisioning_s * math.exp(c.provisioning_sigma * self.rng.standard_normal()))


class Autoscaler:
    """The HPA's decision at each sync (see the module docstring). It keeps
    its recommendations (for the stabilisation windows) and its scale
    events (for the scaling policies)."""

    def __init__(self, config: AutoscalerConfig):
        self.config = config
        self.recommendations: list[tuple[float, int]] = []    # (t, raw recommendation)
        self.events: list[tuple[float, int]] = []             # (t, change in replicas) of each scale

    def usage_ratio(self, values: list[float], current: int) -> float:
        """The metric's ratio to its target: `values` the ready replicas'
        (a per-replica metric) or one total (proxy_queue)."""
        c = self.config
        if c.metric in PER_REPLICA:
            return (sum(values) / len(values)) / c.target if values else 0.0
        return sum(values) / (c.target * max(1, current))

    def recommend(self, values: list[float], ready: int, starting: int) -> int:
        """The raw recommendation (steps 1 and 2) for `ready` replicas with
        the metric's `values` and `starting` ones without a metric yet."""
        c = self.config
        current = ready + starting
        if c.metric not in PER_REPLICA:     # an external metric: every replica counts
            ratio = self.usage_ratio(values, current)
            if abs(ratio - 1.0) <= c.tolerance:
                return current
            return math.ceil(ratio * current)
        if not ready:
            return current
        ratio = self.usage_ratio(values, current)
        if starting == 0 or ratio <= 1.0:
            # missing metrics count as the target on a scale-down: the ratio over ready replicas stands
            if abs(ratio - 1.0) <= c.tolerance:
                return current
            if starting and ratio < 1.0:
                new = (sum(values) / c.target + starting) / current
                if abs(new - 1.0) <= c.tolerance or new > 1.0:
                    return current
                n = math.ceil(new * current)
                return current if n > current else n
            return math.ceil(ratio * ready)
        # a scale-up with replicas starting: they count as using 0
        new = (sum(values) / c.target) / current
        if abs(new - 1.0) <= c.tolerance or new < 1.0:
            return current
        n = math.ceil(new * current)
        return current if n < current else n

    def decide(self, t: float, values: list[float], ready: int, starting: int) -> int:
        """The replica count the HPA sets at t (steps 1 to 3)."""
        c = self.config
        current = ready + starting
        rec = self.recommend(values, ready, starting)
        self.recommendations.append((t, rec))
        up_cut, down_cut = t - c.scale_up_stabilization_s, t - c.scale_down_stabilization_s
        keep = min(up_cut, down_cut)
        self.recommendations = [(s, r) for s, r in self.recommendations if s >= keep]
        up = min(r for s, r in self.recommendations if s >= up_cut)
        down = max(r for s, r in self.recommendations if s >= down_cut)
        desired = min(max(current, up), down)
        if desired > current:
            desired = min(desired, self._up_limit(t, current), c.max_replicas)
        elif desired < current:
            desired = max(desired, self._down_limit(t, current), c.min_replicas)
        desired = min(max(desired, c.min_replicas), c.max_replicas)
        if desired != current:
            self.events.append((t, desired - current))
        return desired

    def _period_start(self, t: float, period: float, current: int) -> int:
        """The replicas at the start of the period ending at t."""
        changed = sum(d for s, d in self.events if s > t - period)
        return current - changed

    def _up_limit(self, t: float, current: int) -> int:
        c = self.config
        start = self._period_start(t, c.scale_up_period_s, current)
        return max(math.ceil(start * (1.0 + c.scale_up_percent / 100.0)), start + c.scale_up_pods)

    def _down_limit(self, t: float, current: int) -> int:
        c = self.config
        start = self._period_start(t, c.scale_down_period_s, current)
        return math.ceil(start * (1.0 - c.scale_down_percent / 100.0))


__all__ = ["METRICS", "PROVISIONING", "DRAIN", "AutoscalerConfig", "ProvisioningDelay", "Autoscaler"]
