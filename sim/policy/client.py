"""The client layer: one retry engine (`sim.policy.retry.Retrier`) behind
the reference client of docs/model.md and every client preset.

The reference client (`ClientConfig`, `reference_settings`): a per-attempt
deadline, up to R retries after a uniform random wait, a Retry-After
honoured up to its cap (a longer one, or one that cannot be honoured, gives
the call up); a refused attempt counts as one of the call's attempts.

The client is a layer like the others (`sim.policy.layers`): clock-free,
timestamped events in, actions out (`ClientLayer`). A call comes from the
workload (`on_call(t, call)`); its attempt goes below (`Send`, a
`CallAttempt` whose `deadline` the driver holds it to, as an HTTP client's
timeout closes its connection: `on_deadline(t, attempt)` then); the layer
below answers it (`on_complete`, `on_refused`); a retry is a `Timer` (its
token the call: `on_timer(t, call)` sends the next attempt); the call's end
goes up to the workload (`Delivered(call)`, `GivenUp(call)`, its outcome in
`call.outcome`). The simulator (`sim.model.Run`, through
`sim.policy.stack.Interpreter`) and the live harness
(`validate.live_run.LiveRun`) drive the same layer.

Behind the actions, a `ClientLayer` decides: `send(call, t)` numbers an
attempt and sets the time the client gives it up (its per-attempt timeout
or the call's deadline) and `timed_out`, `refused` and `completed` return
the retry's `RetryAt`, or None when the call is over. `RetryingClient`
decides for one client (the reference client, a preset), `NestedClients`
for client layers one inside another, `sim.classes.ClassClients` by traffic
class. A give-up the reference client has no outcome for (not retryable,
the call's deadline, throttled) is recorded as `failed_attempts`; a
Retry-After above the cap given up on as `failed_retry_after`."""
from __future__ import annotations

from dataclasses import dataclass

from .layers import Send, Timer
from .proxy import Attempt
from .retry import CONNECT_ERROR, STATUS, TIMEOUT, Failure, Retrier, RetryAt, RetryPolicy


@dataclass(frozen=True)
class ClientConfig:
    deadline_s: float = 120.0
    max_retries: int = 3                # R; 0 is "retries off"
    backoff_min_s: float = 0.25
    backoff_max_s: float = 3.0
    max_retry_after_s: float = 120.0    # a 429 asking for a longer wait gives the call up

    def __post_init__(self):
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be positive")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if not 0 <= self.backoff_min_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_min_s <= backoff_max_s")


def reference_settings(cfg: ClientConfig) -> dict:
    """The reference client as a client layer's settings (`RetryPolicy`
    keys): every failure retried (its own deadline, a refusal of any status)."""
    return {"kind": "client", "name": "client", "timeout_s": cfg.deadline_s, "max_retries": cfg.max_retries,
            "retry_on": (TIMEOUT, CONNECT_ERROR, "4xx", "5xx"), "backoff": "uniform",
            "backoff_base_s": cfg.backoff_min_s, "backoff_cap_s": cfg.backoff_max_s, "retry_after": True,
            "retry_after_formats": ("seconds",), "retry_after_cap_s": cfg.max_retry_after_s,
            "retry_after_above_cap": "give_up"}


def reference_policy(cfg: ClientConfig) -> RetryPolicy:
    return RetryPolicy(**{k: v for k, v in reference_settings(cfg).items() if k not in ("kind", "name")})


Retry = RetryAt     # a retry's time `at` (after `wait`, from its `source`: backoff or Retry-After)


class CallState:
    """A call at its client: also the retry engine's state of it (the fields
    of `sim.policy.retry.CallRetries`: `started_at`, `attempts`, `retries`,
    `done`). `klass` is the call's traffic class (its name; None: none),
    which its attempts carry."""
    __slots__ = ("call_id", "planned_at", "attempts", "open_attempt", "deadline", "done", "outcome", "started_at",
                 "retries", "klass")

    def __init__(self, call_id: int, planned_at: float, klass=None):
        self.call_id = call_id
        self.planned_at = planned_at
        self.attempts = 0           # attempts sent so far
        self.open_attempt = -1      # number of the attempt in progress, -1 if none
        self.deadline = float("inf")
        self.done = False
        self.outcome = ""
        self.started_at = planned_at    # when its first attempt went out
        self.retries = 0            # retries the client decided on so far
        self.klass = klass


class CallAttempt(Attempt):
    """An attempt of the client's: its call (`call`, the `CallState`), and
    the driver's bookkeeping, its row in the attempt log (`row`) and its
    deadline timer (`timer`; None once it fired or was cancelled, so that
    the two make no reference cycle that would outlive the attempt)."""
    __slots__ = ("call", "row", "timer")


