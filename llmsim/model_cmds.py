"""`llmsim run`, `diagnose`, `capacity`, `latency`, `conditions`: the model's
own commands."""
from __future__ import annotations

import dataclasses
import sys
import time

from sim import fleet, measures, verdict
from sim.capacity import capacity_protocol
from sim.conditions import CONDITIONS, DIAGNOSTIC, Condition, compose, get_condition
from sim.experiments import fleet_figure, reference
from sim.experiments.margin import margin, margin_cell, parse_axes
from sim.latency import latency, latency_stages
from sim.profile import ProfileError, embedded_names
from sim.scenario import ARRIVALS, PAPER
from sim.schema import ScenarioError

from . import args
from .scenario_cmds import capacity_line, deployment, layers_line, scenario_arg

_CONTROL_FLAGS = ("retries", "cancel", "coalesce", "budget", "order", "proxy_cap", "queue", "engine_cap")


def condition(a, base: Condition | None = None) -> Condition | None:
    """The named condition (default `base`, else no-control) with any control
    flags applied; None where a --scenario's own condition applies unchanged."""
    changes = {k: getattr(a, k) for k in _CONTROL_FLAGS if getattr(a, k) is not None}
    if a.condition is None and not changes and not getattr(a, "scenario", None):
        raise args.UsageError(f"{a.command}: give --condition NAME or control flags (--cancel, --coalesce, --budget, "
                         f"--order, --proxy-cap, --queue, --engine-cap, --retries); names: {', '.join(CONDITIONS)}")
    if "retries" in changes:
        changes["retries"] = changes["retries"] == "on"
    if not changes:
        return get_condition(a.condition) if a.condition is not None else None
    try:
        return compose(a.condition if a.condition is not None else base, **changes)
    except ValueError as e:
        raise args.UsageError(f"{a.command}: {e}") from None


def cmd_run(a) -> int:
    dep = deployment(a, layers=True)
    png = getattr(a, "queues_png", None)
    if png and dep.fleet is None:
        raise args.UsageError("run: --queues-png draws a fleet's replicas: give a --scenario with a [fleet] section")
    args.check_output(png)
    args.check_output(a.json)
    if a.seeds is not None:
        cond = dep.condition_for(condition(a, dep.condition))
        t0 = time.perf_counter()
        recs = [dep.run(s, cond) for s in a.seeds]
        summ = verdict.summarize(recs, classes=True)
        print(f"{dep.profile.name} / {cond.name} on {dep.name}: {verdict.verdict(summ)}")
        print(verdict.table({cond.name: summ}, dep.scenario.deadline_s, label="condition"))
        if has_classes({cond.name: summ}):
            print(class_tables({cond.name: summ}, recs, dep.scenario))
        print(verdict.legend(len(recs)))
        print(f"({len(recs)} runs in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        args.write_json(a.json, {"model": dep.profile.name, "condition": cond.name, "seeds": a.seeds,
                                 "scenario_name": dep.name, "scenario_hash": dep.content_hash, "summary": summ,
                                 "runs": recs})
        return 0
    rec = dep.run(a.seed, condition(a, dep.condition))
    print(measures.summary(rec))
    if "fleet" in rec:
        print(fleet.summary(rec))
    args.write_json(a.json, rec)
    if png:
        fleet_figure.replica_queues(rec, png)
        print(f"wrote {png}")
    return 0


def cmd_capacity(a) -> int:
    dep = deployment(a, burst=False, capacity=False)
    prof, sc = dep.profile, dep.scenario
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
    ident = {"scenario_name": dep.name, "scenario_hash": dep.content_hash, "workload": sc.workload_key,
             "engine": dict(prof.engine)}
    if len(runs) == 1:
        res = dict(runs[0], model=prof.name, profile_capacity=prof.capacity, **ident)
    else:
        caps = [r["capacity"] for r in runs]
        mean = sum(caps) / len(caps)
        sd = (sum((c - mean) ** 2 for c in caps) / (len(caps) - 1)) ** 0.5
        print(f"{prof.name}: capacity over {len(caps)} seeds: mean {mean:.3f} calls/s, standard deviation "
              f"{sd:.3f}, lowest {min(caps):.3f}, highest {max(caps):.3f}")
        res = {"model": prof.name, "profile_capacity": prof.capacity, "seeds": seeds, "capacity_mean": mean,
               "capacity_sd": sd, "runs": runs, **ident}
    args.write_json(a.json, res)
    return 0


