"""The clock of a run: everything that schedules events in simulated time.

The simulator runs on SimPy. For speed, this module — and no other (see
tests/test_layers.py) — reaches into SimPy's private attributes: the event
queue `_queue` (a heap of (time, priority, event id, event)), the time
`_now`, the event-id counter `_eid` and an event's `_ok`, `_value` and
`_defused`. They were checked against the SimPy versions pyproject.toml
pins. `PublicClock` runs the same model through SimPy's public API alone
(`Environment.run`, `timeout`, `process`), one SimPy timeout per timer;
tests/test_clock.py holds that its records are the fast path's.

What schedules:
- `Clock`: the SimPy environment of a run (the engine's and the
  driver's), with `Environment.run`'s loop inlined, and the entries it runs
  without SimPy's event machinery (`Call`): `call_later(delay, fn)`,
  `call_when(t, fn)`;
- `Timers`: the driver's timers (a call's arrival, an attempt's deadline, a
  retry, a wake-up), cancellable, fired in batches (`Timer` is one timer);
- `RoutedTimers`: timers also filed by the engine replica they may reach.

The horizon (the contract between the engine and the driver). Two parties
move past several instants at once: the engine, which decides a run of
identical decode-only steps in closed form (a fast-forward), and the
timers, which fire every timer due in a stretch in one SimPy event. Each
may do so only where nothing can come in meanwhile that would have changed
what it did, so each asks the other for a horizon, a time before which it
promises no input:
- the engine asks the driver `next_input_time()`: no input reaches this
  engine before it — no request added or aborted, and nothing reads what a
  fast-forward takes ahead (a router reading its KV usage). Every live timer
  whose firing may reach the engine bounds it, and so does any step of any
  engine whose end may make a proxy dispatch to it (a queued execution let
  go when a seat frees). `next_abort_time()` is the same bound for aborts
  alone, asked while admission is blocked (an added request then changes
  none of the steps). The engine decides a step now only if no input is due
  before the boundary at which stepping one step at a time would decide it
  (`EngineCore._fast_forward_limit`);
- the timers ask the driver `horizon()`: no event but a timer happens before
  it — the earliest end of a step in flight, -INF while an engine is idle
  (an input may start a step at once). A batch fires the timers due before
  it, each in its own order and as of its own time (`now` reads it), which
  is what the engine and the policies would see had each fired alone; a tie
  with the horizon is left to the clock.
A bound that is too early costs only speed; one too late changes the run.
tests/test_engine.py compares fast-forwarding with stepping one step at a
time, tests/test_controls.py batched timers with timers fired alone.
"""
from __future__ import annotations

import itertools
from collections import deque
from functools import partial
from heapq import heappop, heappush, heapreplace

import simpy
from simpy.core import StopSimulation
from simpy.events import NORMAL, URGENT, Event

INF = float("inf")


class Call:
    """An entry of the SimPy queue that calls `fn(self)` when the clock
    reaches it: a triggered event, lighter than a simpy.Event. It holds no
    state of its own, so one `Call` per function serves every time it is
    queued (`Calls`)."""
    __slots__ = ("callbacks",)
    _ok = True

    def __init__(self, fn):
        self.callbacks = [fn]


class Calls(dict):
    """Each function's `Call`, made the first time it is asked for (an
    engine's step end and the timers' tick are queued again and again:
    one object each rather than one a step)."""

    def __missing__(self, fn) -> Call:
        call = self[fn] = Call(fn)
        return call


