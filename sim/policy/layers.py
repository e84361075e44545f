"""The kinds of layer a scenario's `[[layer]]` tables name, and the actions a
layer between the client and the proxy answers with.

A layer module fills the registry: `register(LayerKind(name, settings,
make, top))` at import, where

- `settings(preset, overrides)` returns the layer's effective settings (a
  dict with `kind`), raising a one-line `ValueError("key: why")` for a bad
  value (`sim.scenario_file` turns it into `FILE: layer[i].key why`);
- `make(settings, context)` returns the clock-free layer object a run
  drives (`LayerContext`: the run's random draws, a view of the engines,
  the calls' priorities);
- `top`: the layer stands where the client does (the first layer: it sends
  a call's attempts and decides on its retries); otherwise it stands
  between the client and the proxy, in the order of the tables;
- `figures(settings, inner_s)` (optional): what one attempt from above can
  become at this layer (`Figures`), above a layer below that can take
  `inner_s` with one attempt (inf: the engine; NaN: unknown), for `llmsim
  stack` (`sim.policy.stackinfo`; the kinds the presets know, client and
  gateway, are read from their settings there). A kind without it is shown
  with its settings and said not to compose.

`sim.scenario_file` resolves every `[[layer]]` table through this registry and
`sim.model.Run` makes every layer through it: a new kind of layer is its
module (which registers it), its rows in `sim/schema.py` (the module is
imported there, so its registration is done before any scenario is read),
its tests and its docs page.

A layer between the client and the proxy receives an attempt from the layer
above (`on_attempt(t, attempt, params, prompt_len)`) and its disconnect
(`on_attempt_left(t, attempt)`); it hears from below through its upstream
attempts (`Upstream`): `on_complete(t, up)`, `on_refused(t, up, status,
retry_after, reason)`; and a time it asked for comes (`on_timer(t, token)`).
It tells the driver `upstream_of(attempt)` (the upstream attempt open now for
an attempt from above), `counts` (what it did, a dict of counts: a run's
record carries them under `extra.layers`), and where it may hold attempts in
a queue of its own, `may_queue` and `queued`; where it reads the engines'
state (`LayerContext.pods`), `reads_engines`.
Each call returns a list of actions: the answers to the layer above are the
proxy's `Complete(attempt)` and `Refuse(attempt, status, retry_after,
reason)`; towards the layer below, `Send(up)` (an upstream attempt goes
below), `Leave(up)` (the layer closes it: the layer below hears the
disconnect), `RunOn(up)` (nobody waits for it any more, and it goes on);
and `Timer(at, layer, token)`. The driver carries them out through the one
`sim.policy.stack.Interpreter`. Nothing here reads a clock."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from .proxy import Attempt, Execution


@dataclass(frozen=True)
class LayerKind:
    name: str
    settings: Callable      # (preset name or None, overrides: dict) -> effective settings (dict with "kind")
    make: Callable          # (settings, LayerContext) -> the layer object
    top: bool = False       # the client's place (else between the client and the proxy)
    figures: Callable | None = None     # (settings, inner_s) -> Figures; None: the stack cannot compose it


class Figures(NamedTuple):
    """What one attempt from above can become at a layer: at most `attempts`
    attempts (inf: no limit), `reaching` of them can reach the layer below;
    one lasts at most `attempt_s`, all with their waits `span_s`; `runs_on`
    names where an abandoned request runs on ("upstream", "queued")."""
    attempts: float
    reaching: float
    attempt_s: float
    span_s: float
    runs_on: tuple = ()


@dataclass(frozen=True)
class LayerContext:
    """What a run gives the layers it makes. `uniform(a, b)`: the run's
    seeded draws; `pods(t)`: (waiting, KV cache usage, metrics age in s) of
    each engine at t; `priority(call_id)`: a call's priority as a gateway
    sheds by it (below 0: sheddable; `sim.classes.call_objectives`);
    `index`: the layer's place in the stack (0: the top); `up(r)`: whether
    replica r is up now (None: every replica always is; an autoscaled
    fleet's replicas come and go)."""
    uniform: Callable
    pods: Callable | None = None
    priority: Callable | None = None
    index: int = 0
    up: Callable | None = None


_KINDS: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add a kind of layer (a second registration of a name replaces the first)."""
    _KINDS[kind.name] = kind
    return kind


def kinds() -> tuple:
    """The names of the registered kinds."""
    return tuple(_KINDS)


def layer_kind(name: str) -> LayerKind:
    """The registered kind `name`; a one-line ValueError naming `kind` otherwise."""
    k = _KINDS.get(name)
    if k is None:
        raise ValueError(f"kind: unknown layer kind {name!r} (known: {', '.join(_KINDS)})")
    return k


class Upstream(Attempt):
    """An attempt a layer sends to the layer below for an attempt from
    above (`above`); `layer` is the layer that sent it and hears its answer.
    `row` is the driver's (the attempt-log row of the client's attempt it
    serves); `ran_on` marks one nobody waits for any more, `closed` one
    whose connection the layer has closed or seen answered; `server`, the
    server of a gateway's upstream group it goes to (-1: none chosen, the
    cluster places it). Where the answer below streams (an engine's, to the
    gateway below the one proxy), `answering` marks one whose status and
    header came (vLLM sends them as it takes the request) and `streaming`
    one whose first token came."""
    __slots__ = ("layer", "above", "row", "ran_on", "closed", "server", "answering", "streaming")

    def __init__(self, call_id: int, number: int, deadline: float, layer, above: Attempt):
        super().__init__(call_id, number, deadline, above.klass)     # the call's class, for shedding by class
        self.layer = layer
        self.above = above
        self.row = -1
        self.ran_on = False
        self.closed = False
        self.server = -1
        self.answering = False
        self.streaming = False


class ExecutionAttempt(Attempt):
    """An execution of the one proxy as it goes to the gateway below it
    (`Stack.group_below_proxy`): the gateway's attempt from above, answered
    to the proxy (`Interpreter._complete`, `_refuse`). `row` is the
    attempt-log row of the client's attempt it was made for."""
    __slots__ = ("of", "row")

    def __init__(self, ex: Execution, row: int):
        super().__init__(ex.call_id, ex.id, klass=ex.klass)
        self.of = ex
        self.row = row


# actions of a layer between the client and the proxy (answers to the layer above: proxy.Complete / proxy.Refuse)
@dataclass(slots=True)
class Send:
    """The upstream attempt goes to the layer below."""
    attempt: Upstream


@dataclass(slots=True)
class Leave:
    """The layer closes its upstream attempt: the layer below hears the disconnect."""
    attempt: Upstream


@dataclass(slots=True)
class RunOn:
    """Nobody waits for the upstream attempt any more; it goes on below."""
    attempt: Upstream


@dataclass(slots=True)
class Timer:
    """Call `layer.on_timer(at, token)` at time `at`."""
    at: float
    layer: object
    token: object


__all__ = ["LayerKind", "Figures", "LayerContext", "register", "kinds", "layer_kind", "Upstream", "ExecutionAttempt",
           "Send", "Leave", "RunOn", "Timer"]