# the client's answers to the workload above it (the call's outcome is `call.outcome`)
@dataclass(slots=True)
class Delivered:
    """The call got its complete response."""
    call: CallState


@dataclass(slots=True)
class GivenUp:
    """The client gave the call up."""
    call: CallState


class ClientLayer:
    """The client's actions (module docstring) from a subclass's decisions:
    `send(call, t)` (the attempt's number; it sets `call.deadline`),
    `timed_out(call, t)`, `refused(call, t, status, retry_after)`,
    `completed(call, t)` (a `RetryAt`, or None: the call is over)."""
    kind = "client"

    def on_call(self, t: float, call: CallState) -> list:
        """A call from the workload, or its retry come due (`on_timer`: the
        timer's token is the call): its next attempt goes below."""
        n = self.send(call, t)
        att = CallAttempt(call.call_id, n, call.deadline, call.klass)
        att.call = call
        return [Send(att)]

    on_timer = on_call

    def on_deadline(self, t: float, att: CallAttempt) -> list:
        """The attempt reached its deadline; the driver has closed it."""
        return self._then(att.call, self.timed_out(att.call, t))

    def on_refused(self, t: float, att: CallAttempt, status: int, retry_after: float | None = None,
                   reason: str = "") -> list:
        """The layer below refused the attempt with `status` (and a Retry-After in seconds)."""
        return self._then(att.call, self.refused(att.call, t, status, retry_after))

    def _then(self, call: CallState, retry: RetryAt | None) -> list:
        """The retry's timer, or the call given up."""
        return [Timer(retry.at, self, call)] if retry is not None else [GivenUp(call)]

    def on_complete(self, t: float, att: CallAttempt) -> list:
        """The attempt received the complete response."""
        self.completed(att.call, t)
        return [Delivered(att.call)]


class RetryingClient(ClientLayer):
    """One client's decisions for every call (module docstring): `policy`
    is a `RetryPolicy`, or a `ClientConfig` for the reference client.
    `uniform(a, b)` draws (the driver's seeded generator); the policy's
    backoff and jitter take `uniform(0, 1)`."""

    def __init__(self, policy: RetryPolicy | ClientConfig, uniform):
        if isinstance(policy, ClientConfig):
            policy = reference_policy(policy)
        self.policy = policy
        # uniform(0, 1) is the draw itself: a generator that has `random` gives it with one call less
        self.retrier = Retrier(policy, getattr(uniform, "random", None) or (lambda: uniform(0.0, 1.0)))
        self._failure = Failure(TIMEOUT, 0.0)   # the failure handed to the retrier, refilled at each one
        self._timeout_only = policy.deadline_s is None
        self._timeout = self.retrier.attempt_timeout

    def send(self, call: CallState, t: float) -> int:
        """An attempt goes out at t; returns its number (0 = first)."""
        assert not call.done and call.open_attempt < 0
        n = call.attempts
        if n == 0:
            call.started_at = t
        call.open_attempt = n
        if self._timeout_only:          # Retrier.send inlined (no call deadline): a call less on every attempt
            call.attempts = n + 1
            call.deadline = t + self._timeout
        else:
            call.deadline = self.retrier.send(call, t)     # counts the attempt
        return n

    # the layer's events with the decisions inlined (`ClientLayer`'s call `send`, `timed_out`, `refused`):
    # a Python call less on each, about 10 M instructions (0.6%) a reference run (callgrind)
    def on_call(self, t: float, call: CallState) -> list:
        n = call.attempts
        if self._timeout_only:
            assert not call.done and call.open_attempt < 0
            if n == 0:
                call.started_at = t
            call.open_attempt = n
            call.attempts = n + 1
            call.deadline = t + self._timeout
        else:
            self.send(call, t)
        att = CallAttempt(call.call_id, n, call.deadline, call.klass)
        att.call = call
        return [Send(att)]

    on_timer = on_call

    def on_deadline(self, t: float, att: CallAttempt) -> list:
        call, f = att.call, self._failure
        f.kind, f.at, f.status, f.retry_after_s = TIMEOUT, t, None, None
        call.open_attempt = -1
        d = self.retrier.on_failure(call, f)
        if type(d) is RetryAt:
            return [Timer(d.at, self, call)]
        _gave_up(call, d)
        return [GivenUp(call)]

    def on_refused(self, t: float, att: CallAttempt, status: int, retry_after: float | None = None,
                   reason: str = "") -> list:
        call, f = att.call, self._failure
        f.kind, f.at, f.status, f.retry_after_s = STATUS, t, status, retry_after
        call.open_attempt = -1
        d = self.retrier.on_failure(call, f)
        if type(d) is RetryAt:
            return [Timer(d.at, self, call)]
        _gave_up(call, d)
        return [GivenUp(call)]

    def timed_out(self, call: CallState, t: float) -> RetryAt | None:
        """The open attempt reached its timeout (or the call its deadline)."""
        f = self._failure
        f.kind, f.at, f.status, f.retry_after_s = TIMEOUT, t, None, None
        call.open_attempt = -1
        decision = self.retrier.on_failure(call, f)
        # _gave_up's test inlined: a Python call less on every retry (a few thousand instructions, callgrind)
        if type(decision) is RetryAt:
            return decision
        _gave_up(call, decision)
        return None

    def refused(self, call: CallState, t: float, status: int, retry_after: float | None = None) -> RetryAt | None:
        """The open attempt was refused with `status` (and a Retry-After in seconds)."""
        f = self._failure
        f.kind, f.at, f.status, f.retry_after_s = STATUS, t, status, retry_after
        call.open_attempt = -1
        decision = self.retrier.on_failure(call, f)
        if type(decision) is RetryAt:
            return decision
        _gave_up(call, decision)
        return None

    def completed(self, call: CallState, t: float) -> None:
        """The open attempt received the complete response."""
        self.retrier.on_success(call, t)
        call.open_attempt = -1
        call.done = True
        call.outcome = "delivered"


