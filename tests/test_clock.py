"""The clock (`sim.clock`) reaches into SimPy's private attributes for speed;
the same runs through SimPy's public API alone (`PublicClock`: a timeout per
timer and per engine event, `simpy.Environment.run`) give the same records,
and the SimPy installed is one pyproject.toml pins."""
from __future__ import annotations

import json
import os
import re

import pytest
import simpy

import golden
import sim.model
from sim.clock import Clock, PublicClock, Timers
from sim.conditions import compose
from sim.deployment import load
from sim.fleet import RECORD_KEYS, run_fleet
from sim.policy.router import RouterConfig
from sim.profile import load_profile
from sim.scenario import SCENARIOS
from sim.workload import make_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = ("cancel", "no-control", "deferred", "lifo", "coalesce", "engine-cap-100")

with open(golden.GOLDEN) as _f:
    STORED = json.load(_f)


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("LLMSIM_CACHE_DIR", "")


@pytest.fixture
def public(monkeypatch):
    """The driver's clock replaced by the public-API one; the clocks made count."""
    made = []

    class Counted(PublicClock):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr(sim.model, "Clock", Counted)
    return made


@pytest.mark.parametrize("condition", PUBLIC)
def test_the_public_api_path_gives_the_golden_records(public, condition):
    rec = json.loads(json.dumps(golden.run_case("qwen2.5-7b", condition)))
    assert len(public) == 1 and public[0].events_scheduled > 2 * rec["attempts"]["sent"]   # a timeout per timer
    diffs = golden.differences(rec, STORED[f"qwen2.5-7b/{condition}"])
    assert not diffs, "\n".join(diffs[:20])


@pytest.mark.parametrize("policy, placement, cond", [
    ("round-robin", "deployment", compose("proxy-cap", proxy_cap=12)),
    ("call-affinity", "replica", compose("deadline-check", coalesce=True, proxy_cap=6)),
], ids=["round-robin", "call-affinity"])
def test_a_fleet_on_the_public_api_path_gives_the_same_record(public, monkeypatch, policy, placement, cond):
    """Three replicas (with call affinity, the timers filed by replica)."""
    tiny = SCENARIOS["cpu-tiny"].scenario
    profile = load_profile("vllm-cpu-tiny")
    cap = load("cpu-tiny").capacity
    trace = make_trace(3 * cap, tiny, 0)
    rc = RouterConfig(policy, 1, placement)
    slow = run_fleet([profile] * 3, cond, trace, tiny, [cap] * 3, rc)
    made = len(public)
    monkeypatch.setattr(sim.model, "Clock", Clock)
    fast = run_fleet([profile] * 3, cond, trace, tiny, [cap] * 3, rc)
    assert made and len(public) == made

    def bare(rec):
        out = {k: v for k, v in rec.items() if k not in ("wall_s", "extra") + RECORD_KEYS}
        out["replicas"] = [{k: v for k, v in r.items() if k not in ("wall_s", "extra")} for r in rec["replicas"]]
        out["fleet"] = rec["fleet"]
        return json.loads(json.dumps(out))
    assert fast["attempts"]["sent"] > 100
    assert golden.differences(bare(slow), bare(fast)) == []


def test_timers_on_the_public_clock_fire_alone_in_time_order():
    for env in (Clock(), PublicClock()):
        seen = []
        timers = Timers(env, horizon=lambda: 10.0)
        fire = lambda t, arg: seen.append((t, env.now, arg))      # noqa: E731
        set_ = {t: timers.at(t, fire, f"t{t:g}") for t in (3.0, 1.0, 2.0, 12.0, 5.0)}
        timers.cancel(set_[2.0])
        assert timers.next_time() == 1.0
        env.run()
        assert seen == [(1.0, 1.0, "t1"), (3.0, 3.0, "t3"), (5.0, 5.0, "t5"), (12.0, 12.0, "t12")]
        if env.public:
            assert env.events_scheduled == 5        # a timeout per timer
        else:
            assert env.events_scheduled < 5         # batches


def test_the_installed_simpy_is_one_the_clock_was_checked_against():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    low, high = re.search(r'"simpy>=([\d.]+),<([\d.]+)"', text).groups()

    def version(s):
        return tuple(int(x) for x in s.split(".")[:3])
    assert version(low) <= version(simpy.__version__) < version(high)
