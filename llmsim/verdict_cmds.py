"""`llmsim margin`, `advise`, `map`: verdicts over seeds — how far a
deployment is from the point where its recovery flips, which control
settings bring service back, and P(recovered) over two parameters."""
from __future__ import annotations

import dataclasses
import math
import os
import sys

from sim.conditions import CONDITIONS, get_condition
from sim.experiments import advise as advise_mod, advise_classes as advise_classes_mod, margin as margin_mod, phasemap
from sim.scenario import SCENARIOS

from . import args
from .model_cmds import model_arg
from .scenario_cmds import deployment as scenario_deployment, layers_line

DEFAULT_SEEDS = 10


def generated(a, layers: bool = False):
    """The deployment of --model and --scenario (a named scenario or a
    scenario file), refused in one line when its workload is a replayed
    trace. With `layers`, a scenario with [[layer]] tables the simulator
    runs is taken too (`Deployment.run_layers` gives their settings)."""
    dep = scenario_deployment(a, layers=layers)
    if dep.trace_source is not None:
        raise args.UsageError(f"{a.command}: works on a generated workload; {dep.name} has a replayed trace")
    return dep


def deployment(a, layers: bool = False):
    """(profile, scenario, adapt, fleet) of the deployment (`generated`): the
    profile carries the workload's Ĉ (a fleet's: the sum of its replicas'),
    adapt gives a condition the deployment's proxy times and engine cap,
    fleet is the scenario's [fleet] (None: one engine)."""
    return parts(generated(a, layers))


def parts(dep):
    """(profile with the workload's Ĉ, scenario, adapt, fleet) of a deployment."""
    return dataclasses.replace(dep.profile, capacity=dep.capacity), dep.scenario, dep.condition_for, dep.fleet


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_margin(a) -> int:
    dep = generated(a, layers=True)
    prof, sc, adapt, fleet = parts(dep)
    layers = dep.run_layers()
    cond = adapt(get_condition(a.condition))
    try:
        axes = margin_mod.parse_axes(a.axes, layers)
    except ValueError as e:
        raise args.UsageError(f"margin: --axes: {e}") from None
    scaled = [x for x in axes if x in margin_mod.SCALING_AXES]
    if scaled and (fleet is None or fleet.autoscaler is None):
        raise args.UsageError(f"margin: --axes {','.join(scaled)}: needs a scenario with an [autoscaler] section "
                              "(examples/autoscale.toml)")
    on = "" if fleet is None else f" ({fleet.replicas} replicas, router {fleet.router.policy})"
    under = f" under {layers_line(layers)}" if layers else ""
    print(f"{prof.name}{on} / {a.scenario or 'paper'} / {cond.name}{under}: {len(a.seeds)} seeds, "
          f"axes {', '.join(axes)}", file=sys.stderr, flush=True)
    res = margin_mod.margin(prof, sc, cond, a.seeds, axes, rel_tol=a.rel_tol, workers=a.workers,
                            progress=None if a.quiet else _progress, fleet=fleet, layers=layers)
    print(res["sentence"])
    for ax in res["axes"]:
        pr = ", ".join(f"{p['x']:.3g}: {p['p']:.2f}" for p in ax["probes"])
        print(f"  {ax['axis']:<9} ({ax['what']}; baseline {ax['baseline']:g}) probes {pr}")
    print(f"({res['wall_s']:.1f} s)")
    args.write_json(a.json, res)
    return 0


def _screen_cut(text: str) -> tuple[float | None, float | None] | None:
    """--screen-cut BASE,HOLD (seconds) or none."""
    if text == "none":
        return None
    try:
        b, h = (float(x) for x in text.split(","))
    except ValueError:
        raise args.UsageError(f"advise: --screen-cut takes BASE,HOLD in seconds (e.g. 120,360) or none; got {text!r}") \
            from None
    if not (b > 0 and h > 0 and math.isfinite(b) and math.isfinite(h)):
        raise args.UsageError(f"advise: --screen-cut: both times must be positive seconds; got {text!r}")
    return b, h


