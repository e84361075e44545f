"""The phase map: P(recovered) of one condition over a grid of two
parameters — any numeric field of the scenario (pulse, hold_load, pulse_s,
deadline_s, ...) or the engine's `speed` (step times x s) and `kv` (KV blocks
x f), or for a fleet with an autoscaler its `provisioning` delay (s) and
metric `target`, or under [[layer]] tables a layer's key (`layer.client.timeout_s`,
the axes of `margin.LAYER_AXES`) — into a Parquet table and a PNG heatmap. Tipping points (a Wilson
interval across 1/2) are marked, and the line where the burst's backlog at
capacity equals one deadline, (pulse - 1) · pulse_s = deadline_s, is drawn
over the map where it falls inside it.

Every grid point runs the same seeds; on scenario axes the trace of a seed
changes with the parameter (same random stream, different calls), on the
engine axes it does not.

Table: one row per grid point: x_name, x, y_name, y, n, recovered, p, lo, hi,
tipping, and the medians of the cohorts' shares.
"""
from __future__ import annotations

import dataclasses
import os
import textwrap
import time
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from .. import verdict  # noqa: E402
from ..conditions import Condition  # noqa: E402
from ..profile import Profile  # noqa: E402
from ..scenario import PHASE_FIELDS, Scenario  # noqa: E402
from .margin import AXIS, LAYER_AXES, SCALING_AXES, axis, fleet_run, parse_axes, run_many  # noqa: E402

ENGINE_PARAMS = ("speed", "kv")


def scenario_params() -> list[str]:
    return list(PHASE_FIELDS) + [f.name for f in dataclasses.fields(Scenario) if f.type in ("float", float)]


