"""The reference design's figures (`llmsim paper`), computed from the rows
of the results file only, never from live state."""
from __future__ import annotations

import math
import statistics

import matplotlib

matplotlib.use("Agg")
import os

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from ..conditions import CONDITIONS, DIAGNOSTIC
from .design import BLOCK_FIGURES, BLOCKS, COHORTS, FIGURES, PULSE, block_rows, share


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.fmean(xs) if xs else float("nan")


def _base(rows):
    """Rows at the reference pulse, default step budget, uniform prompts."""
    return [r for r in rows if r["pulse"] == PULSE and not r["mixed_prompts"] and r["max_batched_tokens"] == 8192]


def _by(rows, *keys):
    out: dict = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _conditions(rows):
    present = {r["condition"] for r in rows}
    return [c for c in CONDITIONS if c in present]


def write(out_dir: str, rows: list[dict], models, seeds: int, blocks) -> None:
    """Every figure of the report into out_dir, from the results' rows."""
    _figures(out_dir, rows, models)
    _block_figures(out_dir, rows, models, seeds, [b.name for b in blocks])


def _figures(out_dir, rows, models):
    models = [m for m in models if any(r["model"] == m for r in rows)] or list(models)
    base = _base(rows)
    conds = _conditions(base)
    colors = {m: f"C{i}" for i, m in enumerate(models)}

    # 1. diagnostic block: delivered per 60 s and waiting queue, one column per condition (seed 0 or lowest)
    diag = [c for c in DIAGNOSTIC]
    fig, ax = plt.subplots(2, len(diag), figsize=(4.2 * len(diag), 7), sharex=True, squeeze=False)
    groups = _by(base, "model", "condition")
    for j, c in enumerate(diag):
        for m in models:
            rs = sorted(groups.get((m, c), []), key=lambda r: r["seed"])
            if not rs:
                continue
            r = rs[0]
            binw = r.get("series_delivered_bin_s") or 60.0
            d = r["series_delivered_per_60s"]
            ax[0][j].step([binw * (i + 1) for i in range(len(d))], d, where="pre", color=colors[m], label=m)
            q = [w + p for w, p in zip(r["series_waiting"], r["series_proxy_queue"])]
            ax[1][j].plot(r["series_t"], q, color=colors[m], label=m, lw=1)
        ax[0][j].set_title(c)
        for a in (ax[0][j], ax[1][j]):
            a.axvspan(120, 227, color="0.9", zorder=0)
            a.grid(alpha=0.3)
        ax[1][j].set_xlabel("time since run start (s)")
    ax[0][0].set_ylabel("calls delivered per 60 s")
    ax[1][0].set_ylabel("waiting executions (engine + proxy)")
    ax[0][0].legend(fontsize=9, title="model (seed 0); grey = pulse")
    fig.suptitle(f"Diagnostic block, pulse {PULSE} Ĉ")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, FIGURES[0]), dpi=90)
    plt.close(fig)

    def per_model_bars(fname, series, ylabel, title, stacked):
        fig, ax = plt.subplots(len(models), 1, figsize=(max(8, 0.75 * len(conds) + 3), 3.2 * len(models)),
                               squeeze=False)
        for i, m in enumerate(models):
            a = ax[i][0]
            x = range(len(conds))
            n = len(series)
            bottom = [0.0] * len(conds)
            for k, (label, fn) in enumerate(series):
                vals = [_mean([fn(r) for r in groups.get((m, c), [])]) for c in conds]
                vals = [0.0 if math.isnan(v) else v for v in vals]
                if stacked:
                    a.bar(x, vals, bottom=bottom, label=label, color=f"C{k}")
                    bottom = [b + v for b, v in zip(bottom, vals)]
                else:
                    w = 0.8 / n
                    a.bar([xi - 0.4 + w * (k + 0.5) for xi in x], vals, width=w, label=label, color=f"C{k}")
            a.set_xticks(list(x))
            a.set_xticklabels(conds, rotation=35, ha="right", fontsize=8)
            a.set_ylabel(ylabel)
            a.set_title(f"{m}, pulse {PULSE} Ĉ (mean over seeds)", fontsize=10)
            a.grid(axis="y", alpha=0.3)
        ax[0][0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=90)
        plt.close(fig)

    # 2. execution rates per Ĉ
    per_model_bars(FIGURES[1], [(k, (lambda r, k=k: r[f"rates_xC_{k}"]))
                                for k in ("attempts", "created", "accepted", "completed")],
                   "rate over [347, 947) s (× Ĉ)", "Execution rates per Ĉ by condition", stacked=False)
    # 3. prompt-work shares
    per_model_bars(FIGURES[2], [(k.replace("_", " "),
                                 (lambda r, k=k: share(r[f"prompt_tokens_{k}"], r["prompt_tokens_computed"])))
                                for k in ("never_aborted", "aborted_body", "aborted_in_flight")],
                   "share of computed prompt tokens", "Prompt work by fate of the execution", stacked=True)

    # 4. delivery shares by cohort
    nrow = len(models) * len(COHORTS)
    fig, axs = plt.subplots(nrow, 1, figsize=(max(9, 0.6 * len(conds) + 3), 2.3 * nrow + 1.5), squeeze=False,
                            sharex=True)
    ax = [[axs[i * len(COHORTS) + j][0] for j in range(len(COHORTS))] for i in range(len(models))]
    parts = (("within deadline", "within_deadline", "C2"), ("late", "late", "C1"),
             ("undelivered", "undelivered", "C3"))
    for i, m in enumerate(models):
        for j, coh in enumerate(COHORTS):
            a = ax[i][j]
            bottom = [0.0] * len(conds)
            for label, key, col in parts:
                vals = [_mean([share(r[f"{coh}_{key}"], r[f"{coh}_offered"]) for r in groups.get((m, c), [])])
                        for c in conds]
                vals = [0.0 if math.isnan(v) else 100 * v for v in vals]
                a.bar(range(len(conds)), vals, bottom=bottom, color=col, label=label)
                bottom = [b + v for b, v in zip(bottom, vals)]
            a.set_xticks(range(len(conds)))
            a.set_xticklabels(conds, rotation=35, ha="right", fontsize=8)
            a.set_title(f"{m}: {coh} cohort", fontsize=10)
            a.set_ylabel("% of offered calls")
    ax[0][0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Delivery by cohort and condition, pulse {PULSE} Ĉ (mean over seeds)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / (2.3 * nrow + 1.5)))
    fig.savefig(os.path.join(out_dir, FIGURES[3]), dpi=90)
    plt.close(fig)

    # 5. creation rate vs primary delivery, every run
    fig, a = plt.subplots(figsize=(8, 5.5))
    for m in models:
        rs = [r for r in rows if r["model"] == m]
        a.scatter([r["rates_xC_created"] for r in rs],
                  [100 * share(r["primary_delivered"], r["primary_offered"]) for r in rs],
                  s=18, alpha=0.7, color=colors[m], label=f"{m} ({len(rs)} runs)")
    a.set_xlabel("executions created over [347, 947) s (× Ĉ)")
    a.set_ylabel("primary cohort delivered (% of offered)")
    a.set_title("Execution creation rate vs primary delivery, every run")
    a.grid(alpha=0.3)
    a.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, FIGURES[4]), dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------ per-block figures
