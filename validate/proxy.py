"""The live proxy (docs/model.md, "The proxy"): an aiohttp server in front of a vLLM OpenAI
server, driven by the same policy core as the simulator
(`sim.policy.proxy.Proxy`).

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
`CALL_MEMORY` call ids.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from collections import OrderedDict, deque
from typing import Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from sim.conditions import Condition
from sim.policy import gateway as _gateway  # noqa: F401  (registers the gateway kind a group is made of)
from sim.policy.layers import LayerContext, Timer, Upstream, layer_kind
from sim.policy.proxy import Attempt, Cancel, Complete, Drop, EngineView, PromptRate, Refuse, Subscribe, Wake
from sim.policy.router import ReplicaView, RouterConfig
from sim.policy.stack import Interpreter, Stack
from sim.runlog import ExecutionRecord

from .engine import parse_metrics

DEFAULT_MAX_TOKENS = 16      # the OpenAI completions default
MAX_BODY_BYTES = 4 * 1024 * 1024
CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ATTEMPT_MAX = 999_999
CALL_MEMORY = 100_000        # call ids whose attempt count is kept (oldest forgotten first)
LATENCY_SAMPLES = 100_000


def prompt_tokens(prompt) -> int:
    """Prompt length in tokens: a token-id list counts exactly; text is
    estimated at 4 characters a token."""
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):
            return sum(len(p) for p in prompt)
        if prompt and isinstance(prompt[0], str):
            return sum(max(1, len(p) // 4) for p in prompt)
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    return 0


class Stream:
    """One execution's upstream stream: its chunks so far, fanned out."""

    def __init__(self, body: dict, prompt_len: int, max_tokens: int):
        self.body = body
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.chunks: list[bytes] = []     # SSE events, b"data: ...\n\n"
        self.changed = asyncio.Event()
        self.done = False
        self.error: tuple[int, bytes] | None = None    # non-200 upstream answer passed to subscribers
        self.task: asyncio.Task | None = None
        self.first_token = False
        self.tokens = 0
        self.accepted = False
        self.fate = ""                    # completed | cancelled | refused | dropped
        self.record: ExecutionRecord | None = None   # the execution's entry in LiveProxy.executions
        self.last_at = 0.0                # when the newest chunk was read from upstream (monotonic)
        self.received: float | None = None   # when the attempt that created it arrived (monotonic)
        self.replica = 0                  # the engine it is sent to (index into LiveProxy.upstreams)
        self.tried: list[int] = []        # replicas that refused it (503) before, then its current one

    def notify(self) -> None:
        ev, self.changed = self.changed, asyncio.Event()
        ev.set()


class Waiter:
    """The handler side of one attempt: how it ends."""

    def __init__(self, body: dict | None = None, prompt_len: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS,
                 received: float | None = None):
        self.refused: Refuse | None = None
        self.completed = False
        self.stream: Stream | None = None
        self.body, self.prompt_len, self.max_tokens, self.received = body, prompt_len, max_tokens, received
        self.params: tuple = ()           # the policy core's key parameters (the canonical body)
        self.changed = asyncio.Event()

    def new_stream(self) -> Stream:
        """A stream for an execution the attempt creates (again, when the
        router sends it to another replica after a 503)."""
        st = Stream(self.body, self.prompt_len, self.max_tokens)
        st.received = self.received
        return st

    def notify(self) -> None:
        ev, self.changed = self.changed, asyncio.Event()
        ev.set()


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.attempts = Counter("llmsim_proxy_attempts", "attempts received", ["kind"], registry=r)
        ex = lambda n, h: Counter(f"llmsim_proxy_executions_{n}", h, registry=r)   # noqa: E731
        self.created = ex("created", "executions created")
        self.attached = ex("attached", "attempts attached to a live execution")
        self.refused = Counter("llmsim_proxy_refused", "attempts refused", ["reason", "status"], registry=r)
        self.cancelled = ex("cancelled", "executions cancelled at the engine")
        self.orphaned = ex("orphaned", "executions left with no subscriber and read on")
        self.dropped = ex("dropped", "queued executions dropped before the engine")
        self.completed = ex("completed", "executions the engine finished")
        self.engine_refused = ex("engine_refused", "executions the engine refused (503)")
        self.queue = Gauge("llmsim_proxy_queue_depth", "executions waiting in the proxy queue", registry=r)
        self.outstanding = Gauge("llmsim_proxy_outstanding", "executions dispatched and not finished", registry=r)
        self.engine_waiting = Gauge("llmsim_engine_waiting", "engine's vllm:num_requests_waiting (scraped)",
                                    registry=r)
        self.engine_running = Gauge("llmsim_engine_running", "engine's vllm:num_requests_running (scraped)",
                                    registry=r)
        self.abort_rate = Gauge("abort_rate", "accepted executions finished by abort / accepted", registry=r)
        self.completion_ratio = Gauge("completion_ratio", "tokens generated / max tokens (accepted)", registry=r)
        self.useful_token_ratio = Gauge("useful_token_ratio",
                                        "tokens of completed executions / max tokens (accepted)", registry=r)


