"""The record builder of a run (`sim.model.Run`): the executions' records
as the proxy creates, drops and orphans them, the attempt-log rows of the
attempts the proxy saw under layers, and at the end the run's `RunLog` (the
engines' series, counters and work summed) with each engine's part
(`ReplicaParts`)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .policy.proxy import Drop, Subscribe
from .replicas import sum_counters
from .runlog import ExecutionRecord, ExecutionTable, RunLog, Series, sample_columns, sample_log


class ReplicaParts(NamedTuple):
    """Each engine's part of a run's log: its 1 s samples (at `t`), its
    engine work and its step events."""
    t: np.ndarray
    waiting: list
    running: list
    engine: list
    extra: list


class Records:
    """The records of the run of `calls` (`sim.calls.Calls`, whose call and
    attempt tables the log carries)."""

    def __init__(self, calls):
        self.calls = calls
        self.executions: list[ExecutionRecord] = []
        # under layers, the attempt-log row of each attempt the proxy saw, in order (the cluster's `landed`
        # counts the proxy's attempts: a gateway's retries and refusals make them others than the client's)
        self.proxy_rows: list | None = None

    def subscribe(self, t: float, a: Subscribe) -> None:
        att, ex = a.attempt, a.execution
        row, log = att.row, self.calls.attempt_log
        log.execution[row] = ex.id
        if att.attached:
            log.attached[row] = True
        if ex.id == len(self.executions):        # created for this attempt
            i = ex.call_id
            calls = self.calls
            # ExecutionRecord(id, call, attempt, prompt_len, max_tokens, created_at)
            self.executions.append(ExecutionRecord(ex.id, i, att.number, calls.prompt_len[i], calls.max_tokens[i],
                                                   ex.created_at))

    def drop(self, t: float, a: Drop) -> None:
        erec = self.executions[a.execution.id]
        erec.fate, erec.finished_at = "dropped", t

    def orphaned(self, t: float, ex) -> None:
        """An execution runs on with nobody waiting for it (its record's `orphaned_at`: the first time)."""
        erec = self.executions[ex.id]
        if erec.orphaned_at != erec.orphaned_at:
            erec.orphaned_at = t

    def log(self, end: float, wall: float, replicas, chain: tuple, layers: list,
            proxy_queue_log: list) -> tuple[RunLog, ReplicaParts]:
        """The cluster's RunLog (its engines' series, counters and work
        summed) and each engine's part. `chain`: the stack's layers between
        the client and the proxy (kind, settings), `layers` their objects."""
        ts = np.arange(0.0, math.floor(end) + 1.0)
        waiting, running, engine_r, extra_r = [], [], [], []
        for e in replicas.engines:
            w, r = (v.astype(np.int64) for v in sample_columns(e.gauge_log, ts, (1, 2)))
            waiting.append(w)
            running.append(r)
            steps, busy = e.work_by(end)
            engine_r.append({"steps": steps, "preemptions": e.scheduler.num_preemptions,
                             "aborted_before_scheduled": e.aborted_before_scheduled})
            extra_r.append({"busy_s": busy, "step_events": e.num_step_events})
        parts = ReplicaParts(ts, waiting, running, engine_r, extra_r)
        extra = sum_counters(extra_r)
        if layers:             # what each layer between the client and the proxy did, from the top
            extra["layers"] = [{"kind": kind, "preset": settings.get("preset"), **dict(layer.counts)}
                               for (kind, settings), layer in zip(chain, layers)]
            for d, layer in zip(extra["layers"], layers):
                if hasattr(layer, "record"):        # a gateway's upstream group (sim.policy.upstream)
                    d["upstream_group"] = layer.record(end)
        proxy_queue = sample_log(proxy_queue_log, ts, 1).astype(np.int64)
        series = Series(t=ts, waiting=sum(waiting[1:], waiting[0]), running=sum(running[1:], running[0]),
                        proxy_queue=proxy_queue)
        calls = self.calls
        log = RunLog(calls=calls.call_log, attempts=calls.attempt_log, executions=ExecutionTable(self.executions),
                     series=series, counters=sum_counters(e.scheduler.counters for e in replicas.engines),
                     counters_at=dict(replicas.counters_at), engine=sum_counters(engine_r),
                     end_time=end, wall_s=wall, extra=extra)
        return log, parts
