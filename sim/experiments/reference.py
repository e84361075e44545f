"""The published reference outcomes of the diagnostic block, and how simulated
runs compare with them.

The reference is the published figures for vLLM on one H100 80 GB SXM serving
Qwen2.5-7B-Instruct at pulse 2.7 Ĉ (docs/model.md, "Calibration"): per
condition, the share of the hold cohort delivered (a range over the published
runs) and whether and when service recovered (seconds after the pulse end). The bar: hold
delivery within 5 points of the reference range, the same recovered / not
recovered, and a recovery time within one 60 s window of the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass

BAR_POINTS = 5.0        # hold delivery, percentage points
BAR_WINDOW_S = 60.0     # recovery time: one recovery window


@dataclass(frozen=True)
class Reference:
    hold_delivered: tuple[float, float]          # percent, lowest and highest reference run
    recovery_s: tuple[float, float] | None       # None: did not recover by the end of the hold


MODEL = "qwen2.5-7b"
PULSE = 2.7
SOURCE = "the published figures (vLLM on one H100, Qwen2.5-7B-Instruct)"
REFERENCE = {
    "no-control": Reference((0.0, 0.0), None),
    "cancel": Reference((13.3, 15.2), None),
    "no-retry+cancel": Reference((89.0, 91.4), (360.0, 360.0)),
    "no-retry": Reference((72.4, 74.8), (480.0, 540.0)),
}


def applies(model: str, pulse: float) -> bool:
    """Whether runs of this model at this pulse (the paper workload) are
    comparable with the published figures."""
    return model == MODEL and abs(pulse - PULSE) < 1e-9


def distance(x: float, ref: tuple[float, float]) -> float:
    """How far x lies outside the closed interval ref (0 inside it)."""
    return max(0.0, ref[0] - x, x - ref[1])


def hold_delivered_pct(rec: dict) -> float:
    h = rec["cohorts"]["hold"]
    return 100.0 * h["delivered"] / h["offered"] if h["offered"] else 0.0


def compare(records: list[dict]) -> list[dict]:
    """One row per reference condition present in `records` (result records of
    one or more seeds). The simulated figure is the mean over seeds, shown with
    its range; recovery is compared only when every seed and the reference
    agree on whether service recovered."""
    rows = []
    for name, ref in REFERENCE.items():
        recs = [r for r in records if r["condition"] == name]
        if not recs:
            continue
        held = [hold_delivered_pct(r) for r in recs]
        mean = sum(held) / len(held)
        d_gap = distance(mean, ref.hold_delivered)
        recovered = [bool(r["recovered"]) for r in recs]
        times = [r["recovery_time_s"] for r in recs if r["recovered"]]
        row = {"condition": name, "seeds": [r["seed"] for r in recs],
               "hold_delivered_pct": mean, "hold_delivered_range": [min(held), max(held)],
               "reference_hold_delivered": list(ref.hold_delivered), "hold_gap_points": d_gap,
               "recovered": sum(recovered), "runs": len(recs),
               "recovery_s": [min(times), max(times)] if times else None,
               "reference_recovered": ref.recovery_s is not None,
               "reference_recovery_s": list(ref.recovery_s) if ref.recovery_s else None}
        problems = []
        if d_gap > BAR_POINTS:
            side = "below" if mean < ref.hold_delivered[0] else "above"
            problems.append(f"hold delivery {d_gap:.1f} points {side} the reference")
        if ref.recovery_s is None:
            if any(recovered):
                problems.append(f"recovered in {sum(recovered)} of {len(recs)} runs; the reference did not")
            row["recovery_gap_s"] = None
        elif not all(recovered):
            problems.append(f"did not recover in {len(recs) - sum(recovered)} of {len(recs)} runs; the reference did")
            row["recovery_gap_s"] = None
        else:
            mean_t = sum(times) / len(times)
            row["recovery_gap_s"] = r_gap = distance(mean_t, ref.recovery_s)
            if r_gap > BAR_WINDOW_S:
                side = "later" if mean_t > ref.recovery_s[1] else "earlier"
                problems.append(f"recovery {r_gap:.0f} s {side} than the reference")
        row["within_bar"] = not problems
        row["problems"] = problems
        rows.append(row)
    return rows


def _span(lo: float, hi: float, fmt: str, unit: str) -> str:
    return f"{lo:{fmt}}{unit}" if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}{unit}"


def table(rows: list[dict], markdown: bool = False) -> str:
    """The comparison as aligned text, or as a Markdown table."""
    head = ("condition", "hold deliv", "reference", "gap", "recovered", "reference", "verdict")
    out = [head]
    for r in rows:
        lo, hi = r["hold_delivered_range"]
        sim_h = f"{r['hold_delivered_pct']:.1f}%" + ("" if lo == hi else f" ({lo:.1f}-{hi:.1f})")
        if r["recovered"] == 0:
            sim_r = "no"
        else:
            t = r["recovery_s"]
            sim_r = ("" if r["recovered"] == r["runs"] else f"{r['recovered']}/{r['runs']}, ") + _span(*t, ".0f", " s")
        ref_r = _span(*r["reference_recovery_s"], ".0f", " s") if r["reference_recovered"] else "no"
        out.append((r["condition"], sim_h, _span(*r["reference_hold_delivered"], ".1f", "%"),
                    f"{r['hold_gap_points']:.1f}", sim_r, ref_r,
                    "within the bar" if r["within_bar"] else "OFF: " + "; ".join(r["problems"])))
    if markdown:
        return "\n".join(["| " + " | ".join(out[0]) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in out[1:]])
    w = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in out)


def from_flat(row: dict) -> dict:
    """The part of a result record `compare` reads, from a flattened sweep row."""
    return {"condition": row["condition"], "seed": row["seed"], "recovered": bool(row["recovered"]),
            "recovery_time_s": row["recovery_time_s"],
            "cohorts": {"hold": {"offered": row["hold_offered"], "delivered": row["hold_delivered"]}}}
