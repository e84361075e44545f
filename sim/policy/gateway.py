"""A gateway layer (nginx, HAProxy, Envoy, LiteLLM's proxy, an inference
gateway) between the client and the proxy, as a clock-free layer object: the
settings of its preset (`sim.policy.presets`) run by its `RetryPolicy` (through
`Retrier`) and its `GatewayPolicy` (docs/presets.md cites each value).

For each attempt from the layer above (a `Relay`):

- shedding (`shed = "sheddable"`): a call of priority below 0 is refused
  with `shed_status` while no engine has capacity (`SaturationRule` over the
  run's view of the engines);
- the connection limit: at most `max_connections` upstream attempts open;
  the rest wait in a queue (at most `max_queue`, else refused with
  `queue_status`, reason `queue_full`) and are refused with `queue_status`
  once they waited `queue_timeout_s` (or the call's `deadline_s` passed),
  reason `queue_timeout`; a queue is served first in, first out as
  connections free;
- an upstream attempt goes below (`Send`), given up after the per-attempt
  `timeout_s` (or at `deadline_s` from the first): the gateway's upstream
  timeout. The upstream attempt is then closed (`Leave`: the layer below
  hears a disconnect) where `passes_disconnect`, else left running
  (`RunOn`; its connection stays counted until its answer comes);
- a timeout or a refusal from below is retried per the retry-on set, the
  tries and the backoff (`Retrier`; a gateway that retries only on another
  server, nginx, has `upstream_servers` tries); what is not retried is
  answered to the layer above: the timeout with `timeout_status` (504,
  reason `upstream_timeout`), a refusal with its own status, Retry-After
  and reason; a response is passed up (`Complete`);
- the layer above disconnecting (`on_attempt_left`) closes the upstream
  attempt (`Leave`) where `passes_disconnect`, else lets it run on
  (`RunOn`); a queued one leaves the queue where `passes_disconnect_queued`,
  else it is sent when its turn comes with nobody waiting; a retry waiting
  its backoff is not sent.

A gateway of one upstream server leaves the placement to the cluster's
router and marks no server down. A gateway whose `upstream_servers` is
more than one (`GroupGateway`) balances a fleet's replicas itself, its
upstream group (`sim.policy.upstream.UpstreamGroup`): each upstream
attempt goes to the server the group picks (`Upstream.server`), each
answer, timeout and disconnect is told to the group's passive-health rule,
and when no server is left the gateway answers by itself with
`no_live_status` (reason `no_live_upstream`). Over an autoscaled fleet
(`LayerContext.up`) the group lists every replica the autoscaler may
bring up: an upstream attempt to a server whose replica is not up reaches
nothing; it is a connection error (`CONNECT_ERROR`, told to the
passive-health rule), retried where `retry_on` has `connect_error`, else
answered with `connect_error_status` (reason `connect_error`). `counts`
keeps what the gateway did (`COUNTS`, for a group `GROUP_COUNTS`, over an
autoscaled fleet `NOT_UP_COUNTS` too)."""
from __future__ import annotations

import math
from collections import deque

from .layers import LayerKind, Leave, RunOn, Send, Timer, Upstream, register
from .presets import PRESETS, policies, preset
from .proxy import Attempt, Complete, Refuse
from .retry import CONNECT_ERROR, STATUS, TIMEOUT, Admit, Failure, Retrier, RetryAt
from .upstream import CLOSED, CONNECT, FAIL, OK, UpstreamGroup

INF = math.inf
# what a gateway counts: upstream attempts sent, retries, its own refusals by reason, disconnects passed on,
# upstream attempts left running
COUNTS = ("upstream_attempts", "retries", "upstream_timeout", "queue_full", "queue_timeout", "shed",
          "disconnects_passed", "run_on")