def cmd_advise(a) -> int:
    dep = generated(a, layers=True)
    if a.by_class:
        return _advise_by_class(a, dep)
    layers = dep.run_layers()
    if a.only == "router" and dep.fleet is None:
        raise args.UsageError(f"advise: --only router searches a fleet's router, and {dep.name} has one engine: give "
                              "a scenario with a [fleet] section (examples/fleet.toml) or --only client|proxy|engine")
    prof, sc = dataclasses.replace(dep.profile, capacity=dep.capacity), dep.scenario
    cut = _screen_cut(a.screen_cut) if a.screen_cut is not None else advise_mod.default_cut(sc)
    args.check_output(a.out)
    try:
        axes = _margin_axes(a, layers)
        res = advise_mod.advise(prof, sc, a.seeds, a.objective, a.only, a.out, dep.condition_for, screen=a.screen,
                                finalists=a.finalists, workers=a.workers, ray_address=a.ray, margin_axes=axes,
                                progress=not a.quiet, fleet=dep.fleet, base=dep.condition,
                                screen_base_s=cut[0] if cut else None, screen_hold_s=cut[1] if cut else None,
                                layers=layers)
    except ValueError as e:
        raise args.UsageError(f"advise: {e}") from None
    if layers is not None:
        print(f"under {layers_line(layers)}")
    print(advise_mod.report(res))
    print(f"({res['wall_s']:.1f} s)")
    args.write_json(a.json, res)
    return 0


def _margin_axes(a, layers: tuple | None) -> list[str]:
    """--margin-axes as margin axes ([] for none); ValueError on a bad one."""
    return [] if a.margin_axes in ("", "none") else margin_mod.parse_axes(a.margin_axes, layers)


def _advise_by_class(a, dep) -> int:
    """advise --by-class: which control restores the must-recover classes at least cost to the others."""
    if not dep.scenario.classes:
        raise args.UsageError(f"advise: --by-class needs a scenario with workload.classes; {dep.name} has none")
    dep.require_burst()
    args.check_output(a.out)
    layers = dep.run_layers()
    try:
        res = advise_classes_mod.advise_classes(dep, a.seeds, screen=a.screen, finalists=a.finalists,
                                                progress=not a.quiet, out=a.out, workers=a.workers,
                                                ray_address=a.ray, margin_axes=_margin_axes(a, layers))
    except ValueError as e:
        raise args.UsageError(f"advise: {e}") from None
    if layers is not None:
        print(f"under {layers_line(layers)}")
    print(advise_classes_mod.report(res))
    print(f"({res['wall_s']:.1f} s)")
    args.write_json(a.json, res)
    return 0


def cmd_map(a) -> int:
    dep = generated(a, layers=True)
    prof, sc, adapt, fleet = parts(dep)
    layers = dep.run_layers()
    cond = adapt(get_condition(a.condition))
    try:
        x, y = phasemap.parse_range(a.x, layers), phasemap.parse_range(a.y, layers)
    except ValueError as e:
        raise args.UsageError(f"map: {e}") from None
    if x[0] == y[0]:
        raise args.UsageError(f"map: --x and --y must be different parameters, both are {x[0]}")
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    args.check_output(a.out)
    args.check_output(png)
    try:
        rows = phasemap.phase_map(prof, sc, cond, x, y, a.seeds, workers=a.workers,
                                  progress=None if a.quiet else _progress, fleet=fleet, layers=layers)
    except ValueError as e:
        raise args.UsageError(f"map: {e}") from None
    phasemap.write_table(rows, a.out)
    under = f" under {layers_line(layers)}" if layers else ""
    line = phasemap.plot(rows, sc, png, f"{prof.name} / {a.scenario or 'paper'} / {cond.name}{under}: P(recovered) "
                                        f"over {len(a.seeds)} seeds; T: tipping point")
    tips = sum(r["tipping"] for r in rows)
    print(f"wrote {a.out} ({len(rows)} points, {tips} tipping points) and {png}"
          + ("" if line else " (the backlog-equals-deadline line lies outside the map)"))
    return 0


