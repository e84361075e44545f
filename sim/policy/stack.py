"""The layers between the workload and the cluster of engines, as one stack.

A stack names its layers in order from the application to the engines: the
client (`sim.policy.client`), then the proxy (`sim.policy.proxy`, with the
condition's controls) and the router (`sim.policy.router`) in one of two
placements:

- `deployment`: the proxy before the router. The proxy sees every attempt;
  the router places each execution the proxy dispatches (an upstream
  attempt), and on an engine's 503 tries another replica while its retries
  allow.
- `replica`: the router before a sidecar proxy per replica. The router
  places each attempt; a sidecar's 503 (its deadline check, or its engine's
  cap) is retried on another replica likewise (`ReplicaProxies`).

Between the client and the proxy stand any layers of the kinds registered in
`sim.policy.layers` (gateways: `sim.policy.gateway`), in order
(`Stack.with_layers`, `Stack.chain`). The lowest, where it is a gateway
with an upstream group over the replicas, balances them itself: behind it a
sidecar proxy per replica (`replica`), or, with the one proxy of
`deployment`, it stands below that proxy (`Stack.group_below_proxy`) and
takes its executions (`Interpreter._dispatch_below`).

`Stack.from_config(condition, router, scenario)` is the stack of a
condition (its proxy; its client on the scenario's deadline and backoff) and
a `[fleet]` router config (None: the default router, which over one engine
places everything on it).
`Stack.bind(n, ...)` makes the stack's policy objects for a cluster of n
engines: a `Cluster`, whose `proxy` the driver sends attempts to and whose
`place` / `reroute` name the engine an execution goes to. A driver (the
simulator's `sim.model.Run`, the live `validate.proxy.LiveProxy`) carries
the proxy's actions out and asks the cluster where each execution goes;
neither branches on the placement. Nothing here reads a clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from .client import ClientConfig, Delivered, GivenUp
from .layers import ExecutionAttempt, Leave, RunOn, Send, Timer, Upstream, layer_kind
from .proxy import Cancel, Complete, Dispatch, Drop, EngineView, Execution, Proxy, ProxyConfig, Refuse, Subscribe, Wake
from .router import GroupSidecars, ReplicaProxies, Router, RouterConfig

LAYERS = ("client", "proxy", "router")


@dataclass(frozen=True)
class Stack:
    """The layers in order from the application to the engines: each entry
    is (kind, config), the kinds of `LAYERS`."""
    layers: tuple

    def __post_init__(self):
        kinds = [k for k, _ in self.layers]
        if (len(kinds) < 3 or kinds[0] != "client" or sorted(kinds[-2:]) != ["proxy", "router"]
                or any(k in LAYERS for k in kinds[1:-2])):
            raise ValueError("a stack is the client, any layers of the registered kinds, then the proxy and the "
                             f"router in either order; got {kinds}")

    @classmethod
    def from_config(cls, condition, router: RouterConfig | None = None, scenario=None) -> "Stack":
        """A condition's client (its retries on the scenario's deadline and
        backoff; None without a scenario) and proxy, and the router: the
        proxy before the router (`router.proxy` "deployment", the default)
        or after it (a sidecar per replica: "replica")."""
        router = router if router is not None else RouterConfig()
        client: ClientConfig | None = condition.client_config(scenario) if scenario is not None else None
        proxy = ("proxy", condition.proxy)
        below = (proxy, ("router", router)) if router.proxy == "deployment" else (("router", router), proxy)
        return cls((("client", client),) + below)

    def with_client(self, client) -> "Stack":
        """This stack with another client: a `ClientConfig`, a client
        layer's effective settings (`sim.policy.presets.preset`), which the
        simulator drives through `sim.policy.preset_client.preset_client`, or
        a tuple of them, the application's first (`NestedClients`)."""
        return Stack(tuple((k, client if k == "client" else c) for k, c in self.layers))

    def with_layers(self, layers) -> "Stack":
        """This stack with `[[layer]]` tables' effective settings (dicts with
        `kind`, application first): the layers of a kind that stands at the
        top (`LayerKind.top`, the client) replace the client (several: one
        inside another, a tuple); the others stand between the client and
        the proxy, in order."""
        tops = tuple(s for s in layers if layer_kind(s["kind"]).top)
        chain = tuple((s["kind"], s) for s in layers if not layer_kind(s["kind"]).top)
        out = self.with_client(tops[0] if len(tops) == 1 else tops) if tops else self
        return Stack(out.layers[:1] + chain + out.layers[-2:])

    @property
    def chain(self) -> tuple:
        """The layers between the client and the proxy: (kind, settings), from the top."""
        return self.layers[1:-2]

    @classmethod
    def under_layers(cls, condition, layers, scenario=None, router: RouterConfig | None = None) -> "Stack":
        """A condition's proxy and `router` (None: the default one) under
        `[[layer]]` tables' effective settings (`sim.policy.presets.preset`,
        application first; `with_layers`): what a run of the condition
        drives on a scenario with such layers. A layer at the client's place
        sends no retries where the condition turns them off."""
        layers = [dict(s, max_retries=0) if not condition.retries and layer_kind(s["kind"]).top
                  and "max_retries" in s else s for s in layers]
        return cls.from_config(condition, router, scenario).with_layers(layers)

    def config(self, kind: str):
        return next(c for k, c in self.layers if k == kind)

    @property
    def upstream_group(self) -> int:
        """The servers of the upstream group of the lowest layer between the
        client and the proxy (a gateway whose `upstream_servers` is more than
        one balances the replicas itself); 0: none."""
        chain = self.chain
        if not chain or not isinstance(chain[-1][1], dict):
            return 0
        n = chain[-1][1].get("upstream_servers", 1)
        return n if chain[-1][0] == "gateway" and n > 1 else 0

    @property
    def group_below_proxy(self) -> bool:
        """The condition's one proxy stands before the lowest gateway's
        upstream group (`[fleet] proxy = "deployment"`): that gateway takes
        the proxy's executions (`ExecutionAttempt`) and balances them."""
        return bool(self.upstream_group) and self.proxy_before_router

    @property
    def proxy_before_router(self) -> bool:
        kinds = [k for k, _ in self.layers]
        return kinds.index("proxy") < kinds.index("router")

    def bind(self, n: int, engine_view: Callable[[tuple, int, float], EngineView],
             prompt_throughput: Callable[[tuple], float | None], replica_view=None, outstanding=None,
             kv_usage=None) -> "Cluster":
        """The stack's proxy and router over a cluster of n engines.
        `engine_view(group, g, t)` is what the g-th proxy reads of the engines
        of `group` (the replicas it feeds) at t; `prompt_throughput(group)`
        their prompt throughput before any history; the router reads
        `replica_view`, `outstanding` and `kv_usage` (see `Router`)."""
        router = Router(self.config("router"), n, view=replica_view, outstanding=outstanding, kv_usage=kv_usage)
        cfg: ProxyConfig = self.config("proxy")
        kind = ProxyBeforeRouter if self.proxy_before_router else SidecarPerReplica
        group = self.upstream_group
        if group:
            check_group(self, n)
            kind = ProxyBeforeGroup if self.proxy_before_router else GroupSidecarPerReplica
        groups = kind.groups(n)
        proxies = [Proxy(cfg, engine_view=partial(engine_view, grp, g), prompt_throughput=prompt_throughput(grp))
                   for g, grp in enumerate(groups)]
        return kind(router, proxies, groups)


