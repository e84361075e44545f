# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Policy sweep: which proxy control restores service after an overload pulse?
#
# Qwen2.5-7B-Instruct (the embedded `qwen2.5-7b` profile), pulse 2.7 Ĉ, the four
# diagnostic conditions plus a few proxy controls, a couple of seeds each. The runs
# go through `sim.experiments.sweep.sweep()` into one Parquet file; everything below the sweep
# is computed from that file only, so re-running the notebook skips the finished
# runs and re-plots.
#
# Outputs go to `$LLMSIM_NOTEBOOK_OUT/policy_sweep/` (default `./notebook_out/`).

# %%
import os
import statistics

import matplotlib.pyplot as plt
import pyarrow.parquet as pq
from IPython.display import Markdown, display

from sim.conditions import DIAGNOSTIC
from sim.experiments.sweep import grid, sweep

MODEL = "qwen2.5-7b"
PULSE = 2.7
SEEDS = range(int(os.environ.get("LLMSIM_NOTEBOOK_SEEDS", "2")))
CONDITIONS = DIAGNOSTIC + ("coalesce", "budget", "deferred", "lifo")

OUT = os.path.join(os.environ.get("LLMSIM_NOTEBOOK_OUT", "notebook_out"), "policy_sweep")
os.makedirs(OUT, exist_ok=True)
RESULTS = os.path.join(OUT, "results.parquet")

# %% [markdown]
# ## Run the grid (a run takes about half a second; already finished runs are skipped)

# %%
cells = grid([MODEL], CONDITIONS, [PULSE], SEEDS)
summary = sweep(cells, RESULTS, workers=2, progress=False)
print(f"{summary['ran']} runs, {summary['skipped']} already in {RESULTS}, {summary['wall_s']:.1f} s")

# %% [markdown]
# ## Read the results back

# %%
rows = [r for r in pq.read_table(RESULTS).to_pylist()
        if r["model"] == MODEL and r["pulse"] == PULSE and r["condition"] in CONDITIONS]
by_condition = {c: sorted((r for r in rows if r["condition"] == c), key=lambda r: r["seed"]) for c in CONDITIONS}


def hold_pct(r, key="delivered"):
    """Share of the hold cohort's offered calls, in %."""
    return 100 * r[f"hold_{key}"] / r["hold_offered"]


# %% [markdown]
# ## Hold delivery against the engine work the proxy created
#
# Each point is one run. x: executions created at the proxy over [347, 947) s in
# multiples of Ĉ (1.0 = as many as the engine can serve); y: share of the hold
# cohort delivered by 840 s.

# %%
fig, ax = plt.subplots(figsize=(8, 5.5))
for i, (c, rs) in enumerate(by_condition.items()):        # hollow markers of different shapes: ties stay visible
    ax.scatter([r["rates_xC_created"] for r in rs], [hold_pct(r) for r in rs], s=70, marker="osD^vPX*"[i % 8],
               facecolors="none", edgecolors=f"C{i}", linewidths=1.5, label=c)
ax.axvline(1.0, color="0.6", ls="--", lw=1)
ax.set_xlabel("executions created over [347, 947) s (× Ĉ)")
ax.set_ylabel("hold cohort delivered by 840 s (% of offered)")
ax.set_title(f"{MODEL}, pulse {PULSE} Ĉ: hold delivery vs executions created ({len(SEEDS)} seeds)")
ax.set_ylim(-3, 105)
ax.grid(alpha=0.3)
ax.legend(fontsize=9, title="condition", loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
fig.savefig(os.path.join(OUT, "hold_vs_created.png"), dpi=90)
plt.show()

# %% [markdown]
# ## Table (mean over seeds)

# %%
def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


lines = ["| condition | runs | hold delivered % | hold within deadline % | recovered | recovery time s "
         "| attempts ×Ĉ | created ×Ĉ | completed ×Ĉ |", "|---" * 9 + "|"]
for c, rs in by_condition.items():
    lines.append(
        f"| {c} | {len(rs)} | {fmt(mean([hold_pct(r) for r in rs]), '.1f')} "
        f"| {fmt(mean([hold_pct(r, 'within_deadline') for r in rs]), '.1f')} "
        f"| {sum(bool(r['recovered']) for r in rs)}/{len(rs)} | {fmt(mean([r['recovery_time_s'] for r in rs]), '.0f')} "
        f"| {fmt(mean([r['rates_xC_attempts'] for r in rs]), '.2f')} "
        f"| {fmt(mean([r['rates_xC_created'] for r in rs]), '.2f')} "
        f"| {fmt(mean([r['rates_xC_completed'] for r in rs]), '.2f')} |")
table = "\n".join(lines)
with open(os.path.join(OUT, "table.md"), "w") as f:
    f.write(table + "\n")
display(Markdown(table))
