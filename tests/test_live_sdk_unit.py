"""The live run with the real OpenAI SDK as its client (validate/sdk_client.py)
against an in-process stub standing in for a vLLM server (`SlotStub` of
test_live_run_unit: it is a stub, not vLLM), through the live proxy.
Loopback only; a few seconds of wall time. The SDK's retries, timeouts and
backoff are its own; these tests check what the harness records of them."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sim.conditions import get_condition
from sim.policy.presets import preset
from sim.workload import Trace
from test_live_run_unit import SlotStub, _scenario, _trace
from validate.live_run import LiveRun, live_record
from validate.sdk_client import attempt_outcome, give_up_outcome, sdk_options

pytest.importorskip("openai")


async def _live(layer, cond, trace, sc, slots=2):
    from aiohttp.test_utils import TestServer
    stub = SlotStub(slots)
    server = TestServer(stub.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        run = LiveRun(url, "stub", trace, get_condition(cond), sc, seed=0, client_layer=layer)
        end = await run._run(until=float(trace.arrival[-1]) + sc.delivery_horizon_s)
        return run, run._log(end, 0.0), stub
    finally:
        await server.close()


def test_sdk_options_take_timeout_and_retries_and_refuse_what_the_sdk_has_not():
    assert sdk_options(preset("client", "openai-python")) == {"max_retries": 2}    # the SDK's own defaults
    assert sdk_options(preset("client", "openai-python", timeout_s=60, max_retries=5)) == \
        {"max_retries": 5, "timeout": 60.0}
    assert sdk_options(preset("client", "langchain-openai")) == {"max_retries": 2, "timeout": None}
    with pytest.raises(ValueError, match=r"^backoff_base_s: the OpenAI Python SDK has no setting"):
        sdk_options(preset("client", "openai-python", backoff_base_s=2.0))
    with pytest.raises(ValueError, match=r"^preset: .*'langchain-with-retry' has no live client"):
        sdk_options(preset("client", "langchain-with-retry"))


def test_outcomes_of_answers_and_give_ups():
    assert attempt_outcome(429, {"X-Refused-Reason": "budget"}) == "refused_budget"
    assert attempt_outcome(503, {"X-Refused-Reason": "engine"}) == "refused_engine"
    assert attempt_outcome(504, {}) == "error"                 # no gateway in the stack
    assert attempt_outcome(504, {}, gateway=True) == "refused_gateway"       # nginx's read timeout
    assert attempt_outcome(503, {}, gateway=True) == "refused_gateway"       # HAProxy's queue
    assert attempt_outcome(503, {"X-Refused-Reason": "engine"}, gateway=True) == "refused_engine"

    class Resp:
        status_code, headers = 429, {"retry-after": "300"}

    class Err(Exception):
        response = Resp()
    assert give_up_outcome(Err(), 120.0) == "failed_retry_after"
    Resp.headers = {"retry-after": "3"}
    assert give_up_outcome(Err(), 120.0) == "failed_attempts"
    assert give_up_outcome(ValueError(), 120.0) == "failed_attempts"


def test_a_condition_without_retries_turns_the_sdks_off():
    sc = _scenario(deadline=3.0)
    tr = Trace(arrival=np.array([0.0]), prompt_len=np.full(1, 40, dtype=np.int64),
               max_tokens=np.full(1, 200, dtype=np.int64), shared_prefix=10)
    layer = preset("client", "openai-python", timeout_s=0.3)
    run, log, _ = asyncio.run(_live(layer, "no-retry", tr, sc, slots=1))
    assert [c.outcome for c in log.calls] == ["failed_attempts"] and len(log.attempts) == 1
    assert log.attempts[0].outcome == "timeout"


def test_sdk_light_load_every_call_delivered_one_attempt_each():
    sc = _scenario(deadline=3.0)
    tr = _trace(sc, 3.0, 3.0)
    run, log, stub = asyncio.run(_live(preset("client", "openai-python"), "no-retry", tr, sc))
    assert all(c.outcome == "delivered" and c.attempts == 1 for c in log.calls)
    assert len(log.attempts) == len(tr) == len(log.executions) == stub.completed
    assert all(a.number == 0 and a.outcome == "complete" and a.execution >= 0 for a in log.attempts)
    assert all(a.ended_at >= a.sent_at for a in log.attempts)
    rec = live_record(log, sc, 3.0, {"model": "stub", "condition": "no-retry", "pulse": 1.0, "seed": 0})
    assert rec["cohorts"]["hold"]["delivered"] == rec["cohorts"]["hold"]["offered"] > 0
    assert rec["extra"]["client"]["software"] == "openai-python" and rec["extra"]["client"]["options"] == \
        {"max_retries": 0}      # no-retry: the SDK too


def test_sdk_timeouts_are_retried_by_the_sdk_and_recorded_per_attempt():
    sc = _scenario(deadline=3.0)
    n = 3
    # each call needs 2 s of tokens; the SDK gives an attempt 0.4 s and retries twice
    tr = Trace(arrival=np.array([0.0, 0.05, 0.1]), prompt_len=np.full(n, 40, dtype=np.int64),
               max_tokens=np.full(n, 200, dtype=np.int64), shared_prefix=10)
    layer = preset("client", "openai-python", timeout_s=0.4, max_retries=2)
    run, log, stub = asyncio.run(_live(layer, "cancel", tr, sc, slots=3))
    assert all(c.outcome == "failed_attempts" and c.attempts == 3 for c in log.calls)
    for i in range(n):
        mine = sorted((a for a in log.attempts if a.call == i), key=lambda a: a.number)
        assert [a.number for a in mine] == [0, 1, 2]
        assert all(a.outcome == "timeout" for a in mine)
        # the SDK's own backoff between attempts: 0.5 s x 2^k less up to 25 % (openai _calculate_retry_timeout)
        waits = [b.sent_at - a.ended_at for a, b in zip(mine, mine[1:])]
        assert 0.3 < waits[0] < 0.6 and 0.7 < waits[1] < 1.2
        # each attempt's execution, joined by the SDK's retry count (sent as X-Attempt), was cancelled
        ex = {e.id: e for e in log.executions}
        assert [ex[a.execution].attempt for a in mine] == [0, 1, 2]
        assert all(ex[a.execution].fate == "aborted" and not a.attached for a in mine)
    assert len(log.executions) == 3 * n
    assert run.errors.get("sdk:APITimeoutError") == n


def test_the_sdk_sends_the_calls_token_ids_as_the_prompt():
    seen = []

    class Recording(SlotStub):
        async def completions(self, request):
            seen.append(await request.json())
            return await super().completions(request)

    async def go():
        from aiohttp.test_utils import TestServer
        stub = Recording(2)
        server = TestServer(stub.app())
        await server.start_server()
        try:
            sc = _scenario(deadline=3.0)
            tr = _trace(sc, 2.0, 2.0)
            run = LiveRun(str(server.make_url("")).rstrip("/"), "stub", tr, get_condition("no-retry"), sc, seed=0,
                          client_layer=preset("client", "openai-python"))
            await run._run(until=float(tr.arrival[-1]) + sc.delivery_horizon_s)
            return run
        finally:
            await server.close()
    run = asyncio.run(go())
    assert len(seen) == len(run.trace)
    by_prompt = sorted(tuple(b["prompt"]) for b in seen)
    assert by_prompt == sorted(tuple(run.prompts[i]) for i in range(len(run.trace)))
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 10 for b in seen)