class Clock(simpy.Environment):
    """The SimPy environment of a run, with an event scheduled at an exact
    time for the driver's timers (which also set `now` to a timer's own time
    while it fires in a batch, see `Timers`)."""
    public = False          # schedules through SimPy's private attributes (see PublicClock)

    def __init__(self, initial_time: float = 0):
        super().__init__(initial_time)
        self._calls = Calls()

    def call_later(self, delay: float, fn, priority=NORMAL) -> None:
        """Call `fn(event)` at now + delay (the time a SimPy timeout of
        `delay` would fire, in the same order: `schedule` inlined)."""
        heappush(self._queue, (self._now + delay, priority, next(self._eid), self._calls[fn]))

    def call_when(self, t: float, fn) -> None:
        """Call `fn(event)` at t, or now if t has passed: now + max(0, t -
        now), the time a SimPy timeout set now for t would fire."""
        now = self._now
        d = t - now
        heappush(self._queue, (now + d if d > 0.0 else now, NORMAL, next(self._eid), self._calls[fn]))

    def run(self, until=None):
        """As `simpy.Environment.run` (same `until` forms, result and
        errors), with `step()` carried out inline in its loop; a `Call`
        entry (the engine's and the timers') runs its one callback, which
        never stops the simulation, and is left as it was (it may be queued
        again)."""
        if until is not None:
            if not isinstance(until, Event):
                at = until if isinstance(until, int) else float(until)
                if at <= self._now:
                    raise ValueError(f"until ({at}) must be greater than the current simulation time")
                until = Event(self)     # before all regular timeouts, as simpy's
                until._ok = True
                until._value = None
                self.schedule(until, URGENT, at - self._now)
            elif until.callbacks is None:
                return until.value      # processed already
            until.callbacks.append(StopSimulation.callback)
        queue, pop = self._queue, heappop
        try:
            while queue:
                self._now, _, _, event = pop(queue)
                if type(event) is Call:         # one callback, which never stops the simulation
                    event.callbacks[0](event)
                    continue
                callbacks, event.callbacks = event.callbacks, None
                try:
                    for callback in callbacks:
                        callback(event)
                except StopSimulation:
                    # the rest of the event's callbacks run when the simulation resumes
                    event.callbacks = callbacks[callbacks.index(callback) + 1:]
                    self.schedule(event, URGENT - 1)
                    raise
                if not event._ok and not hasattr(event, "_defused"):
                    exc = type(event._value)(*event._value.args)    # a failed event nobody defused
                    exc.__cause__ = event._value
                    raise exc
        except StopSimulation as exc:
            return exc.args[0]
        if until is not None:
            raise RuntimeError(f'No scheduled events left but "until" event was not triggered: {until}')
        return None

    def schedule_at(self, t: float, callback) -> None:
        """Call `callback(event)` when the clock reaches `t` (>= now)."""
        heappush(self._queue, (t, NORMAL, next(self._eid), self._calls[callback]))

    @property
    def events_scheduled(self) -> int:
        """SimPy events scheduled so far (engine steps, timer batches, wake-ups)."""
        n = next(self._eid)
        self._eid = itertools.count(n)
        return n


def _call(fn):
    """A SimPy process that calls `fn(None)` once, at its start."""
    fn(None)
    return
    yield


class PublicClock(Clock):
    """A clock that schedules through SimPy's public API alone: each call a
    `timeout` (one at an instant's start a `process`, which SimPy starts
    first), run by `simpy.Environment.run`; `Timers` on it set one timeout
    per timer and never batch. Slower; the same records as `Clock` (two
    events due at the very same instant could order differently: a timer
    keeps the order of the time it was set, not of a number it reserved)."""
    public = True
    run = simpy.Environment.run

    def call_later(self, delay: float, fn, priority=NORMAL) -> None:
        if priority == URGENT and delay == 0:
            self.process(_call(fn))
        else:
            self.timeout(delay).callbacks.append(fn)

    def call_when(self, t: float, fn) -> None:
        d = t - self.now
        self.timeout(d if d > 0.0 else 0.0).callbacks.append(fn)

    def schedule_at(self, t: float, callback) -> None:
        self.call_when(t, callback)


class Timer:
    """A timer of `Timers`: `fn(t, arg)` at time `t`, fired at `fires_at`
    unless cancelled first (`live` False); timers due at one time fire in
    the order of `seq`. The timers' heap holds it under the key (fires_at,
    seq, timer), compared in C. `Timers.at` sets its fields (no __init__:
    setting a timer makes no Python call)."""
    __slots__ = ("fires_at", "seq", "t", "fn", "arg", "live")


