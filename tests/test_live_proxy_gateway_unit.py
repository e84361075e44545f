"""The live proxy hosting a gateway layer (validate/proxy.py, `layers`): the
simulator's own `Gateway` object above the policy core, its actions carried
out on the asyncio clock, in front of the in-process streaming stub of
test_live_proxy_unit (StubEngine, not vLLM: N chunks DELAY s apart).
Loopback only."""
from __future__ import annotations

import asyncio
import os

import aiohttp
from aiohttp.test_utils import TestServer

from llmsim.cli import main
from sim.conditions import get_condition
from sim.policy.gateway import Gateway, settings
from sim.policy.router import RouterConfig
from tests.test_live_proxy_unit import BODY, DELAY, EXPECTED, N, StubEngine, _metrics, _read_stream, wait_until
from validate.proxy import LiveProxy

STREAM_S = N * DELAY        # how long the stub takes over one stream


def _run(condition: str, layers: list, scenario, delay: float = DELAY):
    async def main():
        stub = StubEngine(delay=delay)
        async with TestServer(stub.app()) as up:
            lp = LiveProxy(str(up.make_url("")), get_condition(condition), prompt_throughput=100.0, layers=layers)
            async with TestServer(lp.app()) as px:
                async with aiohttp.ClientSession() as s:
                    return await scenario(s, str(px.make_url("")), stub, lp)
    return asyncio.run(asyncio.wait_for(main(), 20))


def test_the_proxy_hosts_the_simulators_gateway_object():
    async def sc(s, url, stub, lp):
        (gw,) = lp.layers
        assert type(gw) is Gateway and gw.settings["preset"] == "nginx"
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            text, _ = await _read_stream(r)
        async with s.post(url + "/v1/completions", json=dict(BODY, stream=False)) as r:
            assert r.status == 200
            whole = await r.json()
        assert text == EXPECTED and whole["choices"][0]["text"] == EXPECTED
        assert gw.counts["upstream_attempts"] == 2 and gw.counts["upstream_timeout"] == 0
        assert gw.active == 0 and not gw.relays
    _run("no-control", [settings("nginx", {"timeout_s": 10 * STREAM_S})], sc)


def test_a_gateways_upstream_timeout_is_a_504_and_closes_the_upstream():
    async def sc(s, url, stub, lp):
        (gw,) = lp.layers
        async with s.post(url + "/v1/completions", json=BODY, headers={"X-Call-Id": "7"}) as r:
            assert r.status == 504
            assert r.headers["X-Refused-Reason"] == "upstream_timeout"
        await wait_until(lambda: stub.disconnects)
        assert stub.disconnects == 1 and stub.completed == 0      # nginx passes the disconnect on; cancel aborts
        assert gw.counts["upstream_timeout"] == 1
        assert gw.counts["retries"] == 0                           # nginx resends no POST already sent
        m = await _metrics(s, url)
        assert m["llmsim_proxy_executions_cancelled_total"] == 1
        assert m['llmsim_proxy_refused_total{reason="upstream_timeout",status="504"}'] == 1
    _run("cancel", [settings("nginx", {"timeout_s": STREAM_S / 2})], sc)


def test_a_gateway_that_does_not_pass_the_disconnect_on_lets_the_execution_run_on():
    async def sc(s, url, stub, lp):
        (gw,) = lp.layers
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 504
        await wait_until(lambda: stub.completed or stub.disconnects)
        assert stub.completed == 1 and stub.disconnects == 0       # under cancel, had the proxy heard of it
        assert gw.counts["run_on"] == 1
        m = await _metrics(s, url)
        assert m["llmsim_proxy_executions_orphaned_total"] == 1
        assert m["llmsim_proxy_executions_cancelled_total"] == 0
        (ex,) = lp.executions
        assert ex.orphaned_at == ex.orphaned_at            # recorded (not NaN)
    _run("cancel", [settings("haproxy", {"timeout_s": STREAM_S / 2})], sc)


