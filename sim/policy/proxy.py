"""The proxy of docs/model.md as a clock-free state machine.

Every attempt goes through `on_attempt`; the proxy answers with actions for
its driver: subscribe the attempt to an execution, dispatch an execution to
the engine, refuse an attempt, cancel an execution at the engine, drop a
queued execution, wake the proxy at a later time. The driver reports back
what happens (`on_engine_refused`, `on_attempt_left`, `on_finished`,
`on_wake`) and carries out the actions returned. Nothing here reads a clock:
every event carries its time, and what the proxy knows of the engine comes
from an `EngineView` the driver supplies on request.

Order of checks for one attempt: the call's key; then the retry
budget and the lookup of a live execution in the configured order
(`budget-first` or `lookup-first`); unless refused or attached, under the
`deadline` queue the deadline check; then a new execution, held in the
proxy's own queue while the proxy cap is reached; dispatch to the engine,
which may refuse it (engine cap, 503).

Estimate of the wait to first token (`Proxy.estimate_wait`), used for the
429's Retry-After and the deadline check:

    wait = (uncomputed prompt tokens of the executions queued in the proxy
            + uncomputed prompt tokens of the executions waiting or running
              in the engine
            + the attempt's own prompt tokens) / prompt throughput

where the prompt throughput is the engine's computed prompt tokens per
second over the recent past (`PromptRate`, a sliding 60 s window), or the
profile's figure when there is no history yet. The engine-side figures come
from the driver's `EngineView`. The numerator counts whole prompts, the
denominator computed tokens (prefix-cache hits excluded), so with a shared
cached prefix the estimate errs long by about the cached share; an
execution preempted and recomputed is counted from its current progress.

Deadline check (queue `deadline`): an attempt that would need a new
execution is refused with 503 (reason `deadline`) when it arrives, before an
execution is created, if the estimated wait exceeds the time it has left
(its deadline minus the arrival time). With no throughput known at all
(neither history nor the profile's figure) nothing is refused. The queue
itself is dequeued first in, first out.

Shedding by class (docs/classes.md): each attempt carries its call's
traffic class (`Attempt.klass`, the name; None without classes). After the
budget and the lookup, an attempt of a class named in `shed_classes` that
would need a new execution is refused (reason `class_shed`) while the proxy is
saturated by its rule `shed_when` over `shed_above`: `proxy_queue`, the
executions held in the proxy's own queue; `engine_waiting`, the requests
waiting in the engine (`EngineView.waiting`); `kv_usage`, the engine's KV
cache usage as a share (`EngineView.kv_usage`). The refusal is
`shed_status` (429 or 503) with Retry-After per `shed_retry_after`: `none`,
or `estimate` (the wait estimate above, on a 429). Per class, a retry
budget (`class_budget`: (class, share) pairs, the budget's rule over the
class's own first attempts and retries, refused with 429 and the estimate as
the retry budget is, reason `class_budget`) and a cap (`class_cap`: (class,
N) pairs, at most N live executions of the class, queued in the proxy or
outstanding in the engine; beyond it an attempt that would need a new one
is refused as a shed one, reason `class_cap`). Order: the class's budget
(retries that found no live execution), the saturation rule, the class
cap, then the deadline check.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

INF = float("inf")
CANCELLATIONS = ("off", "now", "deferred")
ORDERS = ("budget-first", "lookup-first")
QUEUES = ("fifo", "deadline", "lifo")
SHED_WHEN = ("proxy_queue", "engine_waiting", "kv_usage")
SHED_STATUSES = (429, 503)
SHED_RETRY_AFTER = ("none", "estimate")
_LIVE = ("created", "queued", "dispatched")    # the states of a live execution


@dataclass(frozen=True)
class ProxyConfig:
    cancellation: str = "off"     # off: orphaned executions run on; now: close the engine connection;
    #                               deferred: close it defer_s after the last subscriber left, unless one attached
    defer_s: float = 10.0
    coalesce: bool = False        # a retry attaches to its call's live execution
    budget: float | None = None   # retry budget: retries admitted <= budget x first attempts over the window
    budget_window_s: float = 60.0
    order: str = "budget-first"   # budget-first | lookup-first
    proxy_cap: int | None = None  # N: most executions outstanding in the engine; more wait in the proxy
    queue: str = "fifo"           # fifo | deadline (fifo, and the deadline check at arrival) | lifo
    lifo_after: int = 50          # lifo takes the newest once more than this many are queued
    # shedding by class (module docstring): classes refused while saturated, the rule and its threshold, the refusal
    shed_classes: tuple = ()      # names of the sheddable classes
    shed_when: str = "engine_waiting"     # proxy_queue | engine_waiting | kv_usage
    shed_above: float = 0.0       # saturated while the rule's measure is above this
    shed_status: int = 429        # 429 | 503
    shed_retry_after: str = "none"        # none | estimate (on a 429)
    class_budget: tuple = ()      # ((class, share), ...): a retry budget per class
    class_cap: tuple = ()         # ((class, N), ...): most live executions of the class

    @property
    def sheds(self) -> bool:
        """Whether any shedding or per-class control is set."""
        return bool(self.shed_classes or self.class_budget or self.class_cap)

    def __post_init__(self):
        if self.cancellation not in CANCELLATIONS:
            raise ValueError(f"cancellation must be one of {', '.join(CANCELLATIONS)}; got {self.cancellation!r}")
        if not self.defer_s >= 0:
            raise ValueError(f"defer_s must be >= 0; got {self.defer_s!r}")
        if self.budget is not None and not self.budget >= 0:
            raise ValueError(f"budget must be >= 0; got {self.budget!r}")
        if not self.budget_window_s > 0:
            raise ValueError("budget_window_s must be positive")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.queue not in QUEUES:
            raise ValueError(f"queue must be one of {', '.join(QUEUES)}; got {self.queue!r}")
        if self.proxy_cap is not None and self.proxy_cap < 1:
            raise ValueError(f"proxy_cap must be >= 1; got {self.proxy_cap!r}")
        if self.lifo_after < 0:
            raise ValueError("lifo_after must be >= 0")
        if self.shed_when not in SHED_WHEN:
            raise ValueError(f"shed_when must be one of {', '.join(SHED_WHEN)}; got {self.shed_when!r}")
        if not self.shed_above >= 0:
            raise ValueError(f"shed_above must be >= 0; got {self.shed_above!r}")
        if self.shed_when == "kv_usage" and self.shed_classes and not self.shed_above < 1:
            raise ValueError(f"shed_above for kv_usage is a share below 1; got {self.shed_above!r}")
        if self.shed_status not in SHED_STATUSES:
            raise ValueError(f"shed_status must be 429 or 503; got {self.shed_status!r}")
        if self.shed_retry_after not in SHED_RETRY_AFTER:
            raise ValueError(f"shed_retry_after must be one of {', '.join(SHED_RETRY_AFTER)}; "
                             f"got {self.shed_retry_after!r}")
        for name, pairs, ok, need in (("class_budget", self.class_budget, lambda v: v >= 0, ">= 0"),
                                      ("class_cap", self.class_cap, lambda v: v >= 1 and v == int(v),
                                       "a whole number >= 1")):
            names = [c for c, _ in pairs]
            if len(set(names)) != len(names):
                raise ValueError(f"{name} names a class twice: {names}")
            for c, v in pairs:
                if not ok(v):
                    raise ValueError(f"{name} of class {c!r} must be {need}; got {v!r}")


@dataclass(frozen=True)
class EngineView:
    """What the proxy knows of the engine at one moment (from the driver)."""
    uncomputed_prompt_tokens: float = 0.0       # of executions waiting or running in the engine
    prompt_throughput: float | None = None      # computed prompt tokens/s over the recent past; None: no history
    waiting: float = 0.0                        # requests waiting in the engine
    kv_usage: float = 0.0                       # the engine's KV cache usage, a share


class PromptRate:
    """Computed prompt tokens per second over a sliding window, fed with
    (time, tokens) events in time order and asked at times no earlier than
    the last event; None while there is no history. Holds only the events
    of the last window."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.events: deque = deque()
        self.total = 0.0

    def _trim(self, t: float) -> None:
        ev, lo = self.events, t - self.window_s
        while ev and ev[0][0] <= lo:
            self.total -= ev.popleft()[1]

    def add(self, t: float, tokens: float) -> None:
        self._trim(t)
        self.events.append((t, tokens))
        self.total += tokens

    def rate(self, t: float) -> float | None:
        self._trim(t)
        if not self.events or self.total <= 0:
            return None
        return self.total / self.window_s


