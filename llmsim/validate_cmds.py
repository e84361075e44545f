"""`llmsim validate`: the command-line side of `validate.validation`."""
from __future__ import annotations

import sys


def _err(msg):
    from sim.cli import UsageError
    return UsageError(msg)


def _profile_for(a, kind: str):
    from sim.cli import _profile
    from .validation import GPU_MODELS
    if a.profile:
        return _profile(a.profile)
    if kind == "cpu":
        return _profile("vllm-cpu-tiny")
    if kind == "gpu":
        if a.model in GPU_MODELS:
            return _profile(a.model)
        raise _err(f"validate: no embedded profile for {a.model!r}; give --profile (embedded: "
                   f"{', '.join(GPU_MODELS)}, or a profile file from `llmsim calibrate`)")
    raise _err("validate: an engine given by URL needs --profile NAME|PATH (its step-time profile)")


def cmd_validate(a) -> int:
    from validate import engine as E
    from .scenarios import get_scenario
    from .validation import EngineSpec, GPU_MODELS, ValidationError, table, validate
    from sim.conditions import CONDITIONS

    eng = a.engine
    if eng in ("cpu", "gpu"):
        kind = eng
    elif eng.startswith(("http://", "https://")):
        kind = "url"
    else:
        raise _err(f"validate: --engine must be cpu, gpu or an engine URL (http://HOST:PORT), got {eng!r}")
    unknown = [p for p in a.points if p not in CONDITIONS]
    if unknown:
        raise _err(f"validate: unknown condition {unknown[0]!r}; valid: {', '.join(CONDITIONS)}")
    try:
        vs = get_scenario(a.scenario or ("cpu-small" if kind == "cpu" else "paper"))
    except ValueError as e:
        raise _err(f"validate: {e}") from None
    prof = _profile_for(a, kind)
    if kind == "cpu" and E.cpu_installed() is None:
        raise _err("validate: the CPU engine is not installed: run `llmsim engine install --cpu` first")
    if kind == "gpu" and (problem := E.gpu_problem()) is not None:
        raise _err(f"validate --engine gpu: {problem}")
    spec = EngineSpec(kind, model=GPU_MODELS.get(a.model, a.model) if kind == "gpu" else None,
                      url=eng if kind == "url" else None)
    if kind == "url":
        try:
            spec.model = E.connect(eng).served_model()
        except E.EngineError as e:
            raise _err(f"validate: cannot reach the engine at {eng}: {e}") from None
        print(f"validate: the engine at {eng} is reused for every point (not fresh)", file=sys.stderr)
    try:
        doc = validate(spec, prof, vs, a.points, a.json, a.capacity)
    except (ValidationError, E.EngineError) as e:
        raise _err(f"validate: {e}") from None
    print(f"{vs.name} on {doc['engine']['kind']} vLLM {doc['engine']['version']} ({doc['engine']['model']}), "
          f"profile {prof.name}, Ĉ {doc['capacity']:.3f} calls/s, seed {vs.seed}")
    print(table(doc["points"]))
    for p in doc["points"]:
        ag = p["agreement"]
        print(f"{p['condition']}: recovered {'agrees' if ag['recovered'] else 'DIFFERS'}; delivery live - sim: "
              f"pulse {ag['pulse_delivered_diff']:+.1f}, hold {ag['hold_delivered_diff']:+.1f} points"
              f"{'' if ag['all'] else '  (beyond the 15-point bar)'}")
    if a.json:
        print(f"-> {a.json}")
    return 0


def add_subcommands(sub) -> None:
    from sim.cli import _list, _positive
    p = sub.add_parser("validate", help="predict points of a scenario with the simulator and run them live on a "
                                        "real vLLM engine; prints both side by side")
    p.add_argument("--engine", required=True, metavar="cpu|gpu|URL",
                   help="cpu: llmsim's vllm-cpu with the tiny model; gpu: `vllm serve MODEL` here; "
                        "or the URL of a running vLLM OpenAI server (reused for every point)")
    p.add_argument("--scenario", default=None, help="cpu-small (default for cpu) or paper (default otherwise)")
    p.add_argument("--points", type=_list(str, "condition names"), required=True,
                   help="comma-separated conditions, e.g. no-control,no-retry,coalesce")
    p.add_argument("--model", default="qwen2.5-7b",
                   help="gpu: the model to serve (an embedded profile name or a HF id; default qwen2.5-7b)")
    p.add_argument("--profile", default=None, metavar="NAME|PATH",
                   help="the engine's profile (default: vllm-cpu-tiny for cpu, the model's for gpu)")
    p.add_argument("--capacity", type=_positive(), default=None,
                   help="Ĉ in calls/s (default: the simulator's capacity protocol on the profile)")
    p.add_argument("--json", metavar="PATH", help="the record; an existing one is resumed")
    p.set_defaults(fn=cmd_validate)