def cmd_latency(a) -> int:
    if (a.rate is None) == (not a.stages):
        raise args.UsageError("latency: give --rate (one steady load) or --stages (the --scenario's phases as a "
                              "load test's stages)")
    dep = deployment(a, burst=False, capacity=False)
    if dep.trace_source is not None:
        raise args.UsageError("latency: a replayed trace has its own arrivals; latency needs a scenario of "
                              "length distributions (it sends them at --rate)")
    prof = dep.profile
    if a.stages:
        return _latency_stages(a, dep)
    try:
        res = latency(prof, a.rate, a.duration, scenario=dep.scenario, seed=a.seed, arrivals=a.arrivals)
    except RuntimeError as e:
        raise args.UsageError(f"latency: {e}") from None
    res.update(scenario_name=dep.name, scenario_hash=dep.content_hash)
    print(f"{prof.name} at {a.rate:g} calls/s ({a.arrivals}) for {a.duration:g} s ({res['calls']} calls after "
          f"warm-up): TTFT mean {res['ttft_mean']:.3f} s, p50 {res['ttft_p50']:.3f} s, p90 {res['ttft_p90']:.3f} s; "
          f"E2E mean {res['e2e_mean']:.3f} s, p50 {res['e2e_p50']:.3f} s, p90 {res['e2e_p90']:.3f} s")
    args.write_json(a.json, res)
    return 0


def _latency_stages(a, dep) -> int:
    """`llmsim latency --stages`: the scenario's phases as a load test's
    stages (`sim.latency.latency_stages`), one line of means a stage."""
    sc = dep.scenario
    if any(p.load is not None for p in sc.phases):
        try:
            cap = dep.capacity
        except (ScenarioError, ProfileError) as e:
            raise args.UsageError(f"latency: {e}") from None
    else:
        cap = 1.0
    stages = [(r, b - t, p.arrivals, p.drained) for (t, b, r), p in zip(sc.arrival_phases(cap), sc.phases)]
    try:
        rows = latency_stages(dep.profile, stages, scenario=sc, seed=a.seed, max_batched_tokens=a.max_batched_tokens)
    except (ValueError, RuntimeError) as e:
        raise args.UsageError(f"latency: {e}") from None
    for p, r in zip(sc.phases, rows):
        print(f"{p.name or 'stage'}: {r['rate']:g} calls/s ({r['arrivals']}{', drained' if r['drained'] else ''}) "
              f"for {r['duration_s']:g} s from {r['start_s']:.1f} s, {r['calls']} calls: TTFT mean "
              f"{r['ttft_mean']:.3f} s, p90 {r['ttft_p90']:.3f} s; E2E mean {r['e2e_mean']:.3f} s, "
              f"p90 {r['e2e_p90']:.3f} s")
    args.write_json(a.json, {"model": dep.profile.name, "scenario_name": dep.name,
                             "scenario_hash": dep.content_hash, "stages": rows})
    return 0


def diagnose_table(recs: list[dict], summ: dict, deadline_s: float, margins: dict | None = None) -> str:
    """The diagnostic table: per condition, P(recovered) over the seeds with
    its interval and the cohorts' shares (sim.verdict.table of `summ`, the
    records' sim.verdict.summarize_by), the rates over the primary interval,
    and the margin when given ({condition: text})."""
    rate = {k: {n: f"{sum(r['rates_xC'][k] for r in recs if r['condition'] == n) / summ[n]['n']:.2f}" for n in summ}
            for k in ("created", "accepted")}
    extra = {"created/C": rate["created"], "accepted/C": rate["accepted"]}
    if margins:
        extra["margin"] = margins
    return verdict.table(summ, deadline_s, extra, label="condition")


def has_classes(summ: dict) -> bool:
    """Whether every condition's summary has its classes' (`summarize(..., classes=True)`)."""
    return bool(summ) and all("classes" in s for s in summ.values())


def class_tables(summ: dict, recs: list[dict], sc) -> str:
    """Per traffic class, the table of its calls: each condition's
    `summ[condition]["classes"][name]` (`sim.verdict.summarize(..., classes=True)`),
    headed by the class's priority, deadline and whether the deployment's
    verdict needs it; the deployment's rule last, with the records'
    `all_calls`."""
    out = []
    for c in sc.classes:
        by_cond = {n: s["classes"][c.name] for n, s in summ.items()}
        deadline = c.client(sc).deadline_s
        out.append(f"\nclass {c.name} (share {c.share:g}, priority {c.priority}, deadline {deadline:g} s"
                   f"{', must recover' if c.must_recover else ''}):")
        out.append(verdict.table(by_cond, deadline, label="condition"))
    must = [c.name for c in sc.classes if c.must_recover]
    if must:
        out.append(f"\nthe deployment recovers when {', '.join(must)} {'does' if len(must) == 1 else 'do'} "
                   "(the first table's P(recovered)); all calls together: "
                   + ", ".join(f"{n} {v['recovered']}/{v['n']}" for n, v in verdict.summarize_by(
                       [dict(r, **r["all_calls"]) for r in recs if "all_calls" in r]).items()))
    return "\n".join(out)


