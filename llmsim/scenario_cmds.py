"""`llmsim scenario show|check` (check's report: `implications`, what a
deployment implies), and the `--scenario FILE|NAME` option the model's
commands share (`scenario_arg`, `deployment`)."""
from __future__ import annotations

import math
import sys

import numpy as np

from calibrate.efficiencies import derive_from_config
from sim.deployment import Deployment, ScenarioError, load
from sim.profile import ProfileError
from sim.scenario import SCENARIOS

from . import args


def build_prior(path: str, gpu: str, **serving) -> dict:
    """A profile derived by the physical step-time model with the fitted
    efficiencies (`llmsim calibrate prior`) for `[model] hf_config`, `gpu`
    and how the model is served (`[model]`'s keys of vLLM's flags)."""
    prof = derive_from_config(path, gpu, capacity=1.0, **serving)
    prof["provenance"]["capacity"] = "placeholder: the capacity protocol runs on the scenario's workload"
    return prof


def scenario_arg(p, trace_speedup: bool = True) -> None:
    p.add_argument("--scenario", metavar="FILE|NAME", default=None,
                   help=f"a scenario file (TOML; `llmsim scenario show` prints one) or a named scenario "
                        f"({', '.join(SCENARIOS)}); default: the reference design (paper)")
    if trace_speedup:
        p.add_argument("--trace-speedup", type=args.positive(), default=None, metavar="X",
                       help="replay the scenario's trace X times faster (arrival times / X)")


def deployment(a, burst: bool = True, capacity: bool = True, layers: bool = False) -> Deployment:
    """The deployment a command runs: `--scenario` (default paper) with the
    command's --model, --pulse, --max-batched-tokens and --mixed-prompts
    applied where given; with `burst`, one that forms cohorts and whose
    layers the simulator runs (with `layers`, [[layer]] tables: the
    commands that run through `Deployment.run`); with
    `capacity`, its Ĉ resolved (a failing protocol is bad input too)."""
    src = getattr(a, "scenario", None)
    try:
        dep = load(src or "paper", build_prior=build_prior, trace_speedup=getattr(a, "trace_speedup", None))
        if getattr(a, "trace_speedup", None) is not None and dep.trace_source is None:
            raise ScenarioError("--trace-speedup needs a --scenario whose [workload] has a trace")
        model = getattr(a, "model", None)
        pulse = getattr(a, "pulse", None)
        if src is None and model is None:
            model = args.DEFAULT_MODEL
        dep = dep.with_changes(model=model, pulse=pulse, max_batched_tokens=getattr(a, "max_batched_tokens", None),
                               mixed_prompts=bool(getattr(a, "mixed_prompts", False)))
        if burst:
            dep.require_burst()
            dep.require_simulated(layers)
        if capacity:
            dep.capacity
    except (ScenarioError, ProfileError) as e:
        raise args.UsageError(f"{a.command}: {e}") from None
    return dep


def layers_line(layers: tuple | None) -> str:
    """'the client layer PRESET (key value, ...), ...' of [[layer]] tables'
    effective settings (their retry keys), or '' for the reference design's
    client."""
    keys = ("timeout_s", "deadline_s", "max_retries", "backoff", "backoff_base_s", "backoff_cap_s")
    out = []
    for s in layers or ():
        shown = {k: "none" if s.get(k) is None else f"{s[k]:g}" if isinstance(s[k], (int, float)) else s[k]
                 for k in keys if k in s}
        out.append(f"the {s['kind']} layer {s['preset']} (" + ", ".join(f"{k} {v}" for k, v in shown.items()) + ")")
    return ", then ".join(out)


