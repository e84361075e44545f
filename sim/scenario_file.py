"""A scenario file read and resolved: the TOML parsed, checked against
`sim.schema.SCHEMA` and each section turned into what a deployment is made
of (the profile with its engine flags changed, the `Scenario`, the proxy's
`Condition`, the fleet, the calls generated from phases or replayed from a
trace file). `sim.deployment` builds its `Deployment` from these fields;
`sim.scenario_writer` writes a deployment back as a file.

API:
- `is_named(path_or_name)`: a name of `sim.scenario.SCENARIOS` (and no file
  of that name).
- `read(path) -> dict`: the file's document (a dict shaped like the file).
- `resolve(doc, source, base_dir, build_prior, trace_speedup, schema) ->
  dict`: the deployment's fields, the document checked against `schema`
  (default `sim.schema.SCHEMA`, read when called). `build_prior(hf_config_path,
  gpu, **serving) -> dict` makes a profile dict for `[model] hf_config` (the roofline
  prior lives above sim).
- `named(name) -> dict`: a named scenario's fields, on its usual profile.
- `layer_settings(table)`: a `[[layer]]` table's effective settings.
- `TraceSource`: a replayed trace file.
Every error is a `ScenarioError`: one line naming the file and the key.

File sections: the rows of `sim.schema.SCHEMA`, which checks the file
(every key optional; the reference design's value by default). `[model]`
profile | hf_config + gpu, and capacity; `[engine]` vLLM's flags and
`max_num_queued_reqs` (the engine cap); `[workload]` phases (absent: the
reference design's), prompt and response lengths (empirical ones read from
a CSV column), shared_prefix or prefix_groups, prompt_pool (whose prompts
start with those prefixes: system prompts), mixed_share, mixed_prompt_len,
or trace (CSV) with trace_speedup; `[client]` and `[measures]` the
Scenario's fields of those names (with the burst phase, or
burst_start_s/burst_end_s with a trace); `[proxy]` condition plus control
overrides; `[faults]`; `[fleet]` replicas behind a router; `[autoscaler]`;
`[[layer]]` the stack's layers. A section of the table that no resolver
here reads (a layer's) is kept as checked, with its defaults, in the
`sections` field.
"""
from __future__ import annotations

import csv
import dataclasses
import difflib
import hashlib
import math
import os
import tomllib
from dataclasses import dataclass, field

import numpy as np

from . import schema as _schema
from .conditions import SHED_KEYS, Condition, compose, get_condition, parse_cancel
from .fleet import FleetSpec
from .policy.autoscaler import AutoscalerConfig
from .policy.layers import layer_kind
from .policy.presets import PRESETS
from .policy.router import RouterConfig
from .profile import Profile, ProfileError, embedded_names, from_dict, load_profile, with_engine
from .scenario import CLIENT_FIELDS, PAPER, REFERENCE_PHASES, SCENARIOS, Lengths, Phase, Scenario, TrafficClass
from .schema import NUMBER, SCHEMA, ScenarioError, Schema
from .workload import Trace, TraceError, read_trace

DEFAULT_MODEL = SCHEMA.row("model", "profile").default
SCENARIO_MODEL = {"paper": "qwen2.5-7b", "scaled": "vllm-cpu-tiny", "cpu-small": "vllm-cpu-tiny",
                  "cpu-tiny": "vllm-cpu-tiny"}
# the sections read by this module's resolvers; any other section of the table (a layer's) is kept as checked
RESOLVED = ("model", "engine", "workload", "client", "proxy", "measures", "faults", "fleet", "autoscaler")


@dataclass(frozen=True)
class TraceSource:
    """A replayed trace file: its path, speedup, content hash and calls."""
    path: str
    speedup: float
    sha256: str
    trace: Trace = field(repr=False, compare=False)
    info: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return {"path": self.path, "speedup": self.speedup, "sha256": self.sha256, **self.info}


