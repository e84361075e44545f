"""The router in the live proxy (validate/proxy.py with several engines) and
the fleet's live run (validate/fleet.py) against in-process mock engines
(MockEngine: k requests at a time, FIFO, max_tokens chunks each; a mock,
not vLLM). Loopback only; a few seconds of wall time."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from sim.conditions import get_condition
from sim.policy.router import RouterConfig, call_key, mix64
from sim.scenario import PAPER
from sim.schema import SCHEMA
from sim.workload import Trace
from tests.test_live_proxy_unit import wait_until
from tests.test_live_run_unit import SlotStub
from validate import engine as E
from validate.fleet import FleetLiveRun, fleet_problem, live_fleet_record, settle
from validate.proxy import LiveProxy


class MockEngine(SlotStub):
    """A mock engine, not vLLM: the live run tests' SlotStub (`slots`
    requests at once, FIFO, max_tokens chunks each) that, with `refuse`,
    answers every request 503 (a full engine's cap), shows `kv` as its
    kv_cache_usage_perc gauge, and lists in `seen` the first prompt token of
    each request it ran, in order."""

    def __init__(self, slots: int = 2, refuse: bool = False, kv: float = 0.0):
        super().__init__(slots)
        self.refuse = refuse
        self.kv = kv
        self.seen: list[int] = []
        self.refused = 0

    async def metrics(self, request):
        resp = await super().metrics(request)
        return web.Response(text=resp.text + f"vllm:kv_cache_usage_perc {self.kv}\n")

    async def completions(self, request):
        body = await request.json()
        if self.refuse:
            self.refused += 1
            return web.json_response({"error": "full"}, status=503)
        self.seen.append(body["prompt"][0])
        return await super().completions(request)


async def _fleet(mocks):
    servers = [TestServer(m.app()) for m in mocks]
    for s in servers:
        await s.start_server()
    return servers, [str(s.make_url("")).rstrip("/") for s in servers]


async def proxy_before(urls, router: RouterConfig, condition: str, fn, scrape_every_s: float = 0.05,
                       extra: dict | None = None):
    """Run `fn(lp, post)` with a LiveProxy before the engines at `urls`;
    `post(call, attempt, head, max_tokens)` sends one streamed request (prompt
    [head, 1, 2, 3], `extra` body fields) and returns (status, headers) once
    its response has ended."""
    lp = LiveProxy(urls, get_condition(condition), prompt_throughput=1000.0, router=router,
                   scrape_every_s=scrape_every_s)
    front = TestServer(lp.app())
    await front.start_server()
    try:
        async with ClientSession() as session:
            async def post(call, attempt=0, head=None, max_tokens=5):
                body = {"model": "tiny-qwen2", "prompt": [head if head is not None else int(call), 1, 2, 3],
                        "max_tokens": max_tokens, "stream": True, **(extra or {})}
                async with session.post(str(front.make_url("/v1/completions")), json=body,
                                        headers={"X-Call-Id": str(call), "X-Attempt": str(attempt)}) as r:
                    await r.read()
                    return r.status, r.headers
            return await fn(lp, post)
    finally:
        await front.close()


async def _with_proxy(mocks, router: RouterConfig, condition: str, fn, scrape_every_s: float = 0.05):
    servers, urls = await _fleet(mocks)
    try:
        return await proxy_before(urls, router, condition, fn, scrape_every_s)
    finally:
        for s in servers:
            await s.close()


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_round_robin_spreads_first_attempts_over_the_engines(placement):
    mocks = [MockEngine(), MockEngine()]

    async def fn(lp, post):
        for c in range(6):
            status, _ = await post(c)
            assert status == 200
        return dict(lp.exec_replica)
    where = asyncio.run(_with_proxy(mocks, RouterConfig("round-robin", 0, placement), "no-retry", fn))
    assert [where[i] for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert mocks[0].seen == [0, 2, 4] and mocks[1].seen == [1, 3, 5]


def test_call_affinity_sends_a_retry_to_the_replica_holding_its_execution():
    """Sidecars with coalescing: the retry of a call whose execution still
    runs attaches to it on the same replica; nothing runs it twice."""
    mocks = [MockEngine(), MockEngine()]

    async def fn(lp, post):
        out = {}
        for c in range(4):
            first = asyncio.create_task(post(c, 0, max_tokens=100))
            await asyncio.sleep(0.1)                          # the first execution is streaming (1 s in all)
            status, h = await post(c, 1, max_tokens=100)
            s0, h0 = await first
            out[c] = (s0, status, h0["X-Execution-Id"], h["X-Execution-Id"], h["X-Attached"])
        return out, dict(lp.exec_replica), lp.proxy.landed, lp.attempt_index
    out, where, landed, index = asyncio.run(
        _with_proxy(mocks, RouterConfig("call-affinity", 1, "replica"), "coalesce", fn))
    for c, (s0, s1, e0, e1, attached) in out.items():
        assert s0 == s1 == 200 and e0 == e1 and attached == "1"
        assert landed[index[(str(c), 0)]] == landed[index[(str(c), 1)]] == mix64(c) % 2 == where[int(e0)]
    assert sorted(mocks[0].seen + mocks[1].seen) == [0, 1, 2, 3]        # one execution a call
    assert len(where) == 4


def test_round_robin_sends_a_retry_elsewhere_and_the_call_runs_twice():
    mocks = [MockEngine(), MockEngine()]

    async def fn(lp, post):
        first = asyncio.create_task(post(7, 0, max_tokens=100))
        await asyncio.sleep(0.1)
        status, h = await post(7, 1, max_tokens=100)
        await first
        return h, dict(lp.exec_replica)
    h, where = asyncio.run(_with_proxy(mocks, RouterConfig("round-robin", 1, "replica"), "coalesce", fn))
    assert h["X-Attached"] == "0" and where == {0: 0, 1: 1}
    assert mocks[0].seen == [7] and mocks[1].seen == [7]


@pytest.mark.parametrize("placement", ["deployment", "replica"])
def test_an_engines_503_is_retried_on_another_replica(placement):
    mocks = [MockEngine(refuse=True), MockEngine()]

    async def fn(lp, post):
        statuses = [(await post(c))[0] for c in range(4)]
        return statuses, dict(lp.exec_replica), lp.rerouted
    statuses, where, rerouted = asyncio.run(
        _with_proxy(mocks, RouterConfig("round-robin", 1, placement), "no-retry", fn))
    assert statuses == [200] * 4
    # round-robin's pointer moves on past the replica it picked: every call tries replica 0 first
    assert mocks[1].seen == [0, 1, 2, 3] and mocks[0].refused == 4
    assert rerouted == 4
    assert list(where.values()).count(1) == 4


def test_without_router_retries_the_engines_503_reaches_the_client():
    mocks = [MockEngine(refuse=True), MockEngine()]

    async def fn(lp, post):
        return [(await post(c))[0] for c in range(2)]
    statuses = asyncio.run(_with_proxy(mocks, RouterConfig("round-robin", 0, "deployment"), "no-retry", fn))
    assert statuses == [503, 200]


def test_least_kv_reads_the_engines_scraped_gauge():
    mocks = [MockEngine(kv=0.9), MockEngine(kv=0.1)]

    async def fn(lp, post):
        await wait_until(lambda: all("vllm:kv_cache_usage_perc" in g for g in lp.engine_gauges))   # a scrape read both
        for c in range(3):
            await post(c)
        return dict(lp.exec_replica)
    where = asyncio.run(_with_proxy(mocks, RouterConfig("least-kv", 0, "deployment"), "no-retry", fn))
    assert set(where.values()) == {1}


def test_least_outstanding_counts_what_the_proxy_sent_and_has_not_seen_end():
    mocks = [MockEngine(), MockEngine()]

    async def fn(lp, post):
        long = asyncio.create_task(post(0, max_tokens=200))      # replica 0 holds one
        await asyncio.sleep(0.1)
        held = list(lp.held)
        await post(1)
        await post(2)
        await long
        return held, dict(lp.exec_replica), list(lp.held)
    held, where, after = asyncio.run(_with_proxy(mocks, RouterConfig("least-outstanding", 0, "deployment"),
                                                 "no-retry", fn))
    assert held == [1, 0] and where[1] == 1 and where[2] == 1 and after == [0, 0]


def test_string_call_ids_hash_as_their_number_or_a_fixed_digest():
    assert call_key("12") == call_key(12) == 12
    assert call_key("abc") == call_key("abc") != call_key("abd")


def _scenario():
    return PAPER.with_(base_s=1.0, pulse_s=1.0, hold_s=3.0, deadline_s=1.0, max_retry_after_s=1.0,
                       delivery_horizon_s=3.0, primary_skip_s=0.5, window_s=1.0, backoff_min_s=0.05,
                       backoff_max_s=0.1)


def test_fleet_live_run_records_each_replica_and_conserves_calls():
    sc = _scenario()
    rng = np.random.default_rng(0)
    arr = np.sort(rng.uniform(0.0, sc.hold_end, 40))
    n = len(arr)
    trace = Trace(arrival=arr, prompt_len=np.full(n, 40, dtype=np.int64), max_tokens=np.full(n, 5, dtype=np.int64),
                  shared_prefix=10)

    async def go():
        mocks = [MockEngine(), MockEngine()]
        servers, urls = await _fleet(mocks)
        try:
            run = FleetLiveRun(urls, "mock", trace, get_condition("coalesce"), sc,
                               RouterConfig("round-robin", 1, "replica"), ["mock", "mock"], seed=0,
                               prompt_throughput=1000.0)
            end = await run._run(until=float(arr[-1]) + sc.delivery_horizon_s)
            return run._log(end, 0.0), mocks
        finally:
            for s in servers:
                await s.close()
    log, mocks = asyncio.run(go())
    rec = live_fleet_record(log, sc, [5.0, 5.0], {"model": "mock", "condition": "coalesce"})
    f = rec["fleet"]
    assert set(SCHEMA.names("fleet")) <= set(f)
    assert sum(f["calls"]) + f["calls_unrouted"] == n
    assert all(c.outcome == "delivered" for c in log.fleet.calls)
    assert f["calls"] == [len(mocks[0].seen), len(mocks[1].seen)] and min(f["calls"]) > 0
    for name, cohort in rec["cohorts"].items():          # each cohort's calls, split over the replicas
        assert sum(r["cohorts"][name]["offered"] for r in rec["replicas"]) == cohort["offered"]
        assert sum(r["cohorts"][name]["delivered"] for r in rec["replicas"]) == cohort["delivered"]
    assert rec["replicas"][0]["counters"]["prefix_cache_queries_total"] == 40 * len(mocks[0].seen)
    assert rec["source"] == "live" and all(r["source"] == "live" for r in rec["replicas"])
    assert f["split_calls"] == 0 and f["router"] == "round-robin"


def test_fleet_problem_names_replicas_beyond_the_cores():
    assert fleet_problem(0) is not None
    assert "core" in fleet_problem(10_000)


def test_fleet_problem_names_replicas_beyond_the_memory(monkeypatch):
    import validate.fleet as F
    monkeypatch.setattr(F, "available_gib", lambda: 4.0)
    assert F.fleet_problem(1) is None
    assert "GiB" in F.fleet_problem(2) and "4.0 GiB is available" in F.fleet_problem(2)


def test_llmsim_proxy_before_several_engines_routes_by_call_and_names_an_engine_that_does_not_answer(capsys):
    """`llmsim proxy` with two --upstream engines (mocks) and call affinity:
    every attempt of a call reaches the engine its call id hashes to; an
    engine that does not answer at start is named on stderr."""
    import socket

    from validate import proxy as P
    mocks = [MockEngine(), MockEngine()]

    async def scenario():
        servers, urls = await _fleet(mocks)
        ports = []
        for _ in range(2):              # the proxy's, and one where nothing listens
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                ports.append(sock.getsockname()[1])
        port, closed = ports
        started = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(P.serve(urls, get_condition("coalesce"), port,
                                           ready=lambda lp, site: started.set_result(lp),
                                           router=RouterConfig("call-affinity", 1, "replica")))
        try:
            lp = await asyncio.wait_for(started, 10)
            async with ClientSession() as s:
                for c in range(8):
                    for attempt in (0, 1):
                        body = {"model": "m", "prompt": [c, 1, 2, 3], "max_tokens": 3, "stream": True}
                        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                          headers={"X-Call-Id": str(c), "X-Attempt": str(attempt)}) as r:
                            assert r.status == 200
                            await r.read()
            assert lp.router is not None and lp.cluster.placement == "replica"
            missing = await P.unreachable([urls[0], f"http://127.0.0.1:{closed}"], 2.0)
            return missing
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for srv in servers:
                await srv.close()
    missing = asyncio.run(scenario())
    for r in (0, 1):
        want = [c for c in range(8) if mix64(c) % 2 == r]
        assert want and sorted(set(mocks[r].seen)) == want
    assert len(missing) == 1 and "does not answer" in missing[0]


def test_settle_waits_out_an_engine_too_busy_to_answer_its_metrics():
    """Between points an engine still draining may not answer /metrics in
    time: settle keeps waiting (up to its limit) instead of failing the fleet."""
    gone = E.Engine(url=f"http://127.0.0.1:{E.free_port()}")     # nothing listens: no answer
    t0 = time.monotonic()
    settle([gone], wait_s=1.0, reset=False)
    assert time.monotonic() - t0 >= 1.0
