"""Property tests of whole simulated runs on random small engines and scenarios.

Each example builds a small profile (a few hundred to a few thousand KV
blocks, steps of ~10-50 ms) and a short scenario (base / pulse / hold of tens
of seconds, deadlines of seconds), runs `simulate()` under a named condition
and checks what must hold of any run: every call ends once, the records of
calls, attempts and executions are consistent with each other and with the
engine's counters, a seed reproduces a run, the closed-form fast-forward gives
the run that stepping one step at a time gives, and without retries a light
hold after the pulse recovers.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from sim.capacity import capacity_protocol
from sim.conditions import CONDITIONS, Condition, compose
from sim.measures import record
from sim.model import simulate
from sim.profile import Profile, from_dict
from sim.runlog import RunLog
from sim.scenario import Scenario
from sim.workload import Trace, make_trace

OUTCOMES = ("delivered", "failed_attempts", "failed_retry_after")
FATES = ("", "completed", "aborted", "dropped", "refused")
ATTEMPT_OUTCOMES = ("", "complete", "timeout", "refused_budget", "refused_engine", "refused_proxy")
MAX_CALLS = 600         # keeps one run around a tenth of a second
# LLMSIM_PROPERTY_SCALE=20 runs twenty times the examples (a deeper search)
SCALE = max(1, int(os.environ.get("LLMSIM_PROPERTY_SCALE", "1")))
SEARCH = os.environ.get("LLMSIM_PROPERTY_SEARCH") == "1"


def examples(n: int) -> settings:
    """n examples (times LLMSIM_PROPERTY_SCALE), drawn from a fixed seed so that
    every machine runs the same ones; LLMSIM_PROPERTY_SEARCH=1 draws new ones."""
    return settings(max_examples=n * SCALE, deadline=None, derandomize=not SEARCH,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------
# Small engines and scenarios
# --------------------------------------------------------------------------

def estimated_capacity(profile: Profile, s: Scenario) -> float:
    """A rough closed-form Ĉ (calls/s) of a small profile under a scenario's
    workload: the lower of the prefill-throughput bound and the bound from
    the requests that fit at once (seats, KV) over their residence time.
    Used only to scale the load; within ~30% of `capacity_protocol`."""
    m, e = profile.step_time, profile.engine
    B = e["max_num_batched_tokens"]
    prompt = max(s.prompt_mean, s.shared_prefix + 1.0)     # make_trace's floor
    full = (m.fixed_s + m.per_token_s * B + m.per_request_s * 4
            + m.per_prefill_pair_s * B * (prompt / 2 + B / 2))
    work = prompt - s.shared_prefix + s.response_mean
    prefill_bound = B / full / work
    seats = min(e["max_num_seqs"], e["num_gpu_blocks"] * e["block_size"] / (prompt + s.response_mean))
    decode = (m.fixed_s + (m.per_request_s + m.per_token_s) * seats
              + m.per_decode_ctx_s * seats * prompt)
    residence = s.response_mean * decode + (prompt / B) * full
    return min(prefill_bound, seats / residence)


@st.composite
def profiles(draw, max_num_seqs=st.integers(8, 64), num_gpu_blocks=st.integers(300, 3000),
             fixed_s=st.floats(0.01, 0.035)) -> Profile:
    B = draw(st.sampled_from([512, 1024, 2048]))
    d = {
        "name": "small-test",
        "step_time": {
            # steps of ~10-50 ms: a decode step costs about fixed_s, a full
            # token budget adds 2-15 ms
            "fixed_s": draw(fixed_s),
            "per_request_s": draw(st.floats(0.0, 3e-4)),
            "per_token_s": draw(st.floats(0.002, 0.015)) / B,
            "per_prefill_pair_s": draw(st.floats(0.0, 2e-9)),
            "per_decode_ctx_s": draw(st.floats(0.0, 5e-8)),
        },
        "engine": {
            "max_num_seqs": draw(max_num_seqs),
            "max_num_batched_tokens": B,
            "block_size": 16,
            "num_gpu_blocks": draw(num_gpu_blocks),
            "depth": draw(st.sampled_from([1, 2])),
            "max_model_len": 32768,
        },
        "capacity": 1.0,
        "provenance": {"kind": "property test"},
    }
    # a server's frontend on every request's way in (engine.frontend_s), in one profile of three:
    # from a fraction of a step to several steps
    frontend = draw(st.one_of(st.just(0.0), st.just(0.0), st.floats(0.001, 0.2)))
    if frontend:
        d["engine"]["frontend_s"] = frontend
    return from_dict(d, "property test")


@st.composite
def scenarios(draw, hold_load=st.floats(0.2, 0.9), pulse=st.floats(1.2, 3.0), max_retries=st.integers(1, 3),
              pulse_s=st.sampled_from([10.0, 15.0, 20.0]), prompt_mean=st.floats(200.0, 1500.0)) -> Scenario:
    prompt_mean = draw(prompt_mean)
    shared = draw(st.sampled_from([64, 128, 256]))
    median = draw(st.floats(10.0, 30.0))
    deadline = draw(st.floats(5.0, 20.0))
    window = draw(st.sampled_from([10.0, 15.0, 20.0]))
    hold = draw(st.sampled_from([60.0, 90.0]))
    return Scenario(
        base_s=draw(st.sampled_from([10.0, 20.0])), pulse_s=draw(pulse_s), hold_s=hold,
        base_load=draw(st.floats(0.2, 0.8)), hold_load=draw(hold_load), pulse=draw(pulse),
        prompt_mean=prompt_mean, prompt_sd=draw(st.floats(0.0, 0.2)) * prompt_mean,
        shared_prefix=shared, mixed_prompt_len=shared + 100,
        response_median=median, response_mean=median * draw(st.floats(1.1, 1.8)),
        deadline_s=deadline, max_retries=draw(max_retries),
        backoff_min_s=0.25, backoff_max_s=draw(st.sampled_from([1.0, 3.0])), max_retry_after_s=120.0,
        delivery_horizon_s=deadline * draw(st.floats(2.0, 5.0)),
        primary_skip_s=window, window_s=window,
    )


@st.composite
def conditions(draw, names=tuple(CONDITIONS)) -> Condition:
    """A named condition, sometimes with caps the small engine reaches, or
    one composed from random control settings."""
    if tuple(names) == tuple(CONDITIONS) and draw(st.integers(0, 4)) == 0:
        return composed(draw)
    cond = CONDITIONS[draw(st.sampled_from(sorted(names)))]
    if cond.engine_cap is not None and draw(st.booleans()):
        # a cap the small engine actually reaches
        cond = dataclasses.replace(cond, name=cond.name + "-small", engine_cap=draw(st.integers(2, 40)))
    if cond.proxy.proxy_cap is not None and draw(st.booleans()):
        cond = dataclasses.replace(cond, name=cond.name + "-small",
                                   proxy=dataclasses.replace(cond.proxy, proxy_cap=draw(st.integers(1, 30)),
                                                             lifo_after=draw(st.sampled_from([0, 5, 50]))))
    return cond


def composed(draw) -> Condition:
    cond = compose(draw(st.sampled_from(["no-control", "no-retry"])),
                   cancel=draw(st.sampled_from(["off", "now", "deferred:0", "deferred:2", "deferred:10"])),
                   coalesce=draw(st.booleans()), budget=draw(st.sampled_from([0, 0.1, 0.5])),
                   order=draw(st.sampled_from(["budget-first", "lookup-first"])),
                   proxy_cap=draw(st.sampled_from([0, 1, 4, 20])),
                   queue=draw(st.sampled_from(["fifo", "deadline", "lifo"])),
                   engine_cap=draw(st.sampled_from([0, 3, 30])))
    return dataclasses.replace(cond, proxy=dataclasses.replace(cond.proxy, lifo_after=draw(st.sampled_from([0, 5]))))


class Case:
    """One example: a profile, a scenario, a condition and the trace
    make_trace(capacity, scenario, seed, mixed_prompts) gives."""

    def __init__(self, profile: Profile, scenario: Scenario, condition: Condition, capacity: float,
                 seed: int, mixed_prompts: bool = False):
        self.profile, self.scenario, self.condition = profile, scenario, condition
        self.capacity, self.seed, self.mixed_prompts = capacity, seed, mixed_prompts
        self.trace = make_trace(capacity, scenario, seed, mixed_prompts=mixed_prompts)

    def run(self, fast_forward: bool = True) -> RunLog:
        return simulate(self.profile, self.trace, self.condition, self.scenario, seed=self.seed,
                        fast_forward=fast_forward)

    def record(self, log: RunLog) -> dict:
        return record(log, self.scenario, self.capacity,
                      {"model": self.profile.name, "condition": self.condition.name,
                       "pulse": self.scenario.pulse, "seed": self.seed})

    def __repr__(self) -> str:
        # enough to rebuild the example by hand ({len(trace)} calls)
        return (f"Case(from_dict({self.profile.raw!r}),\n     {self.scenario!r},\n     {self.condition!r},\n"
                f"     capacity={self.capacity!r}, seed={self.seed}, mixed_prompts={self.mixed_prompts})"
                f"  # {len(self.trace)} calls")


def _trace_fits(profile: Profile, trace: Trace) -> bool:
    """Every request fits in the KV pool with room to spare (otherwise it can
    never run, and max_model_len would refuse it)."""
    if not len(trace):
        return True
    longest = int((trace.prompt_len + trace.max_tokens).max())
    return longest <= min(profile.engine["max_model_len"], profile.kv_tokens // 2)


@st.composite
def cases(draw, names=tuple(CONDITIONS)) -> Case:
    profile = draw(profiles())
    scenario = draw(scenarios())
    condition = draw(conditions(names))
    seed = draw(st.integers(0, 2**16))
    cap = estimated_capacity(profile, scenario)
    s = scenario
    expected = cap * (s.base_load * s.base_s + s.pulse * s.pulse_s + s.hold_load * s.hold_s)
    if expected > MAX_CALLS:
        # a fast engine: lighter base and hold, a shorter pulse that still
        # overloads, rather than thousands of calls
        scale = MAX_CALLS / expected
        pulse = max(s.pulse * scale, min(1.2, s.pulse))
        scenario = s.with_(base_load=s.base_load * scale, hold_load=s.hold_load * scale, pulse=pulse,
                           pulse_s=max(2.0, min(s.pulse_s, 0.5 * MAX_CALLS / (pulse * cap))))
    case = Case(profile, scenario, condition, cap, seed, mixed_prompts=draw(st.booleans()))
    assume(_trace_fits(profile, case.trace))
    return case


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def _isnan(x: float) -> bool:
    return x != x


def hit_time_limit(case: Case, log: RunLog) -> bool:
    last = float(case.trace.arrival[-1]) if len(case.trace) else 0.0
    return log.end_time >= last + case.scenario.delivery_horizon_s - 1e-9


def assert_close(a, b, path: str = "record", rel: float = 1e-9) -> None:
    """Equal structure; floats within a relative tolerance, everything else exact."""
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a.keys() ^ b.keys())}"
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}", rel)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]", rel)
    elif isinstance(a, float) and not isinstance(a, bool):
        assert isinstance(b, float), f"{path}: {a!r} vs {b!r}"
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), f"{path}: {a!r} vs {b!r}"
        else:
            assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-12), f"{path}: {a!r} vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def _without_wall(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "wall_s"}


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

@examples(25)
@given(cases())
def test_every_call_ends_in_one_outcome(case: Case):
    log = case.run()
    s = case.scenario
    retries = s.max_retries if case.condition.retries else 0
    limit = hit_time_limit(case, log)
    assert len(log.calls) == len(case.trace)
    for c in log.calls:
        assert c.outcome in OUTCOMES or (c.outcome == "" and limit), (c, log.end_time)
        assert (c.outcome == "delivered") == (not _isnan(c.delivered_at)), c
        assert 1 <= c.attempts <= retries + 1, c
        if c.outcome == "delivered":
            assert c.planned_at <= c.delivered_at <= log.end_time + 1e-9, c
        if c.outcome == "failed_attempts":
            assert c.attempts == retries + 1, c
    # each call's attempts are numbered 0..n-1, sent in order, and only its
    # last one can still be open; a delivered call's last attempt completed
    by_call: dict[int, list] = {}
    for a in log.attempts:
        by_call.setdefault(a.call, []).append(a)
        assert a.outcome in ATTEMPT_OUTCOMES, a
        assert (a.outcome == "") == _isnan(a.ended_at), a
        if a.outcome:
            assert a.sent_at <= a.ended_at, a
        if a.outcome == "timeout":
            assert math.isclose(a.ended_at - a.sent_at, s.deadline_s, rel_tol=1e-9, abs_tol=1e-9), a
    for c in log.calls:
        atts = by_call.get(c.id, [])
        assert [a.number for a in atts] == list(range(c.attempts)), c
        assert all(x.sent_at <= y.sent_at for x, y in zip(atts, atts[1:])), c
        assert all(a.outcome for a in atts[:-1]), c
        assert atts[0].sent_at == c.planned_at, c
        last = atts[-1]
        if c.outcome == "delivered":
            assert last.outcome == "complete" and last.ended_at == c.delivered_at, (c, last)
        elif c.outcome:
            assert last.outcome not in ("", "complete"), (c, last)
        else:
            assert limit
    if not limit:
        assert all(c.outcome for c in log.calls)


@examples(25)
@given(cases())
def test_attempts_executions_and_counters_are_conserved(case: Case):
    log = case.run()
    rec = case.record(log)
    calls, atts, exs = log.calls, log.attempts, log.executions

    # attempts
    assert len(atts) == sum(c.attempts for c in calls)
    assert rec["attempts"]["sent"] == len(atts)
    assert rec["attempts"]["first"] == len(calls)

    # executions: ids 0..n-1; each created by exactly one (non-attached) attempt
    assert [e.id for e in exs] == list(range(len(exs)))
    creators = Counter()
    for a in atts:
        if a.execution >= 0:
            assert a.execution < len(exs), a
            e = exs[a.execution]
            assert e.call == a.call, (a, e)
            if not a.attached:
                creators[a.execution] += 1
                assert e.attempt == a.number, (a, e)
                assert e.created_at == a.sent_at, (a, e)
    for e in exs:
        assert creators[e.id] == 1, e

    # the engine's answer to every dispatched execution
    dispatched = [e for e in exs if not _isnan(e.dispatched_at)]
    accepted = sum(e.accepted for e in exs)
    refused = sum(e.fate == "refused" for e in exs)
    assert accepted + refused == len(dispatched)
    for e in exs:
        assert e.fate in FATES, e
        assert (e.fate == "") == _isnan(e.finished_at), e
        if e.accepted:
            assert not _isnan(e.dispatched_at) and e.fate not in ("refused", "dropped"), e
        else:
            assert e.fate in ("refused", "dropped", "") and e.prompt_computed == 0, e
            assert _isnan(e.first_scheduled_at) and e.tokens_generated == 0, e
        if _isnan(e.dispatched_at):
            assert e.fate in ("dropped", ""), e
        if e.fate in ("completed", "aborted"):
            assert e.accepted, e
        if e.fate == "completed":
            assert e.tokens_generated == e.max_tokens, e
            assert not _isnan(e.first_token_at), e
        assert 0 <= e.tokens_generated <= e.max_tokens, e
        if e.preemptions == 0 and not _isnan(e.first_token_at):
            # the prompt was computed once, less what the prefix cache gave
            assert e.prompt_computed + e.prefix_hit_tokens == e.prompt_len, e
        assert 0 <= e.prompt_in_flight <= e.prompt_computed, e
        if e.fate != "aborted":
            assert e.prompt_in_flight == 0, e
        if not _isnan(e.first_token_at):
            assert e.created_at <= e.dispatched_at <= e.first_scheduled_at <= e.first_token_at, e
        if e.fate:
            assert e.created_at <= e.finished_at, e
        if e.fate == "refused":
            assert e.finished_at == e.dispatched_at, e
        if e.fate == "dropped":     # left the proxy queue: never reached the engine
            assert _isnan(e.dispatched_at) and not e.accepted and e.prompt_computed == 0, e
            assert e.created_at <= e.finished_at, e
    if case.condition.engine_cap is None:
        assert refused == 0

    # fates partition the executions
    ex = rec["executions"]
    assert ex["created"] == len(exs)
    assert ex["completed"] + ex["aborted"] + ex["dropped"] + ex["refused"] + ex["live_at_end"] == ex["created"]
    assert ex["accepted"] == accepted
    # an attempt that completed got its execution's output
    for a in atts:
        if a.outcome == "complete":
            assert exs[a.execution].fate == "completed", a
            assert exs[a.execution].finished_at == a.ended_at, a
        if a.outcome == "refused_engine":
            assert exs[a.execution].fate == "refused", a
        if a.outcome == "refused_proxy":     # the deadline check refused it at arrival
            assert a.execution == -1 and a.ended_at == a.sent_at, a
        if a.outcome == "refused_budget":
            assert a.execution == -1 and a.number > 0 and a.ended_at == a.sent_at, a
        if a.attached:
            assert a.number > 0 and case.condition.proxy.coalesce, a
    if case.condition.proxy.proxy_cap is None:
        assert ex["dropped"] == 0 and not log.series.proxy_queue.any()
    else:
        # the proxy never has more than N executions in the engine
        cap = case.condition.proxy.proxy_cap
        ends = sorted([(e.dispatched_at, 1) for e in exs if e.accepted]
                      + [(min(e.finished_at, e.cancel_requested_at) if not _isnan(e.cancel_requested_at)
                          else e.finished_at, -1) for e in exs if e.accepted and e.fate])
        level = 0
        for _, d in ends:
            level += d
            assert level <= cap
    assert rec["retries"]["refused_budget"] == sum(a.outcome == "refused_budget" for a in atts)
    if case.condition.proxy.budget is None:
        assert rec["retries"]["refused_budget"] == 0
    assert (log.series.proxy_queue >= 0).all()

    # prompt work
    pt = rec["prompt_tokens"]
    assert pt["computed"] == sum(e.prompt_computed for e in exs)
    assert pt["never_aborted"] + pt["aborted_body"] + pt["aborted_in_flight"] == pt["computed"]
    assert min(pt.values()) >= 0
    assert pt["missed_by_counter"] <= pt["aborted_body"] + pt["aborted_in_flight"]

    # engine counters, as vLLM defines them
    k = log.counters
    assert 0 <= k["prefix_cache_hits_total"] <= k["prefix_cache_queries_total"]
    # prompt_tokens_total: full prompt once, at the first output token
    assert k["prompt_tokens_total"] == sum(e.prompt_len for e in exs if not _isnan(e.first_token_at))
    # queries: full prompt once, at the first admission (which schedules a chunk)
    assert k["prefix_cache_queries_total"] == sum(e.prompt_len for e in exs if not _isnan(e.first_scheduled_at))
    assert k["prefix_cache_hits_total"] <= sum(e.prefix_hit_tokens for e in exs)
    for e in exs:
        assert e.prefix_hit_tokens <= (e.preemptions + 1) * (e.prompt_len + e.max_tokens), e
    assert log.engine["preemptions"] == sum(e.preemptions for e in exs)
    assert log.engine["aborted_before_scheduled"] <= ex["aborted"]
    # snapshots are monotone
    snaps = [log.counters_at[t] for t in sorted(log.counters_at)] + [k]
    for a, b in zip(snaps, snaps[1:]):
        for key in a:
            assert a[key] <= b[key], key


@examples(10)
@given(cases())
def test_a_seed_reproduces_the_run(case: Case):
    a, b = case.run(), case.run()
    assert _nan_equal(a.calls, b.calls)
    assert _nan_equal(a.attempts, b.attempts)
    assert _nan_equal(a.executions, b.executions)
    assert a.end_time == b.end_time and a.counters == b.counters and a.engine == b.engine
    ra, rb = _without_wall(case.record(a)), _without_wall(case.record(b))
    assert ra == rb


def _nan_equal(xs: list, ys: list) -> bool:
    """Record lists equal field by field, NaN equal to NaN."""
    def norm(v):
        return None if isinstance(v, float) and v != v else v
    return len(xs) == len(ys) and all(
        tuple(map(norm, dataclasses.astuple(x))) == tuple(map(norm, dataclasses.astuple(y)))
        for x, y in zip(xs, ys))


@examples(20)
@given(cases())
def test_fast_forward_matches_stepping_one_step_at_a_time(case: Case):
    fast, slow = case.run(fast_forward=True), case.run(fast_forward=False)
    rf, rs = _without_wall(case.record(fast)), _without_wall(case.record(slow))
    # SimPy step events are what the closed form saves: the one figure that differs
    for r in (rf, rs):
        r.get("extra", {}).pop("step_events", None)
    assert_close(rf, rs)
    # the records behind it, too
    for name in ("calls", "attempts", "executions"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert_close([dataclasses.astuple(x) for x in a], [dataclasses.astuple(y) for y in b], name)
    assert math.isclose(fast.end_time, slow.end_time, rel_tol=1e-9)


@st.composite
def roofline_cases(draw) -> Case:
    """A case whose engine has the roofline step time: part of fixed_s is the
    weights' read (weights_s), the ridge point drawn within the decode
    batches' sizes so that runs of decode steps meet it from either side."""
    case = draw(cases())
    st_ = case.profile.step_time.to_dict()
    ridge = draw(st.floats(0.3, 1.5)) * case.profile.engine["max_num_seqs"]
    st_ = dict(st_, form="roofline", weights_s=st_["per_token_s"] * ridge)
    st_["fixed_s"] = max(0.0, st_["fixed_s"] - st_["weights_s"])
    profile = from_dict(dict(case.profile.raw, step_time=st_), "property test")
    return Case(profile, case.scenario, case.condition, case.capacity, case.seed, case.mixed_prompts)


