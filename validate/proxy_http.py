"""The live proxy's HTTP side (`validate.proxy.LiveProxy`): the aiohttp
application (`POST /v1/completions`, `/metrics`, `/stats`, `/health`); a
request checked (its body, `max_tokens`, headers: 400 on a bad one) and
turned into an attempt (its call from `X-Call-Id`, else a call of its own;
its number from `X-Attempt`, else counted per call id over the last
`CALL_MEMORY` call ids; its class from `X-Class`; behind a gateway's upstream
group, the replica of the port it came in on) that enters the chain of
layers; and the response the attempt is served once it has its answer: the
refusal (with `Retry-After` and `X-Refused-Reason`), the execution's stream
(SSE), or the completion aggregated from it. A client that leaves is the
attempt's disconnect."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import OrderedDict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sim.policy.proxy import Attempt, Refuse

from .proxy_engines import Stream

DEFAULT_MAX_TOKENS = 16      # the OpenAI completions default
MAX_BODY_BYTES = 4 * 1024 * 1024
CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ATTEMPT_MAX = 999_999
CALL_MEMORY = 100_000        # call ids whose attempt count is kept (oldest forgotten first)


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


class RequestAttempt(Attempt):
    """A client's attempt (an HTTP request) with its `Waiter` as its `row`
    (the row an upstream attempt serving it carries: `Interpreter._send_below`)
    and, behind a gateway's upstream group, the replica its gateway picked
    (`server`)."""
    __slots__ = ("row", "server")


class HttpSide:
    """The HTTP side of the live proxy `lp` (its chain of layers, clock,
    parts and records); `waiters` holds the attempts being served (id(attempt) ->
    `Waiter`), `attempt_counts` the attempts counted per call id."""

    def __init__(self, lp, max_body_bytes: int = MAX_BODY_BYTES):
        self.lp, self.max_body_bytes = lp, max_body_bytes
        self.waiters: dict[int, Waiter] = {}       # id(attempt) -> waiter
        self.attempt_counts: OrderedDict[str, int] = OrderedDict()
        self._anon = 0
        # the way into the chain of layers (`Interpreter._chain`, wired before the HTTP side is made)
        self.do, self.enter, self.enter_left, self.disconnect = lp._do, lp._enter, lp._enter_left, lp._disconnect

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
        self.lp.views.start(self.lp.engines.open())

    async def _cleanup(self, _app) -> None:
        tasks = self.lp.engines.tasks()
        if self.lp.views.scraper is not None:
            tasks.append(self.lp.views.scraper)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.lp.engines.session.close()

    # ------------------------------------------------------------ handlers
    async def handle_metrics(self, request: web.Request) -> web.Response:
        self.lp.views.update_waste()
        return web.Response(body=generate_latest(self.lp.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def handle_stats(self, request: web.Request) -> web.Response:
        lp = self.lp
        return web.json_response({"added_latency_s": {k: _quantiles(v) for k, v in lp.added_s.items()},
                                  "live": {"streams": len(lp.streams), "waiters": len(self.waiters),
                                           "accepted_live": len(lp.accepted_live),
                                           "call_ids": len(self.attempt_counts)},
                                  "ended": dict(lp.views.fates)})

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        body = await _body(request)
        mt = body.get("max_tokens")
        att = self.attempt(request)
        lp = self.lp
        lp.metrics.attempts.labels("retry" if att.number > 0 else "first").inc()
        params = (json.dumps(body, sort_keys=True, separators=(",", ":")),)
        plen = prompt_tokens(body.get("prompt"))
        w = att.row = self.waiters[id(att)] = Waiter(body, plen, mt or DEFAULT_MAX_TOKENS, received)
        w.params = params
        t = lp.now()
        try:
            self.do(t, self.enter(t, att, params, plen))
            return await self._serve(request, att, w, bool(body.get("stream")))
        except (asyncio.CancelledError, ConnectionResetError) as e:
            if att.open:
                self.disconnect(lp.now(), att, self.enter_left)
            if isinstance(e, ConnectionResetError):
                # the client left while its stream was being written: the same
                # as a disconnect noticed by the server (not a server error)
                raise asyncio.CancelledError from None
            raise
        finally:
            self.waiters.pop(id(att), None)

    # ------------------------------------------------------------ the attempt
    def attempt(self, request: web.Request) -> Attempt:
        """The attempt a request is: its call, number, class and (behind a gateway's group) replica."""
        call = self._call_id(request)
        att = RequestAttempt(call, self._number(call, request.headers.get("X-Attempt")),
                             klass=_header(request, "X-Class"))
        group = self.lp.group is not None and not self.lp.below      # behind the group: a port per replica
        att.server = self.lp.server_ports.get(request.transport.get_extra_info("sockname")[1]) if group else None
        if group and att.server is None:
            raise web.HTTPNotFound(text="behind a gateway's upstream group a request comes in on a replica's port")
        return att

    def _call_id(self, request: web.Request) -> str:
        """The request's `X-Call-Id`; without one, a call of its own."""
        call = _header(request, "X-Call-Id")
        if call is None:
            self._anon += 1
            call = f"anon-{self._anon}"
        return call

    def _number(self, call: str, n: str | None) -> int:
        """The attempt's number: `X-Attempt` (`n`) if given, else the next of
        its call; the call's count is kept among the last `CALL_MEMORY`."""
        counts = self.attempt_counts
        if n is not None:
            if not (n.isascii() and n.isdigit() and int(n) <= ATTEMPT_MAX):
                raise web.HTTPBadRequest(text=f"X-Attempt must be a whole number from 0 to {ATTEMPT_MAX}")
            number = int(n)
            counts[call] = max(counts.get(call, 0), number + 1)
        else:
            number = counts.get(call, 0)
            counts[call] = number + 1
        counts.move_to_end(call)
        while len(counts) > CALL_MEMORY:
            counts.popitem(last=False)
        return number

    # ------------------------------------------------------------ the response
    async def _serve(self, request, att: Attempt, w: Waiter, streaming: bool) -> web.StreamResponse:
        await self._answered(w)
        if w.refused is not None:
            return _refusal(w.refused)
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
            if st.fate == "failed":          # the engine's stream broke off: no answer to aggregate
                return web.json_response({"error": {"message": "the engine's stream broke off", "code": 502}},
                                         status=502, headers=ids)
            return web.json_response(_aggregate(st.chunks), headers=ids)
        return await self._stream_out(request, w, st, ids)

    async def _answered(self, w: Waiter) -> None:
        """Wait until the attempt is refused, completes, or (with no layer
        above the policy core, which answers once it has the answer) its
        stream has output."""
        while w.refused is None and not w.completed and not (w.stream is not None and w.stream.chunks
                                                             and not self.lp.layers):
            waits = [w.changed.wait()] + ([w.stream.changed.wait()] if w.stream is not None else [])
            tasks = [asyncio.ensure_future(x) for x in waits]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for x in tasks:
                    x.cancel()

    async def _stream_out(self, request, w: Waiter, st: Stream, ids: dict) -> web.StreamResponse:
        """The execution's stream as SSE, to the attempt's end."""
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
                    self.lp.added_s["forward"].append(time.monotonic() - st.last_at)
            if w.completed:
                break
            await st.changed.wait()
            waited = True
        if st.fate == "failed":
            # the engine's stream broke off: so does the attempt's, without the last
            # chunk, so that its client reads an error, not an answer cut short
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp


async def _body(request: web.Request) -> dict:
    """The request's body: a JSON object whose `max_tokens`, if given, is a positive whole number."""
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError
    except ValueError:
        raise web.HTTPBadRequest(text="body must be a JSON object") from None
    mt = body.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise web.HTTPBadRequest(text="max_tokens must be a positive whole number")
    return body


def _header(request: web.Request, name: str) -> str | None:
    """A call id or class header: 1-128 characters of A-Za-z0-9._:- (None if absent)."""
    v = request.headers.get(name)
    if v is not None and not CALL_ID.fullmatch(v):
        raise web.HTTPBadRequest(text=f"{name} must be 1-128 characters of A-Za-z0-9._:-")
    return v


def _refusal(r: Refuse) -> web.Response:
    """A refusal's response: its status, reason and (a 429's) `Retry-After` in whole seconds, rounded up."""
    headers = {"X-Refused-Reason": r.reason}
    if r.status == 429 and r.retry_after is not None:
        headers["Retry-After"] = str(max(0, math.ceil(r.retry_after))) if math.isfinite(r.retry_after) \
            else "3600"
    return web.json_response({"error": {"message": f"refused ({r.reason})", "code": r.status}},
                             status=r.status, headers=headers)


def _quantiles(xs) -> dict:
    """p50 / p99 (nearest rank) and the count of a sample."""
    v = sorted(xs)
    if not v:
        return {"n": 0, "p50": None, "p99": None}
    at = lambda q: v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]   # noqa: E731
    return {"n": len(v), "p50": at(0.50), "p99": at(0.99)}


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
