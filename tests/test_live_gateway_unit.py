"""The gateway harness (validate/gateway.py): configs generated from a
gateway layer's settings, read back with the simulator's own readers of the
directives; settings the software cannot take refused in one line; the
install's errors (with a stand-in for subprocess.run, named as such); and,
with nginx / HAProxy put in llmsim's cache by `llmsim gateway install` (once
per session, before the tests that need them: conftest.gateways_installed),
the real binaries between the OpenAI SDK and the live proxy in front of a
stub engine (test_live_run_unit's `SlotStub`, not vLLM)."""
from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from sim.conditions import get_condition
from sim.policy.presets import preset
from sim.policy.router import RouterConfig
from sim.workload import Trace
from test_live_run_unit import SlotStub, _scenario
from validate import gateway as G

RUN = Path("/tmp/llmsim-gw-test")


def test_nginx_config_carries_the_layers_directives():
    s = preset("gateway", "nginx", timeout_s=30, passes_disconnect=False, passes_disconnect_queued=False,
               max_connections=8)
    conf = G.nginx_config(s, 8080, "http://127.0.0.1:9000", RUN)
    assert "proxy_read_timeout 30000ms;" in conf and "listen 127.0.0.1:8080;" in conf
    assert "proxy_next_upstream timeout error;" in conf and "proxy_ignore_client_abort on;" in conf
    assert "server 127.0.0.1:9000 max_fails=1 fail_timeout=10s max_conns=8;" in conf
    assert f"pid {RUN}/nginx.pid;" in conf and f"client_body_temp_path {RUN}/client_body;" in conf
    # read back by the simulator's reader of proxy_next_upstream: the preset's retry-on
    assert set(G.retry_on_of("nginx", conf)) == set(s["retry_on"])
    s2 = preset("gateway", "nginx", retry_on=["connect_error", "504"], retry_sent_non_idempotent=True)
    conf2 = G.nginx_config(s2, 8080, "http://127.0.0.1:9000", RUN)
    assert "proxy_next_upstream error http_504 non_idempotent;" in conf2
    assert "proxy_next_upstream off;" in G.nginx_config(preset("gateway", "nginx", retry_on=[]), 1, "http://h:1", RUN)


def test_haproxy_config_carries_the_layers_directives():
    s = preset("gateway", "haproxy", timeout_s=20, max_retries=2, retry_on=["connect_error", "timeout", "503"],
               max_connections=4, max_queue=16, queue_timeout_s=1.5, passes_disconnect=True,
               passes_disconnect_queued=True, retry_sent_non_idempotent=False)
    conf = G.haproxy_config(s, 8080, "http://127.0.0.1:9000", RUN)
    for line in ("timeout server 20000ms", "retries 2", "retry-on conn-failure response-timeout 503",
                 "timeout queue 1500ms", "option abortonclose", "http-request disable-l7-retry if METH_POST",
                 "server s0 127.0.0.1:9000 maxconn 4 maxqueue 16", "bind 127.0.0.1:8080"):
        assert line in conf, line
    assert set(G.retry_on_of("haproxy", conf)) == set(s["retry_on"])
    plain = G.haproxy_config(preset("gateway", "haproxy"), 1, "http://h:1", RUN)
    assert "abortonclose" not in plain and "timeout server" not in plain and "retry-on conn-failure" in plain


@pytest.mark.parametrize("name, key, value, msg", [
    ("nginx", "backoff_base_s", 1.0, r"^backoff_base_s: nginx has no directive for it"),
    ("nginx", "retry_on", ["408"], r"^retry_on: nginx's proxy_next_upstream has no condition for '408'"),
    ("nginx", "timeout_s", None, r"^timeout_s: nginx always has a read timeout"),
    ("nginx", "upstream_servers", 2, r"^upstream_servers: 2 servers, and a live run has 1 upstream for the gateway"),
    ("nginx", "balance", "hash", r"^balance: a live nginx balances round-robin or least-conn, not 'hash'"),
    ("nginx", "down_for_s", 2.5, r"^down_for_s: nginx's fail_timeout is given here in whole seconds"),
    ("haproxy", "retry_server", "any", r"^retry_server: a live HAProxy retries on the same server or"),
    ("haproxy", "retry_on", ["5xx"], r"^retry_on: HAProxy's retry-on has no condition for '5xx'"),
    ("haproxy", "passes_disconnect", True, r"^passes_disconnect_queued: HAProxy's option abortonclose sets both"),
    ("haproxy", "timeout_status", 502, r"^timeout_status: HAProxy has no directive for it"),
])
def test_a_setting_the_software_cannot_take_is_refused_in_one_line(name, key, value, msg):
    s = preset("gateway", name, **{key: value})
    with pytest.raises(ValueError, match=msg):
        G.gateway_config(s, 1, "http://h:1", RUN)


