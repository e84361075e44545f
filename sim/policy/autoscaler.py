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

`ReplicaSet` is the fleet's replica slots under the HPA, one state machine
for both drivers (the simulator's `sim.autoscale.Scaling`, the live
harness's `validate.autoscale.LiveScaling`): each slot is off, starting,
ready or draining; `sync(t, metric, empty)` runs one sync period's decision
and says which replicas to start, which starting ones to stop and which
ready ones now drain; the driver reports `became_ready(t, r)` when a
started replica takes traffic and `off(t, r)` when a drained one is empty.
A scale-up starts the lowest off slots; a scale-down stops the newest
starting replicas first, then drains ready ones from the highest index (as
a ReplicaSet deletes not-ready pods first).

`ScalingDriver` is what both drivers do with the slots (the metric, the
router's mask, the empty check, the sync period's work); each supplies its
clock, its readings of the replicas and its actions (starting an engine).
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


OFF, STARTING, READY, DRAINING = 0, 1, 2, 3


class Life:
    """One replica's life from a scale-up (replicas ready at 0 have one too,
    decided and ready at 0)."""
    __slots__ = ("replica", "decided_at", "ready_at", "stopped_at", "ended_at")

    def __init__(self, replica: int, decided_at: float, ready_at: float | None = None):
        self.replica, self.decided_at, self.ready_at = replica, decided_at, ready_at
        self.stopped_at = None          # the scale-down that stopped or drained it
        self.ended_at = None            # off from then


class ReplicaSet:
    """The replica slots of a fleet built at `config.max_replicas` under the
    HPA (see the module docstring). `state[r]` is OFF, STARTING, READY or
    DRAINING; `lives` every replica's life in order of decision, `current[r]`
    slot r's latest; `counts` (t, ready, starting, draining) at each change
    (`log(t)` appends one); `decisions` (t, from, to) at each change of the
    count."""

    def __init__(self, config: AutoscalerConfig):
        n, k = config.max_replicas, config.initial
        self.config = config
        self.state = [READY if r < k else OFF for r in range(n)]
        self.hpa = Autoscaler(config)
        self.lives: list[Life] = [Life(r, 0.0, 0.0) for r in range(k)]
        self.current: list[Life | None] = self.lives + [None] * (n - k)
        self.counts: list[tuple] = [(0.0, k, 0, 0)]
        self.decisions: list[tuple] = []

    def sync(self, t: float, metric, empty) -> tuple[list[int], list[int], list[int]]:
        """One sync at t: draining replicas that `empty(r)` finds empty go
        off, then the HPA sets the count from `metric(ready replicas)` (a list
        of values). Returns (started, unstarted, drained): replicas now
        starting (the driver starts each and reports `became_ready`),
        starting ones now off (the driver stops their start), ready ones now
        draining (the driver sends them nothing new and reports `off` once
        each is empty). The driver calls `log(t)` once it has carried them out."""
        state = self.state
        for r, s in enumerate(state):
            if s == DRAINING and empty(r):
                self.off(t, r)
        ready = [r for r, s in enumerate(state) if s == READY]
        starting = state.count(STARTING)
        current = len(ready) + starting
        desired = self.hpa.decide(t, metric(ready), len(ready), starting)
        started: list[int] = []
        unstarted: list[int] = []
        drained: list[int] = []
        if desired != current:
            self.decisions.append((t, current, desired))
        if desired > current:
            for r in [r for r, s in enumerate(state) if s == OFF][:desired - current]:
                state[r] = STARTING
                life = self.current[r] = Life(r, t)
                self.lives.append(life)
                started.append(r)
        elif desired < current:
            cur = self.current
            newest = sorted((r for r, s in enumerate(state) if s == STARTING),
                            key=lambda r: (cur[r].decided_at, r), reverse=True)
            highest = [r for r in range(len(state) - 1, -1, -1) if state[r] == READY]
            for r in (newest + highest)[:current - desired]:
                cur[r].stopped_at = t
                if state[r] == STARTING:
                    self.off(t, r)
                    unstarted.append(r)
                else:
                    state[r] = DRAINING
                    drained.append(r)
        return started, unstarted, drained

    def became_ready(self, t: float, r: int) -> None:
        """Replica r, started, takes traffic from t."""
        self.current[r].ready_at = t
        self.state[r] = READY
        self.log(t)

    def off(self, t: float, r: int) -> None:
        """Replica r is off from t (a drained one found empty, or a start stopped)."""
        self.state[r] = OFF
        self.current[r].ended_at = t

    def log(self, t: float) -> None:
        """Append the counts at t where they changed."""
        s = self.state
        row = (t, s.count(READY), s.count(STARTING), s.count(DRAINING))
        if row[1:] != self.counts[-1][1:]:
            if self.counts[-1][0] == t:
                self.counts[-1] = row
            else:
                self.counts.append(row)

    def replica_seconds(self, end: float) -> float:
        """Replicas starting, ready or draining, integrated over [0, end]."""
        total, rows = 0.0, self.counts
        for (t0, a, b, c), nxt in zip(rows, rows[1:] + [(end,)]):
            t1 = min(nxt[0], end)
            if t1 > t0:
                total += (a + b + c) * (t1 - t0)
        return total


class ScalingDriver:
    """What both drivers of the replica slots do, clock-free: the metric,
    the router's mask, the empty check and one sync period's work. A driver
    (the simulator's `sim.autoscale.Scaling`, the live harness's
    `validate.autoscale.LiveScaling`) subclasses it and supplies its clock:
    it calls `sync(t)` every sync period and `became_ready(t, r)` when a
    started replica takes traffic; its readings of replica r: `waiting(r)`
    (its engine's waiting requests), `kv(r)` (its KV cache usage, 0..1),
    `held(r)` (the requests it holds, in its engine and in its own proxy
    queue: the `in_flight` metric, and a draining replica holding none is
    empty), and `queued()` (the proxy's queue); and what it does when a
    slot changes: `start(t, r)`, `unstart(t, r)` (a starting replica
    stopped), `drain(t, r)` (a ready one now draining, already masked) and
    `stopped(t, r)` (a slot gone off). `router` is the router it masks (its
    `ready`: None where every replica is ready)."""

    def __init__(self, config: AutoscalerConfig):
        self.config = config
        self.replicas = rs = ReplicaSet(config)
        self.mask = [s == READY for s in rs.state]
        self.router = None

    # ------------------------------------------------ the driver's readings
    def waiting(self, r: int) -> float:
        raise NotImplementedError

    def kv(self, r: int) -> float:
        raise NotImplementedError

    def held(self, r: int) -> float:
        raise NotImplementedError

    def queued(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------ the driver's actions
    def start(self, t: float, r: int) -> None:
        raise NotImplementedError

    def unstart(self, t: float, r: int) -> None:
        pass

    def drain(self, t: float, r: int) -> None:
        pass

    def stopped(self, t: float, r: int) -> None:
        pass

    # ------------------------------------------------ the logic
    def metric(self, ready: list[int]) -> list[float]:
        """The metric's values: one per ready replica, or the proxy's queue."""
        m = self.config.metric
        if m == "waiting":
            return [float(self.waiting(r)) for r in ready]
        if m == "kv":
            return [float(self.kv(r)) for r in ready]
        if m == "in_flight":
            return [float(self.held(r)) for r in ready]
        return [float(self.queued())]

    def empty(self, r: int) -> bool:
        return self.held(r) == 0

    def apply_mask(self) -> None:
        """The router's mask: None where every replica is ready."""
        ready = self.mask
        for r, s in enumerate(self.replicas.state):
            ready[r] = s == READY
        self.router.ready = None if all(ready) else ready

    def sync(self, t: float) -> None:
        """One sync period at t: the HPA's count carried out (replicas
        started, starts stopped, replicas drained, drained ones found empty
        off), the mask set and the counts logged."""
        rs = self.replicas
        before = list(rs.state)
        started, unstarted, drained = rs.sync(t, self.metric, self.empty)
        for r in started:
            self.start(t, r)
        for r in unstarted:
            self.unstart(t, r)
        for r in drained:
            self.mask[r] = False
            self.router.ready = self.mask
            self.drain(t, r)
            if self.empty(r):
                rs.off(t, r)
        for r, (b, s) in enumerate(zip(before, rs.state)):
            if s == OFF and b != OFF:
                self.stopped(t, r)
        self.apply_mask()
        rs.log(t)

    def became_ready(self, t: float, r: int) -> None:
        """Replica r, started, takes traffic from t."""
        self.replicas.became_ready(t, r)
        self.apply_mask()


__all__ = ["METRICS", "PROVISIONING", "DRAIN", "AutoscalerConfig", "ProvisioningDelay", "Autoscaler",
           "ReplicaSet", "ScalingDriver", "Life", "OFF", "STARTING", "READY", "DRAINING"]
