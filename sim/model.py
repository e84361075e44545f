"""The SimPy model: the workload's calls, each driven by the client policy,
through the proxy policy, into the engine model — all in simulated time.
`simulate()` returns a RunLog (plain records); `sim.measures` makes the
result record from it.

A run (`Run`) is the chain of layers (`sim.policy.stack.Interpreter`, which
routes the layers' actions) joining its parts: the workload side
(`sim.calls.Calls`: arrivals, attempts, deadlines, the client's decisions),
the cluster of engines (`sim.replicas.Replicas`) and the record builder
(`sim.records.Records`), on the timers of `sim.clock` (whose `NextInput`
and horizon functions bound the engines' fast-forwards)."""
from __future__ import annotations

import gc
import time
from functools import partial
from typing import Sequence

import numpy as np
import simpy

from .autoscale import Scaling
from .calls import Calls
from .classes import call_objectives, clients
from .clock import Clock, NextInput, RoutedTimers, Timers, horizon_all, horizon_one
from .conditions import Condition
from .policy.layers import LayerContext, Upstream, layer_kind
from .policy.proxy import Wake
from .policy.router import RouterConfig
from .policy.stack import Interpreter, Stack
from .profile import Profile
from .records import Records, ReplicaParts
from .replicas import Replicas, engine_config, never, prompt_throughput, sum_counters
from .runlog import RunLog
from .scenario import Scenario
from .workload import Trace

__all__ = ["Run", "simulate", "uniform_draws", "ReplicaParts", "engine_config", "never", "prompt_throughput",
           "sum_counters"]


def uniform_draws(rng: np.random.Generator, chunk: int = 512):
    """`uniform(a, b)` drawing from `rng` the values `rng.uniform(a, b)`
    would, one call after another, with the generator's doubles taken
    `chunk` at a time; its `random()` draws uniform(0, 1) from the same
    stream."""
    buf: list[float] = []

    def uniform(a: float, b: float) -> float:
        if not buf:
            buf.extend(reversed(rng.random(chunk).tolist()))
        return a + (b - a) * buf.pop()

    def random() -> float:
        """uniform(0, 1), the same draw (0 + 1 * r is r)."""
        if not buf:
            buf.extend(reversed(rng.random(chunk).tolist()))
        return buf.pop()
    uniform.random = random
    return uniform