def parse_range(spec: str, layers: tuple | None = None) -> tuple[str, list[float]]:
    """`name=a:b:n` (n evenly spaced values from a to b) or `name=v1,v2,...`;
    with `layers`, name may be a key of one of them (`layer.KIND.KEY`)."""
    name, sep, rest = spec.partition("=")
    name = name.strip()
    valid = scenario_params() + list(ENGINE_PARAMS) + list(SCALING_AXES)
    if sep and name.startswith("layer."):
        parse_axes([name], layers)              # ValueError unless a layer of the scenario sets that key
        valid = [name]
    if not sep or name not in valid:
        raise ValueError(f"expected PARAM=a:b:n or PARAM=v1,v2 with PARAM one of {', '.join(valid)}"
                         + (f", {', '.join(a.name for a in LAYER_AXES.values())}" if layers else "")
                         + f"; got {spec!r}")
    try:
        if ":" in rest:
            a, b, n = rest.split(":")
            k = int(n)
            if k < 1:
                raise ValueError
            vals = [float(v) for v in np.linspace(float(a), float(b), k)]
        else:
            vals = [float(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a:b:n (n >= 1 points) or a comma list of numbers, got {rest!r}") from None
    if not vals or any(not np.isfinite(v) for v in vals):
        raise ValueError(f"{name}: no finite values in {rest!r}")
    if name in ENGINE_PARAMS + SCALING_AXES and min(vals) <= 0:
        raise ValueError(f"{name}: factors must be positive, got {rest!r}")
    if name.startswith("layer."):
        ax = axis(name)
        if min(vals) < ax.lo or max(vals) > ax.hi or (ax.integer and any(v != int(v) for v in vals)):
            raise ValueError(f"{name}: {ax.what}: values from {ax.lo:g} to {ax.hi:g}"
                             + (", whole numbers" if ax.integer else "") + f"; got {rest!r}")
    return name, vals


def apply(profile: Profile, scenario: Scenario, name: str, v: float) -> tuple[Profile, Scenario]:
    if name == "speed":
        return verdict.perturbed(profile, speed=v), scenario
    if name == "kv":
        return verdict.perturbed(profile, kv=v), scenario
    if name in SCALING_AXES or name.startswith("layer."):
        return profile, scenario
    return profile, scenario.with_(**{name: v})


def _layers_at(layers: tuple | None, name: str, v: float) -> tuple | None:
    """The [[layer]] settings with `name` (a layer's key, else none) at v."""
    return axis(name).layers_at(layers, v) if name.startswith("layer.") else layers


def _scaler(config, name: str, v: float):
    """An autoscaler's settings with `name` (an autoscaler axis, else none) at v."""
    return AXIS[name].scaler(config, v) if name in SCALING_AXES else config


def phase_map(profile: Profile, scenario: Scenario, condition: Condition, x: tuple[str, Sequence[float]],
              y: tuple[str, Sequence[float]], seeds: Sequence[int], workers: int | None = 1,
              progress: Callable[[str], None] | None = None, fleet=None,
              layers: tuple | None = None) -> list[dict]:
    """The grid's rows (see the module docstring), x varying fastest. With
    `fleet` (a FleetSpec), the replicas behind its router run instead of
    `profile` (whose capacity is the fleet's Ĉ); speed and kv apply to every
    replica. `layers`, [[layer]] tables' settings, stand above the
    condition's proxy (`margin.run_task`)."""
    (xn, xs), (yn, ys) = x, y
    if xn == yn:
        raise ValueError(f"the two axes must differ, both are {xn}")
    seeds = list(seeds)
    scaled = [n for n in (xn, yn) if n in SCALING_AXES]
    if scaled and (fleet is None or fleet.autoscaler is None):
        raise ValueError(f"{', '.join(scaled)} needs a fleet with an [autoscaler] section")
    caps = tuple(fleet.capacities(scenario)) if fleet is not None else ()
    tasks, points = [], []
    for yv in ys:
        for xv in xs:
            prof, sc = apply(*apply(profile, scenario, xn, xv), yn, yv)
            on = None if fleet is None else fleet_run(
                fleet, caps, lambda q: apply(*apply(q, scenario, xn, xv), yn, yv)[0],
                _scaler(_scaler(fleet.autoscaler, xn, xv), yn, yv) if scaled else None)
            lay = _layers_at(_layers_at(layers, xn, xv), yn, yv)
            points.append((xv, yv))
            tasks += [(prof, sc, condition, s, profile.capacity, on, lay) for s in seeds]
    t0 = time.perf_counter()
    recs = run_many(tasks, workers)
    rows = []
    for i, (xv, yv) in enumerate(points):
        s = verdict.summarize(recs[i * len(seeds):(i + 1) * len(seeds)])
        row = {"x_name": xn, "x": xv, "y_name": yn, "y": yv, "condition": condition.name, "model": profile.name,
               **{k: s[k] for k in ("n", "recovered", "p", "lo", "hi", "tipping")}}
        for c in verdict.COHORTS:
            for k in verdict.SHARES:
                row[f"{c}_{k}_median"] = s[f"{c}_{k}"]["median"]
        rows.append(row)
    if progress:
        progress(f"{len(points)} points x {len(seeds)} seeds in {time.perf_counter() - t0:.1f} s")
    return rows


def write_table(rows: list[dict], path: str) -> None:
    """The rows as Parquet, written atomically."""
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def backlog_excess(scenario: Scenario, names: tuple[str, str], xv, yv) -> np.ndarray:
    """(pulse - 1) · pulse_s - deadline_s at each (x, y): the burst's backlog,
    in seconds of work at capacity, beyond one deadline."""
    v = {k: getattr(scenario, k) for k in ("pulse", "pulse_s", "deadline_s")}
    for n, arr in zip(names, (xv, yv)):
        if n in v:
            v[n] = np.asarray(arr, float)
    return np.broadcast_to((v["pulse"] - 1.0) * v["pulse_s"] - v["deadline_s"], np.broadcast(xv, yv).shape)


def plot(rows: list[dict], scenario: Scenario, path: str, title: str = "") -> bool:
    """The heatmap of P(recovered) with tipping points hatched and the
    backlog-equals-deadline line; returns whether the line was drawn."""
    xn, yn = rows[0]["x_name"], rows[0]["y_name"]
    xs = sorted({r["x"] for r in rows})
    ys = sorted({r["y"] for r in rows})
    p = np.full((len(ys), len(xs)), np.nan)
    tip = np.zeros_like(p, dtype=bool)
    for r in rows:
        i, j = ys.index(r["y"]), xs.index(r["x"])
        p[i, j], tip[i, j] = r["p"], r["tipping"]

    def edges(v):
        v = np.asarray(v, float)
        if len(v) == 1:
            return np.array([v[0] - 0.5, v[0] + 0.5])
        mid = (v[1:] + v[:-1]) / 2
        return np.concatenate([[2 * v[0] - mid[0]], mid, [2 * v[-1] - mid[-1]]])
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    m = ax.pcolormesh(edges(xs), edges(ys), p, vmin=0, vmax=1, cmap="RdYlGn", shading="flat")
    fig.colorbar(m, ax=ax, label="P(recovered)")
    for i in range(len(ys)):
        for j in range(len(xs)):
            if tip[i, j]:
                ax.text(xs[j], ys[i], "T", ha="center", va="center", fontsize=8)
    drawn = False
    if {xn, yn} & {"pulse", "pulse_s", "deadline_s"}:
        gx, gy = np.meshgrid(np.linspace(edges(xs)[0], edges(xs)[-1], 200),
                             np.linspace(edges(ys)[0], edges(ys)[-1], 200))
        z = backlog_excess(scenario, (xn, yn), gx, gy)
        if z.min() < 0 < z.max():
            ax.contour(gx, gy, z, levels=[0.0], colors="k", linewidths=1.5)
            ax.plot([], [], "k-", label="backlog at capacity = one deadline")
            ax.legend(loc="upper right", fontsize=8)
            drawn = True
    ax.set_xlabel(xn)
    ax.set_ylabel(yn)
    title = title or "P(recovered); T: tipping point (95% interval across 1/2)"
    ax.set_title("\n".join(textwrap.wrap(title, 64)), fontsize=9)    # a long title wraps, not cut at the edge
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return drawn
