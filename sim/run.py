"""One run of the model: a condition on a trace of a scenario, measured into
the result record; and the capacity Ĉ of a workload (`workload_capacity`)."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os

from . import measures
from .capacity import capacity_protocol
from .conditions import Condition, get_condition
from .model import simulate
from .profile import Profile
from .scenario import PAPER, SCENARIOS, Scenario
from .workload import Trace, make_trace

_CAPACITY_CACHE: dict[str, dict] = {}


def profile_workload(profile: Profile) -> Scenario:
    """The workload the profile's Ĉ was measured on: its capacity protocol's
    named scenario (`capacity_protocol.scenario_name`), else the reference
    design's."""
    name = (profile.raw.get("capacity_protocol") or {}).get("scenario_name", "paper")
    return SCENARIOS[name].scenario if name in SCENARIOS else PAPER


def profile_engine_key(profile: Profile) -> dict:
    return {"step_time": {k: getattr(profile.step_time, k) for k in sorted(vars(profile.step_time))},
            "engine": dict(sorted(profile.engine.items()))}


def needs_recalibration(profile: Profile, scenario: Scenario) -> bool:
    """Whether the profile's Ĉ is not this workload's: the prompt and
    response mix differs from the one it was measured on, the engine's flags
    were overridden, or the profile is a roofline prior (its Ĉ a placeholder)."""
    return profile.engine != profile.raw.get("engine_profile", profile.engine) or \
        profile.provenance.get("kind") == "roofline prior" or \
        scenario.workload_key != profile_workload(profile).workload_key


def cache_dir() -> str | None:
    """Where computed Ĉ are kept: $LLMSIM_CACHE_DIR (empty: nowhere on disk),
    else $XDG_CACHE_HOME/llmsim or ~/.cache/llmsim."""
    if "LLMSIM_CACHE_DIR" in os.environ:
        return os.environ["LLMSIM_CACHE_DIR"] or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "llmsim")


@functools.lru_cache(maxsize=1)
def simulator_hash() -> str:
    """A hash of the simulator's own source (engine, policies, driver,
    workload, protocol): a cached Ĉ is not reused across changes to them."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for sub in ("engine", "policy"):
        for name in sorted(os.listdir(os.path.join(root, sub))):
            if name.endswith(".py"):
                with open(os.path.join(root, sub, name), "rb") as f:
                    h.update(f.read())
    for name in ("model.py", "capacity.py", "workload.py", "conditions.py"):
        with open(os.path.join(root, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _work(s: Scenario) -> float:
    """A rough cost of one call in prompt-token equivalents (a decode step's
    token costing some twenty prefill tokens)."""
    prompt = s.prompt.expected if s.prompt else s.prompt_mean
    if s.mixed_share:
        prompt = (1 - s.mixed_share) * prompt + s.mixed_share * s.mixed_prompt_len
    resp = s.response.expected if s.response else s.response_mean
    return max(1.0, prompt - s.shared_prefix) + 20.0 * resp


def start_rate(profile: Profile, scenario: Scenario) -> float:
    """The protocol's first stage: 1.0 calls/s, or for a workload
    whose Ĉ is guessed (the profile's, scaled by the work of a call) above
    8 calls/s, the stage of the reference design's schedule (1.0 x 1.5^k) a few stages
    below that guess, so light workloads skip minutes of idle stages."""
    guess = profile.capacity * _work(profile_workload(profile)) / _work(scenario)
    k = max(0, math.floor(math.log(guess / 8.0) / math.log(1.5))) if guess > 8.0 else 0
    return 1.5 ** k


def workload_capacity(profile: Profile, scenario: Scenario, seed: int = 0) -> dict:
    """Ĉ of `scenario`'s prompt and response mix on the profile's engine:
    {"capacity", "source", "key"}. The profile's own Ĉ where it was measured
    on this mix with these flags (`needs_recalibration`); otherwise the capacity
    protocol run on the simulator with this workload, once per content hash
    of the engine, the workload and the simulator's source (kept in memory
    and as JSON under `cache_dir()`)."""
    if not needs_recalibration(profile, scenario):
        return {"capacity": profile.capacity, "source": "profile", "key": None}
    ident = {"engine": profile_engine_key(profile), "workload": scenario.workload_key, "seed": seed,
             "protocol": {"start_rate": start_rate(profile, scenario), "factor": 1.5, "stage_s": 300.0,
                          "max_stages": 12}, "simulator": simulator_hash()}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    hit = _CAPACITY_CACHE.get(key)
    d = cache_dir()
    path = os.path.join(d, f"capacity-{key}.json") if d else None
    if hit is None and path and os.path.isfile(path):
        with open(path) as f:
            hit = json.load(f)
    if hit is None:
        start = start_rate(profile, scenario)
        res = capacity_protocol(profile, scenario, seed=seed, start_rate=start)
        hit = {"capacity": res["capacity"], "source": "capacity protocol on this workload", "key": key,
               "saturated_stage": res["saturated_stage"], "start_rate": start}
        if path:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                measures.write_json(path, hit)
            except OSError:
                pass                               # an unwritable cache only costs a rerun
    _CAPACITY_CACHE[key] = hit
    return hit


def run_one(profile: Profile, condition: str | Condition, pulse: float, seed: int, max_batched_tokens=None,
            mixed_prompts=False, trace: Trace | None = None, fast_forward=True, scenario: Scenario | None = None,
            capacity: float | None = None, extra: dict | None = None, stack=None) -> dict:
    """Simulate `condition` with the trace of `seed` (or the `trace` given,
    which must be of the same scenario and capacity) and return the result
    record. The scenario is the reference one at `pulse` unless `scenario`
    is given (then `pulse` is only recorded). Ĉ is `capacity` if given,
    else the workload's (`workload_capacity`: with mixed prompts the
    protocol's Ĉ of the mix, docs/model.md). `extra` is added to the record's
    inputs. `stack` (a `sim.policy.stack.Stack`) replaces the condition's
    layers."""
    cond = condition if isinstance(condition, Condition) else get_condition(condition)
    sc = scenario if scenario is not None else PAPER.with_(pulse=pulse)
    if mixed_prompts:
        sc = sc.with_(mixed_share=0.5)
    if capacity is None:
        capacity = workload_capacity(profile, sc)["capacity"]
    if trace is None:
        trace = make_trace(capacity, sc, seed)
    log = simulate(profile, trace, cond, sc, seed, max_batched_tokens=max_batched_tokens, fast_forward=fast_forward,
                   stack=stack)
    rec = measures.record(log, sc, capacity, run_inputs(profile, cond, pulse, seed, max_batched_tokens,
                                                        mixed_prompts, extra))
    if cond.proxy.sheds:
        rec["shed"] = measures.shed(log)
    if sc.classes and trace.klass is not None:
        rec = measures.with_classes(rec, measures.class_records(log, sc, capacity, trace.klass))
    return rec


def run_inputs(profile: Profile, cond: Condition, pulse, seed: int, max_batched_tokens=None,
               mixed_prompts=False, extra: dict | None = None) -> dict:
    """The inputs a run's record starts with."""
    return {"model": profile.name, "condition": cond.name, "pulse": pulse, "seed": seed,
            "max_batched_tokens": max_batched_tokens or profile.engine["max_num_batched_tokens"],
            "mixed_prompts": mixed_prompts, "condition_settings": cond.settings(),
            "profile_provenance": profile.provenance.get("kind"), **(extra or {})}
