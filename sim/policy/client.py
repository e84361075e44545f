"""The client of docs/model.md: per-attempt deadline, up to R retries after a
uniform random wait, Retry-After on 429, the usual wait on 503; a refused
attempt counts as one of the call's attempts."""
from __future__ import annotations

from dataclasses import dataclass


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
    __slots__ = ("call_id", "planned_at", "attempts", "open_attempt", "deadline", "done", "outcome")

    def __init__(self, call_id: int, planned_at: float):
        self.call_id = call_id
        self.planned_at = planned_at
        self.attempts = 0           # attempts sent so far
        self.open_attempt = -1      # number of the attempt in progress, -1 if none
        self.deadline = float("inf")
        self.done = False
        self.outcome = ""


class RetryingClient:
    """Decisions for every call of one client. `uniform(a, b)` draws the
    backoff wait (the driver supplies a seeded generator)."""

    def __init__(self, config: ClientConfig, uniform):
        self.config = config
        self.uniform = uniform

    def send(self, call: CallState, t: float) -> int:
        """An attempt goes out at t; returns its number (0 = first)."""
        assert not call.done and call.open_attempt < 0
        n = call.attempts
        call.attempts += 1
        call.open_attempt = n
        call.deadline = t + self.config.deadline_s
        return n

    def _failed(self, call: CallState, t: float, wait: float | None):
        call.open_attempt = -1
        if call.attempts > self.config.max_retries:
            call.done = True
            call.outcome = "failed_attempts"
            return GiveUp("attempts")
        if wait is None:
            wait = self.uniform(self.config.backoff_min_s, self.config.backoff_max_s)
        elif wait > self.config.max_retry_after_s:
            call.done = True
            call.outcome = "failed_retry_after"
            return GiveUp("retry_after")
        return Retry(t + wait)

    def on_deadline(self, call: CallState, t: float):
        """The open attempt reached its deadline: the client closes it."""
        return self._failed(call, t, None)

    def on_refused(self, call: CallState, t: float, status: int, retry_after: float | None = None):
        """The open attempt was refused: 429 (with Retry-After) or 503."""
        if status == 429 and retry_after is not None:
            return self._failed(call, t, float(retry_after))
        return self._failed(call, t, None)

    def on_complete(self, call: CallState, t: float):
        """The open attempt received the complete response."""
        call.open_attempt = -1
        call.done = True
        call.outcome = "delivered"
        return Delivered(t)