def _gave_up(call: CallState, decision) -> None:
    """The retrier gave the call up: its outcome, in the reference client's
    terms (a give-up it has no outcome for counts as `failed_attempts`)."""
    call.done = True
    call.outcome = "failed_retry_after" if decision.reason == "retry_after" else "failed_attempts"


class NestedClients(ClientLayer):
    """Client layers one inside another, the application's first
    (`layers`, `RetryingClient`s): each attempt of an outer layer is one call
    through the layer inside it, as an application's retry loop wraps an
    SDK's (LangChain's around the OpenAI SDK's). The attempts on the wire are
    the innermost layer's, each given up at the earliest deadline of the
    layers it runs under. When an attempt fails, the layer whose deadline
    struck (the outermost one past its deadline), or else the innermost,
    decides; a layer that gives up fails the attempt of the layer outside it
    with the same failure (an SDK re-raises its last error); a retry due
    after an outer layer's deadline is that layer's timeout instead. The
    call's outcome is the outermost layer's."""

    def __init__(self, layers: list):
        if len(layers) < 2:
            raise ValueError("NestedClients: give two client layers or more")
        self.layers = layers
        self.states: dict = {}      # call id -> each layer's CallState of its call in progress (None: none yet)

    def send(self, call: CallState, t: float) -> int:
        assert not call.done and call.open_attempt < 0
        states = self.states.get(call.call_id)
        if states is None:
            states = self.states[call.call_id] = [None] * len(self.layers)
        deadline = float("inf")
        for i, layer in enumerate(self.layers):
            s = states[i]
            if s is None:
                s = states[i] = CallState(call.call_id, t)
            if s.open_attempt < 0:
                layer.send(s, t)
            deadline = min(deadline, s.deadline)
        n = call.attempts
        call.attempts += 1
        call.open_attempt = n
        call.deadline = deadline
        return n

    def timed_out(self, call: CallState, t: float) -> RetryAt | None:
        states = self.states[call.call_id]
        i = next((k for k, s in enumerate(states) if s.deadline <= t), len(states) - 1)
        return self._failed(call, i, _timed_out, t)

    def refused(self, call: CallState, t: float, status: int, retry_after: float | None = None) -> RetryAt | None:
        return self._failed(call, len(self.layers) - 1,
                            lambda layer, s, at: layer.refused(s, at, status, retry_after), t)

    def completed(self, call: CallState, t: float) -> None:
        for layer, s in zip(self.layers, self.states.pop(call.call_id)):
            layer.completed(s, t)
        call.open_attempt = -1
        call.done = True
        call.outcome = "delivered"

    def _failed(self, call: CallState, i: int, fail, t: float) -> RetryAt | None:
        """Layer i's attempt failed at t (`fail(layer, state, t)` tells it);
        the layers inside it are given up with it."""
        call.open_attempt = -1
        states = self.states[call.call_id]
        while True:
            for k in range(i + 1, len(states)):
                states[k] = None
            decision = fail(self.layers[i], states[i], t)
            if decision is not None:
                late = next((k for k in range(i) if states[k].deadline <= decision.at), None)
                if late is None:
                    return decision
                i, t = late, states[late].deadline
                fail = _timed_out
            elif i == 0:
                del self.states[call.call_id]
                call.done = True
                call.outcome = states[0].outcome
                return None
            else:
                i -= 1


def _timed_out(layer, state: CallState, t: float):
    return layer.timed_out(state, t)
