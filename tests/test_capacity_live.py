"""The capacity protocol shared by the simulator and live drivers, and the
open-loop load generator against a stub streaming server (a stand-in for
vLLM's HTTP surface, not an engine)."""
import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from sim.capacity import CapacityProtocol, capacity_protocol
from sim.profile import load_profile
from validate.loadgen import LoadGen, TracePrompts


def test_protocol_on_synthetic_queue_samples_gives_exact_capacity():
    seen = []
    p = CapacityProtocol(start_rate=2.0, factor=2.0, stage_s=10.0, threshold=0.1, max_stages=5, progress=seen.append)
    assert [r for *_, r in p.schedule()] == [2.0, 4.0, 8.0, 16.0, 32.0]
    t = np.arange(0.0, 10.0)
    assert not p.observe(0, 20, t, np.zeros(10))
    assert not p.observe(1, 41, t + 10, np.full(10, 3.0) + 0.05 * t)     # growth 0.05 < 0.1
    assert p.observe(2, 83, t + 20, 7.0 + 0.75 * t)                       # growth 0.75
    r = p.result()
    assert r["saturated_stage"] == 2 and len(seen) == 3
    assert r["stages"][1]["queue_growth"] == pytest.approx(0.05, abs=1e-12)
    assert r["capacity"] == pytest.approx(8.3 - 0.75, abs=1e-12)
    # irregular (live) sample times: the slope is over the times given
    p2 = CapacityProtocol(start_rate=1.0, stage_s=20.0)
    ts = np.array([0.1, 1.3, 2.2, 3.9, 5.0, 19.5])
    assert p2.observe(0, 30, ts, 2.0 * ts)
    assert p2.result()["capacity"] == pytest.approx(1.5 - 2.0, abs=1e-12)


def test_protocol_never_saturating_is_refused():
    p = CapacityProtocol(start_rate=1.0, stage_s=5.0, max_stages=2)
    for k, a, b, r in p.schedule():
        assert not p.observe(k, 5, np.arange(a, b), np.zeros(5))
    with pytest.raises(RuntimeError, match="never grew"):
        p.result()


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b"])
def test_embedded_capacity_is_the_simulators_protocol_on_its_profile(name):
    """An embedded profile's Ĉ is what the protocol gives on today's simulator
    (a change to the engine model that moves it must refit the profiles). A
    profile fitted to the reference outcomes keeps the published Ĉ as the
    unit of its trace and records what the protocol read on trace 0 when it
    was fitted (docs/calibration.md)."""
    p = load_profile(name)
    r = capacity_protocol(p, seed=0)
    read = p.provenance["simulated"]["capacity"] if "reference_fit" in p.provenance else p.capacity
    assert r["capacity"] == pytest.approx(read, rel=1e-9) and r["saturated_stage"] >= 2


class _Stub(BaseHTTPRequestHandler):
    """Streams one SSE chunk per token every `tok_s` seconds, like
    /v1/completions with stream=true; /metrics reports calls in flight as
    vllm:num_requests_waiting. Records arrivals and client disconnects."""
    protocol_version = "HTTP/1.1"
    tok_s = 0.02
    log: dict = {}

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = (f"# HELP x\nvllm:num_requests_waiting{{model_name=\"m\"}} {len(self.log['active'])}\n"
                f"vllm:num_requests_running{{model_name=\"m\"}} 0\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        t = time.monotonic()
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = (req["prompt"][-1], t)
        self.log["arrivals"].append((t, req))
        self.log["active"].add(key)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for k in range(req["max_tokens"]):
                time.sleep(self.tok_s)
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": req["max_tokens"]}})
                             .encode() + b"\n\ndata: [DONE]\n\n")
            self.wfile.flush()
            self.log["completed"].append(time.monotonic())
        except (BrokenPipeError, ConnectionResetError):
            self.log["disconnects"].append(time.monotonic())
        finally:
            self.log["active"].discard(key)


@pytest.fixture
def stub():
    _Stub.log = {"arrivals": [], "active": set(), "completed": [], "disconnects": []}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", _Stub.log
    finally:
        srv.shutdown()
        srv.server_close()


