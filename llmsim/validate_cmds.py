"""`llmsim validate` and `llmsim proxy`: the live harness's commands."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from calibrate import live_capacity
from sim.conditions import CONDITIONS, get_condition
from sim.deployment import ScenarioError, load
from sim.policy.layers import layer_kind
from sim.policy.router import PROXY_PLACEMENTS, ROUTERS, RouterConfig
from sim.policy.stack import Stack, check_group
from sim.profile import ProfileError, from_dict
from sim.scenario import SCENARIOS, NamedScenario, get_scenario
from validate import autoscale as live_autoscale, engine, fleet as live_fleet, gateway
from validate.harness import (
    CALIBRATE_FROM,
    DEFAULT_LAYOUT,
    FLEET_LAYOUT,
    LAYOUTS,
    cached,
    harness_on,
    how_measured,
    keep,
    layout_compute_cpus,
    layout_cpus,
    measured_under,
    under_harness_here,
)
from validate.proxy import main as proxy_main, upstream_url
from validate.validation import (
    GPU_MODELS,
    EngineSpec,
    ValidationError,
    capacity_for,
    live_layers,
    speed_probe,
    steps_path,
    table,
    validate,
)

from . import args
from .calibrate_cmds import fit_summary, recalibrate_needed
from .model_cmds import condition, control_args
from .scenario_cmds import build_prior, deployment


def _err(msg):
    return args.UsageError(msg)


def _profile_for(a, kind: str):
    if a.profile:
        return args.profile(a.profile)
    if kind == "cpu":
        return args.profile("vllm-cpu-tiny")
    if kind == "gpu":
        if a.model in GPU_MODELS:
            return args.profile(a.model)
        raise _err(f"validate: no embedded profile for {a.model!r}; give --profile (embedded: "
                   f"{', '.join(GPU_MODELS)}, or a profile file from `llmsim calibrate`)")
    raise _err("validate: an engine given by URL needs --profile NAME|PATH (its step-time profile)")


def _scenario_file(a):
    """A scenario file as the named scenario validation runs: its Scenario,
    seed and proxy times (as a time scale of the reference's 10 s deferral
    and 60 s budget window); its profile unless --profile is given."""
    dep = deployment(argparse.Namespace(command="validate", scenario=a.scenario, model=None), burst=False)
    try:
        dep.require_burst()
    except ScenarioError as e:
        raise _err(f"validate: {e}") from None
    if dep.trace_source is not None:
        raise _err("validate: a replayed trace cannot be sent live yet; give a scenario of phases and lengths")
    times = dep.proxy_times
    scale = 10.0 / times["defer_s"] if times.get("defer_s") else 1.0
    if times.get("budget_window_s") and abs(60.0 / times["budget_window_s"] - scale) > 1e-9:
        raise _err(f"validate: {a.scenario}: proxy.defer_s and proxy.budget_window_s must keep the reference's "
                   "ratio (10 s to 60 s) for a live run")
    return NamedScenario(dep.name, dep.scenario, seed=dep.seed, time_scale=scale, about=dep.about), dep


def _scenario_and_profile(a, kind: str, default: str, from_file=None):
    """The named scenario the points run (a scenario file's, `from_file` as
    `_scenario_file` read it; or a named one, `default` if none given) and
    the engine's profile."""
    if from_file is not None:
        vs, dep = from_file
        return vs, args.profile(a.profile) if a.profile else dep.profile
    try:
        vs = get_scenario(a.scenario or default)
    except ValueError as e:
        raise _err(f"validate: {e}") from None
    return vs, _profile_for(a, kind)


