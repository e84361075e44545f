"""The advisor: which control settings bring service back after the burst,
and which of those serve the calls best.

Candidates (`candidates`): the named conditions and a grid over the client
(retries on/off), the proxy (cancellation off/now/deferred:W, coalescing, the
retry budget's share and order, the proxy cap N with its queue order and LIFO
threshold) and the engine cap Q; settings without effect are pruned (no
budget order without a budget and coalescing, no queue order without a proxy
cap, no deferral without coalescing, no budget or coalescing without
retries). Cap levels are fractions of ⌈deadline · Ĉ⌉, the queue a deadline's
worth of capacity drains. `only` keeps the grid to one layer (the others
off) and the named conditions that touch only that layer.

A fleet (replicas behind a router) adds the router's layer
(`router_settings`): every policy, the router's own retries on 503 (none or
one other replica) and where the proxy stands (one before the router, or a
sidecar before each replica). A setting whose router differs from the
scenario's is named `CONDITION;router=POLICY,router_retries=K,proxy=WHERE`.
The full search runs the control grid under the scenario's router and the
named conditions (and the scenario's own) under every router; after the
first screening round the best three control settings are crossed with
every router too. `only = "router"` keeps the scenario's controls and
searches the router alone; it needs a fleet. A fleet with an autoscaler
runs every setting under it, and the autoscaler is a layer too
(`autoscaler_settings`: the scenario's, and its metric's target halved and
doubled): the named conditions and the scenario's own run under each in
the first round, named `CONDITION;autoscaler=target:X`. Each setting's
mean replica-seconds (the fleet's cost) is given beside its delivery.

Search (successive halving; `stages`): every candidate runs on the first
seed; the best third of the distinct outcomes go on to the first `screen`
seeds, the best 2 x `finalists` of those are rerun in full on the same
seeds, and the `finalists` best of those run on all seeds. Screening runs
(every round before the full rerun) may simulate a shorter stretch
(`screen_cut`): the seed's calls from `screen_base_s` before the burst to
`screen_hold_s` after it, so a screening run costs a fraction of a full one
and replays the same burst calls. Settings with the same outcome on a
round's runs are one (the simplest stands for them); a round of full runs
ranks by recoveries, then the objective's mean; a round of screening runs
by the objective's mean alone (the slower recoveries cannot show in it, and
on the same calls the share served ranks settings as the whole run does).
The finalists' ranking, on all seeds
and the full horizon, puts first the candidates whose P(recovered) interval
lies above 1/2 (they restore service with high probability), then the rest
by P; within each group by the objective's mean over the seeds:
  timely     calls of the pulse and the hold delivered within the deadline
  delivered  calls of the pulse and the hold delivered at all
  burst      pulse calls delivered
The top settings shown skip one that adds settings to a setting ranked
above it for a like outcome (`pick`); each comes with its margin (one
engine only) and what it gives up against the best alternative
(`gives_up`). All runs of one seed share its trace (common random numbers).

Results are rows of one Parquet file (the sweep's atomic store; screening
rows carry the cut in `scenario_hash`): a rerun with the same file skips
the runs it holds; a file made for another deployment is refused.

[[layer]] tables (their effective settings, `layers`) stand above the
condition's proxy in every run, a client layer in the reference client's
place, and a client layer's keys join the client's layer
(`client_settings`): its per-attempt timeout (the layer's own, and half, one,
two and five deadlines), its retries (none, one, its own) and its backoff
(its own, or exponential from an eighth of a deadline capped at one). A
setting whose layers differ from the scenario's is named
`CONDITION;client=KEY=VALUE,...` (a layer's kind, then its changed keys).
A gateway layer's keys likewise (`gateway_settings`): its upstream timeout
(its own, and half, one, two and five deadlines), its retries (its own, none,
one) and whether it passes a client's disconnect on; with an upstream group
(`upstream_servers` over the fleet's replicas) its passive health: off, three
times the failures before a server goes out, a third and three times the
time out. `only = "client"`
crosses the client conditions (retries on, off) with every client setting;
`only = "gateway"` keeps the scenario's controls and tries every gateway
setting; the full search runs the control grid under the scenario's layers
and the named conditions (and the scenario's own) under every client and
every gateway setting.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from .. import verdict
from ..conditions import CONDITIONS, Condition, compose, engine_cap_for
from ..fleet import FleetSpec, run_fleet
from ..policy.router import PROXY_PLACEMENTS, ROUTERS, RouterConfig
from ..policy.stack import Stack
from ..profile import Profile
from ..scenario import Scenario
from ..workload import Trace, make_trace
from . import margin as margin_mod
from .sweep import ParquetStore, flatten, read_table, run_local, run_ray

OBJECTIVES = ("timely", "delivered", "burst")
LAYERS = ("client", "gateway", "proxy", "engine", "router")
RETRIES = (True, False)
CANCELS = ("off", "now", "deferred:10", "deferred:30")
BUDGETS = (0.0, 0.1, 0.2)
ORDERS = ("budget-first", "lookup-first")
CAP_FRACTIONS = (1 / 3, 1.0)          # of ⌈deadline · Ĉ⌉
QUEUES = (("fifo", None), ("deadline", None), ("lifo", 0), ("lifo", 0.5))   # (order, LIFO threshold / N)
ROUTER_RETRIES = (0, 1)
TIMEOUT_DEADLINES = (0.5, 1.0, 2.0, 5.0)  # a client layer's timeouts tried, in deadlines
CLIENT_RETRIES = (0, 1)               # a client layer's retries tried, besides its own
CROSSED = 3                           # control settings crossed with every router after the first round
BATCH = 4                             # runs per pool task

# ------------------------------------------------------------------ candidates
def _layers(c: Condition) -> set[str]:
    """The layers whose settings differ from no-control's."""
    base = CONDITIONS["no-control"]
    out = set()
    if c.retries != base.retries:
        out.add("client")
    if c.proxy != base.proxy:
        out.add("proxy")
    if c.engine_cap != base.engine_cap:
        out.add("engine")
    return out


