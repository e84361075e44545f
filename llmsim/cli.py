"""`llmsim` command line (SPEC §9). Every command exits non-zero with a
one-line reason on bad input."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from . import measures
from .capacity import capacity_protocol
from .conditions import CONDITIONS, DIAGNOSTIC, Condition, compose, get_condition, parse_cancel
from .latency import latency
from .model import simulate
from .profile import ProfileError, load_profile, embedded_names
from .scenario import PAPER
from .workload import make_trace

DEFAULT_MODEL = "qwen2.5-7b"


class UsageError(Exception):
    pass


def _profile(name: str):
    try:
        return load_profile(name)
    except ProfileError as e:
        raise UsageError(str(e)) from None


def _positive(kind=float, allow_zero=False):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'number' if kind is float else 'whole number'}, got {s!r}")
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'non-negative' if allow_zero else 'positive'}, got {s}")
        return v
    return parse


def _cancel(s: str) -> str:
    try:
        parse_cancel(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _check_output(path: str | None) -> None:
    """Refuse an unwritable --json path before any work is done."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"cannot write {path}: directory {d} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a directory")


def _write_json(path: str | None, obj) -> None:
    if not path:
        return
    _check_output(path)
    measures.write_json(path, obj)


def _scenario(args):
    return PAPER.with_(pulse=args.pulse)


def run_one(profile, condition: str | Condition, pulse: float, seed: int, max_batched_tokens=None,
            mixed_prompts=False, trace=None, fast_forward=True) -> dict:
    cond = condition if isinstance(condition, Condition) else get_condition(condition)
    sc = PAPER.with_(pulse=pulse)
    if trace is None:
        trace = make_trace(profile.capacity, sc, seed, mixed_prompts=mixed_prompts)
    log = simulate(profile, trace, cond, sc, seed, max_batched_tokens=max_batched_tokens, fast_forward=fast_forward)
    inputs = {"model": profile.name, "condition": cond.name, "pulse": pulse, "seed": seed,
              "max_batched_tokens": max_batched_tokens or profile.engine["max_num_batched_tokens"],
              "mixed_prompts": mixed_prompts, "condition_settings": cond.settings(),
              "profile_provenance": profile.provenance.get("kind")}
    return measures.record(log, sc, profile.capacity, inputs)


# ------------------------------------------------------------------ commands
_CONTROL_FLAGS = ("retries", "cancel", "coalesce", "budget", "order", "proxy_cap", "queue", "engine_cap")


def _condition(a) -> Condition:
    """The named condition (default no-control) with any control flags applied."""
    changes = {k: getattr(a, k) for k in _CONTROL_FLAGS if getattr(a, k) is not None}
    if a.condition is None and not changes:
        raise UsageError(f"{a.command}: give --condition NAME or control flags (--cancel, --coalesce, --budget, "
                         f"--order, --proxy-cap, --queue, --engine-cap, --retries); names: {', '.join(CONDITIONS)}")
    if "retries" in changes:
        changes["retries"] = changes["retries"] == "on"
    if not changes:
        return get_condition(a.condition)
    try:
        return compose(a.condition, **changes)
    except ValueError as e:
        raise UsageError(f"{a.command}: {e}") from None


def cmd_run(a) -> int:
    prof = _profile(a.model)
    rec = run_one(prof, _condition(a), a.pulse, a.seed, a.max_batched_tokens, a.mixed_prompts)
    print(measures.summary(rec))
    _write_json(a.json, rec)
    return 0


def cmd_proxy(a) -> int:
    from validate.proxy import main as proxy_main
    return proxy_main(a.upstream, _condition(a), a.host, a.port, a.prompt_throughput)