def _live_stack(a, from_file):
    """A scenario file's [[layer]] stack as the live run takes it: (effective
    settings of each layer, the simulator's `stack_for`), or (None, None).
    A stack the live harness cannot run, or a gateway that is not installed,
    ends here in one line."""
    if from_file is None or not from_file[1].stack_layers:
        return None, None
    dep = from_file[1]
    layers = dep.layer_settings()
    try:
        _, gw = live_layers(layers)
    except ValueError as e:
        raise _err(f"validate: {a.scenario}: {e}") from None
    if gw is not None and gateway.binary(gw["preset"]) is None:
        raise _err(f"validate: {a.scenario}: {gw['preset']} is not installed: run `llmsim gateway install "
                   f"{gw['preset']}` first")
    return layers, dep.stack_for


def cmd_validate(a) -> int:
    eng = a.engine
    from_file = _scenario_file(a) if a.scenario and a.scenario not in SCENARIOS else None
    if from_file is not None and from_file[1].fleet is not None and from_file[1].fleet.autoscaler is not None:
        return cmd_validate_autoscale(a, from_file)
    if a.replicas is not None or a.routers is not None or (from_file is not None and from_file[1].fleet is not None):
        return cmd_validate_fleet(a, from_file)
    if a.router_retries is not None or a.fleet_proxy is not None:
        raise _err("validate: --router-retries and --fleet-proxy are for a fleet: give --replicas N (or a scenario "
                   "file with [fleet])")
    if a.points is None:
        raise _err("validate: give --points (comma-separated conditions, e.g. no-control,coalesce)")
    if eng in ("cpu", "gpu"):
        kind = eng
    elif eng.startswith(("http://", "https://")):
        if "," in eng:
            raise _err("validate: several engine URLs make a fleet: give --replicas N with N URLs")
        kind = "url"
    else:
        raise _err(f"validate: --engine must be cpu, gpu or an engine URL (http://HOST:PORT), got {eng!r}")
    unknown = [p for p in a.points if p not in CONDITIONS]
    if unknown:
        raise _err(f"validate: unknown condition {unknown[0]!r}; valid: {', '.join(CONDITIONS)}")
    vs, prof = _scenario_and_profile(a, kind, "cpu-small" if kind == "cpu" else "paper", from_file)
    layers, stack_for = _live_stack(a, from_file)
    if kind == "cpu" and engine.cpu_installed() is None:
        raise _err("validate: the CPU engine is not installed: run `llmsim engine install --cpu` first")
    if kind == "gpu" and (problem := engine.gpu_problem()) is not None:
        raise _err(f"validate --engine gpu: {problem}")
    spec = EngineSpec(kind, model=GPU_MODELS.get(a.model, a.model) if kind == "gpu" else None,
                      url=eng if kind == "url" else None)
    if kind == "url":
        try:
            spec.model = engine.connect(eng).served_model()
        except engine.EngineError as e:
            raise _err(f"validate: cannot reach the engine at {eng}: {e}") from None
        print(f"validate: the engine at {eng} is reused for every point (not fresh)", file=sys.stderr)
    spec.cpus, harness_cpus = layout_cpus(a.layout) if kind == "cpu" else (None, None)
    spec.compute_cpus = layout_compute_cpus(a.layout) if kind == "cpu" else None
    with harness_on(harness_cpus):
        prof, calibration = _predicting_profile(a, spec, prof, vs, kind, a.layout)
        try:
            doc = validate(spec, prof, vs, a.points, a.json, a.capacity, calibration=calibration, layers=layers,
                           stack_for=stack_for, retry_slow=a.retry_slow, probe=not a.no_speed_probe)
        except (ValidationError, engine.EngineError) as e:
            raise _err(f"validate: {e}") from None
    print(f"{vs.name} on {doc['engine']['kind']} vLLM {doc['engine']['version']} ({doc['engine']['model']}), "
          f"Ĉ {doc['capacity']:.3f} calls/s, seed {vs.seed}" + (f", layout {a.layout}" if kind == "cpu" else ""))
    print(f"predicted with profile {prof.name}: {how_measured(prof.raw)}")
    if calibration:
        c = calibration
        print(f"profile fitted from the live capacity run's {c['steps']} steps ({c['steps_file']}): capacity "
              f"protocol live {c['live_capacity']:.3f} calls/s, simulated with the fit {c['simulated_capacity']:.3f} "
              f"({100 * (c['simulated_capacity'] / c['live_capacity'] - 1):+.1f}%)")
    print("sim: the prediction with the profile; sim x k: a diagnostic only (the profile's steps stretched to "
          "what the engine did during the point)")
    print(table(doc["points"]))
    return _verdicts(doc["points"], lambda p: p["condition"], a.json)


