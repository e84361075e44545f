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

Limits: step-time coefficients finite and >= 0; engine values whole numbers in
[1, 2**31 - 1], `depth` at most 16; capacity finite, > 0 and at most 1,000
calls/s (one engine; the SPEC workload's trace grows with it). A file that
breaks any of these, is not UTF-8 JSON, or is not a file raises ProfileError
naming the file and the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .engine.scheduler import SchedulerConfig
from .engine.step_time import StepTimeModel, COEFFICIENTS

ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "depth", "max_model_len")
ENGINE_MAX = 2**31 - 1
DEPTH_MAX = 16
CAPACITY_MAX = 1000.0


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
        raise ProfileError(f"{source}: {name} lacks {', '.join(f'{name}.{k}' for k in miss)}")
    return sec


def from_dict(d: dict, source: str = "profile") -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: a profile is a JSON object")
    missing = [k for k in ("name", "step_time", "engine", "capacity", "provenance") if k not in d]
    if missing:
        raise ProfileError(f"{source}: missing key(s) {', '.join(missing)}")
    if not isinstance(d["name"], str) or not d["name"].strip():
        raise ProfileError(f"{source}: name must be a non-empty string, got {_show(d['name'])}")
    st = _section(d, "step_time", COEFFICIENTS, source)
    for k in COEFFICIENTS:
        if not _number(st[k]) or not 0 <= st[k] < math.inf or not math.isfinite(float(st[k])):
            raise ProfileError(f"{source}: step_time.{k} must be a finite non-negative number (seconds), "
                               f"got {_show(st[k])}")
    model = StepTimeModel(**{k: float(st[k]) for k in COEFFICIENTS})
    eng = _section(d, "engine", ENGINE_KEYS, source)
    for k in ENGINE_KEYS:
        v, top = eng[k], DEPTH_MAX if k == "depth" else ENGINE_MAX
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
            raise ProfileError(f"{source}: engine.{k} must be a whole number from 1 to {top}, got {_show(v)}")
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
