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

from sim.conditions import get_condition
from sim.policy.presets import preset
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
                 "server upstream 127.0.0.1:9000 maxconn 4 maxqueue 16", "bind 127.0.0.1:8080"):
        assert line in conf, line
    assert set(G.retry_on_of("haproxy", conf)) == set(s["retry_on"])
    plain = G.haproxy_config(preset("gateway", "haproxy"), 1, "http://h:1", RUN)
    assert "abortonclose" not in plain and "timeout server" not in plain and "retry-on conn-failure" in plain


@pytest.mark.parametrize("name, key, value, msg", [
    ("nginx", "backoff_base_s", 1.0, r"^backoff_base_s: nginx has no directive for it"),
    ("nginx", "retry_on", ["408"], r"^retry_on: nginx's proxy_next_upstream has no condition for '408'"),
    ("nginx", "timeout_s", None, r"^timeout_s: nginx always has a read timeout"),
    ("nginx", "upstream_servers", 2, r"^upstream_servers: a live run's gateway has one upstream"),
    ("haproxy", "retry_on", ["5xx"], r"^retry_on: HAProxy's retry-on has no condition for '5xx'"),
    ("haproxy", "passes_disconnect", True, r"^passes_disconnect_queued: HAProxy's option abortonclose sets both"),
    ("haproxy", "timeout_status", 502, r"^timeout_status: HAProxy has no directive for it"),
])
def test_a_setting_the_software_cannot_take_is_refused_in_one_line(name, key, value, msg):
    s = preset("gateway", name, **{key: value})
    with pytest.raises(ValueError, match=msg):
        G.gateway_config(s, 1, "http://h:1", RUN)


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
    from aiohttp.test_utils import TestServer

    from validate.live_run import LiveRun
    stub = SlotStub(slots)
    server = TestServer(stub.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        run = LiveRun(url, "stub", trace, get_condition(cond), sc, seed=0, client_layer=client_settings,
                      gateway=lambda up: G.start(gateway_settings, up))
        port = G.E.free_port()
        run.gateway = run.gateway_factory(f"http://127.0.0.1:{port}")
        try:
            end = await run._run(until=float(trace.arrival[-1]) + sc.delivery_horizon_s, port=port)
        finally:
            run.gateway.stop()
        return run, run._log(end, 0.0), stub
    finally:
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
