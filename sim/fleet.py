"""Several engine replicas behind a router, in simulated time, and the
fleet's result record.

A fleet is a run of `sim.model.Run` over a cluster of one engine per
replica, with a `sim.policy.router.Router` placing requests on them. Where
the proxy stands is the router config's `proxy`, a placement of the
proxy layer in the stack (`sim.policy.stack`):
- `deployment`: one proxy before the router. The router places each
  execution the proxy dispatches; an engine's 503 (its cap) is retried on
  another replica by the router while its retries allow.
- `replica`: a sidecar proxy before each engine (`ReplicaProxies`). The
  router places each attempt; a sidecar's 503 is retried likewise.
With one replica either gives the single engine's run, event for event.
`fleet_log` reads a run's per-replica parts into a `FleetLog`.

`run_fleet` runs one and returns the record: the fleet's own result record (all
calls, attempts and executions; the engines' series, counters and work
summed; Ĉ the sum of the replicas') with two more keys,
- `replicas`: per replica the result record of what reached it (`replica_log`),
- `fleet`: the router, the calls each replica got first, attempts moved to a
  replica other than their call's previous one, prefix-cache hit share per
  replica, and the calls that ever had two live executions on different
  replicas (`fleet_measures`).
With an autoscaler (`sim.policy.autoscaler.AutoscalerConfig`, the
cluster built at its max_replicas) the record has `autoscaler` too
(`sim.autoscale.scaling_measures`: replicas over time, replica-seconds,
scale-ups and each new replica's first call).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import measures
from .autoscale import scaling_measures
from .conditions import Condition, get_condition
from .model import Run
from .policy.autoscaler import AutoscalerConfig
from .policy.router import RouterConfig
from .policy.stack import Stack
from .profile import Profile
from .run import run_inputs, workload_capacity
from .runlog import CALL_OUTCOMES, CallRecord, CallTable, RunLog, Series, column, sample_log, take
from .scenario import Scenario
from .workload import Trace

NAN = float("nan")
RECORD_KEYS = ("fleet", "replicas", "autoscaler")              # keys a fleet's record has beyond the result record
# a call's record in a replica's log when the call reached it only after another replica
ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class FleetSpec:
    """A scenario's [fleet] (read by `sim.scenario_file` against `sim.schema`):
    the router and one profile per replica; `profile_names` as the file
    named them (None: the model's for all); `autoscaler` ([autoscaler]),
    where given, scales the replicas between its min and max (the profiles
    are its max_replicas')."""
    router: RouterConfig
    profiles: tuple = field(repr=False)
    profile_names: tuple | None = None
    autoscaler: AutoscalerConfig | None = None

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
        """The fleet's Ĉ (the sum of the replicas'; with an autoscaler, of
        the replicas it starts with) and where each came from."""
        infos = [workload_capacity(p, scenario) for p in self.profiles]
        sources = sorted({i["source"] for i in infos})
        k = self.autoscaler.initial if self.autoscaler is not None else len(infos)
        return {"capacity": float(sum(i["capacity"] for i in infos[:k])), "key": infos[0].get("key"),
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
    scaling: object = None              # the run's sim.autoscale.Scaling (None: a fixed fleet)


def fleet_log(run: Run, log: RunLog) -> FleetLog:
    """A cluster's run (`Run`, its `run()` returning `log`) as a FleetLog:
    where each attempt and execution landed, and each replica's RunLog."""
    n, cl, parts = run.n, run.cluster, run.parts
    executions = log.executions.read_all()     # the replicas' slices cut its columns
    fleet = replace(log, executions=executions)
    ts = parts.t
    pq = [sample_log(q, ts, 1).astype(np.int64) for q in run.queue_logs]
    ex_rep = np.full(len(executions), -1, dtype=np.int64)
    ex_rep[:] = cl.execution_replicas(len(executions))
    landed = cl.landed()
    if landed is not None and run.proxy_rows is not None:
        # the proxy saw the layers' upstream attempts: each client attempt lands where the last of its
        # upstream attempts that reached a replica did
        att_rep = np.full(len(log.attempts), -1, dtype=np.int64)
        for row, r in zip(run.proxy_rows, landed):
            if r >= 0:
                att_rep[row] = r
    elif landed is not None:
        att_rep = np.asarray(landed, dtype=np.int64)
    else:                       # attempts land where their executions do
        a_exec = column(log.attempts, "execution")
        att_rep = np.where(a_exec >= 0, ex_rep[np.maximum(a_exec, 0)] if len(ex_rep) else -1, -1)
    call_rep = first_landing(log.attempts, att_rep, len(log.calls))
    replicas = [replica_log(fleet, r, att_rep, ex_rep, call_rep,
                            Series(t=ts, waiting=parts.waiting[r], running=parts.running[r], proxy_queue=pq[r]),
                            dict(run.engines[r].scheduler.counters), run.counters_at_r[r], parts.engine[r],
                            parts.extra[r]) for r in range(n)]
    # when each execution got its replica: its dispatch, or where it is
    # placed when created, its creation until it is dispatched
    placed = column(executions, "dispatched_at")
    if cl.placed_at_creation:
        placed = np.where(np.isnan(placed), column(executions, "created_at"), placed)
    rc = run.router_config
    return FleetLog(fleet, replicas, att_rep, ex_rep, placed, call_rep, cl.rerouted,
                    {"replicas": n, "router": rc.policy, "router_retries": rc.retries, "proxy": rc.proxy,
                     "profiles": [p.name for p in run.profiles]}, run.scaling)


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
                   fast_forward: bool = True, stack: Stack | None = None,
                   autoscaler: AutoscalerConfig | None = None) -> FleetLog:
    """`sim.model.simulate` over a cluster of `len(profiles)` replicas
    behind `router` (scaled by `autoscaler`, if given), as a FleetLog;
    `stack` (a `sim.policy.stack.Stack`, its router the fleet's) replaces
    the condition's layers."""
    if not profiles:
        raise ValueError("a fleet needs at least one replica")
    run = Run(list(profiles), trace, condition, scenario, seed, max_batched_tokens, fast_forward,
              snapshot_times=(scenario.pulse_end, scenario.hold_end), router=router, stack=stack,
              autoscaler=autoscaler)
    return fleet_log(run, run.run())


def fleet_capacity(log: FleetLog, capacities: list[float]) -> float:
    """The fleet's Ĉ: the sum of `capacities`, or with an autoscaler, of the
    replicas it starts with."""
    sc = log.scaling
    return sum(capacities[:sc.config.initial]) if sc is not None else sum(capacities)


def fleet_record(log: FleetLog, scenario: Scenario, capacities: list[float], inputs: dict) -> dict:
    """The fleet's record: the result record of the whole fleet (Ĉ the sum of
    `capacities`; with an autoscaler, of the replicas it starts with),
    `replicas` (each replica's result record at its own Ĉ), `fleet`
    (`fleet_measures`) and, with an autoscaler, `autoscaler`."""
    sc = log.scaling
    rec = measures.record(log.fleet, scenario, fleet_capacity(log, capacities), inputs)
    rec["replicas"] = [measures.record(rl, scenario, c, inputs) for rl, c in zip(log.replicas, capacities)]
    rec["fleet"] = measures.jsonable(fleet_measures(log))
    if sc is not None:
        burst = scenario.pulse_start if scenario.burst is not None else None
        rec["autoscaler"] = measures.jsonable(scaling_measures(sc, log.execution_replica, log.execution_placed,
                                                             log.fleet.end_time, burst))
    return rec


def run_fleet(profiles: list[Profile], condition: str | Condition, trace: Trace, scenario: Scenario,
              capacities: list[float], router: RouterConfig = RouterConfig(), seed: int = 0, pulse=None,
              max_batched_tokens: int | None = None, extra: dict | None = None, fast_forward: bool = True,
              stack: Stack | None = None, autoscaler: AutoscalerConfig | None = None) -> dict:
    """One fleet run of `condition` on `trace` (drawn at the fleet's Ĉ, the
    sum of `capacities`, one per replica), measured into the fleet's record.
    The inputs are those `sim.run.run_one` records, for the first replica's
    profile (`model`). With traffic classes the record has `classes` and the
    deployment's verdict as a single engine's (`sim.measures.with_classes`).
    `stack`: as `simulate_fleet`'s."""
    cond = condition if isinstance(condition, Condition) else get_condition(condition)
    log = simulate_fleet(profiles, trace, cond, scenario, router, seed, max_batched_tokens, fast_forward, stack,
                         autoscaler)
    rec = fleet_record(log, scenario, capacities,
                       run_inputs(profiles[0], cond, pulse, seed, max_batched_tokens, extra=extra))
    if cond.proxy.sheds:
        rec["shed"] = measures.shed(log.fleet)
    if scenario.classes and trace.klass is not None:    # per class, as a single engine's record (docs/classes.md)
        rec = measures.with_classes(rec, measures.class_records(log.fleet, scenario, fleet_capacity(log, capacities),
                                                                trace.klass))
    return rec


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
    a = rec.get("autoscaler")
    if a is not None:
        ups = ", ".join(f"{u['from']}->{u['to']} at {u['at']:.0f} s" for u in a["scale_ups"][:4]) or "none"
        firsts = [s["first_call_since_burst_s"] for s in a["started"] if s["first_call_since_burst_s"] is not None]
        lines.append(f"  autoscaler: {a['metric']} target {a['target']:g}, replicas {a['min_replicas']}..."
                     f"{a['max_replicas']}, provisioning {a['provisioning']} {a['provisioning_s']:g} s; scale-ups "
                     f"{ups}; at most {a['max_ready']} ready; replica-seconds {a['replica_seconds']:.0f}"
                     + (f"; first call on a new replica {min(firsts):.0f} s after the burst's start" if firsts
                        else ""))
    return "\n".join(lines)
