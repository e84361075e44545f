"""What a run leaves behind: plain records of calls, attempts and executions,
engine counters and 1 s time series. `sim.measures` turns a RunLog into the
result record; nothing here refers to live simulation state.

Calls and attempts are lists of records or, as the simulator writes them,
tables of columns (`CallTable`, `AttemptTable`) that read as the same
records row by row."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

NAN = float("nan")


def sample_log(log, ts: np.ndarray, column: int = 1) -> np.ndarray:
    """Value of a change log [(time, v1, v2, ...), ...] (sorted by time) at the
    times `ts`: the last entry at or before each time, 0 before the first."""
    return sample_columns(log, ts, (column,))[0]


def sample_columns(log, ts: np.ndarray, columns: tuple) -> list[np.ndarray]:
    """`sample_log` of each of `columns`, the log read once."""
    n = len(log)
    if n == 0:
        return [np.zeros(len(ts)) for _ in columns]
    times = np.fromiter(map(itemgetter(0), log), dtype=float, count=n)
    idx = np.searchsorted(times, ts, side="right") - 1
    rows = [log[i] for i in np.maximum(idx, 0).tolist()]
    before = idx < 0
    out = []
    for c in columns:
        values = np.fromiter(map(itemgetter(c), rows), dtype=float, count=len(rows))
        values[before] = 0.0
        out.append(values)
    return out


def thin_log(log: list) -> None:
    """Thin a change log in place to what `sample_log` needs at whole
    seconds: the last entry of each second (k-1, k]. Sampling the thinned
    log at integer times gives what the full log gives."""
    if len(log) < 2:
        return
    second = np.ceil(np.fromiter((e[0] for e in log), dtype=float, count=len(log)))
    keep = np.flatnonzero(np.append(second[1:] != second[:-1], True))
    log[:] = [log[i] for i in keep.tolist()]


def refusal_outcome(reason: str) -> str:
    """An attempt's outcome for a proxy refusal's reason (sim.policy.proxy.Refuse.reason)."""
    return {"budget": "refused_budget", "engine": "refused_engine"}.get(reason, "refused_proxy")


@dataclass(slots=True)
class AttemptRecord:
    call: int
    number: int                 # 0 = first attempt, 1.. = retries
    sent_at: float
    ended_at: float = NAN
    # complete | timeout | refused_budget (429) | refused_engine (503) | refused_proxy (503 from the proxy: the deadline check)
    outcome: str = ""
    execution: int = -1         # execution it subscribed to (-1: refused before one was found)
    attached: bool = False      # joined an execution created for an earlier attempt


@dataclass(slots=True)
class ExecutionRecord:
    id: int
    call: int
    attempt: int                # number of the attempt that created it
    prompt_len: int
    max_tokens: int
    created_at: float
    dispatched_at: float = NAN  # sent to the engine (after any proxy queue)
    accepted: bool = False      # engine took it (not refused by the engine cap)
    # engine side
    first_scheduled_at: float = NAN   # start of its first step
    first_token_at: float = NAN
    finished_at: float = NAN          # completed, aborted, dropped or refused
    # completed | aborted | dropped (left the proxy queue unsent) | refused (engine cap) | "" (still live at run end)
    fate: str = ""
    cancel_requested_at: float = NAN  # proxy closed its engine connection
    tokens_generated: int = 0         # output tokens produced (discarded ones after abort excluded)
    prompt_computed: int = 0          # prompt-work tokens computed by steps (recompute after preemption included)
    prompt_in_flight: int = 0         # share of prompt_computed in steps issued before the abort, finished after
    prefix_hit_tokens: int = 0        # tokens taken from the prefix cache (all admissions)
    preemptions: int = 0
    orphaned_at: float = NAN          # last subscriber left while it ran on (cancellation off)


@dataclass(slots=True)
class CallRecord:
    id: int
    planned_at: float
    delivered_at: float = NAN   # client received the complete response
    attempts: int = 0
    # delivered | failed_attempts (four failed attempts) | failed_retry_after (429 wait > limit) | "" (outstanding at run end)
    outcome: str = ""


ATTEMPT_OUTCOMES = ("", "complete", "timeout", "refused_budget", "refused_engine", "refused_proxy")
CALL_OUTCOMES = ("", "delivered", "failed_attempts", "failed_retry_after")


class _Table:
    """Records of one kind as columns (`array.array`), one row a record.
    `FIELDS`: (name, typecode, default) in the record's field order; a field
    named in `CODES` holds the index of its value in that tuple; typecode
    "b" without codes is a bool."""
    FIELDS: tuple = ()
    CODES: dict = {}
    RECORD: type = object

    def __init__(self):
        for name, typecode, _ in self.FIELDS:
            setattr(self, name, array(typecode))

    def __len__(self) -> int:
        return len(getattr(self, self.FIELDS[0][0]))

    def __getitem__(self, i: int):
        kw = {}
        for name, typecode, _ in self.FIELDS:
            v = getattr(self, name)[i]
            if name in self.CODES:
                v = self.CODES[name][v]
            elif typecode == "b":
                v = bool(v)
            kw[name] = v
        return self.RECORD(**kw)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def column(self, name: str) -> np.ndarray:
        """A copy of one column as a numpy array (codes as int64, bools as bool)."""
        typecode = next(f[1] for f in self.FIELDS if f[0] == name)
        a = np.array(getattr(self, name))
        if name in self.CODES:
            return a.astype(np.int64)
        return a.astype(bool) if typecode == "b" else a


class AttemptTable(_Table):
    """The attempts of a run in the order sent (`AttemptRecord` rows);
    `outcome` holds indices into ATTEMPT_OUTCOMES."""
    FIELDS = (("call", "q", 0), ("number", "q", 0), ("sent_at", "d", NAN), ("ended_at", "d", NAN),
              ("outcome", "b", 0), ("execution", "q", -1), ("attached", "b", 0))
    CODES = {"outcome": ATTEMPT_OUTCOMES}
    RECORD = AttemptRecord

    def add(self, call: int, number: int, sent_at: float) -> int:
        """A new attempt, open; returns its row."""
        i = len(self.call)
        self.call.append(call)
        self.number.append(number)
        self.sent_at.append(sent_at)
        self.ended_at.append(NAN)
        self.outcome.append(0)
        self.execution.append(-1)
        self.attached.append(0)
        return i


class CallTable(_Table):
    """The calls of a run by id (`CallRecord` rows); `outcome` holds
    indices into CALL_OUTCOMES."""
    FIELDS = (("id", "q", 0), ("planned_at", "d", NAN), ("delivered_at", "d", NAN), ("attempts", "q", 0),
              ("outcome", "b", 0))
    CODES = {"outcome": CALL_OUTCOMES}
    RECORD = CallRecord

    @classmethod
    def planned(cls, planned_at: np.ndarray) -> "CallTable":
        """One outstanding call per planned arrival."""
        t = cls()
        n = len(planned_at)
        t.id = array("q", range(n))
        t.planned_at = array("d", np.asarray(planned_at, dtype=float).tobytes())
        t.delivered_at = array("d", [NAN]) * n
        t.attempts = array("q", [0]) * n
        t.outcome = array("b", [0]) * n
        return t


@dataclass
class Series:
    """1 s samples over the run."""
    t: np.ndarray
    waiting: np.ndarray         # engine waiting queue
    running: np.ndarray         # engine running
    proxy_queue: np.ndarray     # executions held in the proxy's own queue


@dataclass
class RunLog:
    calls: list[CallRecord] | CallTable
    attempts: list[AttemptRecord] | AttemptTable
    executions: list[ExecutionRecord]
    series: Series
    counters: dict[str, int]                    # vLLM counters at run end
    counters_at: dict[float, dict[str, int]]    # counter snapshots at chosen times (e.g. 227, 947)
    engine: dict[str, int]                      # steps, preemptions, aborted_before_scheduled
    end_time: float
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
