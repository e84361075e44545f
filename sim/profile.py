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
