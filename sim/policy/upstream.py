"""An upstream group: a gateway (nginx, HAProxy, Envoy, LiteLLM) in front
of N engines, balancing them itself, as a clock-free state machine.

`UpstreamGroup(policy, n, random)` is the group of a gateway's
`GatewayPolicy` (`upstream_servers = n`): `pick(t, call_id, tried)` names
the server of an upstream attempt (None: no server is left, and the
gateway answers by itself with `no_live_status`), `sent(s)` / `closed(s)`
count its connections, `result(t, s, outcome)` tells it how an attempt
ended (`OK`, `FAIL`, `CLOSED`: the client's disconnect passed on,
`CONNECT`: the connection was refused, the server's replica not up) and
returns whether that took the server out of rotation. `up(s)`, where
given (an autoscaled fleet's replicas), says whether server s's replica is
up now: the gateway's attempt to one that is not is a connection error
(`CONNECT`); HAProxy's active checks of it fail. Every input carries
its time; the rules that depend on periodic checks (HAProxy's active
checks, Envoy's ejection sweep) are evaluated lazily at the next input, on
checks at whole multiples of `check_interval_s` from time 0, so the group
asks for no timer.

Balancing (`balance`, docs/presets.md cites each preset's):

- `round-robin`: the servers in turn, skipping those out of rotation and,
  for a retry to another server, those tried (nginx's smooth weighted round
  robin with equal weights, its tried bitmap; HAProxy's roundrobin; Envoy's
  ROUND_ROBIN). nginx lowers a failed server's effective weight for a while
  (`effective_weight -= weight / max_fails`): not modelled.
- `least-conn`: the fewest open connections, ties in round-robin order
  (nginx least_conn, HAProxy leastconn, LiteLLM least-busy).
- `least-request`: Envoy's LEAST_REQUEST with equal weights: the fewer
  active requests of two hosts drawn at random (choice_count 2).
- `random`: a uniform draw (LiteLLM's simple-shuffle without weights).
- `hash`: a hash of the call id (`mix64`, as the router's call affinity),
  passing on to the next server when it is out (nginx's `hash` re-hashes
  up to 20 times, then falls back to round robin: not modelled).

A retry's server (`retry_server`): `other` (nginx: a server not tried yet
for this request), `same` (HAProxy without `option redispatch`: the server
of the previous try while it is in rotation), `any` (Envoy without a retry
host predicate, LiteLLM: a fresh pick).

Passive health (`health`; off where `fails_to_mark_down` is None), one
rule per software:

- `nginx` (ngx_http_upstream_round_robin.c, 1.22.1): a failure counts
  `fails` and sets `checked = accessed = now`; a server with
  `fails >= max_fails` (`fails_to_mark_down`) is skipped while
  `now - checked <= fail_timeout` (`down_for_s`: the window in which
  failures are counted and the time out at once); the first pick after
  that sets `checked = now` (the one request that probes it); a success
  whose server was picked since its last failure (`accessed < checked`)
  resets `fails`. A failure is a timeout, a connection error or a status
  that `proxy_next_upstream` lists (the gateway's `retry_on`): another
  status, and a client's disconnect, end as a success (a refused
  connection is an `error`: a failure). Counts are those of
  one worker process (or a `zone` shared by the workers).
- `haproxy` (configuration.txt 2.6 `observe layer7`, `error-limit`,
  `on-error`, `rise`, `fall`, `inter`; src/check.c `__health_adjust`,
  `set_server_check_status`): `fails_to_mark_down` consecutive errors (500,
  502, 503, 504 or a timeout) trigger `on_error`: `fail-check` a failed
  check (health one step down, to 0 below `rise`: down after `fall` of
  them in a row), `sudden-death` a pre-fatal one, `mark-down` down at once;
  active checks every `check_interval_s`, every one assumed good (vLLM
  answers /health while it is overloaded), each one step up, the whole way
  up (`rise + fall - 1`) once at `rise` (a server down comes back after
  `rise` of them), and each clearing the consecutive errors. A connection refused is an
  error in either observe mode (src/check.c analyze_statuses:
  HANA_STATUS_L4_ERR); a check of a server whose replica is not up
  fails (`up`), so such a server goes down after `fall` checks and comes
  back `rise` checks after its replica is up.
- `envoy` (outlier_detection.proto): `fails_to_mark_down` consecutive 5xx
  (a timeout or a connect failure counts as one: local-origin errors are
  not split by default)
  eject a host for `down_for_s` x its ejections (capped at
  `max_down_for_s`), back at the first sweep (`check_interval_s`) after
  that; no ejection beyond `max_ejection_percent` of the hosts, except the
  first; while fewer than `panic_threshold_percent` of the hosts are
  healthy, every host is picked from, ejected or not (panic routing).
- `litellm` (router_utils/cooldown_handlers.py): within each minute, a
  deployment whose failures exceed `failure_rate` of its requests, once it
  has `fails_to_mark_down` requests, is cooled for `down_for_s`; a 429
  cools it at once; a group of one is never cooled. A refused connection
  is an APIConnectionError, status 500.
"""
from __future__ import annotations

