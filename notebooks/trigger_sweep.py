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
# # Trigger sweep: how large a pulse does service survive?
#
# Qwen2.5-7B-Instruct (the embedded `qwen2.5-7b` profile), pulses of 1.5, 2 and
# 2.7 Ĉ, the four diagnostic conditions, a couple of seeds each. The runs go
# through `sim.experiments.sweep.sweep()` into one Parquet file; the plots are computed from
# that file only (re-running skips the finished runs).
#
# Outputs go to `$LLMSIM_NOTEBOOK_OUT/trigger_sweep/` (default `./notebook_out/`).

# %%
import os
import statistics

import matplotlib.pyplot as plt
import pyarrow.parquet as pq
from IPython.display import Markdown, display

from sim.conditions import DIAGNOSTIC
from sim.experiments.sweep import grid, sweep

MODEL = "qwen2.5-7b"
PULSES = (1.5, 2.0, 2.7)
SEEDS = range(int(os.environ.get("LLMSIM_NOTEBOOK_SEEDS", "2")))
HOLD_S = 720          # the hold cohort's span after the pulse ends: [227, 947) s

OUT = os.path.join(os.environ.get("LLMSIM_NOTEBOOK_OUT", "notebook_out"), "trigger_sweep")
os.makedirs(OUT, exist_ok=True)
RESULTS = os.path.join(OUT, "results.parquet")

# %% [markdown]
# ## Run the grid (a run takes about half a second; already finished runs are skipped)

# %%
cells = grid([MODEL], DIAGNOSTIC, PULSES, SEEDS)
summary = sweep(cells, RESULTS, workers=2, progress=False)
print(f"{summary['ran']} runs, {summary['skipped']} already in {RESULTS}, {summary['wall_s']:.1f} s")

# %% [markdown]
# ## Read the results back

# %%
rows = [r for r in pq.read_table(RESULTS).to_pylist()
        if r["model"] == MODEL and r["pulse"] in PULSES and r["condition"] in DIAGNOSTIC]
groups = {(c, p): [r for r in rows if r["condition"] == c and r["pulse"] == p] for c in DIAGNOSTIC for p in PULSES}


def hold_pct(r):
    """Share of the hold cohort's offered calls delivered by 840 s, in %."""
    return 100 * r["hold_delivered"] / r["hold_offered"]


# %% [markdown]
# ## Hold delivery and recovery time against the pulse size
#
# Left: mean over seeds, bars from the lowest to the highest seed. Right: recovery
# time of each run (after the pulse end); a run that has not recovered by the end
# of the hold is drawn as × on the dashed line.

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
for i, c in enumerate(DIAGNOSTIC):
    col = f"C{i}"
    stats = [[hold_pct(r) for r in groups[c, p]] for p in PULSES]
    m = [statistics.fmean(v) for v in stats]
    a1.errorbar(PULSES, m, yerr=[[x - min(v) for x, v in zip(m, stats)], [max(v) - x for x, v in zip(m, stats)]],
                marker="o", capsize=3, color=col, label=c)
    dx = (i - 1.5) * 0.03                      # spread the conditions a little so points do not hide each other
    rec = [(p + dx, r["recovery_time_s"]) for p in PULSES for r in groups[c, p] if r["recovered"]]
    never = [p + dx for p in PULSES for r in groups[c, p] if not r["recovered"]]
    a2.scatter([x for x, _ in rec], [y for _, y in rec], color=col, marker="o", label=c)
    a2.scatter(never, [HOLD_S] * len(never), color=col, marker="x", s=60)
a1.set_ylabel("hold cohort delivered by 840 s (% of offered)")
a1.set_ylim(-3, 103)
a2.axhline(HOLD_S, color="0.5", ls="--", lw=1)
a2.text(PULSES[0], HOLD_S, "not recovered by the end of the hold", va="bottom", fontsize=8, color="0.3")
a2.set_ylabel("recovery time after the pulse end (s)")
a2.set_ylim(0, HOLD_S + 60)
for a in (a1, a2):
    a.set_xlabel("pulse arrival rate (× Ĉ)")
    a.set_xticks(PULSES)
    a.grid(alpha=0.3)
a1.legend(fontsize=9, title="condition")
fig.suptitle(f"{MODEL}: trigger sweep ({len(SEEDS)} seeds per point)")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "trigger.png"), dpi=90)
plt.show()

# %% [markdown]
# ## Table (mean over seeds)

# %%
lines = ["| condition | pulse ×Ĉ | runs | hold delivered % | recovered | recovery time s |", "|---" * 6 + "|"]
for (c, p), rs in groups.items():
    rt = [r["recovery_time_s"] for r in rs if r["recovered"]]
    lines.append(f"| {c} | {p:g} | {len(rs)} | {statistics.fmean(hold_pct(r) for r in rs):.1f} "
                 f"| {len(rt)}/{len(rs)} | {f'{statistics.fmean(rt):.0f}' if rt else '–'} |")
table = "\n".join(lines)
with open(os.path.join(OUT, "table.md"), "w") as f:
    f.write(table + "\n")
display(Markdown(table))
