"""Engine profiles: a step-time model, the engine's flags and KV capacity, the
capacity Ĉ, and where it all came from. Embedded profiles live in
`sim/profiles/NAME.json`; a path to a JSON file works wherever a name does.

Schema (all keys required unless marked optional):
  name                 str
  step_time            {fixed_s, per_request_s, per_token_s, per_prefill_pair_s, per_decode_ctx_s}  seconds
  engine               {max_num_seqs, max_num_batched_tokens, block_size, num_gpu_blocks, depth, max_model_len}
  capacity             float, calls/s (Ĉ, SPEC §6) — of this profile's engine under the SPEC workload
  provenance           {kind: "measured" | "fitted to published figures" | ..., ...}
  model, hardware, kv_cache, fit   optional: shape, GPU, KV derivation, fit report
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .engine.scheduler import SchedulerConfig
from .engine.step_time import StepTimeModel, COEFFICIENTS

ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "depth", "max_model_len")


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
                               max_model_len=e["max_model_len"])

    @property
    def depth(self) -> int:
        return self.engine["depth"]

    @property
    def kv_tokens(self) -> int:
        return self.engine["num_gpu_blocks"] * self.engine["block_size"]


def embedded_names() -> list[str]:
    d = resources.files("sim") / "profiles"
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


def _section(d: dict, name: str, keys, source: str) -> dict:
    sec = d[name]
    if not isinstance(sec, dict):
        raise ProfileError(f"{source}: {name} must be an object with {', '.join(keys)}")
    miss = [k for k in keys if k not in sec]
    if miss:
        raise ProfileError(f"{source}: {name} lacks {', '.join(miss)}")
    return sec


def from_dict(d: dict, source: str = "profile") -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: a profile is a JSON object")
    missing = [k for k in ("name", "step_time", "engine", "capacity", "provenance") if k not in d]
    if missing:
        raise ProfileError(f"{source}: missing key(s) {', '.join(missing)}")
    st = _section(d, "step_time", COEFFICIENTS, source)
    try:
        model = StepTimeModel(**{k: st[k] for k in COEFFICIENTS})
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{source}: {e}") from None
    eng = _section(d, "engine", ENGINE_KEYS, source)
    for k in ENGINE_KEYS:
        v = eng[k]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ProfileError(f"{source}: engine.{k} must be a positive integer, got {v!r}")
    cap = d["capacity"]
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
        raise ProfileError(f"{source}: capacity must be a positive number (calls/s), got {cap!r}")
    if not isinstance(d["provenance"], dict) or "kind" not in d["provenance"]:
        raise ProfileError(f"{source}: provenance must be an object with at least 'kind'")
    return Profile(name=str(d["name"]), step_time=model, engine=dict(eng), capacity=float(cap),
                   provenance=d["provenance"], raw=d)


def load_profile(name_or_path: str) -> Profile:
    """An embedded profile by name, or a profile JSON file by path."""
    names = embedded_names()
    if name_or_path in names:
        text = (resources.files("sim") / "profiles" / f"{name_or_path}.json").read_text()
        source = name_or_path
    else:
        p = Path(name_or_path)
        if not p.is_file():
            raise ProfileError(f"unknown model {name_or_path!r}: not an embedded profile "
                               f"({', '.join(names)}) nor a profile file")
        text = p.read_text()
        source = str(p)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return from_dict(d, source)


# vLLM's flag names (as TOML keys, '-' -> '_') that `with_engine` accepts
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "async_scheduling",
                "kv_cache_tokens", "num_gpu_blocks", "gpu_memory_utilization")
KV_FLAGS = ("kv_cache_tokens", "num_gpu_blocks", "gpu_memory_utilization")


def _whole(k: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ProfileError(f"engine.{k} must be a positive whole number, got {v!r}")
    return v


def with_engine(profile: Profile, overrides: dict) -> Profile:
    """The profile with some of its engine flags changed, named as vLLM's:
    `max_num_seqs`, `max_num_batched_tokens`, `block_size`, `max_model_len`,
    `async_scheduling` (true: two steps in flight, false: one), and the KV
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