class _Doc:
    """One table of a document already checked against the schema, with
    errors that name the file and the key."""

    def __init__(self, source: str, where: str, d: dict | None):
        self.source, self.where_, self.d = source, where, d if d is not None else {}

    def where(self, k: str) -> str:
        return f"{self.where_}.{k}" if self.where_ else k

    def err(self, k: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {self.where(k)} {msg}")

    def has(self, k: str) -> bool:
        return k in self.d

    def get(self, k: str, default=None):
        return self.d.get(k, default)

    def sub(self, k: str) -> "_Doc":
        return _Doc(self.source, self.where(k), self.d.get(k))


def _values(schema: Schema, section: str, d: dict) -> dict:
    """A checked table's values as the code takes them: numbers as floats,
    whole numbers as ints."""
    return {k: float(v) if schema.row(section, k).type == NUMBER else v for k, v in d.items()}


# ---------------------------------------------------------------- resolving
def _lengths(sec: _Doc, k: str, base_dir: str) -> Lengths:
    d = sec.sub(k)
    kind = d.get("dist")
    if kind is None:
        raise d.err("dist", "is missing: give normal, lognormal, fixed or empirical")
    if kind == "empirical":
        path, col = d.get("file"), d.get("column")
        if path is None or col is None:
            raise sec.err(k, "(empirical) needs file and column")
        values = _column(os.path.join(base_dir, path), col, f"{sec.source}: {sec.where(k)}")
        return Lengths("empirical", values=values, source=f"{path}:{col}")
    try:
        return Lengths(kind, mean=d.get("mean"), sd=d.get("sd"), median=d.get("median"), value=d.get("value"))
    except ValueError as e:
        raise sec.err(k, str(e)) from None


def _column(path: str, col: str, where: str) -> tuple:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise ScenarioError(f"{where}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not rows or col not in rows[0]:
        raise ScenarioError(f"{where}: {path} has no column {col!r}")
    out = []
    for i, r in enumerate(rows, start=2):
        try:
            v = float(r[col])
        except (TypeError, ValueError):
            v = float("nan")
        if not (math.isfinite(v) and v >= 1 and v == int(v)):
            raise ScenarioError(f"{where}: {path} line {i}: {col} must be a positive whole number, got {r[col]!r}")
        out.append(int(v))
    return tuple(out)


def _profile(m: _Doc, base_dir: str, build_prior) -> tuple[Profile, dict]:
    prof_name, cfg, gpu, cap = m.get("profile"), m.get("hf_config"), m.get("gpu"), m.get("capacity")
    prof, named = _named_profile(m, prof_name, cfg, gpu, base_dir, build_prior)
    return prof, (dict(named, capacity=float(cap)) if cap is not None else named)


SERVING_KEYS = ("tensor_parallel_size", "dtype", "quantization", "cpu_offload_gb")     # [model] with hf_config


def _named_profile(m: _Doc, prof_name, cfg, gpu, base_dir: str, build_prior) -> tuple[Profile, dict]:
    serving = {k: m.get(k) for k in SERVING_KEYS if m.get(k) is not None}
    if cfg is not None:
        if prof_name is not None:
            raise m.err("hf_config", "and model.profile both given: give one")
        if gpu is None:
            raise m.err("gpu", "is missing: hf_config needs the GPU (h100, h200, a100, ...)")
        if build_prior is None:
            raise m.err("hf_config", "needs the roofline prior, which this caller does not provide")
        path = os.path.join(base_dir, cfg)
        try:
            raw = build_prior(path, gpu, **serving)
            prof = from_dict(raw, path)
        except (OSError, ValueError, KeyError) as e:
            raise m.err("hf_config", f"{path}: {e}") from None
        return prof, {"hf_config": cfg, "gpu": gpu, **serving}
    for k in serving:
        raise m.err(k, "only goes with model.hf_config (a profile states how its engine was served)")
    if gpu is not None:
        raise m.err("gpu", "only goes with model.hf_config")
    name = prof_name or DEFAULT_MODEL
    if name not in embedded_names() and not os.path.isabs(name) and os.path.exists(os.path.join(base_dir, name)):
        name = os.path.join(base_dir, name)
    try:
        return load_profile(name), {"profile": prof_name or DEFAULT_MODEL}
    except ProfileError as e:
        raise m.err("profile", str(e)) from None


def _phases(w: _Doc, me: _Doc, schema: Schema) -> tuple[dict, str | None]:
    """The arrivals as Scenario fields (phases, the burst's index) and the
    burst's name. No phases: the reference design's, the burst its pulse."""
    burst = me.get("burst")
    if not w.has("phases"):
        phases = REFERENCE_PHASES
        burst = "pulse" if burst is None else burst
    else:
        phases = []
        for i, p in enumerate(w.get("phases")):
            d = _Doc(w.source, f"workload.phases[{i}]", p)
            if not d.has("duration_s"):
                raise d.err("duration_s", "is missing")
            if d.has("load") and d.has("rate"):
                raise d.err("load", "and rate both given: give the rate in calls/s or as a load in multiples of Ĉ, "
                                    "not both")
            if not d.has("load") and not d.has("rate"):
                raise d.err("load", "is missing: give load (x Ĉ) or rate (calls/s)")
            phases.append(Phase(**{"name": f"phase {i + 1}", **_values(schema, "phase", p)}))
        phases = tuple(phases)
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise w.err("phases", f"names must differ, got {names}")
    if burst is not None and burst not in names:
        close = difflib.get_close_matches(burst, names, n=1)
        raise me.err("burst", f"names no phase ({', '.join(names)})" +
                     (f"; did you mean {close[0]!r}?" if close else f", got {burst!r}"))
    return {"phases": phases, "burst": None if burst is None else names.index(burst)}, burst



def resolve(d: dict, source: str = "scenario", base_dir: str = ".", build_prior=None,
            trace_speedup: float | None = None, schema: Schema | None = None) -> dict:
    """The fields of the `sim.deployment.Deployment` a parsed scenario
    document describes (see the module docstring), checked against `schema`;
    `trace_speedup`, when given, replaces the file's."""
    schema = schema or _schema.SCHEMA
    schema.check(d, source)
    doc = _Doc(source, "", d)
    secs = {s: doc.sub(s) for s in schema.sections()}
    prof, model_doc = _profile(secs["model"], base_dir, build_prior)
    prof, engine_cap = _engine(secs["engine"], prof)
    w, me = secs["workload"], secs["measures"]
    if w.has("trace"):
        sc, trace_src, burst = _replayed(w, me, base_dir, trace_speedup)
    else:
        (sc, burst), trace_src = _generated(w, me, base_dir, schema), None
    scenario = _scenario(sc, secs.values(), prof, trace_src is None, schema)
    if doc.has("faults"):
        scenario = scenario.with_(**_faults(secs["faults"]))
    _check_lengths(w, scenario, trace_src, prof)
    cond, proxy_doc = _proxy(secs["proxy"], schema, scenario)
    scaler = _autoscaler(secs["autoscaler"], schema) if doc.has("autoscaler") else None
    fleet = (_fleet(secs["fleet"], prof, secs["engine"], base_dir, schema, scaler)
             if doc.has("fleet") or scaler is not None else None)
    kept = {s: {**schema.defaults(s), **_values(schema, s, d[s])} for s in schema.sections()
            if s not in RESOLVED and s in d}
    return dict(name=d.get("name", os.path.splitext(os.path.basename(source))[0]), about=d.get("about", ""),
                profile=prof, model=model_doc, scenario=scenario, condition=cond, engine_cap=engine_cap,
                proxy=proxy_doc, seed=int(d.get("seed", 0)), trace_source=trace_src, burst=burst,
                base_dir=base_dir, build_prior=build_prior, fleet=fleet, sections=kept,
                stack_layers=_stack_layers(d.get("layer") or [], source, schema), schema=schema)


def layer_settings(table: dict) -> dict:
    """A [[layer]] table's effective settings, resolved by its kind
    (`sim.policy.layers.layer_kind(kind).settings`: for a client or a
    gateway, its preset's values with the table's keys on top)."""
    return layer_kind(table["kind"]).settings(table.get("preset"),
                                              {k: v for k, v in table.items() if k not in ("kind", "preset")})


def _stack_layers(tables: list, source: str, schema: Schema) -> tuple:
    """The [[layer]] tables as given (numbers as floats), each checked by
    resolving it through its kind's registry entry (`layer_settings`): an
    unknown kind or preset, a key its kind does not take, a value its policy
    refuses (a cap below its base) end in one line naming the file and
    `layer[i].key`."""
    out = []
    for i, t in enumerate(tables):
        where = f"layer[{i}]"
        if "preset" not in t and "kind" not in t:
            raise ScenarioError(f"{source}: {where}.preset must be given (one of {', '.join(PRESETS)})")
        given = _values(schema, "layer", t)
        if "kind" not in given:
            given["kind"] = PRESETS[t["preset"]].kind
        try:
            layer_settings(given)
        except ValueError as e:
            key, _, why = str(e).partition(": ")
            why = "is " + why if why.startswith("not ") else why
            raise ScenarioError(f"{source}: {where}.{key} {why}") from None
        out.append(given)
    return tuple(out)


def _faults(f: _Doc) -> dict:
    """[faults]: engine stalls as [[T, S], ...] (the engine does nothing for S
    seconds from T) and a KV block leak on abort."""
    out: dict = {}
    if f.has("stalls"):
        out["stalls"] = tuple(sorted((float(t), float(s)) for t, s in f.get("stalls")))
    if f.has("leak_blocks_on_abort"):
        out["leak_blocks_on_abort"] = f.get("leak_blocks_on_abort") or None
    return out


def _engine(eng: _Doc, prof: Profile) -> tuple[Profile, int | None]:
    """[engine]: the profile with vLLM's flags changed, and the engine cap."""
    overrides = {k: v for k, v in eng.d.items() if k != "max_num_queued_reqs"}
    try:
        prof = with_engine(prof, overrides)
    except ProfileError as e:
        raise ScenarioError(f"{eng.source}: engine: {e}") from None
    return prof, eng.get("max_num_queued_reqs")


def _replayed(w: _Doc, me: _Doc, base_dir: str, trace_speedup: float | None) -> tuple[dict, TraceSource, str | None]:
    """[workload] trace: Scenario fields (the phases as windows of the trace:
    before the burst, the burst, after it), the trace and the burst's name."""
    clash = [k for k in ("phases", "prompt", "response", "mixed_share", "prefix_groups", "prompt_pool") if w.has(k)]
    if clash:
        raise w.err(clash[0], "and workload.trace both given: a trace fixes arrivals and lengths")
    if me.has("burst"):
        raise me.err("burst", "names a phase, but a trace has none: give burst_start_s and burst_end_s")
    path = os.path.join(base_dir, w.get("trace"))
    speed = trace_speedup if trace_speedup is not None else w.get("trace_speedup", 1.0)
    try:
        tr, info = read_trace(path, speed, int(w.get("shared_prefix", 0)))
    except TraceError as e:
        raise ScenarioError(f"{w.source}: workload.trace: {e}") from None
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()[:16]
    a, b = me.get("burst_start_s"), me.get("burst_end_s")
    if (a is None) != (b is None):
        raise me.err("burst_start_s" if a is None else "burst_end_s", "is missing: give both ends of the burst")
    end = me.get("hold_end_s", float(tr.arrival[-1]))
    if a is not None and not b > a:
        raise me.err("burst_end_s", f"must be after burst_start_s ({a}), got {b}")
    if a is not None and not end > b:
        raise me.err("hold_end_s", f"must be after burst_end_s ({b}), got {end} (the trace's last call "
                                   f"arrives at {tr.arrival[-1]:.1f} s)")
    if a is None:
        windows = [(float(end), "trace")]
    else:
        windows = [(float(a), "base"), (float(b - a), "pulse"), (float(end - b), "hold")]
    phases = tuple(Phase(t, name=n) for t, n in windows if t > 0)
    sc = dict(phases=phases, burst=None if a is None else [p.name for p in phases].index("pulse"),
              shared_prefix=int(tr.shared_prefix),
              prompt=Lengths("empirical", values=tuple(int(x) for x in tr.prompt_len), source=f"trace:{sha}"),
              response=Lengths("empirical", values=tuple(int(x) for x in tr.max_tokens), source=f"trace:{sha}"),
              prompt_mean=float(tr.prompt_len.mean()), response_mean=float(tr.max_tokens.mean()))
    if w.has("classes") or tr.klass is not None:
        classes, klass = _trace_classes(w, tr, info)
        sc["classes"], tr = classes, dataclasses.replace(tr, klass=klass)
    return sc, TraceSource(w.get("trace"), float(speed), sha, tr, info), ("trace" if a is not None else None)


def _trace_classes(w: _Doc, tr: Trace, info: dict) -> tuple:
    """[workload] classes with a trace: each call's class from the trace's
    `class` column, which must name declared classes; a class's share is its
    share of the trace's calls (a share given is not used)."""
    if tr.klass is None:
        raise w.err("classes", "with a trace needs the trace's class column (each call's class by name)")
    if not w.has("classes"):
        raise w.err("trace", f"has a class column ({', '.join(info['classes'])}): declare workload.classes")
    for i, c in enumerate(w.get("classes")):
        d = _Doc(w.source, f"workload.classes[{i}]", c)
        if "name" not in c:
            raise d.err("name", "is missing")
        for k in ("prompt", "response"):
            if k in c:
                raise d.err(k, "and workload.trace both given: a trace fixes arrivals and lengths")
    names = [c["name"] for c in w.get("classes")]
    unknown = [x for x in info["classes"] if x not in names]
    if unknown:
        raise w.err("trace", f"names a class {unknown[0]!r} that workload.classes does not declare "
                             f"({', '.join(names)})")
    klass = np.asarray([names.index(x) for x in info["classes"]], dtype=np.int64)[tr.klass]
    counts = np.bincount(klass, minlength=len(names)) / len(klass)
    docs = [dict(c, share=float(x)) for c, x in zip(w.get("classes"), counts)]
    return _classes(_Doc(w.source, w.where_, dict(w.d, classes=docs)), ".", shares_of_trace=True), klass


def _generated(w: _Doc, me: _Doc, base_dir: str, schema: Schema) -> tuple[dict, str | None]:
    """[workload] phases and lengths: Scenario fields and the burst's name."""
    for k in ("burst_start_s", "burst_end_s", "hold_end_s"):
        if me.has(k):
            raise me.err(k, "only goes with workload.trace; name the burst phase with measures.burst")
    if w.has("trace_speedup"):
        raise w.err("trace_speedup", "only goes with workload.trace")
    sc, burst = _phases(w, me, schema)
    for k in ("prompt", "response"):
        if w.has(k):
            L = _lengths(w, k, base_dir)
            if k == "prompt" and L.kind == "normal":
                sc.update(prompt_mean=float(L.mean), prompt_sd=float(L.sd))
            elif k == "response" and L.kind == "lognormal":
                sc.update(response_median=float(L.median), response_mean=float(L.mean))
            else:
                sc[k] = L
    if w.has("shared_prefix"):
        sc["shared_prefix"] = int(w.get("shared_prefix"))
    if w.has("prefix_groups"):
        if w.has("shared_prefix"):
            raise w.err("shared_prefix", "and workload.prefix_groups both given: give the prefixes one way")
        groups = tuple((int(g["tokens"]), float(g["share"])) for g in _prefix_groups(w))
        sc.update(prefix_groups=groups, shared_prefix=min(g[0] for g in groups))
    for k, L in (("prompt_mean", sc.get("prompt")), ("response_mean", sc.get("response"))):
        if L is not None:                # the mean the proxy's first throughput estimate uses
            sc[k] = float(L.expected)
    if w.has("prompt_pool"):
        if w.has("classes"):
            raise w.err("classes", "and workload.prompt_pool both given: a pool's calls send its prompts whole")
        if w.get("mixed_share"):
            raise w.err("mixed_share", "and workload.prompt_pool both given: a pool's calls send its prompts whole")
        # the pool's prompts start with the system prompts shared_prefix or prefix_groups says, else with none
        sc.update(prompt_pool=int(w.get("prompt_pool")),
                  **({} if w.has("shared_prefix") or w.has("prefix_groups") else {"shared_prefix": 0}))
    if w.has("mixed_prompt_len"):
        sc["mixed_prompt_len"] = int(w.get("mixed_prompt_len"))
    share = w.get("mixed_share")
    if share is not None:
        sc["mixed_share"] = float(share) if share > 0 else None
    if w.has("classes"):
        sc["classes"] = _classes(w, base_dir)
    names = {c.name for c in sc.get("classes", ())}
    for i, p in enumerate(sc["phases"]):
        if p.shares is None:
            continue
        d = _Doc(w.source, f"workload.phases[{i}]", {})
        if not names:
            raise d.err("shares", "gives class shares, but workload.classes declares no class")
        unknown = [c for c, _ in p.shares if c not in names]
        if unknown:
            raise d.err("shares", f"names no class {unknown[0]!r} ({', '.join(sorted(names))})")
        total = sum(x for _, x in p.shares)
        if abs(total - 1.0) > 1e-9:
            raise d.err("shares", f"must add up to 1, got {total:g}")
    return sc, burst


def _classes(w: _Doc, base_dir: str, shares_of_trace: bool = False) -> tuple[TrafficClass, ...]:
    """[workload] classes: each a TrafficClass; names given and distinct,
    shares adding up to 1 (with a trace, its own: a class may have none)."""
    out, names = [], set()
    for i, c in enumerate(w.get("classes")):
        d = _Doc(w.source, f"workload.classes[{i}]", c)
        for k in ("name", "share"):
            if not d.has(k):
                raise d.err(k, "is missing")
        if c["name"] in names:
            raise d.err("name", f"{c['name']!r} names two classes")
        names.add(c["name"])
        kw = {k: int(c[k]) if k == "max_retries" else float(c[k]) for k in CLIENT_FIELDS if k in c}
        lengths = {k: _lengths(d, k, base_dir) for k in ("prompt", "response") if d.has(k)}
        out.append(TrafficClass(name=c["name"], share=float(c["share"]), priority=int(c.get("priority", 0)),
                                must_recover=bool(c.get("must_recover", True)), **lengths, **kw))
    total = sum(c.share for c in out)
    if abs(total - 1.0) > 1e-9 and not shares_of_trace:
        raise w.err("classes", f"shares must add up to 1, got {total:g}")
    return tuple(out)


def _scenario(sc: dict, secs, prof: Profile, generated: bool, schema: Schema) -> Scenario:
    """The Scenario: the workload's fields, and the keys of `secs` whose
    rows are Scenario fields ([client]'s, some of [measures]'), with the
    defaults that follow the deadline (Retry-After cap, primary cohort's
    start, delivery horizon = hold + one deadline)."""
    for sec in secs:
        sc.update({k: v for k, v in _values(schema, sec.where_, sec.d).items() if schema.row(sec.where_, k).field})
    deadline = sc.get("deadline_s", PAPER.deadline_s)
    sc.setdefault("max_retry_after_s", float(deadline))
    sc.setdefault("primary_skip_s", float(deadline))
    if generated and (sc.get("prompt") is not None or sc.get("response") is not None):
        sc["max_call_tokens"] = int(prof.engine["max_model_len"])
    s = PAPER.with_(**sc)
    return s if "delivery_horizon_s" in sc else s.with_(delivery_horizon_s=float(s.hold_s + deadline))


def _check_lengths(w: _Doc, scenario: Scenario, trace_src: TraceSource | None, prof: Profile) -> None:
    """Every replayed call fits the engine's context; every prefix is shorter
    than the prompts it starts."""
    if trace_src is not None:
        tr = trace_src.trace
        over = np.flatnonzero(tr.prompt_len + tr.max_tokens > prof.engine["max_model_len"])
        if len(over):
            i = int(over[0])
            raise w.err("trace", f"{trace_src.path}: call {i + 1} (line {i + 2} without blank lines) has "
                                 f"{tr.prompt_len[i]} + {tr.max_tokens[i]} tokens, beyond the engine's max_model_len "
                                 f"{prof.engine['max_model_len']}: raise [engine] max_model_len")
    longest = max(g[0] for g in scenario.prefix_groups) if scenario.prefix_groups else scenario.shared_prefix
    if longest >= _min_prompt(scenario):
        raise w.err("prefix_groups" if scenario.prefix_groups else "shared_prefix",
                    f"({longest} tokens) must be shorter than the shortest prompt")


def _proxy(px: _Doc, schema: Schema, scenario: Scenario | None = None) -> tuple[Condition, dict]:
    """[proxy]: the condition, and the section as resolved. The classes
    its shedding keys name must be the workload's."""
    cname = px.get("condition", schema.row("proxy", "condition").default)
    if px.has("cancel"):
        try:
            parse_cancel(px.get("cancel"))
        except ValueError as e:
            raise px.err("cancel", str(e)) from None
    times = ("defer_s", "budget_window_s")
    changes = {k: px.get(k) for k in schema.names("proxy") if k != "condition" and k not in times and px.has(k)}
    names = [c.name for c in (scenario.classes or ())] if scenario is not None else None
    for k in ("shed_classes", "class_budget", "class_cap"):
        named = changes.get(k) or []
        for c in (named if k == "shed_classes" else [x[0] for x in named]):
            if names is not None and c not in names:
                raise px.err(k, f"names a class {c!r} that workload.classes does not declare"
                             + (f" ({', '.join(names)})" if names else ""))
    if "shed_status" in changes and changes["shed_status"] not in (429, 503):
        raise px.err("shed_status", f"must be 429 or 503, got {changes['shed_status']!r}")
    try:
        cond = compose(cname, **changes) if changes else get_condition(cname)
    except ValueError as e:
        raise px.err(next(k for k in changes if k in SHED_KEYS) if set(changes) & set(SHED_KEYS) else "condition",
                     str(e)) from None
    return cond, {"condition": cname, **changes, **{k: float(px.get(k)) for k in times if px.has(k)}}


def _prefix_groups(w: _Doc) -> list:
    groups = w.get("prefix_groups")
    for i, g in enumerate(groups):
        d = _Doc(w.source, f"workload.prefix_groups[{i}]", g)
        for k in ("tokens", "share"):
            if not d.has(k):
                raise d.err(k, "is missing")
    total = sum(g["share"] for g in groups)
    if abs(total - 1.0) > 1e-9:
        raise w.err("prefix_groups", f"shares must add up to 1, got {total:g}")
    return groups


def _autoscaler(a: _Doc, schema: Schema) -> AutoscalerConfig:
    """[autoscaler]: the HPA's settings; a setting that contradicts another
    ends in one line naming the file and the key."""
    v = {**schema.defaults("autoscaler"), **_values(schema, "autoscaler", a.d)}
    lo, hi = v["min_replicas"], v["max_replicas"]
    v.setdefault("initial_replicas", lo)
    if not lo <= v["initial_replicas"] <= hi:
        raise a.err("initial_replicas", f"must lie in [min_replicas, max_replicas] = [{lo}, {hi}], "
                                        f"got {v['initial_replicas']}")
    if v["provisioning"] == "uniform" and "provisioning_max_s" not in v:
        raise a.err("provisioning_max_s", "is missing: provisioning = \"uniform\" needs its high end")
    try:
        return AutoscalerConfig(**v)
    except ValueError as e:                 # pragma: no cover - the checks above and the table's bounds come first
        raise ScenarioError(f"{a.source}: {a.where_} {e}") from None


def _fleet(fl: _Doc, prof: Profile, eng: _Doc, base_dir: str, schema: Schema,
           scaler: AutoscalerConfig | None = None) -> FleetSpec:
    """[fleet]: the router and one profile per replica, each with [engine]'s
    overrides; with [autoscaler], max_replicas of them."""
    v = {**schema.defaults("fleet"), **fl.d}
    names = v.get("profiles")
    if scaler is not None:
        if "replicas" in v and v["replicas"] != scaler.max_replicas:
            raise fl.err("replicas", f"({v['replicas']}) must be [autoscaler] max_replicas ({scaler.max_replicas}) "
                                     "with an autoscaler, or be left out")
        v.setdefault("replicas", scaler.max_replicas)
    n = v.get("replicas", len(names) if names is not None else 1)
    if names is not None and len(names) != n:
        raise fl.err("profiles", f"names {len(names)} profiles for {n} replicas: give one per replica")
    router = RouterConfig(v["router"], v["router_retries"], v["proxy"])
    overrides = {k: x for k, x in eng.d.items() if k != "max_num_queued_reqs"}
    profiles = (tuple(_replica_profile(fl, x, base_dir, overrides) for x in names) if names is not None
                else (prof,) * n)
    return FleetSpec(router, profiles, tuple(names) if names is not None else None, scaler)


def _replica_profile(fl: _Doc, name: str, base_dir: str, overrides: dict) -> Profile:
    """A replica's profile named in [fleet] profiles, with [engine]'s overrides."""
    path = os.path.join(base_dir, name)
    if name not in embedded_names() and not os.path.isabs(name) and os.path.exists(path):
        name = path
    try:
        return with_engine(load_profile(name), overrides)
    except ProfileError as e:
        raise fl.err("profiles", str(e)) from None


def _min_prompt(s: Scenario) -> int:
    if s.prompt is not None and s.prompt.kind in ("fixed", "empirical"):
        m = s.prompt.value if s.prompt.kind == "fixed" else min(s.prompt.values)
        return min(m, s.mixed_prompt_len) if s.mixed_share else m
    return 1 << 62                 # drawn lengths are clamped above the prefix


def is_named(path_or_name: str) -> bool:
    """A named scenario (`sim.scenario.SCENARIOS`), not a file: a directory
    of that name (`llmsim paper`'s output) is no scenario."""
    return path_or_name in SCENARIOS and not os.path.isfile(path_or_name)


def read(path: str) -> dict:
    """The document of the scenario file `path` (TOML); an unreadable file
    or a name that is neither a file nor a named scenario ends in one line."""
    if not os.path.isfile(path):
        raise ScenarioError(f"unknown scenario {path!r}: not a file nor a named scenario "
                            f"({', '.join(SCENARIOS)})")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{path}: not a text file (a byte that is not UTF-8 at offset {e.start}); "
                            "a scenario file is TOML") from None
    except RecursionError:
        raise ScenarioError(f"{path}: nested too deeply to be a scenario file") from None
    except OSError as e:
        raise ScenarioError(f"cannot read {path}: {e.strerror or e}") from None


def named(name: str) -> dict:
    """The fields of a named scenario's deployment, on its usual profile."""
    ns = SCENARIOS[name]
    base = get_condition("no-control").proxy
    px = {"condition": "no-control", "defer_s": base.defer_s / ns.time_scale,
          "budget_window_s": base.budget_window_s / ns.time_scale}
    prof = SCENARIO_MODEL.get(name, DEFAULT_MODEL)
    return dict(name=name, about=ns.about, profile=load_profile(prof), model={"profile": prof},
                scenario=ns.scenario, condition=get_condition("no-control"), engine_cap=None, proxy=px,
                seed=ns.seed, trace_source=None, burst="pulse")
