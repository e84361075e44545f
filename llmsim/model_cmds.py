"""`llmsim run`, `diagnose`, `capacity`, `latency`, `conditions`: the model's
own commands."""
from __future__ import annotations

import sys
import time

from sim import measures
from sim.capacity import capacity_protocol
from sim.conditions import CONDITIONS, DIAGNOSTIC, Condition, compose, get_condition
from sim.experiments import reference
from sim.latency import latency
from sim.profile import embedded_names
from sim.run import run_one
from sim.scenario import PAPER
from sim.workload import make_trace

from . import args


_CONTROL_FLAGS = ("retries", "cancel", "coalesce", "budget", "order", "proxy_cap", "queue", "engine_cap")


def condition(a) -> Condition:
    """The named condition (default no-control) with any control flags applied."""
    changes = {k: getattr(a, k) for k in _CONTROL_FLAGS if getattr(a, k) is not None}
    if a.condition is None and not changes:
        raise args.UsageError(f"{a.command}: give --condition NAME or control flags (--cancel, --coalesce, --budget, "
                         f"--order, --proxy-cap, --queue, --engine-cap, --retries); names: {', '.join(CONDITIONS)}")
    if "retries" in changes:
        changes["retries"] = changes["retries"] == "on"
    if not changes:
        return get_condition(a.condition)
    try:
        return compose(a.condition, **changes)
    except ValueError as e:
        raise args.UsageError(f"{a.command}: {e}") from None


def cmd_run(a) -> int:
    prof = args.profile(a.model)
    rec = run_one(prof, condition(a), a.pulse, a.seed, a.max_batched_tokens, a.mixed_prompts)
    print(measures.summary(rec))
    args.write_json(a.json, rec)
    return 0


def cmd_capacity(a) -> int:
    prof = args.profile(a.model)
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
    args.write_json(a.json, res)
    return 0


def cmd_latency(a) -> int:
    prof = args.profile(a.model)
    res = latency(prof, a.rate, a.duration, seed=a.seed, max_batched_tokens=a.max_batched_tokens)
    print(f"{prof.name} at {a.rate:g} calls/s for {a.duration:g} s ({res['calls']} calls after warm-up): "
          f"TTFT p50 {res['ttft_p50']:.3f} s, p90 {res['ttft_p90']:.3f} s; "
          f"E2E p50 {res['e2e_p50']:.3f} s, p90 {res['e2e_p90']:.3f} s")
    args.write_json(a.json, res)
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
    prof = args.profile(a.model)
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
    args.write_json(a.json, {"model": prof.name, "pulse": a.pulse, "seeds": seeds, "capacity": prof.capacity,
                         "runs": recs, "reference": ref_rows})
    return 0


def _seed_list(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def cmd_conditions(a) -> int:
    for name, c in CONDITIONS.items():
        print(f"{name:22s} {c.describe()}")
    return 0


def model_arg(p):
    p.add_argument("--model", default=args.DEFAULT_MODEL,
                   help=f"embedded profile ({', '.join(embedded_names())}) or a profile JSON path "
                        f"(default {args.DEFAULT_MODEL})")


def control_args(p) -> None:
    """The control flags that compose a condition (`run`, `proxy`)."""
    g = p.add_argument_group("controls (each changes the condition's setting)")
    g.add_argument("--retries", choices=("on", "off"), default=None, help="client retries (R = 3) on or off")
    g.add_argument("--cancel", type=args.cancel, default=None, metavar="off|now|deferred[:W]",
                   help="cancellation: off, now, or deferred W seconds (default 10)")
    g.add_argument("--coalesce", action="store_true", default=None,
                   help="a retry attaches to its call's live execution")
    g.add_argument("--budget", type=args.positive(allow_zero=True), default=None, metavar="RATIO",
                   help="retry budget: retries <= RATIO x first attempts over 60 s (0: off)")
    g.add_argument("--order", choices=("budget-first", "lookup-first"), default=None,
                   help="which check comes first: the retry budget or the lookup of a live execution")
    g.add_argument("--proxy-cap", type=args.positive(int, allow_zero=True), default=None, metavar="N",
                   help="at most N executions outstanding in the engine; more wait in the proxy (0: off)")
    g.add_argument("--queue", choices=("fifo", "deadline", "lifo"), default=None,
                   help="dequeue order of the proxy queue")
    g.add_argument("--engine-cap", type=args.positive(int, allow_zero=True), default=None, metavar="Q",
                   help="the engine refuses (503) beyond Q executions waiting or running (0: off)")



def add_subcommands(sub) -> None:
    p = sub.add_parser("run", help="one run of one condition; prints a summary, writes the result record")
    model_arg(p)
    p.add_argument("--condition", help=f"one of: {', '.join(CONDITIONS)} (default no-control when control "
                                      "flags are given; the flags change its settings)")
    p.add_argument("--pulse", type=args.positive(most=args.PULSE_MAX), default=PAPER.pulse,
                   help="pulse rate in multiples of capacity")
    p.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--mixed-prompts", action="store_true", help="half the calls get 3,000-token prompts")
    p.add_argument("--json", metavar="PATH")
    control_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("capacity", help="the capacity protocol (SPEC §6) on the simulator")
    model_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    g.add_argument("--seeds", type=args.seeds, default=None,
                   help="one protocol run per seed, e.g. 0-7: their mean and spread (one run's Ĉ is noisy)")
    p.add_argument("--start-rate", type=args.positive(most=args.RATE_MAX), default=1.0)
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_capacity)

    p = sub.add_parser("latency", help="steady Poisson load straight to the engine: TTFT and E2E percentiles")
    model_arg(p)
    p.add_argument("--rate", type=args.positive(most=args.RATE_MAX), required=True, help="calls/s")
    p.add_argument("--duration", type=args.positive(most=args.DURATION_MAX), default=600.0, help="seconds of arrivals (default 600)")
    p.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_latency)

    p = sub.add_parser("diagnose", help="the four diagnostic conditions on one trace, as a table; "
                                        "qwen2.5-7b at pulse 2.7 is compared with SPEC §7")
    model_arg(p)
    p.add_argument("--pulse", type=args.positive(most=args.PULSE_MAX), default=PAPER.pulse)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    g.add_argument("--seeds", type=args.seeds, default=None,
                   help="several traces, e.g. 0-4: the table gives the mean and range over them")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_diagnose)

    p = sub.add_parser("conditions", help="list the named conditions")
    p.set_defaults(fn=cmd_conditions)
