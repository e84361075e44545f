"""A deployment written back as a scenario file, driven by the rows of
`sim.schema.SCHEMA`: `document(dep)` the resolved document (a dict shaped
like the file, which `sim.scenario_file.resolve` reads back to an equal
deployment) and `to_toml(doc, engine, schema)` the complete, commented file.

`document` takes the file's top-level keys from the deployment's attributes
of those names and goes through the table's sections in its order: a row
marked `field` is the `Scenario`'s field of that name; a section that a
resolver of `sim.scenario_file` turns into something else has its inverse
here (`INVERSES`); any other section (a layer's) is the one the deployment
kept as checked. So a new section is a row of the table and nothing else.
"""
from __future__ import annotations

import dataclasses
import json
import math

from . import schema as _schema
from .scenario import Lengths, TrafficClass
from .schema import PAIRS, TABLE, TABLES, Key, Schema


# ---------------------------------------------------------------- the document
def document(dep) -> dict:
    """The resolved document of `dep` (a `sim.deployment.Deployment`),
    section by section in its schema's order (see the module docstring)."""
    schema = dep.table
    doc = {r.name: getattr(dep, r.name) for r in schema.rows("") if r.type not in (TABLE, TABLES)}
    for r in schema.rows(""):
        if r.type in (TABLE, TABLES):
            d = _section(dep, schema, r.name)
            if d is not None:
                doc[r.name] = d
    return doc


def _section(dep, schema: Schema, sec: str):
    """One section's document, or None when the deployment has none."""
    fields = {r.name: getattr(dep.scenario, r.name) for r in schema.rows(sec) if r.field}
    if sec in INVERSES:
        own = INVERSES[sec](dep)
        return own if not fields else {**(own or {}), **fields}
    kept = dep.sections.get(sec)
    return {**fields, **kept} if kept is not None else (fields or None)


def _engine(dep) -> dict:
    eng = dict(dep.profile.raw.get("engine_overrides") or {})
    if dep.engine_cap is not None:
        eng["max_num_queued_reqs"] = dep.engine_cap
    return eng


def _workload(dep) -> dict:
    """[workload]: the replayed trace, or the phases and lengths."""
    s = dep.scenario
    if dep.trace_source is not None:
        w = {"trace": dep.trace_source.path, "trace_speedup": dep.trace_source.speedup,
             "shared_prefix": int(dep.trace_source.trace.shared_prefix)}
    else:
        w = {"phases": [{"name": p.name, **p.to_dict()} for p in s.phases],
             "prompt": lengths_doc(s.prompt) if s.prompt else {"dist": "normal", "mean": s.prompt_mean,
                                                               "sd": s.prompt_sd},
             "response": lengths_doc(s.response) if s.response else {
                 "dist": "lognormal", "median": s.response_median, "mean": s.response_mean}}
        if s.prompt_pool:
            w["prompt_pool"] = s.prompt_pool
        if s.prefix_groups:
            w["prefix_groups"] = [{"tokens": t, "share": sh} for t, sh in s.prefix_groups]
        else:
            w["shared_prefix"] = s.shared_prefix
        w["mixed_share"] = s.mixed_share or 0.0
        w["mixed_prompt_len"] = s.mixed_prompt_len
    if s.classes:
        w["classes"] = [_class_doc(c) for c in s.classes]
    return w


def _measures(dep) -> dict:
    """[measures]' keys that are no Scenario field: the burst (a phase's
    name, or with a trace its times and the hold's end)."""
    s = dep.scenario
    if dep.trace_source is None:
        return {"burst": dep.burst} if dep.burst is not None else {}
    if dep.burst is None:
        return {"hold_end_s": s.base_s}
    return {"burst_start_s": s.pulse_start, "burst_end_s": s.pulse_end, "hold_end_s": s.hold_end}


def _faults(dep) -> dict | None:
    s, faults = dep.scenario, {}
    if s.stalls:
        faults["stalls"] = [list(x) for x in s.stalls]
    if s.leak_blocks_on_abort:
        faults["leak_blocks_on_abort"] = True
    return faults or None


