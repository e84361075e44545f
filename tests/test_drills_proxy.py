"""Drills: the live proxy's exposure and memory limits, against the in-process
stub of tests/test_live_proxy_unit.py (a stub, not vLLM). A body over the
size limit is 413; a malformed X-Call-Id or X-Attempt, a body that is not an
object, a bad max_tokens are 400; nothing in a request reaches another
upstream; the proxy binds 127.0.0.1 by default; an execution's replay buffer
is released once it has ended and its last subscriber has left; the waste
gauges and the call-id memory stay bounded."""
from __future__ import annotations

import asyncio
import gc
import inspect
import weakref

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from sim.conditions import get_condition
from test_live_proxy_unit import BODY, EXPECTED, N, StubEngine, _read_stream
from validate import proxy as P, proxy_http
from validate.proxy import LiveProxy


def run(condition, scenario, **kw):
    async def main():
        stub, other = StubEngine(), StubEngine()
        async with TestServer(stub.app()) as up, TestServer(other.app()) as elsewhere:
            lp = LiveProxy(str(up.make_url("")), get_condition(condition), prompt_throughput=100.0, **kw)
            async with TestServer(lp.app()) as px:
                async with aiohttp.ClientSession() as s:
                    return await scenario(s, str(px.make_url("")), stub, lp, other, str(elsewhere.make_url("")))
    return asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("headers,body", [
    ({"X-Call-Id": ""}, BODY), ({"X-Call-Id": "a b"}, BODY), ({"X-Call-Id": "x" * 129}, BODY),
    ({"X-Call-Id": "ok/../x"}, BODY), ({"X-Call-Id": "é"}, BODY), ({"X-Call-Id": "1", "X-Attempt": "-1"}, BODY),
    ({"X-Call-Id": "1", "X-Attempt": "1e3"}, BODY), ({"X-Call-Id": "1", "X-Attempt": "10000000"}, BODY),
    ({}, [1, 2]), ({}, dict(BODY, max_tokens="8")), ({}, dict(BODY, max_tokens=0)), ({}, dict(BODY, max_tokens=True)),
])
def test_a_malformed_request_is_refused_with_400_and_never_reaches_the_engine(headers, body):
    async def sc(s, url, stub, lp, *_):
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 400, await r.text()
        assert stub.requests == [] and lp.streams == {} and lp.waiters == {}
    run("coalesce", sc)


def test_a_body_over_the_size_limit_is_413():
    async def sc(s, url, stub, lp, *_):
        big = dict(BODY, prompt=list(range(2000)))              # ~10 KB of JSON
        async with s.post(url + "/v1/completions", json=big, headers={"X-Call-Id": "1"}) as r:
            assert r.status == 413
        async with s.post(url + "/v1/completions", json=BODY, headers={"X-Call-Id": "2"}) as r:
            assert r.status == 200 and (await _read_stream(r))[0] == EXPECTED
        assert len(stub.requests) == 1
    run("coalesce", sc, max_body_bytes=4096)
    assert P.MAX_BODY_BYTES == 4 * 1024 * 1024


def test_no_request_can_steer_the_upstream():
    async def sc(s, url, stub, lp, other, other_url):
        host = other_url.split("//", 1)[1].rstrip("/")
        tricks = [({"Host": host, "X-Forwarded-Host": host, "X-Call-Id": "1"}, BODY, "/v1/completions"),
                  ({"X-Call-Id": "2"}, dict(BODY, upstream=other_url, base_url=other_url),
                   f"/v1/completions?upstream={other_url}")]
        for headers, body, path in tricks:
            async with s.post(url + path, json=body, headers=headers) as r:
                assert r.status == 200 and (await _read_stream(r))[0] == EXPECTED
        async with s.post(url + "/" + other_url, json=BODY) as r:             # a proxy-style absolute path
            assert r.status == 404
        assert len(stub.requests) == 2 and other.requests == []
    run("coalesce", sc)


def test_the_proxy_binds_loopback_unless_told_otherwise():
    assert inspect.signature(P.serve).parameters["host"].default == "127.0.0.1"
    from llmsim.cli import build_parser
    a = build_parser().parse_args(["proxy", "--upstream", "http://127.0.0.1:8000"])
    assert a.host == "127.0.0.1"


def test_a_replay_buffer_is_freed_when_its_execution_ends_and_its_last_subscriber_leaves():
    """Coalescing, no cancellation: the first attempt leaves early (the execution
    runs on, orphaned), a retry attaches and replays; once the execution has
    finished and the retry has read it, nothing holds the stream."""
    async def sc(s, url, stub, lp, *_):
        h = {"X-Call-Id": "7"}
        async with s.post(url + "/v1/completions", json=BODY, headers=h) as r:
            await _read_stream(r, stop_after=2)
        (st,) = lp.streams.values()
        ref = weakref.ref(st)
        del st
        async with s.post(url + "/v1/completions", json=BODY, headers=dict(h, **{"X-Attempt": "1"})) as r:
            assert r.headers["X-Attached"] == "1"
            assert (await _read_stream(r))[0] == EXPECTED
        for _ in range(50):
            await asyncio.sleep(0.02)
            gc.collect()
            if ref() is None:
                break
        assert ref() is None, gc.get_referrers(ref())
        assert lp.streams == {} and lp.waiters == {} and not lp.accepted_live
        assert lp.accepted_ended["n"] == 1 and lp.accepted_ended["tokens"] == N
    run("coalesce", sc)


def test_the_standalone_proxy_keeps_no_per_attempt_records_and_forgets_old_call_ids(monkeypatch):
    monkeypatch.setattr(proxy_http, "CALL_MEMORY", 5)

    async def sc(s, url, stub, lp, *_):
        for i in range(12):
            async with s.post(url + "/v1/completions", json=dict(BODY, stream=False),
                               headers={"X-Call-Id": f"c{i}"}) as r:
                assert r.status == 200
        assert lp.executions == [] and lp.subscriptions == {}
        assert list(lp.attempt_counts) == [f"c{i}" for i in range(7, 12)]
        async with s.get(url + "/stats") as r:
            st = await r.json()
        assert st["added_latency_s"]["dispatch"]["n"] == 12 and st["added_latency_s"]["dispatch"]["p99"] >= 0
        assert st["live"] == {"streams": 0, "waiters": 0, "accepted_live": 0, "call_ids": 5}
    run("coalesce", sc, keep_records=False)
