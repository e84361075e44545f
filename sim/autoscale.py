"""Replicas that come and go in a fleet run: the driver side of the
autoscaler (`sim.policy.autoscaler`, the HPA's decision, clock-free).

`Scaling(run, config, seed)` binds an autoscaler to a `sim.model.Run` whose
cluster is built at `max_replicas` engines. Each replica slot is off,
starting, ready or draining:
- `initial_replicas` slots are ready at 0, the others off;
- at each sync period (one timer of the run's `sim.clock.Timers`) the
  slots' state machine (`sim.policy.autoscaler.ReplicaSet`, through the
  driver logic `ScalingDriver` that the live harness shares; `Scaling`
  gives it the timers, the run's readings and its actions) reads the
  metric of the ready replicas and sets a count; a
  scale-up starts the lowest off slots, each ready after a provisioning
  delay drawn from the run's seeded generator (a timer); a scale-down
  stops the newest starting replicas first, then drains the ready ones
  from the highest index (as a ReplicaSet deletes not-ready pods first):
  the router sends a draining replica nothing new, and its running
  requests finish (`drain = "finish"`) or are cancelled and answered 503
  (`"cancel"`); a drained replica is off from the first sync that finds it
  empty;
- the router reads `ready` (its mask): a replica not ready takes no call.
Where min == max the HPA's count is always the current one (its bounds
clamp it): no timer is set and the mask stays unset, so the run is the
fixed fleet's, event for event.

The timers' horizon (sim.clock) skips the engines of off and starting
replicas (no input reaches them) and stops at the next scaling timer, so a
replica never becomes ready inside a batch of timers.

`scaling_measures(scaling, fleet_log, burst_start)` is the record's
`autoscaler` part (see docs/autoscaling.md).
"""
from __future__ import annotations

from heapq import heappop, heappush

import numpy as np

from .policy.autoscaler import (
    DRAINING,
    OFF,
    READY,
    STARTING,
    AutoscalerConfig,
    Life,
    ProvisioningDelay,
    ReplicaSet,
    ScalingDriver,
)

INF = float("inf")


class Scaling(ScalingDriver):
    def __init__(self, run, config: AutoscalerConfig, seed: int = 0):
        if run.n != config.max_replicas:
            raise ValueError(f"an autoscaled fleet is built at max_replicas ({config.max_replicas}) engines; "
                             f"got {run.n}")
        super().__init__(config)                     # the slots' state machine and the driver logic, shared
        self.run, self.router = run, run.router      # with the live driver
        rs = self.replicas
        self.state, self.lives, self.counts, self.decisions = rs.state, rs.lives, rs.counts, rs.decisions
        self.delay = ProvisioningDelay(config, np.random.default_rng([seed, 3]))
        self.timers: dict[int, object] = {}    # replica -> its ready timer while starting
        self._due: list[float] = []            # times of this scaling's timers not yet fired
        if not config.fixed:
            self.apply_mask()
            run.timers.horizon = self.horizon
            self._at(float(config.sync_period_s), self._sync)

    # ---------------------------------------------------------- timers
    def _at(self, t: float, fn, arg=None):
        t = float(t)
        heappush(self._due, t)
        return self.run.timers.at(t, fn, arg)

    def _fired(self, t: float) -> None:
        due = self._due
        while due and due[0] <= t:
            heappop(due)

    def horizon(self) -> float:
        """The timers' horizon: the earliest end of a step in flight on an
        engine that may get input, -INF while one of them is idle; and no
        later than this scaling's next timer."""
        h = self._due[0] if self._due else INF
        state = self.state
        for r, e in enumerate(self.run.engines):
            p = e.pending
            if not p:
                if state[r] == READY or state[r] == DRAINING:
                    return -INF
                continue
            if p[0].end < h:
                h = p[0].end
        return h

    def _sync(self, t: float, _arg=None) -> None:
        self._fired(t)
        self.sync(t)
        self._at(t + self.config.sync_period_s, self._sync)

    def _ready(self, t: float, r: int) -> None:
        self._fired(t)
        del self.timers[r]
        self.became_ready(t, r)

    # ---------------------------------------------------------- readings
    def waiting(self, r: int) -> float:
        return self.run.engines[r].scheduler.num_waiting

    def kv(self, r: int) -> float:
        return self.run.kv_usage_of(r)

    def held(self, r: int) -> int:
        return self.run.outstanding_of(r)

    def queued(self) -> float:
        return self.run.proxy.queued

    # ---------------------------------------------------------- actions
    def start(self, t: float, r: int) -> None:
        """A replica ready after a provisioning delay drawn from the run's generator."""
        self.timers[r] = self._at(t + self.delay.draw(), self._ready, r)

    def unstart(self, t: float, r: int) -> None:
        self.timers.pop(r).live = False         # Timers.cancel

    def drain(self, t: float, r: int) -> None:
        """With drain = "cancel", cancel the requests on replica r
        (`sim.replicas.Replicas.cancel_on`)."""
        if self.config.drain == "cancel":
            self.run.replicas.cancel_on(t, r)

    # ---------------------------------------------------------- after the run
    def replica_seconds(self, end: float) -> float:
        return self.replicas.replica_seconds(end)


def scaling_measures(scaling: ReplicaSet | Scaling, execution_replica: np.ndarray, execution_placed: np.ndarray,
                     end: float, burst_start: float | None) -> dict:
    """The record's `autoscaler` part: the settings, replicas over time (at
    each change: ready, starting, draining), replica-seconds, each change of
    the count, and each replica started: when it was decided, ready and got
    its first call, also from the burst's start. `scaling`: the slots'
    `ReplicaSet` (a simulated run's `Scaling` or the live harness's)."""
    def since(x):
        return None if x is None or burst_start is None else x - burst_start
    rows = scaling.counts
    lives = []
    for life in scaling.lives[scaling.config.initial:]:
        first = None
        if life.ready_at is not None:
            stop = life.ended_at if life.ended_at is not None else INF
            on = (execution_replica == life.replica) & (execution_placed >= life.ready_at) & (execution_placed <= stop)
            if on.any():
                first = float(execution_placed[on].min())
        lives.append({"replica": life.replica, "decided_at": life.decided_at, "ready_at": life.ready_at,
                      "first_call_at": first, "stopped_at": life.stopped_at, "ended_at": life.ended_at,
                      "decided_since_burst_s": since(life.decided_at),
                      "first_call_since_burst_s": since(first)})
    ups = [{"at": t, "from": a, "to": b, "since_burst_s": since(t)} for t, a, b in scaling.decisions if b > a]
    downs = [{"at": t, "from": a, "to": b} for t, a, b in scaling.decisions if b < a]
    return {**scaling.config.document(),
            "replicas": {"t": [r[0] for r in rows], "ready": [r[1] for r in rows], "starting": [r[2] for r in rows],
                         "draining": [r[3] for r in rows]},
            "max_ready": max(r[1] for r in rows),
            "replica_seconds": scaling.replica_seconds(end),
            "scale_ups": ups, "scale_downs": downs, "started": lives}


__all__ = ["Scaling", "Life", "scaling_measures", "OFF", "STARTING", "READY", "DRAINING"]