def cmd_diagnose(a) -> int:
    dep = deployment(a, layers=True)
    prof, sc = dep.profile, dep.scenario
    layers = dep.run_layers()
    if a.seeds is not None:
        seeds = a.seeds
    elif a.seed is not None:
        seeds = [a.seed]
    else:
        seeds = list(range(dep.seed, dep.seed + DIAGNOSE_SEEDS))
    axes = None
    if a.margin:
        if dep.trace_source is not None:
            raise args.UsageError("diagnose: --margin works on a generated workload (not a replayed trace)")
        try:
            axes = parse_axes(a.margin, layers)
        except ValueError as e:
            raise args.UsageError(f"diagnose: --margin: {e}") from None
    if dep.name != "paper" or a.scenario:
        print(f"scenario {dep.name} (content hash {dep.content_hash}); model {prof.name} "
              f"({prof.provenance.get('kind')}); {capacity_line(dep)}", flush=True)
    print(f"{prof.name}: capacity {dep.capacity:.3f} calls/s ({prof.provenance.get('kind')}); pulse {dep.burst} "
          f"{sc.pulse_start:g}-{sc.pulse_end:g} s, hold to {sc.hold_end:g} s, deadline {sc.deadline_s:g} s; "
          f"seeds {_seed_list(seeds)}", flush=True)
    if layers is not None:
        print(f"stack: {layers_line(layers)}; each condition's proxy and engine controls beneath "
              "(`llmsim stack` shows the stack)", flush=True)
    t_all = time.perf_counter()
    recs = []
    for seed in seeds:
        trace = dep.trace(seed)
        for c in DIAGNOSTIC:
            recs.append(dep.run(seed, c, trace=trace))
            if "fleet" in recs[-1]:
                print(f"  seed {seed} {c}: " + fleet.summary(recs[-1]).strip().replace("\n", "\n    "), flush=True)
        print(f"  seed {seed}: {len(DIAGNOSTIC)} conditions in {time.perf_counter() - t_all:.1f} s so far",
              file=sys.stderr, flush=True)
    margins = None
    if axes:
        prof_c = dataclasses.replace(prof, capacity=dep.capacity)
        margins = {c: margin_cell(margin(prof_c, sc, dep.condition_for(c), seeds, axes, rel_tol=0.05, workers=None,
                                         fleet=dep.fleet, layers=layers))
                   for c in DIAGNOSTIC}
    if len(seeds) > 1:
        print(f"{len(seeds)} seeds ({_seed_list(seeds)})")
    summ = verdict.summarize_by(recs, classes=True)
    print(diagnose_table(recs, summ, sc.deadline_s, margins))
    if has_classes(summ):
        print(class_tables(summ, recs, sc))
    print(verdict.legend(len(seeds)))
    print(f"recovered: two consecutive {sc.window_s:g} s hold windows each delivering >= "
          f"{100 * sc.recovery_delivery:g}% within {sc.deadline_s:g} s with a queue mean <= "
          f"{sc.recovery_queue_mean:g} not growing; time counted from the pulse end")
    print(f"({len(recs)} runs in {time.perf_counter() - t_all:.1f} s)", file=sys.stderr)
    recs_pulse = recs[0]["pulse"]
    ref_rows = None
    pulse = recs_pulse
    reference_design = (sc.with_(pulse=PAPER.pulse) == PAPER and dep.trace_source is None
                        and not prof.raw.get("engine_overrides") and dep.engine_cap is None and layers is None)
    if reference_design and pulse is not None and reference.applies(prof.name, pulse):
        ref_rows = reference.compare(recs)
        print(f"\nAgainst {reference.SOURCE}, pulse {reference.PULSE:g} x C; bar: hold "
              f"delivery within {reference.BAR_POINTS:g} points, recovery within one {reference.BAR_WINDOW_S:g} s "
              f"window; simulated figures are means over the seeds run")
        print(reference.table(ref_rows))
    args.write_json(a.json, {"model": prof.name, "pulse": pulse, "seeds": seeds, "capacity": dep.capacity,
                             "scenario_name": dep.name, "scenario_hash": dep.content_hash,
                             "layers": None if layers is None else list(layers),
                             "summary": summ, "runs": recs, "reference": ref_rows})
    return 0


