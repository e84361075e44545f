"""The advisor per traffic class (docs/classes.md): which control restores
the classes that must recover at least cost to the others.

Candidates (`class_candidates`), each on the deployment's engine (its
scheduling policy) and its own condition's client and proxy:
- the deployment's own condition (priority scheduling alone, where the
  engine schedules by priority) and the diagnostic conditions;
- shedding the classes that need not recover (`must_recover = false`) by
  each saturation rule: the engine's waiting requests over a share of
  ⌈deadline · Ĉ⌉ (the must-recover classes' shortest deadline: the queue a
  deadline's worth of capacity drains), its KV cache usage over a share,
  refused with 429 and the wait estimate as Retry-After or with 503;
- a cap on those classes' live executions (the same shares of that queue),
  and a retry budget for them (none admitted, or 10%);
each with cancellation off and now.

Search: every candidate runs on the first `screen` seeds; the `finalists`
best go on to all seeds (common random numbers: every setting of a seed
replays its trace). Ranking: first the candidates whose P(recovered) — the
deployment's verdict, every must-recover class recovered — has its 95%
interval above 1/2, then the rest by P; within each group by the cost to
the other classes: their calls of the pulse and the hold delivered within
their deadlines (more is less cost), then the must-recover classes' own.
The first few of the ranking get their margins (`sim.experiments.margin`,
along the axes asked for), as plain advise's top settings do.

Runs are plain advise's (`sim.experiments.advise.Runs`): each under the
deployment's [[layer]]s, on its [fleet] if it has one, kept as rows of a
Parquet store when one is given (a rerun on it runs none of its runs
again); a row's class measures are read back by `class_section`.

`advise_classes(deployment, seeds)` returns {"classes", "must_recover",
"layers", "ranking": [{condition, describe, p, lo, hi, classes: {name: {p,
timely, delivered, hold_timely, shed_calls}}, margin}], "best"};
`report(res)` prints it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

from .. import verdict
from ..conditions import DIAGNOSTIC, Condition, compose
from . import advise, margin as margin_mod

SHARES = (0.1, 0.25, 0.5)             # of ⌈deadline · Ĉ⌉, for the engine-waiting rule and the class cap
KV_SHARES = (0.8, 0.95)
CANCELS = ("off", "now")


def queue_scale(deployment) -> int:
    """⌈deadline · Ĉ⌉ over the must-recover classes' shortest deadline."""
    sc = deployment.scenario
    must = [c for c in sc.classes if c.must_recover] or list(sc.classes)
    return math.ceil(min(c.client(sc).deadline_s for c in must) * deployment.capacity)


def class_candidates(deployment) -> list[Condition]:
    """The candidates of the module docstring, each through the deployment's
    `condition_for` (its proxy times, its engine cap)."""
    sc = deployment.scenario
    if not sc.classes:
        raise ValueError(f"{deployment.name}: advise by class needs workload.classes")
    others = [c.name for c in sc.classes if not c.must_recover]
    own = deployment.condition
    out: dict[str, Condition] = {own.name: own}
    for n in DIAGNOSTIC:
        out.setdefault(n, compose(n, name=n))
    if others:
        q = queue_scale(deployment)
        for cancel in CANCELS:
            base = compose(own, cancel=cancel) if own.proxy.cancellation != cancel else own
            rules = [dict(shed_classes=others, shed_when="engine_waiting", shed_above=max(1, round(f * q)))
                     for f in SHARES]
            rules += [dict(shed_classes=others, shed_when="kv_usage", shed_above=f) for f in KV_SHARES]
            for r in rules:
                for status, ra in ((429, "estimate"), (503, "none")):
                    c = compose(base, shed_status=status, shed_retry_after=ra, **r)
                    out.setdefault(c.name, c)
            for f in SHARES:
                c = compose(base, shed_status=503, class_cap=[[o, max(1, round(f * q))] for o in others])
                out.setdefault(c.name, c)
            for b in (0.0, 0.1):
                c = compose(base, class_budget=[[o, b] for o in others])
                out.setdefault(c.name, c)
    return [deployment.condition_for(c) for c in out.values()]


def class_section(row: dict, name: str) -> dict:
    """A run's measures of class `name` from its flat row (`sweep.flatten`:
    classes_NAME_cohorts_hold_offered, ...) as a flat row of its own
    (hold_offered, ...): what `verdict.summarize` and the shares read."""
    p = f"classes_{name}_"
    out = {k: row[p + k] for k in ("recovered", "recovery_time_s", "shed_calls")}
    for c in verdict.COHORTS:
        for k in ("offered", *verdict.SHARES):
            out[f"{c}_{k}"] = row[f"{p}cohorts_{c}_{k}"]
    return out


def _share(c: dict, key: str, cohorts=("pulse", "hold")) -> float | None:
    off = sum(c[f"{x}_offered"] for x in cohorts)
    return sum(c[f"{x}_{key}"] for x in cohorts) / off if off else None


def _mean(v) -> float | None:
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def summarize(rows: Sequence[dict], classes: Sequence[str], must: Sequence[str]) -> dict:
    """A candidate over its seeds' rows (flat records): the deployment's
    P(recovered) with its interval, and per class P(recovered), the pulse
    and hold calls delivered within the class's deadline (`timely`) and at
    all, the hold's own share within the deadline, and the calls shed (mean
    per run)."""
    s = verdict.summarize(rows)
    out = {"p": s["p"], "lo": s["lo"], "hi": s["hi"], "n": s["n"],
           "recovery_time": s["recovery_time"]["median"], "classes": {}}
    for name in classes:
        cs = [class_section(r, name) for r in rows]
        out["classes"][name] = {
            "must_recover": name in must, "p": sum(bool(c["recovered"]) for c in cs) / len(cs),
            "timely": _mean(_share(c, "within_deadline") for c in cs),
            "delivered": _mean(_share(c, "delivered") for c in cs),
            "hold_timely": _mean(_share(c, "within_deadline", ("hold",)) for c in cs),
            "shed_calls": _mean(c["shed_calls"] for c in cs)}
    others = [v["timely"] for v in out["classes"].values() if not v["must_recover"]]
    mine = [v["timely"] for v in out["classes"].values() if v["must_recover"]]
    out["others_timely"] = _mean(others)
    out["must_timely"] = _mean(mine)
    return out


