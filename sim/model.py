"""The SimPy model: the workload's calls, each driven by the client policy,
through the proxy policy, into the engine model — all in simulated time.
`simulate()` returns a RunLog (plain records); `sim.measures` makes the
result record from it."""
from __future__ import annotations

import gc
import math
import time
from functools import partial
from typing import NamedTuple, Sequence

import numpy as np
import simpy

from .autoscale import Scaling
from .classes import call_classes, call_objectives, call_priorities, clients
from .clock import Clock, RoutedTimers, Timers
from .conditions import Condition
from .engine.core import EngineConfig, EngineCore
from .engine.request import Request
from .policy.client import CallState, Delivered, Retry
from .policy.layers import LayerContext, Upstream, layer_kind
from .policy.proxy import Attempt, Cancel, Complete, Drop, EngineView, PromptRate, Proxy, Refuse, Subscribe, Wake
from .policy.router import ReplicaView, RouterConfig
from .policy.stack import Interpreter, Stack
from .profile import Profile
from .runlog import (
    ATTEMPT_OUTCOMES,
    CALL_OUTCOMES,
    AttemptTable,
    CallTable,
    ExecutionRecord,
    ExecutionTable,
    RunLog,
    Series,
    refusal_outcome,
    sample_columns,
    sample_log,
    thin_log,
)
from .scenario import Scenario
from .workload import Trace

INF = float("inf")
_ATTEMPT_CODE = {o: i for i, o in enumerate(ATTEMPT_OUTCOMES)}
_CALL_CODE = {o: i for i, o in enumerate(CALL_OUTCOMES)}
_TIMEOUT, _COMPLETE, _DELIVERED = _ATTEMPT_CODE["timeout"], _ATTEMPT_CODE["complete"], _CALL_CODE["delivered"]


def never() -> float:
    """A time that never comes: the next abort where no proxy cancels an execution."""
    return INF


def uniform_draws(rng: np.random.Generator, chunk: int = 512):
    """`uniform(a, b)` drawing from `rng` the values `rng.uniform(a, b)`
    would, one call after another, with the generator's doubles taken
    `chunk` at a time."""
    buf: list[float] = []

    def uniform(a: float, b: float) -> float:
        if not buf:
            buf.extend(reversed(rng.random(chunk).tolist()))
        return a + (b - a) * buf.pop()
    return uniform


class _Attempt(Attempt):
    """An attempt with the driver's bookkeeping: its row in the attempt log
    and its deadline timer (set by `Run._send`; None once the timer fired or
    was cancelled, so that the two make no reference cycle that would
    outlive the attempt)."""
    __slots__ = ("row", "timer")


def prompt_throughput(profile: Profile, scenario: Scenario) -> float:
    """The profile's prompt throughput (tokens/s): capacity x computed prompt
    tokens per call (the proxy's estimate before it has any history)."""
    return profile.capacity * max(1.0, scenario.prompt_mean - scenario.shared_prefix)


def engine_config(profile: Profile, condition: Condition, max_batched_tokens: int | None = None,
                  scenario: Scenario | None = None) -> EngineConfig:
    """The engine of `profile` with the condition's engine cap and the
    scenario's engine faults (stalls, a KV block leak on abort), if any."""
    faults = {}
    if scenario is not None and scenario.stalls:
        faults["stalls"] = scenario.stalls
    if scenario is not None and scenario.leak_blocks_on_abort:
        faults["leak_blocks_on_abort"] = True
    return EngineConfig(profile.scheduler_config(max_batched_tokens), profile.depth, condition.engine_cap, **faults)