class RequestAttempt(Attempt):
    """A client's attempt (an HTTP request) with its `Waiter` as its `row`
    (the row an upstream attempt serving it carries: `Interpreter._send_below`)
    and, behind a gateway's upstream group, the replica its gateway picked
    (`server`)."""
    __slots__ = ("row", "server")


class LiveProxy(Interpreter):
    """The policy core on the asyncio clock, in front of `upstream` (one
    engine URL, or a list of them behind `router`; see the module docstring
    on fleets). `prompt_throughput` is one engine's. `layers`: the
    effective settings of the layers it hosts above the policy core, from
    the top (see the module docstring); `seed` seeds their draws."""

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
        n = len(self.upstreams)
        if router is None and n > 1:
            router = RouterConfig()
        self.max_body_bytes = max_body_bytes
        self.keep_records = keep_records
        self.condition = condition
        self.scrape_every_s = scrape_every_s
        # per replica: prompt tokens dispatched and awaiting their first token, executions sent and not ended, the
        # engine's scraped gauges
        self.awaiting = [0] * n
        self.held = [0] * n
        self.engine_gauges: list[dict] = [{} for _ in range(n)]
        self.scraped_at = [-math.inf] * n           # when each engine's gauges were read (self.now())
        self.router_config = router
        # the stack's proxy and router over the engines (`sim.policy.stack`), as the simulator binds them
        pt = prompt_throughput
        stack = Stack.from_config(condition, router)
        self.group = group
        self.server_ports: dict[int, int] = {}      # behind a gateway's group: local port -> replica
        if group is not None:
            if layers:
                raise ValueError("the live proxy behind a gateway's upstream group hosts no layer")
            stack = stack.with_layers([group])
        self.cluster = cl = stack.bind(
            n, self._engine_view_of, lambda grp: pt * len(grp) if pt else pt, replica_view=self._replica_view)
        self.router, self.proxy = cl.router, cl.proxy
        # the layers between the client and the policy core, from the top, made as the simulator makes them
        draws = random.Random(seed)
        self.layers = []
        for i, settings in enumerate(layers):
            kind = layer_kind(settings["kind"])
            if kind.top:
                raise ValueError(f"layer[{i}]: a {kind.name} layer stands at the client's place, not in the proxy")
            self.layers.append(kind.make(settings, LayerContext(draws.uniform, self._pods, None, i + 1)))
        self._chain(self.layers, (self._proxy_attempt, self.proxy.on_attempt_left))
        if not keep_records:            # the interpreter's queue log: its last entry only
            self.proxy_queue_log = deque(self.proxy_queue_log, maxlen=1)
        self.prompt_rates = [PromptRate(60.0) for _ in cl.groups]    # the prompt throughput each proxy sees
        self.exec_replica: dict[int, int] = {}     # execution id -> its replica (keep_records)
        self.exec_placed: dict[int, float] = {}    # execution id -> when it got that replica
        self.attempt_index: dict[tuple[str, int], int] = {}   # (call, attempt) -> index in proxy.landed
        self.streams: dict[int, Stream] = {}       # execution id -> stream
        self.waiters: dict[int, Waiter] = {}       # id(attempt) -> waiter
        self.attempt_counts: OrderedDict[str, int] = OrderedDict()
        self.accepted_live: set[Stream] = set()    # accepted by the engine, not ended (waste gauges)
        self.accepted_ended = {"n": 0, "cancelled": 0, "max_tokens": 0, "tokens": 0, "useful": 0}
        self.added_s = {"dispatch": deque(maxlen=LATENCY_SAMPLES), "forward": deque(maxlen=LATENCY_SAMPLES)}
        self.executions: list[ExecutionRecord] = []   # one per execution created, as the simulator keeps them
        self.subscriptions: dict[tuple[str, int], tuple[int, bool]] = {}   # (call, attempt) -> (execution, attached)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self._scraper: asyncio.Task | None = None
        self._anon = 0
        self._t0 = time.monotonic()

    # ------------------------------------------------------------ plumbing
    def now(self) -> float:
        return time.monotonic() - self._t0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self.handle_completion)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/stats", self.handle_stats)
        app.router.add_get("/health", self.handle_health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app) -> None:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None,
                                                                                            sock_connect=10))
        self._scraper = asyncio.create_task(self._scrape())

    async def _cleanup(self, _app) -> None:
        tasks = [s.task for s in self.streams.values() if s.task is not None and not s.task.done()]
        if self._scraper is not None:
            tasks.append(self._scraper)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.session.close()

    async def _scrape(self) -> None:
        while True:
            for r, url in enumerate(self.upstreams):
                try:
                    async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        self.engine_gauges[r] = parse_metrics(await resp.text())
                        self.scraped_at[r] = self.now()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
            for gauge, key in ((self.metrics.engine_waiting, "vllm:num_requests_waiting"),
                               (self.metrics.engine_running, "vllm:num_requests_running")):
                gauge.set(sum(g.get(key, 0.0) for g in self.engine_gauges))
            await asyncio.sleep(self.scrape_every_s)

    def _engine_view_of(self, group: tuple, g: int, t: float) -> EngineView:
        """What the g-th policy core knows of the engines it feeds
        (`group`): the prompt tokens sent there awaiting their first token,
        the prompt throughput seen there, and the engines' waiting requests
        and mean KV cache usage at the last scrape of their `/metrics`."""
        gauges = [self.engine_gauges[r] for r in group]
        return EngineView(float(sum(self.awaiting[r] for r in group)), self.prompt_rates[g].rate(t),
                          float(sum(x.get("vllm:num_requests_waiting", 0.0) for x in gauges)),
                          sum(x.get("vllm:kv_cache_usage_perc", 0.0) for x in gauges) / len(gauges))

    def _pods(self, t: float) -> list:
        """What a layer above the policy core reads of each engine: (waiting,
        KV cache usage, age of the reading in s) from its last /metrics."""
        return [(g.get("vllm:num_requests_waiting", 0.0), g.get("vllm:kv_cache_usage_perc", 0.0), t - at)
                for g, at in zip(self.engine_gauges, self.scraped_at)]

    def _replica_view(self, r: int) -> ReplicaView:
        """What the router reads of replica r: the executions this proxy has
        sent it and not seen end, plus its own proxy queue (a sidecar's); the
        KV cache usage its engine's /metrics gave at the last scrape."""
        return ReplicaView(self.held[r] + self.cluster.queued_at(r),
                           self.engine_gauges[r].get("vllm:kv_cache_usage_perc", 0.0))

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
                self._place(st, r, t)
            if self.keep_records:
                self.executions.append(st.record)
        w.stream = self.streams[a.execution.id]
        w.notify()

    def _dispatch(self, t: float, ex) -> None:
        st = self.streams[ex.id]
        at_once = st.record is not None and st.record.created_at == t     # not held in the proxy queue
        if not st.tried:                     # placed when dispatched (the proxy before the router)
            r = self.cluster.place(ex)
            st.tried.append(r)
            self._place(st, r, t)
        st.task = asyncio.create_task(self._upstream(ex, st, st.received if at_once else None))
        st.record.dispatched_at = t
        self.awaiting[st.replica] += st.prompt_len
        self.held[st.replica] += 1

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

    def _place(self, st: Stream, r: int, t: float) -> None:
        """The execution of `st` goes to replica r (the last of st.tried)."""
        st.replica = r
        if self.keep_records and st.record is not None:
            self.exec_replica[st.record.id], self.exec_placed[st.record.id] = r, t

    def _reroute(self, st: Stream, ex) -> bool:
        """An engine answered 503 to the execution of `st`: send it to the
        replica the cluster names next (True; the router's retries of one
        proxy before it), if any; otherwise it is refused (False)."""
        r = self.cluster.reroute(ex.call_id, st.tried)
        if r is None:
            return False
        old = st.replica
        self.awaiting[old] -= st.prompt_len
        self.held[old] -= 1
        self._place(st, r, self.now())
        self.awaiting[st.replica] += st.prompt_len
        self.held[st.replica] += 1
        return True

    def _wake(self, ex) -> None:
        t = self.now()
        self._do(t, self.proxy.on_wake(t, ex))

    def _first_token(self, st: Stream) -> None:
        if not st.first_token:
            st.first_token = True
            self.awaiting[st.replica] -= st.prompt_len
            t = self.now()
            self.prompt_rates[self.cluster.group_of[st.replica]].add(t, st.prompt_len)
            if st.record is not None:
                st.record.first_token_at = t

    def _update_waste(self) -> None:
        e, live = self.accepted_ended, self.accepted_live
        n = e["n"] + len(live)
        mx = e["max_tokens"] + sum(s.max_tokens for s in live)
        m = self.metrics
        m.abort_rate.set(e["cancelled"] / n if n else 0.0)
        m.completion_ratio.set((e["tokens"] + sum(s.tokens for s in live)) / mx if mx else 0.0)
        m.useful_token_ratio.set(e["useful"] / mx if mx else 0.0)

    def _retire(self, st: Stream) -> None:
        """An accepted execution has ended: fold it into the waste sums."""
        if st in self.accepted_live:
            self.accepted_live.discard(st)
            e = self.accepted_ended
            e["n"] += 1
            e["cancelled"] += st.fate == "cancelled"
            e["max_tokens"] += st.max_tokens
            e["tokens"] += st.tokens
            e["useful"] += st.tokens if st.fate == "completed" else 0

    async def _upstream(self, ex, st: Stream, w_t0: float | None = None) -> None:
        """One execution at the engine: stream it, fan it out, report its end."""
        try:
            await self._stream_upstream(ex, st, w_t0)
        finally:
            self.held[st.replica] -= 1
            self._retire(st)
            self._update_waste()

    async def _stream_upstream(self, ex, st: Stream, w_t0: float | None) -> None:
        body = dict(st.body, stream=True)
        body["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
        resp = None
        try:
            if w_t0 is not None:
                self.added_s["dispatch"].append(time.monotonic() - w_t0)
            while True:
                resp = await self.session.post(self.upstreams[st.replica] + "/v1/completions", json=body)
                if resp.status != 503:
                    break
                async with resp:
                    await resp.read()
                if not self._reroute(st, ex):
                    self._engine_refused(ex, st)
                    return
            async with resp:
                if resp.status != 200:       # passed to the subscribers as it came
                    st.error = (resp.status, await resp.read())
                    self._finished(ex, st, "failed")
                    return
                st.accepted = True
                self.accepted_live.add(st)
                if st.record is not None:
                    st.record.accepted = True
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data != b"[DONE]":
                        try:
                            d = json.loads(data)
                        except ValueError:
                            d = {}
                        if d.get("choices"):
                            self._first_token(st)
                            st.tokens += 1
                        if d.get("usage"):
                            st.tokens = d["usage"].get("completion_tokens", st.tokens)
                    st.chunks.append(b"data: " + data + b"\n\n")
                    st.last_at = time.monotonic()
                    st.notify()
                self._finished(ex, st, "completed")
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()                 # the engine sees the disconnect and aborts
            self._first_token_forget(st)
            st.done = True
            st.notify()
            raise
        except (aiohttp.ClientError, TimeoutError):
            if st.accepted:
                self._finished(ex, st, "failed")
            else:
                self._engine_refused(ex, st)

    def _first_token_forget(self, st: Stream) -> None:
        if not st.first_token:
            st.first_token = True            # no longer awaited
            self.awaiting[st.replica] -= st.prompt_len

    def _engine_refused(self, ex, st: Stream) -> None:
        self._first_token_forget(st)
        st.fate = "refused"
        self.metrics.engine_refused.inc()
        st.done = True
        self.streams.pop(ex.id, None)
        t = self.now()
        if st.record is not None:
            st.record.fate, st.record.finished_at = "refused", t
        self._do(t, self.proxy.on_engine_refused(t, ex))

    def _finished(self, ex, st: Stream, fate: str) -> None:
        self._first_token_forget(st)
        st.fate = fate
        st.done = True
        self.metrics.completed.inc()
        self._retire(st)
        self._update_waste()
        self.streams.pop(ex.id, None)
        t = self.now()
        if st.record is not None:
            # "failed": the engine answered an error, or the connection broke mid-stream
            st.record.fate, st.record.finished_at, st.record.tokens_generated = fate, t, st.tokens
        actions = self.proxy.on_finished(t, ex)
        st.notify()
        self._do(t, actions)

    # ------------------------------------------------------------ handlers
    async def handle_metrics(self, request: web.Request) -> web.Response:
        self._update_waste()
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response({"added_latency_s": {k: _quantiles(v) for k, v in self.added_s.items()},
                                  "live": {"streams": len(self.streams), "waiters": len(self.waiters),
                                           "accepted_live": len(self.accepted_live),
                                           "call_ids": len(self.attempt_counts)}})

    def _attempt(self, request: web.Request) -> Attempt:
        call = request.headers.get("X-Call-Id")
        if call is None:
            self._anon += 1
            call = f"anon-{self._anon}"
        elif not CALL_ID.fullmatch(call):
            raise web.HTTPBadRequest(text="X-Call-Id must be 1-128 characters of A-Za-z0-9._:-")
        n = request.headers.get("X-Attempt")
        if n is not None:
            if not (n.isascii() and n.isdigit() and int(n) <= ATTEMPT_MAX):
                raise web.HTTPBadRequest(text=f"X-Attempt must be a whole number from 0 to {ATTEMPT_MAX}")
            number = int(n)
            self.attempt_counts[call] = max(self.attempt_counts.get(call, 0), number + 1)
        else:
            number = self.attempt_counts.get(call, 0)
            self.attempt_counts[call] = number + 1
        self.attempt_counts.move_to_end(call)
        while len(self.attempt_counts) > CALL_MEMORY:
            self.attempt_counts.popitem(last=False)
        klass = request.headers.get("X-Class")
        if klass is not None and not CALL_ID.fullmatch(klass):
            raise web.HTTPBadRequest(text="X-Class must be 1-128 characters of A-Za-z0-9._:-")
        att = RequestAttempt(call, number, klass=klass)
        att.server = self.server_ports.get(request.transport.get_extra_info("sockname")[1]) \
            if self.group is not None else None
        if self.group is not None and att.server is None:
            raise web.HTTPNotFound(text="behind a gateway's upstream group a request comes in on a replica's port")
        return att

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            raise web.HTTPBadRequest(text="body must be a JSON object") from None
        mt = body.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise web.HTTPBadRequest(text="max_tokens must be a positive whole number")
        att = self._attempt(request)
        self.metrics.attempts.labels("retry" if att.number > 0 else "first").inc()
        params = (json.dumps(body, sort_keys=True, separators=(",", ":")),)
        plen = prompt_tokens(body.get("prompt"))
        w = att.row = self.waiters[id(att)] = Waiter(body, plen, mt or DEFAULT_MAX_TOKENS, received)
        w.params = params
        t = self.now()
        try:
            self._do(t, self._enter(t, att, params, plen))
            return await self._serve(request, att, w, bool(body.get("stream")))
        except (asyncio.CancelledError, ConnectionResetError) as e:
            if att.open:
                self._disconnect(self.now(), att, self._enter_left)
            if isinstance(e, ConnectionResetError):
                # the client left while its stream was being written: the same
                # as a disconnect noticed by the server (not a server error)
                raise asyncio.CancelledError from None
            raise
        finally:
            self.waiters.pop(id(att), None)

    async def _serve(self, request, att: Attempt, w: Waiter, streaming: bool) -> web.StreamResponse:
        # wait until the attempt is refused, completes, or (with no layer above the policy core, which
        # answers once it has the answer) its stream has output
        while w.refused is None and not w.completed and not (w.stream is not None and w.stream.chunks
                                                             and not self.layers):
            waits = [w.changed.wait()] + ([w.stream.changed.wait()] if w.stream is not None else [])
            tasks = [asyncio.ensure_future(x) for x in waits]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for x in tasks:
                    x.cancel()
        if w.refused is not None:
            r = w.refused
            headers = {"X-Refused-Reason": r.reason}
            if r.status == 429 and r.retry_after is not None:
                headers["Retry-After"] = str(max(0, math.ceil(r.retry_after))) if math.isfinite(r.retry_after) \
                    else "3600"
            return web.json_response({"error": {"message": f"refused ({r.reason})", "code": r.status}},
                                     status=r.status, headers=headers)
        st = w.stream
        ex_id = att.execution.id if att.execution is not None else st.record.id    # under layers: the last one's
        ids = {"X-Execution-Id": str(ex_id), "X-Attached": "1" if att.attached else "0"}
        if st.error is not None and not st.chunks:
            att.open = False
            return web.Response(status=st.error[0], body=st.error[1], content_type="application/json",
                                headers=ids)
        if not streaming:
            while not w.completed:
                await w.changed.wait()
            return web.json_response(_aggregate(st.chunks), headers=ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **ids})
        await resp.prepare(request)
        i = 0
        waited = False
        while True:
            while i < len(st.chunks):
                # what has come since the last write, in one write: a retry that
                # attaches replays the whole buffer so far without a write per token
                n = len(st.chunks)
                await resp.write(st.chunks[i] if n - i == 1 else b"".join(st.chunks[i:n]))
                i = n
                if waited and i == len(st.chunks):
                    self.added_s["forward"].append(time.monotonic() - st.last_at)
            if w.completed:
                break
            await st.changed.wait()
            waited = True
        await resp.write_eof()
        return resp