class Run(Interpreter):
    """One run of a stack (`sim.policy.stack.Stack`: the client, any layers
    between it and the proxy (gateways: `self.layers`, made through the
    registry of `sim.policy.layers`), the proxy with the condition's
    controls and the router) over a cluster of engines:
    one per profile (`profile`, or a sequence of them: replica i runs the
    i-th). `router` places requests on the replicas and says where the proxy
    stands (`RouterConfig.proxy`); `stack`, where given, names the layers
    instead (default: `Stack.from_config(condition, router, scenario)`; the
    condition then gives only the engines' cap). A single engine is a
    cluster of one, and any router gives its run event for event. `run()`
    returns the cluster's RunLog (the engines' series, counters and work
    summed); `sim.fleet.fleet_log` reads the per-replica parts from the run.
    `autoscaler` (a `sim.policy.autoscaler.AutoscalerConfig`), where given,
    makes the replicas come and go (`sim.autoscale.Scaling`, `self.scaling`;
    the cluster is built at its max_replicas).

    The run's parts: `calls` (the workload side), `replicas` (the cluster
    of engines), `records` (the record builder); the run itself is the
    chain of layers that joins them (their handlers are its)."""

    def __init__(self, profile: Profile | Sequence[Profile], trace: Trace, condition: Condition,
                 scenario: Scenario, seed: int = 0, max_batched_tokens: int | None = None, fast_forward: bool = True,
                 snapshot_times: tuple = (), router: RouterConfig | None = None, stack: Stack | None = None,
                 autoscaler=None):
        self.profiles = [profile] if isinstance(profile, Profile) else list(profile)
        if not self.profiles:
            raise ValueError("a fleet needs at least one replica")
        self.n = len(self.profiles)
        self.env = Clock()
        self.trace, self.scenario, self.autoscaler = trace, scenario, autoscaler
        self.stack = stack if stack is not None else Stack.from_config(condition, router, scenario)
        self.router_config = self.stack.config("router")
        self.done = self.env.event()
        self.replicas = rp = Replicas(self.env, self.profiles, self.stack, scenario, None)
        self.cluster, self.router, self.proxy, self.engines = rp.cluster, rp.router, rp.proxy, rp.engines
        self.exec_replica, self.queue_logs, self.requests = rp.exec_replica, rp.queue_logs, rp.requests
        self.counters_at, self.counters_at_r = rp.counters_at, rp.counters_at_r
        self.timers = self._timers(condition)
        self.client = self._client(seed, condition)
        self.calls = Calls(trace, scenario, self.timers, self.client, self.done, self._over, thin=rp.thin)
        self.records = Records(self.calls)
        self.executions = rp.executions = self.records.executions
        rp.calls = self.calls
        self._wire(self._layers(seed))
        self._make_engines(condition, scenario, max_batched_tokens, fast_forward)
        for t in snapshot_times:
            self.timers.at(t, rp.snapshot)
        self.calls.plan()
        self.scaling = Scaling(self, autoscaler, seed) if autoscaler is not None else None
        if len(trace) == 0:
            self.calls.finish()

    def _client(self, seed: int, condition: Condition):
        """A client layer of a registered kind (its effective settings, a
        dict: sim.policy.layers), or the reference client; with traffic
        classes each call's client settings and engine priority are its
        class's (sim.classes)."""
        client = self.stack.config("client")
        draws = uniform_draws(np.random.default_rng([seed, 1]))
        return clients(client, condition, self.scenario, self.trace, draws)

    def _layers(self, seed: int) -> list:
        """The layers between the client and the proxy (gateways), from the
        top; they draw from a stream of their own, so that the client's
        draws stay those of a stack without them."""
        if not self.stack.chain:
            return []
        draws = uniform_draws(np.random.default_rng([seed, 2]))
        objective = call_objectives(self.trace, self.scenario)
        scales = self.autoscaler is not None and not self.autoscaler.fixed
        up = self.replicas.up if scales else None       # replicas that come and go (an upstream group reads it)
        layers = [layer_kind(kind).make(settings, LayerContext(draws, self.replicas.pods, objective.__getitem__, i + 1,
                                                               up))
                  for i, (kind, settings) in enumerate(self.stack.chain)]
        for layer in layers:
            if hasattr(layer, "burst_end"):     # a gateway's upstream group dates its verdict by the burst's end
                layer.burst_end = self.scenario.pulse_end
        return layers

    def _timers(self, condition: Condition) -> Timers:
        """The run's timers; where every input a timer brings reaches the
        replica of its call alone, filed by replica (`RoutedTimers`)."""
        n, cl = self.n, self.cluster
        self._over: list = []       # [True] once every call is over and `done` triggered (its length: Timers' stop)
        horizon = partial(horizon_one if n == 1 else horizon_all, self.engines)
        # replicas that come and go move calls, and their drain may abort
        scales = self.autoscaler is not None and not self.autoscaler.fixed
        if not (n > 1 and not scales and not self.stack.chain and cl.calls_stay_home(condition.engine_cap)):
            return Timers(self.env, horizon=horizon, stop=self._over.__len__)
        self.home = [self.router.home(c) for c in range(len(self.trace))]
        # a call's retry (the client's timer: its token is the call), an
        # attempt's deadline and an execution's wake (their call_id); a call's arrival
        # likewise where the trace's arrivals are out of order, else under
        # no replica (`NextInput` stands for arrivals)
        arrival = self.trace.arrival
        in_order = len(arrival) < 2 or bool((np.diff(arrival) >= 0).all())
        by_call = {Calls.arrive: None if in_order else False, Calls.retry: "token", Calls.deadline: True,
                   Run._wake: True}
        return RoutedTimers(self.env, horizon, self._over.__len__, n, self.home, by_call)

    def _wire(self, layers: list) -> None:
        """Join the parts: the handlers of the proxy's actions are theirs,
        and the chain of `layers` stands above the proxy."""
        rp, records, calls = self.replicas, self.records, self.calls
        self._subscribe, self._drop, self._orphaned = records.subscribe, records.drop, records.orphaned
        self._dispatch, self._cancel = rp.dispatch, rp.cancel
        if self.stack.group_below_proxy:    # the lowest gateway stands below the one proxy: it takes its executions
            self._dispatch, self._cancel = self._dispatch_below, self._cancel_below
        self._refused, self._completed = calls.refused, calls.completed
        self._sent, self._delivered, self._given_up = calls.sent, calls.delivered, calls.given_up
        Interpreter.__init__(self)
        self.proxy_queues = self.stack.config("proxy").proxy_cap is not None
        rp.proxy_queue_log = self.proxy_queue_log
        below = None
        if self.stack.group_below_proxy:
            layers, gateway = layers[:-1], layers[-1]
            below = (gateway, (rp.engine_attempt, rp.engine_left))
            rp.below_proxy(gateway)
        if layers:          # the lowest layer's attempts reach the proxy through `_proxy_attempt`
            records.proxy_rows = []
            self._chain(layers, (self._proxy_attempt, self.proxy.on_attempt_left), below)
        else:
            self._chain(layers, (self.proxy.on_attempt, self.proxy.on_attempt_left), below)
        self.proxy_rows = records.proxy_rows
        if self.cluster.per_replica_queues and self.stack.config("proxy").proxy_cap is not None:
            self._do = self._do_and_log_replica_queues
        # the timers' functions, bound once (see `Calls`)
        self._wake, self._layer_timer = self._wake, self._layer_timer
        calls.wire(self)
        rp.do = self._do

    def _make_engines(self, condition: Condition, scenario: Scenario, max_batched_tokens: int | None,
                      fast_forward: bool) -> None:
        """Make the engines (`self.engine`: the one engine of a cluster of
        one), each with its next input time (`sim.clock.NextInput`)."""
        n, pcfg = self.n, self.stack.config("proxy")
        # a 503 an engine answers may send the request on to another replica
        reroutes = n > 1 and self.router_config.retries > 0 and condition.engine_cap is not None
        # a layer between the client and the proxy that may hold attempts in a queue of its own
        queueing = [layer for layer in self.layers if getattr(layer, "may_queue", False)]
        self.next_input = NextInput(self.timers, self.engines, self.cluster, queueing,
                                    may_queue=pcfg.proxy_cap is not None or bool(queueing),
                                    reroutes_refusals=reroutes, workload=self.calls)
        # no proxy cancels, and no router reads the KV usage that a
        # fast-forward takes ahead: requests added to a replica whose
        # admission is blocked change none of its steps (EngineCore)
        # (nor any layer above the proxy reads the engines' state: `reads_engines`; nor replicas come and go)
        # (nor a gateway below the proxy, which closes its upstream attempts on its own timeouts)
        never_aborts = (pcfg.cancellation == "off" and (self.router_config.policy != "least-kv" or n == 1)
                        and not self.stack.group_below_proxy
                        and not any(getattr(layer, "reads_engines", False) for layer in self.layers)
                        and not (self.autoscaler is not None and not self.autoscaler.fixed))
        # only a proxy that reads its view (`Proxy.estimate_wait`) needs the prompt throughput
        reads_view = pcfg.queue == "deadline" or pcfg.budget is not None
        self.replicas.make(condition, scenario, max_batched_tokens, fast_forward, self.replicas.on_finished,
                           self.next_input.functions(), never_aborts, reads_view)
        self.engine = self.engines[0] if n == 1 else None

    @property
    def thin_at(self) -> int:
        """Thin the gauge logs beyond this many entries, looked at every 256th arrival (0: never)."""
        return self.replicas.thin_at

    @thin_at.setter
    def thin_at(self, v: int) -> None:
        self.replicas.thin_at = v

    def kv_usage_of(self, r: int) -> float:
        """Replica r's KV cache usage."""
        return self.replicas.kv_usage_of(r)

    def outstanding_of(self, r: int) -> int:
        """Requests replica r holds: in its engine, and in its own proxy queue."""
        return self.replicas.outstanding_of(r)

    # ------------------------------------------------------------ the chain's hooks
    def _request(self, up: Upstream) -> tuple:
        """What an upstream attempt carries below: its call's (max_tokens,) and prompt length."""
        i = up.call_id
        return (self.calls.max_tokens[i],), self.calls.prompt_len[i]

    def _proxy_attempt(self, t: float, up: Upstream, params: tuple, prompt_len: int) -> list:
        """The lowest layer's upstream attempt reaches the proxy (its row noted in `proxy_rows`)."""
        self.proxy_rows.append(up.row)
        return self.proxy.on_attempt(t, up, params, prompt_len)

    def _execution_refused(self, t: float, ex) -> None:
        """The gateway below the proxy answered `ex` with an error: one no engine took is refused."""
        erec = self.executions[ex.id]
        if not erec.accepted:
            erec.fate, erec.finished_at = "refused", t

    def _wake_at(self, t: float, a: Wake) -> None:
        self.timers.at(a.at, self._wake, a.execution)

    def _wake(self, t: float, ex) -> None:
        self._do(t, self.proxy.on_wake(t, ex))

    def _timer_at(self, t: float, a) -> None:
        self.timers.at(a.at, self._layer_timer, a)

    def _layer_timer(self, t: float, a) -> None:
        self._do(t, a.layer.on_timer(t, a.token))

    def _do_and_log_replica_queues(self, t: float, actions: list) -> None:
        """`_do` where each replica has a proxy queue of its own: their
        lengths are logged once the actions are all carried out."""
        Interpreter._do(self, t, actions)
        if not self._action_stack:
            self.replicas.log_replica_queues(t)

    # ------------------------------------------------------------------- run
    def run(self, until: float | None = None) -> RunLog:
        t0 = time.perf_counter()
        gc_was_enabled = gc.isenabled()
        gc.disable()    # a run leaves no cyclic garbage until it ends; collection passes would only rescan its records
        try:
            return self._run(until, t0)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, until: float | None, t0: float) -> RunLog:
        if until is None:
            last = float(self.trace.arrival[-1]) if len(self.trace) else 0.0
            until = last + self.scenario.delivery_horizon_s
        self.timers.until = until
        self.thin_at = self.thin_at or 8192     # the series samples whole seconds only
        self.env.run(until=simpy.AnyOf(self.env, [self.done, self.env.timeout(until)]))
        end = self.env.now
        wall = time.perf_counter() - t0
        return self._log(end, wall)

    def _log(self, end: float, wall: float) -> RunLog:
        """The cluster's RunLog (its engines' series, counters and work
        summed); `self.parts` keeps each engine's (`ReplicaParts`)."""
        log, self.parts = self.records.log(end, wall, self.replicas, self.stack.chain, self.layers,
                                           self.proxy_queue_log)
        return log


def simulate(profile: Profile, trace: Trace, condition: Condition, scenario: Scenario, seed: int = 0,
             max_batched_tokens: int | None = None, fast_forward: bool = True, stack: Stack | None = None) -> RunLog:
    run = Run(profile, trace, condition, scenario, seed, max_batched_tokens, fast_forward,
              snapshot_times=(scenario.pulse_end, scenario.hold_end), stack=stack)
    return run.run()