def candidates(scenario: Scenario, capacity: float, only: str | None = None,
               adapt: Callable[[Condition], Condition] | None = None,
               base: Condition | None = None) -> list[Condition]:
    """The named conditions and the grid (see the module docstring), each
    passed through `adapt` (e.g. a named scenario's time scaling of the
    proxy's own times); unique names and settings (a named condition
    stands for the grid point with its settings). `base`, the deployment's own
    condition, joins them; with `only = "router"` the controls stay the
    deployment's: `base` (default no-control) alone."""
    if only is not None and only not in LAYERS:
        raise ValueError(f"--only must be one of {', '.join(LAYERS)}, got {only!r}")
    if only in ("router", "gateway"):
        c = base or CONDITIONS["no-control"]
        return [adapt(c) if adapt else c]
    full = engine_cap_for(capacity, scenario)
    caps = sorted({max(1, math.ceil(full * f)) for f in CAP_FRACTIONS})
    layer = {"client": only in (None, "client"), "proxy": only in (None, "proxy"), "engine": only in (None, "engine")}
    out: dict[str, Condition] = {}
    for c in CONDITIONS.values():
        if only is None or _layers(c) <= {only}:
            out[c.name] = c
    if base is not None and (only is None or _layers(base) <= {only}):
        out.setdefault(base.name, base)
    proxies: list[tuple[str, dict]] = []
    for cancel in CANCELS if layer["proxy"] else ("off",):
        for coalesce in (False, True) if layer["proxy"] else (False,):
            if cancel.startswith("deferred") and not coalesce:
                continue
            for budget in BUDGETS if layer["proxy"] else (0.0,):
                for order in ORDERS if budget and coalesce else (None,):
                    for cap in (0, *caps) if layer["proxy"] else (0,):
                        for queue, lifo in QUEUES if cap else ((None, None),):
                            tag = [f"cancel={cancel}"] + (["coalesce"] if coalesce else [])
                            tag += [f"budget={budget:g}"] if budget else []
                            tag += [order] if order else []
                            after = None if lifo is None else int(lifo * cap)
                            tag += [f"proxy-cap={cap}/{queue}"
                                    + (f"@{after}" if after is not None else "")] if cap else []
                            proxies.append((",".join(tag), dict(cancel=cancel, coalesce=coalesce, budget=budget,
                                                                order=order, proxy_cap=cap, queue=queue, after=after)))
    for retries in RETRIES if layer["client"] else (True,):
        for ptag, p in proxies:
            if not retries and (p["coalesce"] or p["budget"]):
                continue                               # nothing to coalesce or budget without retries
            for q in (0, *caps) if layer["engine"] else (0,):
                name = f"retries={'on' if retries else 'off'},{ptag}" + (f",engine-cap={q}" if q else "")
                c = compose("no-control", retries=retries, cancel=p["cancel"], coalesce=p["coalesce"],
                            budget=p["budget"], order=p["order"], proxy_cap=p["proxy_cap"], queue=p["queue"],
                            engine_cap=q, name=name)
                if p["after"] is not None:
                    c = replace(c, proxy=replace(c.proxy, lifo_after=p["after"]))
                out.setdefault(name, c)
    conds = [adapt(c) for c in out.values()] if adapt else list(out.values())
    same: dict[Condition, Condition] = {}
    for c in conds:                     # a grid point that is a named condition runs once, by that name
        same.setdefault(replace(c, name=""), c)
    return list(same.values())


def client_settings(client: dict, scenario: Scenario) -> list[dict]:
    """A client layer's keys the search tries (see the module docstring):
    the layer's own settings first, then each other combination of timeout,
    retries and backoff, as effective settings (a preset's keys)."""
    d = scenario.deadline_s
    own_t, own_r = client.get("timeout_s"), client.get("max_retries")
    timeouts = list(dict.fromkeys([own_t] + [f * d for f in TIMEOUT_DEADLINES]))
    retries = list(dict.fromkeys([own_r, *CLIENT_RETRIES])) if own_r is not None else [None]
    long_wait = {"backoff": "exponential", "backoff_base_s": d / 8, "backoff_cap_s": float(d)}
    backoffs = [{}] + ([long_wait] if any(client.get(k) != v for k, v in long_wait.items()) else [])
    out = [client]
    for t in timeouts:
        for r in retries:
            for b in backoffs:
                c = dict(client, timeout_s=t, max_retries=r, **b)
                if c not in out:
                    out.append(c)
    return out