class RetryBudget:
    """Sliding-window retry budget: a retry at t is admitted if the retries
    admitted in (t - window, t], this one included, stay within
    `ratio` x the first attempts in the same window. No minimum: with fewer
    than 1/ratio first attempts in the window no retry is admitted."""

    def __init__(self, ratio: float, window_s: float = 60.0):
        self.ratio = ratio
        self.window_s = window_s
        self.firsts: deque = deque()
        self.retries: deque = deque()

    def _trim(self, t: float) -> None:
        lo = t - self.window_s
        for q in (self.firsts, self.retries):
            while q and q[0] <= lo:
                q.popleft()

    def first(self, t: float) -> None:
        self.firsts.append(t)

    def admit(self, t: float) -> bool:
        self._trim(t)
        if len(self.retries) + 1 <= self.ratio * len(self.firsts) + 1e-9:
            self.retries.append(t)
            return True
        return False


class Execution:
    __slots__ = ("id", "call_id", "key", "created_at", "prompt_len", "state", "subscribers", "orphaned",
                 "wake_at", "klass")

    def __init__(self, id: int, call_id: int, key, created_at: float, prompt_len: int = 0, klass=None):
        self.id = id
        self.klass = klass            # the call's traffic class (its name; None: none)
        self.call_id = call_id
        self.key = key
        self.created_at = created_at
        self.prompt_len = prompt_len
        # created | queued | dispatched | completed | cancelled | refused | dropped
        self.state = "created"
        self.subscribers: list[Attempt] = []
        self.orphaned = False         # every subscriber left and it runs on
        self.wake_at = INF            # deferred cancellation due at this time

    @property
    def live(self) -> bool:
        return self.state in _LIVE

    def __repr__(self) -> str:
        return f"Execution({self.id}, call {self.call_id}, {self.state})"


