"""Recovery as a probability: runs of one cell (a profile, a scenario and a
condition) over several seeds, summarised as P(recovered) with its 95% Wilson
interval, the recovery time and the cohorts' shares; a cell whose interval
straddles 1/2 is a tipping point.

Also the perturbed engines the margin and the advisor probe: every step-time
coefficient x s (`speed`), KV blocks x f (`kv`).

Summaries accept result records (`sim.measures.record`) or the flat rows of a
sweep table (`sim.experiments.sweep.flatten`) alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

from .conditions import Condition
from .policy.stack import Stack
from .profile import Profile
from .run import run_one
from .scenario import Scenario
from .workload import Trace, make_trace

Z95 = 1.959963984540054     # the standard normal's 97.5% point
COHORTS = ("hold", "pulse", "primary")
SHARES = ("delivered", "within_deadline")


# ------------------------------------------------------------------ the interval
def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for k successes in n trials (95% by default).
    n must be positive and 0 <= k <= n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def is_tipping(lo: float, hi: float) -> bool:
    """A cell is a tipping point when its interval straddles 1/2 (see
    summarize for the case where every run agrees)."""
    return lo < 0.5 < hi


# ------------------------------------------------------------------ perturbed engines
def perturbed(profile: Profile, speed: float = 1.0, kv: float = 1.0) -> Profile:
    """The profile with every step-time coefficient x `speed` (> 1: slower)
    and the KV blocks x `kv` (at least one block). Capacity Ĉ is kept: the
    workload stays that of the unperturbed engine."""
    if not (speed > 0 and kv > 0):
        raise ValueError(f"speed and kv factors must be positive, got {speed}, {kv}")
    if speed == 1.0 and kv == 1.0:
        return profile
    st = profile.step_time.scaled(speed)
    eng = dict(profile.engine, num_gpu_blocks=max(1, int(round(profile.engine["num_gpu_blocks"] * kv))))
    return dataclasses.replace(profile, step_time=st, engine=eng)


# ------------------------------------------------------------------ runs
def run_record(profile: Profile, scenario: Scenario, condition: Condition, seed: int,
               trace: Trace | None = None, inputs: dict | None = None, layers: tuple | None = None) -> dict:
    """One run of `condition` on `scenario` with the trace of `seed` (drawn at
    the profile's capacity unless given) — the result record (`run_one` at
    the profile's Ĉ; `inputs` join the record's). `layers`, [[layer]]
    tables' effective settings, stand above the condition's proxy
    (`Stack.under_layers`; a client layer in the client's place)."""
    stack = None if layers is None else Stack.under_layers(condition, layers, scenario)
    return run_one(profile, condition, scenario.pulse, seed, trace=trace, scenario=scenario,
                   capacity=profile.capacity, extra=inputs, stack=stack)


def run_seeds(profile: Profile, scenario: Scenario, condition: Condition, seeds: Iterable[int],
              trace_profile: Profile | None = None) -> list[dict]:
    """The records of `condition` over `seeds`. Traces are drawn at the
    capacity of `trace_profile` (default `profile`), so a perturbed engine
    replays the unperturbed engine's traces."""
    tp = trace_profile or profile
    return [run_record(profile, scenario, condition, s, make_trace(tp.capacity, scenario, s)) for s in seeds]


# ------------------------------------------------------------------ summaries
def _cohort(r: dict, cohort: str, key: str) -> float | None:
    if "cohorts" in r:
        c = r["cohorts"][cohort]
        off, v = c["offered"], c[key]
    else:
        off, v = r[f"{cohort}_offered"], r[f"{cohort}_{key}"]
    return v / off if off else None


def _spread(v: Sequence[float]) -> dict:
    if not v:
        return {"median": None, "p10": None, "p90": None}
    a = np.asarray(v, dtype=float)
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90)}