def gateway_settings(gateway: dict, scenario: Scenario) -> list[dict]:
    """A gateway layer's keys the search tries (see the module docstring):
    the layer's own settings first, then each other combination of upstream
    timeout, retries and passing a disconnect on."""
    d = scenario.deadline_s
    timeouts = list(dict.fromkeys([gateway.get("timeout_s")] + [f * d for f in TIMEOUT_DEADLINES]))
    own_r = gateway.get("max_retries")
    retries = list(dict.fromkeys([own_r, *CLIENT_RETRIES])) if own_r is not None else [None]
    passes = list(dict.fromkeys([gateway["passes_disconnect"], not gateway["passes_disconnect"]])) \
        if "passes_disconnect" in gateway else [None]
    out = [gateway]
    for t in timeouts:
        for r in retries:
            for p in passes:
                g = dict(gateway, timeout_s=t, max_retries=r)
                if p is not None:
                    g["passes_disconnect"] = p
                if g not in out:
                    out.append(g)
    if gateway.get("upstream_servers", 1) > 1:      # an upstream group: its passive health too
        fails = gateway.get("fails_to_mark_down") or 0
        down = gateway.get("down_for_s") or 0.0
        for f, d in ((0, down), (max(1, fails) * 3, down), (fails, down / 3), (fails, down * 3)):
            g = dict(gateway, fails_to_mark_down=f, down_for_s=d)
            if g not in out:
                out.append(g)
    return out


KEYS_OF = {"client": client_settings, "gateway": gateway_settings}


def layer_settings(layers: tuple, scenario: Scenario, only: str | None = None) -> list[tuple]:
    """The [[layer]] settings the search tries: the scenario's first, then
    for each layer of a kind whose keys are searched (`only`'s kind, or
    every kind), each of its settings with the other layers as given."""
    out = [tuple(layers)]
    for i, s in enumerate(layers):
        if s["kind"] in KEYS_OF and only in (None, s["kind"]):
            for v in KEYS_OF[s["kind"]](s, scenario)[1:]:
                ls = tuple(layers[:i]) + (v,) + tuple(layers[i + 1:])
                if ls not in out:
                    out.append(ls)
    return out


def layer_changes(layers: tuple | None, own: tuple | None) -> dict:
    """{kind: {key: value}}: the keys of each layer of `layers` that differ
    from the same layer of `own`."""
    if layers is None or own is None:
        return {}
    out = {}
    for s, o in zip(layers, own):
        ch = {k: v for k, v in s.items() if o.get(k) != v}
        if ch:
            out.setdefault(s["kind"], {}).update(ch)
    return out


def _value(v) -> str:
    return "none" if v is None else f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def with_layers(c: Condition, layers: tuple | None, own: tuple | None) -> Condition:
    """`c` under [[layer]] settings: renamed `NAME;KIND=KEY=VALUE,...` unless they are the scenario's own."""
    ch = layer_changes(layers, own)
    return replace(c, name=c.name + "".join(f";{kind}=" + ",".join(f"{k}={_value(v)}" for k, v in keys.items())
                                            for kind, keys in ch.items())) if ch else c


def router_settings(fleet: FleetSpec) -> list[RouterConfig]:
    """The router's layer: the scenario's router first, then every policy
    with none or one retry on 503 and the proxy before the router or beside
    each replica (see the module docstring)."""
    own = fleet.router
    out = [own]
    for policy in ROUTERS:
        for k in ROUTER_RETRIES:
            for where in PROXY_PLACEMENTS:
                r = RouterConfig(policy, k, where)
                if r not in out:
                    out.append(r)
    return out


def autoscaler_settings(config) -> list:
    """The autoscaler's layer: the scenario's settings, then its metric's
    target halved and doubled (an earlier or a later scale-up)."""
    if config is None:
        return []
    return [config] + [replace(config, target=config.target * f) for f in (0.5, 2.0)]


def scaled(c: Condition, config, own) -> Condition:
    """`c` under the autoscaler `config`: renamed `NAME;autoscaler=target:X`
    unless it is the scenario's own."""
    if config is None or config == own:
        return c
    return replace(c, name=f"{c.name};autoscaler=target:{config.target:g}")


def first_settings(conds: Sequence[Condition], fleet: FleetSpec | None, only: str | None,
                   base: Condition | None = None) -> list[tuple[Condition, RouterConfig | None]]:
    """The settings of the first round as (controls, router): on one engine
    the conditions (router None); on a fleet the conditions under the
    scenario's router, and with no `only` the named conditions and `base`
    under every router too; with `only = "router"` the one condition (the
    deployment's) under every router."""
    if fleet is None:
        return [(c, None) for c in conds]
    if only == "router":
        return [(conds[0], r) for r in router_settings(fleet)]
    out = [(c, fleet.router) for c in conds]
    if only is None:
        firsts = [c for c in conds if c.name in CONDITIONS or (base is not None and c.name == base.name)]
        out += [(c, r) for c in firsts for r in router_settings(fleet)[1:]]
    return out


def routed(c: Condition, router: RouterConfig, own: RouterConfig) -> Condition:
    """`c` under `router`: renamed `NAME;router=...` unless it is the scenario's own."""
    if router == own:
        return c
    return replace(c, name=f"{c.name};router={router.policy},router_retries={router.retries},proxy={router.proxy}")


def describe_router(r: RouterConfig) -> str:
    return f"router {r.policy} (retries {r.retries}), proxy " + ("per deployment" if r.proxy == "deployment"
                                                                 else "per replica")


def _router_changes(r: RouterConfig | None, own: RouterConfig | None) -> int:
    if r is None or own is None:
        return 0
    return (r.policy != own.policy) + (r.retries != own.retries) + (r.proxy != own.proxy)


