"""Several engine replicas behind a router, in simulated time, and the
fleet's result record.

`FleetRun` is the driver of `sim.model.Run` with one engine per replica and
a `sim.policy.router.Router` between the proxy and the engines. Where the
proxy stands is the router config's `proxy`:
- `deployment`: one proxy before the router. The router places each
  execution the proxy dispatches; an engine's 503 (its cap) is retried on
  another replica by the router while its retries allow.
- `replica`: a sidecar proxy before each engine (`ReplicaProxies`). The
  router places each attempt; a sidecar's 503 is retried likewise.
With one replica either gives the single engine's run, event for event.

`run_fleet` runs one and returns the record: the fleet's own result record (all
calls, attempts and executions; the engines' series, counters and work
summed; Ĉ the sum of the replicas') with two more keys,
- `replicas`: per replica the result record of what reached it (`replica_log`),
- `fleet`: the router, the calls each replica got first, attempts moved to a
  replica other than their call's previous one, prefix-cache hit share per
  replica, and the calls that ever had two live executions on different
  replicas (`fleet_measures`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from . import measures
from .conditions import Condition, get_condition
from .engine.core import EngineCore
from .engine.request import Request
from .clock import RoutedTimers as _RoutedTimers
from .model import Run, never, engine_config, prompt_throughput
from .policy.proxy import EngineView, PromptRate, Proxy
from .policy.router import ReplicaProxies, ReplicaView, Router, RouterConfig
from .profile import Profile
from .run import run_inputs, workload_capacity
from .runlog import (CALL_OUTCOMES, CallRecord, CallTable, ExecutionTable, RunLog, Series, column, sample_log,
                     take)
from .scenario import Scenario
from .workload import Trace

INF = float("inf")
NAN = float("nan")
RECORD_KEYS = ("fleet", "replicas")              # keys a fleet's record has beyond the result record
# a call's record in a replica's log when the call reached it only after another replica
ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class FleetSpec:
    """A scenario's [fleet] (read by `sim.deployment` against `sim.schema`):
    the router and one profile per replica; `profile_names` as the file
    named them (None: the model's for all)."""
    router: RouterConfig
    profiles: tuple = field(repr=False)
    profile_names: tuple | None = None

    @property
    def replicas(self) -> int:
        return len(self.profiles)

    def document(self) -> dict:
        d = {"replicas": self.replicas, "router": self.router.policy, "router_retries": self.router.retries,
             "proxy": self.router.proxy}
        if self.profile_names is not None:
            d["profiles"] = list(self.profile_names)
        return d

    def capacities(self, scenario: Scenario) -> list[float]:
        """Ĉ of each replica on this workload (`sim.run.workload_capacity`)."""
        return [float(workload_capacity(p, scenario)["capacity"]) for p in self.profiles]

    def capacity_info(self, scenario: Scenario) -> dict:
        """The fleet's Ĉ (the sum of the replicas') and where each came from."""
        infos = [workload_capacity(p, scenario) for p in self.profiles]
        sources = sorted({i["source"] for i in infos})
        return {"capacity": float(sum(i["capacity"] for i in infos)), "key": infos[0].get("key"),
                "source": "; ".join(sources),
                "replicas": [float(i["capacity"]) for i in infos]}


@dataclass
class FleetLog:
    """What a fleet run leaves behind: the fleet's RunLog, one per replica,
    and where each attempt and execution landed (-1: on no replica)."""
    fleet: RunLog
    replicas: list[RunLog]
    attempt_replica: np.ndarray         # by position in fleet.attempts
    execution_replica: np.ndarray       # by execution id
    execution_placed: np.ndarray        # when the execution got its replica (NaN: never)
    call_replica: np.ndarray            # replica of the call's first landed attempt
    rerouted: int = 0                   # requests the router retried on another replica
    config: dict = field(default_factory=dict)


class FleetRun(Run):
    """One run of `len(profiles)` replicas (replica i runs `profiles[i]`)."""

    def __init__(self, profiles: list[Profile], trace: Trace, condition: Condition, scenario: Scenario,
                 router: RouterConfig = RouterConfig(), seed: int = 0, max_batched_tokens: int | None = None,
                 fast_forward: bool = True, snapshot_times: tuple = ()):
        if not profiles:
            raise ValueError("a fleet needs at least one replica")
        self.profiles = list(profiles)
        self.router_config = router
        self.n = len(profiles)
        super().__init__(profiles[0], trace, condition, scenario, seed, max_batched_tokens, fast_forward,
                         snapshot_times)

    def _build(self, profile, condition, scenario, max_batched_tokens, fast_forward) -> None:
        n, env = self.n, self.env
        self.replica_mode = self.router_config.proxy == "replica"
        self.router = Router(self.router_config, n, view=self._replica_view, outstanding=self._outstanding_of,
                             kv_usage=self._kv_usage_of)
        self.reroutes_refusals = n > 1 and self.router_config.retries > 0 and condition.engine_cap is not None
        self.rerouted = 0                       # executions the router retried on another replica (deployment proxy)
        # each execution's replica by id (-1: not placed; with the deployment
        # proxy, ids beyond its end too): with sidecars the router placed it
        # when it was created, else when it was dispatched (the time it got
        # its replica: `_placed`)
        self.exec_replica: list[int] = []
        self.counters_at_r: list[dict] = [{} for _ in range(n)]
        # the prompt throughput over the last 60 s, the fleet's (the
        # deployment proxy's view) and each replica's (its sidecar's)
        self.prompt_rate = PromptRate(60.0)
        self.prompt_rates = [PromptRate(60.0) for _ in range(n)]
        if self.replica_mode:
            self.sidecars = [Proxy(condition.proxy, engine_view=partial(self._engine_view_of, r),
                                   prompt_throughput=prompt_throughput(p, scenario))
                             for r, p in enumerate(self.profiles)]
            self.proxy = ReplicaProxies(self.sidecars, self.router)
            self.exec_replica = self.proxy.execution_replica
            self.queue_logs = [[(0.0, 0)] for _ in range(n)]
        else:
            self.proxy = Proxy(condition.proxy, engine_view=self._engine_view,
                               prompt_throughput=sum(prompt_throughput(p, scenario) for p in self.profiles))
        self.sidecar_queues = self.replica_mode and condition.proxy.proxy_cap is not None   # sidecars may queue
        if self.sidecar_queues:
            self._do = self._do_and_log_sidecar_queues
        self._routed_timers = None
        if n > 1 and self._calls_stay_home(condition):
            # every input a timer brings reaches the replica of its call alone
            self.home = [self.router.home(c) for c in range(len(self.trace))]
            # a call's retry (the timer's argument: its id), an attempt's
            # deadline and an execution's wake (its call_id); a call's
            # arrival likewise where the trace's arrivals are out of order,
            # else under no replica (`_calls_of` stands for arrivals)
            arrival = self.trace.arrival
            in_order = len(arrival) < 2 or bool((np.diff(arrival) >= 0).all())
            by_call = {type(self)._arrive: None if in_order else False, type(self)._send: False,
                       type(self)._deadline: True, type(self)._wake: True}
            self._routed_timers = _RoutedTimers(env, self.timers.horizon, self.timers.stop, n, self.home, by_call)
            self.timers = self._routed_timers
            self._calls_of = [[] for _ in range(n)]          # call ids by home replica, in arrival order
            for c, r in enumerate(self.home):
                self._calls_of[r].append(c)
            self._calls_at = [0] * n                         # first of them not yet arrived
            self._next_call = 0                              # first call whose arrival has not fired
        # what each engine calls for its first tokens and its next input
        # time: only a proxy that reads its view (`Proxy.estimate_wait`)
        # needs the prompt throughput
        reads_view = condition.proxy.queue == "deadline" or condition.proxy.budget is not None
        if not reads_view:
            first_token = [None] * n
        elif self.replica_mode:
            first_token = [partial(self._on_first_token_of, r) for r in range(n)]
        else:
            first_token = [self._on_first_token] * n
        if self._routed_timers is None and not self.replica_mode and condition.proxy.proxy_cap is None:
            next_input = [self.timers.next_time] * n     # the proxy never queues: the next timer
        else:
            next_input = [partial(self._next_input_time_of, r) for r in range(n)]
        # no proxy cancels, and no router reads the KV usage that a
        # fast-forward takes ahead: requests added to a replica whose
        # admission is blocked change none of its steps (EngineCore)
        never_aborts = condition.proxy.cancellation == "off" and (self.router_config.policy != "least-kv" or n == 1)
        self.engines = [EngineCore(env, engine_config(p, condition, max_batched_tokens, scenario), p.step_time,
                                   on_finished=self._on_finished, on_first_token=first_token[r],
                                   next_input_time=next_input[r], fast_forward=fast_forward,
                                   next_abort_time=never if never_aborts else None)
                        for r, p in enumerate(self.profiles)]
        self.engine = None

    def _calls_stay_home(self, condition: Condition) -> bool:
        """Whether every request of a call goes to one replica known in
        advance (`Router.home`), and what happens to a call touches no other
        replica: a hashing router that never moves a request on 503, and no
        deployment proxy queue (one that dispatches, when a seat frees, the
        queued execution of any call)."""
        moves = self.router_config.retries > 0 and (
            condition.engine_cap is not None or (self.replica_mode and condition.proxy.queue == "deadline"))
        deployment_queue = not self.replica_mode and condition.proxy.proxy_cap is not None
        return self.router.home(0) is not None and not moves and not deployment_queue

    def _arrive(self, t: float, call_id: int) -> None:
        if self._routed_timers is not None:
            self._next_call = call_id + 1
        super()._arrive(t, call_id)

    # ------------------------------------------------------------ engines
    def _gauge_logs(self) -> list[list]:
        return [e.gauge_log for e in self.engines]

    def _log_entries(self) -> int:
        return sum(map(len, self._gauge_logs())) + len(self.proxy_queue_log)

    def _horizon(self) -> float:
        """The timers' horizon (the contract in sim.clock): the earliest end
        of a step in flight; -INF while an engine is idle."""
        h = INF
        for e in self.engines:
            p = e.pending
            if not p:
                return -INF
            if p[0].end < h:
                h = p[0].end
        return h

    def _next_input_time_of(self, r: int) -> float:
        """Engine r's horizon (the contract in sim.clock): the next timer; and
        while a proxy that feeds r holds a queue, the next moment a request
        may finish where that proxy's queue drains on finishes: r's own
        steps in flight that finish one (its sidecar); with the deployment's
        proxy, any engine's, and for another engine also the end of its
        steps in flight (a step it has not scheduled yet may finish one just
        after); with sidecars, an engine's 503 to an execution its sidecar
        dispatched from its queue sends the attempt on to another replica,
        so where the router retries and engines have a cap, another
        sidecar's queue counts likewise. Where every call stays on its home
        replica, only the timers of r's calls count, and the arrival of the
        next call r is home to."""
        if self._routed_timers is not None:
            t = self._routed_timers.next_time_of(r)
            calls, i = self._calls_of[r], self._calls_at[r]
            while i < len(calls) and calls[i] < self._next_call:
                i += 1
            self._calls_at[r] = i
            if i < len(calls) and self.arrival[calls[i]] < t:
                t = self.arrival[calls[i]]
        else:
            t = self.timers.next_time()
        if self.replica_mode:
            if self.sidecars[r].queued:
                t = min(t, _next_finish(self.engines[r]))
            if self.reroutes_refusals:
                for s, e in enumerate(self.engines):
                    if s != r and self.sidecars[s].queued:
                        t = min(t, _next_finish(e), e.pending[-1].end if e.pending else INF)
            return t
        if self.proxy.queued:
            for s, e in enumerate(self.engines):
                t = min(t, _next_finish(e))
                if s != r and e.pending:
                    t = min(t, e.pending[-1].end)
        return t

    def _replica_view(self, r: int) -> ReplicaView:
        return ReplicaView(self._outstanding_of(r), self._kv_usage_of(r))

    def _outstanding_of(self, r: int) -> int:
        """Requests replica r holds: in its engine, and in its sidecar's queue."""
        held = self.engines[r].num_in_engine()
        return held + self.sidecars[r].queued if self.replica_mode else held

    def _kv_usage_of(self, r: int) -> float:
        return self.engines[r].scheduler.block_pool.usage()

    def _engine_view(self, t: float) -> EngineView:
        """The deployment proxy's view: the whole fleet."""
        return EngineView(float(sum(e.uncomputed_prompt_tokens() for e in self.engines)), self.prompt_rate.rate(t))

    def _engine_view_of(self, r: int, t: float) -> EngineView:
        """A sidecar's view: its own engine."""
        return EngineView(float(self.engines[r].uncomputed_prompt_tokens()), self.prompt_rates[r].rate(t))

    def _on_first_token_of(self, r: int, req: Request, t: float) -> None:
        """Engine r's first token of `req`: replica r's prompt throughput."""
        rec = req.record
        self.prompt_rates[r].add(t, rec.prompt_computed if rec is not None else req.num_prompt_tokens)

    # ---------------------------------------------------------- placement
    def _dispatch(self, t: float, ex) -> None:
        ex_id, call_id = ex.id, ex.call_id
        erec = self.executions[ex_id]
        erec.dispatched_at = t
        prefix, group = self.trace.prefix_of(call_id)
        req = Request(ex_id, call_id, erec.prompt_len, erec.max_tokens, prefix, record=erec, prefix_group=group,
                      priority=self.call_priority[call_id])
        reps = self.exec_replica
        if self.replica_mode:
            r = reps[ex_id]
        else:
            if len(reps) <= ex_id:
                reps.extend([-1] * (ex_id + 1 - len(reps)))
            r = self.router.pick(call_id)
        tried = None
        while True:
            reps[ex_id] = r
            if self.engines[r].add_request(req):
                erec.accepted = True
                self.requests[ex_id] = req
                self.proxy.on_dispatched(t, ex)
                return
            if self.replica_mode:
                break
            if tried is None:
                tried = [r]
            if not self.router.may_retry(tried):
                break
            self.rerouted += 1
            r = self.router.pick(call_id, tried)
            tried.append(r)
        erec.fate, erec.finished_at = "refused", t
        self._do(t, self.proxy.on_engine_refused(t, ex))

    def _cancel(self, t: float, a) -> None:
        self.executions[a.execution.id].cancel_requested_at = t
        self.engines[self.exec_replica[a.execution.id]].abort_request(self.requests.pop(a.execution.id))

    def _do_and_log_sidecar_queues(self, t: float, actions: list) -> None:
        """`_do` where sidecars may queue: their queue lengths are logged
        once the actions are all carried out."""
        Run._do(self, t, actions)
        if not self._action_stack:
            for p, log in zip(self.sidecars, self.queue_logs):
                if p.queued != log[-1][1]:
                    log.append((t, p.queued))

    def _snapshot(self, t: float, _arg=None) -> None:
        for r, e in enumerate(self.engines):
            self.counters_at_r[r][t] = dict(e.scheduler.counters)
        self.counters_at[t] = sum_counters(self.counters_at_r[r][t] for r in range(self.n))

    # ---------------------------------------------------------------- log
    def _log(self, end: float, wall: float) -> FleetLog:
        n = self.n
        ts = np.arange(0.0, math.floor(end) + 1.0)
        waiting = [sample_log(e.gauge_log, ts, 1).astype(np.int64) for e in self.engines]
        running = [sample_log(e.gauge_log, ts, 2).astype(np.int64) for e in self.engines]
        if self.replica_mode:
            pq = [sample_log(q, ts, 1).astype(np.int64) for q in self.queue_logs]
        else:
            pq = [np.zeros(len(ts), dtype=np.int64) for _ in range(n)]
        fleet_pq = sample_log(self.proxy_queue_log, ts, 1).astype(np.int64)
        work = [e.work_by(end) for e in self.engines]
        engine_r = [{"steps": w[0], "preemptions": e.scheduler.num_preemptions,
                     "aborted_before_scheduled": e.aborted_before_scheduled} for e, w in zip(self.engines, work)]
        extra_r = [{"busy_s": w[1], "step_events": e.num_step_events} for e, w in zip(self.engines, work)]
        executions = ExecutionTable(self.executions).read_all()     # the replicas' slices cut its columns
        fleet = RunLog(calls=self.call_log, attempts=self.attempt_log, executions=executions,
                       series=Series(t=ts, waiting=sum(waiting[1:], waiting[0]), running=sum(running[1:], running[0]),
                                     proxy_queue=fleet_pq),
                       counters=sum_counters(e.scheduler.counters for e in self.engines),
                       counters_at=dict(self.counters_at), engine=sum_counters(engine_r), end_time=end, wall_s=wall,
                       extra=sum_counters(extra_r))
        ex_rep = np.full(len(self.executions), -1, dtype=np.int64)
        ex_rep[:len(self.exec_replica)] = self.exec_replica
        if self.replica_mode:
            att_rep = np.asarray(self.proxy.landed, dtype=np.int64)
        else:
            a_exec = column(self.attempt_log, "execution")
            att_rep = np.where(a_exec >= 0, ex_rep[np.maximum(a_exec, 0)] if len(ex_rep) else -1, -1)
        call_rep = first_landing(self.attempt_log, att_rep, len(self.call_log))
        replicas = [replica_log(fleet, r, att_rep, ex_rep, call_rep,
                                Series(t=ts, waiting=waiting[r], running=running[r], proxy_queue=pq[r]),
                                dict(self.engines[r].scheduler.counters), self.counters_at_r[r], engine_r[r],
                                extra_r[r]) for r in range(n)]
        rerouted = self.rerouted + (self.proxy.rerouted if self.replica_mode else 0)
        return FleetLog(fleet, replicas, att_rep, ex_rep, self._placed(executions), call_rep,
                        rerouted, {"replicas": n, "router": self.router_config.policy,
                                   "router_retries": self.router_config.retries, "proxy": self.router_config.proxy,
                                   "profiles": [p.name for p in self.profiles]})

    def _placed(self, executions: ExecutionTable) -> np.ndarray:
        """When each execution got its replica, by id (NaN: never): its
        dispatch, or with sidecars, its creation until it is dispatched."""
        placed = column(executions, "dispatched_at")
        if self.replica_mode:
            placed = np.where(np.isnan(placed), column(executions, "created_at"), placed)
        return placed


def _next_finish(e: EngineCore) -> float:
    """The end of the first step in flight of engine e that finishes a request (INF: none)."""
    for plan in e.pending:
        if plan.finishing:
            return plan.end
    return INF


def sum_counters(dicts) -> dict:
    """Key-wise sum of counter dicts (keys in first-seen order)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


class ReplicaCallTable(CallTable):
    """A replica's calls: the fleet's calls by id, those that landed first on
    another replica standing as rows with id -1, no planned time and outcome
    `elsewhere` (no cohort counts them)."""
    CODES = {"outcome": CALL_OUTCOMES + (ELSEWHERE,)}


_ELSEWHERE_CODE = len(CALL_OUTCOMES)


def first_landing(attempts, attempt_replica: np.ndarray, n_calls: int) -> np.ndarray:
    """Each call's replica: where its first attempt that reached a replica
    landed (-1: none did). Attempts are in the order they were sent."""
    out = np.full(n_calls, -1, dtype=np.int64)
    if not len(attempts):
        return out
    calls = column(attempts, "call")
    landed = attempt_replica >= 0
    c, r = calls[landed][::-1], attempt_replica[landed][::-1]
    out[c] = r                          # the earliest one is written last
    return out


def replica_log(fleet: RunLog, r: int, attempt_replica: np.ndarray, execution_replica: np.ndarray,
                call_replica: np.ndarray, series: Series, counters: dict, counters_at: dict, engine: dict,
                extra: dict) -> RunLog:
    """Replica r's RunLog: slices of the fleet's store (`take`), the
    attempts that landed on it and the executions it ran, with its engine's
    series, counters and work; its calls are those that landed on it first
    (each call belongs to one replica). A call that reached r only after
    another replica stands in its calls as a record with id -1, no planned
    time and outcome `elsewhere` (no cohort counts it); from the fleet's
    tables the replica's are tables (`ReplicaCallTable`), from lists of
    records, lists."""
    ex = fleet.executions
    executions = take(ex, np.flatnonzero(execution_replica[column(ex, "id")] == r))
    here = call_replica == r
    attempts = take(fleet.attempts, np.flatnonzero(attempt_replica == r))
    cl = fleet.calls
    if isinstance(cl, CallTable):
        calls = ReplicaCallTable.of_columns({
            "id": np.where(here, column(cl, "id"), -1),
            "planned_at": np.where(here, column(cl, "planned_at"), NAN),
            "delivered_at": np.where(here, column(cl, "delivered_at"), NAN),
            "attempts": np.where(here, column(cl, "attempts"), 0),
            "outcome": np.where(here, column(cl, "outcome"), _ELSEWHERE_CODE)})
    else:
        elsewhere = CallRecord(-1, NAN, outcome=ELSEWHERE)
        calls = [c if h else elsewhere for c, h in zip(cl, here.tolist())]
    return RunLog(calls=calls, attempts=attempts, executions=executions, series=series, counters=counters,
                  counters_at=counters_at, engine=engine, end_time=fleet.end_time, wall_s=0.0, extra=extra)


def split_calls(log: FleetLog) -> int:
    """Calls that at some moment had two live executions on different
    replicas. An execution is live on its replica from its placement to the
    first of its finish (completed, aborted, dropped, refused) and the
    proxy's cancel, or the run's end."""
    ex = log.fleet.executions
    if not len(ex):
        return 0
    rep = log.execution_replica
    ids, call, fin, cancel = (column(ex, name) for name in ("id", "call", "finished_at", "cancel_requested_at"))
    start = log.execution_placed[ids]
    stop = np.fmin(fin, cancel)
    stop = np.where(np.isnan(stop), log.fleet.end_time, stop)
    r = rep[ids]
    ok = (r >= 0) & ~np.isnan(start) & (stop > start)
    call, start, stop, r = call[ok], start[ok], stop[ok], r[ok]
    if not len(call):
        return 0
    # only calls with executions on two replicas need a look
    order = np.lexsort((start, call))
    call, start, stop, r = call[order], start[order], stop[order], r[order]
    first = np.r_[0, np.flatnonzero(np.diff(call)) + 1]
    size = np.diff(np.r_[first, len(call)])
    mixed = np.minimum.reduceat(r, first) != np.maximum.reduceat(r, first)
    n = 0
    small = mixed & (size <= _PAIRWISE)
    if small.any():
        # each such call's executions side by side (k at most), every pair compared at once
        k = int(size[small].max())
        pos = np.arange(k)
        valid = pos[None, :] < size[small][:, None]
        idx = np.where(valid, first[small][:, None] + pos[None, :], 0)
        s0, s1, rr = start[idx], stop[idx], r[idx]
        pair = ((rr[:, :, None] != rr[:, None, :]) & (s0[:, None, :] < s1[:, :, None])
                & (s0[:, :, None] < s1[:, None, :]) & valid[:, :, None] & valid[:, None, :])
        n += int(pair.any(axis=(1, 2)).sum())
    for c_start, c_size in zip(first[mixed & ~small].tolist(), size[mixed & ~small].tolist()):
        c_end = c_start + c_size
        if _overlap_across(start[c_start:c_end], stop[c_start:c_end], r[c_start:c_end]):
            n += 1
    return n


_PAIRWISE = 16          # calls with more executions are compared pair by pair in a loop


def _overlap_across(start: np.ndarray, stop: np.ndarray, rep: np.ndarray) -> bool:
    k = len(start)
    for i in range(k):
        for j in range(i + 1, k):
            if rep[i] != rep[j] and start[j] < stop[i] and start[i] < stop[j]:
                return True
    return False


def moved_attempts(log: FleetLog) -> int:
    """Attempts that landed on a replica other than the one their call's
    previous landed attempt reached."""
    att = log.fleet.attempts
    if not len(att):
        return 0
    calls = column(att, "call")
    rep = log.attempt_replica
    landed = rep >= 0
    calls, rep = calls[landed], rep[landed]
    order = np.argsort(calls, kind="stable")     # each call's attempts in the order sent
    c, x = calls[order], rep[order]
    return int(((c[1:] == c[:-1]) & (x[1:] != x[:-1])).sum())


def fleet_measures(log: FleetLog) -> dict:
    """The fleet's own measures beyond the result record (see the module docstring)."""
    n = len(log.replicas)
    calls = np.bincount(log.call_replica[log.call_replica >= 0], minlength=n)
    landed = np.bincount(log.attempt_replica[log.attempt_replica >= 0], minlength=n)
    hit = []
    for rl in log.replicas:
        q = rl.counters.get("prefix_cache_queries_total", 0)
        hit.append(rl.counters.get("prefix_cache_hits_total", 0) / q if q else None)
    return {**log.config,
            "calls": calls.tolist(), "calls_unrouted": int((log.call_replica < 0).sum()),
            "attempts_landed": landed.tolist(), "attempts_moved": moved_attempts(log),
            "router_rerouted": int(log.rerouted), "prefix_hit_share": hit, "split_calls": split_calls(log)}


def simulate_fleet(profiles: list[Profile], trace: Trace, condition: Condition, scenario: Scenario,
                   router: RouterConfig = RouterConfig(), seed: int = 0, max_batched_tokens: int | None = None,
                   fast_forward: bool = True) -> FleetLog:
    run = FleetRun(profiles, trace, condition, scenario, router, seed, max_batched_tokens, fast_forward,
                   snapshot_times=(scenario.pulse_end, scenario.hold_end))
    return run.run()


def fleet_record(log: FleetLog, scenario: Scenario, capacities: list[float], inputs: dict) -> dict:
    """The fleet's record: the result record of the whole fleet (Ĉ the sum of
    `capacities`), `replicas` (each replica's result record at its own Ĉ) and
    `fleet` (`fleet_measures`)."""
    rec = measures.record(log.fleet, scenario, sum(capacities), inputs)
    rec["replicas"] = [measures.record(rl, scenario, c, inputs) for rl, c in zip(log.replicas, capacities)]
    rec["fleet"] = measures._clean(fleet_measures(log))
    return rec


def run_fleet(profiles: list[Profile], condition: str | Condition, trace: Trace, scenario: Scenario,
              capacities: list[float], router: RouterConfig = RouterConfig(), seed: int = 0, pulse=None,
              max_batched_tokens: int | None = None, extra: dict | None = None, fast_forward: bool = True) -> dict:
    """One fleet run of `condition` on `trace` (drawn at the fleet's Ĉ, the
    sum of `capacities`, one per replica), measured into the fleet's record.
    The inputs are those `sim.run.run_one` records, for the first replica's
    profile (`model`)."""
    cond = condition if isinstance(condition, Condition) else get_condition(condition)
    log = simulate_fleet(profiles, trace, cond, scenario, router, seed, max_batched_tokens, fast_forward)
    return fleet_record(log, scenario, capacities,
                        run_inputs(profiles[0], cond, pulse, seed, max_batched_tokens, extra=extra))


def summary(rec: dict) -> str:
    """A few lines on a fleet's record: the router, and per replica the
    calls it got first, its hold cohort's delivery within the deadline,
    whether it recovered and its prefix-cache hit share."""
    f = rec["fleet"]
    lines = [f"  fleet: {f['replicas']} replicas, router {f['router']} (retries {f['router_retries']}), proxy per "
             f"{f['proxy']}; attempts moved to another replica {f['attempts_moved']}, rerouted on 503 "
             f"{f['router_rerouted']}; calls with live executions on two replicas {f['split_calls']}"]
    for i, r in enumerate(rec["replicas"]):
        hold = r["cohorts"]["hold"]
        share = f"{100.0 * hold['within_deadline'] / hold['offered']:.1f}%" if hold["offered"] else "n/a"
        hit = f["prefix_hit_share"][i]
        rt = r["recovery_time_s"]
        lines.append(f"  replica {i} ({f['profiles'][i]}): {f['calls'][i]} calls, hold within deadline {share}, "
                     + (f"recovered {rt:.0f} s after the pulse" if r["recovered"] and rt is not None
                        else "not recovered")
                     + (f", prefix-cache hits {100.0 * hit:.1f}%" if hit is not None else ""))
    return "\n".join(lines)