def test_a_gateways_queue_answers_503_once_its_queue_timeout_passes():
    async def sc(s, url, stub, lp):
        (gw,) = lp.layers

        async def post(call):
            async with s.post(url + "/v1/completions", json=dict(BODY, stream=False),
                              headers={"X-Call-Id": call}) as r:
                return r.status, r.headers.get("X-Refused-Reason"), await r.read()
        first = asyncio.create_task(post("1"))
        await wait_until(lambda: gw.active == 1)
        status, reason, _ = await post("2")            # waits in the queue behind the one connection
        assert (status, reason) == (503, "queue_timeout")
        assert (await first)[0] == 200
        assert gw.counts["queue_timeout"] == 1 and gw.counts["upstream_attempts"] == 1
        assert len(stub.requests) == 1                 # the queued request never went upstream
        assert gw.queued == 0 and gw.active == 0
    _run("no-control", [settings("haproxy", {"max_connections": 1, "queue_timeout_s": STREAM_S / 4})], sc)


def test_chained_gateways_in_the_proxy_answer_the_top_ones_504():
    async def sc(s, url, stub, lp):
        top, below = lp.layers
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 504
        assert top.counts["upstream_timeout"] == 1
        assert below.counts["upstream_attempts"] == 1 and below.counts["disconnects_passed"] == 1
        await wait_until(lambda: stub.disconnects)
        assert stub.disconnects == 1
    _run("cancel", [settings("nginx", {"timeout_s": STREAM_S / 2}), settings("nginx", {"timeout_s": 10 * STREAM_S})],
         sc)


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_llmsim_proxy_hosts_a_scenarios_gateways_and_not_its_client(monkeypatch):
    import llmsim.validate_cmds as cmds
    got = {}
    monkeypatch.setattr(cmds, "proxy_main", lambda *a: got.setdefault("args", a) and 0)
    assert main(["proxy", "--upstream", "http://127.0.0.1:9", "--condition", "cancel",
                 "--layers-from", os.path.join(EXAMPLES, "openai-sdk-60s-nginx.toml")]) == 0
    (layer,) = got["args"][-1]
    assert layer["kind"] == "gateway" and layer["preset"] == "nginx"


def test_llmsim_proxy_refuses_a_scenario_without_a_gateway(capsys):
    f = os.path.join(EXAMPLES, "openai-sdk-defaults.toml")
    assert main(["proxy", "--upstream", "http://127.0.0.1:9", "--layers-from", f]) == 2
    err = capsys.readouterr().err
    assert "--layers-from" in err and "gateway" in err


def test_a_gateway_above_sidecars_on_two_stub_engines():
    async def main_():
        stubs = [StubEngine(), StubEngine()]
        servers = [TestServer(st.app()) for st in stubs]
        for sv in servers:
            await sv.start_server()
        try:
            lp = LiveProxy([str(sv.make_url("")) for sv in servers], get_condition("cancel"), 100.0,
                           router=RouterConfig("round-robin", 0, "replica"),
                           layers=[settings("nginx", {"timeout_s": 10 * STREAM_S})])
            async with TestServer(lp.app()) as px, aiohttp.ClientSession() as s:
                url = str(px.make_url(""))
                for call in ("1", "2"):
                    async with s.post(url + "/v1/completions", json=dict(BODY, stream=False),
                                      headers={"X-Call-Id": call}) as r:
                        assert r.status == 200
                        assert (await r.json())["choices"][0]["text"] == EXPECTED
                # each client attempt is placed where the router sent the gateway's upstream attempt
                assert sorted(lp.attempt_index) == [("1", 0), ("2", 0)]
                assert [len(st.requests) for st in stubs] == [1, 1]
                assert lp.layers[0].counts["upstream_attempts"] == 2
        finally:
            for sv in servers:
                await sv.close()
    asyncio.run(asyncio.wait_for(main_(), 20))