class Attempt:
    __slots__ = ("call_id", "number", "execution", "attached", "open", "deadline", "klass")

    def __init__(self, call_id: int, number: int, deadline: float = INF, klass=None):
        self.call_id = call_id
        self.klass = klass            # the call's traffic class (its name; None: none)
        self.number = number
        self.execution: Execution | None = None
        self.attached = False
        self.open = True
        self.deadline = deadline      # the client gives the attempt up at this time

    def __repr__(self) -> str:
        return f"Attempt(call {self.call_id}, #{self.number})"


# actions
@dataclass(slots=True)
class Subscribe:
    attempt: Attempt
    execution: Execution


@dataclass(slots=True)
class Dispatch:
    execution: Execution


@dataclass(slots=True)
class Refuse:
    attempt: Attempt
    status: int                   # 429 or 503
    retry_after: float | None = None
    reason: str = ""              # budget | engine | deadline | class_shed | class_budget | class_cap


@dataclass(slots=True)
class Cancel:
    execution: Execution


@dataclass(slots=True)
class Complete:
    attempt: Attempt


@dataclass(slots=True)
class Drop:
    """A queued execution leaves the proxy's queue without reaching the engine."""
    execution: Execution


@dataclass(slots=True)
class Wake:
    """Call `on_wake(at, execution)` at time `at`."""
    at: float
    execution: Execution


def call_key(call_id: int, params: tuple = ()) -> tuple:
    """The key a call's attempts share: the call id plus the full generation
    parameters (a retry resends both unchanged)."""
    return (call_id,) + tuple(params)