def test_loadgen_is_open_loop_and_closes_at_the_deadline(stub):
    url, log = stub
    # 12 calls over 1.6 s; each streams max_tokens tokens at 20 ms a token.
    # Calls 3 and 7 want 200 tokens (4 s), far beyond the 0.5 s deadline. The
    # run ends with the last call, at ~1.7 s: the sampler's second reading
    # (t = 1 s) has time to come back before it.
    arrival = np.linspace(0.0, 1.6, 12)
    max_tokens = np.full(12, 5)
    max_tokens[[3, 7]] = 200
    prompts = TracePrompts(np.full(12, 40), 10, seed=3)
    gen = LoadGen(url, "stub-model", arrival, prompts, max_tokens, deadline_s=0.5)
    t0 = time.monotonic()
    asyncio.run(gen.run(until=5.0))
    wall = time.monotonic() - t0
    # bounds far from what a failure gives, so that a loaded machine passes:
    assert wall < 3.5                                   # long calls did not hold the run to 4 s
    out = {r.index: r for r in gen.records}
    assert sorted(out) == list(range(12))
    # open loop: every call sent at its planned time even while slow calls stream
    lags = [r.sent - r.planned for r in gen.records]
    assert max(lags) < 0.5 and min(lags) > -1e-3        # one waiting on each call lags ~1 s
    assert len(log["arrivals"]) == 12
    # the last call reached the stub at its planned 1.6 s from the run's start (same clock; one waiting on each
    # call would bring it at ~2.6 s); measured from the start, not from the first arrival, which can come late
    # by the first connection's one-off cost on a loaded machine (once 0.3 s: the span then read 1.3 s)
    sent_at = sorted(t for t, _ in log["arrivals"])
    assert sent_at[0] - gen.t0 > -1e-3 and sent_at[-1] - gen.t0 == pytest.approx(1.6, abs=0.3)
    # the request body is what vLLM takes
    req = log["arrivals"][0][1]
    assert req["model"] == "stub-model" and req["stream"] and req["ignore_eos"]
    assert req["stream_options"] == {"include_usage": True} and len(req["prompt"]) == 40
    assert all(r["prompt"][:10] == req["prompt"][:10] for _, r in log["arrivals"])     # shared prefix
    assert prompts[0] == prompts[0] and prompts[0][10:] != prompts[1][10:]
    # deadline: the two long calls given up at ~0.5 s and their connections closed
    for i in range(12):
        r = out[i]
        if i in (3, 7):
            assert r.outcome == "deadline" and r.end - r.sent == pytest.approx(0.5, abs=0.3)   # not 4 s
            assert 0 < r.tokens < 200
        else:
            assert r.outcome == "ok" and r.tokens == 5 and r.first_token > r.sent
    t_end = time.monotonic() + 5.0                      # the stub notices on its next write, and counts
    while (len(log["disconnects"]) < 2 or len(log["completed"]) < 10) and time.monotonic() < t_end:
        time.sleep(0.05)
    assert len(log["disconnects"]) == 2 and len(log["completed"]) == 10
    # the 1 s sampler read the stub's gauge
    assert len(gen.samples) >= 2 and all(s[1] >= 0 for s in gen.samples)
    t, q = gen.queue_between(0.0, 5.0)
    assert t[0] == pytest.approx(0.0, abs=0.1) and np.all(np.diff(t) == pytest.approx(1.0, abs=0.15))


class _CountingStub(_Stub):
    """Its waiting gauge is every arrival so far: it grows at the arrival
    rate, so the protocol saturates at its first stage with Ĉ near 0."""
    def do_GET(self):
        body = (f"vllm:num_requests_waiting{{model_name=\"m\"}} {len(self.log['arrivals'])}\n"
                f"vllm:num_requests_running{{model_name=\"m\"}} 0\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _protocol_on_a_counting_stub(**kw) -> dict:
    """The live protocol (4 calls/s, 3 s stages, two at most) against a
    `_CountingStub`, which saturates at the first stage; `kw` to the protocol."""
    from calibrate.live_capacity import live_capacity_protocol, live_scenario
    _Stub.log = {"arrivals": [], "active": set(), "completed": [], "disconnects": []}
    _Stub.tok_s = 0.001
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _CountingStub)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        return live_capacity_protocol(f"http://127.0.0.1:{srv.server_address[1]}", "stub-model", live_scenario(),
                                      start_rate=4.0, stage_s=3.0, max_stages=2, deadline_s=5.0, **kw)
    finally:
        srv.shutdown()
        srv.server_close()
        _Stub.tok_s = 0.02


@pytest.mark.parametrize("via_proxy", [False, True])
def test_live_protocol_through_the_proxy_reads_the_engines_gauge(via_proxy):
    res = _protocol_on_a_counting_stub(via_proxy=via_proxy)
    assert res["protocol"]["via_proxy"] is via_proxy and res["saturated_stage"] == 0
    st = res["stages"][0]
    # the stub's count, not 0 (a second's sample taken late moves an arrival across it: 1 of ~4 a second)
    assert st["queue_growth"] == pytest.approx(st["realised_rate"], rel=0.5)
    assert len(_Stub.log["arrivals"]) >= 6 and res["calls"].get("ok", 0) >= 6


def test_the_calls_go_on_past_the_protocols_stop_for_its_tail():
    """Once the protocol has stopped (saturated at its first stage here), the
    trace's calls go on for `tail_s` (the next stage's, past saturation) so
    the engine's steps at its seats are recorded; Ĉ is still the stages'."""
    from calibrate.live_capacity import TAIL_S, plan
    assert plan(4.0)["tail_s"] == TAIL_S > 0 and plan(4.0, tail_s=0.0)["tail_s"] == 0.0
    res = _protocol_on_a_counting_stub(tail_s=2.0)
    assert res["protocol"]["tail_s"] == 2.0 and res["saturated_stage"] == 0
    in_stage = round(res["stages"][0]["realised_rate"] * 3.0)
    # the second stage's calls (6 a second) sent through the tail: about 12 more than the first stage's
    assert len(_Stub.log["arrivals"]) >= in_stage + 4, (len(_Stub.log["arrivals"]), in_stage)
