"""Replicas that come and go in a fleet run: the driver side of the
autoscaler (`sim.policy.autoscaler`, the HPA's decision, clock-free).

`Scaling(run, config, seed)` binds an autoscaler to a `sim.model.Run` whose
cluster is built at `max_replicas` engines. Each replica slot is off,
starting, ready or draining:
- `initial_replicas` slots are ready at 0, the others off;
- at each sync period (one timer of the run's `sim.clock.Timers`) the
  autoscaler reads the metric of the ready replicas and sets a count; a
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

from .policy.autoscaler import Autoscaler, AutoscalerConfig, ProvisioningDelay

INF = float("inf")
OFF, STARTING, READY, DRAINING = 0, 1, 2, 3


class Life:
    """One replica's life from a scale-up (replicas ready at 0 have one too,
    decided and ready at 0)."""
    __slots__ = ("replica", "decided_at", "ready_at", "stopped_at", "ended_at", "timer")

    def __init__(self, replica: int, decided_at: float, ready_at: float | None = None):
        self.replica, self.decided_at, self.ready_at = replica, decided_at, ready_at
        self.stopped_at = None          # the scale-down that stopped or drained it
        self.ended_at = None            # off from then
        self.timer = None               # its ready timer while starting


class Scaling:
    def __init__(self, run, config: AutoscalerConfig, seed: int = 0):
        if run.n != config.max_replicas:
            raise ValueError(f"an autoscaled fleet is built at max_replicas ({config.max_replicas}) engines; "
                             f"got {run.n}")
        self.run, self.config = run, config
        n = run.n
        self.state = [READY if r < config.initial else OFF for r in range(n)]
        self.hpa = Autoscaler(config)
        self.delay = ProvisioningDelay(config, np.random.default_rng([seed, 3]))
        self.lives: list[Life] = [Life(r, 0.0, 0.0) for r in range(config.initial)]
        self.current: list[Life | None] = self.lives + [None] * (n - config.initial)
        self.counts: list[tuple] = [(0.0, config.initial, 0, 0)]     # (t, ready, starting, draining) at changes
        self.decisions: list[tuple] = []       # (t, from, to) of each change of the count
        self._due: list[float] = []            # times of this scaling's timers not yet fired
        self.ready = [s == READY for s in self.state]
        if not config.fixed:
            self._mask()
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

    # ---------------------------------------------------------- state
    def _mask(self) -> None:
        """The router's mask: None where every replica is ready."""
        ready = self.ready
        for r, s in enumerate(self.state):
            ready[r] = s == READY
        self.run.router.ready = None if all(ready) else ready

    def _log(self, t: float) -> None:
        s = self.state
        row = (t, s.count(READY), s.count(STARTING), s.count(DRAINING))
        if row[1:] != self.counts[-1][1:]:
            if self.counts[-1][0] == t:
                self.counts[-1] = row
            else:
                self.counts.append(row)

    def _empty(self, r: int) -> bool:
        return self.run.engines[r].num_in_engine() == 0 and self.run.cluster.queued_at(r) == 0

    def metric(self, ready: list[int]) -> list[float]:
        """The metric's values: one per ready replica, or the proxy's queue."""
        run, m = self.run, self.config.metric
        if m == "waiting":
            return [float(run.engines[r].scheduler.num_waiting) for r in ready]
        if m == "kv":
            return [run._kv_usage_of(r) for r in ready]
        if m == "in_flight":
            return [float(run._outstanding_of(r)) for r in ready]
        return [float(run.proxy.queued)]

    # ---------------------------------------------------------- events
    def _sync(self, t: float, _arg=None) -> None:
        self._fired(t)
        state = self.state
        for r, s in enumerate(state):
            if s == DRAINING and self._empty(r):
                state[r] = OFF
                self.current[r].ended_at = t
        ready = [r for r, s in enumerate(state) if s == READY]
        starting = state.count(STARTING)
        current = len(ready) + starting
        desired = self.hpa.decide(t, self.metric(ready), len(ready), starting)
        if desired != current:
            self.decisions.append((t, current, desired))
        if desired > current:
            for r in [r for r, s in enumerate(state) if s == OFF][:desired - current]:
                state[r] = STARTING
                life = self.current[r] = Life(r, t)
                self.lives.append(life)
                life.timer = self._at(t + self.delay.draw(), self._ready, r)
        elif desired < current:
            self._stop(t, current - desired)
        if not self.config.fixed:
            self._mask()
        self._log(t)
        self._at(t + self.config.sync_period_s, self._sync)

    def _ready(self, t: float, r: int) -> None:
        self._fired(t)
        life = self.current[r]
        life.timer = None
        life.ready_at = t
        self.state[r] = READY
        self._mask()
        self._log(t)

    def _stop(self, t: float, k: int) -> None:
        """Stop k replicas: the newest starting ones, then drain ready ones
        from the highest index."""
        state, cur = self.state, self.current
        starting = sorted((r for r, s in enumerate(state) if s == STARTING),
                          key=lambda r: (cur[r].decided_at, r), reverse=True)
        ready = [r for r in range(len(state) - 1, -1, -1) if state[r] == READY]
        for r in (starting + ready)[:k]:
            life = cur[r]
            life.stopped_at = t
            if state[r] == STARTING:
                life.timer.live = False         # Timers.cancel
                life.timer = None
                state[r] = OFF
                life.ended_at = t
                continue
            state[r] = DRAINING
            self.ready[r] = False
            self.run.router.ready = self.ready
            if self.config.drain == "cancel":
                self._cancel_on(t, r)
            if self._empty(r):
                state[r] = OFF
                life.ended_at = t

    def _cancel_on(self, t: float, r: int) -> None:
        """Cancel the requests on replica r: each aborted in its engine and
        its execution refused (503) to its attempts; a proxy queue held for
        r alone dispatches its next ones to r, cancelled in turn."""
        run = self.run
        reps = run.exec_replica
        while True:
            mine = [i for i in run.requests if reps[i] == r]
            if not mine:
                return
            for i in mine:
                req = run.requests.pop(i)
                run.executions[i].cancel_requested_at = t
                run.engines[r].abort_request(req)
                ex = run.proxy.executions.get(i)
                if ex is not None:
                    run._do(t, run.proxy.on_engine_refused(t, ex))

    # ---------------------------------------------------------- after the run
    def replica_seconds(self, end: float) -> float:
        """Replicas starting, ready or draining, integrated over [0, end]."""
        total, rows = 0.0, self.counts
        for (t0, a, b, c), nxt in zip(rows, rows[1:] + [(end,)]):
            t1 = min(nxt[0], end)
            if t1 > t0:
                total += (a + b + c) * (t1 - t0)
        return total


def scaling_measures(scaling: Scaling, execution_replica: np.ndarray, execution_placed: np.ndarray,
                     end: float, burst_start: float | None) -> dict:
    """The record's `autoscaler` part: the settings, replicas over time (at
    each change: ready, starting, draining), replica-seconds, each change of
    the count, and each replica started: when it was decided, ready and got
    its first call, also from the burst's start."""
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
