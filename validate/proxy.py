"""The live proxy (docs/model.md, "The proxy"): an aiohttp server in front of a vLLM OpenAI
server, driven by the same policy core as the simulator
(`sim.policy.proxy.Proxy`). `LiveProxy` carries the actions out; its parts
are the HTTP side (`validate.proxy_http`: the application, a request turned
into an attempt, the response it is served), the engine streams
(`validate.proxy_engines`: an execution at its engine, rerouted after a 503,
its first token and its end) and what it knows of the engines and exports
(`validate.proxy_views`: the scraped gauges, the views the estimator, the
router and the layers read, the metrics).

It serves `POST /v1/completions` (streaming SSE and non-streaming). Every
request is an attempt: its call is named by the `X-Call-Id` header (a request
without it is a call of its own) and its number by `X-Attempt` (otherwise
counted per call id, 0 first), its traffic class by `X-Class` (shedding by
class, docs/classes.md; none without it). The key is the call id plus the request body
(the full generation parameters). The proxy's actions are carried out as
the simulator carries them out in simulated time, by the same interpreter
(`sim.policy.stack.Interpreter`):

- `Subscribe`: the attempt's handler streams the execution's chunks: first
  every chunk streamed so far (replay), then the rest as they arrive.
- `Dispatch`: one upstream streaming request to the engine; its chunks are
  fanned out to every subscriber. An upstream 503 (engine cap) is
  `on_engine_refused`; the end of the stream is `on_finished`.
- `Cancel`: the upstream connection is closed (vLLM aborts the request).
  Under cancellation `off` an execution with no subscriber left keeps being
  read to its end (orphaned).
- `Refuse`: 429 with `Retry-After` (whole seconds, rounded up) or 503.
- `Complete`: the subscriber's response ends.
- `Drop`: a queued execution never reaches the engine.
- `Wake(at)`: `on_wake` is scheduled with `loop.call_at`.

A client closing its connection is `on_attempt_left`. The estimator's
`EngineView`: the uncomputed prompt tokens are those of the executions
dispatched by this proxy that have not had their first token yet (every
engine request passes through the proxy); the prompt throughput is
the prompt tokens of executions that got their first token over the last
60 s (`PromptRate`, as in the simulator), or the given profile figure before
any. The engine's `/metrics` is scraped every second for its waiting and
running gauges, exported again by the proxy.

A fleet: given several engine URLs, the proxy binds the simulator's own
stack to them (`sim.policy.stack.Stack.from_config(condition, router)`,
`RouterConfig`: policy, retries K, placement), and asks the bound cluster,
as the simulator does, where each execution goes (`created`, `place`) and
where an engine's 503 sends it next (`reroute`). With `proxy = "deployment"`
the one policy core places each execution it dispatches on the replica the
router picks; with `"replica"` a sidecar policy core stands before each
engine (`ReplicaProxies`) and the router places each attempt. Either way an
engine's 503 is retried on another replica while the router's retries allow
(the sidecar's 503 passes through `ReplicaProxies`, the deployment's is
re-sent here). The router's views of replica r: `outstanding` is the
executions this proxy has sent to r and not seen end (plus r's sidecar
queue), `kv_usage` the engine's `vllm:kv_cache_usage_perc` at the last
scrape of its `/metrics`. A sidecar's estimator sees its own engine (prompt
tokens awaiting their first token there, the prompt throughput seen there).
Call ids are the `X-Call-Id` strings; the hashing policies hash a numeric
one as its number, so a live call goes where the simulated call does.
`exec_replica` / `exec_placed` (execution id -> replica, when it got it) and
`attempt_index` (call and attempt -> its entry in `ReplicaProxies.landed`)
record where things went, with `keep_records`.

A real gateway's upstream group before the engines (`group`: the
settings of a gateway layer whose `upstream_servers` is the number of
engines, nginx's upstream block or HAProxy's backend): the gateway is the
router, so the cluster is bound as the simulator binds it behind a group
(`GroupSidecarPerReplica`: a sidecar policy core before each engine,
router retries 0), and each sidecar is reached at a port of its own
(`server_ports`: local port -> replica, filled by whoever opens the sites);
an attempt goes to the engine whose port it came in on. `/health` is
answered by the proxy itself (HAProxy's active checks).

Gateway layers: given `layers` (the effective settings of `[[layer]]`s of a
kind that stands between the client and the proxy, `sim.policy.gateway`),
the proxy hosts them above its policy core, each made through the layer
registry (`sim.policy.layers`) as the simulator makes it: the very same
`Gateway` object, its actions carried out by the same interpreter on the
asyncio clock. A request is the top layer's attempt; `Send` hands a layer's
upstream attempt to the layer below (the next layer, or the policy core),
`Leave` closes it (the layer below hears the disconnect), `RunOn` leaves its
execution running with nobody waiting (orphaned), `Timer` is
`loop.call_at`; a `Complete` or `Refuse` of an upstream attempt goes to the
layer that sent it, and the top layer's answers the request: the
gateway's upstream timeout as its `timeout_status` (504), its queue's
refusals as its `queue_status` (503), with `X-Refused-Reason`. Under a
layer the answer is written once the top layer has it (the response of
the execution that served its last upstream attempt, as a gateway that
buffers the upstream's answer sends it). Shedding by priority needs a
call's priority, which a request does not carry: nothing is shed.

The proxy's own `/metrics` (prometheus-client) counts attempts and
executions created / attached / refused / cancelled / orphaned / dropped,
the proxy queue depth, and the waste gauges (`abort_rate`, `completion_ratio`, `useful_token_ratio`) over the executions
the engine accepted so far. `GET /stats` gives, as JSON, the latency the proxy
adds (p50 / p99 over its last `LATENCY_SAMPLES` samples of each kind):
`dispatch` — request received to the upstream request sent, for attempts that
create an execution sent at once; `forward` — a chunk read from upstream to
the same chunk written to a subscriber that was waiting for it.

Limits and exposure: the proxy binds 127.0.0.1 unless given another host; its
upstream is fixed when it starts (nothing in a request names or changes it);
a request body over `max_body_bytes` (default `MAX_BODY_BYTES`) is refused
with 413, an `X-Call-Id` that is not 1-128 characters of `A-Za-z0-9._:-`, an
`X-Attempt` that is not a whole number from 0 to 999,999, a body that is not
a JSON object and a `max_tokens` that is not a positive whole number with 400.
Memory is bounded by what is live: an execution's stream (its replay buffer)
is released when the execution has ended and its last subscriber has left;
the waste gauges keep running sums, not the streams; with
`keep_records=False` (`llmsim proxy`) no per-execution or per-attempt record
is kept either, and the per-call attempt counter holds the last
`CALL_MEMORY` call ids (`validate.proxy_http`).
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import deque
from typing import Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from sim.conditions import Condition
from sim.policy import gateway as _gateway  # noqa: F401  (registers the gateway kind a group is made of)
from sim.policy.layers import LayerContext, Timer, Upstream, layer_kind
from sim.policy.proxy import Attempt, Cancel, Complete, Drop, Refuse, Subscribe, Wake
from sim.policy.router import RouterConfig
from sim.policy.stack import Interpreter, Stack
from sim.runlog import ExecutionRecord

from .proxy_engines import EngineStreams
from .proxy_http import MAX_BODY_BYTES, HttpSide, Waiter
from .proxy_views import EngineViews, Metrics

LATENCY_SAMPLES = 100_000


class LiveProxy(Interpreter):
    """The policy core on the asyncio clock, in front of `upstream` (one
    engine URL, or a list of them behind `router`; see the module docstring
    on fleets). `prompt_throughput` is one engine's. `layers`: the
    effective settings of the layers it hosts above the policy core, from
    the top (see the module docstring); `seed` seeds their draws. It carries
    the actions out; its parts serve the requests (`http`,
    `validate.proxy_http.HttpSide`), stream the executions at the engines
    (`engines`, `validate.proxy_engines.EngineStreams`) and keep what it
    knows of the engines and exports (`views`,
    `validate.proxy_views.EngineViews`)."""

    def __init__(self, upstream: str | Sequence[str], condition: Condition, prompt_throughput: float | None = None,
                 scrape_every_s: float = 1.0, max_body_bytes: int = MAX_BODY_BYTES, keep_records: bool = True,
                 router: RouterConfig | None = None, layers: Sequence[dict] = (), seed: int = 0,
                 group: dict | None = None):
        Interpreter.__init__(self)
        ups = [upstream] if isinstance(upstream, str) else list(upstream)
        if not ups:
            raise ValueError("the live proxy needs at least one engine URL")
        self.upstreams = [u.rstrip("/") for u in ups]
        self.upstream = self.upstreams[0]
        if router is None and len(self.upstreams) > 1:
            router = RouterConfig()
        self.max_body_bytes = max_body_bytes
        self.keep_records = keep_records
        self.condition = condition
        self.scrape_every_s = scrape_every_s
        self.router_config = router
        self.group = group
        self.server_ports: dict[int, int] = {}      # behind a gateway's group: local port -> replica
        self.below_url: str | None = None           # before the group: the gateway's URL (set once it listens)
        self.metrics = Metrics()
        self.views = v = EngineViews(self.upstreams, self.now, self.metrics, scrape_every_s)
        self._bind(condition, router, prompt_throughput, layers, seed)
        if not keep_records:            # the interpreter's queue log: its last entry only
            self.proxy_queue_log = deque(self.proxy_queue_log, maxlen=1)
        self.added_s = {"dispatch": deque(maxlen=LATENCY_SAMPLES), "forward": deque(maxlen=LATENCY_SAMPLES)}
        self.engines = e = EngineStreams(self, v, self.added_s, keep_records)
        self.http = h = HttpSide(self, max_body_bytes)
        # the parts' state, by the names the harness and the tests read
        self.awaiting, self.held, self.engine_gauges, self.scraped_at = v.awaiting, v.held, v.engine_gauges, \
            v.scraped_at
        self.prompt_rates, self.accepted_live, self.accepted_ended = v.prompt_rates, v.accepted_live, \
            v.accepted_ended
        self.streams, self.exec_replica, self.exec_placed = e.streams, e.exec_replica, e.exec_placed
        self.waiters, self.attempt_counts = h.waiters, h.attempt_counts
        self.attempt_index: dict[tuple[str, int], int] = {}   # (call, attempt) -> index in proxy.landed
        self.executions: list[ExecutionRecord] = []   # one per execution created, as the simulator keeps them
        self.subscriptions: dict[tuple[str, int], tuple[int, bool]] = {}   # (call, attempt) -> (execution, attached)
        self._t0 = time.monotonic()

    def _bind(self, condition: Condition, router: RouterConfig | None, pt: float | None, layers: Sequence[dict],
              seed: int) -> None:
        """The stack's proxy and router over the engines (`sim.policy.stack`),
        as the simulator binds them, and the layers between the client and the
        policy core, from the top, made as the simulator makes them."""
        stack = Stack.from_config(condition, router)
        if self.group is not None:
            if layers:
                raise ValueError("the live proxy behind a gateway's upstream group hosts no layer")
            stack = stack.with_layers([self.group])
        self.below = stack.group_below_proxy      # the one proxy before the group: the gateway takes its executions
        v = self.views
        self.cluster = cl = stack.bind(len(self.upstreams), v.engine_view_of, lambda grp: pt * len(grp) if pt else pt,
                                       replica_view=v.replica_view)
        self.router, self.proxy = cl.router, cl.proxy
        draws = random.Random(seed)
        self.layers = []
        for i, settings in enumerate(layers):
            kind = layer_kind(settings["kind"])
            if kind.top:
                raise ValueError(f"layer[{i}]: a {kind.name} layer stands at the client's place, not in the proxy")
            self.layers.append(kind.make(settings, LayerContext(draws.uniform, v.pods, None, i + 1)))
        self._chain(self.layers, (self._proxy_attempt, self.proxy.on_attempt_left))
        v.bind(cl)

    # ------------------------------------------------ before a gateway's upstream group
    def upstream_replica(self, headers) -> int | None:
        """The replica the gateway below sent an execution to, from the
        header its config adds (nginx: `X-Upstream-Addr`, the servers tried,
        the last one's host:port; HAProxy: `X-Upstream-Server`, its server's
        name `sN`); None where it sent it nowhere (its own answer)."""
        addr = headers.get("X-Upstream-Addr")
        if addr:
            host = addr.split(",")[-1].strip()
            hosts = [u.split("://", 1)[-1] for u in self.upstreams]
            return hosts.index(host) if host in hosts else None
        name = headers.get("X-Upstream-Server", "")
        return int(name[1:]) if name[:1] == "s" and name[1:].isdigit() else None

    def below_reason(self, status: int, replica: int | None) -> str:
        """Why the gateway below answered an execution with `status`: the
        engine's own answer passed on where it reached one, else the
        gateway's (as the simulator's gateway says it)."""
        g = self.group
        if status == g["timeout_status"]:
            return "upstream_timeout"
        if replica is None and status == g["no_live_status"]:
            return "no_live_upstream"
        if replica is None or status == g["connect_error_status"]:
            return "connect_error"
        return "engine"

    # ------------------------------------------------------------ plumbing
    def now(self) -> float:
        return time.monotonic() - self._t0

    def app(self) -> web.Application:
        """The aiohttp application serving the proxy (`HttpSide.app`)."""
        return self.http.app()

    @property
    def outstanding(self) -> int:
        """Executions dispatched to the engines and not finished."""
        return self.cluster.outstanding

    @property
    def rerouted(self) -> int:
        """Requests the router sent on to another replica after a 503."""
        return self.cluster.rerouted

    # ------------------------------------------------------------- actions
    # the handlers of the policy core's actions, carried out by the
    # simulator's own interpreter (`sim.policy.stack.Interpreter._do`)
    def _subscribe(self, t: float, a: Subscribe) -> None:
        m = self.metrics
        w = self._waiter(a.attempt)
        if self.keep_records:
            self.subscriptions[(str(a.attempt.call_id), a.attempt.number)] = (a.execution.id, a.attempt.attached)
        if a.attempt.attached:
            m.attached.inc()
        else:
            st = self.streams[a.execution.id] = w.new_stream()
            m.created.inc()
            st.record = ExecutionRecord(id=a.execution.id, call=_call_number(a.attempt.call_id),
                                        attempt=a.attempt.number, prompt_len=st.prompt_len,
                                        max_tokens=st.max_tokens, created_at=t)
            r = self.cluster.created(a.execution)
            if r is not None:                # placed when created (a sidecar's execution)
                st.tried.append(r)
                self.engines.place(st, r, t)
            if self.keep_records:
                self.executions.append(st.record)
        w.stream = self.streams[a.execution.id]
        w.notify()

    def _dispatch(self, t: float, ex) -> None:
        self.engines.dispatch(t, ex)

    def _cancel(self, t: float, a: Cancel) -> None:
        st = self.streams.pop(a.execution.id)
        st.fate = "cancelled"
        st.record.cancel_requested_at = st.record.finished_at = t
        st.record.fate, st.record.tokens_generated = "aborted", st.tokens
        self.metrics.cancelled.inc()
        if st.task is not None:
            st.task.cancel()

    def _refuse(self, t: float, a: Refuse) -> None:
        """Every refusal is counted; the chain routes it (`Interpreter._refuse`)."""
        self.metrics.refused.labels(a.reason, str(a.status)).inc()
        Interpreter._refuse(self, t, a)

    def _refused(self, t: float, a: Refuse) -> None:
        w = self.waiters.get(id(a.attempt))
        if w is not None:
            w.refused = a
            w.notify()

    def _completed(self, t: float, a: Complete) -> None:
        w = self.waiters.get(id(a.attempt))
        if w is not None:
            w.completed = True
            w.notify()

    def _drop(self, t: float, a: Drop) -> None:
        st = self.streams.pop(a.execution.id)
        st.fate = "dropped"
        st.record.fate, st.record.finished_at = "dropped", t
        self.metrics.dropped.inc()

    def _wake_at(self, t: float, a: Wake) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, a.at - self.now())
        loop.call_at(when, self._wake, a.execution)

    def _wake(self, ex) -> None:
        t = self.now()
        self._do(t, self.proxy.on_wake(t, ex))

    # the actions of the layers between the client and the policy core
    @staticmethod
    def _waiter(att: Attempt) -> Waiter:
        """The request an attempt serves (kept in its `row`: a client's
        attempt's own, a layer's upstream attempt's that of the attempt it
        serves)."""
        return att.row

    @staticmethod
    def _request(up: Upstream) -> tuple:
        """What an upstream attempt carries below: its request's params and prompt length."""
        return up.row.params, up.row.prompt_len

    def _proxy_attempt(self, t: float, att: Attempt, params: tuple, prompt_len: int) -> list:
        """An attempt reaches the policy core (from the client, or the
        lowest layer); where the router placed it, its place is noted."""
        actions = self.proxy.on_attempt(t, att, params, prompt_len)
        landed = self.cluster.landed()
        if landed is not None and self.keep_records:     # the router placed the attempt itself
            top = att
            while type(top) is Upstream:
                top = top.above
            self.attempt_index[(top.call_id, top.number)] = len(landed) - 1
        return actions

    def _timer_at(self, t: float, a: Timer) -> None:
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + max(0.0, a.at - self.now()), self._layer_timer, a)

    def _layer_timer(self, a: Timer) -> None:
        t = max(self.now(), a.at)           # the loop may call a little early (its clock's resolution)
        self._do(t, a.layer.on_timer(t, a.token))

    def _orphaned(self, t: float, ex) -> None:
        """An execution sent to its engine runs on with nobody waiting for it
        (its record's `orphaned_at`: the first time)."""
        if ex.state != "dispatched":
            return
        self.metrics.orphaned.inc()
        st = self.streams.get(ex.id)
        if st is not None and st.record is not None and st.record.orphaned_at != st.record.orphaned_at:
            st.record.orphaned_at = t

    def _do(self, t: float, actions: list) -> None:
        """Carry the actions out (`Interpreter._do`), then set the queue and outstanding gauges."""
        Interpreter._do(self, t, actions)
        self.metrics.queue.set(self.proxy.queued)
        self.metrics.outstanding.set(self.outstanding)