def _verdicts(points: list[dict], tag, json_path: str | None) -> int:
    """Print each point's agreement (named by `tag(point)`); 1 if a point failed, else 0."""
    failed = [p for p in points if "failed" in p]
    for p in points:
        if "failed" in p:
            print(f"{tag(p)}: FAILED ({p['failed']['reason']}); rerun the command to retry it")
            continue
        if p["sim"] is None:
            print(f"{tag(p)}: live only; the prediction is not available ({p['no_prediction']})")
            continue
        ag, sp = p["agreement"], p.get("engine_speed")
        line = (f"recovered {'agrees' if ag['recovered'] else 'DIFFERS'}; delivery live - sim: "
                f"pulse {ag['pulse_delivered_diff']:+.1f}, hold {ag['hold_delivered_diff']:+.1f} points")
        if sp is not None and not sp["tests_model"]:
            print(f"{tag(p)}: NOT A TEST OF THE MODEL: {sp['says']} ({line}; --retry-slow N runs such a point "
                  "again)")
            continue
        if not ag.get("recovery_tests_model", True):
            print(f"{tag(p)}: RECOVERY NOT A TEST OF THE MODEL: {p['band_speeds']['says']} ({line}"
                  f"{'' if ag['pulse'] and ag['hold'] else '; delivery beyond the 15-point bar'}; k {sp['k']:.2f})")
            continue
        print(f"{tag(p)}: {line}{'' if ag['all'] else '  (beyond the 15-point bar)'}"
              + (f"; k {sp['k']:.2f}" if sp is not None else ""))
    if json_path:
        print(f"-> {json_path}")
    return 1 if failed else 0


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def _file_condition(a, dep, give: str) -> str:
    """The scenario file's [proxy] condition, for a live point run without
    --points; an error where the file changes that condition's settings
    (`give`: what --points should hold)."""
    if set(dep.proxy) != {"condition"}:
        raise _err(f"validate: {a.scenario}: its [proxy] changes the {dep.proxy['condition']!r} condition, which a "
                   f"live point cannot run; give --points ({give})")
    return dep.proxy["condition"]


