"""`llmsim stack`: a scenario's stack of layers, application first, each with
its effective settings (a preset's values with the scenario's overrides, each
value's source), and what the stack can do to one call (the most attempts at
the engine, the longest it can be retried for, the layers that let an
abandoned request run on: `sim.policy.stackinfo`)."""
from __future__ import annotations

import math

from sim.deployment import Deployment, ScenarioError, load
from sim.policy.presets import PRESETS, citations
from sim.policy.stack import Stack
from sim.policy.stackinfo import REFERENCE_SOURCE, reference_layers, stack_info
from sim.profile import ProfileError

from . import args
from .scenario_cmds import build_prior, scenario_arg

SCENARIO_SOURCE = "set in the scenario"
KIND_SOURCE = "the kind's default"          # a key of a layer with no preset, not set in the scenario


def _finite(x):
    """A bound as JSON carries it: None for no bound."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else (
        None if isinstance(x, float) else x)


def _layers(dep: Deployment) -> tuple[list, list, bool]:
    """(settings, sources, reference): each layer's effective settings and
    each key's source; the reference design's own layers when the scenario
    gives no [[layer]]."""
    if dep.stack_layers:
        settings = dep.layer_settings()
        sources = []
        for given, s in zip(dep.stack_layers, settings):
            cited = citations(given["preset"]) if given.get("preset") in PRESETS else {}
            sources.append({k: SCENARIO_SOURCE if k in given and k not in ("kind", "preset")
                            else cited.get(k, KIND_SOURCE)
                            for k in s if k not in ("kind", "preset", "version")})
        return settings, sources, False
    router = dep.fleet.router if dep.fleet is not None else None
    settings = reference_layers(Stack.from_config(dep.condition_for(), router, dep.scenario))
    return settings, [{k: REFERENCE_SOURCE for k in s if k not in ("kind", "name")} for s in settings], True


def describe(dep: Deployment) -> dict:
    """The stack as data (what `--json` writes)."""
    settings, sources, reference = _layers(dep)
    info = stack_info(settings)
    layers = []
    nan = lambda **xs: [k for k, x in xs.items() if x != x]    # noqa: E731 (figures unknown: NaN)
    for s, src, li, sent in zip(settings, sources, info.layers, info.sent_attempts):
        layers.append({"name": li.name, "kind": li.kind, "preset": s.get("preset"), "version": s.get("version"),
                       "settings": {k: {"value": _finite(list(v) if isinstance(v, tuple) else v), "source": src[k]}
                                    for k, v in s.items() if k in src},
                       "attempts": _finite(float(li.attempts)), "reaching_below": _finite(float(li.reaching)),
                       "attempts_sent": _finite(float(sent)), "attempt_s": _finite(float(li.attempt_s)),
                       "span_s": _finite(float(li.span_s)), "runs_on": list(li.runs_on), "composed": li.composed,
                       "unknown": nan(attempts=li.attempts, reaching_below=li.reaching, attempts_sent=sent,
                                      attempt_s=li.attempt_s, span_s=li.span_s)})
    # a layer that cannot be composed leaves figures unknown: None in JSON as no bound is, named in `unknown`
    group = next((s.get("upstream_servers", 1) for s in settings if s.get("kind") == "gateway"
                  and s.get("upstream_servers", 1) > 1), None)
    placement = dep.fleet.router.proxy if dep.fleet is not None and group else None
    return {"scenario": dep.name, "reference_design": reference, "layers": layers,
            "upstream_group": None if group is None else {"servers": group, "proxy": placement},
            "engine_attempts": _finite(float(info.engine_attempts)), "longest_s": _finite(float(info.longest_s)),
            "runs_on": list(info.runs_on), "not_composed": list(info.not_composed),
            "unknown": nan(engine_attempts=info.engine_attempts, longest_s=info.longest_s)}


def _num(d: dict, key: str, unit: str = "") -> str:
    """d[key] as the text shows it: unknown, no bound or the figure."""
    x = d[key]
    return "unknown" if key in d["unknown"] else "no bound" if x is None else f"{x:g}{unit}"


def _value(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def cmd_stack(a) -> int:
    try:
        dep = load(a.scenario or "paper", build_prior=build_prior)
        d = describe(dep)
    except (ScenarioError, ProfileError, ValueError) as e:
        raise args.UsageError(f"stack: {e}") from None
    where = "its client, proxy and router: no [[layer]] given" if d["reference_design"] else "its [[layer]] tables"
    print(f"stack of {d['scenario']}: {len(d['layers'])} layers from the application down ({where})")
    for i, layer in enumerate(d["layers"]):
        head = f"{i + 1}. {layer['kind']}" + (f" {layer['name']}" if layer["name"] != layer["kind"] else "")
        if layer["preset"]:
            head += f" (preset {layer['preset']}, {layer['version']})"
        print(head)
        width = max((len(k) for k in layer["settings"]), default=0)
        shown = {k: _value(s["value"]) for k, s in layer["settings"].items()}
        vwidth = max((len(v) for v in shown.values()), default=0)
        for k, s in layer["settings"].items():
            print(f"     {k:<{width}} = {shown[k]:<{vwidth}}  {s['source']}")
        if not layer["composed"]:
            print(f"   cannot be composed: a {layer['kind']} layer says nothing of the attempts or times it adds, "
                  "so the stack's figures are unknown")
            continue
        runs = f"; an abandoned request runs on ({', '.join(layer['runs_on'])})" if layer["runs_on"] else ""
        print(f"   attempts per attempt from above {_num(layer, 'attempts')}, of which "
              f"{_num(layer, 'reaching_below')} can reach below; one attempt lasts at most "
              f"{_num(layer, 'attempt_s', ' s')}, with its retries {_num(layer, 'span_s', ' s')}{runs}")
    if (g := d["upstream_group"]) is not None:
        where = ("before it ([fleet] proxy = \"deployment\"): the gateway takes its executions" if g["proxy"] ==
                 "deployment" else "behind it, a sidecar before each engine ([fleet] proxy = \"replica\")")
        print(f"the gateway's upstream group balances {g['servers']} replicas; the condition's proxy stands {where}")
    print(f"most attempts one call can cause at the engine: {_num(d, 'engine_attempts')}")
    print(f"longest a call can go on being retried: {_num(d, 'longest_s', ' s')}")
    print("layers that let an abandoned request run on: " + (", ".join(d["runs_on"]) or "none"))
    args.write_json(a.json, d)
    if a.json:
        print(f"wrote {a.json}")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("stack", help="a scenario's stack of layers: each layer's effective settings and sources, "
                                     "the most attempts one call can cause, the longest it can be retried, which "
                                     "layers let an abandoned request run on")
    scenario_arg(p, trace_speedup=False)
    p.add_argument("--json", metavar="PATH", default=None, help="write the same as JSON")
    p.set_defaults(fn=cmd_stack)