@examples(10)
@given(roofline_cases())
def test_roofline_fast_forward_matches_stepping_one_step_at_a_time(case: Case):
    fast, slow = case.run(fast_forward=True), case.run(fast_forward=False)
    rf, rs = _without_wall(case.record(fast)), _without_wall(case.record(slow))
    for r in (rf, rs):
        r.get("extra", {}).pop("step_events", None)
    assert_close(rf, rs)
    assert math.isclose(fast.end_time, slow.end_time, rel_tol=1e-9)


def _tiny_profile(num_gpu_blocks: int, depth: int) -> Profile:
    """10 ms steps whatever their content."""
    return from_dict({
        "name": "tiny", "capacity": 1.0, "provenance": {"kind": "property test"},
        "step_time": {"fixed_s": 0.01, "per_request_s": 0.0, "per_token_s": 0.0,
                      "per_prefill_pair_s": 0.0, "per_decode_ctx_s": 0.0},
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 16,
                   "num_gpu_blocks": num_gpu_blocks, "depth": depth, "max_model_len": 4096}})


def test_steps_and_busy_time_at_the_time_limit_do_not_depend_on_fast_forward():
    # one call decoding 1000 tokens in 10 ms steps; the run stops after 1 s,
    # in the middle of what fast-forward takes as one closed-form run
    scenario = Scenario(deadline_s=10.0, delivery_horizon_s=1.0)
    trace = Trace(arrival=np.array([0.0]), prompt_len=np.array([100]), max_tokens=np.array([1000]),
                  shared_prefix=0)
    fast, slow = (simulate(_tiny_profile(300, depth=1), trace, CONDITIONS["no-retry"], scenario, fast_forward=ff)
                  for ff in (True, False))
    assert fast.end_time == slow.end_time == 1.0
    # the steps done by the end (100 of 10 ms), not those scheduled past it
    assert fast.engine["steps"] == slow.engine["steps"] == 100
    assert math.isclose(fast.extra["busy_s"], 1.0) and math.isclose(slow.extra["busy_s"], 1.0)


