"""The SimPy model: the workload's calls, each driven by the client policy,
through the proxy policy, into the engine model — all in simulated time.
`simulate()` returns a RunLog (plain records); `sim.measures` makes the
result record from it."""
from __future__ import annotations

import heapq
import math
import time

import numpy as np
import simpy

from .conditions import Condition
from .engine.core import EngineCore, EngineConfig
from .engine.request import Request
from .policy.client import RetryingClient, CallState, Retry, GiveUp, Delivered
from .engine.request import WAITING
from .policy.proxy import (Proxy, Attempt, EngineView, PromptRate, Subscribe, Dispatch, Refuse, Cancel, Complete,
                           Drop, Wake)
from .profile import Profile
from .runlog import RunLog, CallRecord, AttemptRecord, ExecutionRecord, Series, sample_log, refusal_outcome
from .scenario import Scenario
from .workload import Trace

INF = float("inf")


class Timers:
    """Driver-side timers on the SimPy clock, cancellable, with the time of
    the next live one (the engine may not advance past it in closed form)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.heap: list[list] = []
        self._seq = 0

    def at(self, t: float, fn, *args) -> list:
        entry = [t, self._seq, fn, args, True]
        self._seq += 1
        heapq.heappush(self.heap, entry)
        ev = self.env.timeout(max(0.0, t - self.env.now))
        ev.callbacks.append(lambda _e, entry=entry: self._fire(entry))
        return entry

    def _fire(self, entry: list) -> None:
        if entry[4]:
            entry[4] = False
            entry[2](entry[0], *entry[3])

    @staticmethod
    def cancel(entry: list) -> None:
        entry[4] = False

    def next_time(self) -> float:
        h = self.heap
        while h and not h[0][4]:
            heapq.heappop(h)
        return h[0][0] if h else INF


class Run:
    def __init__(self, profile: Profile, trace: Trace, condition: Condition, scenario: Scenario,
                 seed: int = 0, max_batched_tokens: int | None = None, fast_forward: bool = True,
                 snapshot_times: tuple = ()):
        self.env = env = simpy.Environment()
        self.trace = trace
        self.scenario = scenario
        self.timers = Timers(env)
        rng = np.random.default_rng([seed, 1])   # stream of client backoff draws
        self.client = RetryingClient(condition.client_config(scenario), lambda a, b: float(rng.uniform(a, b)))
        # the proxy's prompt-throughput estimate: computed prompt tokens of the
        # executions that got their first token over the last 60 s; before
        # any, the profile's (capacity x computed prompt tokens per call)
        self.prompt_rate = PromptRate(60.0)
        self.proxy = Proxy(condition.proxy, engine_view=self._engine_view,
                           prompt_throughput=profile.capacity * max(1.0, scenario.prompt_mean - scenario.shared_prefix))
        self.proxy_queue_log: list[tuple[float, int]] = [(0.0, 0)]   # (t, proxy queue length) at changes
        self.engine = EngineCore(env, EngineConfig(profile.scheduler_config(max_batched_tokens), profile.depth,
                                                   condition.engine_cap),
                                 profile.step_time, on_finished=self._on_finished,
                                 on_first_token=self._on_first_token,
                                 next_input_time=self._next_input_time, fast_forward=fast_forward)
        n = len(trace)
        self.calls = [CallState(i, float(trace.arrival[i])) for i in range(n)]
        self.call_records = [CallRecord(i, float(trace.arrival[i])) for i in range(n)]
        self.attempts: list[AttemptRecord] = []
        self.executions: list[ExecutionRecord] = []
        self.requests: dict[int, Request] = {}
        self.deadline_timer: dict[int, list] = {}       # id(attempt) -> timer
        self.attempt_rec: dict[int, AttemptRecord] = {}
        self.outstanding = n
        self.done = env.event()
        self.counters_at: dict[float, dict] = {}
        for t in snapshot_times:
            self.timers.at(t, self._snapshot)
        for i in range(n):
            self.timers.at(float(trace.arrival[i]), self._send, i)
        if n == 0:
            self.done.succeed()

    # ------------------------------------------------------------ client side
    def _send(self, t: float, call_id: int) -> None:
        cs = self.calls[call_id]
        number = self.client.send(cs, t)
        att = Attempt(call_id, number, cs.deadline)
        rec = AttemptRecord(call=call_id, number=number, sent_at=t)
        self.attempts.append(rec)
        self.attempt_rec[id(att)] = rec
        self.call_records[call_id].attempts = cs.attempts
        self.deadline_timer[id(att)] = self.timers.at(cs.deadline, self._deadline, att)
        self._do(t, self.proxy.on_attempt(t, att, (int(self.trace.max_tokens[call_id]),),
                                          int(self.trace.prompt_len[call_id])))

    def _deadline(self, t: float, att: Attempt) -> None:
        self.deadline_timer.pop(id(att), None)
        if not att.open:
            return
        rec = self.attempt_rec.pop(id(att))
        rec.ended_at, rec.outcome = t, "timeout"
        self._do(t, self.proxy.on_attempt_left(t, att))
        ex = att.execution
        if ex is not None and ex.orphaned:
            erec = self.executions[ex.id]
            if erec.orphaned_at != erec.orphaned_at:
                erec.orphaned_at = t
        self._decide(t, att.call_id, self.client.on_deadline(self.calls[att.call_id], t))

    def _decide(self, t: float, call_id: int, decision) -> None:
        if isinstance(decision, Retry):
            self.timers.at(decision.at, self._send, call_id)
            return
        crec = self.call_records[call_id]
        if isinstance(decision, Delivered):
            crec.delivered_at = decision.at
            crec.outcome = "delivered"
        else:
            crec.outcome = "failed_" + decision.reason
        self.outstanding -= 1
        if self.outstanding == 0 and not self.done.triggered:
            self.done.succeed()

    def _close_attempt(self, att: Attempt) -> AttemptRecord:
        timer = self.deadline_timer.pop(id(att), None)
        if timer is not None:
            Timers.cancel(timer)
        return self.attempt_rec.pop(id(att))

    # ------------------------------------------------------------- proxy side
    def _do(self, t: float, actions: list) -> None:
        for a in actions:
            if isinstance(a, Subscribe):
                rec = self.attempt_rec[id(a.attempt)]
                ex = a.execution
                rec.execution = ex.id
                rec.attached = a.attempt.attached
                if ex.id == len(self.executions):        # created for this attempt
                    i = ex.call_id
                    self.executions.append(ExecutionRecord(
                        id=ex.id, call=i, attempt=a.attempt.number, prompt_len=int(self.trace.prompt_len[i]),
                        max_tokens=int(self.trace.max_tokens[i]), created_at=ex.created_at))
            elif isinstance(a, Dispatch):
                self._dispatch(t, a.execution)
            elif isinstance(a, Cancel):
                self.executions[a.execution.id].cancel_requested_at = t
                self.engine.abort_request(self.requests[a.execution.id])
            elif isinstance(a, Refuse):
                rec = self._close_attempt(a.attempt)
                rec.ended_at = t
                rec.outcome = refusal_outcome(a.reason)
                self._decide(t, a.attempt.call_id,
                             self.client.on_refused(self.calls[a.attempt.call_id], t, a.status, a.retry_after))
            elif isinstance(a, Complete):
                rec = self._close_attempt(a.attempt)
                rec.ended_at, rec.outcome = t, "complete"
                self._decide(t, a.attempt.call_id, self.client.on_complete(self.calls[a.attempt.call_id], t))
            elif isinstance(a, Drop):
                erec = self.executions[a.execution.id]
                erec.fate, erec.finished_at = "dropped", t
            elif isinstance(a, Wake):
                self.timers.at(a.at, self._wake, a.execution)
            else:  # pragma: no cover
                raise TypeError(f"unknown proxy action {a!r}")
        q = self.proxy.queued
        if q != self.proxy_queue_log[-1][1]:
            self.proxy_queue_log.append((t, q))

    def _next_input_time(self) -> float:
        """When the engine may next get input: the next timer, or — while
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
        prefix, group = self.trace.prefix_of(ex.call_id)
        req = Request(ex.id, ex.call_id, erec.prompt_len, erec.max_tokens, prefix, record=erec, prefix_group=group)
        if self.engine.add_request(req):
            erec.accepted = True
            self.requests[ex.id] = req
            self.proxy.on_dispatched(t, ex)
        else:
            erec.fate, erec.finished_at = "refused", t
            self._do(t, self.proxy.on_engine_refused(t, ex))

    def _engine_view(self, t: float) -> EngineView:
        """Uncomputed prompt tokens of the executions waiting or running in
        the engine (or on their way in), and the recent prompt throughput."""
        eng = self.engine
        s = eng.scheduler
        tok = 0
        for r in s.waiting:
            if r.status == WAITING:
                tok += r.prompt_len - min(r.prompt_len, r.num_computed_tokens)
        for r in s.prefilling:
            tok += max(0, r.prompt_len - r.num_computed_tokens)
        for kind, r in eng.inbox:
            if kind == "add":
                tok += r.prompt_len
        return EngineView(float(tok), self.prompt_rate.rate(t))

    def _on_first_token(self, req: Request, t: float) -> None:
        rec = req.record
        self.prompt_rate.add(t, rec.prompt_computed if rec is not None else req.prompt_len)

    def _on_finished(self, req: Request, t: float) -> None:
        self.requests.pop(req.request_id, None)
        ex = self.proxy.executions.get(req.request_id)
        if ex is not None:
            self._do(t, self.proxy.on_finished(t, ex))

    def _snapshot(self, t: float) -> None:
        self.counters_at[t] = dict(self.engine.scheduler.counters)

    # ------------------------------------------------------------------- run
    def run(self, until: float | None = None) -> RunLog:
        t0 = time.perf_counter()
        if until is None:
            last = float(self.trace.arrival[-1]) if len(self.trace) else 0.0
            until = last + self.scenario.delivery_horizon_s
        self.env.run(until=simpy.AnyOf(self.env, [self.done, self.env.timeout(until)]))
        end = self.env.now
        wall = time.perf_counter() - t0
        return self._log(end, wall)

    def _log(self, end: float, wall: float) -> RunLog:
        eng = self.engine
        ts = np.arange(0.0, math.floor(end) + 1.0)
        waiting = sample_log(eng.gauge_log, ts, 1).astype(np.int64)
        running = sample_log(eng.gauge_log, ts, 2).astype(np.int64)
        proxy_queue = sample_log(self.proxy_queue_log, ts, 1).astype(np.int64)
        series = Series(t=ts, waiting=waiting, running=running, proxy_queue=proxy_queue)
        s = eng.scheduler
        steps, busy = eng.work_by(end)
        return RunLog(calls=self.call_records, attempts=self.attempts, executions=self.executions,
                      series=series, counters=dict(s.counters), counters_at=dict(self.counters_at),
                      engine={"steps": steps, "preemptions": s.num_preemptions,
                              "aborted_before_scheduled": eng.aborted_before_scheduled},
                      end_time=end, wall_s=wall, extra={"busy_s": busy, "step_events": eng.num_plans})


def simulate(profile: Profile, trace: Trace, condition: Condition, scenario: Scenario, seed: int = 0,
             max_batched_tokens: int | None = None, fast_forward: bool = True) -> RunLog:
    run = Run(profile, trace, condition, scenario, seed, max_batched_tokens, fast_forward,
              snapshot_times=(scenario.pulse_end, scenario.hold_end))
    return run.run()
