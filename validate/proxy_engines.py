"""The live proxy's engine streams (`validate.proxy.LiveProxy`): an execution
dispatched to the replica the cluster places it on, as one streaming
`/v1/completions` request, its chunks kept and fanned out to the attempts
subscribed to it (`Stream`); an engine's 503 sent on to the replica the
cluster names next (`reroute`) or, with none left, reported to the policy
core (`on_engine_refused`); the first token (awaited prompt tokens, the
prompt throughput, the record); the end of the stream (`on_finished`), the
execution then folded into the waste sums; a cancelled one's upstream
connection closed (vLLM aborts the request)."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from sim.runlog import ExecutionRecord


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


class EngineStreams:
    """The executions at the engines of `views` (`EngineViews`, whose counts
    they keep), for the interpreter `lp` (its clock `now`, its cluster, its
    policy core and `_do`); `added_s["dispatch"]` takes the latency the proxy
    adds before an execution it sends at once."""

    def __init__(self, lp, views, added_s: dict, keep_records: bool):
        self.lp, self.views, self.added_s, self.keep_records = lp, views, added_s, keep_records
        self.metrics = views.metrics
        self.do = lp._do                           # the interpreter's: carry the policy core's actions out
        self.streams: dict[int, Stream] = {}       # execution id -> stream
        self.exec_replica: dict[int, int] = {}     # execution id -> its replica (keep_records)
        self.exec_placed: dict[int, float] = {}    # execution id -> when it got that replica
        self.session: aiohttp.ClientSession | None = None

    def open(self) -> aiohttp.ClientSession:
        """The session the upstream requests (and the scrapes) go over."""
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None,
                                                                                            sock_connect=10))
        return self.session

    def tasks(self) -> list:
        """The upstream requests still running."""
        return [s.task for s in self.streams.values() if s.task is not None and not s.task.done()]

    # ------------------------------------------------------------ placing
    def dispatch(self, t: float, ex) -> None:
        """The execution `ex` goes to its engine (placed now if the cluster has not placed it yet)."""
        st = self.streams[ex.id]
        at_once = st.record is not None and st.record.created_at == t     # not held in the proxy queue
        if self.lp.below_url is not None:    # the gateway below places it: counted on replica 0 until it says
            st.replica = 0
        elif not st.tried:                   # placed when dispatched (the proxy before the router)
            r = self.lp.cluster.place(ex)
            st.tried.append(r)
            self.place(st, r, t)
        st.task = asyncio.create_task(self.upstream(ex, st, st.received if at_once else None))
        st.record.dispatched_at = t
        self.views.awaiting[st.replica] += st.prompt_len
        self.views.held[st.replica] += 1

    def place(self, st: Stream, r: int, t: float) -> None:
        """The execution of `st` goes to replica r (the last of st.tried)."""
        st.replica = r
        if self.keep_records and st.record is not None:
            self.exec_replica[st.record.id], self.exec_placed[st.record.id] = r, t

    def move(self, st: Stream, r: int) -> None:
        """The execution of `st` runs on replica r (where the gateway below sent it)."""
        v = self.views
        if r != st.replica:
            if not st.first_token:
                v.awaiting[st.replica] -= st.prompt_len
                v.awaiting[r] += st.prompt_len
            v.held[st.replica] -= 1
            v.held[r] += 1
        self.place(st, r, self.lp.now())

    def reroute(self, st: Stream, ex) -> bool:
        """An engine answered 503 to the execution of `st`: send it to the
        replica the cluster names next (True; the router's retries of one
        proxy before it), if any; otherwise it is refused (False)."""
        r = self.lp.cluster.reroute(ex.call_id, st.tried)
        if r is None:
            return False
        v = self.views
        old = st.replica
        v.awaiting[old] -= st.prompt_len
        v.held[old] -= 1
        self.place(st, r, self.lp.now())
        v.awaiting[st.replica] += st.prompt_len
        v.held[st.replica] += 1
        return True

    # ------------------------------------------------------------ the stream
    async def upstream(self, ex, st: Stream, w_t0: float | None = None) -> None:
        """One execution at the engine: stream it, fan it out, report its end."""
        try:
            await self._stream(ex, st, w_t0)
        finally:
            self.views.held[st.replica] -= 1
            self.views.retire(st)
            self.views.update_waste()

    async def _stream(self, ex, st: Stream, w_t0: float | None) -> None:
        resp = None
        try:
            if w_t0 is not None:
                self.added_s["dispatch"].append(time.monotonic() - w_t0)
            resp = await self._post(ex, st)
            if resp is None:
                return
            async with resp:
                below = self.lp.below_url is not None
                if below:
                    r = self.lp.upstream_replica(resp.headers)
                    if r is not None:
                        self.move(st, r)
                    if resp.status != 200:   # the gateway's own answer, or the engine's passed on
                        await resp.read()
                        self.upstream_refused(ex, st, resp.status, self.lp.below_reason(resp.status, r))
                        return
                if resp.status != 200:       # passed to the subscribers as it came
                    st.error = (resp.status, await resp.read())
                    self.finished(ex, st, "failed")
                    return
                self._accepted(st)
                async for line in resp.content:
                    self._line(st, line)
                if below and not st.first_token:
                    self.cut(ex, st)         # the gateway's read timeout cut the stream before its first token
                    return
                self.finished(ex, st, "completed")
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()                 # the engine sees the disconnect and aborts
            self.forget_first_token(st)
            st.done = True
            st.notify()
            raise
        except (aiohttp.ClientError, TimeoutError):
            if st.accepted and self.lp.below_url is not None and not st.first_token:
                self.cut(ex, st)
            elif st.accepted:
                self.finished(ex, st, "failed")
            else:
                self.engine_refused(ex, st)

    async def _post(self, ex, st: Stream) -> aiohttp.ClientResponse | None:
        """The upstream request of `st`, sent on after each 503 while the
        cluster names another replica; None once the execution is refused."""
        body = dict(st.body, stream=True)
        body["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
        if self.lp.below_url is not None:    # the gateway below balances the engines and answers for them
            return await self.session.post(self.lp.below_url + "/v1/completions", json=body)
        while True:
            resp = await self.session.post(self.views.upstreams[st.replica] + "/v1/completions", json=body)
            if resp.status != 503:
                return resp
            async with resp:
                await resp.read()
            if not self.reroute(st, ex):
                self.engine_refused(ex, st)
                return None

    def _accepted(self, st: Stream) -> None:
        st.accepted = True
        self.views.accepted_live.add(st)
        if st.record is not None:
            st.record.accepted = True

    def _line(self, st: Stream, line: bytes) -> None:
        """One line of the engine's stream: an SSE event is counted and kept for the subscribers."""
        if not line.startswith(b"data: "):
            return
        data = line[6:].strip()
        if data != b"[DONE]":
            try:
                d = json.loads(data)
            except ValueError:
                d = {}
            if d.get("choices"):
                self.first_token(st)
                st.tokens += 1
            if d.get("usage"):
                st.tokens = d["usage"].get("completion_tokens", st.tokens)
        st.chunks.append(b"data: " + data + b"\n\n")
        st.last_at = time.monotonic()
        st.notify()

    # ------------------------------------------------------------ its end
    def first_token(self, st: Stream) -> None:
        if not st.first_token:
            st.first_token = True
            v = self.views
            v.awaiting[st.replica] -= st.prompt_len
            t = self.lp.now()
            v.prompt_rates[self.lp.cluster.group_of[st.replica]].add(t, st.prompt_len)
            if st.record is not None:
                st.record.first_token_at = t

    def forget_first_token(self, st: Stream) -> None:
        if not st.first_token:
            st.first_token = True            # no longer awaited
            self.views.awaiting[st.replica] -= st.prompt_len

    def _ended_refused(self, ex, st: Stream) -> float:
        """The stream of `ex` ends refused and is forgotten; returns the time."""
        self.forget_first_token(st)
        st.fate = "refused"
        st.done = True
        self.streams.pop(ex.id, None)
        return self.lp.now()

    def engine_refused(self, ex, st: Stream) -> None:
        self.metrics.engine_refused.inc()
        t = self._ended_refused(ex, st)
        if st.record is not None:
            st.record.fate, st.record.finished_at = "refused", t
        self.do(t, self.lp.proxy.on_engine_refused(t, ex))

    def upstream_refused(self, ex, st: Stream, status: int, reason: str) -> None:
        """The gateway below answered the execution with an error before any
        token (`status`, `reason`: `LiveProxy.below_reason`): the policy core
        refuses its subscribers with it (`Proxy.on_upstream_refused`)."""
        t = self._ended_refused(ex, st)
        if st.record is not None:
            if st.accepted:                  # an engine took it, and the gateway closed it: the engine aborted it
                st.record.fate, st.record.cancel_requested_at = "aborted", t
            else:
                st.record.fate = "refused"
            st.record.finished_at, st.record.tokens_generated = t, st.tokens
        self.do(t, self.lp.proxy.on_upstream_refused(t, ex, status, None, reason))

    def cut(self, ex, st: Stream) -> None:
        """The gateway below cut the stream before its first token (its read
        timeout, the status already sent): as the simulator's gateway, its
        timeout's answer."""
        self.upstream_refused(ex, st, self.lp.group["timeout_status"], "upstream_timeout")

    def finished(self, ex, st: Stream, fate: str) -> None:
        self.forget_first_token(st)
        st.fate = fate
        st.done = True
        self.metrics.completed.inc()
        self.views.retire(st)
        self.views.update_waste()
        self.streams.pop(ex.id, None)
        t = self.lp.now()
        if st.record is not None:
            # "failed": the engine answered an error, or the connection broke mid-stream
            st.record.fate, st.record.finished_at, st.record.tokens_generated = fate, t, st.tokens
        actions = self.lp.proxy.on_finished(t, ex)
        st.notify()
        self.do(t, actions)