# ------------------------------------------------------------------ screening horizon
def screen_cut(scenario: Scenario, base_s: float | None, hold_s: float | None) -> tuple[float, float] | None:
    """(from, to): the stretch of the trace a screening run keeps, `base_s`
    before the burst to `hold_s` after it (None: either as in the scenario);
    None when that is the whole scenario or the scenario has engine faults
    (their times are the scenario's own). The cut keeps at least the
    primary cohort's first window."""
    if scenario.stalls:
        return None
    start = max(0.0, scenario.pulse_start - base_s) if base_s is not None else 0.0
    least = scenario.primary_skip_s + scenario.window_s
    end = min(scenario.hold_end, scenario.pulse_end + max(hold_s, least)) if hold_s is not None else scenario.hold_end
    if start <= 0.0 and end >= scenario.hold_end:
        return None
    return start, end


def default_cut(scenario: Scenario) -> tuple[float, float]:
    """The screening runs' default stretch (seconds before the burst, after
    it): half a deadline before, for the steady load to fill the engine;
    two recovery windows after, for the burst's backlog to show in the
    share of calls served."""
    return scenario.deadline_s / 2, 2 * scenario.window_s


def cut_scenario(scenario: Scenario, cut: tuple[float, float]) -> Scenario:
    """The scenario of a screening run: the arrivals from cut[0] to cut[1],
    shifted to start at 0 (phases clipped likewise)."""
    a, b = cut
    phases, burst, t = [], None, 0.0
    for i, p in enumerate(scenario.phases):
        lo, hi = max(t, a), min(t + p.duration_s, b)
        if hi > lo:
            if i == scenario.burst:
                burst = len(phases)
            phases.append(replace(p, duration_s=hi - lo))
        t += p.duration_s
    return scenario.with_(phases=tuple(phases), burst=burst)


def cut_trace(trace: Trace, cut: tuple[float, float]) -> Trace:
    """The calls of `trace` planned in [cut[0], cut[1]), times shifted by -cut[0]."""
    i, j = (int(x) for x in trace.arrival.searchsorted(cut, side="left"))

    def pick(v):
        return None if v is None else v[i:j]

    return Trace(arrival=trace.arrival[i:j] - cut[0], prompt_len=trace.prompt_len[i:j],
                 max_tokens=trace.max_tokens[i:j], shared_prefix=trace.shared_prefix,
                 prefix_len=pick(trace.prefix_len), prefix_group=pick(trace.prefix_group),
                 prompt_id=pick(trace.prompt_id))


def cut_tag(cut: tuple[float, float] | None) -> str:
    """What a screening row carries as its scenario_hash ('' for a full run)."""
    return "" if cut is None else f"advise-screen:{cut[0]:g}-{cut[1]:g}"


# ------------------------------------------------------------------ runs and storage
DROP = ("series_", "windows_")


def deployment_key(profile: Profile, scenario: Scenario, fleet: FleetSpec | None = None,
                   layers: tuple | None = None) -> str:
    """A digest of what the runs depend on besides the condition and seed."""
    d = {"profile": profile.raw or profile.name, "step_time": profile.step_time.to_dict(), "engine": profile.engine,
         "capacity": profile.capacity, "scenario": scenario.to_dict()}
    if layers is not None:
        d["layers"] = list(layers)
    if fleet is not None:
        d["fleet"] = {"replicas": [{"profile": p.raw or p.name, "step_time": p.step_time.to_dict(),
                                    "engine": p.engine} for p in fleet.profiles]}
        if fleet.autoscaler is not None:
            d["fleet"]["autoscaler"] = fleet.autoscaler.document()
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


_TRACES: dict = {}


def _trace(key: str, capacity: float, scenario: Scenario, seed: int, cut) -> Trace:
    """The seed's trace (cut for a screening run), kept per process: every
    setting of a seed replays the same calls."""
    k = (key, seed, cut)
    if k not in _TRACES:
        if len(_TRACES) >= 32:
            _TRACES.clear()
        tr = make_trace(capacity, scenario, seed)
        _TRACES[k] = tr if cut is None else cut_trace(tr, cut)
    return _TRACES[k]


def _rows_task(task: tuple) -> list[dict]:
    """A batch of runs: (profile, scenario, fleet (profiles, capacities,
    autoscaler) or None, deployment key, cut, [(condition, router, [[layer]]
    settings or None, seed[, autoscaler]), ...]) -> rows (an autoscaler's part
    as its replica-seconds, most replicas ready, and the first scale-up and
    the first call on a new replica from the burst's start)."""
    profile, scenario, fleet, key, cut, items = task
    sc = scenario if cut is None else cut_scenario(scenario, cut)
    out = []
    for cond, router, layers, seed, *scaler in items:
        tr = _trace(key, profile.capacity, scenario, seed, cut)
        if fleet is None:
            rec = verdict.run_record(profile, sc, cond, seed, tr, layers=layers)
        else:
            stack = None if layers is None else Stack.under_layers(cond, layers, sc, router)
            rec = run_fleet(list(fleet[0]), cond, tr, sc, fleet[1], router, seed, scenario.pulse, stack=stack,
                            autoscaler=scaler[0] if scaler else fleet[2] if len(fleet) > 2 else None)
            rec.pop("replicas")
            a = rec.pop("autoscaler", None)
            if a is not None:
                firsts = [x["first_call_since_burst_s"] for x in a["started"]
                          if x["first_call_since_burst_s"] is not None]
                rec["autoscaler"] = {"replica_seconds": a["replica_seconds"], "max_ready": a["max_ready"],
                                     "first_scale_up_s": a["scale_ups"][0]["since_burst_s"] if a["scale_ups"]
                                     else None, "first_new_call_s": min(firsts) if firsts else None}
        row = {k: v for k, v in flatten(rec).items() if not k.startswith(DROP)}
        row["deployment"] = key
        if cut is not None:
            row["scenario_hash"] = cut_tag(cut)
        out.append(row)
    return out