def capacity_line(dep: Deployment) -> str:
    info = dep.capacity_info
    if dep.fleet is not None and dep.fleet.autoscaler is not None:
        k = dep.fleet.autoscaler.initial
        return (f"Ĉ {dep.capacity:.3f} calls/s, of the {k} replica{'s' if k != 1 else ''} the autoscaler starts "
                f"with (at most {dep.fleet.replicas}; {info['source']})")
    if dep.fleet is not None:
        return f"Ĉ {dep.capacity:.3f} calls/s, the sum of the {dep.fleet.replicas} replicas' ({info['source']})"
    if info["source"] == "profile":
        return f"Ĉ {dep.capacity:.3f} calls/s (the profile's, measured on this workload)"
    if info["key"] is None:
        return f"Ĉ {dep.capacity:.3f} calls/s ({info['source']})"
    return (f"Ĉ {dep.capacity:.3f} calls/s ({info['source']}: the workload's mix or engine differs from the one "
            f"the profile's Ĉ {dep.profile.capacity:.3f} was measured on; computed once, cached as {info['key']})")


def cmd_show(a) -> int:
    try:
        dep = load(a.name, build_prior=build_prior)
    except (ScenarioError, ProfileError) as e:
        raise args.UsageError(f"scenario show: {e}") from None
    sys.stdout.write(dep.to_toml())
    return 0


def implications(dep: Deployment) -> dict:
    """What the scenario implies: calls per phase at Ĉ, the burst's backlog
    (arrivals beyond capacity over the burst, in seconds of work at
    capacity) against the deadline, and the KV seats for the mean prompt
    plus mean response."""
    s, cap = dep.scenario, dep.capacity
    out: dict = {"capacity": cap, "capacity_source": dep.capacity_info["source"]}
    if dep.trace_source is not None:
        tr = dep.trace_source.trace
        out["phases"] = [{"name": "trace", "duration_s": float(tr.arrival[-1]), "calls": len(tr)}]
        if dep.burst is not None:
            n = int(np.count_nonzero((tr.arrival >= s.pulse_start) & (tr.arrival < s.pulse_end)))
            burst_rate = n / s.pulse_s
    else:
        out["phases"] = []
        for name, (a, b, r) in zip([p.name for p in s.phases], s.arrival_phases(cap)):
            out["phases"].append({"name": name, "duration_s": b - a, "rate": r, "calls": r * (b - a)})
        if dep.burst is not None:
            burst_rate = next(p["rate"] for p in out["phases"] if p["name"] == dep.burst)
    if dep.burst is not None:
        backlog = max(0.0, burst_rate - cap) * s.pulse_s / cap
        out["burst"] = {"name": dep.burst, "start_s": s.pulse_start, "end_s": s.pulse_end,
                        "rate": burst_rate, "load": burst_rate / cap, "backlog_s": backlog,
                        "deadline_s": s.deadline_s, "beyond_deadline": backlog > s.deadline_s}
    out["kv"] = _kv_seats(dep)
    return out