import math

from .router import call_key, mix64

OK, FAIL, CLOSED, CONNECT = "ok", "fail", "closed", "connect"
INF = math.inf


class _Rule:
    """A passive-health rule over n servers: `available(s, t)`, `picked(s,
    t)`, `result(t, s, outcome, status)` -> the time the server comes back
    when this result took it out (None otherwise). `up(s)`: whether server
    s's replica is up (None: always); a rule whose own checks take a server
    out or bring it back tells `spell(s, start, end)` (end None: back at
    `start`)."""

    def __init__(self, gw, n: int, up=None, spell=None):
        self.gw = gw
        self.n = n
        self.up = up
        self.spell = spell

    def available(self, s: int, t: float) -> bool:
        return True

    def picked(self, s: int, t: float) -> None:
        pass

    def panic(self, t: float) -> bool:
        return False


class Nginx(_Rule):
    def __init__(self, gw, n, up=None, spell=None):
        super().__init__(gw, n, up, spell)
        self.fails = [0] * n
        self.checked = [-INF] * n
        self.accessed = [-INF] * n

    def available(self, s, t):
        return not (self.fails[s] >= self.gw.fails_to_mark_down and t - self.checked[s] <= self.gw.down_for_s)

    def picked(self, s, t):
        if t - self.checked[s] > self.gw.down_for_s:
            self.checked[s] = t

    def result(self, t, s, outcome, status=None):
        if outcome == FAIL or outcome == CONNECT:
            self.fails[s] += 1
            self.accessed[s] = self.checked[s] = t
            if self.fails[s] >= self.gw.fails_to_mark_down:
                return t + self.gw.down_for_s
        elif self.accessed[s] < self.checked[s]:
            self.fails[s] = 0
        return None


class Haproxy(_Rule):
    def __init__(self, gw, n, up=None, spell=None):
        super().__init__(gw, n, up, spell)
        self.top = gw.rise + gw.fall - 1
        self.health = [self.top] * n        # up while >= rise
        self.errors = [0] * n               # consecutive errors observed
        self.tick = [0] * n                 # checks applied up to this one

    def _catch_up(self, s, t):
        k = math.floor(t / self.gw.check_interval_s)
        m = k - self.tick[s]
        if m > 0:
            # each good check: one step up, and at `rise` the whole way up ("OK now"); it also clears the
            # consecutive errors (src/check.c set_server_check_status, CHK_RES_PASSED)
            self.tick[s] = k
            if self.up is None:
                h = self.health[s] + m
                self.health[s] = self.top if h >= self.gw.rise else h
                self.errors[s] = 0
            else:
                self._checks(s, k, m, self.up(s))

    def _checks(self, s, k, m, good):
        """The checks k-m+1..k of server s, all good or all failed (its
        replica up or not), with the spells out they begin or end."""
        rise, iv = self.gw.rise, self.gw.check_interval_s
        h = self.health[s]
        if good:
            self.health[s] = self.top if h + m >= rise else h + m
            self.errors[s] = 0
            if h < rise <= self.health[s]:
                self.spell(s, (k - m + rise - h) * iv, None)      # the check that brought it back
            return
        for j in range(1, min(m, self.top + 1) + 1):
            was = self.health[s]
            self._failed_check(s)
            if was >= rise > self.health[s]:
                self.spell(s, (k - m + j) * iv, INF)             # down until its replica is up
        if self.health[s] < rise:
            self.spell(s, k * iv, INF)                          # still out: its spell goes on

    def available(self, s, t):
        self._catch_up(s, t)
        return self.health[s] >= self.gw.rise

    def _failed_check(self, s):
        if self.health[s] > self.gw.rise:
            self.health[s] -= 1
        else:
            self.health[s] = 0

    def result(self, t, s, outcome, status=None):
        if outcome == CLOSED:
            return None
        self._catch_up(s, t)
        if outcome == OK:
            self.errors[s] = 0
            return None
        self.errors[s] += 1
        if self.errors[s] < self.gw.fails_to_mark_down:
            return None
        self.errors[s] = 0
        mode, rise = self.gw.on_error, self.gw.rise
        if mode == "sudden-death":
            self.health[s] = min(self.health[s], rise + 1)
            self._failed_check(s)
        elif mode == "fail-check":
            self._failed_check(s)
        elif mode == "mark-down":
            self.health[s] = 0
        if self.health[s] < rise:
            # back after good checks up to `rise`: the checks at the next multiples of the interval
            return (math.floor(t / self.gw.check_interval_s) + rise - self.health[s]) * self.gw.check_interval_s
        return None


