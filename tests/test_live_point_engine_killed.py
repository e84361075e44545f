"""Live: a point survives the real engine's death. `validate` on the CPU engine
(`cpu-tiny`, two points); 20 s into the first point the engine's core process
(the API server's child that runs the model) is SIGKILLed. The first point is
recorded as failed with the reason and vLLM's last log lines, the second runs
on a fresh engine, and no engine process is left. Deselect with
`-m "not live"`. Time: two engine start-ups (~50-130 s each) and ~2 minutes
of points."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from sim.profile import load_profile
from sim.scenario import get_scenario
from validate import engine as E
from validate import validation as V

pytestmark = pytest.mark.live
KILL_AFTER_S = 20


class KillFirst(V.EngineSpec):
    def __init__(self):
        super().__init__("cpu")
        self.started: list[E.Engine] = []
        self.killed: list[int] = []

    def start(self, extra_args):
        eng, started = super().start(extra_args)
        self.started.append(eng)
        if len(self.started) == 1:
            def kill():
                core = [c for c in E.children(eng.pid) if "resource_tracker" not in
                        Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
                for c in core:
                    os.kill(c, signal.SIGKILL)
                self.killed = core
            threading.Timer(KILL_AFTER_S, kill).start()
        return eng, started


def test_a_point_whose_real_engine_dies_is_recorded_failed_and_the_next_runs_fresh(tmp_path, cpu_engine_installed):
    spec = KillFirst()
    prof = load_profile("vllm-cpu-tiny")
    out = tmp_path / "v.json"
    doc = V.validate(spec, prof, get_scenario("cpu-tiny"), ["no-retry", "no-control"], str(out))
    first, second = doc["points"]
    print("FAILED POINT", first.get("failed"))
    assert spec.killed, "no engine core process was found to kill"
    assert "failed" in first and "live" not in first
    assert first["failed"]["reason"].startswith("the engine process")
    assert first["failed"]["engine_log"]
    assert any("EngineDeadError" in l for l in first["failed"]["engine_errors"])
    assert "live" in second and second["live"]["executions"]["completed"] > 0
    assert len(spec.started) == 2 and not any(e.alive() for e in spec.started)
