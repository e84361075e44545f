"""`llmsim sweep`, `paper`, `waste`: experiments built on the model."""
from __future__ import annotations

import argparse
import math
import os

from sim import verdict
from sim.conditions import CONDITIONS
from sim.experiments.figures import waste_plot
from sim.experiments.paper import DEFAULT_SEEDS, paper, write_report
from sim.experiments.sweep import ResultsFileError, cell_key, grid, read_rows, sweep
from sim.experiments.waste import table, waste_study
from sim.scenario import PAPER

from . import args
from .model_cmds import model_arg
from .scenario_cmds import deployment


def cmd_waste(a) -> int:
    prof = args.profile(a.model)
    if a.stop_rate is not None and len(a.stop_rate) != 1:
        raise args.UsageError("waste: --stop-rate takes one rate")
    if a.plot:
        args.check_output(a.plot)
    try:
        res = waste_study(prof, a.cancel_rate, stop_rate=a.stop_rate[0] if a.stop_rate else 0.2, rate=a.rate,
                          duration_s=a.duration, max_tokens=a.max_tokens, seed=a.seed)
    except ValueError as e:
        raise args.UsageError(f"waste: {e}") from None
    print(table(res))
    args.write_json(a.json, res)
    if a.plot:
        waste_plot(res, a.plot)
    return 0


def cmd_sweep(a) -> int:
    for c in a.conditions:
        if c not in CONDITIONS:
            raise args.UsageError(f"sweep: unknown condition {c!r}; valid: {', '.join(CONDITIONS)}")
    if any(not (math.isfinite(x) and 0 < x <= args.PULSE_MAX) for x in a.pulses or []):
        raise args.UsageError(f"sweep: pulses must be positive and at most {args.PULSE_MAX:g}")
    if any(x <= 0 for x in a.max_batched_tokens or []):
        raise args.UsageError("sweep: --max-batched-tokens must be positive")
    if a.workers is not None and a.workers < 1:
        raise args.UsageError("sweep: --workers must be at least 1")
    models = a.models or ([None] if a.scenario else [args.DEFAULT_MODEL])
    pulses = a.pulses or ([None] if a.scenario else [PAPER.pulse])
    for m in models:
        if m is not None:
            args.profile(m)
    args.check_output(a.out)
    if a.scenario:
        for m in models:                      # the scenario's bad input ends here, before any work
            deployment(argparse.Namespace(command="sweep", scenario=a.scenario, model=m, pulse=pulses[0],
                                          max_batched_tokens=(a.max_batched_tokens or [None])[0],
                                          mixed_prompts=a.mixed_prompts), layers=True)
    try:
        cells = grid(models, a.conditions, pulses, a.seeds, a.max_batched_tokens or [None],
                     [True] if a.mixed_prompts else [False], scenario=a.scenario)
    except ValueError as e:
        raise args.UsageError(f"sweep: {e}") from None
    try:
        res = sweep(cells, a.out, workers=a.workers, ray_address=a.ray, progress=not a.quiet)
    except ResultsFileError as e:
        raise args.UsageError(f"sweep: {e}") from None
    print(f"sweep: {res['total']} cells, {res['skipped']} already in {a.out}, ran {res['ran']} "
          f"in {res['wall_s']:.1f} s")
    keys = {c.key for c in cells}
    rows = [r for r in read_rows(a.out) if cell_key(r) in keys]
    summ = verdict.summarize_by(rows, key=lambda r: " ".join(
        [r["model"], r["condition"], f"pulse {r['pulse']:g}", f"mbt {r['max_batched_tokens']}"]
        + (["mixed"] if r["mixed_prompts"] else [])))
    print(verdict.table(summ, PAPER.deadline_s))
    print(verdict.legend(len(set(a.seeds))))
    return 0


