"""A client layer from a preset (`sim.policy.presets`) behind the interface
the simulator drives its client through (`sim.policy.client.RetryingClient`'s):
`send` numbers the attempt and sets the time the client gives it up (its
per-attempt timeout or the call's deadline), `on_deadline`, `on_refused` and
`on_complete` return `Retry`, `GiveUp` or `Delivered`. The decisions are the
preset's `RetryPolicy`, made by `sim.policy.retry.Retrier`.

A give-up the reference client has no outcome for (not retryable, the call's
deadline, throttled) is recorded as `failed_attempts`; a Retry-After above
the cap given up on as `failed_retry_after`. Clock-free like the rest of
`sim.policy`. The module registers the layer kind "client" (`CLIENT`,
`sim.policy.layers`)."""
from __future__ import annotations

from .client import CallState, Delivered, GiveUp, Retry
from .layers import LayerKind, register
from .presets import PRESETS, policies, preset
from .retry import STATUS, TIMEOUT, Failure, Retrier, RetryAt


class PresetClient:
    """Decisions for every call of a client layer of `settings` (a preset's
    effective settings). `uniform(a, b)` draws (the driver's seeded
    generator); the policy's jitter takes `uniform(0, 1)`."""

    def __init__(self, settings: dict, uniform):
        retry, gateway = policies(settings)
        if gateway is not None:
            raise ValueError(f"a {settings.get('kind')} layer is not a client")
        self.settings = settings
        self.retrier = Retrier(retry, lambda: uniform(0.0, 1.0))
        self._retries: dict = {}            # call id -> the Retrier's state of a call in progress

    def send(self, call: CallState, t: float) -> int:
        """An attempt goes out at t; returns its number (0 = first)."""
        assert not call.done and call.open_attempt < 0
        state = self._retries.get(call.call_id)
        if state is None:
            state = self._retries[call.call_id] = self.retrier.start(t)
        n = call.attempts
        call.attempts += 1
        call.open_attempt = n
        call.deadline = self.retrier.send(state, t)
        return n

    def _failed(self, call: CallState, failure: Failure):
        call.open_attempt = -1
        decision = self.retrier.on_failure(self._retries[call.call_id], failure)
        if type(decision) is RetryAt:
            return Retry(decision.at)
        del self._retries[call.call_id]
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
        self.retrier.on_success(self._retries.pop(call.call_id), t)
        call.open_attempt = -1
        call.done = True
        call.outcome = "delivered"
        return Delivered(t)


def settings(preset_name: str | None, overrides: dict) -> dict:
    """A client [[layer]]'s effective settings (`sim.policy.presets.preset`)."""
    if preset_name is None:
        raise ValueError(f"preset: must be given (one of {', '.join(PRESETS)})")
    return preset("client", preset_name, **overrides)


CLIENT = register(LayerKind("client", settings, lambda settings, context: PresetClient(settings, context.uniform),
                            top=True))
