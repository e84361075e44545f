"""What a run leaves behind: plain records of calls, attempts and executions,
engine counters and 1 s time series. `sim.measures` turns a RunLog into the
result record; nothing here refers to live simulation state.

Calls, attempts and executions are lists of records or, as the simulator
stores them, tables of columns (`CallTable`, `AttemptTable`,
`ExecutionTable`) that read as the same records row by row; each table's
columns come from its record's declaration. `column()` reads one column of
either, `take()` a slice of rows (a replica's view of a fleet's store)."""
from __future__ import annotations

from array import array
from dataclasses import MISSING, dataclass, field, fields
from itertools import repeat
from operator import attrgetter, itemgetter

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
    second = np.ceil(np.fromiter(map(itemgetter(0), log), dtype=float, count=len(log)))
    keep = np.flatnonzero(np.append(second[1:] != second[:-1], True))
    log[:] = [log[i] for i in keep.tolist()]


def refusal_outcome(reason: str) -> str:
    """An attempt's outcome for a proxy refusal's reason (sim.policy.proxy.Refuse.reason)."""
    out = _REFUSALS.get(reason)
    if out is None:
        return "refused_gateway" if reason in GATEWAY_REASONS else "refused_proxy"
    return out


# a per-class control's refusal in the proxy (shedding, a class's retry budget or cap: sim.policy.proxy) is a shed
# attempt
_REFUSALS = {"budget": "refused_budget", "engine": "refused_engine", "class_shed": "refused_shed",
             "class_budget": "refused_shed", "class_cap": "refused_shed"}
# a gateway's own refusals (sim.policy.gateway): its upstream timeout (504), its queue full or timed out (503), shed,
# no server of its upstream group left (nginx's 502 "no live upstreams"), a connection refused by a server whose replica
# was not up and not retried
GATEWAY_REASONS = ("upstream_timeout", "queue_full", "queue_timeout", "shed", "no_live_upstream", "connect_error")
ATTEMPT_OUTCOMES = ("", "complete", "timeout", "refused_budget", "refused_engine", "refused_proxy", "refused_gateway",
                    "refused_shed")
CALL_OUTCOMES = ("", "delivered", "failed_attempts", "failed_retry_after")
EXECUTION_FATES = ("", "completed", "aborted", "dropped", "refused")


def _coded(values: tuple):
    """A string field whose value is one of `values` (a table stores its index)."""
    return field(default=values[0], metadata={"codes": values})


@dataclass(slots=True)
class AttemptRecord:
    call: int
    number: int                 # 0 = first attempt, 1.. = retries
    sent_at: float
    ended_at: float = NAN
    # complete | timeout | refused_budget (429) | refused_engine (503) | refused_proxy (503 from the proxy: the deadline
    # check) | refused_gateway (a gateway's own answer: its 504, its queue's 503, its shedding)
    outcome: str = _coded(ATTEMPT_OUTCOMES)
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
    fate: str = _coded(EXECUTION_FATES)
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
    # delivered | failed_attempts (four failed attempts) | failed_retry_after (429 wait > limit)
    # | "" (outstanding at run end)
    outcome: str = _coded(CALL_OUTCOMES)


# a field's type -> the typecode of its column (a coded string: its index)
_TYPECODES = {"int": "q", "float": "d", "bool": "b", "str": "b"}
_DTYPES = {"q": np.int64, "d": np.float64, "b": np.int8}


def _type(f) -> str:
    """A record field's declared type's name ("int", "float", "bool", "str")."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def _list_dtype(f) -> type:
    """The numpy type of a record field's column (a coded string: its index)."""
    return np.int64 if "codes" in f.metadata else {"int": np.int64, "float": np.float64, "bool": np.bool_}[_type(f)]


def _declared(record: type) -> tuple:
    """The columns of a record class, from its declaration: (name, typecode,
    default) per field, and the codes of its coded string fields."""
    cols, codes = [], {}
    for f in fields(record):
        default = f.default
        if "codes" in f.metadata:
            codes[f.name] = f.metadata["codes"]
            default = 0
        elif default is MISSING:
            default = NAN if _type(f) == "float" else 0
        cols.append((f.name, _TYPECODES[_type(f)], default))
    return tuple(cols), codes