def cmd_paper(a) -> int:
    seeds = a.seeds or DEFAULT_SEEDS
    if a.report_only:
        if not os.path.exists(os.path.join(a.out, "results.parquet")):
            raise args.UsageError(f"paper: no {os.path.join(a.out, 'results.parquet')} to report from")
        try:
            print(f"paper: wrote {write_report(a.out, seeds=seeds)}")
        except ResultsFileError as e:
            raise args.UsageError(f"paper: {e}") from None
        return 0
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise args.UsageError(f"paper: {a.out} exists and is not a directory")
    try:
        res = paper(a.out, seeds=seeds, workers=a.workers, ray_address=a.ray, progress=not a.quiet)
    except ResultsFileError as e:
        raise args.UsageError(f"paper: {e}") from None
    print(f"paper: {res['total']} cells, {res['skipped']} already done, ran {res['ran']} in "
          f"{res['wall_s']:.1f} s; wrote {res['report']}")
    return 0



def add_subcommands(sub) -> None:
    p = sub.add_parser("waste", help="steady-load cancellation waste (docs/model.md): KV policies x abort latencies")
    model_arg(p)
    p.add_argument("--cancel-rate", type=args.rates, default=[0.0, 0.1, 0.3], help="comma-separated, e.g. 0,0.1,0.3")
    p.add_argument("--stop-rate", type=args.rates, default=None,
                   help="share of responses ended by a stop sequence (0.2)")
    p.add_argument("--rate", type=args.positive(most=args.RATE_MAX), default=None,
                   help="calls/s (default: 90%% of the decode capacity)")
    p.add_argument("--duration", type=args.positive(most=args.DURATION_MAX), default=600.0,
                   help="seconds of arrivals (default 600)")
    p.add_argument("--max-tokens", type=args.positive(int, most=2**20), default=2048)
    p.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG of throughput and waste against cancellation rate")
    p.set_defaults(fn=cmd_waste)

    p = sub.add_parser("sweep", help="a grid of runs on local processes or Ray, appended to one Parquet file; "
                                     "re-running skips finished cells")
    p.add_argument("--models", type=args.comma_list(str, "profile names"), default=None,
                   help=f"comma-separated profiles (default {args.DEFAULT_MODEL}, or the --scenario's)")
    p.add_argument("--scenario", metavar="FILE|NAME", default=None,
                   help="every cell runs this scenario (file or name; `llmsim scenario show`); its rows carry "
                        "scenario_name and scenario_hash")
    p.add_argument("--conditions", type=args.comma_list(str, "condition names"), required=True,
                   help="comma-separated named conditions")
    p.add_argument("--pulses", type=args.comma_list(float, "numbers"), default=None,
                   help=f"comma-separated pulse rates in multiples of capacity (default {PAPER.pulse:g}, or the "
                        "--scenario's burst)")
    p.add_argument("--seeds", type=args.seeds, default=[0], help="e.g. 0-4 or 0,1,2 (default 0)")
    p.add_argument("--max-batched-tokens", type=args.comma_list(int, "whole numbers"), default=None,
                   help="comma-separated step budgets (default: the profile's)")
    p.add_argument("--mixed-prompts", action="store_true",
                   help="half the calls get 3,000-token prompts; Ĉ is the capacity protocol's on that mix")
    p.add_argument("--out", required=True, metavar="PATH", help="the Parquet file (created or extended)")
    p.add_argument("--workers", type=int, default=None, help="local processes (default: all cores)")
    p.add_argument("--ray", metavar="ADDRESS|auto", default=None,
                   help="run on a Ray cluster instead (auto: the running one; local: start one here)")
    p.add_argument("--quiet", action="store_true", help="no progress line per finished cell")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("paper", help="every block of the reference design on the three embedded models, "
                                     "then report.md and PNG figures from DIR/results.parquet")
    p.add_argument("--out", default="paper", metavar="DIR", help="output directory (default ./paper)")
    p.add_argument("--seeds", type=args.positive(int), default=None, metavar="N",
                   help="seeds 0..N-1 per cell (default 3; the published counts are not known)")
    p.add_argument("--workers", type=args.positive(int), default=None, help="local processes (default: all cores)")
    p.add_argument("--ray", metavar="ADDRESS|auto", default=None, help="run on a Ray cluster instead")
    p.add_argument("--report-only", action="store_true", help="only rewrite the report from DIR/results.parquet")
    p.add_argument("--quiet", action="store_true", help="no progress line per finished cell")
    p.set_defaults(fn=cmd_paper)
