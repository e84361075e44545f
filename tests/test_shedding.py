"""Shedding by class in the proxy (sim/policy/proxy.py, docs/classes.md):
the saturation rules, the refusal's status and Retry-After, a retry budget
and a cap per class; the scenario keys; a shed call counted once, under its
class; the live proxy refusing by the same object."""
from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings, strategies as st

from sim.conditions import compose, get_condition
from sim.deployment import from_document
from sim.measures import class_log, class_records, record, shed
from sim.model import simulate
from sim.policy.proxy import Attempt, EngineView, Proxy, ProxyConfig, Refuse
from sim.runlog import ATTEMPT_OUTCOMES, column
from sim.schema import ScenarioError
from tests.test_live_proxy_unit import BODY, StubEngine, wait_until
from validate.proxy import LiveProxy

SHED = ATTEMPT_OUTCOMES.index("refused_shed")


def _proxy(view=None, **cfg) -> Proxy:
    return Proxy(ProxyConfig(**cfg), engine_view=(lambda t: view) if view is not None else None,
                 prompt_throughput=100.0)


def _refusal(actions):
    return next((a for a in actions if isinstance(a, Refuse)), None)


# ------------------------------------------------------------------ the policy
@pytest.mark.parametrize("when,view,above", [
    ("engine_waiting", EngineView(waiting=30.0), 20.0),
    ("kv_usage", EngineView(kv_usage=0.95), 0.9),
])
def test_sheddable_class_is_refused_while_the_engine_view_is_saturated(when, view, above):
    p = _proxy(view, shed_classes=("batch",), shed_when=when, shed_above=above, shed_status=503)
    r = _refusal(p.on_attempt(0.0, Attempt(0, 0, klass="batch"), prompt_len=50))
    assert r is not None and r.status == 503 and r.reason == "class_shed" and r.retry_after is None
    assert _refusal(p.on_attempt(0.0, Attempt(1, 0, klass="chat"), prompt_len=50)) is None   # not sheddable
    calm = _proxy(dataclasses.replace(view, waiting=0.0, kv_usage=0.0), shed_classes=("batch",), shed_when=when,
                  shed_above=above)
    assert _refusal(calm.on_attempt(0.0, Attempt(0, 0, klass="batch"), prompt_len=50)) is None


def test_proxy_queue_rule_and_429_with_the_estimate_as_retry_after():
    p = _proxy(shed_classes=("batch",), shed_when="proxy_queue", shed_above=1, proxy_cap=1,
               shed_retry_after="estimate")
    for i in range(3):      # one dispatched, two queued
        assert _refusal(p.on_attempt(0.0, Attempt(i, 0, klass="chat"), prompt_len=100)) is None
    assert p.queued == 2
    r = _refusal(p.on_attempt(0.0, Attempt(9, 0, klass="batch"), prompt_len=100))
    assert r.status == 429 and r.reason == "class_shed"
    assert r.retry_after == pytest.approx((2 * 100 + 100) / 100.0)     # the queued prompts and its own


def test_class_cap_counts_the_class_live_executions():
    p = _proxy(class_cap=(("batch", 2),), shed_status=503)
    atts = [Attempt(i, 0, klass="batch") for i in range(3)]
    assert _refusal(p.on_attempt(0.0, atts[0])) is None
    assert _refusal(p.on_attempt(0.0, atts[1])) is None
    r = _refusal(p.on_attempt(0.0, atts[2]))
    assert r.reason == "class_cap" and r.status == 503
    assert _refusal(p.on_attempt(0.0, Attempt(5, 0, klass="chat"))) is None     # other classes uncapped
    p.on_finished(1.0, atts[0].execution)           # a seat of the class frees
    assert _refusal(p.on_attempt(1.0, Attempt(6, 0, klass="batch"))) is None
    assert p.class_live["batch"] == 2


def test_class_budget_refuses_the_class_retries_beyond_its_share():
    p = _proxy(class_budget=(("batch", 0.5),))
    for i in range(2):
        p.on_attempt(0.0, Attempt(i, 0, klass="batch"))
    assert _refusal(p.on_attempt(1.0, Attempt(0, 1, klass="batch"))) is None     # 1 <= 0.5 x 2
    r = _refusal(p.on_attempt(1.0, Attempt(1, 1, klass="batch")))
    assert r.status == 429 and r.reason == "class_budget" and r.retry_after is not None
    assert _refusal(p.on_attempt(1.0, Attempt(7, 1, klass="chat"))) is None      # no budget on chat


