"""The client layer: one retry engine (`sim.policy.retry.Retrier`) behind
the reference client of docs/model.md and every client preset.

The reference client (`ClientConfig`, `reference_settings`): a per-attempt
deadline, up to R retries after a uniform random wait, a Retry-After
honoured up to its cap (a longer one, or one that cannot be honoured, gives
the call up); a refused attempt counts as one of the call's attempts.

`RetryingClient` makes a layer's decisions for every call: `send` numbers the
attempt and sets the time the client gives it up (its per-attempt timeout or
the call's deadline), `on_deadline`, `on_refused` and `on_complete` return
`Retry`, `GiveUp` or `Delivered`. A give-up the reference client has no
outcome for (not retryable, the call's deadline, throttled) is recorded as
`failed_attempts`; a Retry-After above the cap given up on as
`failed_retry_after`. Clock-free like the rest of `sim.policy`."""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class Retry:
    at: float           # send the next attempt at this time


@dataclass(slots=True)
class GiveUp:
    reason: str         # "attempts" (no retries left) or "retry_after" (429 wait too long)


@dataclass(slots=True)
class Delivered:
    at: float


class CallState:
    __slots__ = ("call_id", "planned_at", "attempts", "open_attempt", "deadline", "done", "outcome", "retries")

    def __init__(self, call_id: int, planned_at: float):
        self.call_id = call_id
        self.planned_at = planned_at
        self.attempts = 0           # attempts sent so far
        self.open_attempt = -1      # number of the attempt in progress, -1 if none
        self.deadline = float("inf")
        self.done = False
        self.outcome = ""
        self.retries = None         # the Retrier's state of the call (`CallRetries`), from its first attempt


class RetryingClient:
    """Decisions for every call of one client layer (module docstring):
    `policy` is a `RetryPolicy`, or a `ClientConfig` for the reference
    client. `uniform(a, b)` draws (the driver's seeded generator); the
    policy's backoff and jitter take `uniform(0, 1)`."""

    def __init__(self, policy: RetryPolicy | ClientConfig, uniform):
        if isinstance(policy, ClientConfig):
            policy = reference_policy(policy)
        self.policy = policy
        self.retrier = Retrier(policy, lambda: uniform(0.0, 1.0))

    def send(self, call: CallState, t: float) -> int:
        """An attempt goes out at t; returns its number (0 = first)."""
        assert not call.done and call.open_attempt < 0
        if call.retries is None:
            call.retries = self.retrier.start(t)
        n = call.attempts
        call.attempts += 1
        call.open_attempt = n
        call.deadline = self.retrier.send(call.retries, t)
        return n

    def _failed(self, call: CallState, failure: Failure):
        call.open_attempt = -1
        decision = self.retrier.on_failure(call.retries, failure)
        if type(decision) is RetryAt:
            return Retry(decision.at)
        reason = "retry_after" if decision.reason == "retry_after" else "attempts"
        call.done = True
        call.outcome = "failed_" + reason
        return GiveUp(reason)

    def on_deadline(self, call: CallState, t: float):
        """The open attempt reached its timeout (or the call its deadline)."""
        return self._failed(call, Failure(TIMEOUT, t))

    def on_refused(self, call: CallState, t: float, status: int, retry_after: float | None = None):
        """The open attempt was refused with `status` (and a Retry-After in seconds)."""
        headers = None if retry_after is None else {"retry-after": repr(float(retry_after))}
        return self._failed(call, Failure(STATUS, t, status, headers))

    def on_complete(self, call: CallState, t: float):
        """The open attempt received the complete response."""
        self.retrier.on_success(call.retries, t)
        call.open_attempt = -1
        call.done = True
        call.outcome = "delivered"
        return Delivered(t)