UPS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def test_nginx_group_config_lists_every_server_with_its_passive_health():
    s = preset("gateway", "nginx", timeout_s=5, upstream_servers=2, balance="least-conn", fails_to_mark_down=2,
               down_for_s=4.0)
    conf = G.nginx_config(s, 8080, UPS, RUN)
    block = conf[conf.index("upstream llmsim_upstream {"):]
    block = block[:block.index("}")]
    assert "least_conn;" in block
    assert [line.strip() for line in block.splitlines() if line.strip().startswith("server")] == \
        ["server 127.0.0.1:9001 max_fails=2 fail_timeout=4s;", "server 127.0.0.1:9002 max_fails=2 fail_timeout=4s;"]
    assert "proxy_pass http://llmsim_upstream;" in conf and "access_log " + str(RUN) + "/access.log llmsim;" in conf
    assert "least_conn" not in G.nginx_config(preset("gateway", "nginx", timeout_s=5, upstream_servers=2), 1, UPS, RUN)


def test_haproxy_group_config_observes_layer7_with_active_checks():
    s = preset("gateway", "haproxy", timeout_s=5, upstream_servers=2, fails_to_mark_down=3, balance="least-conn",
               retry_server="other", check_interval_s=1.0)
    conf = G.haproxy_config(s, 8080, UPS, RUN)
    opts = "check inter 1000ms rise 2 fall 3 observe layer7 error-limit 3 on-error fail-check"
    for line in (f"server s0 127.0.0.1:9001 {opts}", f"server s1 127.0.0.1:9002 {opts}", "balance leastconn",
                 "option httpchk GET /health", "option redispatch 1", "log stdout format rfc5424 local0 info"):
        assert line in conf, line
    off = G.haproxy_config(preset("gateway", "haproxy", timeout_s=5, upstream_servers=2), 1, UPS, RUN)
    assert " check" not in off and "httpchk" not in off and "redispatch" not in off and "balance" not in off


def test_group_spells_count_as_the_simulator_counts():
    ng = preset("gateway", "nginx", upstream_servers=2, down_for_s=10.0)
    # server 0 out at 1 s; a late failure at 5 s lengthens that spell (to 15 s); at 20 s a new one
    out = G.group_spells([0, 1, 0, 0], [1.0, 2.0, 5.0, 20.0], ng)
    assert out["marked_down"] == 3 and out["first_marked_down_s"] == 1.0
    assert out["spells"] == [[0, 1.0, 15.0], [1, 2.0, 12.0], [0, 20.0, 30.0]]
    ha = preset("gateway", "haproxy", upstream_servers=2, fails_to_mark_down=3)
    out = G.group_spells([1, 1], [3.0, 9.0], ha, back=[1], back_times=[6.0])
    assert out["spells"] == [[1, 3.0, 6.0], [1, 9.0, float("inf")]]
    assert G.group_spells([], [], ng) == {"marked_down": 0, "first_marked_down_s": None, "spells": []}