def test_preempted_with_its_last_token_in_flight_finishes_with_max_tokens():
    # A (64-token prompt, 40 tokens) decodes from step 1 and needs a new block
    # at step 17; B (48-token prompt, 1 token) is admitted at step 16 into the
    # last 3 free blocks and finishes in it. Scheduling step 17 while step 16
    # is in flight (depth 2) preempts B; step 16's output then gives B its
    # only token, and B finishes on it rather than being recomputed.
    trace = Trace(arrival=np.array([0.0, 0.145]), prompt_len=np.array([64, 48]),
                  max_tokens=np.array([40, 1]), shared_prefix=0)
    log = simulate(_tiny_profile(8, depth=2), trace, CONDITIONS["no-retry"],
                   Scenario(deadline_s=100.0, delivery_horizon_s=100.0))
    a, b = log.executions
    assert b.preemptions == 1 and math.isclose(b.first_token_at, 0.17)
    assert b.fate == "completed"
    assert b.tokens_generated == b.max_tokens == 1
    assert math.isclose(b.finished_at, b.first_token_at)
    assert b.prompt_computed == 48
    assert a.fate == "completed" and a.tokens_generated == 40 and a.preemptions == 0
    assert [c.outcome for c in log.calls] == ["delivered", "delivered"]


@st.composite
def light_hold_cases(draw) -> Case:
    # a short pulse, then a hold well below capacity, long enough to drain the
    # backlog and show two good 20 s windows
    s = draw(scenarios(hold_load=st.floats(0.3, 0.45), pulse=st.floats(1.5, 2.7), max_retries=st.just(3),
                       pulse_s=st.just(10.0), prompt_mean=st.floats(600.0, 1500.0)))
    # the recovery rule's growth limit of 0.01/s is 0.6 calls over a 60 s window: keep
    # that per window, or a single waiting request sampled at the end of a 20 s
    # window fails it
    s = s.with_(hold_s=120.0, window_s=20.0, primary_skip_s=20.0, base_load=min(s.base_load, 0.5),
                recovery_queue_growth=0.01 * 60.0 / 20.0)
    # enough seats, in max_num_seqs and in KV blocks, that a light load seldom
    # queues (the rule wants a queue averaging <= 2 and not growing over a
    # window), and slowish steps so that the capacity and the number of calls
    # stay small
    seats = draw(st.integers(12, 24))
    blocks = math.ceil(seats * (s.prompt_mean + 3 * s.prompt_sd + 4 * s.response_mean) / 16)
    profile = draw(profiles(max_num_seqs=st.integers(seats, 32), num_gpu_blocks=st.integers(blocks, 2 * blocks),
                            fixed_s=st.floats(0.025, 0.05)))
    est = estimated_capacity(profile, s)
    assume(est * (s.base_load * s.base_s + s.pulse * s.pulse_s + s.hold_load * s.hold_s) <= 2 * MAX_CALLS)
    seed = draw(st.integers(0, 2**16))
    cal = capacity_protocol(profile, s, seed=seed, start_rate=est / 3.0, factor=1.5, stage_s=20.0, max_stages=14)
    trace = make_trace(cal["capacity"], s, seed)
    assume(_trace_fits(profile, trace))
    # a deadline that the longest response of the trace meets on an idle
    # engine (the trace does not depend on it): a lognormal tail of responses
    # too long for a short deadline would fail calls however light the load
    e, m = profile.engine, profile.step_time
    longest = int((trace.prompt_len + trace.max_tokens).max())
    step = m.duration(e["max_num_seqs"], e["max_num_batched_tokens"] + e["max_num_seqs"],
                      e["max_num_batched_tokens"] * longest, e["max_num_seqs"] * longest)
    prefill_steps = math.ceil(int(trace.prompt_len.max()) / e["max_num_batched_tokens"])
    service = (prefill_steps + int(trace.max_tokens.max())) * step
    if 1.5 * service > s.deadline_s:
        s = s.with_(deadline_s=1.5 * service, delivery_horizon_s=s.delivery_horizon_s / s.deadline_s * 1.5 * service)
    condition = CONDITIONS[draw(st.sampled_from(["no-retry", "no-retry+cancel"]))]
    return Case(profile, s, condition, cal["capacity"], seed)