class Relay:
    """One attempt from the layer above and what the gateway does with it:
    `state` queued | upstream | backoff | done; `listening` while the layer
    above waits for the answer."""
    __slots__ = ("above", "retries", "state", "upstream", "listening", "expires", "retry_at")

    def __init__(self, above: Attempt, retries):
        self.above = above
        self.retries = retries          # the Retrier's state of this attempt's upstream tries
        self.state = "new"
        self.upstream: Upstream | None = None
        self.listening = True
        self.expires = INF              # queued: refused at this time
        self.retry_at = INF             # backoff: sent again at this time


class Gateway:
    """A gateway of `settings` (a preset's effective settings). `random()`
    draws in [0, 1) for the backoff's jitter; `pods(t)` and `priority(call)`
    feed the shedding (None: nothing is shed)."""
    kind = "gateway"
    relay_class = Relay

    def __init__(self, settings: dict, random, pods=None, priority=None):
        retry, gw = policies(settings)
        if gw is None:
            raise ValueError(f"a {settings.get('kind')} layer is not a gateway")
        self.settings = settings
        self.policy = gw
        self.retrier = Retrier(retry, random, servers=gw.servers_for_retries)
        self.pods = pods
        self.priority = priority
        self.relays: dict = {}          # attempt from above -> its Relay, until answered
        self.queue: deque = deque()     # may hold relays no longer queued, skipped when met
        self.queued = 0                 # relays waiting in the queue
        self.active = 0                 # upstream attempts open (left running ones included)
        self.retrying = 0               # relays with a retry scheduled or sent, not yet answered
        self.tries: dict = {}           # call id -> upstream attempts sent (the number of the next one)
        self.counts = dict.fromkeys(COUNTS, 0)
        self.may_queue = gw.max_connections is not None     # may hold attempts in its queue (`queued`)
        self.reads_engines = gw.shed != "off" and pods is not None      # reads `pods(t)` as attempts arrive

    # ------------------------------------------------------------ from above
    def on_attempt(self, t: float, attempt: Attempt, params: tuple = (), prompt_len: int = 0) -> list:
        gw = self.policy
        if gw.shed != "off" and self.pods is not None:
            prio = self.priority(attempt.call_id) if self.priority is not None else 0
            shed = gw.sheds(prio, self.pods(t))
            if shed is not None:
                self.counts["shed"] += 1
                attempt.open = False
                return [Refuse(attempt, shed.status, None, shed.reason)]
        r = self.relay_class(attempt, self.retrier.start(t))
        self.relays[attempt] = r
        out: list = []
        self._admit(t, r, out)
        return out

    def on_attempt_left(self, t: float, attempt: Attempt) -> list:
        """The layer above closed its attempt (its timeout, or its own client's disconnect passed on)."""
        attempt.open = False
        r = self.relays.get(attempt)
        if r is None:
            return []
        r.listening = False
        out: list = []
        gw = self.policy
        if r.state == "queued":
            if gw.passes_disconnect_queued:
                self.queued -= 1
                self._finish(r)
        elif r.state == "upstream":
            up = r.upstream
            if gw.passes_disconnect:
                r.upstream = None
                self._finish(r)
                self.counts["disconnects_passed"] += 1
                out.append(Leave(up))
                self._release(t, up, out)
            else:
                self._run_on(up, out)
        else:                           # backoff: the retry is not sent
            self._finish(r)
        return out

    # ------------------------------------------------------------ from below
    def on_complete(self, t: float, up: Upstream) -> list:
        """The layer below delivered the response of `up`."""
        out: list = []
        r = self._relay_of(up)
        if r is not None:
            r.upstream = None
            self.retrier.on_success(r.retries, t)
            self._answer(r, Complete(r.above), out)
        self._release(t, up, out)
        return out

    def on_refused(self, t: float, up: Upstream, status: int, retry_after: float | None = None,
                   reason: str = "") -> list:
        """The layer below refused `up` with `status` (and a Retry-After in seconds)."""
        out: list = []
        r = self._relay_of(up)
        if r is not None:
            r.upstream = None
            self._failed(t, r, Failure(STATUS, t, status, retry_after_s=retry_after),
                         Refuse(r.above, status, retry_after, reason), out)
        self._release(t, up, out)
        return out

    def on_timer(self, t: float, token) -> list:
        """A time the gateway asked for: an upstream attempt's timeout, a
        queued relay's expiry, a relay's retry."""
        out: list = []
        if type(token) is Upstream:
            up = token
            r = self._cut_by_timeout(up)
            if r is None:
                return out
            r.upstream = None
            if self.policy.passes_disconnect:
                out.append(Leave(up))
                self._release(t, up, out)
            else:
                self._run_on(up, out)
            if not r.listening:
                self._finish(r)
                return out
            self.counts["upstream_timeout"] += 1
            gw = self.policy
            answer = Refuse(r.above, gw.timeout_status, None, "upstream_timeout")
            if up.answering:                # the answer's status and header went above: the stream is cut, not retried
                self._answer(r, answer, out)
            else:
                self._failed(t, r, Failure(TIMEOUT, t), answer, out)
        elif token.state == "queued" and t >= token.expires:
            self.queued -= 1
            self.counts["queue_timeout"] += 1
            self._answer(token, Refuse(token.above, self.policy.queue_status, None, "queue_timeout"), out)
        elif token.state == "backoff" and t >= token.retry_at:
            self._admit(t, token, out)
        return out

    def upstream_of(self, attempt: Attempt) -> Upstream | None:
        """The upstream attempt open now for an attempt from above (None: none)."""
        r = self.relays.get(attempt)
        return r.upstream if r is not None else None

    # ------------------------------------------------------------ inside
    def _relay_of(self, up: Upstream) -> Relay | None:
        """The relay waiting for `up`'s answer (None: nobody waits for it)."""
        r = self.relays.get(up.above)
        return r if r is not None and r.upstream is up else None

    def _cut_by_timeout(self, up: Upstream) -> Relay | None:
        """The relay whose upstream attempt `up` its timeout cuts now; None
        where it was answered, was left running with nobody waiting, or is a
        stream whose tokens keep coming under a timeout between reads (no
        silence reaches it)."""
        r = self._relay_of(up)
        if r is None or not up.open or (up.streaming and self.policy.timeout_between_reads):
            return None
        return r

    def _admit(self, t: float, r: Relay, out: list) -> None:
        gw = self.policy
        a = gw.admit(self.active, self.queued)
        if type(a) is Admit:
            if a.action == "dispatch":
                self._forward(t, r, out)
                return
            r.state = "queued"
            self.queue.append(r)
            self.queued += 1
            p = self.retrier.policy
            r.expires = gw.queue_expires_at(t)
            if p.deadline_s is not None:
                r.expires = min(r.expires, r.retries.started_at + p.deadline_s)
            if r.expires < INF:
                out.append(Timer(r.expires, self, r))
            return
        self.counts[a.reason] += 1
        self._answer(r, Refuse(r.above, a.status, None, a.reason), out)

    def _forward(self, t: float, r: Relay, out: list) -> None:
        call = r.above.call_id
        n = self.tries.get(call, 0)
        self.tries[call] = n + 1
        end = self.retrier.send(r.retries, t)
        deadline = min(end, r.above.deadline) if self.policy.passes_disconnect else end
        up = Upstream(call, n, deadline, self, r.above)
        r.upstream, r.state = up, "upstream"
        self.active += 1
        self.counts["upstream_attempts"] += 1
        out.append(Send(up))
        if end < INF:
            out.append(Timer(end, self, up))
        if not r.listening:             # queued when the layer above left, and not dropped
            self._run_on(up, out)

    def _run_on(self, up: Upstream, out: list) -> None:
        if not up.ran_on:
            up.ran_on = True
            self.counts["run_on"] += 1
            out.append(RunOn(up))

    def _failed(self, t: float, r: Relay, failure: Failure, answer, out: list) -> None:
        """The upstream attempt of `r` failed: a retry, or `answer` to the layer above."""
        if not r.listening:
            self._finish(r)
            return
        d = self.retrier.on_failure(r.retries, failure, self.active, self.queued, self.retrying)
        if type(d) is RetryAt:
            if r.retries.retries == 1:
                self.retrying += 1
            self.counts["retries"] += 1
            r.state, r.retry_at = "backoff", d.at
            out.append(Timer(d.at, self, r))
        else:
            self._answer(r, answer, out)

    def _answer(self, r: Relay, answer, out: list) -> None:
        if r.listening:
            r.above.open = False
            out.append(answer)
        self._finish(r)

    def _finish(self, r: Relay) -> None:
        if r.state != "done":
            if r.retries.retries > 0:
                self.retrying -= 1
            r.state = "done"
            self.relays.pop(r.above, None)

    def _release(self, t: float, up: Upstream, out: list) -> None:
        """The connection of `up` is closed: the queue's first relays go up while connections allow."""
        if up.closed:
            return
        up.closed = True
        up.open = False
        self.active -= 1
        cap = self.policy.max_connections
        q = self.queue
        while self.queued and (cap is None or self.active < cap):
            r = q.popleft()
            if r.state == "queued":
                self.queued -= 1
                self._forward(t, r, out)