class Cluster:
    """The stack's proxies and router over n engines. `proxy` is driven as
    one proxy (`sim.policy.proxy.Proxy`'s methods and actions);
    `proxies[g]` stands before the replicas `groups[g]`. `execution_replica`
    maps an execution's id to its replica (a driver sets it as it places
    the execution; `execution_replicas` reads it out); `rerouted` counts
    requests the router retried on another replica."""
    placement = ""
    per_replica_queues = False      # each replica has a proxy queue of its own
    placed_at_creation = False      # an execution has its replica from its creation (else from its dispatch)

    def __init__(self, router: Router, proxies: Sequence[Proxy], groups: tuple):
        self.router = router
        self.proxies = list(proxies)
        self.groups = groups
        self.group_of = [0] * router.n
        for g, grp in enumerate(groups):
            for r in grp:
                self.group_of[r] = g
        self.execution_replica: dict[int, int] | list[int] = {}

    def execution_replicas(self, n: int) -> list[int]:
        """The replica of executions 0..n-1 (-1: never placed)."""
        get = self.execution_replica.get
        return [get(i, -1) for i in range(n)]

    @property
    def rerouted(self) -> int:
        return self._rerouted

    @property
    def outstanding(self) -> int:
        """Executions dispatched to the engines and not finished."""
        return sum(p.outstanding for p in self.proxies)

    def queued_at(self, r: int) -> int:
        """Executions held for replica r alone in a proxy queue."""
        return 0

    def created(self, ex: Execution) -> int | None:
        """The replica a new execution has from its creation (None: it gets
        one when dispatched)."""
        return None

    def place(self, ex: Execution) -> int:
        """The replica an execution being dispatched goes to first."""
        raise NotImplementedError

    def reroute(self, call_id, tried: list) -> int | None:
        """The engines of `tried` refused (503) an execution: the replica
        to try next (appended to `tried`), or None (it is refused)."""
        return None

    def landed(self) -> list | None:
        """The replica each attempt was last sent to, in the order the
        proxy saw them; None where attempts land with their executions."""
        return None

    def calls_stay_home(self, engine_cap) -> bool:
        """Whether every request of a call goes to the one replica
        `router.home(call)` names in advance and what happens to a call
        touches no other replica."""
        raise NotImplementedError


