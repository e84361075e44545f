"""The measures of docs/model.md and the result record, computed from a
`RunLog`. Everything here is a pure function of the log and the scenario: the
simulator and the live harness write the same record from the same kind of log.

The log's calls, attempts and executions are read as numpy columns once
(`_Columns`, through `sim.runlog.column`); each record key is then one
helper, a function of those columns.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np

from .runlog import ATTEMPT_OUTCOMES, CALL_OUTCOMES, EXECUTION_FATES, ExecutionTable, RunLog, Series, column, take
from .scenario import Scenario

# Tolerance on the recovery thresholds: a share computed as 49/50 or a slope
# that is 0.01 up to rounding must count as meeting the threshold.
_EPS = 1e-9

REQUIRED_KEYS = (
    "model", "condition", "pulse", "seed", "capacity",
    "cohorts", "recovered", "recovery_time_s", "rates_xC", "prompt_tokens",
    "counters", "counters_hold", "retries", "waste", "engine", "wall_s",
)
COUNTER_KEYS = ("prompt_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total")


# --------------------------------------------------------------------------
# Recovery (docs/model.md#measures)
# --------------------------------------------------------------------------

def good_windows(window_delivery: Sequence[float], window_queue_mean: Sequence[float],
                 window_queue_growth: Sequence[float], scenario: Scenario) -> np.ndarray:
    """Boolean per hold window: delivery share >= recovery_delivery, mean of
    (engine waiting + proxy queue) <= recovery_queue_mean and its growth (per s)
    <= recovery_queue_growth. A NaN input (e.g. a window without samples) is
    not good."""
    d = np.asarray(window_delivery, dtype=float)
    m = np.asarray(window_queue_mean, dtype=float)
    g = np.asarray(window_queue_growth, dtype=float)
    if not (len(d) == len(m) == len(g)):
        raise ValueError(f"window arrays differ in length: {len(d)}, {len(m)}, {len(g)}")
    with np.errstate(invalid="ignore"):
        return ((d >= scenario.recovery_delivery - _EPS)
                & (m <= scenario.recovery_queue_mean + _EPS)
                & (g <= scenario.recovery_queue_growth + _EPS))


def recovery(window_delivery: Sequence[float], window_queue_mean: Sequence[float],
             window_queue_growth: Sequence[float], scenario: Scenario) -> tuple[bool, float | None]:
    """The recovery rule over the hold's windows [pulse_end + w·k,
    pulse_end + w·(k+1)), k = 0, 1, ... (w = scenario.window_s).

    Recovered once two consecutive windows are good; the recovery time is the
    end of the second window minus the pulse end, i.e. w·(k+2) for the first
    good pair (k, k+1). (False, None) if no such pair exists."""
    good = good_windows(window_delivery, window_queue_mean, window_queue_growth, scenario)
    pair = np.flatnonzero(good[:-1] & good[1:]) if len(good) >= 2 else np.empty(0, int)
    if len(pair) == 0:
        return False, None
    k = int(pair[0])
    return True, float(scenario.window_s * (k + 2))


# --------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------

_F_LIVE, _F_COMPLETED, _F_ABORTED, _F_DROPPED, _F_REFUSED = (EXECUTION_FATES.index(f) for f in (
    "", "completed", "aborted", "dropped", "refused"))
_O_COMPLETE, _O_TIMEOUT, _O_BUDGET, _O_ENGINE, _O_PROXY, _O_GATEWAY, _O_SHED = (ATTEMPT_OUTCOMES.index(o) for o in (
    "complete", "timeout", "refused_budget", "refused_engine", "refused_proxy", "refused_gateway", "refused_shed"))
_C_LIVE, _C_DELIVERED, _C_FAILED_ATTEMPTS, _C_FAILED_RETRY_AFTER = (CALL_OUTCOMES.index(o) for o in (
    "", "delivered", "failed_attempts", "failed_retry_after"))


class _Columns:
    """The RunLog's columns the measures read (`sim.runlog.column`), read once."""

    def __init__(self, log: RunLog, calls: bool = True, rest: bool = True):
        if calls:
            c = log.calls
            self.planned, self.delivered_at, self.call_attempts, self.call_outcome = (
                column(c, name) for name in ("planned_at", "delivered_at", "attempts", "outcome"))
        if not rest:
            return
        a = log.attempts
        self.a_call, self.a_number, self.a_sent, self.a_outcome, self.a_exec, self.a_attached = (
            column(a, name) for name in ("call", "number", "sent_at", "outcome", "execution", "attached"))
        e = log.executions
        self.e_id = column(e, "id")
        self.e_call = column(e, "call")
        self.e_attempt = column(e, "attempt")
        self.e_max_tokens = column(e, "max_tokens")
        self.e_created = column(e, "created_at")
        self.e_dispatched = column(e, "dispatched_at")
        self.e_accepted = column(e, "accepted")
        self.e_first_sched = column(e, "first_scheduled_at")
        self.e_first_token = column(e, "first_token_at")
        self.e_finished = column(e, "finished_at")
        self.e_fate = column(e, "fate")
        self.e_cancel = column(e, "cancel_requested_at")
        self.e_tokens = column(e, "tokens_generated")
        self.e_prompt = column(e, "prompt_computed")
        self.e_in_flight = column(e, "prompt_in_flight")
        self.e_orphaned = column(e, "orphaned_at")
        # execution id -> row (ids are normally 0..n-1 in order)
        n = len(self.e_id)
        if n and (self.e_id == np.arange(n)).all():
            self.row_of_id = np.arange(n)
        else:
            size = int(self.e_id.max()) + 1 if n else 0
            self.row_of_id = np.full(size, -1, dtype=np.int64)
            self.row_of_id[self.e_id] = np.arange(n)

    def exec_row(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the given execution ids; -1 for ids that are -1 or unknown."""
        out = np.full(len(ids), -1, dtype=np.int64)
        ok = (ids >= 0) & (ids < len(self.row_of_id))
        out[ok] = self.row_of_id[ids[ok]]
        return out


# --------------------------------------------------------------------------
# Per-window inputs of the recovery rule
# --------------------------------------------------------------------------

def _window_edges(scenario: Scenario) -> np.ndarray:
    n = int(math.floor(scenario.hold_s / scenario.window_s + 1e-9))
    return scenario.pulse_end + scenario.window_s * np.arange(n + 1)


def _slope(t: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of y over t (per unit of t); 0 for fewer than 2 points."""
    if len(t) < 2:
        return 0.0
    x = t - t.mean()
    sxx = float(x @ x)
    if sxx == 0.0:
        return 0.0
    return float(x @ (y - y.mean())) / sxx


def _window_stats(planned: np.ndarray, delivered_at: np.ndarray, log: RunLog,
                  scenario: Scenario) -> dict[str, np.ndarray]:
    edges = _window_edges(scenario)
    k = len(edges) - 1
    idx = np.searchsorted(edges, planned, side="right") - 1
    inside = (idx >= 0) & (idx < k)
    with np.errstate(invalid="ignore"):
        on_time = (delivered_at - planned) <= scenario.deadline_s
    n_planned = np.bincount(idx[inside], minlength=k)[:k]
    n_on_time = np.bincount(idx[inside & on_time], minlength=k)[:k]
    share = np.ones(k)
    nz = n_planned > 0
    share[nz] = n_on_time[nz] / n_planned[nz]

    s = log.series
    t = np.asarray(s.t, dtype=float)
    q = np.asarray(s.waiting, dtype=float) + np.asarray(s.proxy_queue, dtype=float)
    lo = np.searchsorted(t, edges[:-1], side="left")
    hi = np.searchsorted(t, edges[1:], side="left")
    mean = np.full(k, np.nan)
    growth = np.full(k, np.nan)
    for j in range(k):
        if hi[j] > lo[j]:
            tt, qq = t[lo[j]:hi[j]], q[lo[j]:hi[j]]
            mean[j] = qq.mean()
            growth[j] = _slope(tt, qq)
    good = good_windows(share, mean, growth, scenario)
    return {"start": edges[:-1].copy(), "planned": n_planned, "on_time": n_on_time,
            "delivery": share, "queue_mean": mean, "queue_growth": growth, "good": good}


def window_stats(log: RunLog, scenario: Scenario) -> dict[str, np.ndarray]:
    """Per hold window (aligned to the pulse end): `start`, `planned` (calls
    planned in it), `on_time` (of those, delivered within deadline_s of planned
    arrival), `delivery` (on_time / planned; 1.0 when none planned),
    `queue_mean` and `queue_growth` (mean and least-squares slope per second of
    the 1 s samples of engine waiting + proxy queue with t in the window; NaN
    when the series has no sample there) and `good`."""
    cols = _Columns(log, calls=True, rest=False)
    return _window_stats(cols.planned, cols.delivered_at, log, scenario)


# --------------------------------------------------------------------------
# The result record (docs/model.md#result-record)
# --------------------------------------------------------------------------

def jsonable(x: Any) -> Any:
    """JSON-able plain Python: numpy scalars/arrays converted, NaN/inf -> None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            return [v if math.isfinite(v) else None for v in x.tolist()]
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    return x


def _ratio(num, den) -> float | None:
    return float(num) / float(den) if den else None


def _median(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else None


def _snapshot(counters_at: dict, t: float) -> dict | None:
    for k, v in counters_at.items():
        if abs(float(k) - t) < 1e-6:
            return v
    return None


def _in(x: np.ndarray, a: float, b: float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return (x >= a) & (x < b)


def _inputs(inputs: dict, capacity: float) -> dict:
    """The run's inputs, `model`, `condition`, `pulse`, `seed` first, then
    the rest as given, then `capacity`."""
    rec = {key: inputs.get(key) for key in ("model", "condition", "pulse", "seed")}
    rec.update((k, v) for k, v in inputs.items() if k not in rec and k != "capacity")
    rec["capacity"] = float(capacity)
    return rec


def _cohorts(c: _Columns, s: Scenario) -> dict:
    """Per cohort of planned arrivals: offered, delivered (within the
    delivery horizon), within_deadline, late, undelivered."""
    with np.errstate(invalid="ignore"):
        lag = c.delivered_at - c.planned
        delivered = lag <= s.delivery_horizon_s
        within = lag <= s.deadline_s
    out = {}
    for name, (a, b) in s.cohorts().items():
        m = _in(c.planned, a, b)
        offered, dl, wd = int(m.sum()), int((m & delivered).sum()), int((m & within).sum())
        out[name] = {"offered": offered, "delivered": dl, "within_deadline": wd,
                     "late": dl - wd, "undelivered": offered - dl}
    return out


def _rates(c: _Columns, s: Scenario, capacity: float) -> dict:
    """Attempts sent, executions created, accepted by the engine and
    completed over the primary interval, in multiples of capacity."""
    a, b = s.primary_start, s.hold_end
    per = 1.0 / ((b - a) * capacity)
    return {"attempts": _in(c.a_sent, a, b).sum() * per,
            "created": _in(c.e_created, a, b).sum() * per,
            "accepted": (c.e_accepted & _in(c.e_dispatched, a, b)).sum() * per,
            "completed": ((c.e_fate == _F_COMPLETED) & _in(c.e_finished, a, b)).sum() * per}


def _prompt_tokens(c: _Columns) -> dict:
    """Prompt work computed, split by whether the execution was aborted, the
    aborted share into work before the abort and work in flight when it came,
    and the aborted work the vLLM counter never sees (no first token)."""
    aborted = c.e_fate == _F_ABORTED
    ab_prompt = int(c.e_prompt[aborted].sum())
    ab_flight = int(c.e_in_flight[aborted].sum())
    return {"computed": int(c.e_prompt.sum()),
            "never_aborted": int(c.e_prompt[~aborted].sum()),
            "aborted_body": ab_prompt - ab_flight,
            "aborted_in_flight": ab_flight,
            "missed_by_counter": int(c.e_prompt[aborted & np.isnan(c.e_first_token)].sum())}


def _counters(log: RunLog) -> dict:
    """The vLLM counters at run end (`COUNTER_KEYS` always present)."""
    out = {k: log.counters.get(k) for k in COUNTER_KEYS}
    out.update(log.counters)
    return out


def _counters_hold(log: RunLog, s: Scenario) -> dict:
    """Increase of the prompt-token and prefix-query counters over the hold
    (None without a snapshot at the pulse end)."""
    start = _snapshot(log.counters_at, s.pulse_end)
    end = _snapshot(log.counters_at, s.hold_end) or log.counters

    def incr(key):
        if start is None or start.get(key) is None or end.get(key) is None:
            return None
        return int(end[key]) - int(start[key])
    return {"prompt_tokens": incr("prompt_tokens_total"),
            "prefix_cache_queries": incr("prefix_cache_queries_total")}


def _prev_execution(c: _Columns) -> np.ndarray:
    """Row of each execution's predecessor: the same call's previous
    execution by creation time (-1 for a call's first)."""
    order = np.lexsort((c.e_id, c.e_created, c.e_call))
    prev = np.full(len(c.e_id), -1, dtype=np.int64)
    same = c.e_call[order[1:]] == c.e_call[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _retries(c: _Columns, s: Scenario) -> dict:
    """Retries sent, attached, refused (budget, engine, proxy), never
    scheduled; for retries that created an execution the engine scheduled:
    the median gap from the predecessor's abort to the first step and the
    median time left to the deadline at that step."""
    retry = c.a_number > 0
    row = c.exec_row(c.a_exec)
    has_exec = row >= 0
    sched = np.zeros(len(row), dtype=bool)
    sched[has_exec] = ~np.isnan(c.e_first_sched[row[has_exec]])
    never = retry & ((~has_exec) | (~c.a_attached & ~sched))
    created_own = retry & has_exec & ~c.a_attached
    created_own[has_exec] &= c.e_attempt[row[has_exec]] == c.a_number[has_exec]
    sr = created_own & sched
    sr_rows = row[sr]
    aborted = c.e_fate == _F_ABORTED
    abort_at = np.where(~np.isnan(c.e_cancel), c.e_cancel, np.where(aborted, c.e_finished, np.nan))
    p = _prev_execution(c)[sr_rows]
    has_p = p >= 0
    gap = np.full(len(sr_rows), np.nan)
    gap[has_p] = c.e_first_sched[sr_rows[has_p]] - abort_at[p[has_p]]
    left = c.a_sent[sr] + s.deadline_s - c.e_first_sched[sr_rows]
    n_retry, n_never = int(retry.sum()), int(never.sum())
    return {"sent": n_retry,
            "attached": int(c.a_attached.sum()),
            "refused_budget": int((c.a_outcome == _O_BUDGET).sum()),
            "refused_engine": int((c.a_outcome == _O_ENGINE).sum()),
            "never_scheduled": n_never,
            "median_abort_to_first_step_s": _median(gap),
            "median_left_at_first_step_s": _median(left),
            "never_scheduled_share": _ratio(n_never, n_retry),
            "refused_engine_retries": int((retry & (c.a_outcome == _O_ENGINE)).sum()),
            "refused_proxy": int((c.a_outcome == _O_PROXY).sum()),
            "scheduled_created": int(sr.sum())}


def _waste(c: _Columns) -> dict:
    """Over executions the engine accepted: the share aborted, output tokens
    generated and those of completed executions against the tokens asked for."""
    acc = c.e_accepted
    max_acc = int(c.e_max_tokens[acc].sum())
    return {"abort_rate": _ratio(((c.e_fate == _F_ABORTED) & acc).sum(), acc.sum()),
            "completion_ratio": _ratio(c.e_tokens[acc].sum(), max_acc),
            "useful_token_ratio": _ratio(c.e_tokens[acc & (c.e_fate == _F_COMPLETED)].sum(), max_acc)}


def _engine(log: RunLog) -> dict:
    return {k: log.engine.get(k) for k in ("aborted_before_scheduled", "preemptions", "steps")}


def _calls_failed(c: _Columns) -> dict:
    """Failed calls by reason, calls outstanding at run end, and failed calls
    whose last attempt was refused (429 or 503) rather than timed out."""
    outc = c.call_outcome
    failed = (outc == _C_FAILED_ATTEMPTS) | (outc == _C_FAILED_RETRY_AFTER)
    is_last = c.a_number == c.call_attempts[c.a_call] - 1 if len(c.a_call) else np.zeros(0, dtype=bool)
    refused_calls = c.a_call[is_last & np.isin(c.a_outcome, (_O_BUDGET, _O_ENGINE, _O_PROXY, _O_GATEWAY, _O_SHED))]
    return {"attempts": int((outc == _C_FAILED_ATTEMPTS).sum()),
            "retry_after": int((outc == _C_FAILED_RETRY_AFTER).sum()),
            "outstanding": int((outc == _C_LIVE).sum()), "by_refusal": int(failed[refused_calls].sum())}


def _attempts(c: _Columns) -> dict:
    """Attempts by number (first, retries) and by outcome."""
    n_first = int((c.a_number == 0).sum())
    out = {"sent": len(c.a_number), "first": n_first, "retries": len(c.a_number) - n_first}
    for name, code in (("complete", _O_COMPLETE), ("timeout", _O_TIMEOUT), ("refused_budget", _O_BUDGET),
                       ("refused_engine", _O_ENGINE), ("refused_proxy", _O_PROXY)):
        out[name] = int((c.a_outcome == code).sum())
    gateway = int((c.a_outcome == _O_GATEWAY).sum())
    if gateway:                     # only a stack with gateway layers has these
        out["refused_gateway"] = gateway
    return out


def _shed(c: _Columns) -> dict:
    """Attempts shed by a per-class control (shedding, a class's retry
    budget or cap), the calls they belong to (each once), and the calls that
    failed with their last attempt shed."""
    shed = c.a_outcome == _O_SHED
    calls = np.unique(c.a_call[shed])
    outc = c.call_outcome
    failed = (outc == _C_FAILED_ATTEMPTS) | (outc == _C_FAILED_RETRY_AFTER)
    is_last = c.a_number == c.call_attempts[c.a_call] - 1 if len(c.a_call) else np.zeros(0, dtype=bool)
    return {"attempts": int(shed.sum()), "calls": len(calls),
            "failed": int(failed[np.unique(c.a_call[shed & is_last])].sum())}


def shed(log: RunLog) -> dict:
    """`_shed` of a run's log: the record's `shed` where the proxy sheds."""
    return _shed(_Columns(log))


def _executions(c: _Columns) -> dict:
    """Executions created, accepted by the engine, by fate, orphaned."""
    fate = c.e_fate
    return {"created": len(c.e_id), "accepted": int(c.e_accepted.sum()),
            "dropped": int((fate == _F_DROPPED).sum()), "refused": int((fate == _F_REFUSED).sum()),
            "aborted": int((fate == _F_ABORTED).sum()), "completed": int((fate == _F_COMPLETED).sum()),
            "orphaned": int((~np.isnan(c.e_orphaned)).sum()), "live_at_end": int((fate == _F_LIVE).sum())}


def _series(c: _Columns, log: RunLog, s: Scenario) -> dict:
    """The 1 s samples and the calls delivered per window_s bin."""
    ser = log.series
    d = c.delivered_at[~np.isnan(c.delivered_at)]
    end_t = max(float(log.end_time), float(ser.t[-1]) if len(ser.t) else 0.0,
                float(d.max()) + 1e-9 if len(d) else 0.0)
    nbins = max(1, int(math.ceil(end_t / s.window_s)))
    return {"t": np.asarray(ser.t), "waiting": np.asarray(ser.waiting),
            "running": np.asarray(ser.running), "proxy_queue": np.asarray(ser.proxy_queue),
            "delivered_per_60s": np.bincount(np.minimum((d // s.window_s).astype(np.int64), nbins - 1),
                                             minlength=nbins),
            "delivered_bin_s": s.window_s}


def _proxy_queue(log: RunLog, s: Scenario) -> dict:
    """Largest proxy queue sampled, and its mean over pulse, hold and primary."""
    pq = np.asarray(log.series.proxy_queue, dtype=float)
    pt = np.asarray(log.series.t, dtype=float)

    def mean(a, b):
        m = (pt >= a) & (pt < b)
        return float(pq[m].mean()) if m.any() else None
    return {"max": int(pq.max()) if len(pq) else 0, "mean_pulse": mean(s.pulse_start, s.pulse_end),
            "mean_hold": mean(s.pulse_end, s.hold_end), "mean_primary": mean(s.primary_start, s.hold_end)}


def record(log: RunLog, scenario: Scenario, capacity: float, inputs: dict) -> dict:
    """The result record of one run, as plain JSON-able Python."""
    s = scenario
    c = _Columns(log)
    win = _window_stats(c.planned, c.delivered_at, log, s)
    recovered, recovery_time = recovery(win["delivery"], win["queue_mean"], win["queue_growth"], s)
    rec: dict[str, Any] = _inputs(inputs, capacity)
    rec.update({
        "cohorts": _cohorts(c, s),
        "recovered": recovered,
        "recovery_time_s": recovery_time,
        "rates_xC": _rates(c, s, capacity),
        "prompt_tokens": _prompt_tokens(c),
        "counters": _counters(log),
        "counters_hold": _counters_hold(log, s),
        "retries": _retries(c, s),
        "waste": _waste(c),
        "engine": _engine(log),
        "wall_s": float(log.wall_s),
        "calls_failed": _calls_failed(c),
        "attempts": _attempts(c),
        "executions": _executions(c),
        "series": _series(c, log, s),
        "proxy_queue": _proxy_queue(log, s),
        "windows": win,
        "end_time": float(log.end_time),
        "scenario": s.to_dict(),
    })
    if log.extra:
        rec["extra"] = log.extra
    return jsonable(rec)


# --------------------------------------------------------------------------
# Traffic classes (docs/classes.md)
# --------------------------------------------------------------------------

# the keys of a class's record: the same measures on the class's calls
CLASS_KEYS = ("cohorts", "recovered", "recovery_time_s", "rates_xC", "prompt_tokens", "retries", "waste",
              "calls_failed", "attempts", "executions", "windows")


def _class_series(log: RunLog, executions) -> Series:
    """The 1 s series of one class's executions, from their records: in the
    proxy's queue from creation to dispatch, waiting in the engine from
    dispatch (if accepted) to the first scheduled step (in a live run, which
    cannot see it, the first token), running from there to the end (a
    preempted execution's second wait counts as running)."""
    t = np.asarray(log.series.t, dtype=float)
    end = float(log.end_time) + 1.0

    def count(starts, stops) -> np.ndarray:
        a = np.sort(np.where(np.isnan(starts), np.inf, starts))
        b = np.sort(np.where(np.isnan(stops), end, stops))
        return (np.searchsorted(a, t, side="right") - np.searchsorted(b, t, side="right")).astype(np.int64)

    created, dispatched, sched, first_token, finished = (column(executions, k) for k in (
        "created_at", "dispatched_at", "first_scheduled_at", "first_token_at", "finished_at"))
    # a live run cannot see a request's first step: its wait ends at its first token there (the prefill
    # counted as waiting); a simulated execution without a first step has no first token either
    sched = np.where(np.isnan(sched), first_token, sched)
    left_proxy = np.where(np.isnan(dispatched), finished, dispatched)
    waited = np.where(column(executions, "accepted"), dispatched, np.nan)
    left_queue = np.where(np.isnan(sched), finished, sched)
    return Series(t=t, waiting=count(waited, left_queue), running=count(sched, finished),
                  proxy_queue=count(created, left_proxy))


def _renumbered(store, name: str, ids: np.ndarray):
    """A store (table or list of records) with the call ids in field `name`
    mapped through `ids`: a table rebuilt from its columns, records copied."""
    if hasattr(type(store), "of_columns"):
        cols = {f[0]: column(store, f[0]) for f in store.FIELDS}
        cols[name] = ids[cols[name]]
        return type(store).of_columns(cols)
    recs = [dataclasses.replace(r, **{name: int(ids[getattr(r, name)])}) for r in store]
    return ExecutionTable(recs) if isinstance(store, ExecutionTable) else recs


def class_log(log: RunLog, calls: np.ndarray, own_series: bool = True) -> RunLog:
    """The log of the calls `calls` (their ids, sorted): their calls,
    attempts and executions, the calls numbered 0.. in that order; engine
    counters and totals as the whole run's. The series is the class's own
    (`_class_series`) or, with own_series False, the run's."""
    calls = np.asarray(calls, dtype=np.int64)
    new_id = np.full(len(log.calls), -1, dtype=np.int64)
    new_id[calls] = np.arange(len(calls))
    a_rows = np.flatnonzero(new_id[column(log.attempts, "call")] >= 0)
    e_rows = np.flatnonzero(new_id[column(log.executions, "call")] >= 0)
    executions = _renumbered(take(log.executions, e_rows), "call", new_id)
    series = _class_series(log, executions) if own_series else log.series
    return dataclasses.replace(log, calls=_renumbered(take(log.calls, calls), "id", new_id),
                               attempts=_renumbered(take(log.attempts, a_rows), "call", new_id),
                               executions=executions, series=series)


def class_records(log: RunLog, scenario: Scenario, capacity: float, klass: np.ndarray) -> dict:
    """Per traffic class (`scenario.classes`; `klass` each call's class):
    `record`'s measures (`CLASS_KEYS`) on the class's calls, judged with the
    class's deadline, plus its priority and must_recover. With one class its
    series is the run's; with several, each class's own (`class_log`)."""
    klass = np.asarray(klass)
    out = {}
    for k, c in enumerate(scenario.classes):
        sub = class_log(log, np.flatnonzero(klass == k), own_series=len(scenario.classes) > 1)
        rec = record(sub, c.client(scenario), capacity, {})
        out[c.name] = {"share": c.share, "priority": c.priority, "must_recover": c.must_recover,
                       **{key: rec[key] for key in CLASS_KEYS}, "shed": shed(sub)}
    return out


def with_classes(rec: dict, classes: dict) -> dict:
    """The record with its `classes` and the deployment's verdict: it has
    recovered when every class that must recover has (recovery time: the
    latest of theirs); the verdict on all calls together is kept as
    `all_calls`. With no class that must recover the record is unchanged
    but for `classes`."""
    rec = dict(rec, classes=classes)
    must = [v for v in classes.values() if v["must_recover"]]
    if must:
        rec["all_calls"] = {"recovered": rec["recovered"], "recovery_time_s": rec["recovery_time_s"]}
        ok = all(v["recovered"] for v in must)
        rec["recovered"] = ok
        rec["recovery_time_s"] = max(v["recovery_time_s"] for v in must) if ok else None
    return rec


def write_json(path: str, obj) -> None:
    """Write a result as JSON through a temporary file, so `path` is never
    left half-written."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def summary(rec: dict) -> str:
    """A few lines for a human: condition, recovery, cohort delivery, rates."""
    def pct(num, den):
        return f"{100.0 * num / den:.1f}%" if den else "n/a"

    rt = rec.get("recovery_time_s")
    rec_line = (f"recovered {rt:.0f} s after the pulse" if rec.get("recovered") and rt is not None
                else "not recovered by the end of the hold")
    lines = [f"{rec.get('model')} / {rec.get('condition')}  pulse {rec.get('pulse')}  "
             f"seed {rec.get('seed')}  capacity {rec.get('capacity'):.3f} calls/s: {rec_line}"]
    for name in ("pulse", "hold", "primary"):
        co = rec["cohorts"][name]
        lines.append(f"  {name:<8} offered {co['offered']:>6}  delivered {pct(co['delivered'], co['offered']):>6}"
                     f"  within deadline {pct(co['within_deadline'], co['offered']):>6}")
    r = rec["rates_xC"]
    lines.append(f"  over primary (x C): attempts {r['attempts']:.2f}  created {r['created']:.2f}"
                 f"  accepted {r['accepted']:.2f}  completed {r['completed']:.2f}")
    lines.append(f"  wall {rec.get('wall_s', 0.0):.3f} s")
    return "\n".join(lines)
