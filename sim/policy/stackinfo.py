"""What a stack of layers can do to one call, from its settings alone: the
most attempts the call can cause at each layer and at the engine, the
longest the call can go on being retried, and which layers let an abandoned
request run on (they do not pass the disconnect on).

A call is a non-idempotent POST (a chat or completion request): a layer that
may not resend a request already sent upstream (nginx's default), or that
retries only a failed connection (HAProxy's), resends only attempts that
never reached the layer below, so it multiplies the attempts it sends but not
the executions below it.

A layer's figures come from its settings: a kind the presets know (client,
gateway) from its `RetryPolicy` and `GatewayPolicy` (`preset_figures`);
another registered kind from its `LayerKind.figures`, where it gives one.
A layer of neither cannot be composed: its figures, and every figure that
depends on them, are unknown (NaN), and `StackInfo.not_composed` names it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .client import reference_settings
from .layers import Figures, layer_kind
from .presets import KINDS as PRESET_KINDS, policies
from .retry import CONNECT_ERROR

NAN = math.nan


@dataclass(frozen=True)
class LayerInfo:
    name: str
    kind: str
    attempts: float            # most attempts one attempt from above can turn into here (inf: no limit)
    reaching: float            # of those, how many can reach the layer below
    attempt_s: float           # longest one of this layer's attempts can last
    span_s: float              # longest this layer can go on with one attempt from above, retries included
    runs_on: tuple = ()        # "upstream" and/or "queued": where an abandoned request runs on
    composed: bool = True      # False: its kind gives no figures (those above are NaN: unknown)


@dataclass(frozen=True)
class StackInfo:
    layers: tuple = field(default_factory=tuple)

    @property
    def engine_attempts(self) -> float:
        """The most attempts one call can cause at the engine: the product of
        each layer's attempts that reach the layer below."""
        return math.prod(layer.reaching for layer in self.layers) if self.layers else 1

    @property
    def sent_attempts(self) -> tuple:
        """The most attempts one call can cause at each layer's upstream."""
        out, incoming = [], 1
        for layer in self.layers:
            out.append(incoming * layer.attempts)
            incoming = incoming * layer.reaching
        return tuple(out)

    @property
    def longest_s(self) -> float:
        """The longest a call can go on being retried (inf: no bound)."""
        return self.layers[0].span_s if self.layers else 0.0

    @property
    def runs_on(self) -> tuple:
        """The layers that let an abandoned request run on."""
        return tuple(layer.name for layer in self.layers if layer.runs_on)

    @property
    def not_composed(self) -> tuple:
        """The layers whose kind gives no figures (the stack's figures are then unknown)."""
        return tuple(layer.name for layer in self.layers if not layer.composed)


def _name(settings: dict, i: int) -> str:
    return str(settings.get("name") or settings.get("preset") or f"{settings.get('kind', 'client')}{i}")


def _layer_attempts(retry, gateway) -> tuple:
    n = retry.max_attempts
    if gateway is not None and gateway.servers_for_retries is not None:
        n = min(n, gateway.servers_for_retries)
    if not retry.retry_on:
        n = 1
    resends_sent = retry.retry_sent_non_idempotent and set(retry.retry_on) - {CONNECT_ERROR}
    return n, (n if resends_sent else 1)


def _bound(x: float, cap: float) -> float:
    """min(x, cap), unknown (NaN) where x is."""
    return x if x != x else min(x, cap)


def preset_figures(settings: dict, inner_s: float) -> Figures:
    """The figures of a layer of a kind the presets know (its `RetryPolicy`
    and `GatewayPolicy`), above a layer below that can take `inner_s` with
    one attempt (inf: the engine; NaN: unknown)."""
    retry, gateway = policies(settings)
    attempts, reaching = _layer_attempts(retry, gateway)
    attempt = inner_s if retry.timeout_s is None else (retry.timeout_s if inner_s != inner_s
                                                       else min(retry.timeout_s, inner_s))
    if gateway is not None and gateway.max_connections is not None:
        attempt += math.inf if gateway.queue_timeout_s is None else gateway.queue_timeout_s
    if math.isfinite(attempts):
        waits = sum(retry.longest_wait(k) for k in range(int(attempts) - 1))
        span = attempts * attempt + waits
    else:
        span = math.inf
    if retry.tries_timeout_s is not None:
        span = _bound(span, retry.tries_timeout_s + attempt)
    if retry.deadline_s is not None:
        span = _bound(span, retry.deadline_s)
    runs_on = ()
    if gateway is not None:
        runs_on = tuple(where for where, passes in (("upstream", gateway.passes_disconnect),
                                                    ("queued", gateway.passes_disconnect_queued))
                        if not passes and (where == "upstream" or gateway.max_connections is not None))
    return Figures(attempts, reaching, attempt, span, runs_on)


def figures_of(settings: dict):
    """How a layer's figures are had (`preset_figures`, or its kind's
    `LayerKind.figures`); None where its kind gives none."""
    kind = settings.get("kind", "client")
    if kind in PRESET_KINDS:
        return preset_figures
    try:
        return layer_kind(kind).figures
    except ValueError:
        return None


def stack_info(layers: list) -> StackInfo:
    """layers: each layer's effective settings (presets.preset(), or a
    registered kind's), in order from the application to the engine."""
    infos = []
    inner = math.inf                 # the engine: no bound on how long an execution takes
    for i in range(len(layers) - 1, -1, -1):
        name, kind = _name(layers[i], i), layers[i].get("kind", "client")
        figures = figures_of(layers[i])
        if figures is None:
            infos.append(LayerInfo(name, kind, NAN, NAN, NAN, NAN, (), composed=False))
            inner = NAN
            continue
        f = figures(layers[i], inner)
        infos.append(LayerInfo(name, kind, f.attempts, f.reaching, f.attempt_s, f.span_s, tuple(f.runs_on)))
        inner = f.span_s
    return StackInfo(tuple(reversed(infos)))


REFERENCE_SOURCE = "docs/model.md (the reference design)"


def reference_layers(stack) -> list:
    """The reference design's own layers (`sim.policy.stack.Stack`: its
    client, proxy and router, in the stack's order) as settings
    `stack_info` reads, each key sourced to docs/model.md: the client's
    deadline bounds each attempt and it retries every failure (a timeout, a
    refusal of any status) after a uniform wait, a Retry-After honoured up to
    its cap (a longer one gives the call up); the proxy retries nothing and passes the
    disconnect on unless its cancellation is off; the router tries another
    replica on an engine's 503 (a request that never ran, so no more
    executions)."""
    out = []
    for kind, cfg in stack.layers:
        if kind == "client":
            s = reference_settings(cfg)
        elif kind == "proxy":
            passes = cfg.cancellation != "off"
            s = {"kind": "gateway", "name": "proxy", "cancellation": cfg.cancellation, "max_retries": 0,
                 "passes_disconnect": passes, "passes_disconnect_queued": passes,
                 "max_connections": cfg.proxy_cap}
        else:
            s = {"kind": "gateway", "name": "router", "router": cfg.policy, "max_retries": cfg.retries,
                 "retry_on": ("503",) if cfg.retries else (), "retry_sent_non_idempotent": False,
                 "upstream_servers": cfg.retries + 1, "next_server_only": True}
        out.append(s)
    return out