class ProxyBeforeRouter(Cluster):
    """One proxy before the router: the router places executions."""
    placement = "deployment"

    @staticmethod
    def groups(n: int) -> tuple:
        return (tuple(range(n)),)

    def __init__(self, router, proxies, groups):
        super().__init__(router, proxies, groups)
        self.proxy = self.proxies[0]
        self._rerouted = 0

    def place(self, ex: Execution) -> int:
        return self.router.pick(ex.call_id)

    def reroute(self, call_id, tried: list) -> int | None:
        if not self.router.may_retry(tried):
            return None
        self._rerouted += 1
        r = self.router.pick(call_id, tried)
        tried.append(r)
        return r

    def calls_stay_home(self, engine_cap) -> bool:
        # a hashing router that never moves a request on 503, and no proxy
        # queue (one that dispatches, when a seat frees, the queued
        # execution of any call)
        moves = self.router.config.retries > 0 and engine_cap is not None
        return (self.router.home(0) is not None and not moves
                and self.proxy.config.proxy_cap is None)


class SidecarPerReplica(Cluster):
    """A sidecar proxy before each engine, behind the router: the router
    places attempts (`ReplicaProxies`)."""
    placement = "replica"
    per_replica_queues = True
    placed_at_creation = True

    @staticmethod
    def groups(n: int) -> tuple:
        return tuple((r,) for r in range(n))

    def __init__(self, router, proxies, groups):
        super().__init__(router, proxies, groups)
        self.proxy = ReplicaProxies(self.proxies, router)
        self.execution_replica = self.proxy.execution_replica

    @property
    def rerouted(self) -> int:
        return self.proxy.rerouted

    def execution_replicas(self, n: int) -> list[int]:
        reps = self.execution_replica         # by id, from each execution's creation
        return reps[:n] + [-1] * (n - len(reps))

    def queued_at(self, r: int) -> int:
        return self.proxies[r].queued

    def created(self, ex: Execution) -> int | None:
        return self.execution_replica[ex.id]

    def place(self, ex: Execution) -> int:
        return self.execution_replica[ex.id]

    def landed(self) -> list | None:
        return self.proxy.landed

    def calls_stay_home(self, engine_cap) -> bool:
        # a 503 the router retries elsewhere: the engine's cap, or a sidecar's deadline check
        moves = self.router.config.retries > 0 and (engine_cap is not None
                                                    or self.proxies[0].config.queue == "deadline")
        return self.router.home(0) is not None and not moves