def rank_key(s: dict) -> tuple:
    high = s["lo"] > 0.5
    return (not high, 0.0 if high else -s["p"], -(s["others_timely"] if s["others_timely"] is not None else -1.0),
            -(s["must_timely"] or 0.0))


def advise_classes(deployment, seeds: Sequence[int], screen: int = 2, finalists: int = 8,
                   candidates: Sequence[Condition] | None = None, progress: bool = True, out: str | None = None,
                   workers: int | None = 1, ray_address: str | None = None, margin_axes: Sequence[str] = (),
                   top: int = 3) -> dict:
    """Search the candidates for the deployment (module docstring), under
    its [[layer]]s (`run_layers`) and on its [fleet] if it has them. The
    runs are kept in the Parquet store `out` when given, as plain advise
    keeps them (`advise.Runs`: a rerun on it runs none of its runs again);
    the `top` settings of the ranking get their margins along
    `margin_axes` (none: no margins)."""
    seeds = list(seeds)
    if not seeds:
        raise ValueError("advise needs at least one seed")
    t0 = time.perf_counter()
    sc, fleet, layers = deployment.scenario, deployment.fleet, deployment.run_layers()
    profile = dataclasses.replace(deployment.profile, capacity=deployment.capacity)
    names = [c.name for c in sc.classes]
    must = [c.name for c in sc.classes if c.must_recover]
    conds = list(candidates) if candidates is not None else class_candidates(deployment)
    by_name = {c.name: c for c in conds}
    router = fleet.router if fleet is not None else None
    key = advise.deployment_key(profile, sc, fleet, layers)
    runs = advise.Runs(profile, sc, fleet, key, out, workers, ray_address, progress)

    def scored(cs: Sequence[str], ss: Sequence[int], what: str) -> dict:
        runs.run(cs, ss, lambda n, s: (by_name[n], router, layers, s), None, what)
        return {n: summarize([runs[(n, s, "")] for s in ss], names, must) for n in cs}

    first = seeds[:max(1, min(screen, len(seeds)))]
    screened = scored(list(by_name), first, f"screen {len(conds)} settings x {len(first)} seeds")
    keep = sorted(by_name, key=lambda n: rank_key(screened[n]))[:finalists]
    own = deployment.condition_for().name
    if own in by_name and own not in keep:
        keep.append(own)                # the deployment's own condition is always reported
    final = scored(keep, seeds, f"final {len(keep)} settings x {len(seeds)} seeds")
    ranked = sorted(keep, key=lambda n: rank_key(final[n]))
    margins = {n: margin_mod.margin(profile, sc, by_name[n], seeds, margin_axes, rel_tol=0.05,
                                           workers=workers, base=verdict.summarize([runs[(n, s, "")] for s in seeds]),
                                           fleet=fleet, layers=layers)
               for n in ranked[:top]} if margin_axes else {}
    ranking = [{"condition": n, "describe": by_name[n].describe(), **final[n],
                "margin": _margin(margins[n]) if n in margins else None} for n in ranked]
    best = ranking[0] if ranking and ranking[0]["lo"] > 0.5 else None
    return {"deployment": deployment.name, "classes": names, "must_recover": must, "seeds": seeds,
            "screen_seeds": first, "candidates": len(conds), "queue_scale": queue_scale(deployment),
            "layers": None if layers is None else list(layers), "margin_axes": list(margin_axes or ()),
            "ranking": ranking, "best": best["condition"] if best else None, "wall_s": time.perf_counter() - t0}


def _margin(m: dict) -> dict:
    return {"sentence": m["sentence"], "axes": m["axes"]}


def report(res: dict) -> str:
    """The ranking with each class's delivery, best first."""
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"
    lines = [f"{res['deployment']}: {res['candidates']} settings screened on {len(res['screen_seeds'])} seed(s), "
             f"{len(res['ranking'])} on {len(res['seeds'])}; must recover: {', '.join(res['must_recover'])}; "
             f"queue scale ⌈deadline · Ĉ⌉ = {res['queue_scale']}"]
    lines.append("best: " + (res["best"] or "none restores the must-recover classes with P's interval above 1/2"))
    for i, r in enumerate(res["ranking"]):
        lines.append(f"{i + 1}. {r['condition']}: P(recovered) {r['p']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]"
                     + (f", recovery {r['recovery_time']:.0f} s" if r["recovery_time"] is not None else ""))
        lines.append(f"   {r['describe']}")
        for name, c in r["classes"].items():
            lines.append(f"   {name}{' (must recover)' if c['must_recover'] else ''}: P {c['p']:.2f}, pulse+hold "
                         f"within deadline {pct(c['timely'])}, delivered {pct(c['delivered'])}, hold within deadline "
                         f"{pct(c['hold_timely'])}, shed calls {c['shed_calls']:.0f} a run")
        if r.get("margin"):
            lines.append(f"   margin: {r['margin']['sentence'].split('; ', 1)[-1]}")
    return "\n".join(lines)
