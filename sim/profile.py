"""Engine profiles: a step-time model, the engine's flags and KV capacity, the
capacity Ĉ, and where it all came from. Embedded profiles live in
`sim/profiles/NAME.json`; a path to a JSON file works wherever a name does.

Schema (all keys required unless marked optional):
  name                 str
  step_time            {fixed_s, per_request_s, per_token_s, per_prefill_pair_s, per_decode_ctx_s}  seconds;
                       optional form: "linear" (the default, their sum) or "roofline" (with weights_s:
                       the larger of compute and memory time, sim.engine.step_time) or "moe" (with
                       weights_s, expert_weights_s, expert_per_token_s and the routing: whole experts,
                       experts_per_token);
                       roofline and moe: optional comm_per_token_s (tensor-parallel all-reduces a token)
                       and comm_bulk_fixed_s, comm_bulk_per_token_s (their bulk regime)
  engine               {max_num_seqs, max_num_batched_tokens, block_size, num_gpu_blocks, depth, max_model_len}
  capacity             float, calls/s (Ĉ) — of this profile's engine under the reference workload
  provenance           {kind: "measured" | "fitted to published figures" | ..., ...}
  model, hardware, kv_cache, fit   optional: shape, GPU, KV derivation, fit report

Limits: step-time coefficients finite and >= 0; engine values whole numbers in
[1, 2**31 - 1], `depth` at most 16; capacity finite, > 0 and at most 1,000
calls/s (one engine; the reference workload's trace grows with it). A file that
breaks any of these, is not UTF-8 JSON, or is not a file raises ProfileError
naming the file and the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from .engine.step_time import FORM_MODELS, FORMS, OPTIONAL_COEFFICIENTS, ROUTING, StepTimeModel, step_time_model

ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "depth", "max_model_len")
ENGINE_MAX = 2**31 - 1
DEPTH_MAX = 16
CAPACITY_MAX = 1000.0
FRONTEND_MAX_S = 10.0     # engine.frontend_s: seconds; a frontend of more is a misread unit (ms?)


class ProfileError(ValueError):
    pass


@dataclass
class Profile:
    name: str
    step_time: StepTimeModel
    engine: dict
    capacity: float
    provenance: dict
    raw: dict = field(repr=False, default_factory=dict)

    def scheduler_config(self, max_batched_tokens: int | None = None) -> SchedulerConfig:
        e = self.engine
        return SchedulerConfig(max_num_seqs=e["max_num_seqs"],
                               max_num_batched_tokens=max_batched_tokens or e["max_num_batched_tokens"],
                               num_gpu_blocks=e["num_gpu_blocks"], block_size=e["block_size"],
                               max_model_len=e["max_model_len"],
                               scheduling_policy=e.get("scheduling_policy", "fcfs"))

    @property
    def frontend_s(self) -> float:
        """The time a call spends in the server before its request reaches
        the scheduler (HTTP, tokenization, the hand-over), simulated on every
        call's way in (`engine.frontend_s`; 0 where the profile has none)."""
        return float(self.engine.get("frontend_s", 0.0))

    @property
    def depth(self) -> int:
        return self.engine["depth"]

    @property
    def kv_tokens(self) -> int:
        return self.engine["num_gpu_blocks"] * self.engine["block_size"]


def embedded_names() -> list[str]:
    d = resources.files("sim") / "profiles"
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


# What to do about a key a profile written before it existed lacks.
ADDED_KEYS = {
    "step_time.expert_per_token_s": "the routed experts' compute, a moe step time's since 2026-12-07: derive the "
                                    "profile again (llmsim calibrate prior)",
}


def _section(d: dict, name: str, keys, source: str) -> dict:
    sec = d[name]
    if not isinstance(sec, dict):
        raise ProfileError(f"{source}: {name} must be an object with {', '.join(keys)}")
    miss = [f"{name}.{k}" for k in keys if k not in sec]
    if miss:
        hints = "; ".join(f"{k}: {ADDED_KEYS[k]}" for k in miss if k in ADDED_KEYS)
        raise ProfileError(f"{source}: {name} lacks {', '.join(miss)}" + (f" ({hints})" if hints else ""))
    return sec