@examples(8)
@given(light_hold_cases())
def test_without_retries_a_light_hold_recovers(case: Case):
    log = case.run()
    rec = case.record(log)
    assert rec["calls_failed"]["outstanding"] == 0
    assert rec["attempts"]["retries"] == 0
    assert rec["recovered"] is True, (rec["windows"], rec["cohorts"])
    assert rec["recovery_time_s"] <= case.scenario.hold_s


# --------------------------------------------------------------------------
# Controls in whole runs
# --------------------------------------------------------------------------

def _live_until(e) -> float:
    """When the proxy stopped counting the execution as live."""
    end = e.finished_at if e.fate else math.inf
    return min(end, e.cancel_requested_at) if not _isnan(e.cancel_requested_at) else end


@examples(15)
@given(cases(names=("coalesce", "coalesce+cancel", "deferred", "budget-first", "lookup-first")))
def test_with_coalescing_a_call_never_has_two_live_executions(case: Case):
    log = case.run()
    by_call: dict[int, list] = {}
    for e in log.executions:
        by_call.setdefault(e.call, []).append(e)
    for exs in by_call.values():
        exs.sort(key=lambda e: (e.created_at, e.id))
        for a, b in zip(exs, exs[1:]):
            assert b.created_at >= _live_until(a), (a, b)