def check_group(stack: Stack, n: int) -> None:
    """Raises (one line) unless the stack's upstream group can stand before
    a cluster of n replicas: as many servers as replicas (the group is the
    cluster's router), no router retries of its own (the group retries
    itself), and no other gateway with a group above it (one balancer of
    the replicas). The condition's proxy stands before the group (the one
    proxy of `deployment`: the group takes its executions) or behind it, a
    sidecar before each engine (`replica`)."""
    group = stack.upstream_group
    if group != n:
        raise ValueError(f"upstream_servers: the gateway's upstream group has {group} servers and the fleet {n} "
                         "replicas; give [fleet] replicas the same number")
    router = stack.config("router")
    if router.retries:
        raise ValueError("upstream_servers: a gateway's upstream group is the router and retries itself; "
                         "set [fleet] router_retries = 0")
    above = [s for k, s in stack.chain[:-1] if isinstance(s, dict) and s.get("upstream_servers", 1) > 1]
    if above:
        raise ValueError("upstream_servers: only the lowest gateway may balance the replicas (an upstream group)")


class ProxyBeforeGroup(ProxyBeforeRouter):
    """The condition's one proxy before a gateway's upstream group: the
    group places each execution (its upstream attempt's `server`); the
    driver sends the proxy's executions to the gateway
    (`Interpreter._dispatch_below`) and the gateway's upstream attempts to
    their servers' engines."""
    placement = "deployment"

    def place(self, ex: Execution) -> int:
        raise RuntimeError("the gateway's upstream group places the executions (Interpreter._dispatch_below)")


class GroupSidecarPerReplica(SidecarPerReplica):
    """A sidecar proxy before each engine, behind a gateway's upstream
    group: the gateway places attempts (`GroupSidecars`)."""

    def __init__(self, router, proxies, groups):
        Cluster.__init__(self, router, proxies, groups)
        self.proxy = GroupSidecars(self.proxies, router)
        self.execution_replica = self.proxy.execution_replica