DIAGNOSE_SEEDS = 10


def _seed_list(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


def cmd_conditions(a) -> int:
    for name, c in CONDITIONS.items():
        print(f"{name:22s} {c.describe()}")
    return 0


def model_arg(p, default=args.DEFAULT_MODEL):
    p.add_argument("--model", default=default,
                   help=f"embedded profile ({', '.join(embedded_names())}) or a profile JSON path "
                        f"(default {args.DEFAULT_MODEL}, or the --scenario's)")


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
    model_arg(p, None)
    scenario_arg(p)
    p.add_argument("--condition", help=f"one of: {', '.join(CONDITIONS)} (default no-control when control "
                                      "flags are given; the flags change its settings)")
    p.add_argument("--pulse", type=args.positive(most=args.PULSE_MAX), default=None,
                   help=f"pulse rate in multiples of capacity (default {PAPER.pulse:g}, or the --scenario's burst)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=args.positive(int, allow_zero=True), default=None,
                   help="the trace's seed (default 0, or the --scenario's)")
    g.add_argument("--seeds", type=args.seed_set, default=None,
                   help="a count N (seeds 0..N-1) or seeds like 0-9: P(recovered) with its 95%% interval and the "
                        "shares' spread over them")
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--mixed-prompts", action="store_true",
                   help="half the calls get 3,000-token prompts; Ĉ is the capacity protocol's on that mix")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--queues-png", metavar="PATH", default=None,
                   help="a fleet's run: write each replica's waiting queue over time as a PNG")
    control_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("capacity", help="the capacity protocol on the simulator")
    model_arg(p, None)
    scenario_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    g.add_argument("--seeds", type=args.seeds, default=None,
                   help="one protocol run per seed, e.g. 0-7: their mean and spread (one run's Ĉ is noisy)")
    p.add_argument("--start-rate", type=args.positive(most=args.RATE_MAX), default=1.0)
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_capacity)

    p = sub.add_parser("latency", help="steady load straight to the engine: TTFT and E2E means and percentiles")
    model_arg(p, None)
    scenario_arg(p, trace_speedup=False)
    p.add_argument("--rate", type=args.positive(most=args.RATE_MAX), default=None, help="calls/s")
    p.add_argument("--stages", action="store_true",
                   help="instead of --rate: the --scenario's phases as a load test's stages, one after another "
                        "(a drained phase starting once every call before it has finished), every call counted")
    p.add_argument("--arrivals", choices=ARRIVALS, default="poisson",
                   help="poisson (default); constant: one call every 1/rate s (guidellm's constant rate); "
                        "poisson_exact: int(rate x duration) calls, exponential gaps rescaled to the duration "
                        "(inference-perf's constant load); uniform_exact: int(rate x duration) calls at uniform "
                        "random times")
    p.add_argument("--duration", type=args.positive(most=args.DURATION_MAX), default=600.0,
                   help="seconds of arrivals (default 600)")
    p.add_argument("--seed", type=args.positive(int, allow_zero=True), default=0)
    p.add_argument("--max-batched-tokens", type=args.positive(int), default=None)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_latency)

    p = sub.add_parser("diagnose", help="the four diagnostic conditions on one trace, as a table; "
                                        "qwen2.5-7b at pulse 2.7 is compared with the published figures")
    model_arg(p, None)
    scenario_arg(p)
    p.add_argument("--pulse", type=args.positive(most=args.PULSE_MAX), default=None,
                   help=f"pulse rate in multiples of capacity (default {PAPER.pulse:g}, or the --scenario's burst)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seed", type=args.positive(int, allow_zero=True), default=None, help="one trace")
    g.add_argument("--seeds", type=args.seed_set, default=None,
                   help=f"a count N (seeds 0..N-1) or seeds like 0-4 (default {DIAGNOSE_SEEDS}): P(recovered) with its "
                        "95%% interval, shares as median (10th-90th percentile)")
    p.add_argument("--margin", nargs="?", const="speed", default=None, metavar="AXES",
                   help="add each condition's margin along AXES (default speed; of speed,pulse,hold_load,kv, or a "
                        "[[layer]]'s key as layer.KIND.KEY)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_diagnose)

    p = sub.add_parser("conditions", help="list the named conditions")
    p.set_defaults(fn=cmd_conditions)