class _Table:
    """Records of one kind as columns (`array.array`), one row a record:
    the store of a run's calls, attempts or executions. `FIELDS`: (name,
    typecode, default) in the record's field order, and `CODES`, derived
    from the record's declaration (`RECORD`); a field named in `CODES`
    holds the index of its value in that tuple; typecode "b" without codes
    is a bool. `column()` reads one column, `take()` a slice of rows."""
    FIELDS: tuple = ()
    CODES: dict = {}
    RECORD: type = object

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "RECORD" in cls.__dict__:
            fields_, codes = _declared(cls.RECORD)
            cls.FIELDS = fields_
            cls.CODES = {**codes, **cls.__dict__.get("CODES", {})}

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

    @classmethod
    def of_columns(cls, columns: dict):
        """A table with the given columns (numpy arrays or sequences, one per field, codes as stored)."""
        out = cls()
        for name, typecode, _ in cls.FIELDS:
            col = np.ascontiguousarray(columns[name], dtype=_DTYPES[typecode])
            setattr(out, name, array(typecode, col.tobytes()))
        return out


def column(table, name: str) -> np.ndarray:
    """One column of a store as a numpy array: of a table (`CallTable`,
    `AttemptTable`: a copy; `ExecutionTable`: its own), or of a list of
    records (read from each; the record's declaration gives the type).
    Ints as int64, floats as float64, bools as bool, a coded string as the
    index of its value in the field's codes (-1 for a value not among
    them)."""
    if isinstance(table, ExecutionTable):
        return table.column(name)
    if isinstance(table, _Table):
        typecode = next(f[1] for f in table.FIELDS if f[0] == name)
        col = getattr(table, name)
        a = np.frombuffer(col, dtype=_DTYPES[typecode]).copy() if len(col) else np.zeros(0, _DTYPES[typecode])
        if name in table.CODES:
            return a.astype(np.int64)
        return a.astype(bool) if typecode == "b" else a
    n = len(table)
    if not n:
        return np.zeros(0, dtype=_EMPTY[name])
    f = next(f for f in fields(type(table[0])) if f.name == name)
    values = map(attrgetter(name), table)
    if "codes" in f.metadata:
        index = {v: i for i, v in enumerate(f.metadata["codes"])}
        return np.fromiter(map(index.get, values, repeat(-1)), dtype=np.int64, count=n)
    return np.fromiter(values, dtype=_list_dtype(f), count=n)


def take(table, rows):
    """The rows `rows` (indices, in the order given) of a store: a table of
    the same kind, or a list of the records."""
    rows = np.asarray(rows, dtype=np.int64)
    if isinstance(table, ExecutionTable):
        return table.take(rows)
    if isinstance(table, _Table):
        return type(table).of_columns({name: np.frombuffer(getattr(table, name), dtype=_DTYPES[tc])[rows]
                                       if len(table) else np.zeros(0, _DTYPES[tc])
                                       for name, tc, _ in table.FIELDS})
    return [table[i] for i in rows.tolist()]


class AttemptTable(_Table):
    """The attempts of a run in the order sent (`AttemptRecord` rows);
    `outcome` holds indices into ATTEMPT_OUTCOMES."""
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


class ExecutionTable:
    """The executions of a run (`ExecutionRecord` rows, by id as the
    simulator writes them): the records the engine updated while they ran,
    and their columns, each made from the records the first time it is
    read (`column()`; `fate` as indices into EXECUTION_FATES) or given (a
    slice of another table's, `take()`). Its fields, codes and column types
    are `ExecutionRecord`'s declaration."""
    RECORD = ExecutionRecord
    FIELDS, CODES = _declared(ExecutionRecord)

    def __init__(self, records=(), columns: dict | None = None):
        self.records = list(records)
        self._columns = dict(columns) if columns else {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> ExecutionRecord:
        return self.records[i]

    def __iter__(self):
        return iter(self.records)

    def column(self, name: str) -> np.ndarray:
        """One column (made once; the array is the table's: not to be written)."""
        col = self._columns.get(name)
        if col is None:
            col = self._columns[name] = column(self.records, name)
        return col

    def read_all(self) -> "ExecutionTable":
        """Make every column now (slices then cut them rather than read the records again)."""
        for name, _, _ in self.FIELDS:
            self.column(name)
        return self

    def take(self, rows: np.ndarray) -> "ExecutionTable":
        return ExecutionTable(map(self.records.__getitem__, rows.tolist()),
                              {k: v[rows] for k, v in self._columns.items()})


# the column types of an empty list of records (a name means one type in every record kind)
_EMPTY = {f.name: _list_dtype(f) for r in (CallRecord, AttemptRecord, ExecutionRecord) for f in fields(r)}


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
    executions: list[ExecutionRecord] | ExecutionTable
    series: Series
    counters: dict[str, int]                    # vLLM counters at run end
    counters_at: dict[float, dict[str, int]]    # counter snapshots at chosen times (e.g. 227, 947)
    engine: dict[str, int]                      # steps, preemptions, aborted_before_scheduled
    end_time: float
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
