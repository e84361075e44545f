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

Search: every candidate runs on the first `screen` seeds; settings with the
same outcome on those are one (the simplest stands for them); the `finalists`
best of those (by recoveries, then the objective) run on all seeds; the
ranking puts first the candidates whose P(recovered) interval lies above 1/2
(they restore service with high probability), then the rest by P; within
each group by the objective's mean over the seeds:
  timely     calls of the pulse and the hold delivered within the deadline
  delivered  calls of the pulse and the hold delivered at all
  burst      pulse calls delivered
The top settings shown skip one that adds controls to a setting ranked
above it for a like outcome (`pick`); each comes with its margin and what it
gives up against the best alternative (`gives_up`). All runs of one seed share its trace (common random numbers).

Results are rows of one Parquet file (the sweep's atomic store): a rerun
with the same file skips the runs it holds; a file made for another
deployment is refused.
"""
from __future__ import annotations

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
from ..profile import Profile
from ..scenario import Scenario
from . import margin as margin_mod
from .sweep import _local, _ray, _Store, flatten, read_table

OBJECTIVES = ("timely", "delivered", "burst")
LAYERS = ("client", "proxy", "engine")
RETRIES = (True, False)
CANCELS = ("off", "now", "deferred:10", "deferred:30")
BUDGETS = (0.0, 0.1, 0.2)
ORDERS = ("budget-first", "lookup-first")
CAP_FRACTIONS = (1 / 3, 1.0)          # of ⌈deadline · Ĉ⌉
QUEUES = (("fifo", None), ("deadline", None), ("lifo", 0), ("lifo", 0.5))   # (order, LIFO threshold / N)


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
               adapt: Callable[[Condition], Condition] | None = None) -> list[Condition]:
    """The named conditions and the grid (see the module docstring), each
    passed through `adapt` (e.g. a named scenario's time scaling of the
    proxy's own times); unique names."""
    if only is not None and only not in LAYERS:
        raise ValueError(f"--only must be one of {', '.join(LAYERS)}, got {only!r}")
    full = engine_cap_for(capacity, scenario)
    caps = sorted({max(1, math.ceil(full * f)) for f in CAP_FRACTIONS})
    layer = {"client": only in (None, "client"), "proxy": only in (None, "proxy"), "engine": only in (None, "engine")}
    out: dict[str, Condition] = {}
    for c in CONDITIONS.values():
        if only is None or _layers(c) <= {only}:
            out[c.name] = c
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
                            tag += [f"proxy-cap={cap}/{queue}" + (f"@{after}" if after is not None else "")] if cap else []
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
    conds = list(out.values())
    return [adapt(c) for c in conds] if adapt else conds


# ------------------------------------------------------------------ runs and storage
DROP = ("series_", "windows_")


def deployment_key(profile: Profile, scenario: Scenario) -> str:
    """A digest of what the runs depend on besides the condition and seed."""
    d = {"profile": profile.raw or profile.name, "step_time": profile.step_time.to_dict(), "engine": profile.engine,
         "capacity": profile.capacity, "scenario": scenario.to_dict()}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _row_task(task: tuple) -> dict:
    profile, scenario, condition, seed, key = task
    rec = verdict.run_record(profile, scenario, condition, seed)
    row = {k: v for k, v in flatten(rec).items() if not k.startswith(DROP)}
    row["deployment"] = key
    return row


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
    return s


def _rank_key(s: dict, obj: str) -> tuple:
    high = s["lo"] > 0.5
    return (not high, -s["p"] if not high else 0.0, -(s[obj] if s[obj] is not None else -1.0))


def advise(profile: Profile, scenario: Scenario, seeds: Sequence[int], objective_name: str = "timely",
           only: str | None = None, out: str | None = None, adapt: Callable[[Condition], Condition] | None = None,
           screen: int = 2, finalists: int = 12, top: int = 3, workers: int | None = 1,
           ray_address: str | None = None, margin_axes: Sequence[str] = ("speed",), progress: bool = True) -> dict:
    """Search the controls for the deployment (profile, scenario); see the
    module docstring. Returns {"ranking": [...], "top": [...], ...} with, for
    each of the top settings, its summary, margin (along `margin_axes`) and
    what it gives up against the best alternative."""
    if objective_name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective_name!r}")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("advise needs at least one seed")
    t0 = time.perf_counter()
    key = deployment_key(profile, scenario)
    cands = candidates(scenario, profile.capacity, only, adapt)
    by_name = {c.name: c for c in cands}
    store = None
    rows: dict[tuple[str, int], dict] = {}
    if out:
        t = read_table(out)
        if t is not None and t.num_rows:
            have = set(t.column("deployment").to_pylist()) if "deployment" in t.column_names else {None}
            if have != {key}:
                raise ValueError(f"{out} holds runs of another deployment (profile, scenario); give another --out")
        store = _Store(out)
        for r in ([] if t is None else t.to_pylist()):
            rows[(r["condition"], int(r["seed"]))] = r

    def run(names: Sequence[str], ss: Sequence[int], stage: str) -> None:
        todo = [(profile, scenario, by_name[n], s, key) for n in names for s in ss if (n, s) not in rows]
        if not todo:
            return
        it = _ray(todo, ray_address, fn=_row_task) if ray_address is not None else \
            _local(todo, workers if workers else (os.cpu_count() or 1), fn=_row_task)
        t1 = time.perf_counter()
        shown = [t1]
        tty = sys.stderr.isatty()
        try:
            for i, r in enumerate(it, 1):
                rows[(r["condition"], int(r["seed"]))] = r
                if store is not None:
                    store.add(r)
                    if store.due():
                        store.flush()
                if progress and (time.perf_counter() - shown[0] >= 1.0 or i == len(todo)):
                    shown[0] = time.perf_counter()
                    el = shown[0] - t1
                    bar = "#" * (30 * i // len(todo))
                    end = "\n" if i == len(todo) or not tty else ""
                    print(f"\r{stage} [{bar:<30}] {i}/{len(todo)} runs, {el:.0f} s, eta {el / i * (len(todo) - i):.0f} s",
                          end=end, file=sys.stderr, flush=True)
        finally:
            if store is not None:
                store.flush()

    names = [c.name for c in cands]
    first = seeds[:max(1, min(screen, len(seeds)))]
    run(names, first, f"screen {len(names)} settings x {len(first)} seeds")
    names = distinct(names, by_name, [[rows[(n, s)] for s in first] for n in names])
    screened = {n: score([rows[(n, s)] for s in first], objective_name) for n in names}
    best = sorted(names, key=lambda n: (-screened[n]["recovered"], -(screened[n][objective_name] or 0.0)))
    final = best[:max(top, finalists)]
    run(final, seeds, f"final {len(final)} settings x {len(seeds)} seeds")
    scored = {n: score([rows[(n, s)] for s in seeds], objective_name) for n in final}
    ranking = sorted(final, key=lambda n: _rank_key(scored[n], objective_name))
    shown = pick(ranking, scored, by_name, top)
    margins = {n: margin_mod.margin(profile, scenario, by_name[n], seeds, margin_axes, rel_tol=0.05, workers=workers)
               if margin_axes else None for n in shown}
    tops = []
    for i, n in enumerate(shown):
        alt = shown[1] if i == 0 and len(shown) > 1 else shown[0]
        m = margins[n]
        tops.append({"rank": i + 1, "condition": n, "settings": by_name[n].settings(), "describe": by_name[n].describe(),
                     "summary": scored[n], "verdict": verdict.verdict(scored[n]),
                     "margin": None if m is None else {"sentence": m["sentence"], "axes": m["axes"]},
                     "against": alt if alt != n else None,
                     "gives_up": gives_up(scored[n], scored[alt], m, margins[alt]) if alt != n else []})
    return {"model": profile.name, "scenario": scenario.to_dict(), "deployment": key, "objective": objective_name,
            "only": only, "seeds": seeds, "screen_seeds": first, "candidates": len(cands),
            "ranking": [{"condition": n, **{k: scored[n][k] for k in ("p", "lo", "hi", "tipping", *OBJECTIVES)}}
                        for n in ranking],
            "top": tops, "wall_s": time.perf_counter() - t0}


SIGNATURE = ("recovered", "recovery_time_s", "pulse_delivered", "pulse_within_deadline", "hold_delivered",
             "hold_within_deadline", "primary_delivered", "primary_within_deadline")


def distinct(names: Sequence[str], by_name: dict, rows: Sequence[Sequence[dict]]) -> list[str]:
    """One name per outcome: settings whose runs agree on every SIGNATURE
    measure stand as one, the one with the fewest settings changed (a named
    condition on a tie) — first-seen order kept."""
    groups: dict[tuple, list[str]] = {}
    for n, rs in zip(names, rows):
        groups.setdefault(tuple(tuple(r[k] for k in SIGNATURE) for r in rs), []).append(n)
    keep = {min(g, key=lambda n: (len(by_name[n].describe().split(", ")), n not in CONDITIONS)) for g in groups.values()}
    return [n for n in names if n in keep]


def _alike(a: dict, b: dict) -> bool:
    """The same P(recovered) and every objective within half a point."""
    return a["p"] == b["p"] and all(a[o] is not None and b[o] is not None and abs(a[o] - b[o]) <= 0.005
                                    for o in OBJECTIVES)


def pick(ranking: Sequence[str], scored: dict, by_name: dict, top: int) -> list[str]:
    """The first `top` of the ranking, skipping a setting that changes more
    than one ranked above it and does alike (it adds settings for nothing)."""
    out: list[str] = []
    size = lambda n: len(by_name[n].describe().split(", "))
    for n in ranking:
        if not any(_alike(scored[n], scored[m]) and size(n) > size(m) for m in out):
            out.append(n)
        if len(out) == top:
            break
    return out


def gives_up(s: dict, alt: dict, margin: dict | None = None, alt_margin: dict | None = None) -> list[str]:
    """Where s is worse than alt: P(recovered), the objectives (by more than
    half a point), the median recovery time (by more than a second), and the
    distance to a margin's crossing (by more than 2%) on the axes both have."""
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
                    or not y["recovers_at_baseline"]:
                continue
            dx, dy = abs(math.log(x["crossing"] / x["baseline"])), abs(math.log(y["crossing"] / y["baseline"]))
            if dy - dx > math.log(1.02):
                out.append(f"margin on {x['axis']}: flips at {x['crossing']:.3g} vs {y['crossing']:.3g} "
                           f"(now {x['baseline']:g})")
    return out


def report(res: dict) -> str:
    """The top settings in words."""
    lines = [f"{res['model']}: {res['candidates']} settings screened on {len(res['screen_seeds'])} seed(s), "
             f"{len(res['ranking'])} finalists on {len(res['seeds'])}; objective: {res['objective']}"]
    for t in res["top"]:
        s = t["summary"]
        lines.append(f"{t['rank']}. {t['condition']}")
        lines.append(f"   {t['describe']}")
        lines.append(f"   {t['verdict']}; within deadline {100 * (s['timely'] or 0):.1f}%, delivered "
                     f"{100 * (s['delivered'] or 0):.1f}%, pulse delivered {100 * (s['burst'] or 0):.1f}%")
        if t["margin"]:
            lines.append(f"   margin: {t['margin']['sentence'].split('; ', 1)[-1]}")
        if t["against"]:
            gu = "; ".join(t["gives_up"]) or "nothing"
            lines.append(f"   gives up against {t['against']}: {gu}")
    return "\n".join(lines)
