"""Whose machine: the hardware a step profile is measured on (CPU model,
flags and core count; GPU names and driver where nvidia-smi answers), and
whether two such descriptions are the same machine for a step profile."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess


def _cpuinfo() -> dict:
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in ("model name", "flags") and k not in out:
                    out[k] = v.strip()
    except OSError:
        pass
    return out


# the cores this process was given at its start: a validation later pins its
# harness to some of them (`validate.harness`), which leaves the machine as it was
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 0))


def cores() -> list[int]:
    """The cores this process was given at its start."""
    return list(_CORES)


def cpus() -> int:
    return len(_CORES)


def gpus() -> dict | None:
    """GPU names and driver version from nvidia-smi, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    if not rows:
        return None
    return {"names": [r[0] for r in rows], "driver": rows[0][1] if len(rows[0]) > 1 else None}


def describe() -> dict:
    """This machine: machine, processor (CPU model), cpus (usable cores),
    cpu_flags (sorted), cpu_flags_sha1 (short digest of them), gpu, node."""
    info = _cpuinfo()
    flags = sorted(info.get("flags", "").split())
    return {"machine": platform.machine(), "processor": info.get("model name") or platform.processor()
            or platform.machine(), "cpus": cpus(), "cpu_flags": flags,
            "cpu_flags_sha1": hashlib.sha1(" ".join(flags).encode()).hexdigest()[:12] if flags else None,
            "gpu": gpus(), "node": platform.node()}


def differences(recorded: dict | None, here: dict, gpu: bool = False) -> list[str]:
    """How the machine at hand differs from the one a profile recorded (one
    phrase each; [] when they agree). Compared: CPU model and core count, CPU
    flags where both record them; with `gpu`, the GPU names and driver instead."""
    if not recorded:
        return ["the profile records no hardware"]
    out = []
    if gpu:
        a, b = recorded.get("gpu") or {}, here.get("gpu") or {}
        for k in ("names", "driver"):
            if a.get(k) != b.get(k):
                out.append(f"GPU {k} {a.get(k)} here {b.get(k)}")
        return out
    if recorded.get("processor") != here.get("processor"):
        out.append(f"CPU {recorded.get('processor')!r}, here {here.get('processor')!r}")
    if recorded.get("cpus") != here.get("cpus"):
        out.append(f"{recorded.get('cpus')} cores, here {here.get('cpus')}")
    fa, fb = recorded.get("cpu_flags"), here.get("cpu_flags")
    if fa and fb and set(fa) != set(fb):
        out.append(f"CPU flags differ ({len(set(fa) - set(fb))} missing here, {len(set(fb) - set(fa))} extra)")
    return out
