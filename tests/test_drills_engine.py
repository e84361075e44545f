"""Drills: no engine outlives its owner; an engine that never becomes ready is
a clear error within the stated time. The engine here is tests/fake_engine.py
(a stand-in serving /health with one child process in its group, not vLLM),
started by validate.engine.start_server exactly as vLLM is; the owners that
die are separate Python processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from validate import engine as E

ROOT = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_engine.py"


def start_fake(tmp_path, mode="healthy", timeout=30.0, **kw) -> E.Engine:
    port = E.free_port()
    return E.start_server([sys.executable, str(FAKE), str(port), str(tmp_path / "pids"), mode],
                          f"http://127.0.0.1:{port}", tmp_path / "server.log", dict(os.environ), tmp_path,
                          timeout, kind="fake", **kw)


def pids(tmp_path, wait_s=30.0) -> tuple[int, int]:
    f = tmp_path / "pids"
    t_end = time.monotonic() + wait_s
    while not f.exists():
        assert time.monotonic() < t_end, "the fake engine never wrote its pids"
        time.sleep(0.05)
    a, b = f.read_text().split()
    return int(a), int(b)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return not stat[stat.rfind(")") + 2:].startswith("Z")


def gone(*ps: int, wait_s: float = 30.0) -> bool:
    """Whether all ps have exited within wait_s (a bound for a slow machine, not a timing check)."""
    t_end = time.monotonic() + wait_s
    while any(alive(p) for p in ps):
        if time.monotonic() > t_end:
            return False
        time.sleep(0.1)
    return True


def test_engine_stop_ends_its_whole_process_group(tmp_path):
    eng = start_fake(tmp_path)
    server, child = pids(tmp_path)
    assert eng.healthy() and alive(server) and alive(child) and eng in E.owned()
    assert E.tagged_processes(os.environ["LLMSIM_ENGINE_SESSION"])      # the engine carries the tags
    eng.stop()
    assert gone(server, child) and not eng.alive() and eng not in E.owned()
    assert eng.guard.poll() is not None                                # its guard exits with it


def test_engine_stopped_when_its_leader_died_but_a_child_lives(tmp_path):
    eng = start_fake(tmp_path)
    server, child = pids(tmp_path)
    os.kill(server, signal.SIGKILL)
    assert gone(server) and alive(child)
    eng.stop()
    assert gone(child)


def test_engine_that_never_becomes_ready_is_a_clear_error_within_its_timeout(tmp_path):
    with pytest.raises(E.EngineError, match=r"engine not ready after 2 s \(log .*server.log\)"):
        start_fake(tmp_path, "never-ready", timeout=2.0)
    server, child = pids(tmp_path)
    assert gone(server, child) and not E.owned()


def test_engine_that_exits_during_startup_reports_its_code_and_log(tmp_path):
    with pytest.raises(E.EngineError, match=r"exited with code 3 during start-up .*fake engine failed"):
        start_fake(tmp_path, "exit-at-start")
    server, child = pids(tmp_path)
    assert gone(server, child)


OWNER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from validate import engine as E
    tmp, port, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
    signal.signal(signal.SIGHUP, signal.SIG_DFL)              # and one under nohup with SIGHUP ignored
    mode = "never-ready" if how == "sigint-during-start" else "healthy"
    eng = E.start_server([sys.executable, sys.argv[4], str(port), str(tmp / "pids"), mode],
                         f"http://127.0.0.1:{port}", tmp / "server.log", dict(os.environ), tmp, 600, kind="fake")
    (tmp / "ready").write_text("1")
    if how == "raise":
        raise RuntimeError("the owner fails")
    if how == "exit":
        sys.exit(0)
    while True:
        time.sleep(0.1)
""")


@pytest.mark.parametrize("how", ["exit", "raise", "sigint", "sigterm", "sighup", "sigkill", "sigint-during-start"])
def test_no_engine_outlives_its_owner(tmp_path, how):
    """The owner ends normally, raises, is interrupted (also while the engine
    starts), terminated or killed outright: the engine's group goes with it."""
    port = E.free_port()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path), str(port), how, str(FAKE)],
                             cwd=ROOT, stderr=subprocess.PIPE, text=True)
    server, child = pids(tmp_path)
    if how in ("sigint", "sigterm", "sighup", "sigkill"):
        t_end = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and owner.poll() is None and time.monotonic() < t_end:
            time.sleep(0.05)
        owner.send_signal(getattr(signal, how.upper()))
    elif how == "sigint-during-start":
        owner.send_signal(signal.SIGINT)
    _, err = owner.communicate(timeout=60)
    assert owner.returncode != 0 or how == "exit"
    assert gone(server, child), f"engine left running after the owner's {how}: {err[-500:]}"


def test_an_engine_started_by_a_failing_test_is_stopped(tmp_path):
    """The suite's per-test guard (tests/conftest.py) as a plugin of an inner
    pytest run whose one test starts an engine and fails."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
        import os, sys
        from validate import engine as E
        def test_fails(tmp_path):
            port = E.free_port()
            E.start_server([sys.executable, {str(FAKE)!r}, str(port), {str(tmp_path / 'pids')!r}],
                           f"http://127.0.0.1:{{port}}", tmp_path / "log", dict(os.environ), tmp_path, 60)
            assert False, "the test fails with its engine running"
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        str(tmp_path / "test_inner.py"), "--rootdir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "1 failed" in r.stdout, r.stdout[-2000:]
    assert "still running at its end" not in r.stdout
    server, child = pids(tmp_path)
    assert gone(server, child)