def test_bad_settings_are_refused():
    for kw in ({"shed_when": "gpu"}, {"shed_status": 500}, {"shed_retry_after": "always"},
               {"class_cap": (("b", 0),)}, {"class_budget": (("b", -1.0),)},
               {"class_cap": (("b", 1), ("b", 2))}):
        with pytest.raises(ValueError):
            ProxyConfig(**kw)


# ------------------------------------------------------------------ scenarios
def _doc(proxy: dict, policy: str = "priority") -> dict:
    return {"name": "shed", "model": {"capacity": 7.0}, "engine": {"scheduling_policy": policy},
            "workload": {"phases": [{"name": "base", "duration_s": 60.0, "load": 0.6},
                                    {"name": "pulse", "duration_s": 60.0, "load": 2.7,
                                     "shares": [["chat", 0.2], ["batch", 0.8]]},
                                    {"name": "hold", "duration_s": 200.0, "load": 0.6}],
                         "classes": [{"name": "chat", "share": 0.7, "priority": 0, "deadline_s": 30.0,
                                      "max_retries": 1, "prompt": {"dist": "normal", "mean": 3000.0, "sd": 300.0},
                                      "response": {"dist": "lognormal", "median": 150.0, "mean": 200.0}},
                                     {"name": "batch", "share": 0.3, "priority": 10, "must_recover": False}]},
            "proxy": proxy, "measures": {"burst": "pulse"}}


def test_scenario_keys_give_the_proxy_settings():
    d = from_document(_doc({"shed_classes": ["batch"], "shed_when": "engine_waiting", "shed_above": 20,
                            "shed_status": 503, "class_cap": [["batch", 40]], "class_budget": [["batch", 0.1]]}))
    p = d.condition.proxy
    assert (p.shed_classes, p.shed_when, p.shed_above, p.shed_status) == (("batch",), "engine_waiting", 20.0, 503)
    assert p.class_cap == (("batch", 40),) and p.class_budget == (("batch", 0.1),)
    assert d.condition.settings()["shed"]["class_cap"] == {"batch": 40}
    again = from_document(d.document())
    assert again.condition.proxy == p


@pytest.mark.parametrize("proxy,where", [
    ({"shed_classes": ["free"]}, "proxy.shed_classes"),
    ({"class_cap": [["free", 3]]}, "proxy.class_cap"),
    ({"shed_status": 500}, "proxy.shed_status"),
    ({"shed_when": "gpu"}, "proxy.shed_when"),
    ({"class_cap": [["batch", 0]]}, "proxy.class_cap"),
])
def test_bad_scenario_keys_are_one_line_errors(proxy, where):
    with pytest.raises(ScenarioError, match=where.replace(".", r"\.")) as e:
        from_document(_doc(proxy))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ counting
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(when=st.sampled_from(["proxy_queue", "engine_waiting", "kv_usage"]), above=st.floats(0.0, 0.9),
       status=st.sampled_from([429, 503]), ra=st.sampled_from(["none", "estimate"]),
       cap=st.sampled_from([None, 5, 30]), budget=st.sampled_from([None, 0.0, 0.2]),
       shed_chat=st.booleans(), seed=st.integers(0, 3))