def from_dict(d: dict, source: str = "profile") -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: a profile is a JSON object")
    missing = [k for k in ("name", "step_time", "engine", "capacity", "provenance") if k not in d]
    if missing:
        raise ProfileError(f"{source}: missing key(s) {', '.join(missing)}")
    if not isinstance(d["name"], str) or not d["name"].strip():
        raise ProfileError(f"{source}: name must be a non-empty string, got {_show(d['name'])}")
    form = d["step_time"].get("form", "linear") if isinstance(d["step_time"], dict) else "linear"
    if form not in FORMS:
        raise ProfileError(f"{source}: step_time.form must be one of {', '.join(FORMS)}, got {_show(form)}")
    coefficients = FORM_MODELS[form].coefficients
    st = _section(d, "step_time", coefficients, source)
    optional = [k for k in OPTIONAL_COEFFICIENTS if k in st] if form != "linear" else []
    for k in (*coefficients, *optional):
        if not _number(st[k]) or not 0 <= st[k] < math.inf or not math.isfinite(float(st[k])):
            raise ProfileError(f"{source}: step_time.{k} must be a finite non-negative number (seconds), "
                               f"got {_show(st[k])}")
    if form == "moe":
        for k in ROUTING:
            if not isinstance(st.get(k), int) or isinstance(st.get(k), bool) or st[k] < 1:
                raise ProfileError(f"{source}: step_time.{k} must be a whole number of at least 1 (a moe "
                                   f"step time's routing), got {_show(st.get(k))}")
    try:
        model = step_time_model(st)
    except ValueError as e:
        raise ProfileError(f"{source}: {e}") from None
    eng = _section(d, "engine", ENGINE_KEYS, source)
    for k in ENGINE_KEYS:
        v, top = eng[k], DEPTH_MAX if k == "depth" else ENGINE_MAX
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
            raise ProfileError(f"{source}: engine.{k} must be a whole number from 1 to {top}, got {_show(v)}")
    fe = eng.get("frontend_s", 0.0)
    if not _number(fe) or not 0 <= fe <= FRONTEND_MAX_S:
        raise ProfileError(f"{source}: engine.frontend_s (a call's time in the server before its request reaches "
                           f"the scheduler) must be a number of seconds from 0 to {FRONTEND_MAX_S:g}, got {_show(fe)}")
    cap = d["capacity"]
    if not _number(cap) or not 0 < cap <= CAPACITY_MAX:
        raise ProfileError(f"{source}: capacity must be a number of calls/s above 0 and at most "
                           f"{CAPACITY_MAX:g}, got {_show(cap)}")
    if not isinstance(d["provenance"], dict) or "kind" not in d["provenance"]:
        raise ProfileError(f"{source}: provenance must be an object with at least 'kind'")
    return Profile(name=d["name"], step_time=model, engine=dict(eng), capacity=float(cap),
                   provenance=d["provenance"], raw=d)


def _number(v) -> bool:
    """An int or float (not a bool) that a float can hold."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _show(v) -> str:
    """A value for an error line: short, on one line."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def load_profile(name_or_path: str) -> Profile:
    """An embedded profile by name, or a profile JSON file by path."""
    names = embedded_names()
    if name_or_path in names:
        text = (resources.files("sim") / "profiles" / f"{name_or_path}.json").read_text()
        source = name_or_path
    else:
        p = Path(name_or_path)
        source = str(p)
        if p.is_dir():
            raise ProfileError(f"{source}: is a directory, not a profile file")
        if not p.is_file():
            raise ProfileError(f"unknown model {name_or_path!r}: not an embedded profile "
                               f"({', '.join(names)}) nor a profile file")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ProfileError(f"{source}: cannot read it ({e.strerror or e})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProfileError(f"{source}: not a JSON text file (byte 0x{data[e.start]:02x} at offset {e.start} "
                               "is not UTF-8)") from None
    if not text.strip():
        raise ProfileError(f"{source}: empty file; a profile is a JSON object")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ProfileError(f"{source}: not a profile (JSON nested too deeply)") from None
    return from_dict(d, source)


# vLLM's flag names (as TOML keys, '-' -> '_') that `with_engine` accepts
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "async_scheduling",
                "kv_cache_tokens", "num_gpu_blocks", "gpu_memory_utilization", "scheduling_policy")