def summarize(recs: Sequence[dict], classes: bool = False) -> dict:
    """One cell over its seeds: n, recovered (count), p, lo, hi (95% Wilson),
    tipping (the interval straddles 1/2 and the runs disagree), too_few (the
    interval straddles 1/2 though every run agrees: fewer than 4 seeds),
    recovery_time {median, min, max} over the recovered runs, and per cohort
    (hold, pulse, primary) and share (delivered, within_deadline) the median
    and 10th/90th percentiles of the share of offered calls. With `classes`,
    records that carry traffic classes add `classes` (`summarize_classes`)."""
    if not recs:
        raise ValueError("summarize needs at least one record")
    n = len(recs)
    k = sum(bool(r["recovered"]) for r in recs)
    lo, hi = wilson(k, n)
    t = [float(r["recovery_time_s"]) for r in recs if r["recovered"] and r["recovery_time_s"] is not None]
    straddles = is_tipping(lo, hi)
    out = {"n": n, "recovered": k, "p": k / n, "lo": lo, "hi": hi, "tipping": straddles and 0 < k < n,
           "too_few": straddles and k in (0, n),
           "recovery_time": {"median": float(np.median(t)) if t else None,
                             "min": min(t) if t else None, "max": max(t) if t else None}}
    for c in COHORTS:
        for s in SHARES:
            out[f"{c}_{s}"] = _spread([x for x in (_cohort(r, c, s) for r in recs) if x is not None])
    by_class = summarize_classes(recs) if classes else {}
    if by_class:
        out["classes"] = by_class
    return out


def summarize_classes(recs: Sequence[dict]) -> dict:
    """Per traffic class (docs/classes.md), `summarize` of the records' own
    sections of that class (`classes[name]`: the class's calls alone, judged
    with its deadline): {name: summary} in the records' order of classes;
    {} unless every record has classes."""
    if not recs or not all("classes" in r for r in recs):
        return {}
    return {name: summarize([r["classes"][name] for r in recs]) for name in recs[0]["classes"]}


def summarize_by(recs: Iterable[dict], key=lambda r: r["condition"], classes: bool = False) -> dict:
    """{key: summary} over the records grouped by key (first-seen order);
    `classes` as `summarize` takes it."""
    by: dict = {}
    for r in recs:
        by.setdefault(key(r), []).append(r)
    return {k: summarize(rs, classes) for k, rs in by.items()}


def p_cell(s: dict) -> str:
    """P(recovered) with its interval, and the tipping-point label."""
    cell = f"{s['p']:.2f} [{s['lo']:.2f}, {s['hi']:.2f}]"
    return cell + (" tipping point" if s["tipping"] else " too few seeds" if s.get("too_few") else "")


def verdict(s: dict) -> str:
    """One phrase: recovers / does not recover / tipping point, with P and its interval."""
    word = "tipping point" if s["tipping"] else ("recovers" if s["p"] > 0.5 else "does not recover")
    if s.get("too_few"):
        word += ", too few seeds to be sure"
    return f"{word} (P = {s['p']:.2f}, [{s['lo']:.2f}, {s['hi']:.2f}], {s['n']} seeds)"


def _range_cell(mid, a, b, fmt: str, unit: str = "") -> str:
    """mid (a-b), or mid alone when a == b; '-' when there is none."""
    if mid is None:
        return "-"
    if a == b:
        return f"{mid:{fmt}}{unit}"
    return f"{mid:{fmt}}{unit} ({a:.0f}-{b:.0f})"


def _share_cell(d: dict) -> str:
    pct = [None if v is None else 100 * v for v in (d["median"], d["p10"], d["p90"])]
    return _range_cell(*pct, ".1f", "%")


def _time_cell(t: dict) -> str:
    return _range_cell(t["median"], t["min"], t["max"], ".0f", " s")


def table(summaries: dict, deadline_s: float | None = None, extra: dict | None = None, label: str = "cell") -> str:
    """The per-cell table: P(recovered) [95% interval] (tipping points
    labelled), recovery time median (range), and per cohort delivered and
    within deadline as median (10th-90th percentile). `extra` adds columns:
    {column name: {cell key: text}}; `label` heads the first column."""
    dl = f"<={deadline_s:g}s" if deadline_s else "in deadline"
    head = [label, "P(recovered) [95%]", "recovery time"]
    for c in COHORTS:
        head += [f"{c} deliv", f"{c} {dl}"]
    extra = extra or {}
    head += list(extra)
    rows = [head]
    for k, s in summaries.items():
        row = [str(k), p_cell(s), _time_cell(s["recovery_time"])]
        for c in COHORTS:
            row += [_share_cell(s[f"{c}_delivered"]), _share_cell(s[f"{c}_within_deadline"])]
        row += [col.get(k, "-") for col in extra.values()]
        rows.append(row)
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def legend(n: int) -> str:
    return (f"P(recovered) over {n} seed{'s' if n != 1 else ''} with its 95% Wilson interval (a tipping point: "
            "the interval straddles 1/2 and the runs disagree; too few seeds: it straddles 1/2 though they agree); "
            "recovery time median (range) over the recovered runs; shares "
            "median (10th-90th percentile) over the seeds")