def _hold_pct(rs):
    """Hold delivered by 840 s, % of offered: (mean, min, max) over the runs; NaNs when none."""
    v = [100 * share(r["hold_delivered"], r["hold_offered"]) for r in rs]
    return (statistics.fmean(v), min(v), max(v)) if v else (float("nan"),) * 3


def _block_figures(out_dir, rows, models, seeds, names):
    """BLOCK_FIGURES for the reported blocks, from the block's own cells (the table's groups)."""
    names = [n for n in names if n in BLOCK_FIGURES]
    if not names:
        return
    by = {b.name: b for b in BLOCKS}
    models = list(models)
    cond_color = {c: f"C{i}" for i, c in enumerate(DIAGNOSTIC)}
    ylabel = "hold cohort delivered by 840 s\n(% of offered calls)"

    def groups(name):
        return block_rows(by[name], rows, models, seeds)

    def axes(title):
        fig, ax = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.6), squeeze=False, sharey=True)
        fig.suptitle(title)
        ax = ax[0]
        ax[0].set_ylabel(ylabel)
        for a, m in zip(ax, models):
            a.set_title(m, fontsize=10)
            a.set_ylim(-3, 108)
            a.grid(alpha=0.3)
        return fig, ax

    def save(fig, name, legend_ax):
        handles, labels = legend_ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(os.path.join(out_dir, BLOCK_FIGURES[name]), dpi=90)
        plt.close(fig)

    def bars(name, title, variants):
        """One bar per (condition, variant): variants = [(label, groups, key of the group)]."""
        fig, ax = axes(title)
        w = 0.8 / len(variants)
        for a, m in zip(ax, models):
            for k, (label, g, key) in enumerate(variants):
                stats = [_hold_pct(g.get(key(m, c), [])) for c in DIAGNOSTIC]
                x = [i - 0.4 + w * (k + 0.5) for i in range(len(DIAGNOSTIC))]
                mean = [0.0 if math.isnan(s[0]) else s[0] for s in stats]
                err = [[0.0 if math.isnan(s[0]) else s[0] - s[1] for s in stats],
                       [0.0 if math.isnan(s[0]) else s[2] - s[0] for s in stats]]
                a.bar(x, mean, width=w, yerr=err, capsize=2, color=f"C{k}", label=label)
                for xi, s in zip(x, stats):
                    a.text(xi, 1 if math.isnan(s[0]) else s[2] + 1, "not run" if math.isnan(s[0]) else f"{s[0]:.0f}",
                           rotation=90 if math.isnan(s[0]) else 0, ha="center", va="bottom", fontsize=7)
            a.set_xticks(range(len(DIAGNOSTIC)))
            a.set_xticklabels(DIAGNOSTIC, rotation=25, ha="right", fontsize=9)
        save(fig, name, ax[0])

    if "trigger" in names:
        fig, ax = axes("Trigger sweep: hold delivery vs pulse size (mean over seeds, bars = min–max)")
        g = groups("trigger")
        for a, m in zip(ax, models):
            for c in DIAGNOSTIC:
                pts = sorted((k[2], _hold_pct(rs)) for k, rs in g.items() if k[0] == m and k[1] == c and rs)
                if pts:
                    a.errorbar([p for p, _ in pts], [s[0] for _, s in pts],
                               yerr=[[s[0] - s[1] for _, s in pts], [s[2] - s[0] for _, s in pts]],
                               marker="o", capsize=3, color=cond_color[c], label=c)
            a.set_xticks(by["trigger"].pulses)
            a.set_xlabel("pulse arrival rate (× Ĉ)")
        save(fig, "trigger", ax[0])

    if "tracing" in names:
        g = groups("tracing")
        bars("tracing", f"Tracing: hold delivery by step budget, pulse {PULSE} Ĉ (mean over seeds, bars = min–max)",
             [(f"step budget {mbt} tokens", g, (lambda m, c, mbt=mbt: next(
                 (k for k in g if k[0] == m and k[1] == c and k[3] == mbt), None)))
              for mbt in by["tracing"].max_batched_tokens])

    if "mixed" in names:
        gm, gu = groups("mixed"), groups("diagnostic")
        bars("mixed", f"Uniform vs mixed prompts: hold delivery, pulse {PULSE} Ĉ (mean over seeds, bars = min–max)",
             [(label, g, (lambda m, c, g=g: next((k for k in g if k[0] == m and k[1] == c), None)))
              for label, g in (("uniform prompts", gu), ("mixed prompts (half at 3,000 tokens)", gm))])