def cmd_capacity(a) -> int:
    prof = _profile(a.model)
    sc = PAPER
    seeds = a.seeds if a.seeds is not None else [a.seed]

    def progress(st):
        print(f"  stage {st['stage']}: {st['rate']:.3f} calls/s (realised {st['realised_rate']:.3f}), "
              f"waiting queue growth {st['queue_growth']:+.3f}/s", file=sys.stderr, flush=True)
    runs = []
    for seed in seeds:
        if len(seeds) > 1:
            print(f"seed {seed}:", file=sys.stderr, flush=True)
        r = capacity_protocol(prof, sc, seed=seed, start_rate=a.start_rate, max_batched_tokens=a.max_batched_tokens,
                              progress=progress)
        runs.append(r)
        print(f"{prof.name}: capacity {r['capacity']:.3f} calls/s, seed {seed} "
              f"(saturated at stage {r['saturated_stage']}; profile says {prof.capacity:.3f})", flush=True)
    if len(runs) == 1:
        res = dict(runs[0], model=prof.name, profile_capacity=prof.capacity)
    else:
        caps = [r["capacity"] for r in runs]
        mean = sum(caps) / len(caps)
        sd = (sum((c - mean) ** 2 for c in caps) / (len(caps) - 1)) ** 0.5
        print(f"{prof.name}: capacity over {len(caps)} seeds: mean {mean:.3f} calls/s, standard deviation "
              f"{sd:.3f}, lowest {min(caps):.3f}, highest {max(caps):.3f}")
        res = {"model": prof.name, "profile_capacity": prof.capacity, "seeds": seeds, "capacity_mean": mean,
               "capacity_sd": sd, "runs": runs}
    _write_json(a.json, res)
    return 0


def cmd_latency(a) -> int:
    prof = _profile(a.model)
    res = latency(prof, a.rate, a.duration, seed=a.seed, max_batched_tokens=a.max_batched_tokens)
    print(f"{prof.name} at {a.rate:g} calls/s for {a.duration:g} s ({res['calls']} calls after warm-up): "
          f"TTFT p50 {res['ttft_p50']:.3f} s, p90 {res['ttft_p90']:.3f} s; "
          f"E2E p50 {res['e2e_p50']:.3f} s, p90 {res['e2e_p90']:.3f} s")
    _write_json(a.json, res)
    return 0


def _pct_cell(recs: list[dict], cohort: str, k: str) -> str:
    """One cohort's share over the seeds: the mean, with the range when there
    are several."""
    v = [100.0 * r["cohorts"][cohort][k] / r["cohorts"][cohort]["offered"] for r in recs
         if r["cohorts"][cohort]["offered"]]
    if not v:
        return "-"
    mean = sum(v) / len(v)
    return f"{mean:.1f}%" if min(v) == max(v) else f"{mean:.1f}% ({min(v):.1f}-{max(v):.1f})"


def _recovered_cell(recs: list[dict]) -> str:
    t = [r["recovery_time_s"] for r in recs if r["recovered"]]
    if not t:
        return "no"
    span = f"{min(t):.0f} s" if min(t) == max(t) else f"{min(t):.0f}-{max(t):.0f} s"
    return f"yes, {span}" if len(t) == len(recs) else f"{len(t)}/{len(recs)}, {span}"


def diagnose_table(recs: list[dict]) -> str:
    """The diagnostic table; records of several seeds are summarised per
    condition (mean, with the range over seeds)."""
    head = ("condition", "hold deliv", "hold <=120s", "pulse deliv", "pulse <=120s", "primary deliv",
            "primary <=120s", "recovered", "created/C", "accepted/C")
    rows = [head]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["condition"], []).append(r)
    for name, rs in by.items():
        rate = lambda k: f"{sum(r['rates_xC'][k] for r in rs) / len(rs):.2f}"
        rows.append((name, _pct_cell(rs, "hold", "delivered"), _pct_cell(rs, "hold", "within_deadline"),
                     _pct_cell(rs, "pulse", "delivered"), _pct_cell(rs, "pulse", "within_deadline"),
                     _pct_cell(rs, "primary", "delivered"), _pct_cell(rs, "primary", "within_deadline"),
                     _recovered_cell(rs), rate("created"), rate("accepted")))
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows)


