"""The live proxy (validate/proxy.py) against an in-process streaming stub
standing in for a vLLM OpenAI server (StubEngine: N SSE chunks with a delay,
notices client disconnects, can answer 503). Loopback only."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from sim.conditions import get_condition
from tests.test_live_proxy import proxy_metrics_when
from validate.engine import parse_metrics
from validate.proxy import LiveProxy

N = 8            # chunks per stub stream
DELAY = 0.05     # s between stub chunks


class StubEngine:
    """A stub, not vLLM: streams N token chunks, then usage and [DONE]."""

    def __init__(self, refuse: bool = False, delay: float = DELAY, break_after: int | None = None):
        # break_after: that many chunks, then the connection drops
        self.refuse, self.delay, self.break_after = refuse, delay, break_after
        self.requests: list[dict] = []
        self.completed = 0
        self.disconnects = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request):
        return web.Response(text="vllm:num_requests_waiting 0.0\nvllm:num_requests_running 1.0\n")

    async def completions(self, request):
        body = await request.json()
        self.requests.append(body)
        if self.refuse:
            return web.json_response({"error": "queue full"}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            for i in range(N):
                await asyncio.sleep(self.delay)
                if i == self.break_after:
                    request.transport.abort()        # the engine's connection breaks mid-stream
                    return resp
                d = {"id": "cmpl-stub", "model": "stub", "choices": [{"index": 0, "text": f"t{i} ",
                                                                      "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
            await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % N)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        self.completed += 1
        return resp


BODY = {"model": "stub", "prompt": list(range(25)), "max_tokens": N, "stream": True}
EXPECTED = "".join(f"t{i} " for i in range(N))


async def _read_stream(resp, stop_after: int | None = None) -> tuple[str, list[bytes]]:
    text, raw, n = "", [], 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        raw.append(line)
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        d = json.loads(data)
        for ch in d.get("choices") or []:
            text += ch["text"]
            n += 1
        if stop_after is not None and n >= stop_after:
            break
    return text, raw


def _run(condition: str, scenario, refuse: bool = False, prompt_throughput: float | None = 100.0,
         delay: float = DELAY, break_after: int | None = None):
    async def main():
        stub = StubEngine(refuse, delay, break_after)
        async with TestServer(stub.app()) as up:
            lp = LiveProxy(str(up.make_url("")), get_condition(condition), prompt_throughput=prompt_throughput)
            async with TestServer(lp.app()) as px:
                async with aiohttp.ClientSession() as s:
                    return await scenario(s, str(px.make_url("")), stub, lp)
    return asyncio.run(asyncio.wait_for(main(), 15))


async def _metrics(s, url) -> dict:
    async with s.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


async def wait_until(pred, timeout: float = 5.0) -> None:
    """Wait (polling) until pred() holds, at most `timeout` s: what a stub or
    the proxy does after the client's last read comes at a time a loaded
    machine can delay, so it is waited for, not slept on."""
    t0 = asyncio.get_running_loop().time()
    while not pred() and asyncio.get_running_loop().time() - t0 < timeout:
        await asyncio.sleep(0.02)


def test_completion_passes_through_streaming_and_not():
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            text, raw = await _read_stream(r)
        async with s.post(url + "/v1/completions", json=dict(BODY, stream=False)) as r:
            assert r.status == 200
            whole = await r.json()
        assert text == EXPECTED and raw[-1].strip() == b"data: [DONE]"
        assert whole["choices"][0]["text"] == EXPECTED and whole["usage"]["completion_tokens"] == N
        assert len(stub.requests) == 2 and all(b["stream"] for b in stub.requests)
        m = await _metrics(s, url)
        assert m["llmsim_proxy_executions_created_total"] == 2
        assert m["completion_ratio"] == 1.0 and m["useful_token_ratio"] == 1.0 and m["abort_rate"] == 0.0
    _run("no-control", sc)


def test_a_stream_broken_upstream_is_broken_for_the_client():
    """The engine's connection drops after 3 chunks: the client reads those and
    then an error, never a clean end it could take for a whole answer."""
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            try:
                text, raw = await _read_stream(r)
            except aiohttp.ClientPayloadError:
                raw = None
        assert raw is None, f"the client read a clean end after {raw}"
        async with s.post(url + "/v1/completions", json=dict(BODY, stream=False)) as r:
            assert r.status == 502                   # not the 3 chunks aggregated as a whole answer
        await wait_until(lambda: not lp.streams)
        assert not lp.streams and not lp.accepted_live
    _run("no-control", sc, break_after=3)


def test_attach_replays_the_identical_token_stream():
    async def sc(s, url, stub, lp):
        h = {"X-Call-Id": "c1"}
        async with s.post(url + "/v1/completions", json=BODY, headers=h) as r:
            first, _ = await _read_stream(r, stop_after=3)        # then the client leaves
        await asyncio.sleep(2 * DELAY)
        async with s.post(url + "/v1/completions", json=BODY, headers=dict(h, **{"X-Attempt": "1"})) as r:
            assert r.status == 200
            again, _ = await _read_stream(r)
        assert first == EXPECTED[:len(first)] and len(first) > 0
        assert again == EXPECTED                     # replay of what was streamed, then the rest
        assert len(stub.requests) == 1               # one execution served both attempts
        m = await _metrics(s, url)
        assert m["llmsim_proxy_executions_attached_total"] == 1
        assert m["llmsim_proxy_executions_created_total"] == 1
        assert m['llmsim_proxy_attempts_total{kind="retry"}'] == 1
    # the retry must reach the proxy while the execution still streams: the
    # stub's remaining 5 chunks take 1 s, the retry comes 0.1 s after the leave
    _run("coalesce", sc, delay=0.2)


def test_disconnect_under_now_closes_the_upstream():
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await _read_stream(r)
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await _read_stream(r, stop_after=2)
        await wait_until(lambda: stub.disconnects)
        assert stub.disconnects == 1 and stub.completed == 1
        m = await _metrics(s, url)
        assert m["llmsim_proxy_executions_cancelled_total"] == 1
        assert m["llmsim_proxy_executions_orphaned_total"] == 0
        assert m["abort_rate"] == 0.5 and m["useful_token_ratio"] == 0.5
        assert 0.5 < m["completion_ratio"] < 1.0
        assert m["llmsim_proxy_queue_depth"] == 0
    _run("cancel", sc)


def test_disconnect_under_off_keeps_reading_the_upstream():
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=BODY) as r:
            await _read_stream(r, stop_after=2)
        await wait_until(lambda: stub.completed or stub.disconnects)
        assert stub.disconnects == 0 and stub.completed == 1
        m = await proxy_metrics_when(s, url, "completion_ratio", 1.0, timeout=5.0)
        assert m["llmsim_proxy_executions_orphaned_total"] == 1
        assert m["llmsim_proxy_executions_cancelled_total"] == 0
        assert m["abort_rate"] == 0.0 and m["completion_ratio"] == 1.0
    _run("no-control", sc)


def test_budget_refusal_is_429_with_retry_after():
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=dict(BODY, stream=False), headers={"X-Call-Id": "a"}) as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json=BODY, headers={"X-Call-Id": "a"}) as r:
            assert r.status == 429
            # the estimate from the first call's first token: 25 tokens over the 60 s window
            ra = int(r.headers["Retry-After"])
        assert ra >= 1
        m = await _metrics(s, url)
        assert m['llmsim_proxy_refused_total{reason="budget",status="429"}'] == 1
        assert len(stub.requests) == 1
    _run("budget", sc, prompt_throughput=10.0)


def test_retry_after_is_the_estimate_rounded_up():
    async def sc(s, url, stub, lp):
        lp.proxy.budget.first(0.0)                   # no retry admitted: 0.1 x 1 first attempt < 1
        async with s.post(url + "/v1/completions", json=BODY, headers={"X-Call-Id": "b", "X-Attempt": "1"}) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "3"   # 25 tokens / 10 tokens/s = 2.5 s
    _run("budget", sc, prompt_throughput=10.0)


def test_upstream_503_becomes_503():
    async def sc(s, url, stub, lp):
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 503
            assert "Retry-After" not in r.headers
        m = await proxy_metrics_when(s, url, "llmsim_engine_running", 1.0, timeout=5.0)   # the proxy's first scrape
        assert m["llmsim_proxy_executions_engine_refused_total"] == 1
        assert m['llmsim_proxy_refused_total{reason="engine",status="503"}'] == 1
        assert m["llmsim_proxy_outstanding"] == 0
        assert m["llmsim_engine_running"] == 1.0      # scraped from the stub's /metrics
    _run("engine-cap-100", sc, refuse=True)