def _kv_seats(dep: Deployment) -> dict:
    """The KV cache's seats for a mean call (mean prompt, mixed ones
    included, plus mean response)."""
    s, e = dep.scenario, dep.profile.engine
    mean_prompt = (s.prompt.expected if s.prompt else s.prompt_mean)
    if s.mixed_share:
        mean_prompt = (1 - s.mixed_share) * mean_prompt + s.mixed_share * s.mixed_prompt_len
    mean_resp = s.response.expected if s.response else s.response_mean
    per = math.ceil((mean_prompt + mean_resp) / e["block_size"])
    return {"tokens": e["num_gpu_blocks"] * e["block_size"], "blocks": e["num_gpu_blocks"],
            "mean_prompt": mean_prompt, "mean_response": mean_resp, "blocks_per_call": per,
            "seats": e["num_gpu_blocks"] // per, "max_num_seqs": e["max_num_seqs"]}


def cmd_check(a) -> int:
    try:
        dep = load(a.file, build_prior=build_prior)
        dep.capacity
    except (ScenarioError, ProfileError) as e:
        raise args.UsageError(f"scenario check: {e}") from None
    imp = implications(dep)
    e = dep.profile.engine
    over = dep.profile.raw.get("engine_overrides") or {}
    print(f"{dep.name} (content hash {dep.content_hash}): {a.file} is valid")
    print(f"model {dep.profile.name} ({dep.profile.provenance.get('kind')})"
          + (f"; engine flags changed: {', '.join(f'{k}={v}' for k, v in over.items())}" if over else ""))
    if dep.profile.provenance.get("kind") == "roofline prior":
        print("  derived from the model's shape and the GPU's datasheet, with hardware efficiencies fitted on public "
              "measurements of real vLLM (docs/any-model.md): not a measurement")
        kv_given = "kv_cache_tokens" in over or "num_gpu_blocks" in over     # not derived again at another utilization
        kv_note = [] if kv_given or "kv_note" not in dep.profile.provenance else [dep.profile.provenance["kv_note"]]
        for note in [*dep.profile.provenance.get("notes", ()), *kv_note]:
            print(f"  {note}")
    print(capacity_line(dep))
    if dep.fleet is not None:
        f, caps = dep.fleet, dep.capacity_info["replicas"]
        print(f"fleet: {f.replicas} replicas behind a {f.router.policy} router (retries {f.router.retries}), proxy "
              f"per {f.router.proxy}; Ĉ per replica "
              + ", ".join(f"{p.name} {c:.3f}" for p, c in zip(f.profiles, caps)))
    for sec, values in dep.sections.items():
        print(f"[{sec}]: " + ", ".join(f"{k} = {v!r}" for k, v in values.items()))
    for i, t in enumerate(dep.stack_layers):
        changed = {k: v for k, v in t.items() if k not in ("kind", "preset")}
        print(f"layer[{i}]: {t['kind']} {t['preset']}" + (": " + ", ".join(f"{k} = {v!r}" for k, v in changed.items())
                                                         if changed else " (its defaults)")
              + " (`llmsim stack` shows the stack)")
    if dep.trace_source is not None:
        t = dep.trace_source
        print(f"trace {t.path} ({t.info['dialect']} columns, sha256 {t.sha256}): {t.info['calls']} calls over "
              f"{t.info['span_s']:.1f} s (speedup {t.speedup:g})")
    else:
        for p in imp["phases"]:
            print(f"  phase {p['name']:<10} {p['duration_s']:8.1f} s at {p['rate']:.3f} calls/s "
                  f"({p['rate'] / dep.capacity:.2f} x Ĉ): {p['calls']:.0f} calls expected")
    b = imp.get("burst")
    if b is None:
        print("no burst declared: run and diagnose need one ([measures] burst, or burst_start_s/burst_end_s)")
    else:
        verdict = ("beyond one deadline: retries of calls that time out in the backlog can keep the engine "
                   "from recovering (docs/model.md)" if b["beyond_deadline"] else "within one deadline")
        print(f"burst {b['name']}: {b['start_s']:g}-{b['end_s']:g} s at {b['load']:.2f} x Ĉ; backlog at capacity "
              f"{b['backlog_s']:.0f} s of work against a {b['deadline_s']:g} s deadline: {verdict}")
    kv = imp["kv"]
    print(f"KV cache {kv['tokens']:,} tokens ({kv['blocks']} blocks of {e['block_size']}): a mean call "
          f"({kv['mean_prompt']:.0f} prompt + {kv['mean_response']:.0f} response tokens) takes {kv['blocks_per_call']} "
          f"blocks, {kv['seats']} seats (max_num_seqs {kv['max_num_seqs']})")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("scenario", help="scenario files: print one (show) or check one (check)")
    ss = p.add_subparsers(dest="scenario_command", required=True, parser_class=type(p))
    q = ss.add_parser("show", help="print a named scenario as a complete, commented TOML file")
    q.add_argument("name", nargs="?", default="paper", metavar="NAME|FILE",
                   help=f"{', '.join(SCENARIOS)} (default paper), or a file to print resolved")
    q.set_defaults(fn=cmd_show)
    q = ss.add_parser("check", help="validate a scenario file and print what it implies")
    q.add_argument("file", metavar="FILE")
    q.set_defaults(fn=cmd_check)