def cmd_validate_autoscale(a, from_file) -> int:
    """`validate --scenario FILE` where FILE has [autoscaler]: the live point
    of `validate.autoscale` (the fleet starts with its initial engines, the
    HPA adds and drains real vllm-cpu engines), beside its predictions."""
    _, dep = from_file
    flags = [f for f, v in (("--replicas", a.replicas), ("--routers", a.routers),
                            ("--router-retries", a.router_retries), ("--fleet-proxy", a.fleet_proxy)) if v is not None]
    if flags:
        raise _err(f"validate: {a.scenario} has [autoscaler]: the fleet is its [fleet] and [autoscaler]; drop "
                   f"{', '.join(flags)}")
    if a.engine != "cpu":
        raise _err(f"validate: {a.scenario} has [autoscaler]: its replicas are vllm-cpu engines llmsim starts as the "
                   f"autoscaler asks (--engine cpu), got --engine {a.engine}")
    if dep.stack_layers:
        raise _err(f"validate: {a.scenario}: a live autoscaled fleet runs the reference design's client; [[layer]] "
                   "tables run live on one engine")
    if a.points is not None and len(a.points) != 1:
        raise _err("validate: an autoscaled fleet runs one point: give one condition in --points (or none: its "
                   "[proxy] condition)")
    cond = a.points[0] if a.points else _file_condition(a, dep, "one named condition")
    if cond not in CONDITIONS:
        raise _err(f"validate: unknown condition {cond!r}; valid: {', '.join(CONDITIONS)}")
    if engine.cpu_installed() is None:
        raise _err("validate: the CPU engine is not installed: run `llmsim engine install --cpu` first")
    if (problem := live_fleet.fleet_problem(dep.fleet.autoscaler.max_replicas)) is not None:
        raise _err(f"validate: {problem}")
    spec = EngineSpec("cpu", cpus=layout_cpus(FLEET_LAYOUT)[0])    # calibrated as a replica runs: on a core
    prof, _ = _predicting_profile(a, spec, dep.profile, from_file[0], "cpu", FLEET_LAYOUT)
    dep = with_profile(dep, prof)
    slow = []
    while True:
        try:
            point = live_autoscale.run_point(dep, condition=cond)
        except (ValidationError, engine.EngineError, live_fleet.PointFailed) as e:
            raise _err(f"validate: {e}") from None
        sp = point["engine_speed"]
        if sp is None or sp["tests_model"] or len(slow) >= a.retry_slow:
            break
        slow.append({"k": sp["k"], "live": point["live"]})
        _say(f"validate: {sp['says']}; running it again ({len(slow)}/{a.retry_slow}, --retry-slow)")
    if slow:
        point["slow_runs"] = slow
    print(f"predicted with profile {prof.name}: {how_measured(prof.raw)}")
    print(live_autoscale.table(point))
    if point["engine_speed"] is not None and not point["engine_speed"]["tests_model"]:
        print(f"NOT A TEST OF THE MODEL: {point['engine_speed']['says']} (--retry-slow N runs it again)")
    elif (edges := point.get("band_speeds")) is not None and edges["flips"]:
        print(f"RECOVERY NOT A TEST OF THE MODEL: {edges['says']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(point, f, indent=1, default=str)
        print(f"-> {a.json}")
    return 0


def cmd_validate_fleet(a, from_file=None) -> int:
    """`validate --replicas N [--routers ...]`: one point per routing policy
    (and condition) on a fleet of N engines behind the live proxy's router.
    A scenario file's [fleet] (`from_file`, as `_scenario_file` read it)
    gives the replicas, router, router retries and proxy placement the flags
    do not, and its [proxy] condition the point when --points is not given."""
    dep = from_file[1] if from_file is not None else None
    fleet = dep.fleet if dep is not None else None
    if fleet is not None and a.points is None:
        a.points = [_file_condition(a, dep, "named conditions")]
    layers, _ = _live_stack(a, from_file)
    if fleet is not None and len({p.name for p in fleet.profiles}) > 1:
        raise _err(f"validate: {a.scenario}: [fleet] gives the replicas different profiles "
                   f"({', '.join(fleet.profile_names or ())}); a live fleet is N identical engines: give one profile")
    n = a.replicas if a.replicas is not None else fleet.replicas if fleet is not None else 2
    if a.routers is None and fleet is not None:
        a.routers = [fleet.router.policy]
    if a.router_retries is None:
        a.router_retries = fleet.router.retries if fleet is not None else 1
    if a.fleet_proxy is None:
        a.fleet_proxy = fleet.router.proxy if fleet is not None else "replica"
    if n < 1:
        raise _err(f"validate: --replicas must be at least 1, got {n}")
    routers = a.routers or list(live_fleet.DEFAULT_ROUTERS)
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        raise _err(f"validate: unknown router {unknown[0]!r}; valid: {', '.join(ROUTERS)}")
    points = a.points or ["coalesce"]
    unknown = [p for p in points if p not in CONDITIONS]
    if unknown:
        raise _err(f"validate: unknown condition {unknown[0]!r}; valid: {', '.join(CONDITIONS)}")
    if layers:                  # the stack each point runs, as the simulator takes it (one line where it cannot)
        for r in routers:
            for p in points:
                try:
                    stack = Stack.under_layers(get_condition(p), layers, dep.scenario,
                                               RouterConfig(r, a.router_retries, a.fleet_proxy))
                    if stack.upstream_group:
                        check_group(stack, n)
                except ValueError as e:
                    raise _err(f"validate: {a.scenario}: {e}") from None
    eng, urls = a.engine, None
    if eng == "cpu":
        kind = "cpu"
    elif eng == "gpu":
        raise _err("validate --replicas: a fleet runs on the CPU engine (--engine cpu) or on engines given by "
                   "URL (--engine URL1,URL2,...)")
    elif eng.startswith(("http://", "https://")):
        kind = "url"
        urls = [u.strip() for u in eng.split(",") if u.strip()]
        if len(urls) != n:
            raise _err(f"validate --replicas {n}: an engine given by URL is one replica; give {n} comma-separated "
                       f"URLs (got {len(urls)})")
    else:
        raise _err(f"validate: --engine must be cpu or engine URLs (http://HOST:PORT,...), got {eng!r}")
    vs, prof = _scenario_and_profile(a, kind, "cpu-tiny", from_file)
    if kind == "cpu":
        if (problem := live_fleet.fleet_problem(n)) is not None:
            raise _err(f"validate: {problem}")
        if engine.cpu_installed() is None:
            raise _err("validate: the CPU engine is not installed: run `llmsim engine install --cpu` first")
    spec = EngineSpec(kind, url=urls[0] if urls else None)
    if kind == "url":
        try:
            spec.model = engine.connect(urls[0]).served_model()
            for u in urls[1:]:
                engine.connect(u)
        except engine.EngineError as e:
            raise _err(f"validate: cannot reach an engine: {e}") from None
        print(f"validate: the engines at {', '.join(urls)} are reused for every point (not fresh)", file=sys.stderr)
    if kind == "cpu":          # calibrated as a fleet's engine runs: on a core of its own
        spec.cpus = layout_cpus(FLEET_LAYOUT)[0]
    prof, _ = _predicting_profile(a, spec, prof, vs, kind, FLEET_LAYOUT)
    spec.cpus = None
    try:
        doc = live_fleet.validate_fleet(spec, prof, vs, n, routers, points, a.json, a.capacity,
                                        retries=a.router_retries, proxy=a.fleet_proxy, urls=urls,
                                        retry_slow=a.retry_slow, layers=layers)
    except (ValidationError, engine.EngineError) as e:
        raise _err(f"validate: {e}") from None
    print(f"{vs.name} on {n} x {doc['engine']['kind']} vLLM {doc['engine']['version']} ({doc['engine']['model']}), "
          f"profile {prof.name}, Ĉ {doc['capacity']:.3f} calls/s ({doc['capacity_per_replica']:.3f} a replica), "
          f"proxy per {a.fleet_proxy}, router retries {a.router_retries}, seed {vs.seed}")
    print(f"predicted with profile {prof.name}: {how_measured(prof.raw)}")
    print(live_fleet.fleet_table(doc["points"]))
    return _verdicts(doc["points"], lambda p: live_fleet.point_name(p["router"], p["condition"]), a.json)


def with_profile(dep, prof):
    """The deployment with every engine described by `prof` (a live fleet is
    N identical engines)."""
    fleet = dep.fleet and dataclasses.replace(dep.fleet, profiles=tuple(prof for _ in dep.fleet.profiles))
    return dataclasses.replace(dep, profile=prof, fleet=fleet)


def _predicting_profile(a, spec: EngineSpec, prof, vs, kind: str, layout: str):
    """The profile the points are predicted with, and the record's
    `calibration` (None where the profile is used as given). `--calibrate-from
    auto`: on a CPU engine, a profile measured under the validation harness on
    this machine in `layout` (the given one, or one fitted before and kept),
    else one fitted now from a live capacity run (`validate.harness`); on a
    GPU engine or one given by URL, the profile as given. A profile measured
    on another machine is fitted first whatever the mode (under `auto`, once:
    the fit is kept and reused), unless --no-recalibrate."""
    diffs = recalibrate_needed(prof.raw, kind, a.no_recalibrate, "validate")
    mode = a.calibrate_from
    if kind == "url":
        if mode == "capacity":
            raise _err("validate --calibrate-from capacity: needs an engine llmsim starts (cpu or gpu), whose step "
                       "recorder keeps the steps; an engine given by URL has none")
        return prof, None
    if not diffs and (mode == "profile" or (mode == "auto" and kind == "gpu")
                      or (mode == "auto" and under_harness_here(prof.raw, layout))):
        return prof, None
    if mode == "auto" and (hit := cached(prof.raw, layout)) is not None:      # fitted here: whatever its base
        fitted, path = hit
        _say(f"validate: predicting with the profile fitted under the validation harness here before ({path}; "
             "--calibrate-from capacity fits it again)")
        return from_dict(fitted, str(path)), fitted.get("calibration")
    if diffs:
        _say(f"validate: profile {prof.name!r} was measured on another machine ({'; '.join(diffs)}): "
             "fitting it from a live capacity run's steps first (--no-recalibrate to stop instead)")
    elif mode == "auto":
        _say(f"validate: profile {prof.name!r} was {how_measured(prof.raw)}, not under this validation's harness "
             "here: fitting it from a live capacity run through the live proxy first (kept for later validations; "
             "--calibrate-from profile predicts with it as it is)")
    p, calibration = _calibrate_first(spec, prof, vs, a.json, diffs, layout)
    if mode != "profile":
        keep(prof.raw, p.raw, layout)
    return p, calibration


def _calibrate_first(spec: EngineSpec, prof, vs, json_path: str | None, diffs: list[str], layout: str):
    """The live capacity protocol on a fresh engine, a profile fitted from its
    steps, the simulated protocol on that profile: (the fitted profile, the
    record's `calibration`). With --json, the fitted profile is kept beside it
    (JSON_STEM.profile.json) and reused when the record is resumed."""
    base = json_path or os.path.join(str(engine.STATE_DIR), "validate", "validate.json")
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    prof_path = (base[:-5] if base.endswith(".json") else base) + ".profile.json"
    if json_path and os.path.exists(json_path) and os.path.exists(prof_path):
        try:
            with open(prof_path) as f:
                fitted = json.load(f)
            p = from_dict(fitted, prof_path)
        except (OSError, ValueError, ProfileError) as e:
            raise _err(f"validate: cannot resume with {prof_path}: {e}; remove it and {json_path}") from None
        _say(f"validate: resuming with the profile fitted before ({prof_path})")
        return p, fitted["calibration"]
    steps = steps_path(base, "capacity")
    params = live_capacity.plan(capacity_for(prof, vs), via_proxy=True)     # the points' harness, as they run

    def progress(tag):
        def f(st):
            _say(f"  capacity ({tag}) stage {st['stage']}: planned {st['rate']:.2f} calls/s, queue growth "
                 f"{st['queue_growth']:+.3f}/s")
        return f
    _say("validate: live capacity protocol on a fresh engine, to fit the profile from its steps …")
    try:
        eng, started = spec.start(list(vs.engine_args))
    except engine.EngineError as e:
        raise _err(f"validate: {e}") from None
    try:
        fitted, live, sim_res = live_capacity.calibrate_under_load(
            eng, prof.raw, params, steps, name=f"{prof.name} (fitted under load here)", progress=progress,
            scenario=vs.scenario)
        # the speed probe on the engine just fitted: the reference a point's probe is compared with
        fitted["speed_probe"] = speed_probe(eng, from_dict(fitted), vs, _say) if started else None
    except (engine.EngineError, RuntimeError, ValueError) as e:
        raise _err(f"validate: calibrating from the capacity run: {e}") from None
    finally:
        if started:
            eng.stop()
    calibration = {"from": "capacity", "workload": vs.name, "params": params, "profile_before": prof.name,
                   "machine_differences": diffs,
                   "steps_file": steps, "steps": live["steps"], "profile_file": prof_path,
                   "live_capacity": live["capacity"], "simulated_capacity": sim_res["capacity"],
                   "live_wall_s": live["wall_s"], "fit_error": fitted["provenance"]["fit_error"], "layout": layout}
    fitted["calibration"] = calibration
    fitted["provenance"]["measured_under"] = measured_under(layout, spec.kind, live["steps"])
    p = from_dict(fitted, prof_path)
    args.write_json(prof_path, fitted)
    print(fit_summary(fitted["fit"], p.step_time))
    return p, calibration


def cmd_proxy(a) -> int:
    ups = []
    for given in a.upstream:
        for u in given.split(","):
            try:
                ups.append(upstream_url(u.strip()))
            except ValueError as e:
                raise _err(f"proxy: --upstream {e}") from None
    if len(set(ups)) < len(ups):
        raise _err(f"proxy: an engine is given twice in --upstream ({', '.join(ups)})")
    fleet_flags = [f for f, v in (("--router", a.router), ("--router-retries", a.router_retries),
                                  ("--fleet-proxy", a.fleet_proxy)) if v is not None]
    router = None
    if len(ups) > 1:
        router = RouterConfig(a.router or "call-affinity", 1 if a.router_retries is None else a.router_retries,
                              a.fleet_proxy or "replica")
    elif fleet_flags:
        raise _err(f"proxy: {', '.join(fleet_flags)} need{'s' if len(fleet_flags) == 1 else ''} two or more engines "
                   "in --upstream (got one)")
    layers = ()
    if a.layers_from is not None:
        try:
            dep = load(a.layers_from, build_prior=build_prior)
        except ScenarioError as e:
            raise _err(str(e)) from None
        layers = tuple(s for s in dep.layer_settings() if not layer_kind(s["kind"]).top)
        if not layers:
            raise _err(f"proxy: --layers-from {a.layers_from}: no [[layer]] that stands between the client and "
                       "the proxy (a gateway)")
    return proxy_main(ups, condition(a), a.host, a.port, a.prompt_throughput, router, layers)


def add_subcommands(sub) -> None:
    p = sub.add_parser("validate", help="predict points of a scenario with the simulator and run them live on a "
                                        "real vLLM engine; prints both side by side")
    p.add_argument("--engine", required=True, metavar="cpu|gpu|URL",
                   help="cpu: llmsim's vllm-cpu with the tiny model; gpu: `vllm serve MODEL` here; "
                        "or the URL of a running vLLM OpenAI server (reused for every point)")
    p.add_argument("--scenario", default=None, metavar="FILE|NAME",
                   help="cpu-small (default for cpu), paper (default otherwise), another named scenario, or a "
                        "scenario file (its profile unless --profile)")
    p.add_argument("--points", type=args.comma_list(str, "condition names"), default=None,
                   help="comma-separated conditions, e.g. no-control,no-retry,coalesce (with --replicas: "
                        "default coalesce)")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="a fleet: N engines (cpu: each pinned to a core of its own; or N comma-separated URLs "
                        "in --engine) behind the router in the live proxy, one point per router; default "
                        "scenario cpu-tiny. A scenario file's [fleet] makes a fleet too (its replicas, router, "
                        "router_retries and proxy, unless these flags are given)")
    p.add_argument("--routers", type=args.comma_list(str, "router names"), default=None,
                   help=f"with --replicas: the routing policies, one point each (default: the scenario file's [fleet] "
                        f"router, else all: {', '.join(ROUTERS)})")
    p.add_argument("--router-retries", type=args.positive(int, allow_zero=True), default=None, metavar="K",
                   help="with --replicas: on an engine's 503 the router tries up to K other replicas (default: the "
                        "scenario file's [fleet] router_retries, else 1)")
    p.add_argument("--fleet-proxy", choices=PROXY_PLACEMENTS, default=None,
                   help="with --replicas: replica: a sidecar proxy before each engine, the router before them; "
                        "deployment: one proxy before the router (default: the scenario file's [fleet] proxy, "
                        "else replica)")
    p.add_argument("--model", default="qwen2.5-7b",
                   help="gpu: the model to serve (an embedded profile name or a HF id; default qwen2.5-7b)")
    p.add_argument("--profile", default=None, metavar="NAME|PATH",
                   help="the engine's profile (default: vllm-cpu-tiny for cpu, the model's for gpu)")
    p.add_argument("--capacity", type=args.positive(), default=None,
                   help="Ĉ in calls/s (default: the simulator's capacity protocol on the profile)")
    p.add_argument("--json", metavar="PATH", help="the record; an existing one is resumed. Each point's "
                                                 "recorded steps are kept beside it (PATH_STEM.POINT.steps.jsonl; "
                                                 "one engine only)")
    p.add_argument("--calibrate-from", choices=CALIBRATE_FROM, default="auto",
                   help="auto (default): on a CPU engine, predict with a profile measured under this validation's "
                        "harness on this machine (the given one if it was, else one fitted from a live capacity run "
                        "through the live proxy, kept for later validations); capacity: fit it anew; profile: "
                        "predict with the profile as given")
    p.add_argument("--layout", choices=LAYOUTS, default=DEFAULT_LAYOUT,
                   help=f"cpu: where the engine runs: shared (the engine and the harness share every core), split "
                        f"(the engine pinned to the first core, the harness to the others) or apart (the engine's "
                        f"forward passes alone on the first core, its API server and engine core with the harness "
                        f"on the others); default {DEFAULT_LAYOUT}")
    p.add_argument("--retry-slow", type=args.positive(int, allow_zero=True), default=0, metavar="N",
                   help="run a point again, up to N times, while its engine ran outside the speed band "
                        "(k, its step time over the profile's, outside 0.9-1.1): such a point does not test the "
                        "model (default 0)")
    p.add_argument("--no-speed-probe", action="store_true",
                   help="one engine: do not measure the fresh engine's speed with a few calls before each point "
                        "(by default each point is predicted for the engine's speed so measured, the profile's "
                        "steps scaled by it)")
    p.add_argument("--no-recalibrate", action="store_true",
                   help="stop if the profile was measured on another machine, instead of fitting it first")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("proxy", help="the live proxy in front of a vLLM OpenAI server, "
                                     "with Prometheus metrics on /metrics")
    p.add_argument("--upstream", required=True, action="append", metavar="URL[,URL...]",
                   help="the engine, e.g. http://127.0.0.1:8000; several (comma-separated or the flag repeated): "
                        "a fleet, behind the router")
    p.add_argument("--router", choices=ROUTERS, default=None,
                   help="with several engines: the routing policy (default call-affinity: a retry reaches the "
                        "engine holding its call's execution)")
    p.add_argument("--router-retries", type=args.positive(int, allow_zero=True), default=None, metavar="K",
                   help="with several engines: on an engine's 503 the router tries up to K other engines "
                        "(default 1)")
    p.add_argument("--fleet-proxy", choices=PROXY_PLACEMENTS, default=None,
                   help="with several engines: replica (default): the controls per engine (a sidecar each), "
                        "the router before them; deployment: the controls once, before the router")
    p.add_argument("--condition", help=f"one of: {', '.join(CONDITIONS)} (the control flags change its settings)")
    p.add_argument("--port", type=args.positive(int), default=8001)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prompt-throughput", type=args.positive(), default=None, metavar="TOKENS_PER_S",
                   help="the estimator's prompt throughput before any first token is seen")
    p.add_argument("--layers-from", default=None, metavar="FILE|NAME",
                   help="host the scenario's gateway [[layer]]s above the controls, in their order (the "
                        "simulator's own gateway objects: a 504 on a gateway's upstream timeout, a 503 from its "
                        "queue); its client layer is whoever calls the proxy")
    control_args(p)
    p.set_defaults(fn=cmd_proxy)
