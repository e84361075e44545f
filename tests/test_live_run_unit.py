"""The live run's own logic (validate/live_run.py: the policy core's retrying
client over HTTP through the live proxy, the RunLog and the result record) against
an in-process stub standing in for a vLLM server (SlotStub: k requests at a
time, FIFO, max_tokens chunks each; it is a stub, not vLLM). Loopback only;
a few seconds of wall time."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sim.conditions import compose, get_condition
from sim.scenario import PAPER
from sim.workload import Trace
from validate.live_run import LiveRun, live_record
from validate.validation import agreement, table

TOKEN_S = 0.01      # stub seconds per output token


class SlotStub:
    """A stub engine, not vLLM: `slots` requests run at once, the rest wait
    in FIFO order; each streams max_tokens chunks TOKEN_S apart."""

    def __init__(self, slots: int = 2):
        self.sem = asyncio.Semaphore(slots)
        self.waiting = self.running = 0
        self.prompt_tokens = self.queries = 0
        self.completed = self.aborted = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)     # as vLLM's (a gateway's active checks)
        return app

    async def health(self, request):
        return web.Response()

    async def metrics(self, request):
        return web.Response(text=f"vllm:num_requests_waiting {self.waiting}\n"
                                 f"vllm:num_requests_running {self.running}\n"
                                 f"vllm:prompt_tokens_total {self.prompt_tokens}\n"
                                 f"vllm:prefix_cache_queries_total {self.queries}\n"
                                 f"vllm:prefix_cache_hits_total 0\n")

    async def completions(self, request):
        body = await request.json()
        n = int(body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.waiting += 1
        try:
            async with self.sem:
                self.waiting -= 1
                self.running += 1
                self.queries += len(body["prompt"])
                try:
                    for i in range(n):
                        await asyncio.sleep(TOKEN_S)
                        if i == 0:
                            self.prompt_tokens += len(body["prompt"])
                        d = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                        await resp.write(b"data: " + json.dumps(d).encode() + b"\n\n")
                    await resp.write(b"data: [DONE]\n\n")
                    self.completed += 1
                finally:
                    self.running -= 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        return resp


def _scenario(deadline=1.0):
    # 2 s base, 2 s pulse, 6 s hold; 1 s windows
    return PAPER.with_(base_s=2.0, pulse_s=2.0, hold_s=6.0, deadline_s=deadline, max_retry_after_s=deadline,
                       delivery_horizon_s=8.0, primary_skip_s=1.0, window_s=1.0, backoff_min_s=0.05,
                       backoff_max_s=0.1)


def _trace(sc, rate_base, rate_pulse, tokens=10, seed=0):
    rng = np.random.default_rng(seed)
    arr = []
    for a, b, r in ((0, sc.base_s, rate_base), (sc.pulse_start, sc.pulse_end, rate_pulse),
                    (sc.pulse_end, sc.hold_end, rate_base)):
        t = a + np.cumsum(rng.exponential(1 / r, int(3 * r * (b - a)) + 5))
        arr.append(t[t < b])
    arr = np.concatenate(arr)
    n = len(arr)
    return Trace(arrival=arr, prompt_len=np.full(n, 40, dtype=np.int64),
                 max_tokens=np.full(n, tokens, dtype=np.int64), shared_prefix=10)


async def _live(cond, trace, sc, slots=2):
    stub = SlotStub(slots)
    server = TestServer(stub.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        run = LiveRun(url, "stub", trace, get_condition(cond) if isinstance(cond, str) else cond, sc, seed=0)
        end = await run._run(until=float(trace.arrival[-1]) + sc.delivery_horizon_s)
        return run._log(end, 0.0), stub
    finally:
        await server.close()


def test_light_load_every_call_delivered_and_records_join():
    sc = _scenario(deadline=3.0)
    tr = _trace(sc, 3.0, 3.0)        # 0.1 s of work per call, 2 slots: far below capacity
    log, stub = asyncio.run(_live("no-retry", tr, sc))
    assert all(c.outcome == "delivered" for c in log.calls)
    assert len(log.attempts) == len(tr) == len(log.executions) == stub.completed
    # each attempt names the execution it got; every execution completed with its tokens
    assert sorted(a.execution for a in log.attempts) == list(range(len(tr)))
    assert all(e.fate == "completed" and e.tokens_generated == 10 and e.accepted for e in log.executions)
    assert all(e.first_token_at >= e.dispatched_at >= e.created_at for e in log.executions)
    rec = live_record(log, sc, 3.0, {"model": "stub", "condition": "no-retry", "pulse": 1.0, "seed": 0})
    assert rec["cohorts"]["hold"]["delivered"] == rec["cohorts"]["hold"]["offered"] > 0
    assert rec["counters"]["prompt_tokens_total"] == 40 * len(tr)
    assert rec["prompt_tokens"]["computed"] == 40 * len(tr)      # queries - hits
    assert rec["retries"]["never_scheduled"] is None and "retries.never_scheduled" in rec["unmeasured"]
    assert len(rec["series"]["t"]) >= int(tr.arrival[-1])


def test_overload_with_coalescing_attaches_retries_to_live_executions():
    sc = _scenario(deadline=0.6)
    tr = _trace(sc, 2.0, 40.0, tokens=12)     # pulse far above the stub's 2 x 8 calls/s
    log, stub = asyncio.run(_live("coalesce", tr, sc, slots=2))
    att = [a for a in log.attempts if a.attached]
    assert att, "some retry attached to its call's live execution"
    ex_call = {e.id: e.call for e in log.executions}
    assert all(ex_call[a.execution] == a.call and a.number > 0 for a in att)
    # coalescing: never more than one live execution per call at a time, so
    # executions created <= calls + those whose predecessor had ended
    assert len(log.executions) < len(log.attempts)
    assert any(a.outcome == "timeout" for a in log.attempts)
    assert sum(c.outcome == "delivered" for c in log.calls) > 0


def test_retry_budget_refusals_reach_the_client_as_429():
    sc = _scenario(deadline=0.5)
    tr = _trace(sc, 2.0, 40.0, tokens=12)
    log, _ = asyncio.run(_live("budget", tr, sc, slots=1))
    refused = [a for a in log.attempts if a.outcome == "refused_budget"]
    assert refused and all(a.number > 0 and a.execution == -1 for a in refused)
    rec = live_record(log, sc, 2.0, {"model": "stub", "condition": "budget", "pulse": 1.0, "seed": 0})
    assert rec["retries"]["refused_budget"] == len(refused)


def test_side_by_side_table_and_agreement_bar():
    def r(recovered, pulse, hold):
        return {"recovered": recovered, "recovery_time_s": 60.0 if recovered else None,
                "cohorts": {"pulse": {"offered": 100, "delivered": pulse, "within_deadline": pulse},
                            "hold": {"offered": 200, "delivered": hold, "within_deadline": hold}},
                "rates_xC": {"created": 1.0, "accepted": 0.9},
                "counters_hold": {"prefix_cache_queries": 1000, "prompt_tokens": 900},
                "engine": {"steps": 5000}}
    p = {"condition": "no-retry", "sim": r(True, 50, 150), "live": r(True, 60, 100)}
    ag = agreement(p)
    assert ag["recovered"] and ag["pulse"] and not ag["hold"] and not ag["all"]
    assert ag["hold_delivered_diff"] == -25.0
    out = table([p])
    assert "hold delivered %" in out and "-25.0" in out and "counter gap" in out
    p2 = {"condition": "x", "sim": r(True, 50, 150), "live": r(False, 50, 150)}
    assert "DIFFER" in table([p2]) and not agreement(p2)["recovered"]
    # with the step-adjusted prediction: two more columns
    p3 = dict(p, sim_step_adjusted=r(True, 58, 110))
    p3["live"] = dict(p["live"], step_time_vs_profile={"ratio": 1.2})
    out = table([p3])
    pulse_line = out.split("pulse delivered %")[1].split("\n")[0].split()
    assert "sim x k" in out and "1.200 x the profile" in out
    assert pulse_line == ["50.0", "60.0", "+10.0", "58.0", "+2.00"]


def test_proxy_cap_holds_executions_in_the_proxy_queue():
    sc = _scenario(deadline=0.8)
    tr = _trace(sc, 2.0, 30.0, tokens=10)
    cond = compose("no-control", cancel="now", proxy_cap=2)
    log, stub = asyncio.run(_live(cond, tr, sc, slots=2))
    assert log.series.proxy_queue.max() > 0                  # sampled from the proxy's queue
    assert log.series.waiting.max() == 0                     # never more than the cap reached the stub
    queued = [e for e in log.executions if e.dispatched_at > e.created_at + 0.05]
    assert queued, "some executions waited in the proxy before dispatch"
    dropped = [e for e in log.executions if e.fate == "dropped"]
    assert all(e.dispatched_at != e.dispatched_at for e in dropped)   # dropped ones never reached the engine
    # every attempt that subscribed names its execution, also those that timed out while it was queued
    assert all(a.execution >= 0 for a in log.attempts if a.outcome in ("timeout", "complete"))


def test_deferred_cancellation_waits_before_closing_the_upstream():
    sc = _scenario(deadline=0.3)
    n = 3
    tr = Trace(arrival=np.array([0.0, 0.01, 0.02]), prompt_len=np.full(n, 40, dtype=np.int64),
               max_tokens=np.full(n, 200, dtype=np.int64), shared_prefix=10)   # 2 s of tokens each
    cond = compose("no-retry", cancel="deferred:0.5")
    log, stub = asyncio.run(_live(cond, tr, sc, slots=3))
    assert all(a.outcome == "timeout" for a in log.attempts)
    for e in log.executions:
        assert e.fate == "aborted"
        left = min(a.ended_at for a in log.attempts if a.execution == e.id)
        # never before W; the upper bound allows for a loaded machine's event loop
        assert 0.5 - 0.02 <= e.cancel_requested_at - left < 0.5 + 2.0
    assert stub.aborted == n and stub.completed == 0


def test_step_time_ratio_against_the_profile_and_scaled_prediction(tmp_path):
    from sim.profile import load_profile
    from validate.validation import scaled_profile, step_time_ratio
    prof = load_profile("vllm-cpu-tiny")
    st = prof.step_time
    # recorded steps that took exactly 1.5 x what the profile predicts
    lines = []
    t = 0.0
    for i, (chunks, dn, dctx) in enumerate([([[1024, 0]], 0, 0), ([[512, 1024]], 3, 900), ([], 8, 4000)]):
        q = sum(c[0] for c in chunks)
        from sim.engine.step_time import prefill_pairs
        d = 1.5 * st.duration(len(chunks) + dn, q + dn, sum(prefill_pairs(a, b) for a, b in chunks), dctx)
        lines.append(json.dumps({"i": i, "t_start": t, "t_end": t + d, "prefill": chunks, "decode_n": dn,
                                 "decode_tokens": dn, "decode_ctx": dctx}))
        t += d
    p = tmp_path / "steps.raw.jsonl"
    p.write_text("\n".join(lines) + "\n")
    r = step_time_ratio(str(p), prof)
    assert r["ratio"] == pytest.approx(1.5) and r["steps"] == 3
    assert step_time_ratio(str(p), prof, skip=2)["steps"] == 1
    assert step_time_ratio(str(tmp_path / "missing"), prof) is None
    k = scaled_profile(prof, 1.5)
    assert k.step_time.duration(3, 100, 1e4, 500) == pytest.approx(1.5 * st.duration(3, 100, 1e4, 500))
    assert k.capacity == prof.capacity and k.engine == prof.engine
    assert "ratio_in_fit_range" not in r            # the embedded profile does not say its fitted range


def _decode_steps(path, prof, steps: int, odd: tuple, even: tuple):
    """A step recorder's file of decode steps alternating between two
    (requests, x the profile's time), each request at 500 tokens of context."""
    from sim.engine.step_time import prefill_pairs
    lines, t = [], 0.0
    for i in range(steps):
        n, k = odd if i % 2 else even
        d = k * prof.step_time.duration(n, n, prefill_pairs(0, 0), 500 * n)
        lines.append(json.dumps({"i": i, "t_start": t, "t_end": t + d, "prefill": [], "decode_n": n,
                                 "decode_tokens": n, "decode_ctx": 500 * n}))
        t += d
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_points_k_is_read_over_its_busy_steps(tmp_path):
    """Steps with calls to spare (fewer than max_num_seqs / 8 requests) are
    mostly fixed costs and decide nothing: a long light stretch that ran
    faster than the profile does not move the point's k, which is read
    over the busy steps where enough ran (else over all)."""
    import dataclasses

    from sim.profile import load_profile
    from validate import validation as V
    prof = load_profile("vllm-cpu-tiny")
    assert V.busy_num_reqs(prof) == prof.engine["max_num_seqs"] // 8 == 8
    # 1,000 steps of 2 at 0.6 x the profile, 1,000 of 20 at 1.0 x
    p = _decode_steps(tmp_path / "steps.raw.jsonl", prof, 2000, (2, 0.6), (20, 1.0))
    r = V.step_time_ratio(str(p), prof)
    assert r["ratio"] < 0.95 and r["ratio_busy"] == pytest.approx(1.0) and r["busy_num_reqs"] == 8
    assert V.engine_speed(r)["k"] == pytest.approx(1.0) and V.engine_speed(r)["tests_model"]
    fitted = dataclasses.replace(prof, raw=dict(prof.raw, fit=dict(prof.raw.get("fit") or {}, max_num_reqs=40)))
    assert V.realized_speed({"live": {"step_time_vs_profile": V.step_time_ratio(str(p), fitted)}}) == \
        pytest.approx(1.0)
    # a fleet's k sums its replicas' busy steps
    from validate.fleet import fleet_step_time_ratio
    assert fleet_step_time_ratio([r, None, r])["ratio_busy"] == pytest.approx(1.0)
    # too few busy steps: the whole point's ratio
    few = V.step_time_ratio(str(p), prof, skip=2000 - 2 * (V.MIN_STEPS_IN_RANGE - 1))
    assert "ratio_busy" not in few and V.engine_speed(few)["k"] == pytest.approx(few["ratio"]) and few["ratio"] < 0.95
    # a profile that does not say its fitted range: the speed expected of the next point is the point's k
    assert V.realized_speed({"live": {"step_time_vs_profile": r}}) == pytest.approx(1.0)


def test_the_speed_a_point_ran_at_is_read_over_the_steps_the_profile_was_fitted_on(tmp_path):
    """Steps busier than any the profile was fitted on say how it
    extrapolates, not how fast the machine ran: the speed expected of the
    next point (`realized_speed`) is read over the others, where enough."""
    import dataclasses

    from sim.profile import load_profile
    from validate import validation as V
    prof = load_profile("vllm-cpu-tiny")
    prof = dataclasses.replace(prof, raw=dict(prof.raw, fit=dict(prof.raw.get("fit") or {}, max_num_reqs=40)))
    # 150 steps of 8 at 1.0 x the profile, 150 of 60 at 1.4 x
    p = _decode_steps(tmp_path / "steps.raw.jsonl", prof, 300, (8, 1.0), (60, 1.4))
    r = V.step_time_ratio(str(p), prof)
    assert r["ratio"] > 1.2 and r["ratio_in_fit_range"] == pytest.approx(1.0) and r["fit_range_num_reqs"] == 40
    assert V.realized_speed({"live": {"step_time_vs_profile": r}}) == pytest.approx(1.0)
    # too few steps inside the range to say: the whole point's ratio
    few = V.step_time_ratio(str(p), prof, skip=300 - 2 * (V.MIN_STEPS_IN_RANGE - 1))
    assert "ratio_in_fit_range" not in few and V.realized_speed({"live": {"step_time_vs_profile": few}}) > 1.2
