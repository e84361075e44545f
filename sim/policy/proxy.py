"""The proxy of SPEC §3 as a clock-free state machine.

Every attempt goes through `on_attempt`; the proxy answers with actions for
its driver: subscribe the attempt to an execution, dispatch an execution to
the engine, refuse an attempt, cancel an execution at the engine. The driver
reports back what happens (`on_engine_refused`, `on_attempt_left`,
`on_finished`) and carries out the actions returned. Checks and controls are
policies on this one object.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CANCELLATIONS = ("off", "now")


@dataclass(frozen=True)
class ProxyConfig:
    cancellation: str = "off"     # off: orphaned executions run on; now: close the engine connection

    def __post_init__(self):
        if self.cancellation not in CANCELLATIONS:
            raise ValueError(f"cancellation must be one of {', '.join(CANCELLATIONS)}; got {self.cancellation!r}")


class Execution:
    __slots__ = ("id", "call_id", "key", "created_at", "state", "subscribers", "orphaned")

    def __init__(self, id: int, call_id: int, key, created_at: float):
        self.id = id
        self.call_id = call_id
        self.key = key
        self.created_at = created_at
        self.state = "created"        # created | dispatched | completed | cancelled | refused
        self.subscribers: list[Attempt] = []
        self.orphaned = False         # every subscriber left and it runs on

    @property
    def live(self) -> bool:
        return self.state in ("created", "dispatched")


class Attempt:
    __slots__ = ("call_id", "number", "execution", "attached", "open")

    def __init__(self, call_id: int, number: int):
        self.call_id = call_id
        self.number = number
        self.execution: Execution | None = None
        self.attached = False
        self.open = True


# actions
@dataclass(frozen=True)
class Subscribe:
    attempt: Attempt
    execution: Execution


@dataclass(frozen=True)
class Dispatch:
    execution: Execution


@dataclass(frozen=True)
class Refuse:
    attempt: Attempt
    status: int                   # 429 or 503
    retry_after: float | None = None
    reason: str = ""              # budget | engine | proxy


@dataclass(frozen=True)
class Cancel:
    execution: Execution


@dataclass(frozen=True)
class Complete:
    attempt: Attempt


def call_key(call_id: int, params: tuple = ()) -> tuple:
    """The key a call's attempts share: the call id plus the full generation
    parameters (a retry resends both unchanged)."""
    return (call_id,) + tuple(params)


class Proxy:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.executions: dict[int, Execution] = {}
        self._next_id = 0

    # ------------------------------------------------------------ attempts
    def on_attempt(self, t: float, attempt: Attempt, params: tuple = ()) -> list:
        ex = Execution(self._next_id, attempt.call_id, call_key(attempt.call_id, params), t)
        self._next_id += 1
        self.executions[ex.id] = ex
        ex.subscribers.append(attempt)
        attempt.execution = ex
        return [Subscribe(attempt, ex), Dispatch(ex)]

    def on_dispatched(self, t: float, ex: Execution) -> None:
        ex.state = "dispatched"

    def on_engine_refused(self, t: float, ex: Execution) -> list:
        """The engine answered 503 (engine cap): every subscriber is refused."""
        ex.state = "refused"
        subs, ex.subscribers = ex.subscribers, []
        out = []
        for a in subs:
            a.open = False
            out.append(Refuse(a, 503, None, "engine"))
        self.executions.pop(ex.id, None)
        return out

    def on_attempt_left(self, t: float, attempt: Attempt) -> list:
        """The client gave up the attempt and closed its connection."""
        attempt.open = False
        ex = attempt.execution
        if ex is None or not ex.live:
            return []
        ex.subscribers.remove(attempt)
        if ex.subscribers:
            return []
        if self.config.cancellation == "now":
            ex.state = "cancelled"
            self.executions.pop(ex.id, None)
            return [Cancel(ex)]
        ex.orphaned = True
        return []

    def on_finished(self, t: float, ex: Execution) -> list:
        """The engine streamed the execution's last token."""
        ex.state = "completed"
        self.executions.pop(ex.id, None)
        subs, ex.subscribers = ex.subscribers, []
        for a in subs:
            a.open = False
        return [Complete(a) for a in subs]