class Envoy(_Rule):
    def __init__(self, gw, n, up=None, spell=None):
        super().__init__(gw, n, up, spell)
        self.consecutive = [0] * n
        self.until = [-INF] * n             # ejected until this sweep
        self.ejections = [0] * n            # the ejection time's multiplier
        self.back_at = [0.0] * n            # when it last came back

    def available(self, s, t):
        return t >= self.until[s]

    def ejected(self, t):
        return sum(1 for u in self.until if t < u)

    def panic(self, t):
        healthy = self.n - self.ejected(t)
        return 100.0 * healthy / self.n < self.gw.panic_threshold_percent

    def result(self, t, s, outcome, status=None):
        if outcome == CLOSED:
            return None
        if outcome == OK:
            self.consecutive[s] = 0
            return None
        self.consecutive[s] += 1
        if self.consecutive[s] < self.gw.fails_to_mark_down or t < self.until[s]:
            return None
        ejected = self.ejected(t)
        if ejected and 100.0 * (ejected + 1) / self.n > self.gw.max_ejection_percent:
            return None                     # max_ejection_percent: "but will eject at least one host"
        self.consecutive[s] = 0
        iv = self.gw.check_interval_s
        sweeps = math.floor(t / iv) - math.floor(self.back_at[s] / iv)     # healthy sweeps: one step down each
        self.ejections[s] = max(0, self.ejections[s] - max(0, sweeps)) + 1
        cap = max(self.gw.down_for_s, self.gw.max_down_for_s if self.gw.max_down_for_s is not None else INF)
        end = t + min(self.gw.down_for_s * self.ejections[s], cap)
        self.until[s] = self.back_at[s] = math.ceil(end / iv) * iv      # the first sweep after it
        return self.until[s]


class Litellm(_Rule):
    COOLS = frozenset((429, 408, 401, 404))     # and every 5xx: cooldown_handlers._is_cooldown_required

    def __init__(self, gw, n, up=None, spell=None):
        super().__init__(gw, n, up, spell)
        self.minute = [-1] * n
        self.fails = [0] * n
        self.ok = [0] * n
        self.until = [-INF] * n

    def available(self, s, t):
        return t >= self.until[s]

    def _bucket(self, s, t):
        m = math.floor(t / 60.0)
        if m != self.minute[s]:
            self.minute[s], self.fails[s], self.ok[s] = m, 0, 0

    def result(self, t, s, outcome, status=None):
        if outcome == CLOSED:
            return None
        self._bucket(s, t)
        if outcome == OK:
            self.ok[s] += 1
            return None
        self.fails[s] += 1
        if status is None:              # a timeout: litellm.Timeout, 408; a refused connection: APIConnectionError, 500
            status = 500 if outcome == CONNECT else 408
        if not (status in self.COOLS or status >= 500) or self.n == 1 or t < self.until[s]:
            return None
        total = self.fails[s] + self.ok[s]
        if status == 429 or (self.fails[s] / total > self.gw.failure_rate and total >= self.gw.fails_to_mark_down):
            self.until[s] = t + self.gw.down_for_s
            return self.until[s]
        return None


RULES = {"nginx": Nginx, "haproxy": Haproxy, "envoy": Envoy, "litellm": Litellm}