class Interpreter:
    """Carries a layer's actions out and routes attempts through the chain of
    layers: the one interpreter of the simulator (`sim.model.Run`) and the
    live proxy (`validate.proxy.LiveProxy`). A driver subclasses it with one
    handler per action of the proxy, each given the time: `_subscribe(t,
    Subscribe)`, `_dispatch(t, execution)`, `_cancel(t, Cancel)`, `_drop(t,
    Drop)`, `_wake_at(t, Wake)`, and `_timer_at(t, Timer)` for a layer's
    timer; the handlers of the client's actions where it hosts the client
    (`sim.policy.client.ClientLayer`): `_sent(t, Send)` (its attempt goes
    out: the driver sends it into the chain, `_enter`), `_delivered(t,
    Delivered)` and `_given_up(t, GivenUp)` (the call's end, to the
    workload); and the hooks of the routing this class owns: `_refused(t,
    Refuse)` and `_completed(t, Complete)` (the answer to an attempt from the
    top, the client's), `_request(up)` (the (params, prompt length) an
    upstream attempt carries below) and `_orphaned(t, execution)` (an
    execution runs on with nobody waiting). `_chain(layers, bottom)` wires
    the layers between the client and the proxy (`sim.policy.layers`): an
    answer to a layer's upstream attempt goes to that layer, `Send` to the
    layer below, `Leave` is its disconnect there, `RunOn` finds the
    execution that runs on. As each list of actions ends, the length of the
    queue of `proxy` is appended to `proxy_queue_log` as (t, length) if it
    changed."""

    def __init__(self):
        self.proxy_queue_log: list = [(0.0, 0)]     # (t, proxy queue length) at changes
        self.proxy_queues = True            # the proxy may hold a queue: its length is logged
        self._action_stack: list = []       # (t, actions) lists being carried out (see _do)
        self._doing = False                 # _do's loop is running
        self.layers: list = []
        self._below: dict = {}
        self._handlers = {Subscribe: self._subscribe, Cancel: self._cancel, Refuse: self._refuse,
                          Complete: self._complete, Drop: self._drop, Wake: self._wake_at,
                          Send: self._send_below, Leave: self._leave, RunOn: self._run_on, Timer: self._timer_at,
                          Delivered: self._delivered, GivenUp: self._given_up}

    # ---------------------------------------------------------- the chain of layers
    def _chain(self, layers, bottom: tuple, below_proxy: tuple | None = None) -> None:
        """Wire `layers` (from the top) above `bottom`, the (on_attempt,
        on_attempt_left) of what stands below the lowest of them (the
        proxy): `_enter` / `_enter_left` take the top's attempts.
        `below_proxy`, where the stack's upstream group stands below the one
        proxy (`Stack.group_below_proxy`): (its gateway, the (on_attempt,
        on_attempt_left) of the engines below it); the proxy's executions
        then go to that gateway (`_dispatch_below`, `_cancel_below`). Without
        layers every answer is to the top, and every attempt sent the
        client's: `_refused` / `_completed` / `_sent` take them straight from
        the table."""
        self.layers = list(layers)
        entries = [(layer.on_attempt, layer.on_attempt_left) for layer in self.layers] + [bottom]
        self._enter, self._enter_left = entries[0]
        self._below = dict(zip(self.layers, entries[1:]))     # each layer's layer below
        self._above = len(self.layers)                        # the layers above the proxy: self.layers[:_above]
        if below_proxy is not None:
            self._group_below, engines = below_proxy
            self.layers.append(self._group_below)
            self._below[self._group_below] = engines
            self._below_attempts: dict = {}         # execution id -> its ExecutionAttempt, while it is live
        h = self._handlers
        if not self.layers and h[Refuse].__func__ is Interpreter._refuse:
            h[Refuse] = self._refused
        if not self.layers and h[Complete].__func__ is Interpreter._complete:
            h[Complete] = self._completed
        if not self.layers and h[Send].__func__ is Interpreter._send_below:
            h[Send] = self._sent            # every attempt sent is the client's

    def _below_layer(self, layer):
        """The layer below `layer` between the client and the proxy (None: the
        proxy, or the engines below the gateway under the proxy)."""
        k = self.layers.index(layer) + 1
        return self.layers[k] if k < self._above else None

    def _refuse(self, t: float, a: Refuse) -> None:
        ta = type(a.attempt)
        if ta is Upstream:                  # a layer's upstream attempt: the answer goes to that layer
            up = a.attempt
            self._do(t, up.layer.on_refused(t, up, a.status, a.retry_after, a.reason))
        elif ta is ExecutionAttempt:        # the gateway below the proxy answered an execution by itself
            ex = a.attempt.of
            self._below_attempts.pop(ex.id, None)
            self._execution_refused(t, ex)
            self._do(t, self.proxy.on_upstream_refused(t, ex, a.status, a.retry_after, a.reason))
        else:
            self._refused(t, a)

    def _complete(self, t: float, a: Complete) -> None:
        ta = type(a.attempt)
        if ta is Upstream:
            self._do(t, a.attempt.layer.on_complete(t, a.attempt))
        elif ta is ExecutionAttempt:        # through the gateway below the proxy: the execution is complete
            ex = a.attempt.of
            self._below_attempts.pop(ex.id, None)
            self._do(t, self.proxy.on_finished(t, ex))
        else:
            self._completed(t, a)

    def _dispatch_below(self, t: float, ex: Execution) -> None:
        """The proxy dispatches `ex`: it goes to the gateway below the proxy
        as an attempt (`ExecutionAttempt`) carrying the call's request."""
        row = ex.subscribers[0].row if ex.subscribers else -1
        ea = self._below_attempts[ex.id] = ExecutionAttempt(ex, row)
        params, prompt_len = self._request(ea)
        self._do(t, self._group_below.on_attempt(t, ea, params, prompt_len))

    def _cancel_below(self, t: float, a: Cancel) -> None:
        """The proxy cancels an execution: the gateway below it hears the disconnect."""
        ea = self._below_attempts.pop(a.execution.id, None)
        if ea is not None:
            self._do(t, self._group_below.on_attempt_left(t, ea))

    def _execution_refused(self, t: float, ex: Execution) -> None:
        """Hook: the gateway below the proxy answered `ex` with an error (a driver records it)."""

    def _send_below(self, t: float, a: Send) -> None:
        """A layer's upstream attempt goes to the layer below; it carries
        the `row` of the attempt it serves. The client's attempt goes to
        the driver's `_sent`, which sends it into the chain (`_enter`)."""
        up = a.attempt
        if type(up) is not Upstream:
            self._sent(t, a)
            return
        up.row = up.above.row
        params, prompt_len = self._request(up)
        self._do(t, self._below[up.layer][0](t, up, params, prompt_len))

    def _leave(self, t: float, a: Leave) -> None:
        """A layer closed its upstream attempt: the layer below hears the disconnect."""
        up = a.attempt
        self._disconnect(t, up, self._below[up.layer][1])

    def _disconnect(self, t: float, att, left) -> None:
        """`left(t, att)`, the disconnect of `att` at the layer below it; an
        execution left with nobody waiting runs on (`_orphaned`)."""
        ex = att.execution
        self._do(t, left(t, att))
        if ex is not None and ex.orphaned:
            self._orphaned(t, ex)

    def _run_on(self, t: float, a: RunOn) -> None:
        """Nobody waits for a layer's upstream attempt any more: the execution
        serving it (found down the layers below) runs on, orphaned."""
        att = a.attempt
        while att is not None and att.execution is None and type(att) is Upstream:
            below = self._below_layer(att.layer)
            att = below.upstream_of(att) if below is not None else None
        ex = att.execution if att is not None else None
        if ex is not None and ex.live:
            self._orphaned(t, ex)

    def _no_layers(self, t: float, a) -> None:
        raise NotImplementedError(f"{type(self).__name__} hosts no layer between the client and the proxy "
                                  f"({type(a).__name__})")

    _timer_at = _no_layers

    def _no_client(self, t: float, a) -> None:
        raise NotImplementedError(f"{type(self).__name__} hosts no client ({type(a).__name__})")

    _sent = _delivered = _given_up = _no_client

    def _do(self, t: float, actions: list) -> None:
        """Carry out the actions in order. Actions that a handler's own call
        produces (an engine refusal's, which dispatches the next queued
        execution) run next, before the rest of the outer list, as a nested
        call would run them, but from one loop: a long chain of refusals
        does not grow the stack. `_action_stack` holds the lists left to
        carry out once a handler produced actions (empty otherwise)."""
        stack = self._action_stack
        if self._doing:                     # a handler's own actions: the loop running already takes them next
            stack.append((t, iter(actions)))
            return
        if len(actions) == 1 and type(actions[0]) is not Dispatch:
            # one action: no rest of the list to order its handler's own actions against, so they run at
            # once, nested (the loop's bookkeeping less: about 1% of a reference run's instructions, callgrind);
            # not a Dispatch, whose refusal dispatches the next queued execution: that chain stays in the loop
            self._handlers[type(actions[0])](t, actions[0])
        elif actions:
            self._doing = True
            handlers = self._handlers
            k = 0
            for a in actions:
                k += 1
                ta = type(a)
                if ta is Subscribe:
                    self._subscribe(t, a)
                elif ta is Dispatch:
                    self._dispatch(t, a.execution)
                else:
                    handlers[ta](t, a)
                if stack:                   # the handler's own actions, on the stack now, come first
                    if k == len(actions):   # none of this list's left: its end comes after theirs
                        self._do_nested()
                        break
                    stack.insert(0, (t, iter(actions[k:])))
                    self._do_nested()       # each list ends in turn, this one's rest last
                    self._doing = False
                    return
            self._doing = False
        if self.proxy_queues:
            q = self.proxy.queued
            if q != self.proxy_queue_log[-1][1]:
                self.proxy_queue_log.append((t, q))

    def _do_nested(self) -> None:
        """`_do`'s loop once a handler's own actions are on the stack: the
        top list first, then the rest of the lists below it."""
        stack, handlers = self._action_stack, self._handlers
        while stack:
            at, it = stack[-1]
            depth = len(stack)
            for a in it:
                if type(a) is Dispatch:
                    self._dispatch(at, a.execution)
                else:
                    handlers[type(a)](at, a)
                if len(stack) != depth:
                    break                   # the handler's own actions, on the stack now, come first
            else:
                stack.pop()
                if self.proxy_queues:
                    q = self.proxy.queued
                    if q != self.proxy_queue_log[-1][1]:
                        self.proxy_queue_log.append((at, q))


__all__ = ["LAYERS", "Stack", "Cluster", "ProxyBeforeRouter", "SidecarPerReplica", "GroupSidecarPerReplica",
           "ProxyBeforeGroup", "check_group", "Interpreter"]
