"""The SimPy model: the workload's calls, each driven by the client policy,
through the proxy policy, into the engine model — all in simulated time.
`simulate()` returns a RunLog (plain records); `sim.measures` makes the
result record from it."""
from __future__ import annotations

import gc
import math
import time

import numpy as np
import simpy

from .classes import call_priorities, clients
from .clock import Clock, Timers
from .conditions import Condition
from .engine.core import EngineCore, EngineConfig
from .engine.request import Request
from .policy.client import CallState, Retry, Delivered
from .policy.proxy import (Proxy, Attempt, EngineView, PromptRate, Subscribe, Dispatch, Refuse, Cancel, Complete,
                           Drop, Wake)
from .profile import Profile
from .runlog import (RunLog, ExecutionRecord, ExecutionTable, Series, AttemptTable, CallTable, ATTEMPT_OUTCOMES,
                     CALL_OUTCOMES, sample_columns, sample_log, refusal_outcome, thin_log)
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


class Run:
    def __init__(self, profile: Profile, trace: Trace, condition: Condition, scenario: Scenario,
                 seed: int = 0, max_batched_tokens: int | None = None, fast_forward: bool = True,
                 snapshot_times: tuple = ()):
        self.env = env = Clock()
        self.trace = trace
        self.scenario = scenario
        self.done = env.event()
        self._over: list = []       # [True] once every call is over and `done` triggered (its length: Timers' stop)
        self.timers = Timers(env, horizon=self._horizon, stop=self._over.__len__)
        # traffic classes: each call's client settings and engine priority are its class's (sim.classes)
        self.client = clients(condition, scenario, trace, uniform_draws(np.random.default_rng([seed, 1])))
        self.call_priority = call_priorities(trace, scenario)
        self.proxy_queue_log: list[tuple[float, int]] = [(0.0, 0)]   # (t, proxy queue length) at changes
        self._build(profile, condition, scenario, max_batched_tokens, fast_forward)
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
        self.thin_at = 0      # thin the gauge logs beyond this many entries, looked at every 256th arrival
        #                       (0: never; run() sets it)
        self._action_stack: list = []       # (t, actions) lists being carried out (see _do)
        self._doing = False                 # _do's loop is running
        # the timers' functions, bound once: a timer keeps its function, and
        # binding one at each timer set would make a new object every time
        self._arrive, self._send, self._deadline, self._wake = self._arrive, self._send, self._deadline, self._wake
        self._handlers = {Subscribe: self._subscribe, Cancel: self._cancel,
                          Refuse: self._refuse, Complete: self._complete, Drop: self._drop, Wake: self._wake_at}
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
        if n == 0:
            self._finish()

    def _build(self, profile: Profile, condition: Condition, scenario: Scenario, max_batched_tokens: int | None,
               fast_forward: bool) -> None:
        """Make the proxy (`self.proxy`) and the engine (`self.engine`); a
        driver of several engines (`sim.fleet`) makes its own."""
        # the proxy's prompt-throughput estimate: computed prompt tokens of the
        # executions that got their first token over the last 60 s; before
        # any, the profile's (capacity x computed prompt tokens per call);
        # kept only where the proxy reads its view (`Proxy.estimate_wait`)
        self.prompt_rate = PromptRate(60.0)
        reads_view = condition.proxy.queue == "deadline" or condition.proxy.budget is not None
        self.proxy = Proxy(condition.proxy, engine_view=self._engine_view,
                           prompt_throughput=prompt_throughput(profile, scenario))
        self.engine = EngineCore(self.env, engine_config(profile, condition, max_batched_tokens, scenario),
                                 profile.step_time, on_finished=self._on_finished,
                                 on_first_token=self._on_first_token if reads_view else None,
                                 next_input_time=self._next_input_time, fast_forward=fast_forward,
                                 next_abort_time=never if condition.proxy.cancellation == "off" else None)

    def _gauge_logs(self) -> list[list]:
        """The engines' gauge logs (one engine here; a fleet has several)."""
        return [self.engine.gauge_log]

    def _log_entries(self) -> int:
        return sum(len(log) for log in self._gauge_logs()) + len(self.proxy_queue_log)

    def _thin(self) -> None:
        """Thin the gauge logs to what the 1 s series needs (see `thin_log`)."""
        for log in self._gauge_logs():
            thin_log(log)
        thin_log(self.proxy_queue_log)
        self.thin_at = max(self.thin_at, 2 * self._log_entries())

    def _horizon(self) -> float:
        """The timers' horizon (the contract in sim.clock): the end of the
        engine's step in flight (-INF while it is idle)."""
        pending = self.engine.pending
        return pending[0].end if pending else -INF

    # ------------------------------------------------------------ client side
    def _arrive(self, t: float, call_id: int) -> None:
        if not call_id & 255 and self.thin_at and self._log_entries() > self.thin_at:
            self._thin()
        nxt = call_id + 1
        if self._in_order and nxt < len(self.arrival):
            self.timers.at(self.arrival[nxt], self._arrive, nxt, self._arrival_seq + nxt)
        self.calls[call_id] = CallState(call_id, self.arrival[call_id])
        self._send(t, call_id)

    def _send(self, t: float, call_id: int) -> None:
        cs = self.calls[call_id]
        number = self.client.send(cs, t)
        att = _Attempt(call_id, number, cs.deadline)
        att.row = self.attempt_log.add(call_id, number, t)
        self.call_log.attempts[call_id] = cs.attempts
        att.timer = self.timers.at(cs.deadline, self._deadline, att, None, True)    # in order
        self._do(t, self.proxy.on_attempt(t, att, (self.max_tokens[call_id],), self.prompt_len[call_id]))

    def _deadline(self, t: float, att: _Attempt) -> None:
        att.timer = None                    # fired: the attempt and its timer no longer hold each other
        if not att.open:
            return
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = _TIMEOUT
        self._do(t, self.proxy.on_attempt_left(t, att))
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
    def _do(self, t: float, actions: list) -> None:
        """Carry out the proxy's actions in order. Actions that a handler's
        own call produces (an engine refusal's, which dispatches the next
        queued execution) run next, before the rest of the outer list, as a
        nested call would run them, but from one loop: a long chain of
        refusals does not grow the stack. `_action_stack` holds the lists
        left to carry out once a handler produced actions (empty otherwise)."""
        stack = self._action_stack
        if self._doing:                     # a handler's own actions: the loop running already takes them next
            stack.append((t, iter(actions)))
            return
        if actions:
            self._doing = True
            handlers = self._handlers
            k = 0
            for a in actions:
                k += 1
                ta = type(a)
                if ta is Subscribe:
                    self._subscribe(t, a)
                elif ta is Dispatch:
                    self._dispatch(t, a.execution)
                else:
                    handlers[ta](t, a)
                if stack:                   # the handler's own actions, on the stack now, come first
                    stack.insert(0, (t, iter(actions[k:])))
                    self._do_nested()       # logs the queue as each list ends, this one's rest last
                    self._doing = False
                    return
            self._doing = False
        q = self.proxy.queued
        if q != self.proxy_queue_log[-1][1]:
            self.proxy_queue_log.append((t, q))

    def _do_nested(self) -> None:
        """`_do`'s loop once a handler's own actions are on the stack: the
        top list first, then the rest of the lists below it, each logging
        the proxy queue when done."""
        stack, handlers = self._action_stack, self._handlers
        while stack:
            at, it = stack[-1]
            depth = len(stack)
            for a in it:
                if type(a) is Dispatch:
                    self._dispatch(at, a.execution)
                else:
                    handlers[type(a)](at, a)
                if len(stack) != depth:
                    break                   # the handler's own actions, on the stack now, come first
            else:
                stack.pop()
                q = self.proxy.queued
                if q != self.proxy_queue_log[-1][1]:
                    self.proxy_queue_log.append((at, q))

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
        self.engine.abort_request(self.requests.pop(a.execution.id))

    def _refuse(self, t: float, a: Refuse) -> None:
        self._close_attempt(a.attempt, t, _ATTEMPT_CODE[refusal_outcome(a.reason)])
        self._decide(t, a.attempt.call_id,
                     self.client.on_refused(self.calls[a.attempt.call_id], t, a.status, a.retry_after))

    def _complete(self, t: float, a: Complete) -> None:
        self._close_attempt(a.attempt, t, _COMPLETE)
        self._decide(t, a.attempt.call_id, self.client.on_complete(self.calls[a.attempt.call_id], t))

    def _drop(self, t: float, a: Drop) -> None:
        erec = self.executions[a.execution.id]
        erec.fate, erec.finished_at = "dropped", t

    def _wake_at(self, t: float, a: Wake) -> None:
        self.timers.at(a.at, self._wake, a.execution)

    def _next_input_time(self) -> float:
        """The engine's horizon (sim.clock): the next timer, or — while
        the proxy holds executions in its queue — the end of the first step
        in flight that finishes a request (its completion frees a seat under
        the proxy cap, and a queued execution is dispatched then)."""
        t = self.timers.next_time()
        if self.proxy.queued:
            for plan in self.engine.pending:
                if plan.finishing:
                    return min(t, plan.end)
        return t

    def _wake(self, t: float, ex) -> None:
        self._do(t, self.proxy.on_wake(t, ex))

    def _dispatch(self, t: float, ex) -> None:
        erec = self.executions[ex.id]
        erec.dispatched_at = t
        i = ex.call_id
        req = Request(ex.id, i, erec.prompt_len, erec.max_tokens, self.prefix_len[i], record=erec,
                      prefix_group=self.prefix_group[i], priority=self.call_priority[i])
        if self.engine.add_request(req):
            erec.accepted = True
            self.requests[ex.id] = req
            if self._report_dispatch:
                self.proxy.on_dispatched(t, ex)
        else:
            erec.fate, erec.finished_at = "refused", t
            self._do(t, self.proxy.on_engine_refused(t, ex))

    def _engine_view(self, t: float) -> EngineView:
        """Uncomputed prompt tokens of the executions waiting or running in
        the engine (or on their way in), and the recent prompt throughput."""
        return EngineView(float(self.engine.uncomputed_prompt_tokens()), self.prompt_rate.rate(t))

    def _on_first_token(self, req: Request, t: float) -> None:
        rec = req.record
        self.prompt_rate.add(t, rec.prompt_computed if rec is not None else req.num_prompt_tokens)

    def _on_finished(self, req: Request, t: float) -> None:
        self.requests.pop(req.request_id, None)
        ex = self.proxy.executions.get(req.request_id)
        if ex is not None:
            self._do(t, self.proxy.on_finished(t, ex))

    def _snapshot(self, t: float, _arg=None) -> None:
        self.counters_at[t] = dict(self.engine.scheduler.counters)

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
        eng = self.engine
        ts = np.arange(0.0, math.floor(end) + 1.0)
        waiting, running = (v.astype(np.int64) for v in sample_columns(eng.gauge_log, ts, (1, 2)))
        proxy_queue = sample_log(self.proxy_queue_log, ts, 1).astype(np.int64)
        series = Series(t=ts, waiting=waiting, running=running, proxy_queue=proxy_queue)
        s = eng.scheduler
        steps, busy = eng.work_by(end)
        return RunLog(calls=self.call_log, attempts=self.attempt_log, executions=ExecutionTable(self.executions),
                      series=series, counters=dict(s.counters), counters_at=dict(self.counters_at),
                      engine={"steps": steps, "preemptions": s.num_preemptions,
                              "aborted_before_scheduled": eng.aborted_before_scheduled},
                      end_time=end, wall_s=wall, extra={"busy_s": busy, "step_events": eng.num_step_events})


def simulate(profile: Profile, trace: Trace, condition: Condition, scenario: Scenario, seed: int = 0,
             max_batched_tokens: int | None = None, fast_forward: bool = True) -> RunLog:
    run = Run(profile, trace, condition, scenario, seed, max_batched_tokens, fast_forward,
              snapshot_times=(scenario.pulse_end, scenario.hold_end))
    return run.run()
