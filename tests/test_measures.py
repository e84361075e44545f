"""The measures and the result record (docs/model.md#measures, #result-record) on hand-built run logs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.measures import REQUIRED_KEYS, record, recovery, summary, window_stats
from sim.runlog import (
    ATTEMPT_OUTCOMES,
    CALL_OUTCOMES,
    EXECUTION_FATES,
    NAN,
    AttemptRecord,
    AttemptTable,
    CallRecord,
    CallTable,
    ExecutionRecord,
    ExecutionTable,
    RunLog,
    Series,
    column,
)
from sim.scenario import PAPER

S = PAPER          # pulse end 227, hold end 947, primary from 347, 12 windows
NW = 12


def rec_(delivery, mean=None, growth=None, s=S):
    mean = [0.0] * len(delivery) if mean is None else mean
    growth = [0.0] * len(delivery) if growth is None else growth
    return recovery(delivery, mean, growth, s)


# --------------------------------------------------------------------------
# recovery rule
# --------------------------------------------------------------------------

def test_recovers_at_end_of_second_good_window():
    assert rec_([0.5] * 4 + [1.0] * 8) == (True, 360.0)


def test_first_two_windows_good():
    assert rec_([1.0] * NW) == (True, 120.0)


def test_last_pair_of_the_hold():
    assert rec_([0.0] * 10 + [1.0, 1.0]) == (True, 720.0)


def test_never_recovers():
    assert rec_([0.9] * NW) == (False, None)
    assert rec_([0.0] * 11 + [1.0]) == (False, None)


def test_exactly_98_percent_is_good_just_below_is_not():
    assert rec_([0.0, 0.98, 0.98] + [0.0] * 9) == (True, 180.0)
    assert rec_([0.0, 49 / 50, 49 / 50] + [0.0] * 9) == (True, 180.0)
    assert rec_([0.0, 0.98, 0.9799] + [0.0] * 9) == (False, None)
    assert rec_([0.0, 0.98, 97 / 99] + [0.0] * 9) == (False, None)


def test_single_good_window_then_bad_does_not_count():
    assert rec_([1.0, 0.0] * 6) == (False, None)
    assert rec_([1.0, 0.0, 1.0, 1.0] + [0.0] * 8) == (True, 240.0)


def test_queue_mean_threshold_blocks():
    d = [1.0] * NW
    mean = [2.5] * 6 + [2.0] * 6          # 2.0 itself is allowed
    assert rec_(d, mean=mean) == (True, 480.0)
    assert rec_(d, mean=[2.01] * NW) == (False, None)
    # one window over the mean in the middle of good ones
    assert rec_(d, mean=[2.1, 0, 2.1, 0, 2.1, 0, 0] + [0] * 5) == (True, 420.0)


def test_queue_growth_threshold_blocks():
    d = [1.0] * NW
    assert rec_(d, growth=[0.01] * NW) == (True, 120.0)
    assert rec_(d, growth=[0.011] * NW) == (False, None)
    assert rec_(d, growth=[0.02] * 3 + [-0.5] * 9) == (True, 300.0)


def test_nan_window_is_not_good():
    assert rec_([1.0] * NW, mean=[math.nan] * 11 + [0.0]) == (False, None)


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        recovery([1.0] * 3, [0.0] * 2, [0.0] * 3, S)


# --------------------------------------------------------------------------
# a hand-built run log
# --------------------------------------------------------------------------

def E(id, call, attempt, max_tokens, created, **kw):
    return ExecutionRecord(id=id, call=call, attempt=attempt, prompt_len=100,
                           max_tokens=max_tokens, created_at=created, **kw)


def hand_log(counters_at=None) -> RunLog:
    calls = [
        CallRecord(0, 130.0, 200.0, 1, "delivered"),     # pulse, within
        CallRecord(1, 150.0, 400.0, 2, "delivered"),     # pulse, late (250 s)
        CallRecord(2, 200.0, NAN, 4, "failed_attempts"),  # pulse, undelivered
        CallRecord(3, 300.0, 350.0, 1, "delivered"),     # hold, window 1, within
        CallRecord(4, 400.0, 600.0, 2, "delivered"),     # hold+primary, window 2, late
        CallRecord(5, 500.0, 620.0, 1, "delivered"),     # hold+primary, window 4, exactly 120 s: within
        CallRecord(6, 50.0, 60.0, 1, "delivered"),       # base: no cohort
        CallRecord(7, 600.0, 1500.0, 1, "delivered"),    # hold+primary, 900 s > 840: undelivered
        CallRecord(8, 700.0, 900.0, 2, "delivered"),     # hold+primary, late
        CallRecord(9, 800.0, 1640.0, 0, "delivered"),    # hold+primary, window 9, exactly 840 s: late
    ]
    A = AttemptRecord
    attempts = [
        A(0, 0, 130.0, 200.0, "complete", 0),
        A(1, 0, 150.0, 270.0, "timeout", 1),
        A(1, 1, 272.0, 400.0, "complete", 2),
        A(2, 0, 200.0, 320.0, "timeout", 3),
        A(2, 1, 322.0, 442.0, "timeout", 4),
        A(2, 2, 445.0, 445.0, "refused_budget", -1),
        A(2, 3, 450.0, 450.0, "refused_engine", 5),
        A(3, 0, 300.0, 350.0, "complete", 6),
        A(4, 0, 400.0, 520.0, "timeout", 7),
        A(4, 1, 522.0, 600.0, "complete", 7, attached=True),
        A(5, 0, 500.0, 620.0, "complete", 9),
        A(6, 0, 50.0, 60.0, "complete", 10),
        A(7, 0, 600.0, 1500.0, "complete", 8),
        A(8, 0, 700.0, 820.0, "timeout", 11),
        A(8, 1, 822.0, 900.0, "complete", 12),
    ]
    ex = [
        E(0, 0, 0, 10, 130.0, dispatched_at=130.0, accepted=True, first_scheduled_at=131.0,
          first_token_at=132.0, finished_at=200.0, fate="completed", tokens_generated=10,
          prompt_computed=100),
        E(1, 1, 0, 20, 150.0, dispatched_at=150.0, accepted=True, first_scheduled_at=155.0,
          first_token_at=160.0, finished_at=270.5, fate="aborted", cancel_requested_at=270.0,
          tokens_generated=5, prompt_computed=100, prompt_in_flight=20),
        E(2, 1, 1, 20, 272.0, dispatched_at=272.0, accepted=True, first_scheduled_at=280.0,
          first_token_at=281.0, finished_at=400.0, fate="completed", tokens_generated=20,
          prompt_computed=60, prefix_hit_tokens=40),
        E(3, 2, 0, 30, 200.0, dispatched_at=200.0, accepted=True, first_scheduled_at=250.0,
          finished_at=320.2, fate="aborted", cancel_requested_at=320.0, prompt_computed=80,
          prompt_in_flight=30),
        E(4, 2, 1, 30, 322.0, finished_at=442.0, fate="dropped"),
        E(5, 2, 3, 30, 450.0, dispatched_at=450.0, finished_at=450.0, fate="refused"),
        E(6, 3, 0, 15, 300.0, dispatched_at=300.0, accepted=True, first_scheduled_at=301.0,
          first_token_at=302.0, finished_at=350.0, fate="completed", tokens_generated=15,
          prompt_computed=90),
        E(7, 4, 0, 40, 400.0, dispatched_at=400.0, accepted=True, first_scheduled_at=410.0,
          first_token_at=415.0, finished_at=600.0, fate="completed", tokens_generated=40,
          prompt_computed=120, orphaned_at=520.0),
        E(8, 7, 0, 5, 600.0, dispatched_at=600.0, accepted=True, first_scheduled_at=1400.0,
          first_token_at=1401.0, finished_at=1500.0, fate="completed", tokens_generated=5,
          prompt_computed=100),
        E(9, 5, 0, 8, 500.0, dispatched_at=500.0, accepted=True, first_scheduled_at=501.0,
          first_token_at=502.0, finished_at=620.0, fate="completed", tokens_generated=8,
          prompt_computed=100),
        E(10, 6, 0, 3, 50.0, dispatched_at=50.0, accepted=True, first_scheduled_at=51.0,
          first_token_at=52.0, finished_at=60.0, fate="completed", tokens_generated=3,
          prompt_computed=100),
        # aborted by the engine with no cancel request recorded: finished_at is the abort
        E(11, 8, 0, 10, 700.0, dispatched_at=700.0, accepted=True, first_scheduled_at=705.0,
          finished_at=820.0, fate="aborted", prompt_computed=50),
        E(12, 8, 1, 10, 822.0, dispatched_at=822.0, accepted=True, first_scheduled_at=850.0,
          first_token_at=851.0, finished_at=900.0, fate="completed", tokens_generated=10,
          prompt_computed=50),
    ]
    t = np.arange(0.0, 1000.0)
    waiting = np.zeros_like(t)
    waiting[(t >= 227) & (t < 287)] = 5.0               # window 0: queue mean 5
    proxy = np.zeros_like(t)
    w9 = (t >= 767) & (t < 827)                         # window 9: ramp 0.02/s
    proxy[w9] = 0.02 * (t[w9] - 767)
    running = np.ones_like(t)
    if counters_at is None:
        counters_at = {
            227.0: {"prompt_tokens_total": 300, "prefix_cache_queries_total": 500,
                    "prefix_cache_hits_total": 10},
            947.0: {"prompt_tokens_total": 900, "prefix_cache_queries_total": 1400,
                    "prefix_cache_hits_total": 40},
        }
    return RunLog(
        calls=calls, attempts=attempts, executions=ex,
        series=Series(t=t, waiting=waiting, running=running, proxy_queue=proxy),
        counters={"prompt_tokens_total": 1000, "prefix_cache_queries_total": 1600,
                  "prefix_cache_hits_total": 50},
        counters_at=counters_at,
        engine={"steps": 1234, "preemptions": 2, "aborted_before_scheduled": 0},
        end_time=1650.0, wall_s=0.25,
    )


INPUTS = {"model": "qwen2.5-7b", "condition": "cancel", "pulse": 2.7, "seed": 3}


@pytest.fixture(scope="module")
def rec():
    return record(hand_log(), S, 0.5, INPUTS)


def test_window_stats_hand_log():
    w = window_stats(hand_log(), S)
    assert len(w["delivery"]) == NW
    assert list(w["planned"]) == [0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0]
    assert list(w["delivery"]) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert w["queue_mean"][0] == 5.0
    assert w["queue_growth"][0] == pytest.approx(0.0, abs=1e-12)
    assert w["queue_mean"][9] == pytest.approx(0.02 * 29.5)
    assert w["queue_growth"][9] == pytest.approx(0.02)
    assert list(w["good"]) == [False, True, False, True, True, True, False, False,
                               True, False, True, True]


def test_window_stats_98_percent_from_counts():
    def log(on_time_second):
        calls, i = [], 0
        for k, on_time in ((0, 49), (1, on_time_second)):
            for j in range(50):
                planned = 227.0 + 60 * k + j
                d = planned + (10.0 if j < on_time else 130.0)
                calls.append(CallRecord(i, planned, d))
                i += 1
        t = np.arange(0.0, 1000.0)
        z = np.zeros_like(t)
        return RunLog(calls, [], [], Series(t, z, z, z), {}, {}, {}, 1000.0)
    w = window_stats(log(49), S)
    assert w["delivery"][0] == 0.98 and w["delivery"][1] == 0.98
    assert recovery(w["delivery"], w["queue_mean"], w["queue_growth"], S) == (True, 120.0)
    w = window_stats(log(48), S)
    assert w["delivery"][1] == 0.96
    # windows 2.. have no calls (100%): the first good pair is (2, 3)
    assert recovery(w["delivery"], w["queue_mean"], w["queue_growth"], S) == (True, 240.0)


def test_record_recovery(rec):
    assert rec["recovered"] is True
    assert rec["recovery_time_s"] == 300.0
    assert rec["windows"]["good"][:5] == [False, True, False, True, True]


def test_record_inputs(rec):
    assert (rec["model"], rec["condition"], rec["pulse"], rec["seed"], rec["capacity"]) == \
        ("qwen2.5-7b", "cancel", 2.7, 3, 0.5)


def test_record_cohorts(rec):
    assert rec["cohorts"] == {
        "pulse": {"offered": 3, "delivered": 2, "within_deadline": 1, "late": 1, "undelivered": 1},
        "hold": {"offered": 6, "delivered": 5, "within_deadline": 2, "late": 3, "undelivered": 1},
        "primary": {"offered": 5, "delivered": 4, "within_deadline": 1, "late": 3, "undelivered": 1},
    }


def test_record_rates(rec):
    # over [347, 947) = 600 s at capacity 0.5: one event = 1/300 of C
    r = rec["rates_xC"]
    assert r["attempts"] == pytest.approx(8 / 300)
    assert r["created"] == pytest.approx(6 / 300)
    assert r["accepted"] == pytest.approx(5 / 300)
    assert r["completed"] == pytest.approx(5 / 300)


def test_record_prompt_tokens(rec):
    p = rec["prompt_tokens"]
    assert p == {"computed": 950, "never_aborted": 720, "aborted_body": 180,
                 "aborted_in_flight": 50, "missed_by_counter": 130}
    assert p["never_aborted"] + p["aborted_body"] + p["aborted_in_flight"] == p["computed"]


def test_record_counters(rec):
    assert rec["counters"] == {"prompt_tokens_total": 1000, "prefix_cache_queries_total": 1600,
                               "prefix_cache_hits_total": 50}
    assert rec["counters_hold"] == {"prompt_tokens": 600, "prefix_cache_queries": 900}


def test_counters_hold_fallbacks():
    # no hold-end snapshot: the final counters stand in for it
    r = record(hand_log({227.0: {"prompt_tokens_total": 300, "prefix_cache_queries_total": 500}}),
               S, 0.5, INPUTS)
    assert r["counters_hold"] == {"prompt_tokens": 700, "prefix_cache_queries": 1100}
    # no pulse-end snapshot: the increase is unknown
    r = record(hand_log({}), S, 0.5, INPUTS)
    assert r["counters_hold"] == {"prompt_tokens": None, "prefix_cache_queries": None}


def test_record_retries(rec):
    r = rec["retries"]
    assert {k: r[k] for k in ("sent", "attached", "refused_budget", "refused_engine",
                              "never_scheduled")} == \
        {"sent": 6, "attached": 1, "refused_budget": 1, "refused_engine": 1, "never_scheduled": 3}
    # call 1: cancel 270 -> retry scheduled 280 (10 s); call 8: abort 820 -> 850 (30 s)
    assert r["median_abort_to_first_step_s"] == 20.0
    # 272+120-280 = 112, 822+120-850 = 92
    assert r["median_left_at_first_step_s"] == 102.0
    assert r["never_scheduled_share"] == 0.5


def test_record_waste_engine_extras(rec):
    w = rec["waste"]
    assert w["abort_rate"] == pytest.approx(3 / 11)
    assert w["completion_ratio"] == pytest.approx(116 / 171)
    assert w["useful_token_ratio"] == pytest.approx(111 / 171)
    assert rec["engine"] == {"aborted_before_scheduled": 0, "preemptions": 2, "steps": 1234}
    assert rec["wall_s"] == 0.25
    assert rec["calls_failed"] == {"attempts": 1, "retry_after": 0, "outstanding": 0, "by_refusal": 1}
    assert rec["executions"] == {"created": 13, "accepted": 11, "dropped": 1, "refused": 1,
                                 "aborted": 3, "completed": 8, "orphaned": 1, "live_at_end": 0}
    per60 = rec["series"]["delivered_per_60s"]
    # delivered at 60, 200, 350, 400, 600, 620, 900, 1500, 1640; run ends at 1650
    assert len(per60) == 28 and sum(per60) == 9
    assert {i: n for i, n in enumerate(per60) if n} == {1: 1, 3: 1, 5: 1, 6: 1, 10: 2, 15: 1,
                                                         25: 1, 27: 1}
    assert len(rec["series"]["t"]) == 1000 and rec["series"]["waiting"][227] == 5.0


def test_record_has_all_keys_and_is_plain_json(rec):
    for k in REQUIRED_KEYS:
        assert k in rec, k
    for name in ("pulse", "hold", "primary"):
        assert set(rec["cohorts"][name]) == {"offered", "delivered", "within_deadline", "late",
                                             "undelivered"}
    assert set(rec["rates_xC"]) == {"attempts", "created", "accepted", "completed"}
    assert set(rec["prompt_tokens"]) == {"computed", "never_aborted", "aborted_body",
                                         "aborted_in_flight", "missed_by_counter"}
    assert set(rec["counters_hold"]) == {"prompt_tokens", "prefix_cache_queries"}
    assert {"sent", "attached", "refused_budget", "refused_engine", "never_scheduled",
            "median_abort_to_first_step_s", "median_left_at_first_step_s"} <= set(rec["retries"])
    assert set(rec["waste"]) == {"abort_rate", "completion_ratio", "useful_token_ratio"}
    text = json.dumps(rec, allow_nan=False)
    back = json.loads(text)
    assert back["cohorts"] == rec["cohorts"]

    def no_numpy(x):
        if isinstance(x, dict):
            return all(no_numpy(v) for v in x.values())
        if isinstance(x, list):
            return all(no_numpy(v) for v in x)
        return x is None or type(x) in (bool, int, float, str)
    assert no_numpy(rec)


def test_empty_log_is_valid():
    z = np.zeros(0)
    log = RunLog([], [], [], Series(z, z, z, z), {}, {}, {}, 0.0)
    r = record(log, S, 1.0, {})
    json.dumps(r, allow_nan=False)
    assert r["recovered"] is False and r["recovery_time_s"] is None   # no samples: not good
    assert r["waste"] == {"abort_rate": None, "completion_ratio": None, "useful_token_ratio": None}
    assert r["retries"]["median_abort_to_first_step_s"] is None
    assert r["cohorts"]["hold"]["offered"] == 0


def test_summary(rec):
    text = summary(rec)
    assert "cancel" in text and "recovered 300 s" in text
    assert "hold" in text and "83.3%" in text   # hold delivered 5/6


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["completed", "aborted", "dropped", "refused", ""]),
                          st.integers(0, 20_000), st.integers(0, 20_000), st.booleans()),
                max_size=30))
def test_prompt_split_sums_exactly(rows):
    ex = []
    for i, (fate, comp, fl, tok) in enumerate(rows):
        fl = min(fl, comp) if fate == "aborted" else 0
        ex.append(ExecutionRecord(i, i, 0, 100, 10, 0.0, accepted=fate != "dropped", fate=fate,
                                  prompt_computed=comp, prompt_in_flight=fl,
                                  first_token_at=1.0 if tok else NAN))
    t = np.arange(0.0, 10.0)
    z = np.zeros_like(t)
    r = record(RunLog([], [], ex, Series(t, z, z, z), {}, {}, {}, 10.0), S, 1.0, INPUTS)
    p = r["prompt_tokens"]
    assert p["never_aborted"] + p["aborted_body"] + p["aborted_in_flight"] == p["computed"]
    assert p["computed"] == sum(x[1] for x in rows)
    assert 0 <= p["missed_by_counter"] <= p["aborted_body"] + p["aborted_in_flight"]


def big_log(n_calls=6000, seed=0) -> RunLog:
    rng = np.random.default_rng(seed)
    planned = np.sort(rng.uniform(0, 947, n_calls))
    calls, attempts, ex = [], [], []
    fates = ["completed", "aborted", "dropped", "refused", "completed"]
    for c, p in enumerate(planned):
        d = p + rng.uniform(1, 900)
        calls.append(CallRecord(c, float(p), float(d) if d < p + 850 else NAN, 2, "delivered"))
        for n in range(2 if c % 2 else 1):
            eid = len(ex)
            sent = float(p + 130 * n)
            attempts.append(AttemptRecord(c, n, sent, sent + 120, "timeout", eid))
            fate = fates[(c + n) % 5]
            ex.append(ExecutionRecord(eid, c, n, 12000, 400, sent, dispatched_at=sent,
                                      accepted=True, first_scheduled_at=sent + 1,
                                      first_token_at=sent + 2, finished_at=sent + 50, fate=fate,
                                      cancel_requested_at=sent + 40 if fate == "aborted" else NAN,
                                      tokens_generated=300, prompt_computed=12000,
                                      prompt_in_flight=100 if fate == "aborted" else 0))
    t = np.arange(0.0, 1800.0)
    w = rng.integers(0, 5, len(t)).astype(float)
    return RunLog(calls, attempts, ex, Series(t, w, w, w), {}, {}, {}, 1800.0)


def test_record_on_10k_executions_counts_every_one():
    log = big_log()
    assert len(log.executions) >= 9000
    rec = record(log, S, 2.8, INPUTS)
    ex = rec["executions"]
    assert ex["created"] == len(log.executions)
    assert ex["completed"] + ex["aborted"] == sum(e.fate in ("completed", "aborted") for e in log.executions)
    assert rec["prompt_tokens"]["computed"] == sum(e.prompt_computed for e in log.executions)


def _as_tables(log: RunLog) -> RunLog:
    calls = CallTable.planned(np.array([c.planned_at for c in log.calls]))
    for c in log.calls:
        calls.delivered_at[c.id] = c.delivered_at
        calls.attempts[c.id] = c.attempts
        calls.outcome[c.id] = CALL_OUTCOMES.index(c.outcome)
    attempts = AttemptTable()
    for a in log.attempts:
        i = attempts.add(a.call, a.number, a.sent_at)
        attempts.ended_at[i] = a.ended_at
        attempts.outcome[i] = ATTEMPT_OUTCOMES.index(a.outcome)
        attempts.execution[i] = a.execution
        attempts.attached[i] = a.attached
    return RunLog(calls, attempts, ExecutionTable(log.executions), log.series, log.counters, log.counters_at,
                  log.engine, log.end_time, log.wall_s, log.extra)


def _nan_none(x):
    return json.loads(json.dumps(x, default=str).replace("NaN", "null"))


def test_tables_read_as_the_records_they_hold():
    log = hand_log()
    t = _as_tables(log)
    assert len(t.calls) == len(log.calls) and len(t.attempts) == len(log.attempts)
    for a, b in zip(list(t.calls) + list(t.attempts), log.calls + log.attempts):
        assert type(a) is type(b)
        assert _nan_none(repr(a)) == _nan_none(repr(b))
    assert column(t.attempts, "attached").dtype == bool
    assert list(column(t.attempts, "outcome")) == [ATTEMPT_OUTCOMES.index(a.outcome) for a in log.attempts]
    assert list(column(t.executions, "fate")) == [EXECUTION_FATES.index(e.fate) for e in log.executions]


@pytest.mark.parametrize("make", [hand_log, big_log], ids=["hand", "big"])
def test_record_of_tables_is_the_record_of_the_same_records(make):
    log = make()
    assert record(_as_tables(log), S, 2.8, INPUTS) == record(log, S, 2.8, INPUTS)