class Runs:
    """The advisor's runs of one deployment by (setting, seed, cut tag):
    those an `out` Parquet store holds (the sweep's atomic store, read back
    so that a rerun on it runs none of them again; a store made for another
    deployment is refused) and those run here, added to it as they finish.
    `key` is the deployment's (`deployment_key`); runs go to `workers`
    local processes (None: one per CPU) or a Ray cluster at `ray_address`,
    with a progress bar on stderr unless `progress` is off."""

    def __init__(self, profile: Profile, scenario: Scenario, fleet: FleetSpec | None, key: str,
                 out: str | None = None, workers: int | None = 1, ray_address: str | None = None,
                 progress: bool = True):
        fleet_task = None if fleet is None else (tuple(fleet.profiles), fleet.capacities(scenario), fleet.autoscaler)
        self.head = (profile, scenario, fleet_task, key)
        self.workers, self.ray_address, self.progress = workers, ray_address, progress
        self.rows: dict[tuple[str, int, str], dict] = {}
        self.store = None
        if out:
            t = read_table(out)
            if t is not None and t.num_rows:
                have = set(t.column("deployment").to_pylist()) if "deployment" in t.column_names else {None}
                if have != {key}:
                    raise ValueError(f"{out} holds runs of another deployment (profile, scenario); give another --out")
            self.store = ParquetStore(out)
            for r in ([] if t is None else t.to_pylist()):
                self.rows[(r["condition"], int(r["seed"]), r.get("scenario_hash") or "")] = r

    def __getitem__(self, k: tuple[str, int, str]) -> dict:
        return self.rows[k]

    def run(self, names: Sequence[str], seeds: Sequence[int], item: Callable[[str, int], tuple], cut,
            stage: str) -> None:
        """Run each (name, seed) not held yet, on the trace cut to `cut`
        (None: whole runs); `item(name, seed)` gives its part of a task:
        (condition, router, [[layer]] settings, seed[, autoscaler])."""
        tag = cut_tag(cut)
        todo = [(n, s) for s in seeds for n in names if (n, s, tag) not in self.rows]
        if not todo:
            return
        tasks = [(*self.head, cut, [item(n, s) for n, s in todo[i:i + BATCH]]) for i in range(0, len(todo), BATCH)]
        it = run_ray(tasks, self.ray_address, fn=_rows_task) if self.ray_address is not None else \
            run_local(tasks, self.workers if self.workers else (os.cpu_count() or 1), fn=_rows_task)
        t1 = shown = time.perf_counter()
        i = 0
        try:
            for batch in it:
                for r in batch:
                    i += 1
                    self._keep(r, tag)
                if self.progress and (time.perf_counter() - shown >= 1.0 or i == len(todo)):
                    shown = time.perf_counter()
                    _show(stage, i, len(todo), shown - t1)
        finally:
            if self.store is not None:
                self.store.flush()

    def _keep(self, r: dict, tag: str) -> None:
        self.rows[(r["condition"], int(r["seed"]), tag)] = r
        if self.store is not None:
            self.store.add(r)
            if self.store.due():
                self.store.flush()


def _show(stage: str, i: int, n: int, elapsed: float) -> None:
    """The progress bar: i of n runs done after `elapsed` seconds."""
    end = "\n" if i == n or not sys.stderr.isatty() else ""
    print(f"\r{stage} [{'#' * (30 * i // n):<30}] {i}/{n} runs, {elapsed:.0f} s, eta {elapsed / i * (n - i):.0f} s",
          end=end, file=sys.stderr, flush=True)


def objective(r: dict, name: str) -> float | None:
    """The objective's share for one row (flat record)."""
    if name == "burst":
        return r["pulse_delivered"] / r["pulse_offered"] if r["pulse_offered"] else None
    k = "within_deadline" if name == "timely" else "delivered"
    off = r["pulse_offered"] + r["hold_offered"]
    return (r[f"pulse_{k}"] + r[f"hold_{k}"]) / off if off else None


def _mean(v: Iterable) -> float | None:
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def score(rows: Sequence[dict], obj: str) -> dict:
    """A candidate over its rows: the verdict summary plus the objectives' means."""
    s = verdict.summarize(rows)
    for o in OBJECTIVES:
        s[o] = _mean(objective(r, o) for r in rows)
    if rows and "autoscaler_replica_seconds" in rows[0]:
        s["replica_seconds"] = _mean(r["autoscaler_replica_seconds"] for r in rows)
    return s


def _rank_key(s: dict, obj: str) -> tuple:
    high = s["lo"] > 0.5
    return (not high, -s["p"] if not high else 0.0, -(s[obj] if s[obj] is not None else -1.0))


def stages(n_seeds: int, screen: int, finalists: int, cut) -> list[tuple[int, bool, int | None]]:
    """The rounds of the search as (seeds, full horizon, how many go on:
    None for the third of the round's distinct outcomes, at least 2 x
    `finalists`): the first seed, the first `screen`, those again in full
    (when screening runs are cut), and all seeds for the `finalists`."""
    screen = max(1, min(screen, n_seeds))
    out = [(1, cut is None, None)]
    if screen > 1:
        out.append((screen, cut is None, 2 * finalists))
    if cut is not None:
        out.append((screen, True, 2 * finalists))
    out[-1] = (out[-1][0], out[-1][1], finalists)
    out.append((n_seeds, True, 0))
    return out