def test_a_shed_call_is_counted_once_under_its_class(when, above, status, ra, cap, budget, shed_chat, seed):
    scale = {"proxy_queue": 10.0, "engine_waiting": 40.0, "kv_usage": 1.0}[when]
    proxy = {"condition": "proxy-cap" if when == "proxy_queue" else "no-control", "shed_when": when,
             "shed_above": above * scale, "shed_status": status, "shed_retry_after": ra,
             "shed_classes": ["batch", "chat"] if shed_chat else ["batch"]}
    if cap is not None:
        proxy["class_cap"] = [["batch", cap]]
    if budget is not None:
        proxy["class_budget"] = [["batch", budget]]
    d = from_document(_doc(proxy))
    trace = d.trace(seed)
    log = simulate(d.profile, trace, d.condition_for(), d.scenario, seed)
    rec = {"attempts": record(log, d.scenario, d.capacity, {})["attempts"], "shed": shed(log),
           "classes": class_records(log, d.scenario, d.capacity, trace.klass)}
    outcome, call = column(log.attempts, "outcome"), column(log.attempts, "call")
    shed_calls = np.unique(call[outcome == SHED])
    klass = trace.klass
    total = 0
    for k, c in enumerate(d.scenario.classes):
        mine = shed_calls[klass[shed_calls] == k]
        got = rec["classes"][c.name]["shed"]
        assert got["calls"] == len(mine)                  # each shed call once, under its own class
        assert got["attempts"] == int(((outcome == SHED) & (klass[call] == k)).sum())
        sub = class_log(log, np.flatnonzero(klass == k))
        assert got["attempts"] == int((column(sub.attempts, "outcome") == SHED).sum())
        total += got["calls"]
    assert total == len(shed_calls) == rec["shed"]["calls"]
    if not shed_chat:
        assert rec["classes"]["chat"]["shed"]["attempts"] == 0
    assert sum(v["attempts"]["sent"] for v in rec["classes"].values()) == rec["attempts"]["sent"]


def test_shedding_batch_restores_chat_at_a_cost_to_batch():
    """The mechanism the docs' worked answer rests on: under a batch burst,
    shedding batch while the engine queue is long gives chat more of its
    hold within its deadline than priority alone, and refuses batch calls."""
    base = from_document(_doc({"condition": "no-control"})).run(seed=0)
    shed = from_document(_doc({"condition": "no-control", "shed_classes": ["batch"], "shed_above": 20})).run(seed=0)

    def on_time(rec, c):
        h = rec["classes"][c]["cohorts"]["hold"]
        return h["within_deadline"] / h["offered"]
    assert on_time(shed, "chat") > on_time(base, "chat")
    assert shed["classes"]["batch"]["shed"]["calls"] > 0 and shed["classes"]["chat"]["shed"]["calls"] == 0


# ------------------------------------------------------------------ the live proxy
class WaitingStub(StubEngine):
    """The stub engine reporting `waiting` requests in its /metrics."""

    def __init__(self, waiting: float):
        super().__init__()
        self.waiting = waiting

    async def metrics(self, request):
        from aiohttp import web
        return web.Response(text=f"vllm:num_requests_waiting {self.waiting}\nvllm:num_requests_running 1.0\n")


def test_live_proxy_sheds_by_the_x_class_header():
    cond = compose(get_condition("no-control"), shed_classes=["batch"], shed_when="engine_waiting", shed_above=2,
                   shed_status=503)

    async def main():
        stub = WaitingStub(5.0)
        async with TestServer(stub.app()) as up:
            lp = LiveProxy(str(up.make_url("")), cond, prompt_throughput=100.0)
            async with TestServer(lp.app()) as px:
                url = str(px.make_url(""))
                async with aiohttp.ClientSession() as s:
                    await wait_until(lambda: lp.engine_gauges[0])       # the proxy's first scrape
                    assert lp.engine_gauges[0]
                    body = dict(BODY, stream=False)
                    async with s.post(url + "/v1/completions", json=body,
                                      headers={"X-Call-Id": "b1", "X-Class": "batch"}) as r:
                        assert r.status == 503 and r.headers["X-Refused-Reason"] == "class_shed"
                        assert "Retry-After" not in r.headers
                    async with s.post(url + "/v1/completions", json=body,
                                      headers={"X-Call-Id": "c1", "X-Class": "chat"}) as r:
                        assert r.status == 200
                    async with s.post(url + "/v1/completions", json=body, headers={"X-Class": "bad class"}) as r:
                        assert r.status == 400
                    stub.waiting = 0.0
                    await wait_until(lambda: lp.engine_gauges[0].get("vllm:num_requests_waiting") == 0.0)
                    async with s.post(url + "/v1/completions", json=body,
                                      headers={"X-Call-Id": "b2", "X-Class": "batch"}) as r:
                        assert r.status == 200
                    assert len(stub.requests) == 2
    asyncio.run(asyncio.wait_for(main(), 20))