# ------------------------------------------------------------------ llmsim waste
def waste_plot(res: dict, path: str) -> None:
    """Throughput and waste against cancellation rate, one line per KV policy
    and abort latency, from the result record alone."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {("on-demand", "v1"): ("C0", "-"), ("on-demand", "v0"): ("C0", "--"),
              ("reserve", "v1"): ("C3", "-"), ("reserve", "v0"): ("C3", "--")}
    panels = (("useful_tokens_per_s", "useful tokens/s"),
              ("discarded_busy_share", "share of busy time on tokens no client received"),
              ("useful_token_ratio", "useful_token_ratio"))
    for (kv, lat), (color, ls) in styles.items():
        rows = sorted((r for r in res["results"] if r["kv_policy"] == kv and r["abort_latency"] == lat),
                      key=lambda r: r["cancel_rate"])
        if not rows:
            continue
        x = [r["cancel_rate"] for r in rows]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(x, [r[key] for r in rows], color=color, ls=ls, marker="o", label=f"{kv}, abort {lat}")
    for ax, (_, label) in zip(axes, panels):
        ax.set_xlabel("cancellation rate")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{res['model']}: {res['rate']:.3g} calls/s, max_tokens {res['max_tokens']}, "
                 f"stop rate {res['stop_rate']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