def test_group_events_read_the_gateways_own_lines(tmp_path):
    hosts = ["127.0.0.1:9001", "127.0.0.1:9002"]
    (tmp_path / "error.log").write_text(
        '2026/12/04 13:10:01 [warn] 12#12: *56 upstream server temporarily disabled while reading response header '
        'from upstream, client: 127.0.0.1, server: , request: "POST /v1/completions HTTP/1.1", upstream: '
        '"http://127.0.0.1:9002/v1/completions", host: "127.0.0.1:8080"\n'
        '2026/12/04 13:10:02 [error] 12#12: *60 no live upstreams while connecting to upstream\n')
    (tmp_path / "access.log").write_text('1764853802.100 7 502 "llmsim_upstream" "-"\n'
                                         '1764853802.300 8 200 "127.0.0.1:9001" "200"\n'
                                         '1764853802.500 7 502 "llmsim_upstream" "-"\n')
    ev = G.group_events("nginx", tmp_path, hosts)
    assert ev["marked"] == [1] and ev["alone_calls"] == ["7", "7"]
    (tmp_path / "haproxy.log").write_text(
        "[WARNING]  (1650) : Server llmsim_upstream/s0 is DOWN, reason: Health analyze\n"
        "<129>1 2026-12-04T12:43:49.179926+00:00 - haproxy 1650 - - Server llmsim_upstream/s0 is DOWN, reason: x\n"
        "<134>1 2026-12-04T12:43:51.671256+00:00 - haproxy 1650 - - 17 503 <NOSRV>\n"
        "<134>1 2026-12-04T12:43:52.000000+00:00 - haproxy 1650 - - - 200 <NOSRV>\n"     # its own /health
        "<133>1 2026-12-04T12:43:53.000000+00:00 - haproxy 1650 - - Server llmsim_upstream/s0 is UP, reason: y\n")
    ev = G.group_events("haproxy", tmp_path, hosts)
    assert ev["marked"] == [0] and ev["back"] == [0] and ev["alone_calls"] == ["17"]
    assert abs(ev["back_at"][0] - ev["marked_at"][0] - 3.820074) < 1e-6


def test_a_gateway_preset_without_live_software_is_refused():
    with pytest.raises(ValueError, match=r"^preset: a live run's gateway is nginx or haproxy; 'envoy'"):
        G.gateway_config(preset("gateway", "envoy"), 1, "http://h:1", RUN)


class FakeRun:
    """A stand-in for subprocess.run: answers apt-get / dpkg commands from a table."""

    def __init__(self, fail_download=False):
        self.calls, self.fail_download = [], fail_download

    def __call__(self, argv, cwd=None, **kw):
        self.calls.append(argv)
        if argv[:2] == ["apt-get", "download"]:
            if self.fail_download:
                return subprocess.CompletedProcess(argv, 100, "", "E: Unable to locate package nginx\n")
            Path(cwd, f"{argv[2]}_1.0_amd64.deb").write_bytes(b"")
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_install_without_apt_get_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(G.E, "STATE_DIR", tmp_path)
    monkeypatch.setattr(G.shutil, "which", lambda tool: None)
    with pytest.raises(G.GatewayError, match=r"^apt-get not found: .* give its binary as LLMSIM_NGINX="):
        G.install("nginx", log=lambda m: None, run=FakeRun())


def test_install_a_failed_fetch_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(G.E, "STATE_DIR", tmp_path)
    monkeypatch.setattr(G.shutil, "which", lambda tool: "/usr/bin/" + tool)
    with pytest.raises(G.GatewayError, match=r"^apt-get download nginx failed \(E: Unable to locate package nginx\); "
                                             r"run `apt-get update`"):
        G.install("nginx", log=lambda m: None, run=FakeRun(fail_download=True))
    assert G.binary("nginx") is None and G.installed("nginx") is None