class Timers:
    """Driver-side timers on the SimPy clock, cancellable, with the time of
    the next live one (a bound on the engine's next input: see the module
    docstring).

    A timer set at time c for time t fires at c + max(0, t - c) (the time a
    SimPy timeout would), calling `fn(t, arg)`, timers due at one time in
    the order they were set. Timers are kept in a heap and a lane, under
    their keys (fire time, seq, Timer): a timer set `in_order` (the caller's
    timers of one kind each come due a fixed time after they are set, as
    attempts' deadlines do) joins the lane's end if due no earlier than its
    last one, any other the heap; the lane's first timer stands for the lane
    in the heap, so the heap stays small. Timers take one SimPy event per
    batch: when one comes due, every later one due before `horizon()` fires
    with it (the module docstring), each as of its own time (`env.now` reads
    it). `horizon()` returns -INF when timers must fire one instant at a
    time. Timers also stop batching once `stop()` is true, and never batch
    past `until`. On a `PublicClock` each timer is its own SimPy timeout."""

    def __init__(self, env: Clock, horizon=lambda: -INF, stop=lambda: False):
        self.env = env
        self.heap: list[tuple] = []         # (fire time, seq, Timer)
        self.lane: deque[tuple] = deque()   # likewise, in firing order
        self.horizon = horizon
        self.stop = stop
        self.until = INF                    # no batching past this time
        self._seq = 0
        self._armed: list[float] = []       # times of this heap's SimPy events in the queue
        self._firing = False
        self._each = env.public             # one SimPy timeout per timer

    def reserve(self, n: int) -> int:
        """Reserve n sequence numbers (for timers added later that must
        order as if set now); returns the first."""
        first = self._seq
        self._seq += n
        return first

    def at(self, t: float, fn, arg=None, seq: int | None = None, in_order: bool = False) -> Timer:
        """Set a timer: `fn(t, arg)` at t (at once if t has passed)."""
        now = self.env._now
        d = t - now
        tf = now + d if d > 0.0 else now    # now + max(0, t - now)
        if seq is None:
            seq = self._seq
            self._seq += 1
        timer = Timer()
        timer.fires_at = tf
        timer.seq = seq
        timer.t = t
        timer.fn = fn
        timer.arg = arg
        timer.live = True
        key = (tf, seq, timer)
        lane = self.lane
        if in_order and (not lane or lane[-1] < key):
            if not lane:
                heappush(self.heap, key)    # the lane's first timer stands for it in the heap
            lane.append(key)
        else:
            heappush(self.heap, key)
        if self._each:
            self.env.timeout(d if d > 0.0 else 0.0).callbacks.append(partial(self._fire, timer))
        elif not self._firing and (not self._armed or tf < self._armed[0]):
            self._arm(tf)
        return timer

    def _arm(self, tf: float) -> None:
        heappush(self._armed, tf)
        self.env.schedule_at(tf, self._tick)

    def _pop(self) -> None:
        """Take the heap's first entry out; if it is the lane's first, the
        lane's next entry takes its place in the heap."""
        h, lane = self.heap, self.lane
        if lane and h[0] is lane[0]:
            lane.popleft()
            if lane:
                heapreplace(h, lane[0])
                return
        heappop(h)

    def _tick(self, _event) -> None:
        env, h = self.env, self.heap
        now = heappop(self._armed)
        limit = min(self.horizon(), self.until)
        if -INF < limit < INF:
            limit -= 1e-9 * max(1.0, abs(limit))    # leave a tie with the horizon to the clock
        pop, stop = self._pop, self.stop
        self._firing = True
        try:
            while h:
                tf, _, timer = h[0]
                live = timer.live
                if live:
                    if tf > now:
                        if tf >= limit or stop():
                            break
                        env._now = tf           # as of its own time
                    timer.live = False
                pop()
                if live:
                    fn = timer.fn               # (a slot read, then a call: `timer.fn(...)` is no faster path)
                    fn(timer.t, timer.arg)
        finally:
            env._now = now
            self._firing = False
        while h and not h[0][2].live:
            self._pop()
        if h and (not self._armed or h[0][0] < self._armed[0]):
            self._arm(h[0][0])

    @staticmethod
    def _fire(timer: Timer, _event) -> None:
        """A timer's own timeout (on a PublicClock) came."""
        if timer.live:
            timer.live = False
            timer.fn(timer.t, timer.arg)

    @staticmethod
    def cancel(timer: Timer) -> None:
        timer.live = False

    def next_time(self) -> float:
        """The time of the next live timer (INF: none)."""
        h = self.heap
        while h and not h[0][2].live:
            self._pop()
        return h[0][2].t if h else INF