def _autoscaler(dep) -> dict | None:
    if dep.fleet is None or dep.fleet.autoscaler is None:
        return None
    return dep.fleet.autoscaler.document()


# each the inverse of a resolver of sim.scenario_file: the section's document from the deployment, None: absent
INVERSES = {
    "model": lambda dep: dict(dep.model),
    "engine": _engine,
    "workload": _workload,
    "proxy": lambda dep: dict(dep.proxy),
    "measures": _measures,
    "faults": _faults,
    "fleet": lambda dep: dep.fleet.document() if dep.fleet is not None else None,
    "autoscaler": _autoscaler,
    "layer": lambda dep: [dict(x) for x in dep.stack_layers] or None,
}


def _class_doc(c: TrafficClass) -> dict:
    d = {k: v for k, v in dataclasses.asdict(c).items() if v is not None and k not in ("prompt", "response")}
    for k in ("prompt", "response"):
        if getattr(c, k) is not None:
            d[k] = lengths_doc(getattr(c, k))
    return d


def lengths_doc(L: Lengths) -> dict:
    """A length distribution as a [workload] prompt or response table."""
    if L.kind == "empirical":
        path, _, col = L.source.rpartition(":")
        return {"dist": "empirical", "file": path, "column": col}
    return {"dist": L.kind, **{k: getattr(L, k) for k in ("mean", "sd", "median", "value")
                               if getattr(L, k) is not None}}


# ------------------------------------------------------------------ the file
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def _comment(text: str, indent: str = "") -> list[str]:
    return [f"{indent}# {line}" for line in text.splitlines()]


def _documented(schema: Schema, r: Key) -> str:
    """A row's comment, with the keys of its tables for a TABLE, TABLES or PAIRS row."""
    if r.type in (TABLE, TABLES, PAIRS) and r.of is not None:
        return f"{r.comment}: {{{', '.join(schema.names(r.table))}}}"
    if r.choices:
        return f"{r.comment}: {' | '.join(r.choices)}"
    return r.comment


def to_toml(doc: dict, engine: dict | None = None, schema: Schema | None = None) -> str:
    """A resolved document as a commented TOML file, written from the
    schema's rows: each section with its comment, each key given after its
    comment, each key not given commented out with its default (or what it
    defaults to) and comment, an absent section likewise; `engine` (the
    profile's flags) gives [engine]'s defaults."""
    schema = schema or _schema.SCHEMA
    lines = [f"# llmsim scenario {doc['name']}" + (f": {doc['about']}" if doc.get("about") else ""),
             "# every key is optional; an absent key takes the reference design's value (docs/model.md)"]
    for r in schema.rows(""):
        if r.type != TABLE and r.name in doc:
            lines += _comment(r.comment) + [f"{r.name} = {_toml_value(doc[r.name])}"]
    shown = {}
    if engine:
        shown = dict(engine, async_scheduling=engine["depth"] > 1)
        shown.pop("depth")
    for sec in schema.sections():
        given = doc.get(sec)
        lines.append("")
        lines += [f"[{sec}]"] if given is not None else [f"# [{sec}] (not given)"]
        lines += _comment(schema.comment(sec))
        for r in schema.rows(sec):
            about = _documented(schema, r)
            if given is not None and r.name in given:
                v = given[r.name]
                lines += _comment(about)
                if r.type == TABLES:
                    lines.append(f"{r.name} = [")
                    lines += [f"  {_toml_value(x)}," for x in v]
                    lines.append("]")
                else:
                    lines.append(f"{r.name} = {_toml_value(v)}")
                continue
            default = shown.get(r.name) if sec == "engine" else r.default
            lines.append(f"#   {r.name} = {_toml_value(default)}  # {about}" if default is not None
                         else f"#   {r.name}: {about}")
    return "\n".join(lines) + "\n"