class Proxy:
    """`engine_view(t)` returns the driver's `EngineView` at t (None: the
    proxy assumes an empty engine); `prompt_throughput` (tokens/s) is the
    profile's figure, used while the view has no history."""

    def __init__(self, config: ProxyConfig, engine_view: Callable[[float], EngineView] | None = None,
                 prompt_throughput: float | None = None):
        self.config = config
        self.engine_view = engine_view
        self.prompt_throughput = prompt_throughput
        self.executions: dict[int, Execution] = {}
        self.live: dict[tuple, Execution] = {}      # key -> live execution (coalescing)
        self.budget = RetryBudget(config.budget, config.budget_window_s) if config.budget is not None else None
        self.queue: deque[Execution] = deque()      # may hold dropped entries, skipped when met
        self.queued = 0                             # live executions in the queue
        self.queued_tokens = 0                      # their prompt tokens
        self.outstanding = 0                        # dispatched executions not yet finished
        self._next_id = 0
        # shedding by class: the sheddable classes, each class's retry budget and its live executions under a cap
        self.shed_classes = frozenset(config.shed_classes)
        self.class_budgets = {c: RetryBudget(r, config.budget_window_s) for c, r in config.class_budget}
        self.class_caps = dict(config.class_cap)
        self.class_live: dict = {c: 0 for c in self.class_caps}
        # whether an attempt meets any check before it gets a new execution (`_admit`)
        self._checks = config.budget is not None or config.coalesce or config.queue == "deadline" or config.sheds

    # ----------------------------------------------------------- estimator
    def estimate_wait(self, t: float, prompt_len: float) -> float:
        """Seconds until an attempt of `prompt_len` prompt tokens arriving at
        t would get its first token (see the module docstring); INF when no
        prompt throughput is known."""
        view = self.engine_view(t) if self.engine_view is not None else None
        engine_tokens = view.uncomputed_prompt_tokens if view is not None else 0.0
        rate = view.prompt_throughput if view is not None else None
        if not rate or rate <= 0:
            rate = self.prompt_throughput
        if not rate or rate <= 0:
            return INF
        return (self.queued_tokens + engine_tokens + prompt_len) / rate

    def misses_deadline(self, t: float, attempt: Attempt, prompt_len: float) -> bool:
        """The deadline check: the estimated wait exceeds the time the
        attempt has left (False when no throughput is known)."""
        wait = self.estimate_wait(t, prompt_len)
        return wait != INF and wait > attempt.deadline - t

    # ------------------------------------------------------------ attempts
    def on_attempt(self, t: float, attempt: Attempt, params: tuple = (), prompt_len: int = 0) -> list:
        key = (attempt.call_id, *params)            # call_key(attempt.call_id, params)
        if self._checks:
            out = self._admit(t, attempt, key, prompt_len)
            if out is not None:
                return out
        cfg = self.config
        ex = Execution(self._next_id, attempt.call_id, key, t, prompt_len, attempt.klass)
        self._next_id += 1
        if self.class_live and ex.klass in self.class_live:
            self.class_live[ex.klass] += 1
        self.executions[ex.id] = ex
        if cfg.coalesce:
            self.live[key] = ex
        ex.subscribers.append(attempt)
        attempt.execution = ex
        if cfg.proxy_cap is None or self.outstanding < cfg.proxy_cap:
            ex.state = "dispatched"             # as _dispatch()
            self.outstanding += 1
            return [Subscribe(attempt, ex), Dispatch(ex)]
        ex.state = "queued"
        self.queue.append(ex)
        self.queued += 1
        self.queued_tokens += ex.prompt_len
        return [Subscribe(attempt, ex)]

    def _admit(self, t: float, attempt: Attempt, key: tuple, prompt_len: int) -> list | None:
        """The checks before an attempt gets a new execution, in the
        configured order: the answer if the attempt is refused or attached
        to its call's live execution, else None."""
        cfg = self.config
        retry = attempt.number > 0
        if not retry and self.budget is not None:
            self.budget.first(t)
        found = self.live.get(key) if cfg.coalesce else None
        if found is not None and not found.live:      # pragma: no cover - unlinked when it ends
            found = None
        if retry and self.budget is not None and (cfg.order == "budget-first" or found is None):
            if not self.budget.admit(t):
                attempt.open = False
                return [Refuse(attempt, 429, self.estimate_wait(t, prompt_len), "budget")]
        if found is not None:
            found.subscribers.append(attempt)
            found.orphaned = False
            found.wake_at = INF
            attempt.execution = found
            attempt.attached = True
            return [Subscribe(attempt, found)]
        if cfg.sheds:
            out = self._shed(t, attempt, retry, prompt_len)
            if out is not None:
                return out
        if cfg.queue == "deadline" and self.misses_deadline(t, attempt, prompt_len):
            attempt.open = False
            return [Refuse(attempt, 503, None, "deadline")]
        return None

    def saturation(self, t: float) -> float:
        """The measure of the shedding rule (`shed_when`) at t."""
        rule = self.config.shed_when
        if rule == "proxy_queue":
            return float(self.queued)
        view = self.engine_view(t) if self.engine_view is not None else None
        if view is None:
            return 0.0
        return float(view.waiting if rule == "engine_waiting" else view.kv_usage)

    def saturated(self, t: float) -> bool:
        """Whether the shedding rule holds at t: its measure above `shed_above`."""
        return self.saturation(t) > self.config.shed_above

    def _shed(self, t: float, attempt: Attempt, retry: bool, prompt_len: int) -> list | None:
        """The per-class checks on an attempt that would need a new
        execution (module docstring): the refusal, or None."""
        k = attempt.klass
        if k is None:
            return None
        budget = self.class_budgets.get(k)
        if budget is not None:
            if not retry:
                budget.first(t)
            elif not budget.admit(t):
                attempt.open = False
                return [Refuse(attempt, 429, self.estimate_wait(t, prompt_len), "class_budget")]
        if k in self.shed_classes and self.saturated(t):
            return self._shed_refusal(t, attempt, prompt_len, "class_shed")
        cap = self.class_caps.get(k)
        if cap is not None and self.class_live[k] >= cap:
            return self._shed_refusal(t, attempt, prompt_len, "class_cap")
        return None

    def _shed_refusal(self, t: float, attempt: Attempt, prompt_len: int, reason: str) -> list:
        cfg = self.config
        ra = self.estimate_wait(t, prompt_len) if cfg.shed_retry_after == "estimate" and cfg.shed_status == 429 \
            else None
        attempt.open = False
        return [Refuse(attempt, cfg.shed_status, ra, reason)]

    def _dispatch(self, ex: Execution, out: list) -> None:
        ex.state = "dispatched"
        self.outstanding += 1
        out.append(Dispatch(ex))

    def _end(self, ex: Execution, state: str) -> None:
        """The execution stops being live."""
        if ex.state == "dispatched":
            self.outstanding -= 1
        elif ex.state == "queued":
            self.queued -= 1
            self.queued_tokens -= ex.prompt_len
        if self.class_live and ex.klass in self.class_live and ex.state in _LIVE:
            self.class_live[ex.klass] -= 1
        ex.state = state
        self.executions.pop(ex.id, None)
        live = self.live
        if live and live.get(ex.key) is ex:
            del live[ex.key]

    def _pop(self) -> Execution | None:
        q = self.queue
        lifo = self.config.queue == "lifo" and self.queued > self.config.lifo_after
        while q:
            ex = q.pop() if lifo else q.popleft()
            if ex.state == "queued":
                return ex
        return None

    def _pump(self, t: float, out: list) -> list:
        """Dispatch queued executions while the proxy cap allows."""
        cap = self.config.proxy_cap
        if cap is None:
            return out
        while self.outstanding < cap and self.queued:
            ex = self._pop()
            self.queued -= 1
            self.queued_tokens -= ex.prompt_len
            self._dispatch(ex, out)
        return out

    def on_dispatched(self, t: float, ex: Execution) -> None:
        """The engine took the execution (kept for drivers that report it)."""

    def on_engine_refused(self, t: float, ex: Execution) -> list:
        """The engine answered 503 (engine cap): every subscriber is refused."""
        return self.on_upstream_refused(t, ex, 503, None, "engine")

    def on_upstream_refused(self, t: float, ex: Execution, status: int, retry_after: float | None,
                            reason: str) -> list:
        """What stands below answered the execution with an error (`status`,
        `reason`: an engine's 503, or a gateway's own answer below the proxy,
        its 502 or 504): every subscriber is refused with it."""
        subs, ex.subscribers = ex.subscribers, []
        self._end(ex, "refused")
        out = []
        for a in subs:
            a.open = False
            out.append(Refuse(a, status, retry_after, reason))
        return self._pump(t, out)

    def on_attempt_left(self, t: float, attempt: Attempt) -> list:
        """The client gave up the attempt and closed its connection."""
        attempt.open = False
        ex = attempt.execution
        if ex is None:
            return []
        state, subs = ex.state, ex.subscribers
        if state not in _LIVE:
            return []
        subs.remove(attempt)
        if subs:
            return []
        if state == "queued":
            self._end(ex, "dropped")
            return [Drop(ex)]
        c = self.config.cancellation
        if c == "now":
            self._end(ex, "cancelled")
            return [Cancel(ex)] if self.config.proxy_cap is None else self._pump(t, [Cancel(ex)])
        ex.orphaned = True
        if c == "deferred":
            ex.wake_at = t + self.config.defer_s
            return [Wake(ex.wake_at, ex)]
        return []

    def on_wake(self, t: float, ex: Execution) -> list:
        """A `Wake` came due: cancel the execution if nobody attached since."""
        if ex.state != "dispatched" or ex.subscribers or t < ex.wake_at:
            return []
        self._end(ex, "cancelled")
        return self._pump(t, [Cancel(ex)])

    def on_finished(self, t: float, ex: Execution) -> list:
        """The engine streamed the execution's last token."""
        subs, ex.subscribers = ex.subscribers, []
        self._end(ex, "completed")
        out = []
        for a in subs:
            a.open = False
            out.append(Complete(a))
        return self._pump(t, out)
