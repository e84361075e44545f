"""`llmsim paper`: every block of the reference design on the three embedded
models, run through `sweep()` into DIR/results.parquet, then a report
(DIR/report.md and PNG figures) computed from that Parquet file only.

Blocks (all at the profile's step budget, uniform prompts, pulse 2.7 Ĉ
unless said otherwise):

  diagnostic      the 4 diagnostic conditions
  trigger         the 4 diagnostic conditions at pulses 1.5, 2, 2.7
  tracing         the 4 diagnostic conditions at step budgets 8192 and 2048
  composition     coalesce, budget, budget-first, lookup-first, coalesce+cancel, budget+cancel
  queue           proxy-cap, deadline-check, lifo
  engine-cap      engine-cap-338, engine-cap-338+cancel, engine-cap-100
  deferral        deferred vs coalesce+cancel
  budget-cancel   budget+cancel against budget and cancel alone
  mixed           the 4 diagnostic conditions with mixed prompts

A cell shared by several blocks (same model, condition, pulse, seed, step
budget, prompts) runs once and appears in each block's table.

Seeds: the published design does not give its number of seeds per block, so
every block runs DEFAULT_SEEDS (3) seeds, not the published counts; change it
with `--seeds N` (seeds 0..N-1). Re-running `paper` on the same DIR
skips the cells already in results.parquet (a killed run resumes).
"""
from __future__ import annotations

import math
import os
import statistics

from .. import verdict
from . import figures, reference
from .design import (
    BLOCK_FIGURES,
    BLOCK_NAMES,
    BLOCKS,
    COHORTS,
    DEFAULT_SEEDS,
    FIGURES,
    MODELS,
    PULSE,
    Block,
    block_rows,
    get_blocks,
    paper_cells,
    share,
)
from .sweep import read_rows, sweep

__all__ = ["BLOCK_FIGURES", "BLOCK_NAMES", "BLOCKS", "COHORTS", "DEFAULT_SEEDS", "FIGURES", "MODELS", "PULSE",
           "Block", "get_blocks", "paper", "paper_cells", "write_report"]

def paper(out_dir: str, seeds: int = DEFAULT_SEEDS, workers: int | None = None, ray_address: str | None = None,
          blocks=None, models=MODELS, progress=True) -> dict:
    """Run the design's cells not yet in out_dir/results.parquet, then write the report.
    Returns sweep()'s summary plus "report" (the report.md path)."""
    if seeds < 1:
        raise ValueError("seeds must be at least 1")
    os.makedirs(out_dir, exist_ok=True)
    cells = paper_cells(blocks, models, seeds)
    res = sweep(cells, os.path.join(out_dir, "results.parquet"), workers=workers, ray_address=ray_address,
                progress=progress)
    res["report"] = write_report(out_dir, blocks=blocks, models=models, seeds=seeds)
    return res


# ------------------------------------------------------------------ report
def _fmt(vals, scale=1.0, digits=1, unit=""):
    v = [x * scale for x in vals if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "–"
    m = statistics.fmean(v)
    if len(v) == 1 or min(v) == max(v):
        return f"{m:.{digits}f}{unit}"
    return f"{m:.{digits}f}{unit} ({min(v):.{digits}f}–{max(v):.{digits}f})"


def _table(block: Block, groups) -> list[str]:
    vary = []
    if len(block.pulses) > 1:
        vary.append(("pulse ×Ĉ", lambda k: f"{k[2]:g}"))
    if len(block.max_batched_tokens) > 1:
        vary.append(("step budget", lambda k: str(k[3])))
    head = ["model", "condition"] + [v[0] for v in vary] + ["seeds"]
    for c in COHORTS:
        head += [f"{c} delivered %", f"{c} within deadline %"]
    head += ["P(recovered) [95%]", "recovery time s", "created ×Ĉ", "accepted ×Ĉ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, rs in groups.items():
        cells = [k[0], k[1]] + [f(k) for _, f in vary] + [str(len(rs))]
        for c in COHORTS:
            cells.append(_fmt([share(r[f"{c}_delivered"], r[f"{c}_offered"]) for r in rs], 100))
            cells.append(_fmt([share(r[f"{c}_within_deadline"], r[f"{c}_offered"]) for r in rs], 100))
        cells.append(verdict.p_cell(verdict.summarize(rs)) if rs else "–")
        cells.append(_fmt([r["recovery_time_s"] for r in rs], digits=0))
        cells.append(_fmt([r["rates_xC_created"] for r in rs], digits=2))
        cells.append(_fmt([r["rates_xC_accepted"] for r in rs], digits=2))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_report(out_dir: str, blocks=None, models=MODELS, seeds: int = DEFAULT_SEEDS) -> str:
    """DIR/report.md and DIR/*.png from DIR/results.parquet (nothing else)."""
    rows = read_rows(os.path.join(out_dir, "results.parquet"))
    md = ["# llmsim paper: the reference design on the simulator", "",
          f"{len(rows)} runs from `results.parquet`; models: {', '.join(models)}; seeds per cell: {seeds} "
          "(the published design does not give its seed counts per block, so these are not the published "
          "counts). Cells: mean over seeds (min–max). "
          "P(recovered): the share of seeds that recovered with its 95% Wilson interval; a tipping point: the "
          "interval straddles 1/2 and the seeds disagree. "
          "Shares are of the cohort's offered calls; delivered = by 840 s, within deadline = by 120 s; "
          "rates over [347, 947) s in multiples of Ĉ.", ""]
    for b in get_blocks(blocks):
        md += [f"## {b.title}", f"<!-- block: {b.name} -->", ""]
        groups = block_rows(b, rows, models, seeds)
        md += _table(b, groups) + [""]
        if b.name == "diagnostic":
            md += _against_reference(groups)
        if b.name in BLOCK_FIGURES:
            md += [f"![{BLOCK_FIGURES[b.name]}]({BLOCK_FIGURES[b.name]})", ""]
    md += ["## Figures", ""] + [f"![{f}]({f})" for f in FIGURES] + [""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    figures.write(out_dir, rows, models, seeds, get_blocks(blocks))
    return path


def _against_reference(groups) -> list[str]:
    """The diagnostic block's default-model cells against the published figures."""
    recs = [reference.from_flat(r) for k, rs in groups.items() for r in rs
            if reference.applies(k[0], k[2]) and not k[4]]
    if not recs:
        return []
    rows = reference.compare(recs)
    return [f"Against {reference.SOURCE} ({reference.MODEL}; bar: hold delivery within {reference.BAR_POINTS:g} "
            "points, "
            f"recovery within one {reference.BAR_WINDOW_S:g} s window; mean over seeds, range in brackets):", "",
            reference.table(rows, markdown=True), ""]
