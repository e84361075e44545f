"""Property tests of recovery: what the verdicts of `sim.verdict` and the
margin rest on. Small random engines and scenarios (the strategies of
test_properties) keep each run around a tenth of a second; where only a
statistical statement holds, it is tested over many seeds with its bound.
"""
from __future__ import annotations

import dataclasses

from hypothesis import given, strategies as st

from sim import verdict
from sim.conditions import CONDITIONS, compose
from sim.experiments.margin import cell
from sim.profile import load_profile
from sim.scenario import get_scenario
from sim.workload import make_trace
from test_properties import Case, cases, examples, light_hold_cases


@examples(4)
@given(light_hold_cases(), st.floats(0.1, 0.45))
def test_without_retries_a_burst_whose_backlog_is_well_under_a_deadline_recovers(case: Case, share: float):
    """A pulse at rate p·Ĉ for pulse_s leaves (p - 1)·pulse_s seconds of work
    at capacity; set that to at most 0.45 of a deadline. Without retries no
    attempt adds work, so that backlog drains under a light hold (0.3-0.45 Ĉ)
    within a deadline or so, each call waits less than a deadline behind it,
    and the hold's windows soon deliver in time with an empty queue: the run
    must recover."""
    s = case.scenario
    s = s.with_(pulse=1.0 + share * s.deadline_s / s.pulse_s)
    c = Case(case.profile, s, case.condition, case.capacity, case.seed)
    rec = c.record(c.run())
    assert (s.pulse - 1.0) * s.pulse_s <= 0.45 * s.deadline_s + 1e-9
    assert rec["attempts"]["retries"] == 0
    assert rec["recovered"] is True, (rec["windows"], rec["cohorts"])


@examples(10)
@given(cases(names=("no-retry", "no-retry+cancel")), st.floats(1.1, 2.0))
def test_slowing_every_step_never_brings_recovery_to_a_no_retry_run(case: Case, s: float):
    """Common random numbers: the same trace and seed, every step-time
    coefficient x s (s > 1). Without retries the offered work is the trace's
    whatever the engine's speed; a slower engine serves each step later, so
    every window delivers no more in time and queues no less. A run that did
    not recover at speed 1 cannot recover slower."""
    base = case.record(case.run())
    slow = Case(verdict.perturbed(case.profile, speed=s), case.scenario, case.condition, case.capacity, case.seed,
                case.mixed_prompts)
    slow_rec = slow.record(slow.run())
    assert not (slow_rec["recovered"] and not base["recovered"]), (base["windows"], slow_rec["windows"])


@examples(10)
@given(cases(names=("no-control", "cancel", "budget", "budget+cancel")))
def test_coalescing_never_creates_more_executions(case: Case):
    """A retry under coalescing attaches to its call's live execution instead
    of starting another, and only creates one when none is live; the same
    trace and seed without coalescing creates one per admitted attempt. So the
    run with coalescing creates no more executions."""
    without = case.run()
    co = Case(case.profile, case.scenario, compose(case.condition, coalesce=True), case.capacity, case.seed,
              case.mixed_prompts)
    with_ = co.run()
    assert len(with_.executions) <= len(without.executions)


# ------------------------------------------------------------------ statistical
NS = get_scenario("cpu-tiny")
TINY = dataclasses.replace(load_profile("vllm-cpu-tiny"), capacity=4.0)
SEEDS = range(16)


def test_recovery_probability_falls_as_the_engine_slows_and_the_burst_grows():
    """Per seed the verdict near a tipping point can go either way, but
    P(recovered) over seeds must not rise as the engine slows or the burst
    grows. Bound: over 16 common seeds, each step's P may rise by at most
    2/16 (two seeds flipping the wrong way), and the ends must differ by at
    least half: the deployment (cpu-tiny on the tiny engine at Ĉ = 4/s, cancel)
    recovers at speed 1 and at 0.7 of its burst, not at speed 1.3 nor at 1.3
    times its burst."""
    cond = NS.condition(CONDITIONS["cancel"])
    ps = [cell(verdict.perturbed(TINY, speed=s), NS.scenario, cond, SEEDS, trace_capacity=TINY.capacity)["p"]
          for s in (1.0, 1.1, 1.3)]
    assert all(b <= a + 2 / 16 for a, b in zip(ps, ps[1:])), ps
    assert ps[0] - ps[-1] >= 0.5, ps
    pp = [cell(TINY, NS.scenario.with_(pulse=NS.scenario.pulse * m), cond, SEEDS)["p"] for m in (0.7, 1.0, 1.3)]
    assert all(b <= a + 2 / 16 for a, b in zip(pp, pp[1:])), pp
    assert pp[0] - pp[-1] >= 0.5, pp


def test_a_perturbed_engine_replays_the_same_traces():
    """Common random numbers on the speed and kv axes: the trace is drawn at
    the unperturbed capacity, so a seed gives the same calls at every probe."""
    a = make_trace(TINY.capacity, NS.scenario, 3)
    slow = verdict.perturbed(TINY, speed=2.0, kv=0.5)
    assert slow.capacity == TINY.capacity
    b = make_trace(slow.capacity, NS.scenario, 3)
    assert (a.arrival == b.arrival).all() and (a.prompt_len == b.prompt_len).all()
    assert slow.step_time.fixed_s == 2.0 * TINY.step_time.fixed_s
    assert slow.engine["num_gpu_blocks"] == TINY.engine["num_gpu_blocks"] // 2