_ANY = object()         # a timer that may reach every replica (see RoutedTimers)


class RoutedTimers(Timers):
    """The driver's timers, each also filed under the replica its firing may
    reach, so that a replica's next input skips the timers of the others. A
    timer whose function is in `by_call` reaches its call's replica
    (`home[call id]`), the call id being its argument (`by_call[fn]`
    False), the argument's `call_id` (True) or its token's (`"token"`: a
    layer's `Timer` whose token is a call); one whose function maps to
    None is filed under no replica (the caller bounds its firing otherwise);
    any other timer (a counter snapshot) may reach every replica."""

    def __init__(self, env, horizon, stop, n: int, home: list[int], by_call: dict):
        super().__init__(env, horizon, stop)
        self.home = home
        self.by_call = by_call
        self.due: list[list] = [[] for _ in range(n)]
        self.due_lanes: list[deque] = [deque() for _ in range(n)]    # each replica's lane (see Timers)
        self.due_any: list = []

    def at(self, t: float, fn, arg=None, seq: int | None = None, in_order: bool = False) -> Timer:
        timer = Timers.at(self, t, fn, arg, seq, in_order)
        attr = self.by_call.get(getattr(fn, "__func__", None), _ANY)
        key = (timer.fires_at, timer.seq, timer)
        if attr is _ANY:
            heappush(self.due_any, key)
        elif attr is not None:
            r = self.home[arg if attr is False else arg.call_id if attr is True else arg.token.call_id]
            lane = self.due_lanes[r]
            if in_order and (not lane or lane[-1] < key):
                lane.append(key)
            else:
                heappush(self.due[r], key)
        return timer

    def next_time_of(self, r: int) -> float:
        """The time of the next live timer that may reach replica r (INF: none)."""
        h, lane, t = self.due[r], self.due_lanes[r], INF
        while h and not h[0][2].live:
            heappop(h)
        while lane and not lane[0][2].live:
            lane.popleft()
        if lane and (not h or lane[0] < h[0]):
            t = lane[0][2].t
        elif h:
            t = h[0][2].t
        h = self.due_any
        while h and not h[0][2].live:
            heappop(h)
        if h and h[0][2].t < t:
            t = h[0][2].t
        return t


# ---- the driver's side of the horizon over a cluster of engines (the contract above)

def next_finish(engine) -> float:
    """The end of the first step in flight of `engine` that finishes a request (INF: none)."""
    for plan in engine.pending:
        if plan.finishing:
            return plan.end
    return INF


def horizon_one(engines: list) -> float:
    """The timers' horizon over one engine: the end of its step in flight (-INF while it is idle)."""
    pending = engines[0].pending
    return pending[0].end if pending else -INF


def horizon_all(engines: list) -> float:
    """The earliest end of a step in flight; -INF while an engine is idle
    (an input may start a step on it at once)."""
    h = INF
    for e in engines:
        p = e.pending
        if not p:
            return -INF
        if p[0].end < h:
            h = p[0].end
    return h