def _call_number(call_id) -> int:
    """The call's number for the records: the X-Call-Id when it is a whole
    number (the load generator's calls), else -1."""
    try:
        return int(call_id)
    except (TypeError, ValueError):
        return -1


def upstream_url(u: str) -> str:
    """An engine URL as the proxy uses it (no trailing slash); ValueError
    naming the problem unless it is http(s)://HOST[:PORT][/PATH]."""
    try:
        parts = urlsplit(u)
        parts.port                           # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"{u!r} is not an engine URL ({e}); give http://HOST:PORT, e.g. "
                         "http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{u!r} is not an engine URL; give http://HOST:PORT, e.g. http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise ValueError(f"{u!r}: an engine URL takes no query or fragment")
    return u.rstrip("/")


async def unreachable(upstreams: Sequence[str], timeout_s: float = 3.0) -> list[str]:
    """For each engine that does not answer GET /metrics within `timeout_s`, a
    line saying so (empty: every engine answered)."""
    async def probe(session, u):
        try:
            async with session.get(u + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return f"{u}/metrics answered {r.status}: is this a vLLM OpenAI server?"
                return None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return f"{u} does not answer ({type(e).__name__}: {e or 'timed out'})"
    async with aiohttp.ClientSession() as session:
        found = await asyncio.gather(*[probe(session, u) for u in upstreams])
    return [x for x in found if x]


async def serve(upstream: str | Sequence[str], condition: Condition, port: int, host: str = "127.0.0.1",
                prompt_throughput: float | None = None, ready=None, router: RouterConfig | None = None,
                layers: Sequence[dict] = ()) -> None:
    """Run the proxy until cancelled (before several engines: behind
    `router`; under `layers`, as `LiveProxy`'s)."""
    lp = LiveProxy(upstream, condition, prompt_throughput, keep_records=False, router=router, layers=layers)
    runner = web.AppRunner(lp.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if ready is not None:
        ready(lp, site)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(upstream: str | Sequence[str], condition: Condition, host: str, port: int,
         prompt_throughput: float | None = None, router: RouterConfig | None = None,
         layers: Sequence[dict] = ()) -> int:
    """`llmsim proxy`: serve until interrupted. An engine that does not
    answer at start is named on stderr (the proxy serves all the same: an
    engine may come up after it; until then its attempts are refused)."""
    ups = [upstream] if isinstance(upstream, str) else list(upstream)
    for line in asyncio.run(unreachable(ups)):
        print(f"llmsim proxy: warning: {line}", file=sys.stderr, flush=True)

    def ready(lp, site):
        to = ups[0] if len(ups) == 1 else \
            f"{len(ups)} engines ({', '.join(ups)}) by {router.policy}, proxy per {router.proxy}, " \
            f"router retries {router.retries}"
        under = "".join(f"{s.get('preset', s['kind'])} -> " for s in layers)
        print(f"llmsim proxy at http://{host}:{port} -> {under}{to} ({condition.name}: {condition.describe()}); "
              f"metrics at /metrics", file=sys.stderr, flush=True)
    asyncio.run(serve(ups if len(ups) > 1 else ups[0], condition, port, host, prompt_throughput, ready, router,
                      layers))
    return 0
