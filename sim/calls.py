"""The workload side of a run (`sim.model.Run`): each call's arrival, its
client's attempts with their deadlines, and the client's decisions on them
(a retry timer, the call delivered or given up), logged in the run's call
and attempt tables. The attempts go down the run's chain of layers
(`enter`, `enter_left`, `do`, `disconnect`: the run's `Interpreter`, set by
the run once it is wired)."""
from __future__ import annotations

import numpy as np

from .classes import call_classes, call_priorities
from .policy.client import CallState, Delivered, Retry
from .policy.proxy import Attempt, Complete, Refuse
from .runlog import ATTEMPT_OUTCOMES, CALL_OUTCOMES, AttemptTable, CallTable, refusal_outcome
from .scenario import Scenario
from .workload import Trace

_ATTEMPT_CODE = {o: i for i, o in enumerate(ATTEMPT_OUTCOMES)}
_CALL_CODE = {o: i for i, o in enumerate(CALL_OUTCOMES)}
_TIMEOUT, _COMPLETE, _DELIVERED = _ATTEMPT_CODE["timeout"], _ATTEMPT_CODE["complete"], _CALL_CODE["delivered"]


class CallAttempt(Attempt):
    """An attempt with the driver's bookkeeping: its row in the attempt log
    and its deadline timer (set by `Calls.send`; None once the timer fired
    or was cancelled, so that the two make no reference cycle that would
    outlive the attempt)."""
    __slots__ = ("row", "timer")


class Calls:
    """The calls of `trace` on the timers of a run, each driven by `client`
    (`send`, `on_deadline`, `on_refused`, `on_complete`: its decisions).
    `done` succeeds once every call is over, and `over` (a list) is then
    [True] (its length: the timers' stop). `thin()` is called at every 256th arrival
    (the run's gauge logs)."""

    def __init__(self, trace: Trace, scenario: Scenario, timers, client, done, over: list, thin=None):
        n = len(trace)
        self.timers, self.client, self.done, self.over, self.thin = timers, client, done, over, thin
        self.arrival = trace.arrival.tolist()
        self.max_tokens = trace.max_tokens.tolist()
        self.prompt_len = trace.prompt_len.tolist()
        # each call's shared-prefix tokens and prefix group (trace.prefix_of)
        self.prefix_len = trace.prefix_len.tolist() if trace.prefix_len is not None else [trace.shared_prefix] * n
        self.prefix_group = trace.prefix_group.tolist() if trace.prefix_len is not None else [0] * n
        self.call_priority = call_priorities(trace, scenario)
        self.call_class = call_classes(trace, scenario)     # carried by each attempt (shedding by class)
        self.calls: list[CallState | None] = [None] * n     # client state of the calls in progress
        self.call_log = CallTable.planned(trace.arrival)
        self.attempt_log = AttemptTable()
        self.outstanding = n
        self.next_call = 0                  # first call whose arrival has not fired
        self.in_order = bool(n < 2 or (np.diff(trace.arrival) >= 0).all())
        self.enter = self.enter_left = self.do = self.disconnect = None     # the chain's (`wire`)
        # the timers' functions, bound once: a timer keeps its function, and
        # binding one at each timer set would make a new object every time
        self.arrive, self.send, self.deadline = self.arrive, self.send, self.deadline

    def wire(self, chain) -> None:
        """Send the attempts down `chain` (an `Interpreter` once wired: `_chain`)."""
        self.enter, self.enter_left, self.do, self.disconnect = (chain._enter, chain._enter_left, chain._do,
                                                                 chain._disconnect)

    def plan(self) -> None:
        """Set the arrivals: in order, each one, when it fires, sets the
        next, with the sequence number it would have had if set now."""
        n = len(self.arrival)
        self.arrival_seq = self.timers.reserve(n)
        for i in range(n if not self.in_order else min(n, 1)):
            self.timers.at(self.arrival[i], self.arrive, i, seq=self.arrival_seq + i)
        if n == 0:
            self.finish()

    def arrive(self, t: float, call_id: int) -> None:
        if not call_id & 255 and self.thin is not None:
            self.thin()
        nxt = self.next_call = call_id + 1
        if self.in_order and nxt < len(self.arrival):
            self.timers.at(self.arrival[nxt], self.arrive, nxt, self.arrival_seq + nxt)
        self.calls[call_id] = CallState(call_id, self.arrival[call_id])
        self.send(t, call_id)

    def send(self, t: float, call_id: int) -> None:
        cs = self.calls[call_id]
        number = self.client.send(cs, t)
        att = CallAttempt(call_id, number, cs.deadline, self.call_class[call_id])
        att.row = self.attempt_log.add(call_id, number, t)
        self.call_log.attempts[call_id] = cs.attempts
        att.timer = self.timers.at(cs.deadline, self.deadline, att, None, True)    # in order
        self.do(t, self.enter(t, att, (self.max_tokens[call_id],), self.prompt_len[call_id]))

    def deadline(self, t: float, att: CallAttempt) -> None:
        att.timer = None                    # fired: the attempt and its timer no longer hold each other
        if not att.open:
            return
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = _TIMEOUT
        self.disconnect(t, att, self.enter_left)
        self.decide(t, att.call_id, self.client.on_deadline(self.calls[att.call_id], t))

    def refused(self, t: float, a: Refuse) -> None:
        """The chain refused a call's attempt."""
        self.close_attempt(a.attempt, t, _ATTEMPT_CODE[refusal_outcome(a.reason)])
        self.decide(t, a.attempt.call_id,
                    self.client.on_refused(self.calls[a.attempt.call_id], t, a.status, a.retry_after))

    def completed(self, t: float, a: Complete) -> None:
        """A call's attempt got the complete response."""
        self.close_attempt(a.attempt, t, _COMPLETE)
        self.decide(t, a.attempt.call_id, self.client.on_complete(self.calls[a.attempt.call_id], t))

    def decide(self, t: float, call_id: int, decision) -> None:
        if type(decision) is Retry:
            self.timers.at(decision.at, self.send, call_id)
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
            self.finish()

    def finish(self) -> None:
        """Every call is over: the run ends (timers stop batching)."""
        self.over.append(True)
        self.done.succeed()

    def close_attempt(self, att: CallAttempt, t: float, outcome: int) -> None:
        att.timer.live = False              # Timers.cancel
        att.timer = None                    # the attempt and its timer no longer hold each other
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = outcome