def advise(profile: Profile, scenario: Scenario, seeds: Sequence[int], objective_name: str = "timely",
           only: str | None = None, out: str | None = None, adapt: Callable[[Condition], Condition] | None = None,
           screen: int = 2, finalists: int = 12, top: int = 3, workers: int | None = 1,
           ray_address: str | None = None, margin_axes: Sequence[str] = ("speed",), progress: bool = True,
           fleet: FleetSpec | None = None, base: Condition | None = None,
           screen_base_s: float | None = None, screen_hold_s: float | None = None,
           layers: tuple | None = None) -> dict:
    """Search the controls for the deployment (profile, scenario; with
    `fleet`, its replicas behind a router, Ĉ the profile's); see the module
    docstring. `base` is the deployment's own condition (`only = "router"`
    keeps it). Screening runs are cut to `screen_base_s` before the burst and
    `screen_hold_s` after it (`screen_cut`; both None: whole runs). Returns
    {"ranking": [...], "top": [...], ...} with, for each of the top
    settings, its summary, margin (along `margin_axes`)
    and what it gives up against the best alternative. `layers`, [[layer]]
    tables' effective settings, stand above the condition's proxy (a client
    layer's keys searched as the module docstring says)."""
    if objective_name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective_name!r}")
    if only == "router" and fleet is None:
        raise ValueError("--only router searches a fleet's router: the scenario has one engine (give a scenario "
                         "with a [fleet] section, or --only client|proxy|engine)")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("advise needs at least one seed")
    for x, what in ((screen_base_s, "screen_base_s"), (screen_hold_s, "screen_hold_s")):
        if x is not None and not x > 0:
            raise ValueError(f"{what} must be positive, got {x!r}")
    t0 = time.perf_counter()
    key = deployment_key(profile, scenario, fleet, layers)
    own = fleet.router if fleet is not None else None
    conds = candidates(scenario, profile.capacity, only, adapt, base)
    by_name: dict[str, Condition] = {}
    routers: dict[str, RouterConfig | None] = {}
    own_scaler = fleet.autoscaler if fleet is not None else None
    scalers: dict[str, object] = {}
    stacks: dict[str, tuple | None] = {}

    def add(c: Condition, r: RouterConfig | None, ls: tuple | None = layers, a=None) -> str:
        c = routed(c, r, own) if r is not None else c
        c = with_layers(c, ls, layers)
        a = a if a is not None else own_scaler
        c = scaled(c, a, own_scaler)
        if c.name not in by_name:
            by_name[c.name], routers[c.name], stacks[c.name], scalers[c.name] = c, r, ls, a
        return c.name

    firsts = first_settings(conds, fleet, only, base)
    names = list(dict.fromkeys(add(c, r) for c, r in firsts))
    if own_scaler is not None and only in (None, "router"):
        named = [c for c in conds if c.name in CONDITIONS or (base is not None and c.name == base.name)]
        names += [n for n in dict.fromkeys(add(c, fleet.router, a=a) for c in named
                                           for a in autoscaler_settings(own_scaler)[1:]) if n not in names]
    if only == "gateway" and not any(s["kind"] == "gateway" for s in layers or ()):
        raise ValueError("--only gateway searches a gateway [[layer]]'s keys, and the scenario has none")
    if layers is not None and only in (None, "client", "gateway"):
        crossed = [(c, r) for c, r in firsts if only is not None or c.name in CONDITIONS
                   or (base is not None and c.name == base.name)]
        names += [n for n in dict.fromkeys(add(c, r, ls) for c, r in crossed        # r: a fleet's router, else None
                                           for ls in layer_settings(layers, scenario, only)[1:]) if n not in names]
    n_cands = len(names)
    cut = screen_cut(scenario, screen_base_s, screen_hold_s)
    runs = Runs(profile, scenario, fleet, key, out, workers, ray_address, progress)
    rows = runs.rows

    def run(names: Sequence[str], ss: Sequence[int], c, stage: str) -> None:
        runs.run(names, ss, lambda n, s: (by_name[n], routers[n], stacks[n], s, scalers[n]), c, stage)

    def size(n):
        return (len(by_name[n].describe().split(", ")) + _router_changes(routers[n], own)
                + sum(map(len, layer_changes(stacks[n], layers).values())) + (scalers[n] != own_scaler))

    plan = stages(len(seeds), screen, finalists, cut)
    rounds = []
    for k, (n_s, full, keep) in enumerate(plan):
        ss, c = seeds[:n_s], (None if full else cut)
        label = "final" if keep == 0 else ("screen" if not full else "rerun in full")
        run(names, ss, c, f"{label} {len(names)} settings x {len(ss)} seeds" + ("" if full else " (cut)"))
        tag = cut_tag(c)
        if keep == 0:
            break
        if k == 0 and fleet is not None and only is None:     # the best controls under every router
            best = _order(distinct(names, by_name, [[rows[(n, s, tag)] for s in ss] for n in names], size),
                          rows, ss, tag, objective_name)
            crossed = [n for n in best if routers[n] == own and scalers[n] == own_scaler][:CROSSED]
            more = [add(by_name[n], r) for n in crossed for r in router_settings(fleet)[1:]]
            more = [n for n in dict.fromkeys(more) if n not in names]
            run(more, ss, c, f"{label} {len(more)} settings x {len(ss)} seeds (best controls x routers)"
                + ("" if full else " (cut)"))
            names += more
            n_cands += len(more)
        names = distinct(names, by_name, [[rows[(n, s, tag)] for s in ss] for n in names], size)
        ranked = _order(names, rows, ss, tag, objective_name)
        go_on = max(2 * finalists, math.ceil(len(ranked) / 3)) if keep is None else keep
        rounds.append({"seeds": n_s, "full": full, "settings": len(names), "kept": min(go_on, len(ranked))})
        names = ranked[:max(top, go_on)]
    final = names
    scored = {n: score([rows[(n, s, "")] for s in seeds], objective_name) for n in final}
    ranking = sorted(final, key=lambda n: _rank_key(scored[n], objective_name))
    shown = pick(ranking, scored, by_name, top, size)
    margins = {n: margin_mod.margin(profile, scenario, by_name[n], seeds, margin_axes, rel_tol=0.05, workers=workers,
                                    base=verdict.summarize([rows[(n, s, "")] for s in seeds]),
                                    fleet=None if fleet is None else dataclasses.replace(fleet, router=routers[n],
                                                                                         autoscaler=scalers[n]),
                                    layers=stacks[n])
               if margin_axes else None for n in shown}
    tops = []
    for i, n in enumerate(shown):
        alt = shown[1] if i == 0 and len(shown) > 1 else shown[0]
        m = margins[n]
        tops.append({"rank": i + 1, "condition": n, "settings": by_name[n].settings(),
                     "router": None if routers[n] is None else vars(routers[n]).copy(),
                     "autoscaler": None if scalers[n] is None else scalers[n].document(),
                     "layers": layer_changes(stacks[n], layers) if layers is not None else None,
                     "describe": describe(n, by_name, routers, scalers, stacks, layers), "summary": scored[n],
                     "verdict": verdict.verdict(scored[n]),
                     "margin": None if m is None else {"sentence": m["sentence"], "axes": m["axes"]},
                     "against": alt if alt != n else None,
                     "gives_up": gives_up(scored[n], scored[alt], m, margins[alt]) if alt != n else []})
    res = {"model": profile.name, "scenario": scenario.to_dict(), "deployment": key, "objective": objective_name,
           "only": only, "seeds": seeds, "screen_seeds": seeds[:max(1, min(screen, len(seeds)))],
           "screen_cut": list(cut) if cut else None, "margin_axes": list(margin_axes or ()), "rounds": rounds,
           "candidates": n_cands, "layers": None if layers is None else list(layers),
           "ranking": [{"condition": n, **{k: scored[n][k] for k in ("p", "lo", "hi", "tipping", *OBJECTIVES,
                                                                    "replica_seconds") if k in scored[n]}}
                       for n in ranking],
           "top": tops, "wall_s": time.perf_counter() - t0}
    if fleet is not None:
        res["router"] = router_note(fleet.router, shown, scored, by_name, routers, objective_name)
        if fleet.autoscaler is not None:
            res["autoscaler"] = fleet.autoscaler.document()
    return res