class UpstreamGroup:
    """The servers of one gateway (see the module docstring). `random()`
    draws in [0, 1) (the balancers that draw); `up(s)`, where given,
    whether server s's replica is up now. `out` logs each spell out of
    rotation as [server, start, end] (end: when it is back, given no later
    failure), `not_up` those that began while the server's replica was not
    up; `on_out()` is called as each begins; `panic_routed` counts picks
    made in Envoy's panic mode."""

    def __init__(self, gw, n: int, random, up=None):
        self.gw = gw
        self.n = n
        self.random = random
        self.up = up
        self.conns = [0] * n
        self.next = 0
        self.rule = (RULES[gw.health](gw, n, up, self._check_spell) if gw.fails_to_mark_down    # 0 or None: off
                     else None)                                                                 # (nginx max_fails=0)
        self.out: list = []
        self.not_up: list = []
        self.on_out = None
        self._open_spell = [None] * n       # the server's last spell in `out`
        self.panic_routed = 0
        self._pick = {"round-robin": self._round_robin, "least-conn": self._least_conn, "hash": self._hash,
                      "random": self._random, "least-request": self._least_request}[gw.balance]

    # ------------------------------------------------------------ picking
    def pick(self, t: float, call_id, tried: list) -> int | None:
        """The server of an upstream attempt of `call_id` whose earlier
        tries went to `tried` (None: no server is left)."""
        rule = self.rule
        rs = self.gw.retry_server
        if tried and rs == "same":
            s = tried[-1]
            if rule is None or rule.available(s, t):
                if rule is not None:
                    rule.picked(s, t)
                return s
        exclude = tried if tried and rs == "other" else ()
        if rule is None:
            cands = [s for s in range(self.n) if s not in exclude] if exclude else range(self.n)
        else:
            cands = [s for s in range(self.n) if s not in exclude and rule.available(s, t)]
            if rule.panic(t):
                self.panic_routed += 1
                cands = [s for s in range(self.n) if s not in exclude]
        if not cands:
            return None
        s = self._pick(call_id, cands)
        if rule is not None:
            rule.picked(s, t)
        return s

    def _round_robin(self, call_id, cands) -> int:
        n, nxt = self.n, self.next
        s = min(cands, key=lambda r: (r - nxt) % n)
        self.next = (s + 1) % n
        return s

    def _least_conn(self, call_id, cands) -> int:
        n, nxt, conns = self.n, self.next, self.conns
        s = min(cands, key=lambda r: (conns[r], (r - nxt) % n))
        self.next = (s + 1) % n
        return s

    def _hash(self, call_id, cands) -> int:
        home = mix64(call_key(call_id)) % self.n
        n = self.n
        return min(cands, key=lambda r: (r - home) % n)

    def _random(self, call_id, cands) -> int:
        cands = list(cands)
        return cands[min(int(self.random() * len(cands)), len(cands) - 1)]

    def _least_request(self, call_id, cands) -> int:
        a, b = self._random(call_id, cands), self._random(call_id, cands)
        return b if self.conns[b] < self.conns[a] else a

    # ------------------------------------------------------------ connections and results
    def sent(self, s: int) -> None:
        self.conns[s] += 1

    def closed(self, s: int) -> None:
        self.conns[s] -= 1

    def result(self, t: float, s: int, outcome: str, status: int | None = None) -> bool:
        """An attempt on server s ended (`OK`, `FAIL` with its status or
        None for a timeout, `CLOSED`, `CONNECT`); True when it took s out of
        rotation (a spell out begins: `out`)."""
        if self.rule is None:
            return False
        back = self.rule.result(t, s, outcome, status)
        return back is not None and self._spell(s, t, back, outcome == CONNECT)

    def _spell(self, s: int, t: float, back: float, not_up: bool) -> bool:
        """Server s is out from t until `back`: a new spell (True), or the
        one it is in goes on (a late answer)."""
        spell = self._open_spell[s]
        if spell is not None and spell[2] >= t:
            spell[2] = max(spell[2], back)
            return False
        spell = [s, t, back]
        self.out.append(spell)
        self._open_spell[s] = spell
        if not_up:
            self.not_up.append(spell)
        if self.on_out is not None:
            self.on_out()
        return True

    def _check_spell(self, s: int, t: float, end: float | None) -> None:
        """The rule's own checks took s out at t until `end` (its replica
        not up), or (`end` None) brought it back at t."""
        if end is not None:
            self._spell(s, t, end, True)
            return
        spell = self._open_spell[s]
        if spell is not None and spell[2] > t:
            spell[2] = max(t, spell[1])

    def spells(self, end: float) -> list:
        """The spells out of rotation, each [server, start, end] cut at `end`."""
        return [[s, a, min(b, end)] for s, a, b in self.out if a <= end]

    def record(self, end: float, burst_end: float | None = None) -> dict:
        """What the group did over a run ending at `end`: spells out of
        rotation, when the first began (s from the run's start; None: no
        spell), server-seconds out, servers out at the end, and with the
        burst's end the servers out then and when the last came back."""
        spells = self.spells(end)
        out = {"servers": self.n, "balance": self.gw.balance,
               "health": self.gw.health if self.rule is not None else "off",
               "marked_down": len(self.out), "out_s": sum(b - a for _, a, b in spells),
               "first_marked_down_s": min((a for _, a, _ in spells), default=None),
               "out_at_end": sorted({s for s, _, b in self.out if b > end}),
               "panic_routed": self.panic_routed}
        if burst_end is not None:
            at = sorted({s for s, a, b in self.out if a <= burst_end < b})
            later = [b for _, a, b in self.out if b > burst_end]
            out["out_at_burst_end"] = at
            out["back_after_burst_s"] = (min(max(later), end) - burst_end) if later else 0.0
        if self.up is not None:
            cut = [(a, min(b, end)) for _, a, b in self.not_up if a <= end]
            out["not_up"] = {"marked_down": len(self.not_up), "out_s": sum(b - a for a, b in cut)}
        return out


__all__ = ["UpstreamGroup", "RULES", "OK", "FAIL", "CLOSED", "CONNECT"]