def sum_counters(dicts) -> dict:
    """Key-wise sum of counter dicts (keys in first-seen order)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


def _next_finish(e: EngineCore) -> float:
    """The end of the first step in flight of engine e that finishes a request (INF: none)."""
    for plan in e.pending:
        if plan.finishing:
            return plan.end
    return INF


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
    the cluster is built at its max_replicas)."""

    def __init__(self, profile: Profile | Sequence[Profile], trace: Trace, condition: Condition,
                 scenario: Scenario, seed: int = 0, max_batched_tokens: int | None = None, fast_forward: bool = True,
                 snapshot_times: tuple = (), router: RouterConfig | None = None, stack: Stack | None = None,
                 autoscaler=None):
        self.profiles = [profile] if isinstance(profile, Profile) else list(profile)
        if not self.profiles:
            raise ValueError("a fleet needs at least one replica")
        self.n = len(self.profiles)
        self.env = env = Clock()
        self.trace = trace
        self.scenario = scenario
        self.stack = stack if stack is not None else Stack.from_config(condition, router, scenario)
        self.router_config = self.stack.config("router")
        self.done = env.event()
        self._over: list = []       # [True] once every call is over and `done` triggered (its length: Timers' stop)
        self.timers = Timers(env, horizon=self._horizon_one if self.n == 1 else self._horizon_all,
                             stop=self._over.__len__)
        client = self.stack.config("client")
        draws = uniform_draws(np.random.default_rng([seed, 1]))
        self.call_priority = call_priorities(trace, scenario)
        self.autoscaler = autoscaler
        self.call_class = call_classes(trace, scenario)     # carried by each attempt (shedding by class)
        # a client layer of a registered kind (its effective settings, a dict: sim.policy.layers), or the
        # reference client; with traffic classes each call's client settings and engine priority are its
        # class's (sim.classes)
        self.client = (layer_kind(client["kind"]).make(client, LayerContext(draws)) if isinstance(client, dict)
                       else clients(client, condition, scenario, trace, draws))
        # the layers between the client and the proxy (gateways), from the top; they draw from a stream of
        # their own, so that the client's draws stay those of a stack without them
        self.layers = []
        if self.stack.chain:
            layer_draws = uniform_draws(np.random.default_rng([seed, 2]))
            objective = call_objectives(trace, scenario)
            self.layers = [layer_kind(kind).make(settings, LayerContext(layer_draws, self._pods,
                                                                        objective.__getitem__, i + 1))
                           for i, (kind, settings) in enumerate(self.stack.chain)]
        self._build(condition, scenario, max_batched_tokens, fast_forward)
        Interpreter.__init__(self)      # after _build: its handlers are the run's, and `_do` may be replaced
        n = len(trace)
        self.arrival = trace.arrival.tolist()
        self.max_tokens = trace.max_tokens.tolist()
        self.prompt_len = trace.prompt_len.tolist()
        # each call's shared-prefix tokens and prefix group (trace.prefix_of)
        self.prefix_len = trace.prefix_len.tolist() if trace.prefix_len is not None else [trace.shared_prefix] * n
        self.prefix_group = trace.prefix_group.tolist() if trace.prefix_len is not None else [0] * n
        self.calls: list[CallState | None] = [None] * n     # client state of the calls in progress
        self.call_log = CallTable.planned(trace.arrival)
        self.attempt_log = AttemptTable()
        self.executions: list[ExecutionRecord] = []
        self.requests: dict[int, Request] = {}
        self.outstanding = n
        self.counters_at: dict[float, dict] = {}
        self.counters_at_r: list[dict] = [{} for _ in range(self.n)]     # each engine's
        self.thin_at = 0      # thin the gauge logs beyond this many entries, looked at every 256th arrival
        #                       (0: never; run() sets it)
        self._next_call = 0                 # first call whose arrival has not fired
        # the timers' functions, bound once: a timer keeps its function, and
        # binding one at each timer set would make a new object every time
        self._arrive, self._send, self._deadline, self._wake = self._arrive, self._send, self._deadline, self._wake
        # the top layer below the client (a gateway, else the proxy), and each layer's layer below
        below = self.layers + [self.proxy]
        self._enter, self._enter_left = below[0].on_attempt, below[0].on_attempt_left
        self._below = {layer: (b.on_attempt, b.on_attempt_left) for layer, b in zip(self.layers, below[1:])}
        # under layers, the attempt-log row of each attempt the proxy saw, in order (the cluster's `landed`
        # counts the proxy's attempts: a gateway's retries and refusals make them others than the client's)
        self.proxy_rows: list | None = None
        if self.layers:
            self.proxy_rows = []
            self._below[self.layers[-1]] = (self._proxy_attempt, self.proxy.on_attempt_left)
        self._layer_timer = self._layer_timer
        # Proxy.on_dispatched does nothing: called only where a proxy overrides it
        self._report_dispatch = type(self.proxy).on_dispatched is not Proxy.on_dispatched
        for t in snapshot_times:
            self.timers.at(t, self._snapshot)
        # arrivals are planned in order: each one, when it fires, sets the
        # next, with the sequence number it would have had if set now
        self._arrival_seq = self.timers.reserve(n)
        self._in_order = bool(n < 2 or (np.diff(trace.arrival) >= 0).all())
        for i in range(n if not self._in_order else min(n, 1)):
            self.timers.at(self.arrival[i], self._arrive, i, seq=self._arrival_seq + i)
        self.scaling = Scaling(self, autoscaler, seed) if autoscaler is not None else None
        if n == 0:
            self._finish()

    def _build(self, condition: Condition, scenario: Scenario, max_batched_tokens: int | None,
               fast_forward: bool) -> None:
        """Bind the stack to the cluster (`self.cluster`: its proxy, router
        and placement) and make the engines (`self.engines`; `self.engine`
        the one engine of a cluster of one)."""
        n, env, profiles = self.n, self.env, self.profiles
        # each proxy's prompt-throughput estimate: computed prompt tokens of
        # the executions that got their first token over the last 60 s on the
        # replicas it feeds; before any, the profiles' (capacity x computed
        # prompt tokens per call); kept only where the proxy reads its view
        # (`Proxy.estimate_wait`)
        self.cluster = cl = self.stack.bind(
            n, self._engine_view_of, lambda grp: sum(prompt_throughput(profiles[r], scenario) for r in grp),
            replica_view=self._replica_view, outstanding=self._outstanding_of, kv_usage=self._kv_usage_of)
        self.router, self.proxy = cl.router, cl.proxy
        self.prompt_rates = [PromptRate(60.0) for _ in cl.groups]
        self.exec_replica = cl.execution_replica
        self.queue_logs = [[(0.0, 0)] for _ in range(n)]     # each replica's own proxy queue (sidecars')
        pcfg = self.stack.config("proxy")
        cap = pcfg.proxy_cap
        if cl.per_replica_queues and cap is not None:
            self._do = self._do_and_log_replica_queues
        # a 503 an engine answers may send the request on to another replica
        self.reroutes_refusals = n > 1 and self.router_config.retries > 0 and condition.engine_cap is not None
        self._may_queue = cap is not None                    # a proxy may hold executions in its queue
        self._all_groups = range(len(cl.groups))
        self._routed_timers = None
        # replicas that come and go move calls, and their drain may abort
        scales = self.autoscaler is not None and not self.autoscaler.fixed
        if n > 1 and not scales and not self.stack.chain and cl.calls_stay_home(condition.engine_cap):
            # every input a timer brings reaches the replica of its call alone
            self.home = [self.router.home(c) for c in range(len(self.trace))]
            # a call's retry (the timer's argument: its id), an attempt's
            # deadline and an execution's wake (its call_id); a call's
            # arrival likewise where the trace's arrivals are out of order,
            # else under no replica (`_calls_of` stands for arrivals)
            arrival = self.trace.arrival
            in_order = len(arrival) < 2 or bool((np.diff(arrival) >= 0).all())
            by_call = {Run._arrive: None if in_order else False, Run._send: False,
                       Run._deadline: True, Run._wake: True}
            self._routed_timers = RoutedTimers(env, self.timers.horizon, self.timers.stop, n, self.home, by_call)
            self.timers = self._routed_timers
            self._calls_of = [[] for _ in range(n)]          # call ids by home replica, in arrival order
            for c, r in enumerate(self.home):
                self._calls_of[r].append(c)
            self._calls_at = [0] * n                         # first of them not yet arrived
        # what each engine calls for its first tokens and its next input
        # time: only a proxy that reads its view (`Proxy.estimate_wait`)
        # needs the prompt throughput
        reads_view = pcfg.queue == "deadline" or pcfg.budget is not None
        first_token = [partial(self._on_first_token_of, self.prompt_rates[cl.group_of[r]]) if reads_view else None
                       for r in range(n)]
        # a layer between the client and the proxy that may hold attempts in a queue of its own
        self._queueing_layers = [layer for layer in self.layers if getattr(layer, "may_queue", False)]
        if self._queueing_layers:
            self._may_queue = True
            next_input = [partial(self._next_input_time_of, r) for r in range(n)]
        elif self._routed_timers is None and cap is None:
            next_input = [self.timers.next_time] * n     # no proxy ever queues: the next timer
        elif n == 1:
            next_input = [self._next_input_time]
        else:
            next_input = [partial(self._next_input_time_of, r) for r in range(n)]
        # no proxy cancels, and no router reads the KV usage that a
        # fast-forward takes ahead: requests added to a replica whose
        # admission is blocked change none of its steps (EngineCore)
        # (nor any layer above the proxy reads the engines' state: `reads_engines`; nor replicas come and go)
        never_aborts = (pcfg.cancellation == "off" and (self.router_config.policy != "least-kv" or n == 1)
                        and not any(getattr(layer, "reads_engines", False) for layer in self.layers)
                        and not scales)
        self.engines = [EngineCore(env, engine_config(p, condition, max_batched_tokens, scenario), p.step_time,
                                   on_finished=self._on_finished, on_first_token=first_token[r],
                                   next_input_time=next_input[r], fast_forward=fast_forward,
                                   next_abort_time=never if never_aborts else None)
                        for r, p in enumerate(profiles)]
        self.engine = self.engines[0] if n == 1 else None

    # ------------------------------------------------------------ engines
    def _gauge_logs(self) -> list[list]:
        """The engines' gauge logs."""
        return [e.gauge_log for e in self.engines]

    def _log_entries(self) -> int:
        return sum(map(len, self._gauge_logs())) + len(self.proxy_queue_log)

    def _thin(self) -> None:
        """Thin the gauge logs to what the 1 s series needs (see `thin_log`)."""
        for log in self._gauge_logs():
            thin_log(log)
        thin_log(self.proxy_queue_log)
        self.thin_at = max(self.thin_at, 2 * self._log_entries())

    def _horizon_one(self) -> float:
        """The timers' horizon (the contract in sim.clock) over one engine: the end of the
        engine's step in flight (-INF while it is idle)."""
        pending = self.engines[0].pending
        return pending[0].end if pending else -INF

    def _horizon_all(self) -> float:
        """The earliest end of a step in flight; -INF while an engine is idle
        (an input may start a step on it at once)."""
        h = INF
        for e in self.engines:
            p = e.pending
            if not p:
                return -INF
            if p[0].end < h:
                h = p[0].end
        return h

    def _next_input_time(self) -> float:
        """`_next_input_time_of` the one engine of a cluster of one: the
        next timer, or — while the proxy holds executions in its queue —
        the end of the first step in flight that finishes a request (its
        completion frees a seat under the proxy cap, and a queued execution
        is dispatched then)."""
        t = self.timers.next_time()
        if self.proxy.queued:
            return min(t, _next_finish(self.engines[0]))
        return t

    def _next_input_time_of(self, r: int) -> float:
        """A bound on when engine r may next get input (or be read by the
        router): the next timer; and while a proxy holds a queue, the next
        moment a request may finish where that queue drains on finishes: if
        the proxy feeds r, the steps in flight that finish one on the
        engines it feeds, and for another of them also the end of its steps
        in flight (a step it has not scheduled yet may finish one just
        after); where an engine's 503 sends a request on to another replica
        (the router retries and engines have a cap), any other proxy's queue
        counts likewise; an idle engine just given input bounds it at now
        (the step it is about to start may finish one at any time). Where
        every call stays on its home replica, only
        the timers of r's calls count, and the arrival of the next call r is
        home to."""
        if self._routed_timers is not None:
            t = self._routed_timers.next_time_of(r)
            calls, i = self._calls_of[r], self._calls_at[r]
            while i < len(calls) and calls[i] < self._next_call:
                i += 1
            self._calls_at[r] = i
            if i < len(calls) and self.arrival[calls[i]] < t:
                t = self.arrival[calls[i]]
        else:
            t = self.timers.next_time()
        if self._queueing_layers and any(layer.queued for layer in self._queueing_layers):
            # a layer above the proxy sends a queued attempt on as a request anywhere below it finishes
            for s, e in enumerate(self.engines):
                t = min(t, _next_finish(e))
                if s != r and e.pending:
                    t = min(t, e.pending[-1].end)
        if self._may_queue:
            cl = self.cluster
            for g in self._all_groups if self.reroutes_refusals else (cl.group_of[r],):
                if cl.proxies[g].queued:
                    for s in cl.groups[g]:
                        e = self.engines[s]
                        t = min(t, _next_finish(e))
                        if s != r and e.pending:
                            t = min(t, e.pending[-1].end)
                        elif s != r and e.inbox:     # idle with input: a step about to start may finish one
                            t = min(t, self.env.now)
        return t

    def _pods(self, t: float) -> list:
        """What a layer above the proxy reads of each engine: (waiting, KV cache usage, metrics age 0)."""
        return [(e.num_in_engine() - len(e.scheduler.running), e.scheduler.block_pool.usage(), 0.0)
                for e in self.engines]

    def _replica_view(self, r: int) -> ReplicaView:
        return ReplicaView(self._outstanding_of(r), self._kv_usage_of(r))

    def _outstanding_of(self, r: int) -> int:
        """Requests replica r holds: in its engine, and in its own proxy queue."""
        return self.engines[r].num_in_engine() + self.cluster.queued_at(r)

    def _kv_usage_of(self, r: int) -> float:
        return self.engines[r].scheduler.block_pool.usage()

    def _engine_view_of(self, group: tuple, g: int, t: float) -> EngineView:
        """What the g-th proxy knows of the engines it feeds (`group`): the
        uncomputed prompt tokens of the executions waiting or running in
        them (or on their way in), their recent prompt throughput, the
        requests waiting in them and their mean KV cache usage."""
        es = [self.engines[r] for r in group]
        return EngineView(float(sum(e.uncomputed_prompt_tokens() for e in es)), self.prompt_rates[g].rate(t),
                          float(sum(e.num_in_engine() - len(e.scheduler.running) for e in es)),
                          sum(e.scheduler.block_pool.usage() for e in es) / len(es))

    @staticmethod
    def _on_first_token_of(rate: PromptRate, req: Request, t: float) -> None:
        """An engine's first token of `req`: the prompt throughput of the
        proxy that feeds it."""
        rec = req.record
        rate.add(t, rec.prompt_computed if rec is not None else req.num_prompt_tokens)

    # ------------------------------------------------------------ client side
    def _arrive(self, t: float, call_id: int) -> None:
        if not call_id & 255 and self.thin_at and self._log_entries() > self.thin_at:
            self._thin()
        nxt = self._next_call = call_id + 1
        if self._in_order and nxt < len(self.arrival):
            self.timers.at(self.arrival[nxt], self._arrive, nxt, self._arrival_seq + nxt)
        self.calls[call_id] = CallState(call_id, self.arrival[call_id])
        self._send(t, call_id)

    def _send(self, t: float, call_id: int) -> None:
        cs = self.calls[call_id]
        number = self.client.send(cs, t)
        att = _Attempt(call_id, number, cs.deadline, self.call_class[call_id])
        att.row = self.attempt_log.add(call_id, number, t)
        self.call_log.attempts[call_id] = cs.attempts
        att.timer = self.timers.at(cs.deadline, self._deadline, att, None, True)    # in order
        self._do(t, self._enter(t, att, (self.max_tokens[call_id],), self.prompt_len[call_id]))

    def _deadline(self, t: float, att: _Attempt) -> None:
        att.timer = None                    # fired: the attempt and its timer no longer hold each other
        if not att.open:
            return
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = _TIMEOUT
        self._do(t, self._enter_left(t, att))
        ex = att.execution
        if ex is not None and ex.orphaned:
            erec = self.executions[ex.id]
            if erec.orphaned_at != erec.orphaned_at:
                erec.orphaned_at = t
        self._decide(t, att.call_id, self.client.on_deadline(self.calls[att.call_id], t))

    def _decide(self, t: float, call_id: int, decision) -> None:
        if type(decision) is Retry:
            self.timers.at(decision.at, self._send, call_id)
            return
        calls = self.call_log
        if type(decision) is Delivered:
            calls.delivered_at[call_id] = decision.at
            calls.outcome[call_id] = _DELIVERED
        else:
            calls.outcome[call_id] = _CALL_CODE["failed_" + decision.reason]
        self.calls[call_id] = None          # the call is over: its client state goes
        self.outstanding -= 1
        if self.outstanding == 0 and not self.done.triggered:
            self._finish()

    def _finish(self) -> None:
        """Every call is over: the run ends (timers stop batching)."""
        self._over.append(True)
        self.done.succeed()

    def _close_attempt(self, att: _Attempt, t: float, outcome: int) -> None:
        att.timer.live = False              # Timers.cancel
        att.timer = None                    # the attempt and its timer no longer hold each other
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = outcome

    # ------------------------------------------------------------- proxy side
    def _subscribe(self, t: float, a: Subscribe) -> None:
        att, ex = a.attempt, a.execution
        row, log = att.row, self.attempt_log
        log.execution[row] = ex.id
        if att.attached:
            log.attached[row] = True
        if ex.id == len(self.executions):        # created for this attempt
            i = ex.call_id
            # ExecutionRecord(id, call, attempt, prompt_len, max_tokens, created_at)
            self.executions.append(ExecutionRecord(ex.id, i, att.number, self.prompt_len[i], self.max_tokens[i],
                                                   ex.created_at))

    def _cancel(self, t: float, a: Cancel) -> None:
        self.executions[a.execution.id].cancel_requested_at = t
        self.engines[self.exec_replica[a.execution.id]].abort_request(self.requests.pop(a.execution.id))

    def _refuse(self, t: float, a: Refuse) -> None:
        if type(a.attempt) is Upstream:     # a layer's upstream attempt: the answer goes to that layer
            up = a.attempt
            self._do(t, up.layer.on_refused(t, up, a.status, a.retry_after, a.reason))
            return
        self._close_attempt(a.attempt, t, _ATTEMPT_CODE[refusal_outcome(a.reason)])
        self._decide(t, a.attempt.call_id,
                     self.client.on_refused(self.calls[a.attempt.call_id], t, a.status, a.retry_after))

    def _complete(self, t: float, a: Complete) -> None:
        if type(a.attempt) is Upstream:
            self._do(t, a.attempt.layer.on_complete(t, a.attempt))
            return
        self._close_attempt(a.attempt, t, _COMPLETE)
        self._decide(t, a.attempt.call_id, self.client.on_complete(self.calls[a.attempt.call_id], t))

    def _drop(self, t: float, a: Drop) -> None:
        erec = self.executions[a.execution.id]
        erec.fate, erec.finished_at = "dropped", t

    def _wake_at(self, t: float, a: Wake) -> None:
        self.timers.at(a.at, self._wake, a.execution)

    def _wake(self, t: float, ex) -> None:
        self._do(t, self.proxy.on_wake(t, ex))

    # ------------------------------------------- layers between the client and the proxy
    def _send_below(self, t: float, a) -> None:
        """A layer's upstream attempt goes to the layer below; it logs
        against the row of the client's attempt it serves."""
        up = a.attempt
        up.row = up.above.row
        i = up.call_id
        self._do(t, self._below[up.layer][0](t, up, (self.max_tokens[i],), self.prompt_len[i]))

    def _proxy_attempt(self, t: float, up: Upstream, params: tuple, prompt_len: int) -> list:
        """The lowest layer's upstream attempt reaches the proxy (its row noted in `proxy_rows`)."""
        self.proxy_rows.append(up.row)
        return self.proxy.on_attempt(t, up, params, prompt_len)

    def _leave(self, t: float, a) -> None:
        """A layer closed its upstream attempt: the layer below hears the disconnect."""
        up = a.attempt
        self._do(t, self._below[up.layer][1](t, up))
        ex = up.execution
        if ex is not None and ex.orphaned:
            erec = self.executions[ex.id]
            if erec.orphaned_at != erec.orphaned_at:
                erec.orphaned_at = t

    def _run_on(self, t: float, a) -> None:
        """Nobody waits for a layer's upstream attempt any more: the execution
        serving it (found down the layers below) runs on, orphaned."""
        att = a.attempt
        while att is not None and att.execution is None and type(att) is Upstream:
            below = self._below_layer(att.layer)
            att = below.upstream_of(att) if below is not None else None
        ex = att.execution if att is not None else None
        if ex is not None and ex.live:
            erec = self.executions[ex.id]
            if erec.orphaned_at != erec.orphaned_at:
                erec.orphaned_at = t

    def _below_layer(self, layer):
        """The layer below `layer` between the client and the proxy (None: the proxy)."""
        k = self.layers.index(layer) + 1
        return self.layers[k] if k < len(self.layers) else None

    def _timer_at(self, t: float, a) -> None:
        self.timers.at(a.at, self._layer_timer, a)

    def _layer_timer(self, t: float, a) -> None:
        self._do(t, a.layer.on_timer(t, a.token))

    def _dispatch(self, t: float, ex) -> None:
        """Send an execution to the engine the cluster places it on; an
        engine's refusal (503) sends it on to the next replica the cluster
        names, if any, else it is refused."""
        ex_id, i = ex.id, ex.call_id
        erec = self.executions[ex_id]
        erec.dispatched_at = t
        req = Request(ex_id, i, erec.prompt_len, erec.max_tokens, self.prefix_len[i], record=erec,
                      prefix_group=self.prefix_group[i], priority=self.call_priority[i])
        reps, cl = self.exec_replica, self.cluster
        r = cl.place(ex)
        tried = None
        while r is not None:
            reps[ex_id] = r
            if self.engines[r].add_request(req):
                erec.accepted = True
                self.requests[ex_id] = req
                if self._report_dispatch:
                    self.proxy.on_dispatched(t, ex)
                return
            if tried is None:
                tried = [r]
            r = cl.reroute(i, tried)
        erec.fate, erec.finished_at = "refused", t
        self._do(t, self.proxy.on_engine_refused(t, ex))

    def _do_and_log_replica_queues(self, t: float, actions: list) -> None:
        """`_do` where each replica has a proxy queue of its own: their
        lengths are logged once the actions are all carried out."""
        Interpreter._do(self, t, actions)
        if not self._action_stack:
            for p, log in zip(self.cluster.proxies, self.queue_logs):
                if p.queued != log[-1][1]:
                    log.append((t, p.queued))

    def _on_finished(self, req: Request, t: float) -> None:
        self.requests.pop(req.request_id, None)
        ex = self.proxy.executions.get(req.request_id)
        if ex is not None:
            self._do(t, self.proxy.on_finished(t, ex))

    def _snapshot(self, t: float, _arg=None) -> None:
        for r, e in enumerate(self.engines):
            self.counters_at_r[r][t] = dict(e.scheduler.counters)
        self.counters_at[t] = sum_counters(c[t] for c in self.counters_at_r)

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
        ts = np.arange(0.0, math.floor(end) + 1.0)
        waiting, running, engine_r, extra_r = [], [], [], []
        for e in self.engines:
            w, r = (v.astype(np.int64) for v in sample_columns(e.gauge_log, ts, (1, 2)))
            waiting.append(w)
            running.append(r)
            steps, busy = e.work_by(end)
            engine_r.append({"steps": steps, "preemptions": e.scheduler.num_preemptions,
                             "aborted_before_scheduled": e.aborted_before_scheduled})
            extra_r.append({"busy_s": busy, "step_events": e.num_step_events})
        self.parts = ReplicaParts(ts, waiting, running, engine_r, extra_r)
        extra = sum_counters(extra_r)
        if self.layers:             # what each layer between the client and the proxy did, from the top
            extra["layers"] = [{"kind": kind, "preset": settings.get("preset"), **dict(layer.counts)}
                               for (kind, settings), layer in zip(self.stack.chain, self.layers)]
        proxy_queue = sample_log(self.proxy_queue_log, ts, 1).astype(np.int64)
        series = Series(t=ts, waiting=sum(waiting[1:], waiting[0]), running=sum(running[1:], running[0]),
                        proxy_queue=proxy_queue)
        return RunLog(calls=self.call_log, attempts=self.attempt_log, executions=ExecutionTable(self.executions),
                      series=series, counters=sum_counters(e.scheduler.counters for e in self.engines),
                      counters_at=dict(self.counters_at), engine=sum_counters(engine_r),
                      end_time=end, wall_s=wall, extra=extra)


class ReplicaParts(NamedTuple):
    """Each engine's part of a run's log: its 1 s samples (at `t`), its
    engine work and its step events."""
    t: np.ndarray
    waiting: list
    running: list
    engine: list
    extra: list


def simulate(profile: Profile, trace: Trace, condition: Condition, scenario: Scenario, seed: int = 0,
             max_batched_tokens: int | None = None, fast_forward: bool = True, stack: Stack | None = None) -> RunLog:
    run = Run(profile, trace, condition, scenario, seed, max_batched_tokens, fast_forward,
              snapshot_times=(scenario.pulse_end, scenario.hold_end), stack=stack)
    return run.run()