def _order(names: Sequence[str], rows: dict, ss: Sequence[int], tag: str, obj: str) -> list[str]:
    """A round's order: the objective's mean over its seeds, after the
    recoveries where the runs are full ones (a screening run ends before
    the slower recoveries could show; on the same calls, the share it
    serves ranks the settings as the whole run does)."""
    sc = {n: score([rows[(n, s, tag)] for s in ss], obj) for n in names}
    full = tag == ""
    return sorted(names, key=lambda n: (-sc[n]["recovered"] if full else 0, -(sc[n][obj] or 0.0)))


def describe(n: str, by_name: dict, routers: dict, scalers: dict | None = None, stacks: dict | None = None,
             own: tuple | None = None) -> str:
    """A setting's controls in words, with its router on a fleet, its
    autoscaler's target where it has one, and its layers' keys that differ
    from the scenario's (`own`)."""
    r = routers.get(n)
    a = (scalers or {}).get(n)
    ch = layer_changes((stacks or {}).get(n), own)
    return (by_name[n].describe() + ("" if r is None else ", " + describe_router(r))
            + ("" if a is None else f", autoscaler target {a.target:g}")
            + "".join(f", {kind} layer " + ", ".join(f"{k} {_value(v)}" for k, v in keys.items())
                      for kind, keys in ch.items()))


def router_note(own: RouterConfig, shown: Sequence[str], scored: dict, by_name: dict, routers: dict,
                obj: str) -> dict:
    """Which router the best setting takes and whether it matters: the
    finalists with the best setting's controls under another router, each
    with its P(recovered) and objective."""
    best = shown[0]
    controls = by_name[best].settings()
    others = [n for n in scored if n != best and by_name[n].settings() == controls]
    r = routers[best]
    return {"chosen": vars(r).copy(), "scenario": vars(own).copy(), "changed": r != own,
            "alternatives": [{"router": vars(routers[n]).copy(), "p": scored[n]["p"], obj: scored[n][obj]}
                             for n in others]}


SIGNATURE = ("recovered", "recovery_time_s", "pulse_delivered", "pulse_within_deadline", "hold_delivered",
             "hold_within_deadline", "primary_delivered", "primary_within_deadline")


def _describe_size(by_name: dict) -> Callable[[str], int]:
    return lambda n: len(by_name[n].describe().split(", "))


def distinct(names: Sequence[str], by_name: dict, rows: Sequence[Sequence[dict]],
             size: Callable[[str], int] | None = None) -> list[str]:
    """One name per outcome: settings whose runs agree on every SIGNATURE
    measure stand as one, the one with the fewest settings changed (`size`;
    default the conditions' settings; a named condition on a tie) —
    first-seen order kept."""
    size = size or _describe_size(by_name)
    groups: dict[tuple, list[str]] = {}
    for n, rs in zip(names, rows):
        groups.setdefault(tuple(tuple(r[k] for k in SIGNATURE) for r in rs), []).append(n)
    keep = {min(g, key=lambda n: (size(n), n not in CONDITIONS)) for g in groups.values()}
    return [n for n in names if n in keep]


