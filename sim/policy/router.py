"""The router before a fleet of replicas, as a clock-free policy object.

`Router.pick(call_id, exclude)` names the replica (0..n-1) that gets a
request: an attempt, when each replica has its own proxy (`proxy =
"replica"`: a sidecar before each engine), or an execution, when one proxy
stands before the router (`proxy = "deployment"`). Policies:

- `round-robin`: the replicas in turn.
- `least-outstanding`: the replica holding the fewest requests (`view(r)
  .outstanding`: its engine's waiting, running and arriving requests plus
  its sidecar proxy's queue).
- `least-kv`: the replica with the lowest KV cache usage gauge (`view(r)
  .kv_usage`, vLLM's `kv_cache_usage_perc`: blocks in use over all blocks,
  cached free blocks counted free), as llm-d's KV scorer reads it.
- `prefix-affinity`: a hash of the call's prefix group (the workload's shared
  prompt prefix: one group for every call unless the driver tells groups
  apart), so calls that share a prefix meet its cached blocks.
- `call-affinity`: a hash of the call id for its first request; later ones
  go where the call's previous request went (a retry reaches the replica
  holding its call's execution, also after the router moved one on 503).

Ties go to the lowest replica index after the round-robin pointer's order
(round-robin, least-*), so every pick is deterministic. `ready`, where set
(an autoscaled fleet, `sim.autoscale`), masks the replicas that take
requests: every policy picks among the ready ones only (a hashing policy
walks on from a replica not ready as from one excluded); None: all. `exclude` lists
replicas already tried for this request (the router's own retry on 503:
`retries` more replicas at most); a hashing policy then walks on from its
choice in index order.

`GroupSidecars`: the same, behind a gateway that balances the replicas
itself (its upstream group): each attempt goes where the gateway sent it.

`ReplicaProxies` is the proxy side of `proxy = "replica"`: one
`sim.policy.proxy.Proxy` per replica behind the router, presented to a
driver as one proxy (same methods and actions). A 503 a sidecar answers to
an attempt (its deadline check, or its engine's cap) is retried by the
router on another replica while `retries` allow; the client sees only the
last answer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from .proxy import Attempt, Complete, Execution, Proxy, Refuse

ROUTERS = ("round-robin", "least-outstanding", "least-kv", "prefix-affinity", "call-affinity")
PROXY_PLACEMENTS = ("deployment", "replica")
_MASK = (1 << 64) - 1


def call_key(call_id) -> int:
    """A call id as the integer the hashing policies hash: an int as it is; a
    string (the live proxy's `X-Call-Id`) as its whole number when it is one
    (call "12" goes where call 12 goes in a simulated run), else a fixed
    64-bit digest of its text."""
    if isinstance(call_id, int):
        return call_id
    if call_id.isascii() and call_id.isdigit():
        return int(call_id)
    return int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "little")


def mix64(x: int) -> int:
    """A fixed 64-bit hash of an integer (splitmix64's finaliser): the same
    on every run and platform, unlike Python's `hash` of a string."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "round-robin"
    retries: int = 0              # K: on 503, try up to K other replicas
    proxy: str = "deployment"     # deployment: one proxy before the router; replica: a sidecar before each engine

    def __post_init__(self):
        if self.policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.policy!r}")
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ValueError(f"router_retries must be a whole number >= 0; got {self.retries!r}")
        if self.proxy not in PROXY_PLACEMENTS:
            raise ValueError(f"proxy must be one of {', '.join(PROXY_PLACEMENTS)}; got {self.proxy!r}")


class ReplicaView(NamedTuple):
    """What the router reads of one replica at one moment (from the driver)."""
    outstanding: int = 0          # requests the replica holds
    kv_usage: float = 0.0         # KV cache usage, 0..1


class Router:
    """`view(r)` returns replica r's `ReplicaView` (read only by the
    least-outstanding and least-kv policies); `outstanding(r)` and
    `kv_usage(r)`, where given, read one of its fields alone (default: from
    `view`); least-kv reads a replica's outstanding requests only where its
    KV usage ties the lowest so far. `prefix_group(call_id)` is the call's
    prefix group (default: one group)."""

    def __init__(self, config: RouterConfig, n: int, view: Callable[[int], ReplicaView] | None = None,
                 prefix_group: Callable[[int], int] | None = None, outstanding: Callable[[int], int] | None = None,
                 kv_usage: Callable[[int], float] | None = None):
        if n < 1:
            raise ValueError(f"a fleet needs at least one replica; got {n}")
        self.config = config
        self.n = n
        self.view = view or (lambda r: ReplicaView())
        self.outstanding = outstanding or (lambda r: self.view(r).outstanding)
        self.kv_usage = kv_usage or (lambda r: self.view(r).kv_usage)
        self.prefix_group = prefix_group or (lambda call_id: 0)
        self.next = 0                         # round-robin pointer
        self._orders = [tuple(range(s, n)) + tuple(range(s)) for s in range(n)]    # by pointer
        self.last: dict[int, int] = {}        # call id -> replica of its last request (call-affinity)
        self._pick = {"round-robin": self._round_robin, "least-outstanding": self._least_outstanding,
                      "least-kv": self._least_kv, "prefix-affinity": self._hashed,
                      "call-affinity": self._hashed}[config.policy]
        self._home = {"prefix-affinity": self._prefix_home, "call-affinity": self._call_home}.get(config.policy)
        self._affinity = config.policy == "call-affinity"
        self.ready: list[bool] | None = None   # replicas that take requests (None: all)

    def may_retry(self, tried: Sequence[int]) -> bool:
        """Whether the router retries a request refused (503) on every
        replica in `tried` on one more."""
        if len(tried) > self.config.retries:
            return False
        ready = self.ready
        if ready is None:
            return len(tried) < self.n
        return any(ready[r] and r not in tried for r in range(self.n))

    def pick(self, call_id: int, exclude: Sequence[int] = ()) -> int:
        """The replica for a request of `call_id`, not one in `exclude`."""
        if self.n == 1:
            return 0
        r = self._pick(call_id, exclude)
        if self._affinity:
            self.last[call_id] = r
        return r

    def _order(self, exclude) -> Sequence[int]:
        order = self._orders[self.next]
        ready = self.ready
        if ready is not None:
            return [r for r in order if ready[r] and r not in exclude]
        return [r for r in order if r not in exclude] if exclude else order

    def _round_robin(self, call_id, exclude) -> int:
        r = self.next if not exclude and self.ready is None else self._order(exclude)[0]
        self.next = (r + 1) % self.n
        return r

    def _least(self, key, exclude) -> int:
        best, best_key = -1, None
        for r in self._order(exclude):     # the first of the lowest in pointer order
            k = key(r)
            if best_key is None or k < best_key:
                best, best_key = r, k
        self.next = (best + 1) % self.n
        return best

    def _least_outstanding(self, call_id, exclude) -> int:
        return self._least(self.outstanding, exclude)

    def _least_kv(self, call_id, exclude) -> int:
        """The least of (KV usage, outstanding requests), as `_least`."""
        kv_usage, outstanding = self.kv_usage, self.outstanding
        best, best_kv, best_out = -1, None, None
        for r in self._order(exclude):
            k = kv_usage(r)
            if best_kv is None or k < best_kv:
                best, best_kv, best_out = r, k, None
            elif k == best_kv:
                if best_out is None:
                    best_out = outstanding(best)
                o = outstanding(r)
                if o < best_out:
                    best, best_out = r, o
        self.next = (best + 1) % self.n
        return best

    def _walk(self, home: int, exclude) -> int:
        n, ready = self.n, self.ready
        for k in range(n):
            r = (home + k) % n
            if r not in exclude and (ready is None or ready[r]):
                return r
        raise ValueError("every replica is excluded")

    def home(self, call_id: int) -> int | None:
        """The replica `pick(call_id)` names now when nothing is excluded,
        for the hashing policies, whose pick depends on the call alone (and,
        for call-affinity, on where its previous request went); None for the
        others, whose pick depends on the moment it is made. No state
        changes."""
        if self.n == 1:
            return 0
        return self._home(call_id) if self._home is not None else None

    def _prefix_home(self, call_id) -> int:
        return mix64(self.prefix_group(call_id)) % self.n

    def _call_home(self, call_id) -> int:
        home = self.last.get(call_id)
        return mix64(call_key(call_id)) % self.n if home is None else home

    def _hashed(self, call_id, exclude) -> int:
        home = self._home(call_id)
        return self._walk(home, exclude) if exclude or self.ready is not None else home


class _Routed:
    __slots__ = ("index", "params", "prompt_len", "tried")

    def __init__(self, index: int, params: tuple, prompt_len: int):
        self.index = index
        self.params = params
        self.prompt_len = prompt_len
        self.tried: list[int] = []


class _Executions:
    """The sidecars' live executions by id, as one mapping (`get`)."""

    def __init__(self, owner: "ReplicaProxies"):
        self.owner = owner

    def get(self, ex_id: int, default=None):
        reps = self.owner.execution_replica
        if not 0 <= ex_id < len(reps):
            return default
        return self.owner.proxies[reps[ex_id]].executions.get(ex_id, default)


class ReplicaProxies:
    """Sidecar proxies behind a router, driven as one proxy. Execution ids
    are drawn from one sequence across the sidecars, in creation order.
    `landed[i]` is the replica the i-th attempt (in the order `on_attempt`
    saw them) was last sent to; `execution_replica[id]` is an execution's
    replica; `rerouted` counts the router's retries."""

    def __init__(self, proxies: Sequence[Proxy], router: Router):
        self.proxies = list(proxies)
        self.router = router
        self.landed: list[int] = []
        self.execution_replica: list[int] = []   # by execution id
        self.executions = _Executions(self)
        self.rerouted = 0
        self._open: dict[int, _Routed] = {}      # id(attempt) -> its routing state, while open
        self._may_queue = any(p.config.proxy_cap is not None for p in self.proxies)

    @property
    def queued(self) -> int:
        return sum(p.queued for p in self.proxies) if self._may_queue else 0

    def replica_of(self, ex: Execution) -> int:
        return self.execution_replica[ex.id]

    # ---------------------------------------------------------- attempts
    def on_attempt(self, t: float, attempt: Attempt, params: tuple = (), prompt_len: int = 0) -> list:
        st = _Routed(len(self.landed), params, prompt_len)
        self.landed.append(-1)
        self._open[id(attempt)] = st
        return self._forward(t, attempt, st)

    def _forward(self, t: float, attempt: Attempt, st: _Routed) -> list:
        return self._send_to(t, attempt, st, self.router.pick(attempt.call_id, st.tried))

    def _send_to(self, t: float, attempt: Attempt, st: _Routed, r: int) -> list:
        """The attempt goes to replica r's sidecar."""
        st.tried.append(r)
        self.landed[st.index] = r
        p = self.proxies[r]
        reps = self.execution_replica
        k = p._next_id = len(reps)                  # one id sequence across the sidecars
        out = p.on_attempt(t, attempt, st.params, st.prompt_len)
        if p._next_id > k:
            reps.extend([r] * (p._next_id - k))
        return self._after(t, out)

    def _after(self, t: float, out: list) -> list:
        """Retry the attempts a sidecar refused with 503 on another replica
        while the router allows; forget attempts that are answered."""
        res = None                            # the answer, once it differs from `out`
        for i, a in enumerate(out):
            ta = type(a)
            if ta is Refuse:
                st = self._open.get(id(a.attempt))
                if a.status == 503 and st is not None and self.router.may_retry(st.tried):
                    att = a.attempt
                    att.open, att.execution, att.attached = True, None, False
                    self.rerouted += 1
                    if res is None:
                        res = out[:i]
                    res.extend(self._forward(t, att, st))
                    continue
                self._open.pop(id(a.attempt), None)
            elif ta is Complete:
                self._open.pop(id(a.attempt), None)
            if res is not None:
                res.append(a)
        return out if res is None else res

    def on_attempt_left(self, t: float, attempt: Attempt) -> list:
        st = self._open.pop(id(attempt), None)
        if st is None:                        # pragma: no cover - the driver closes open attempts only
            return []
        return self._after(t, self.proxies[st.tried[-1]].on_attempt_left(t, attempt))

    # -------------------------------------------------------- executions
    def on_dispatched(self, t: float, ex: Execution) -> None:
        self.proxies[self.execution_replica[ex.id]].on_dispatched(t, ex)

    def on_engine_refused(self, t: float, ex: Execution) -> list:
        return self._after(t, self.proxies[self.execution_replica[ex.id]].on_engine_refused(t, ex))

    def on_wake(self, t: float, ex: Execution) -> list:
        return self._after(t, self.proxies[self.execution_replica[ex.id]].on_wake(t, ex))

    def on_finished(self, t: float, ex: Execution) -> list:
        return self._after(t, self.proxies[self.execution_replica[ex.id]].on_finished(t, ex))


class GroupSidecars(ReplicaProxies):
    """The sidecars behind a gateway's upstream group (`sim.policy.upstream`):
    each attempt goes to the server its gateway picked (`attempt.server`),
    never elsewhere (the router is the gateway's group; it retries itself)."""

    def _forward(self, t: float, attempt: Attempt, st: _Routed) -> list:
        return self._send_to(t, attempt, st, attempt.server)
