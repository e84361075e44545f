"""The engine depends on nothing but its inputs: the executions added and
aborted at their times. Replayed alone on its own clock (as
`benchmarks/bench_engine_floor.py` does to measure the engine's share of a
run), they give the engine work of the full run: the same tokens computed,
the same steps, and no more step events."""
import importlib
import sys
from pathlib import Path

import pytest

from sim.conditions import get_condition
from sim.model import Run
from sim.profile import load_profile
from sim.scenario import PAPER
from sim.workload import make_trace

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def floor():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("bench_engine_floor")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("name", ["cancel", "no-control", "engine-cap-338+cancel"])
def test_the_engine_alone_on_a_runs_inputs_does_the_runs_engine_work(floor, name):
    profile = load_profile("qwen2.5-7b")
    trace = make_trace(profile.capacity, PAPER, 3)
    condition = get_condition(name)
    run = Run(profile, trace, condition, PAPER, 3)
    inputs = floor.recorded_inputs(run)
    adds = sum(op == "add" for _, op, _ in inputs)
    aborts = sum(op == "abort" for _, op, _ in inputs)
    assert adds >= len(trace) * 0.9
    assert aborts == 0 if condition.proxy.cancellation == "off" else aborts > 0
    engine, _, _ = floor.replay(profile, condition, inputs, run.env.now)
    assert engine.env.now == run.env.now
    assert engine.scheduler.counters == run.engine.scheduler.counters
    assert engine.scheduler.counters["prompt_tokens_total"] > 0
    assert engine.work_by(run.env.now)[0] == run.engine.work_by(run.env.now)[0]
    assert engine.scheduler.num_preemptions == run.engine.scheduler.num_preemptions
    assert engine.num_step_events <= run.engine.num_step_events
