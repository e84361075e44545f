"""What a stack of layers can do to one call, from its settings alone: the
most attempts the call can cause at each layer and at the engine, the
longest the call can go on being retried, and which layers let an abandoned
request run on (they do not pass the disconnect on).

A call is a non-idempotent POST (a chat or completion request): a layer that
may not resend a request already sent upstream (nginx's default), or that
retries only a failed connection (HAProxy's), resends only attempts that
never reached the layer below, so it multiplies the attempts it sends but not
the executions below it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .presets import policies
from .retry import CONNECT_ERROR


@dataclass(frozen=True)
class LayerInfo:
    name: str
    kind: str
    attempts: float            # most attempts one attempt from above can turn into here (inf: no limit)
    reaching: float            # of those, how many can reach the layer below
    attempt_s: float           # longest one of this layer's attempts can last
    span_s: float              # longest this layer can go on with one attempt from above, retries included
    runs_on: tuple = ()        # "upstream" and/or "queued": where an abandoned request runs on


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


def stack_info(layers: list) -> StackInfo:
    """layers: each layer's effective settings (presets.preset()), in order
    from the application to the engine."""
    built = [policies(s) for s in layers]
    infos = []
    inner = math.inf                 # the engine: no bound on how long an execution takes
    for i in range(len(layers) - 1, -1, -1):
        retry, gateway = built[i]
        attempts, reaching = _layer_attempts(retry, gateway)
        attempt = inner if retry.timeout_s is None else min(retry.timeout_s, inner)
        if gateway is not None and gateway.max_connections is not None:
            attempt += math.inf if gateway.queue_timeout_s is None else gateway.queue_timeout_s
        if math.isfinite(attempts):
            waits = sum(retry.longest_wait(k) for k in range(int(attempts) - 1))
            span = attempts * attempt + waits
        else:
            span = math.inf
        if retry.tries_timeout_s is not None:
            span = min(span, retry.tries_timeout_s + attempt)
        if retry.deadline_s is not None:
            span = min(span, retry.deadline_s)
        runs_on = ()
        if gateway is not None:
            runs_on = tuple(where for where, passes in (("upstream", gateway.passes_disconnect),
                                                        ("queued", gateway.passes_disconnect_queued))
                            if not passes and (where == "upstream" or gateway.max_connections is not None))
        infos.append(LayerInfo(_name(layers[i], i), layers[i].get("kind", "client"), attempts, reaching,
                               attempt, span, runs_on))
        inner = span
    return StackInfo(tuple(reversed(infos)))


REFERENCE_SOURCE = "docs/model.md (the reference design)"


def reference_layers(stack) -> list:
    """The reference design's own layers (`sim.policy.stack.Stack`: its
    client, proxy and router, in the stack's order) as settings
    `stack_info` reads, each key sourced to docs/model.md: the client's
    deadline bounds each attempt and it retries a timeout, a 429 (its
    Retry-After honoured up to its cap, a longer one gives the call up) and a
    503 after a uniform wait; the proxy retries nothing and passes the
    disconnect on unless its cancellation is off; the router tries another
    replica on an engine's 503 (a request that never ran, so no more
    executions)."""
    out = []
    for kind, cfg in stack.layers:
        if kind == "client":
            s = {"kind": "client", "name": "client", "timeout_s": cfg.deadline_s, "max_retries": cfg.max_retries,
                 "retry_on": ("timeout", "429", "503"), "backoff": "uniform", "backoff_base_s": cfg.backoff_min_s,
                 "backoff_cap_s": cfg.backoff_max_s, "retry_after": True, "retry_after_formats": ("seconds",),
                 "retry_after_cap_s": cfg.max_retry_after_s, "retry_after_above_cap": "give_up"}
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
