"""The Wilson interval, the cell summary and the bisection of the margin."""
import math

import pytest

from sim import verdict
from sim.experiments.margin import find_crossing, parse_axes


# Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (score interval without continuity correction)
@pytest.mark.parametrize("k,n,lo,hi", [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605),
                                       (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_published_values(k, n, lo, hi):
    a, b = verdict.wilson(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_wilson_is_symmetric_and_contains_the_share():
    for n in (1, 3, 10, 57):
        for k in range(n + 1):
            lo, hi = verdict.wilson(k, n)
            lo2, hi2 = verdict.wilson(n - k, n)
            assert 0 <= lo <= k / n <= hi <= 1
            assert lo == pytest.approx(1 - hi2, abs=1e-12) and hi == pytest.approx(1 - lo2, abs=1e-12)


def test_wilson_refuses_impossible_counts():
    for k, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            verdict.wilson(k, n)


def test_tipping_point_needs_an_interval_across_one_half():
    assert verdict.is_tipping(*verdict.wilson(5, 10))
    assert not verdict.is_tipping(*verdict.wilson(10, 10))      # [0.72, 1]
    assert not verdict.is_tipping(*verdict.wilson(0, 10))
    assert verdict.is_tipping(*verdict.wilson(1, 1))            # one run decides nothing


def test_agreeing_runs_too_few_to_decide_are_not_a_tipping_point():
    three = verdict.summarize([_rec(True, 60.0)] * 3)             # [0.44, 1]
    assert three["too_few"] and not three["tipping"] and "too few seeds" in verdict.p_cell(three)
    four = verdict.summarize([_rec(True, 60.0)] * 4)              # [0.51, 1]
    assert not four["too_few"] and not four["tipping"] and verdict.verdict(four).startswith("recovers")


def _rec(recovered, t, hold=(10, 9, 8)):
    off, dl, wd = hold
    co = {"offered": off, "delivered": dl, "within_deadline": wd}
    return {"recovered": recovered, "recovery_time_s": t, "cohorts": {"hold": co, "pulse": co, "primary": co}}


def test_summary_counts_recoveries_and_spreads():
    recs = [_rec(True, 60.0), _rec(True, 180.0), _rec(False, None, (10, 5, 2)), _rec(True, 120.0)]
    s = verdict.summarize(recs)
    assert (s["n"], s["recovered"], s["p"]) == (4, 3, 0.75)
    assert (s["lo"], s["hi"]) == verdict.wilson(3, 4) and s["tipping"]
    assert s["recovery_time"] == {"median": 120.0, "min": 60.0, "max": 180.0}
    assert s["hold_delivered"]["median"] == pytest.approx(0.9)
    assert s["hold_within_deadline"]["p10"] == pytest.approx(0.2 + 0.3 * 0.6, abs=1e-9)   # linear, of 0.2 0.8 0.8 0.8
    flat = [{"recovered": r["recovered"], "recovery_time_s": r["recovery_time_s"],
             **{f"{c}_{k}": v for c, d in r["cohorts"].items() for k, v in d.items()}} for r in recs]
    assert verdict.summarize(flat) == s


def test_find_crossing_on_a_smooth_decreasing_curve():
    x_star = 1.3
    r = find_crossing(lambda x: 1 / (1 + math.exp(25 * (x - x_star))), 1.0, worse=16.0, better=1 / 16, rel_tol=1e-3)
    assert r["side0"] and r["crossing"] == pytest.approx(x_star, rel=2e-3)
    a, b = r["bracket"]
    assert a <= x_star <= b and b / a - 1 <= 1e-3


def test_find_crossing_on_a_step_searches_the_better_side_when_it_does_not_recover():
    x_star = 0.37                       # p = 1 below x_star, 0 above; x0 = 1 does not recover
    r = find_crossing(lambda x: 1.0 if x < x_star else 0.0, 1.0, worse=16.0, better=1 / 16, rel_tol=0.01)
    assert not r["side0"] and r["limit"] == 1 / 16
    lo, hi = sorted(r["bracket"])
    assert lo < x_star <= hi and hi / lo - 1 <= 0.01
    assert lo <= r["crossing"] <= hi


def test_find_crossing_increasing_curve_and_no_crossing():
    r = find_crossing(lambda x: min(1.0, x / 4), 1.0, worse=1 / 8, better=8.0, rel_tol=1e-4)
    assert not r["side0"] and r["crossing"] == pytest.approx(2.0, rel=1e-3)
    r = find_crossing(lambda x: 0.9, 1.0, worse=16.0, better=1 / 16)
    assert r["crossing"] is None and r["bracket"] is None and r["probes"][-1][0] == 16.0


def test_axes_are_checked():
    assert parse_axes("speed, kv") == ["speed", "kv"]
    with pytest.raises(ValueError):
        parse_axes("speed,warp")