GROUP_COUNTS = ("no_live_upstream", "marked_down")
# over an autoscaled fleet: upstream attempts to a server whose replica was not up, and those answered above
NOT_UP_COUNTS = ("connect_error", "connect_error_answered")


class GroupRelay(Relay):
    """A relay of a gateway with an upstream group: `tried`, the servers of its upstream attempts."""
    __slots__ = ("tried",)

    def __init__(self, above: Attempt, retries):
        super().__init__(above, retries)
        self.tried: list = []


class GroupGateway(Gateway):
    """A gateway in front of `upstream_servers` engines, balancing them
    itself (see the module docstring); `group` is its `UpstreamGroup`.
    `burst_end`, where set, dates the record's verdict on the servers out
    of rotation after the burst (`record`); `up(s)`, where given, says
    whether server s's replica is up (else every server always is)."""
    relay_class = GroupRelay

    def __init__(self, settings: dict, random, pods=None, priority=None, up=None):
        super().__init__(settings, random, pods, priority)
        gw = self.policy
        self.up = up
        self.group = UpstreamGroup(gw, gw.upstream_servers, random, up)
        self.group.on_out = self._marked_down
        self.counts.update(dict.fromkeys(GROUP_COUNTS + (NOT_UP_COUNTS if up is not None else ()), 0))
        self._listed = self.retrier.policy.retry_statuses     # nginx: a status counts where proxy_next_upstream has it
        self._pending: dict = {}        # upstream attempt -> its server, until its result is told to the group
        self.alone_calls: set = set()   # calls with an attempt the gateway answered by itself
        self.burst_end = None

    def _forward(self, t: float, r: Relay, out: list) -> None:
        s = self.group.pick(t, r.above.call_id, r.tried)
        if s is None:                   # no server left: the gateway answers by itself
            self.counts["no_live_upstream"] += 1
            self.alone_calls.add(r.above.call_id)
            r.state = "upstream"        # as one sent and answered at once
            self._answer(r, Refuse(r.above, self.policy.no_live_status, None, "no_live_upstream"), out)
            return
        r.tried.append(s)
        if self.up is not None and not self.up(s):
            self._connect_error(t, r, s, out)
            return
        super()._forward(t, r, out)
        up = r.upstream
        up.server = s
        self.group.sent(s)
        self._pending[up] = s

    def _connect_error(self, t: float, r: Relay, s: int, out: list) -> None:
        """An upstream attempt to server s, whose replica is not up: the
        connection is refused at once and nothing goes below."""
        call = r.above.call_id
        self.tries[call] = self.tries.get(call, 0) + 1
        self.retrier.send(r.retries, t)
        self.counts["upstream_attempts"] += 1
        self.counts["connect_error"] += 1
        self.group.result(t, s, CONNECT)
        r.state = "upstream"
        answer = Refuse(r.above, self.policy.connect_error_status, None, "connect_error")
        self._failed(t, r, Failure(CONNECT_ERROR, t), answer, out)
        if out and out[-1] is answer:
            self.counts["connect_error_answered"] += 1
            self.alone_calls.add(call)

    def _marked_down(self) -> None:
        self.counts["marked_down"] += 1

    def _tell(self, t: float, up: Upstream, outcome: str, status: int | None = None) -> None:
        s = self._pending.pop(up, None)
        if s is not None:
            self.group.result(t, s, outcome, status)

    def _counts_as_failure(self, status: int) -> bool:
        h = self.policy.health
        if h == "nginx":
            return status in self._listed
        if h == "haproxy":
            return 500 <= status <= 504 and status != 501
        if h == "envoy":
            return status >= 500
        return status >= 400

    def on_complete(self, t: float, up: Upstream) -> list:
        self._tell(t, up, OK)
        return super().on_complete(t, up)

    def on_refused(self, t: float, up: Upstream, status: int, retry_after: float | None = None,
                   reason: str = "") -> list:
        self._tell(t, up, FAIL if self._counts_as_failure(status) else OK, status)
        return super().on_refused(t, up, status, retry_after, reason)

    def on_timer(self, t: float, token) -> list:
        if type(token) is Upstream and self._cut_by_timeout(token) is not None:
            # the gateway's upstream timeout; a stream it cuts counts as the preset says
            self._tell(t, token, FAIL if not token.answering or self.policy.cut_counts_as_failure else CLOSED)
        return super().on_timer(t, token)

    def on_attempt_left(self, t: float, attempt: Attempt) -> list:
        r = self.relays.get(attempt)
        up = r.upstream if r is not None and r.state == "upstream" else None
        out = super().on_attempt_left(t, attempt)
        if up is not None and self.policy.passes_disconnect:
            self._tell(t, up, CLOSED)           # nginx frees the peer as a success (state 0)
        return out

    def _release(self, t: float, up: Upstream, out: list) -> None:
        if not up.closed and up.server >= 0:
            self.group.closed(up.server)
        super()._release(t, up, out)

    def record(self, end: float) -> dict:
        """The group's part of the run's record (`UpstreamGroup.record`)."""
        c = self.counts
        rec = {**self.group.record(end, self.burst_end),
               "answered_alone": c["no_live_upstream"] + c.get("connect_error_answered", 0),
               "calls_answered_alone": len(self.alone_calls)}
        if self.up is not None:
            rec["not_up"].update(connect_errors=c["connect_error"], answered=c["connect_error_answered"])
        return rec


def settings(preset_name: str | None, overrides: dict) -> dict:
    """A gateway [[layer]]'s effective settings (`sim.policy.presets.preset`)."""
    if preset_name is None:
        raise ValueError(f"preset: must be given (one of {', '.join(PRESETS)})")
    return preset("gateway", preset_name, **overrides)


def make(settings: dict, context) -> Gateway:
    uniform = context.uniform
    if settings.get("upstream_servers", 1) > 1:
        return GroupGateway(settings, lambda: uniform(0.0, 1.0), pods=context.pods, priority=context.priority,
                            up=context.up)
    return Gateway(settings, lambda: uniform(0.0, 1.0), pods=context.pods, priority=context.priority)


GATEWAY = register(LayerKind("gateway", settings, make))

__all__ = ["Gateway", "GroupGateway", "Relay", "COUNTS", "GROUP_COUNTS", "NOT_UP_COUNTS", "GATEWAY"]