@st.composite
def deferred_cases(draw) -> Case:
    case = draw(cases(names=("no-control",)))
    # W above the client's longest wait between an attempt leaving and its retry
    w = case.scenario.backoff_max_s + draw(st.floats(0.01, 5.0))
    case.condition = compose("no-control", cancel=f"deferred:{w!r}", coalesce=True,
                             engine_cap=draw(st.sampled_from([0, 0, 20])))
    return case


@examples(15)
@given(deferred_cases())
def test_deferred_cancellation_longer_than_the_backoff_never_cancels_a_retried_call(case: Case):
    log = case.run()
    w = case.condition.proxy.defer_s
    sent: dict[int, list] = {}
    for a in log.attempts:
        sent.setdefault(a.call, []).append(a.sent_at)
    cancelled = [e for e in log.executions if not _isnan(e.cancel_requested_at)]
    for e in cancelled:
        left = e.cancel_requested_at - w          # its last subscriber left here
        assert not any(t > left for t in sent[e.call]), (e, sent[e.call])
    if case.condition.retries and cancelled:
        # a cancelled execution's call made its last attempt
        for e in cancelled:
            assert len(sent[e.call]) == case.scenario.max_retries + 1 or log.calls[e.call].outcome != "", e


@examples(15)
@given(cases(names=("budget", "budget+cancel", "budget-first")))
def test_the_budget_admits_no_more_retries_than_its_share_in_a_run(case: Case):
    log = case.run()
    ratio, win = case.condition.proxy.budget, case.condition.proxy.budget_window_s
    firsts = np.sort([a.sent_at for a in log.attempts if a.number == 0])
    admitted = np.sort([a.sent_at for a in log.attempts if a.number > 0 and a.outcome != "refused_budget"])
    for t in admitted:
        n_r = np.count_nonzero((admitted > t - win) & (admitted <= t))
        n_f = np.count_nonzero((firsts > t - win) & (firsts <= t))
        assert n_r <= ratio * n_f + 1e-9, (t, n_r, n_f)