class NextInput:
    """Each engine's `next_input_time()` over a cluster (`engines`, the
    stack's `cluster` of proxies): the next timer, bounded further while a
    proxy — or a layer of `queueing_layers` above it — holds a queue that
    drains as requests finish. `reroutes_refusals`: an engine's 503 sends a
    request on to another replica (every proxy's queue counts for every
    engine). Where every call stays on its home replica (`timers` a
    `RoutedTimers`), `calls_of[r]` are the calls r is home to, in arrival
    order, and `workload` the run's calls (`sim.calls.Calls`: their
    `arrival` times, and `next_call`, the first call not yet arrived)."""

    def __init__(self, timers, engines: list, cluster, queueing_layers=(), may_queue: bool = False,
                 reroutes_refusals: bool = False, workload=None):
        self.timers, self.engines, self.cluster = timers, engines, cluster
        self.queueing_layers = list(queueing_layers)
        self.may_queue, self.reroutes_refusals = may_queue, reroutes_refusals
        self.all_groups = range(len(cluster.groups))
        self.routed = isinstance(timers, RoutedTimers)
        self.workload = workload
        if self.routed:
            self.calls_of = [[] for _ in cluster.group_of]  # call ids by home replica, in arrival order
            for c, r in enumerate(timers.home):
                self.calls_of[r].append(c)
            self.calls_at = [0] * len(cluster.group_of)     # first of them not yet arrived

    def functions(self) -> list:
        """Each engine's `next_input_time`."""
        n = len(self.cluster.group_of)
        if self.queueing_layers:
            return [partial(self.of, r) for r in range(n)]
        if not self.routed and not self.may_queue:
            return [self.timers.next_time] * n             # no proxy ever queues: the next timer
        if n == 1:
            return [self.one]
        return [partial(self.of, r) for r in range(n)]

    def one(self) -> float:
        """`of` the one engine of a cluster of one: the next timer, or —
        while the proxy holds executions in its queue — the end of the
        first step in flight that finishes a request (its completion frees
        a seat under the proxy cap, and a queued execution is dispatched
        then)."""
        t = self.timers.next_time()
        if self.cluster.proxy.queued:
            return min(t, next_finish(self.engines[0]))
        return t

    def of(self, r: int) -> float:
        """A bound on when engine r may next get input (or be read by the
        router): the next timer; and while a proxy holds a queue, the next
        moment a request may finish where that queue drains on finishes: if
        the proxy feeds r, the steps in flight that finish one on the
        engines it feeds, and for another of them also the end of its steps
        in flight (a step it has not scheduled yet may finish one just
        after); where an engine's 503 sends a request on to another replica,
        any other proxy's queue counts likewise; an idle engine just given
        input bounds it at now (the step it is about to start may finish one
        at any time). Where every call stays on its home replica, only the
        timers of r's calls count, and the arrival of the next call r is
        home to."""
        if self.routed:
            t = self.timers.next_time_of(r)
            calls, i, arrived = self.calls_of[r], self.calls_at[r], self.workload.next_call
            while i < len(calls) and calls[i] < arrived:
                i += 1
            self.calls_at[r] = i
            if i < len(calls) and self.workload.arrival[calls[i]] < t:
                t = self.workload.arrival[calls[i]]
        else:
            t = self.timers.next_time()
        engines = self.engines
        if self.queueing_layers and any(layer.queued for layer in self.queueing_layers):
            # a layer above the proxy sends a queued attempt on as a request anywhere below it finishes
            for s, e in enumerate(engines):
                t = min(t, next_finish(e))
                if s != r and e.pending:
                    t = min(t, e.pending[-1].end)
        if self.may_queue:
            cl = self.cluster
            for g in self.all_groups if self.reroutes_refusals else (cl.group_of[r],):
                if cl.proxies[g].queued:
                    for s in cl.groups[g]:
                        e = engines[s]
                        t = min(t, next_finish(e))
                        if s != r and e.pending:
                            t = min(t, e.pending[-1].end)
                        elif s != r and e.inbox:     # idle with input: a step about to start may finish one
                            t = min(t, self.timers.env.now)
        return t