def cmd_diagnose(a) -> int:
    from . import reference
    prof = _profile(a.model)
    sc = PAPER.with_(pulse=a.pulse)
    seeds = a.seeds if a.seeds is not None else [a.seed]
    recs = []
    for seed in seeds:
        trace = make_trace(prof.capacity, sc, seed)
        print(f"{prof.name}: capacity {prof.capacity:.3f} calls/s ({prof.provenance.get('kind')}); pulse {a.pulse:g} "
              f"x C for {sc.pulse_s:g} s, hold {sc.hold_load:g} x C; {len(trace)} calls, seed {seed}", flush=True)
        for c in DIAGNOSTIC:
            t0 = time.perf_counter()
            recs.append(run_one(prof, c, a.pulse, seed, trace=trace))
            print(f"  ran {c} in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    if len(seeds) > 1:
        print(f"{len(seeds)} seeds ({_seed_list(seeds)}): mean (lowest-highest) per cell")
    print(diagnose_table(recs))
    print("recovered: two consecutive 60 s hold windows each delivering >= 98% within 120 s with an empty queue; "
          "time counted from the pulse end")
    ref_rows = None
    if reference.applies(prof.name, a.pulse):
        ref_rows = reference.compare(recs)
        print(f"\nSPEC §7 reference (Qwen2.5-7B-Instruct on one H100, pulse {reference.PULSE:g} x C); bar: hold "
              f"delivery within {reference.BAR_POINTS:g} points, recovery within one {reference.BAR_WINDOW_S:g} s "
              f"window; simulated figures are means over the seeds run")
        print(reference.table(ref_rows))
    _write_json(a.json, {"model": prof.name, "pulse": a.pulse, "seeds": seeds, "capacity": prof.capacity,
                         "runs": recs, "reference": ref_rows})
    return 0


def _seed_list(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def cmd_conditions(a) -> int:
    for name, c in CONDITIONS.items():
        print(f"{name:22s} {c.describe()}")
    return 0


def _rates(s: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not v or any(not (0.0 <= x <= 1.0) for x in v):
        raise argparse.ArgumentTypeError(f"rates must lie in [0, 1], got {s!r}")
    return v


def cmd_waste(a) -> int:
    from .waste import waste_study, table, plot
    prof = _profile(a.model)
    if a.stop_rate is not None and len(a.stop_rate) != 1:
        raise UsageError("waste: --stop-rate takes one rate")
    if a.plot:
        _check_output(a.plot)
    try:
        res = waste_study(prof, a.cancel_rate, stop_rate=a.stop_rate[0] if a.stop_rate else 0.2, rate=a.rate,
                          duration_s=a.duration, max_tokens=a.max_tokens, seed=a.seed)
    except ValueError as e:
        raise UsageError(f"waste: {e}") from None
    print(table(res))
    _write_json(a.json, res)
    if a.plot:
        plot(res, a.plot)
    return 0


def _list(kind, what):
    def parse(s: str):
        try:
            v = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None
        if not v:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}")
        return v
    return parse


def _seeds(s: str) -> list[int]:
    from .sweep import parse_seeds
    try:
        return parse_seeds(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_sweep(a) -> int:
    from .sweep import grid, sweep
    for c in a.conditions:
        if c not in CONDITIONS:
            raise UsageError(f"sweep: unknown condition {c!r}; valid: {', '.join(CONDITIONS)}")
    if any(not (math.isfinite(x) and x > 0) for x in a.pulses):
        raise UsageError("sweep: pulses must be positive")
    if any(x <= 0 for x in a.max_batched_tokens or []):
        raise UsageError("sweep: --max-batched-tokens must be positive")
    if a.workers is not None and a.workers < 1:
        raise UsageError("sweep: --workers must be at least 1")
    for m in a.models:
        _profile(m)
    _check_output(a.out)
    cells = grid(a.models, a.conditions, a.pulses, a.seeds, a.max_batched_tokens or [None],
                 [True] if a.mixed_prompts else [False])
    res = sweep(cells, a.out, workers=a.workers, ray_address=a.ray, progress=not a.quiet)
    print(f"sweep: {res['total']} cells, {res['skipped']} already in {a.out}, ran {res['ran']} "
          f"in {res['wall_s']:.1f} s")
    return 0


def cmd_paper(a) -> int:
    from .paper import DEFAULT_SEEDS, paper, write_report
    seeds = a.seeds or DEFAULT_SEEDS
    if a.report_only:
        if not os.path.exists(os.path.join(a.out, "results.parquet")):
            raise UsageError(f"paper: no {os.path.join(a.out, 'results.parquet')} to report from")
        print(f"paper: wrote {write_report(a.out, seeds=seeds)}")
        return 0
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UsageError(f"paper: {a.out} exists and is not a directory")
    res = paper(a.out, seeds=seeds, workers=a.workers, ray_address=a.ray, progress=not a.quiet)
    print(f"paper: {res['total']} cells, {res['skipped']} already done, ran {res['ran']} in "
          f"{res['wall_s']:.1f} s; wrote {res['report']}")
    return 0


# -------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _model_arg(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded profile ({', '.join(embedded_names())}) or a profile JSON path "
                        f"(default {DEFAULT_MODEL})")


def _control_args(p) -> None:
    """The control flags that compose a condition (`run`, `proxy`)."""
    g = p.add_argument_group("controls (each changes the condition's setting)")
    g.add_argument("--retries", choices=("on", "off"), default=None, help="client retries (R = 3) on or off")
    g.add_argument("--cancel", type=_cancel, default=None, metavar="off|now|deferred[:W]",
                   help="cancellation: off, now, or deferred W seconds (default 10)")
    g.add_argument("--coalesce", action="store_true", default=None,
                   help="a retry attaches to its call's live execution")
    g.add_argument("--budget", type=_positive(allow_zero=True), default=None, metavar="RATIO",
                   help="retry budget: retries <= RATIO x first attempts over 60 s (0: off)")
    g.add_argument("--order", choices=("budget-first", "lookup-first"), default=None,
                   help="which check comes first: the retry budget or the lookup of a live execution")
    g.add_argument("--proxy-cap", type=_positive(int, allow_zero=True), default=None, metavar="N",
                   help="at most N executions outstanding in the engine; more wait in the proxy (0: off)")
    g.add_argument("--queue", choices=("fifo", "deadline", "lifo"), default=None,
                   help="dequeue order of the proxy queue")
    g.add_argument("--engine-cap", type=_positive(int, allow_zero=True), default=None, metavar="Q",
                   help="the engine refuses (503) beyond Q executions waiting or running (0: off)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="llmsim", description="Simulate a vLLM engine behind retrying clients and an "
                                           "overload-control proxy: does service come back after a burst?")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser, required=True)

    p = sub.add_parser("run", help="one run of one condition; prints a summary, writes the result record")
    _model_arg(p)
    p.add_argument("--condition", help=f"one of: {', '.join(CONDITIONS)} (default no-control when control "
                                      "flags are given; the flags change its settings)")
    p.add_argument("--pulse", type=_positive(), default=PAPER.pulse, help="pulse rate in multiples of capacity")
    p.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    p.add_argument("--max-batched-tokens", type=_positive(int), default=None)
    p.add_argument("--mixed-prompts", action="store_true", help="half the calls get 3,000-token prompts")
    p.add_argument("--json", metavar="PATH")
    _control_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("capacity", help="the capacity protocol (SPEC §6) on the simulator")
    _model_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    g.add_argument("--seeds", type=_seeds, default=None,
                   help="one protocol run per seed, e.g. 0-7: their mean and spread (one run's Ĉ is noisy)")
    p.add_argument("--start-rate", type=_positive(), default=1.0)
    p.add_argument("--max-batched-tokens", type=_positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_capacity)

    p = sub.add_parser("latency", help="steady Poisson load straight to the engine: TTFT and E2E percentiles")
    _model_arg(p)
    p.add_argument("--rate", type=_positive(), required=True, help="calls/s")
    p.add_argument("--duration", type=_positive(), default=600.0, help="seconds of arrivals (default 600)")
    p.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    p.add_argument("--max-batched-tokens", type=_positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_latency)

    p = sub.add_parser("diagnose", help="the four diagnostic conditions on one trace, as a table; "
                                        "qwen2.5-7b at pulse 2.7 is compared with SPEC §7")
    _model_arg(p)
    p.add_argument("--pulse", type=_positive(), default=PAPER.pulse)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    g.add_argument("--seeds", type=_seeds, default=None,
                   help="several traces, e.g. 0-4: the table gives the mean and range over them")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_diagnose)

    p = sub.add_parser("conditions", help="list the named conditions")
    p.set_defaults(fn=cmd_conditions)

    p = sub.add_parser("waste", help="steady-load cancellation waste (SPEC §10): KV policies x abort latencies")
    _model_arg(p)
    p.add_argument("--cancel-rate", type=_rates, default=[0.0, 0.1, 0.3], help="comma-separated, e.g. 0,0.1,0.3")
    p.add_argument("--stop-rate", type=_rates, default=None, help="share of responses ended by a stop sequence (0.2)")
    p.add_argument("--rate", type=_positive(), default=None, help="calls/s (default: 90%% of the decode capacity)")
    p.add_argument("--duration", type=_positive(), default=600.0, help="seconds of arrivals (default 600)")
    p.add_argument("--max-tokens", type=_positive(int), default=2048)
    p.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG of throughput and waste against cancellation rate")
    p.set_defaults(fn=cmd_waste)

    p = sub.add_parser("sweep", help="a grid of runs on local processes or Ray, appended to one Parquet file; "
                                     "re-running skips finished cells")
    p.add_argument("--models", type=_list(str, "profile names"), default=[DEFAULT_MODEL],
                   help=f"comma-separated profiles (default {DEFAULT_MODEL})")
    p.add_argument("--conditions", type=_list(str, "condition names"), required=True,
                   help="comma-separated named conditions")
    p.add_argument("--pulses", type=_list(float, "numbers"), default=[PAPER.pulse],
                   help="comma-separated pulse rates in multiples of capacity")
    p.add_argument("--seeds", type=_seeds, default=[0], help="e.g. 0-4 or 0,1,2 (default 0)")
    p.add_argument("--max-batched-tokens", type=_list(int, "whole numbers"), default=None,
                   help="comma-separated step budgets (default: the profile's)")
    p.add_argument("--mixed-prompts", action="store_true", help="half the calls get 3,000-token prompts")
    p.add_argument("--out", required=True, metavar="PATH", help="the Parquet file (created or extended)")
    p.add_argument("--workers", type=int, default=None, help="local processes (default: all cores)")
    p.add_argument("--ray", metavar="ADDRESS|auto", default=None,
                   help="run on a Ray cluster instead (auto: the running one; local: start one here)")
    p.add_argument("--quiet", action="store_true", help="no progress line per finished cell")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("paper", help="every block of the reference design on the three embedded models, "
                                     "then report.md and PNG figures from DIR/results.parquet")
    p.add_argument("--out", default="paper", metavar="DIR", help="output directory (default ./paper)")
    p.add_argument("--seeds", type=_positive(int), default=None, metavar="N",
                   help="seeds 0..N-1 per cell (default 3; the published counts are not in the SPEC)")
    p.add_argument("--workers", type=_positive(int), default=None, help="local processes (default: all cores)")
    p.add_argument("--ray", metavar="ADDRESS|auto", default=None, help="run on a Ray cluster instead")
    p.add_argument("--report-only", action="store_true", help="only rewrite the report from DIR/results.parquet")
    p.add_argument("--quiet", action="store_true", help="no progress line per finished cell")
    p.set_defaults(fn=cmd_paper)

    p = sub.add_parser("proxy", help="the live proxy (SPEC §3) in front of a vLLM OpenAI server, "
                                     "with Prometheus metrics on /metrics")
    p.add_argument("--upstream", required=True, metavar="URL", help="the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--condition", help=f"one of: {', '.join(CONDITIONS)} (the control flags change its settings)")
    p.add_argument("--port", type=_positive(int), default=8001)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prompt-throughput", type=_positive(), default=None, metavar="TOKENS_PER_S",
                   help="the estimator's prompt throughput before any first token is seen")
    _control_args(p)
    p.set_defaults(fn=cmd_proxy)

    from calibrate.commands import add_subcommands     # engine …, calibrate …
    add_subcommands(sub)
    from validate.commands import add_subcommands as add_validate
    add_validate(sub)
    return ap


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "condition", None) is not None and args.condition not in CONDITIONS:
            raise UsageError(f"unknown condition {args.condition!r}; valid: {', '.join(CONDITIONS)}")
        _check_output(getattr(args, "json", None))
        return args.fn(args)
    except UsageError as e:
        print(f"llmsim: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmsim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:             # output piped into a reader that stopped (e.g. head)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