def _quantiles(xs) -> dict:
    """p50 / p99 (nearest rank) and the count of a sample."""
    v = sorted(xs)
    if not v:
        return {"n": 0, "p50": None, "p99": None}
    at = lambda q: v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]   # noqa: E731
    return {"n": len(v), "p50": at(0.50), "p99": at(0.99)}


def _call_number(call_id) -> int:
    """The call's number for the records: the X-Call-Id when it is a whole
    number (the load generator's calls), else -1."""
    try:
        return int(call_id)
    except (TypeError, ValueError):
        return -1


def _aggregate(chunks: list[bytes]) -> dict:
    """The non-streaming completion from the streamed chunks."""
    out: dict = {}
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for c in chunks:
        data = c[6:].strip()
        if data == b"[DONE]":
            continue
        d = json.loads(data)
        for k in ("id", "created", "model"):
            if k in d:
                out.setdefault(k, d[k])
        for ch in d.get("choices") or []:
            i = ch.get("index", 0)
            texts[i] = texts.get(i, "") + (ch.get("text") or "")
            if ch.get("finish_reason") is not None:
                finish[i] = ch["finish_reason"]
        if d.get("usage"):
            out["usage"] = d["usage"]
    out["object"] = "text_completion"
    out["choices"] = [{"index": i, "text": texts[i], "finish_reason": finish.get(i), "logprobs": None}
                      for i in sorted(texts)]
    return out


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