def _common(p, condition: bool) -> None:
    model_arg(p, None)
    p.add_argument("--scenario", default=None, metavar="FILE|NAME",
                   help=f"a scenario file or a named scenario: {', '.join(SCENARIOS)} (default paper)")
    if condition:
        p.add_argument("--condition", required=True, help=f"one of: {', '.join(CONDITIONS)}")
    p.add_argument("--seeds", type=args.seed_set, default=list(range(DEFAULT_SEEDS)),
                   help=f"a count N (seeds 0..N-1) or seeds like 0-9 or 0,3,7 (default {DEFAULT_SEEDS}); the same "
                        "seeds at every probe (common random numbers)")
    p.add_argument("--workers", type=args.positive(int), default=None,
                   help="local processes (default: one per CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_subcommands(sub) -> None:
    p = sub.add_parser("margin", help="how far the deployment is from where its recovery verdict flips, per axis")
    _common(p, condition=True)
    p.add_argument("--axes", default=",".join(margin_mod.AXES),
                   help=f"comma-separated, of {', '.join(margin_mod.AXES)} (default these); with an "
                        f"[autoscaler], {', '.join(margin_mod.SCALING_AXES)}; or a [[layer]]'s key: "
                        "layer.client.timeout_s|max_retries|backoff_base_s, layer.gateway.timeout_s|max_retries")
    p.add_argument("--rel-tol", type=args.positive(), default=0.02,
                   help="bisection stops when the bracket's ends are within this ratio (default 0.02)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_margin)

    p = sub.add_parser("advise", help="search the control settings for those that restore service, best first")
    _common(p, condition=False)
    p.add_argument("--objective", choices=advise_mod.OBJECTIVES, default="timely",
                   help="timely: calls within deadline; delivered: calls delivered; burst: pulse calls delivered")
    p.add_argument("--only", choices=advise_mod.LAYERS, default=None,
                   help="search one layer's settings only (router: a fleet's router, the scenario's controls kept; "
                        "client: with a client [[layer]], its timeout_s, max_retries and backoff too; gateway: a "
                        "gateway [[layer]]'s timeout_s, max_retries and passes_disconnect, the controls kept)")
    p.add_argument("--screen", type=args.positive(int), default=2,
                   help="seeds of the screen (default 2): every setting runs on the first, the best third on these")
    p.add_argument("--screen-cut", metavar="BASE,HOLD|none", default=None,
                   help="screening runs simulate the arrivals from BASE s before the burst to HOLD s after it "
                        "(default: half a deadline before, two recovery windows after); none: the whole scenario")
    p.add_argument("--finalists", type=args.positive(int), default=12,
                   help="settings run on all seeds after the screen (default 12)")
    p.add_argument("--margin-axes", default="speed",
                   help="axes of the top settings' margins (default speed; none to skip); with --by-class, of the "
                        "first three of the ranking")
    p.add_argument("--out", metavar="PARQUET", default=None,
                   help="keep the runs here; a rerun with the same file skips the runs it holds")
    p.add_argument("--ray", metavar="ADDRESS", default=None, help="run on a Ray cluster (local: a local one)")
    p.add_argument("--by-class", action="store_true",
                   help="with traffic classes: which control (priority alone, shedding by class, a class's cap or "
                        "retry budget, cancellation) restores the must-recover classes at least cost to the others, "
                        "with each class's delivery, under the scenario's [[layer]]s; --out, --margin-axes, --screen, "
                        "--finalists, --workers and --ray as without it (docs/classes.md)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(fn=cmd_advise)

    p = sub.add_parser("map", help="P(recovered) over a grid of two parameters: Parquet and a PNG heatmap")
    _common(p, condition=True)
    p.add_argument("--x", required=True, metavar="PARAM=a:b:n",
                   help="e.g. pulse=1:3:9, or PARAM=v1,v2,...; with [[layer]]s a layer's key, e.g. "
                        "layer.client.timeout_s=2:10:5")
    p.add_argument("--y", required=True, metavar="PARAM=a:b:n", help="e.g. hold_load=0.3:0.9:7")
    p.add_argument("--out", metavar="PARQUET", default="map.parquet", help="the table (default map.parquet)")
    p.add_argument("--png", metavar="PATH", default=None, help="the heatmap (default: --out with .png)")
    p.set_defaults(fn=cmd_map)
