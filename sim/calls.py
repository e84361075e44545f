"""The workload side of a run (`sim.model.Run`): each call's arrival, handed
to the run's client layer (`sim.policy.client.ClientLayer`), its attempts
logged and held to their deadlines, and the call's end (delivered, given
up), in the run's call and attempt tables. The client's actions are carried
out here (`answer`): its attempts sent into the run's chain of layers
(`do`, `enter`, `enter_left`, `disconnect`: the run's `Interpreter`, set by
the run once it is wired), which hands the workload side their answers
(`refused`, `completed`), its retries' timers, and the call's end
(`delivered`, `given_up`)."""
from __future__ import annotations

import numpy as np

from .classes import call_classes, call_priorities
from .policy.client import CallAttempt, CallState, Delivered, GivenUp
from .policy.layers import Send, Timer
from .policy.proxy import Complete, Refuse
from .runlog import ATTEMPT_OUTCOMES, CALL_OUTCOMES, AttemptTable, CallTable, refusal_outcome
from .scenario import Scenario
from .workload import Trace

_ATTEMPT_CODE = {o: i for i, o in enumerate(ATTEMPT_OUTCOMES)}
_CALL_CODE = {o: i for i, o in enumerate(CALL_OUTCOMES)}
_TIMEOUT, _COMPLETE = _ATTEMPT_CODE["timeout"], _ATTEMPT_CODE["complete"]


class Calls:
    """The calls of `trace` on the timers of a run, each handed to `client`
    (a `ClientLayer`). `done` succeeds once every call is over, and `over`
    (a list) is then [True] (its length: the timers' stop). `thin()` is
    called at every 256th arrival (the run's gauge logs)."""

    def __init__(self, trace: Trace, scenario: Scenario, timers, client, done, over: list, thin=None):
        n = len(trace)
        self.timers, self.client, self.done, self.over, self.thin = timers, client, done, over, thin
        self.arrival = trace.arrival.tolist()
        self.max_tokens = trace.max_tokens.tolist()
        self.prompt_len = trace.prompt_len.tolist()
        # each call's shared-prefix tokens and prefix group (trace.prefix_of)
        self.prefix_len = trace.prefix_len.tolist() if trace.prefix_len is not None else [trace.shared_prefix] * n
        self.prefix_group = trace.prefix_group.tolist() if trace.prefix_len is not None else [0] * n
        # the prompt each call sends past its prefix (trace.prompt_id): a pool's, else its own
        self.prompt_id = trace.prompt_id.tolist() if trace.prompt_id is not None else range(n)
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
        self.arrive, self.deadline, self.retry = self.arrive, self.deadline, self.retry
        # the client's actions, carried out here (`answer`): each list is the last step of the hook that made
        # it, so each action runs at once by its handler, the order the chain's `do` would give them; without
        # the chain's loop, 0.5% fewer instructions in bench_fleet's fleet of 8 (callgrind)
        self.answers = {Send: self.sent, Timer: self.retry_at, Delivered: self.delivered, GivenUp: self.given_up}

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
        call = self.calls[call_id] = CallState(call_id, self.arrival[call_id], self.call_class[call_id])
        # `answer` inlined here, in `retry` and in `deadline`: 0.45% fewer instructions (fleet of 8, callgrind)
        for b in self.client.on_call(t, call):
            self.answers[type(b)](t, b)

    def answer(self, t: float, actions: list) -> None:
        """Carry out the client's actions (`answers`): its attempt sent, its
        retry's timer, the call delivered or given up."""
        answers = self.answers
        for a in actions:
            answers[type(a)](t, a)

    def retry_at(self, t: float, a: Timer) -> None:
        """The client's timer (a retry's wait; its token is the call): the client's `on_timer` at `a.at`."""
        self.timers.at(a.at, self.retry, a)

    def retry(self, t: float, a: Timer) -> None:
        """The client's timer came due: its layer's `on_timer` (the retry's attempt)."""
        for b in a.layer.on_timer(t, a.token):
            self.answers[type(b)](t, b)

    def sent(self, t: float, a: Send) -> None:
        """The client's attempt goes out: logged, held to its deadline, and into the chain."""
        att = a.attempt
        call_id = att.call_id
        att.row = self.attempt_log.add(call_id, att.number, t)
        self.call_log.attempts[call_id] = att.call.attempts
        att.timer = self.timers.at(att.deadline, self.deadline, att, None, True)    # in order
        self.do(t, self.enter(t, att, (self.max_tokens[call_id],), self.prompt_len[call_id]))

    def deadline(self, t: float, att: CallAttempt) -> None:
        att.timer = None                    # fired: the attempt and its timer no longer hold each other
        if not att.open:
            return
        log = self.attempt_log
        log.ended_at[att.row] = t
        log.outcome[att.row] = _TIMEOUT
        self.disconnect(t, att, self.enter_left)
        for b in self.client.on_deadline(t, att):
            self.answers[type(b)](t, b)

    def refused(self, t: float, a: Refuse) -> None:
        """The chain refused a call's attempt."""
        att = a.attempt
        self.close_attempt(att, t, _ATTEMPT_CODE[refusal_outcome(a.reason)])
        self.answer(t, self.client.on_refused(t, att, a.status, a.retry_after, a.reason))

    def completed(self, t: float, a: Complete) -> None:
        """A call's attempt got the complete response."""
        self.close_attempt(a.attempt, t, _COMPLETE)
        self.answer(t, self.client.on_complete(t, a.attempt))

    def delivered(self, t: float, a: Delivered) -> None:
        """The client delivered the call: it is over."""
        call_id = a.call.call_id
        self.call_log.delivered_at[call_id] = t
        self.end(call_id, a.call.outcome)

    def given_up(self, t: float, a: GivenUp) -> None:
        """The client gave the call up: it is over (`call.outcome` says how)."""
        self.end(a.call.call_id, a.call.outcome)

    def end(self, call_id: int, outcome: str) -> None:
        """The call is over, with `outcome` (a `CALL_OUTCOMES` name)."""
        self.call_log.outcome[call_id] = _CALL_CODE[outcome]
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