KV_FLAGS = ("kv_cache_tokens", "num_gpu_blocks", "gpu_memory_utilization")


def _whole(k: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ProfileError(f"engine.{k} must be a positive whole number, got {v!r}")
    return v


def with_engine(profile: Profile, overrides: dict) -> Profile:
    """The profile with some of its engine flags changed, named as vLLM's:
    `max_num_seqs`, `max_num_batched_tokens`, `block_size`, `max_model_len`,
    `async_scheduling` (true: two steps in flight, false: one),
    `scheduling_policy` (fcfs | priority; a profile without it is fcfs), and the KV
    cache as at most one of `kv_cache_tokens`, `num_gpu_blocks` or
    `gpu_memory_utilization` (blocks from the profile's own KV derivation,
    its `kv_cache` section's memory, weights, reserve and bytes per token).
    A `block_size` change alone keeps the KV cache's tokens. The step-time
    model and Ĉ are kept (Ĉ belongs to a workload and engine: the caller
    decides whether to recalibrate); the changes are listed in
    `raw["engine_overrides"]` and the flags before them in
    `raw["engine_profile"]`. Raises ProfileError naming the flag."""
    if not overrides:
        return profile
    unknown = [k for k in overrides if k not in ENGINE_FLAGS]
    if unknown:
        raise ProfileError(f"unknown engine flag {unknown[0]!r}; valid: {', '.join(ENGINE_FLAGS)}")
    kv = [k for k in KV_FLAGS if k in overrides]
    if len(kv) > 1:
        raise ProfileError(f"give the KV cache one way, not {' and '.join(kv)}")
    e = dict(profile.engine)
    kv_tokens = e["num_gpu_blocks"] * e["block_size"]
    for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
        if k in overrides:
            e[k] = _whole(k, overrides[k])
    if "async_scheduling" in overrides:
        v = overrides["async_scheduling"]
        if not isinstance(v, bool):
            raise ProfileError(f"engine.async_scheduling must be true or false, got {v!r}")
        e["depth"] = 2 if v else 1
    if "scheduling_policy" in overrides:
        v = overrides["scheduling_policy"]
        if v not in SCHEDULING_POLICIES:
            raise ProfileError(f"engine.scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {v!r}")
        e["scheduling_policy"] = v
    bs = e["block_size"]
    if "num_gpu_blocks" in overrides:
        e["num_gpu_blocks"] = _whole("num_gpu_blocks", overrides["num_gpu_blocks"])
    elif "kv_cache_tokens" in overrides:
        e["num_gpu_blocks"] = _whole("kv_cache_tokens", overrides["kv_cache_tokens"]) // bs
    elif "gpu_memory_utilization" in overrides:
        u = overrides["gpu_memory_utilization"]
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ProfileError(f"engine.gpu_memory_utilization must lie in (0, 1], got {u!r}")
        kvc = profile.raw.get("kv_cache") or {}
        need = ("gpu_memory_bytes", "weights_bytes", "reserve_bytes", "kv_bytes_per_token")
        if any(k not in kvc for k in need):
            raise ProfileError(f"profile {profile.name} has no KV derivation (kv_cache.{', '.join(need)}); "
                               "give engine.kv_cache_tokens or engine.num_gpu_blocks instead")
        kv_bytes = kvc["gpu_memory_bytes"] * u - kvc["weights_bytes"] - kvc["reserve_bytes"]
        e["num_gpu_blocks"] = max(0, int(kv_bytes // (kvc["kv_bytes_per_token"] * bs)))
    elif "block_size" in overrides:
        e["num_gpu_blocks"] = kv_tokens // bs
    if e["num_gpu_blocks"] * bs < e["max_model_len"]:
        raise ProfileError(f"the KV cache ({e['num_gpu_blocks']} blocks of {bs} = {e['num_gpu_blocks'] * bs} tokens) "
                           f"is too small for one max_model_len ({e['max_model_len']}) request: give a larger "
                           "KV cache or a smaller engine.max_model_len")
    raw = dict(profile.raw, engine=e, engine_overrides=dict(overrides),
               engine_profile=profile.raw.get("engine_profile", dict(profile.engine)))
    return Profile(name=profile.name, step_time=profile.step_time, engine=e, capacity=profile.capacity,
                   provenance=profile.provenance, raw=raw)