def test_the_cli_names_a_failed_install_in_one_line(monkeypatch, tmp_path, capsys):
    from llmsim.cli import main
    monkeypatch.setattr(G.E, "STATE_DIR", tmp_path)
    monkeypatch.setattr(G.shutil, "which", lambda tool: None)
    assert main(["gateway", "install", "haproxy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmsim: gateway install: apt-get not found")


# ------------------- the real binaries, installed once per session (conftest.gateways_installed)
_needs = pytest.mark.usefixtures("gateways_installed")


async def _through(gateway_settings, client_settings, cond, trace, sc, slots):
    from validate.live_run import LiveRun
    stub = SlotStub(slots)
    server = TestServer(stub.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        run = LiveRun(url, "stub", trace, get_condition(cond), sc, seed=0, client_layer=client_settings,
                      gateway=lambda up: G.start(gateway_settings, up))
        try:
            end = await run._run(until=float(trace.arrival[-1]) + sc.delivery_horizon_s, port=G.E.free_port())
        finally:
            if run.gateway is not None:
                run.gateway.stop()
        return run, run._log(end, 0.0), stub
    finally:
        await server.close()


async def _through_group(gateway_settings, cond, trace, sc, slots, placement="replica"):
    """`_through` with a stub engine per server of the gateway's upstream
    group, the reference client in front of the gateway (a sidecar proxy
    before each engine), or in front of the one proxy before the gateway
    (`placement` "deployment")."""
    from validate.live_run import LiveRun
    n = gateway_settings["upstream_servers"]
    stubs = [SlotStub(slots) for _ in range(n)]
    servers = [TestServer(s.app()) for s in stubs]
    for server in servers:
        await server.start_server()
    try:
        urls = [str(server.make_url("")).rstrip("/") for server in servers]
        run = LiveRun(urls, "stub", trace, get_condition(cond), sc, seed=0, router=RouterConfig("round-robin", 0,
                                                                                               placement),
                      gateway=lambda ups: G.start(gateway_settings, ups), group=gateway_settings)
        try:
            end = await run._run(until=float(trace.arrival[-1]) + sc.delivery_horizon_s, port=G.E.free_port())
        finally:
            if run.gateway is not None:
                run.gateway.stop()
        return run, run._log(end, 0.0), stubs
    finally:
        for server in servers:
            await server.close()


def _long_calls(n, tokens=200):
    return Trace(arrival=np.arange(n) * 0.05, prompt_len=np.full(n, 40, dtype=np.int64),
                 max_tokens=np.full(n, tokens, dtype=np.int64), shared_prefix=10)


@_needs
def test_nginx_read_timeout_answers_504_that_the_sdk_retries():
    sc = _scenario(deadline=3.0)
    n = 2
    gw = preset("gateway", "nginx", timeout_s=0.5)            # 2 s responses: every attempt outlasts it
    client = preset("client", "openai-python", timeout_s=5, max_retries=1)
    run, log, stub = asyncio.run(_through(gw, client, "cancel", _long_calls(n), sc, slots=2))
    assert all(c.outcome == "failed_attempts" and c.attempts == 2 for c in log.calls)
    assert all(a.outcome == "refused_gateway" and 0.4 < a.ended_at - a.sent_at < 1.5 for a in log.attempts)
    assert run.sdk_log.statuses == {"504": 2 * n}
    # nginx closed each upstream request at its timeout (proxy_ignore_client_abort off): cancelled
    assert len(log.executions) == 2 * n and all(e.fate == "aborted" for e in log.executions)
    assert not run.gateway.alive()
    assert log.extra["gateway"]["software"] == "nginx" and log.extra["gateway"]["version"] == "1.22.1"


@_needs
def test_haproxy_queue_timeout_answers_503_and_a_connection_limit_holds():
    sc = _scenario(deadline=3.0)
    n = 3
    gw = preset("gateway", "haproxy", timeout_s=10, max_connections=1, max_queue=8, queue_timeout_s=0.3)
    client = preset("client", "openai-python", timeout_s=5, max_retries=0)
    run, log, stub = asyncio.run(_through(gw, client, "no-control", _long_calls(n, tokens=100), sc, slots=3))
    # one request at a time reaches the proxy; the others wait 0.3 s in HAProxy's queue and get its 503
    assert sorted(c.outcome for c in log.calls) == ["delivered", "failed_attempts", "failed_attempts"]
    assert run.sdk_log.statuses == {"503": 2}
    assert len(log.executions) == 1 and stub.completed == 1


@_needs
def test_a_started_gateway_is_owned_until_stopped_and_leaves_nothing_behind():
    g = G.start(preset("gateway", "nginx", timeout_s=1), "http://127.0.0.1:9")
    try:
        assert g.process in G.E.owned() and g.alive()       # stopped at exit / by the suite's guard if left
        assert (g.run_dir / "nginx.pid").exists() and str(g.run_dir) in g.config_path.read_text()
    finally:
        g.stop()
    assert g.process not in G.E.owned() and not g.alive()
    assert g.process.proc.poll() is not None                 # reaped


def _out_while_placed(spells: list, placed: list, slack: float = 0.75) -> list:
    """Attempts placed on a server while the gateway's log said it was out:
    (server, placed at) for each; nginx's log times are within 0.5 s."""
    return [(s, t) for s, a, b in spells for r, t in placed if r == s and a + slack < t < b - slack]


def _group_of_two(software: str) -> dict:
    """A gateway's group of two servers, a read timeout of 0.5 s, passive health on (HAProxy: one error, one
    failed check)."""
    if software == "nginx":
        return preset("gateway", "nginx", timeout_s=0.5, upstream_servers=2, down_for_s=3.0)
    return preset("gateway", "haproxy", timeout_s=0.5, upstream_servers=2, fails_to_mark_down=1, fall=1,
                  rise=2, check_interval_s=1.0, max_retries=0)


@_needs
@pytest.mark.parametrize("software", ["nginx", "haproxy"])
def test_an_upstream_group_takes_servers_out_and_answers_alone(software):
    """Two stub engines of one slot each behind a real gateway's group: the
    calls beyond the slots outlast the read timeout, each server is taken
    out of rotation, and with none left the gateway answers by itself; the
    gateway's own logs say so, and no attempt reached a server it had out."""
    sc = _scenario(deadline=6.0)
    gw = _group_of_two(software)
    run, log, stubs = asyncio.run(_through_group(gw, "no-control", _long_calls(12, tokens=100), sc, slots=1))
    layer = log.extra["layers"][0]
    g = layer["upstream_group"]
    assert layer["kind"] == "gateway" and layer["preset"] == software and g["servers"] == 2
    assert g["marked_down"] >= 2 and layer["marked_down"] == g["marked_down"]       # both servers went out
    assert -0.5 <= g["first_marked_down_s"] < 6.0          # within the run; nginx dates its lines to the second
    statuses = {a.outcome for a in log.attempts}
    assert g["answered_alone"] > 0 and "refused_gateway" in statuses
    assert 0 < g["calls_answered_alone"] <= min(g["answered_alone"], len(log.calls))
    # the attempts that reached the proxy came in on both servers' ports
    lp = run.proxy
    assert set(lp.exec_replica.values()) == {0, 1}
    assert sum(s.completed + s.aborted for s in stubs) <= len(lp.executions)
    ev = G.group_events(software, run.gateway.run_dir, [u.split("://")[1] for u in run.gateway.upstream])
    spells = G.group_spells(ev["marked"], [t - run.t0_wall for t in ev["marked_at"]], gw, ev["back"],
                            [t - run.t0_wall for t in ev["back_at"]])["spells"]
    placed = [(lp.exec_replica[i], lp.exec_placed[i]) for i in lp.exec_replica]
    assert _out_while_placed(spells, placed) == []            # (a spell with no "is UP" runs to the end)


@_needs
@pytest.mark.parametrize("software", ["nginx", "haproxy"])
def test_before_a_group_the_one_proxy_sees_streams_cut_and_no_server_goes_out(software):
    """The condition's one proxy before a real gateway's group of two stub
    engines of one slot each, which send a stream's status and header as
    they take a request (as vLLM does): the calls beyond the slots wait past
    the read timeout without a token; the gateway cuts those streams (its
    status already sent: not retried), the proxy refuses their attempts with
    the gateway's timeout, and, such a cut being no failure for either
    software's passive health, no server goes out and the gateway answers
    nothing alone. Each execution's replica is the one the gateway says it
    sent it to."""
    sc = _scenario(deadline=6.0)
    gw = _group_of_two(software)
    run, log, stubs = asyncio.run(_through_group(gw, "no-control", _long_calls(12, tokens=100), sc, slots=1,
                                                 placement="deployment"))
    lp = run.proxy
    assert lp.below and lp.below_url == run.gateway.url and run.front_url == run.proxy_url
    g = log.extra["layers"][0]["upstream_group"]
    assert g["servers"] == 2 and g["marked_down"] == 0 and g["answered_alone"] == 0
    outcomes = {a.outcome for a in log.attempts}
    assert "refused_gateway" in outcomes and "complete" in outcomes
    cut = [e for e in lp.executions if e.fate == "aborted"]
    assert cut and all(not e.first_token_at <= e.finished_at for e in cut)     # NaN: cut before a token
    assert set(lp.exec_replica.values()) == {0, 1}
    assert sum(s.completed for s in stubs) == sum(e.fate == "completed" for e in lp.executions)