def _alike(a: dict, b: dict) -> bool:
    """The same P(recovered) and every objective within half a point."""
    return a["p"] == b["p"] and all(a[o] is not None and b[o] is not None and abs(a[o] - b[o]) <= 0.005
                                    for o in OBJECTIVES)


def pick(ranking: Sequence[str], scored: dict, by_name: dict, top: int,
         size: Callable[[str], int] | None = None) -> list[str]:
    """The first `top` of the ranking, skipping a setting that changes more
    (`size`, as in `distinct`) than one ranked above it and does alike (it
    adds settings for nothing)."""
    out: list[str] = []
    size = size or _describe_size(by_name)
    for n in ranking:
        if not any(_alike(scored[n], scored[m]) and size(n) > size(m) for m in out):
            out.append(n)
        if len(out) == top:
            break
    return out


def gives_up(s: dict, alt: dict, margin: dict | None = None, alt_margin: dict | None = None) -> list[str]:
    """Where s is worse than alt: P(recovered), the objectives (by more than
    half a point), the median recovery time (by more than a second), and the
    distance to a margin's crossing (by more than 2%) on the axes both have
    and search from the same value."""
    out = []
    if s["p"] < alt["p"]:
        out.append(f"P(recovered) {s['p']:.2f} vs {alt['p']:.2f}")
    for o, what in (("timely", "calls within deadline"), ("delivered", "calls delivered"),
                    ("burst", "pulse calls delivered")):
        if s[o] is not None and alt[o] is not None and alt[o] - s[o] > 0.005:
            out.append(f"{what} {100 * s[o]:.1f}% vs {100 * alt[o]:.1f}%")
    a, b = s["recovery_time"]["median"], alt["recovery_time"]["median"]
    if a is not None and b is not None and a - b > 1.0:
        out.append(f"recovery {a:.0f} s vs {b:.0f} s")
    if margin and alt_margin:
        theirs = {x["axis"]: x for x in alt_margin["axes"]}
        for x in margin["axes"]:
            y = theirs.get(x["axis"])
            if y is None or x["crossing"] is None or y["crossing"] is None or not x["recovers_at_baseline"] \
                    or not y["recovers_at_baseline"] or x["baseline"] != y["baseline"]:
                continue                # (a client layer's key: each setting searched from its own value)
            dx, dy = abs(math.log(x["crossing"] / x["baseline"])), abs(math.log(y["crossing"] / y["baseline"]))
            if dy - dx > math.log(1.02):
                out.append(f"margin on {x['axis']}: flips at {x['crossing']:.3g} vs {y['crossing']:.3g} "
                           f"(now {x['baseline']:g})")
    return out


def report(res: dict) -> str:
    """The top settings in words."""
    cut = res.get("screen_cut")
    steps = [f"{r['settings']} distinct on {r['seeds']} seed(s)" + ("" if r["full"] else " (screening runs)")
             for r in res.get("rounds", [])]
    lines = [f"{res['model']}: {res['candidates']} settings; " + ", ".join(steps)
             + f"; {len(res['ranking'])} finalists on {len(res['seeds'])}; objective: {res['objective']}"]
    if cut:
        lines.append(f"(screening runs simulate {cut[0]:g}-{cut[1]:g} s of the scenario's arrivals; the finalists "
                     "the whole scenario)")
    note = res.get("router")
    if note:
        r, own = note["chosen"], note["scenario"]
        head = (f"router: {r['policy']} (retries {r['retries']}, proxy per {r['proxy']})"
                + (f" instead of the scenario's {own['policy']} (retries {own['retries']}, proxy per {own['proxy']})"
                   if note["changed"] else ", the scenario's own"))
        alts = [f"{a['router']['policy']}/{a['router']['retries']}/{a['router']['proxy']}: P {a['p']:.2f}, "
                f"{res['objective']} {100 * (a[res['objective']] or 0):.1f}%" for a in note["alternatives"]]
        lines.append(head + ("; the same controls under " + "; ".join(alts) if alts else ""))
    a = res.get("autoscaler")
    if a:
        lines.append(f"autoscaler (the scenario's): {a['metric']} target {a['target']:g}, replicas "
                     f"{a['min_replicas']}..{a['max_replicas']}, sync {a['sync_period_s']:g} s, provisioning "
                     f"{a['provisioning']} {a['provisioning_s']:g} s, drain {a['drain']}")
    for t in res["top"]:
        s = t["summary"]
        lines.append(f"{t['rank']}. {t['condition']}")
        lines.append(f"   {t['describe']}")
        lines.append(f"   {t['verdict']}; within deadline {100 * (s['timely'] or 0):.1f}%, delivered "
                     f"{100 * (s['delivered'] or 0):.1f}%, pulse delivered {100 * (s['burst'] or 0):.1f}%"
                     + (f"; replica-seconds {s['replica_seconds']:.0f}" if s.get("replica_seconds") is not None
                        else ""))
        if t["margin"]:
            lines.append(f"   margin: {t['margin']['sentence'].split('; ', 1)[-1]}")
        if t["against"]:
            gu = "; ".join(t["gives_up"]) or "nothing"
            lines.append(f"   gives up against {t['against']}: {gu}")
    return "\n".join(lines)
