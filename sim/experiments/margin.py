"""The robustness margin: how far a deployment is from the point where its
recovery verdict flips. Along each axis — engine speed (every step-time
coefficient x s), burst size (the pulse rate x m), load after the burst
(hold_load) and KV capacity (num_gpu_blocks x f), and for a fleet with an
autoscaler its provisioning delay (seconds until a new replica is ready)
and its metric's target — P(recovered) over a fixed set of seeds is probed
and the value where it crosses 1/2 is found by bisection.

Common random numbers: every probe runs the same seeds. On the speed and kv
axes the traces are identical at every probe (drawn at the unperturbed
profile's capacity). On the pulse and hold_load axes the trace depends on the
probed value, so a seed gives the same random stream but not the same calls.

Search (`find_crossing`): from the baseline x0, the side of 1/2 there
(P >= 1/2: recovers) decides the direction — towards the worse end when it
recovers, the better end when it does not; x is stepped geometrically (x
ratio) until the side flips or the axis's limit is reached, then the bracket is
halved geometrically until its ends are within `rel_tol` of each other. The
crossing is where P, interpolated linearly between the bracket's ends, equals
1/2; the bracket is the last pair of probes on either side.

A [[layer]]'s key is an axis too (`layer.KIND.KEY`, `LAYER_AXES`: a client
layer's timeout_s, max_retries and backoff_base_s) on a deployment with such
a layer: the key's value itself is probed, from the layer's own, the
direction its recovery takes decided as above; a whole-number key
(max_retries) is stepped and halved on whole numbers, and the bracket's ends
are then one apart.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .. import verdict
from ..conditions import Condition
from ..fleet import FleetSpec, run_fleet
from ..policy.stack import Stack
from ..profile import Profile
from ..scenario import Scenario
from ..workload import make_trace
from .sweep import run_local

AXES = ("speed", "pulse", "hold_load", "kv")
SCALING_AXES = ("provisioning", "target")     # a fleet with an [autoscaler] only


# ------------------------------------------------------------------ bisection
def find_crossing(p: Callable[[float], float], x0: float, worse: float, better: float, ratio: float = 2.0,
                  rel_tol: float = 0.02, max_probes: int = 24, integer: bool = False) -> dict:
    """Where the monotone-ish p(x) crosses 1/2, searching from x0 (> 0)
    towards `worse` if p(x0) >= 1/2, else towards `better` (both > 0).
    With `integer`, x takes whole numbers (x0, worse, better >= 0): each
    step goes at least one further, and the bracket is halved until its
    ends are one apart.

    Returns {"side0": p(x0) >= 1/2, "crossing": x or None, "bracket": [a, b]
    (a nearer x0) or None, "probes": [(x, p(x)), ...] in probe order,
    "limit": the end searched}. `crossing` is None when p keeps its side up to
    the limit or the probe budget ran out before a flip."""
    if integer:
        if not (min(x0, worse, better) >= 0 and ratio > 1 and all(v == int(v) for v in (x0, worse, better))):
            raise ValueError("find_crossing on whole numbers needs whole x0, worse, better >= 0 and ratio > 1")
    elif not (x0 > 0 and worse > 0 and better > 0 and ratio > 1 and rel_tol > 0):
        raise ValueError("find_crossing needs positive x0, worse, better, rel_tol and ratio > 1")
    probes: list[tuple[float, float]] = []

    def probe(x: float) -> bool:
        v = float(p(x))
        probes.append((x, v))
        return v >= 0.5

    side0 = probe(x0)
    limit = worse if side0 else better
    up = limit > x0
    a, b = x0, None
    x = x0
    while len(probes) < max_probes and x != limit:
        if integer:
            x = min(max(x + 1, math.ceil(x * ratio)), limit) if up else max(min(x - 1, math.floor(x / ratio)), limit)
        else:
            x = min(x * ratio, limit) if up else max(x / ratio, limit)
        if probe(x) != side0:
            b = x
            break
        a = x
    if b is None:
        return {"side0": side0, "crossing": None, "bracket": None, "probes": probes, "limit": limit}
    while len(probes) < max_probes and (abs(b - a) > 1 if integer else abs(b / a - 1) > rel_tol):
        m = (a + b) // 2 if integer else math.sqrt(a * b)
        if probe(m) == side0:
            a = m
        else:
            b = m
    pa = next(v for x, v in reversed(probes) if x == a)
    pb = next(v for x, v in reversed(probes) if x == b)
    cross = a + (0.5 - pa) / (pb - pa) * (b - a) if pb != pa else (a + b) / 2 if integer else math.sqrt(a * b)
    return {"side0": side0, "crossing": cross, "bracket": [a, b], "probes": probes, "limit": limit}


# ------------------------------------------------------------------ axes
@dataclass(frozen=True)
class Axis:
    name: str
    worse_up: bool          # larger values make recovery harder
    lo: float               # the smallest value searched
    hi: float               # the largest value searched
    what: str

    integer = False

    def baseline(self, scenario: Scenario, fleet: FleetSpec | None = None, layers: tuple | None = None) -> float:
        """The value at the deployment as it is (the scaling axes: its
        fleet's autoscaler's; the others: the scenario's or 1)."""
        if self.name in SCALING_AXES:
            a = fleet.autoscaler
            return a.provisioning_s if self.name == "provisioning" else a.target
        return scenario.hold_load if self.name == "hold_load" else 1.0

    def limits(self, layers: tuple | None, x0: float) -> tuple[float, float]:
        return self.lo, self.hi

    def layers_at(self, layers: tuple | None, x: float) -> tuple | None:
        """The [[layer]] settings at x (this axis leaves them)."""
        return layers

    def scaler(self, config, x: float):
        """The autoscaler's settings at x (as they are off its axes): on the
        provisioning axis the delay (a uniform one's ends both scaled to
        keep their ratio), on the target axis the metric's target."""
        if config is None or self.name not in SCALING_AXES:
            return config
        if self.name == "target":
            return replace(config, target=x)
        hi = config.provisioning_max_s
        if hi is not None and config.provisioning_s > 0:
            hi = hi * x / config.provisioning_s
        return replace(config, provisioning_s=x, provisioning_max_s=hi)

    def apply(self, profile: Profile, scenario: Scenario, x: float) -> tuple[Profile, Scenario]:
        """The profile and scenario at x."""
        if self.name in SCALING_AXES:
            return profile, scenario
        if self.name == "speed":
            return verdict.perturbed(profile, speed=x), scenario
        if self.name == "kv":
            return verdict.perturbed(profile, kv=x), scenario
        if self.name == "pulse":
            return profile, scenario.with_(pulse=scenario.pulse * x)
        return profile, scenario.with_(hold_load=x)

    def phrase(self, x: float, a: float, b: float, base: float) -> str:
        """The change that moves the deployment to x, in words, with the bracket."""
        lo, hi = sorted((a, b))
        if self.name == "speed":
            if x >= 1:
                return f"the engine is {100 * (x - 1):.0f}% slower ({100 * (lo - 1):.0f}-{100 * (hi - 1):.0f}%)"
            return f"the engine is {100 * (1 - x):.0f}% faster ({100 * (1 - hi):.0f}-{100 * (1 - lo):.0f}%)"
        if self.name == "pulse":
            return f"the burst is {x:.2f}x its size ({lo:.2f}-{hi:.2f}x)"
        if self.name == "hold_load":
            return f"the load after the burst is {x:.2f} x C ({lo:.2f}-{hi:.2f}; now {base:.2f})"
        if self.name == "provisioning":
            return f"a new replica's provisioning delay is {x:.0f} s ({lo:.0f}-{hi:.0f} s; now {base:.0f} s)"
        if self.name == "target":
            return f"the autoscaler's target is {x:.3g} ({lo:.3g}-{hi:.3g}; now {base:.3g})"
        if x <= 1:
            return f"the KV cache is {100 * (1 - x):.0f}% smaller ({100 * (1 - hi):.0f}-{100 * (1 - lo):.0f}%)"
        return f"the KV cache is {x:.2f}x larger ({lo:.2f}-{hi:.2f}x)"


@dataclass(frozen=True)
class LayerAxis:
    """A key of the first [[layer]] of a kind as an axis
    (`layer.KIND.KEY`): its value is probed, from the layer's own."""
    kind: str
    key: str
    worse_up: bool
    lo: float
    hi: float
    integer: bool
    what: str

    @property
    def name(self) -> str:
        return f"layer.{self.kind}.{self.key}"

    def index(self, layers: tuple | None) -> int:
        """Where the layer stands in `layers` (ValueError: it is not there)."""
        i = next((i for i, s in enumerate(layers or ()) if s["kind"] == self.kind), None)
        if i is None:
            raise ValueError(f"{self.name} needs a {self.kind} [[layer]] in the scenario (the reference design has "
                             "none)")
        return i

    def baseline(self, scenario: Scenario, fleet: FleetSpec | None = None, layers: tuple | None = None) -> float:
        if self.key in GROUP_KEYS and layers[self.index(layers)].get("upstream_servers", 1) <= 1:
            raise ValueError(f"{self.name}: the {self.kind} layer has one upstream server and marks none down; "
                             "give it upstream_servers over a [fleet]'s replicas (an upstream group)")
        v = layers[self.index(layers)].get(self.key)
        if v is None:
            raise ValueError(f"{self.name}: the {self.kind} layer sets no {self.key} (no limit): give it one in the "
                             "scenario's [[layer]] to search from")
        if not self.integer and not v > 0:
            raise ValueError(f"{self.name}: the {self.kind} layer's {self.key} is {v:g}; a search needs it positive")
        return v

    def limits(self, layers: tuple | None, x0: float) -> tuple[float, float]:
        """The values searched: the axis's range, widened to take the layer's
        own; a first backoff no longer than the layer's backoff cap."""
        lo, hi = min(self.lo, x0), max(self.hi, x0)
        cap = layers[self.index(layers)].get("backoff_cap_s")
        if self.key == "backoff_base_s" and cap is not None:
            hi = max(x0, min(hi, cap))
        return lo, hi

    def apply(self, profile: Profile, scenario: Scenario, x: float) -> tuple[Profile, Scenario]:
        return profile, scenario

    def scaler(self, config, x: float):
        """The autoscaler's settings at x (this axis leaves them)."""
        return config

    def layers_at(self, layers: tuple | None, x: float) -> tuple | None:
        i = self.index(layers)
        return layers[:i] + (dict(layers[i], **{self.key: int(x) if self.integer else float(x)}),) + layers[i + 1:]

    def phrase(self, x: float, a: float, b: float, base: float) -> str:
        lo, hi = sorted((a, b))
        if self.integer:
            return f"the {self.kind}'s {self.key} goes from {a:g} to {b:g} (now {base:g})"
        return f"the {self.kind}'s {self.key} is {x:.3g} s ({lo:.3g}-{hi:.3g} s; now {base:g} s)"


LAYER_AXES = {(a.kind, a.key): a for a in [
    LayerAxis("client", "timeout_s", False, 0.5, 7200.0, False, "the client layer's per-attempt timeout in s"),
    LayerAxis("client", "max_retries", True, 0, 32, True, "the client layer's retries per call"),
    LayerAxis("client", "backoff_base_s", False, 0.01, 600.0, False, "the client layer's first backoff wait in s"),
    LayerAxis("gateway", "timeout_s", False, 0.5, 7200.0, False, "the gateway layer's upstream timeout in s"),
    LayerAxis("gateway", "max_retries", True, 0, 32, True, "the gateway layer's retries per attempt from above"),
    # an upstream group's passive health (sim.policy.upstream): more failures before a server goes out is safer,
    # a longer time out is worse
    LayerAxis("gateway", "fails_to_mark_down", False, 1, 1000, True,
              "the gateway's failures that take a server of its upstream group out of rotation"),
    LayerAxis("gateway", "down_for_s", True, 0.5, 3600.0, False,
              "how long a server of the gateway's upstream group stays out of rotation, in s"),
]}
GROUP_KEYS = ("fails_to_mark_down", "down_for_s")     # axes of a gateway's upstream group only
SIMULATED_KINDS = ("client", "gateway")          # the kinds of layer whose keys are axes


AXIS = {a.name: a for a in [
    Axis("speed", True, 1 / 16, 16.0, "every step-time coefficient x s"),
    Axis("pulse", True, 1 / 16, 8.0, "the pulse rate x m"),
    Axis("hold_load", True, 0.02, 1.5, "the hold's load in multiples of C"),
    Axis("kv", False, 1 / 256, 16.0, "KV blocks x f"),
    Axis("provisioning", True, 1.0, 3600.0, "a new replica's provisioning delay (s)"),
    Axis("target", True, 1e-3, 1e4, "the autoscaler metric's target"),
]}


def axis(name: str):
    """The Axis or LayerAxis of a name."""
    return AXIS[name] if name in AXIS else LAYER_AXES[tuple(name.split(".")[1:])]


def parse_axes(spec: str | Sequence[str], layers: tuple | None = None) -> list[str]:
    """Axis names from "a,b" or a list: those of `AXES`, and with `layers`
    ([[layer]] tables' effective settings) `layer.KIND.KEY` for the keys of
    `LAYER_AXES` a layer of that kind sets. One-line ValueError otherwise."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    layer = [a.name for a in LAYER_AXES.values()]
    for n in names:
        if not n.startswith("layer."):
            continue
        kind = n.split(".")[1] if n.count(".") == 2 else ""
        if kind not in SIMULATED_KINDS:
            raise ValueError(f"{n}: a layer's axis is layer.KIND.KEY, of {', '.join(layer)}"
                             + ("; gateway layers are not yet simulated" if kind == "gateway" else ""))
        if tuple(n.split(".")[1:]) not in LAYER_AXES:
            raise ValueError(f"unknown axis {n}; a layer's axes: {', '.join(layer)}")
        axis(n).baseline(None, layers=layers)   # the scenario has the layer, and the layer sets the key
    bad = [n for n in names if n not in AXIS and not n.startswith("layer.")]
    if bad or not names:
        raise ValueError(f"unknown axis {', '.join(bad) or spec!r}; valid: {', '.join(AXES + SCALING_AXES)}"
                         + (f", {', '.join(layer)}" if layers else ""))
    return names


# ------------------------------------------------------------------ runs
def slim(rec: dict) -> dict:
    """The parts of a result record the verdicts use."""
    return {k: rec[k] for k in ("model", "condition", "pulse", "seed", "recovered", "recovery_time_s", "cohorts",
                                "rates_xC", "wall_s")}


def fleet_run(fleet: FleetSpec, capacities: tuple, profile_at: Callable[[Profile], Profile], scaler=None) -> tuple:
    """run_task's fleet part: every replica's profile through `profile_at`
    (a probe's perturbation), the replicas' Ĉ, the router and, where the
    fleet has one, the autoscaler (`scaler`, default the fleet's)."""
    out = (tuple(profile_at(p) for p in fleet.profiles), capacities, fleet.router)
    scaler = scaler if scaler is not None else fleet.autoscaler
    return out if scaler is None else out + (scaler,)


def run_task(task: tuple, full: bool = False) -> dict:
    """One run: (profile, scenario, condition, seed, trace capacity[, fleet[,
    layers]]) -> the slim record (the full one with `full`, less a fleet's
    per-replica records). `fleet`, (profiles, capacities, router[,
    autoscaler]) (`fleet_run`), runs the replicas behind the router, scaled
    by the autoscaler where given, instead of `profile`; `layers`, [[layer]]
    tables' effective settings, stand above the condition's proxy (on a
    fleet, above its proxy or router)."""
    profile, scenario, condition, seed, trace_capacity, *on = task
    fleet, layers = (list(on) + [None, None])[:2]
    trace = make_trace(trace_capacity, scenario, seed)
    if fleet is not None:                   # a fleet: (replicas' profiles, their Ĉ, router[, autoscaler])
        profiles, capacities, router, *scaler = fleet
        stack = None if layers is None else Stack.under_layers(condition, layers, scenario, router)
        rec = run_fleet(list(profiles), condition, trace, scenario, list(capacities), router, seed, scenario.pulse,
                        stack=stack, autoscaler=scaler[0] if scaler else None)
        rec.pop("replicas", None)
    else:
        rec = verdict.run_record(profile, scenario, condition, seed, trace, layers=layers)
    return rec if full else slim(rec)


def run_many(tasks: Sequence[tuple], workers: int | None = None, full: bool = False) -> list[dict]:
    """run_task over tasks on local processes (default one per CPU), in task order."""
    w = workers if workers else (os.cpu_count() or 1)
    tagged = [(i, t, full) for i, t in enumerate(tasks)]
    out = list(run_local(tagged, min(w, len(tagged)), fn=_tagged))
    return [r for _, r in sorted(out, key=lambda ir: ir[0])]


def _tagged(it: tuple) -> tuple:
    return it[0], run_task(it[1], it[2])


def run_conditions(profile: Profile, scenario: Scenario, conditions: Sequence[Condition], seeds: Sequence[int],
                   workers: int | None = None) -> list[dict]:
    """The full records of every condition on every seed's trace, seed by
    seed, conditions in the order given."""
    return run_many([(profile, scenario, c, s, profile.capacity) for s in seeds for c in conditions], workers,
                    full=True)


def cell(profile: Profile, scenario: Scenario, condition: Condition, seeds: Sequence[int],
         workers: int | None = 1, trace_capacity: float | None = None, fleet: tuple | None = None,
         layers: tuple | None = None) -> dict:
    """summarize() of `condition` over `seeds`, traces drawn at `trace_capacity`
    (default the profile's); on `fleet` or under `layers` (see run_task) if given."""
    cap = trace_capacity or profile.capacity
    return verdict.summarize(run_many([(profile, scenario, condition, s, cap, fleet, layers) for s in seeds],
                                      workers))


# ------------------------------------------------------------------ the margin
def margin(profile: Profile, scenario: Scenario, condition: Condition, seeds: Sequence[int],
           axes: Sequence[str] = AXES, rel_tol: float = 0.02, workers: int | None = 1,
           progress: Callable[[str], None] | None = None, base: dict | None = None,
           fleet: FleetSpec | None = None, layers: tuple | None = None) -> dict:
    """The margin of `condition` on (profile, scenario) along each axis.
    Returns a JSON-able record: the baseline cell's summary, and per axis the
    crossing, its bracket and every probe (x, P, Wilson interval). `base`:
    the baseline cell's summary when the caller has it (the same seeds).
    With `fleet`, the replicas behind its router run instead of `profile`
    (whose capacity is then the fleet's Ĉ, the traces' rate): the speed and
    kv axes perturb every replica alike. `layers`, [[layer]] tables'
    effective settings, stand above the condition's proxy at every probe;
    their keys are axes then (`LAYER_AXES`)."""
    t0 = time.perf_counter()
    seeds = list(seeds)
    if not seeds:
        raise ValueError("margin needs at least one seed")
    axes = parse_axes(axes, layers)
    scaled = [a for a in axes if a in SCALING_AXES]
    if scaled and (fleet is None or fleet.autoscaler is None):
        raise ValueError(f"the {', '.join(scaled)} axis needs a fleet with an [autoscaler] section")
    caps = tuple(fleet.capacities(scenario)) if fleet is not None else ()

    def on(ax: Axis | None = None, x: float = 1.0):
        """The fleet's run at x on an axis (None: one engine)."""
        if fleet is None:
            return None
        return fleet_run(fleet, caps, (lambda p: ax.apply(p, scenario, x)[0]) if ax else (lambda p: p),
                         ax.scaler(fleet.autoscaler, x) if ax else None)
    base = base if base is not None else cell(profile, scenario, condition, seeds, workers, fleet=on(),
                                              layers=layers)
    out_axes = []
    for name in axes:
        ax = axis(name)
        x0 = ax.baseline(scenario, fleet, layers)
        seen: dict[float, dict] = {x0: base}

        def p(x: float) -> float:
            if x not in seen:
                prof, sc = ax.apply(profile, scenario, x)
                seen[x] = cell(prof, sc, condition, seeds, workers, trace_capacity=profile.capacity,
                               fleet=on(ax, x), layers=ax.layers_at(layers, x))
                if progress:
                    s = seen[x]
                    progress(f"  {name} {x:.4g}: P = {s['p']:.2f} [{s['lo']:.2f}, {s['hi']:.2f}]")
            return seen[x]["p"]
        lo, hi = ax.limits(layers, x0)
        worse, better = (hi, lo) if ax.worse_up else (lo, hi)
        r = find_crossing(p, x0, worse, better, rel_tol=rel_tol, integer=ax.integer)
        probes = [{"x": x, "p": seen[x]["p"], "lo": seen[x]["lo"], "hi": seen[x]["hi"], "n": seen[x]["n"],
                   "tipping": seen[x]["tipping"]} for x, _ in r["probes"]]
        rec = {"axis": name, "what": ax.what, "baseline": x0, "recovers_at_baseline": r["side0"],
               "crossing": r["crossing"], "bracket": r["bracket"], "limit": r["limit"], "probes": probes}
        rec["phrase"] = (ax.phrase(r["crossing"], *r["bracket"], x0) if r["crossing"] is not None
                         else f"no crossing on {name} up to {r['limit']:g}")
        out_axes.append(rec)
    res = {"model": profile.name, "condition": condition.name, "condition_settings": condition.settings(),
           "scenario": scenario.to_dict(), "seeds": seeds, "rel_tol": rel_tol, "baseline": base,
           "verdict": verdict.verdict(base), "axes": out_axes, "wall_s": time.perf_counter() - t0}
    if fleet is not None:
        res["fleet"] = fleet.document()
    if layers is not None:
        res["layers"] = list(layers)
    res["sentence"] = sentence(res)
    return res


def sentence(res: dict) -> str:
    """'recovers (P = ..); stops recovering if A, or B; no crossing on C' in one line."""
    flips = [a["phrase"] for a in res["axes"] if a["crossing"] is not None]
    none = [a["phrase"] for a in res["axes"] if a["crossing"] is None]
    rec = res["baseline"]["p"] >= 0.5
    s = res["verdict"]
    if flips:
        s += f"; {'stops' if rec else 'starts'} recovering if " + ", or ".join(flips)
    if none:
        s += "; " + "; ".join(none)
    return s


def margin_cell(res: dict) -> str:
    """The margin in a table cell: each axis's crossing as a value (bracket)."""
    parts = []
    for a in res["axes"]:
        if a["crossing"] is None:
            parts.append(f"{a['axis']} none")
        else:
            lo, hi = sorted(a["bracket"])
            parts.append(f"{a['axis']} {a['crossing']:.3g} ({lo:.3g}-{hi:.3g})")
    return "; ".join(parts)
