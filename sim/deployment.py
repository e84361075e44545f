"""A deployment and its traffic, resolved from a scenario file (TOML) or a
named scenario: the profile with its engine flags changed, the `Scenario`,
the proxy's `Condition`, and the calls (generated from phases, or replayed
from a trace file).

API (what commands build on):
- `load(path_or_name, build_prior=None, trace_speedup=None) -> Deployment`:
  a scenario file, or a
  name of `sim.scenario.SCENARIOS`. `build_prior(hf_config_path, gpu) -> dict`
  makes a profile dict for `[model] hf_config` (the roofline prior lives
  above sim). Raises `ScenarioError` (one line naming the file and key).
- `from_document(doc, source, base_dir, build_prior)`: the same from a parsed
  document (a dict shaped like the file).
- `Deployment`, frozen:
  - `name`, `profile` (overrides applied), `scenario`, `condition` (from
    `[proxy]`), `engine_cap`, `seed`, `trace_source` (a `TraceSource` or
    None), `content_hash` (of the resolved deployment, not of the file's
    text), `document()` (the resolved document), `identity()` (what a record
    carries).
  - `capacity` / `capacity_info`: Ĉ of this workload on this engine (given
    in the file, the profile's, or the capacity protocol's on this workload,
    computed once and cached by content hash; `sim.run.workload_capacity`).
  - `run_pulse`: the burst's load as records give it (`pulse`), or None.
  - `trace(seed=None)`: the calls of one seed (a replayed trace is the same
    for every seed).
  - `run(seed=None, condition=None, trace=None)`: one run, the result record, which
    carries `deployment` (name, content hash, profile identity, Ĉ's source,
    the resolved TOML).
  - `condition_for(cond)`: a condition with the deployment's proxy times and
    engine cap applied.
  - `require_burst()`: raises unless cohorts can be formed (a burst declared).
  - `with_changes(model=, pulse=, max_batched_tokens=, mixed_prompts=)`: the
    deployment as the command-line flags change it.
  - `to_toml()`: the resolved deployment as a complete, commented file that
    `load` reads back to an equal deployment.
  - `implications()`: calls per phase, Ĉ, the burst's backlog against the
    deadline, KV seats for the mean prompt (`llmsim scenario check`).

File sections (every key optional; the reference design's value by default):
`[model]` profile | hf_config + gpu, and capacity; `[engine]` vLLM's flags
(`sim.profile.ENGINE_FLAGS`) and `max_num_queued_reqs` (the engine cap);
`[workload]` phases (duration_s, load or rate, name), prompt and response
(`{dist = "normal"|"lognormal"|"fixed"|"empirical", ...}`), shared_prefix
or prefix_groups, mixed_share, mixed_prompt_len, or trace (CSV) with
trace_speedup; `[client]` the Scenario's client fields; `[proxy]` condition plus control overrides;
`[measures]` burst (a phase's name) or burst_start_s/burst_end_s with a
trace, and the Scenario's measure fields.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field

import numpy as np

from .conditions import CONDITIONS, Condition, compose, get_condition, parse_cancel
from .policy.proxy import ProxyConfig
from .profile import ENGINE_FLAGS, Profile, ProfileError, embedded_names, from_dict, load_profile, with_engine
from .fleet import FLEET_KEYS, FleetSpec, fleet_spec, run_fleet
from .run import run_one, workload_capacity
from .scenario import PAPER, SCENARIOS, Lengths, Phase, Scenario
from .workload import Trace, TraceError, make_trace, read_trace


class ScenarioError(ValueError):
    """A scenario file that cannot be used: one line naming the file and key."""


DEFAULT_MODEL = "qwen2.5-7b"
SCENARIO_MODEL = {"paper": "qwen2.5-7b", "scaled": "vllm-cpu-tiny", "cpu-small": "vllm-cpu-tiny",
                  "cpu-tiny": "vllm-cpu-tiny"}
CLIENT_KEYS = ("deadline_s", "max_retries", "backoff_min_s", "backoff_max_s", "max_retry_after_s")
MEASURE_KEYS = ("delivery_horizon_s", "primary_skip_s", "window_s", "recovery_delivery", "recovery_queue_mean",
                "recovery_queue_growth")
PROXY_KEYS = ("condition", "retries", "cancel", "coalesce", "budget", "order", "proxy_cap", "queue",
              "defer_s", "budget_window_s")
FLAT_PHASE_KEYS = ("base_s", "pulse_s", "hold_s", "base_load", "pulse", "hold_load")
SCHEMA = {
    "": ("name", "about", "seed", "model", "engine", "workload", "client", "proxy", "measures", "faults", "fleet"),
    "fleet": FLEET_KEYS,
    "faults": ("stalls", "leak_blocks_on_abort"),
    "stall": ("start_s", "duration_s"),
    "model": ("profile", "hf_config", "gpu", "capacity"),
    "engine": ENGINE_FLAGS + ("max_num_queued_reqs",),
    "workload": ("phases", "prompt", "response", "shared_prefix", "prefix_groups", "mixed_share", "mixed_prompt_len", "trace",
                 "trace_speedup", "prompt_mean", "prompt_sd", "response_median", "response_mean") + FLAT_PHASE_KEYS,
    "client": CLIENT_KEYS,
    "proxy": PROXY_KEYS,
    "measures": ("burst", "burst_start_s", "burst_end_s", "hold_end_s") + MEASURE_KEYS,
    "phase": ("name", "duration_s", "load", "rate", "arrivals"),
    "prefix_group": ("tokens", "share"),
    "lengths": ("dist", "mean", "sd", "median", "value", "file", "column"),
}


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


# ------------------------------------------------------------ type checking
class _Doc:
    """Typed access to one section of the document, with errors that name the
    file and the key."""

    def __init__(self, source: str, section: str, d: dict, schema: str | None = None):
        self.source, self.section, self.d = source, section, d
        if not isinstance(d, dict):
            raise ScenarioError(f"{source}: {section or 'the file'} must be a table")
        valid = SCHEMA[schema if schema is not None else section]
        for k in d:
            if k not in valid:
                close = difflib.get_close_matches(k, valid, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
                raise ScenarioError(f"{source}: unknown key {self.where(k)!r}{hint}")

    def where(self, k: str) -> str:
        return f"{self.section}.{k}" if self.section else k

    def err(self, k: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {self.where(k)} {msg}")

    def has(self, k: str) -> bool:
        return k in self.d

    def num(self, k: str, default=None, positive=False, allow_zero=True, whole=False):
        if k not in self.d:
            return default
        v = self.d[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (whole and not isinstance(v, int)):
            raise self.err(k, f"must be a {'whole number' if whole else 'number'}, got {v!r}")
        if not math.isfinite(v):
            raise self.err(k, f"must be finite, got {v!r}")
        if positive and (v < 0 or (v == 0 and not allow_zero)):
            raise self.err(k, f"must be {'non-negative' if allow_zero else 'positive'}, got {v!r}")
        return v

    def str_(self, k: str, default=None):
        if k not in self.d:
            return default
        v = self.d[k]
        if not isinstance(v, str):
            raise self.err(k, f"must be a string, got {v!r}")
        return v

    def bool_(self, k: str, default=None):
        if k not in self.d:
            return default
        v = self.d[k]
        if not isinstance(v, bool):
            raise self.err(k, f"must be true or false, got {v!r}")
        return v

    def sub(self, k: str, schema: str) -> "_Doc":
        return _Doc(self.source, self.where(k), self.d[k], schema)


# ---------------------------------------------------------------- resolving
def _lengths(sec: _Doc, k: str, base_dir: str) -> Lengths:
    d = sec.sub(k, "lengths")
    kind = d.str_("dist")
    if kind is None:
        raise d.err("dist", "is missing: give normal, lognormal, fixed or empirical")
    if kind == "empirical":
        path, col = d.str_("file"), d.str_("column")
        if path is None or col is None:
            raise sec.err(k, "(empirical) needs file and column")
        values = _column(os.path.join(base_dir, path), col, f"{sec.source}: {sec.where(k)}")
        return Lengths("empirical", values=values, source=f"{path}:{col}")
    try:
        return Lengths(kind, mean=d.num("mean"), sd=d.num("sd"), median=d.num("median"),
                       value=d.num("value", whole=True))
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


def _profile(doc: _Doc, base_dir: str, build_prior) -> tuple[Profile, dict]:
    m = doc.sub("model", "model") if doc.has("model") else _Doc(doc.source, "model", {})
    prof_name, cfg, gpu = m.str_("profile"), m.str_("hf_config"), m.str_("gpu")
    cap = m.num("capacity", positive=True, allow_zero=False)
    prof, named = _named_profile(m, prof_name, cfg, gpu, base_dir, build_prior)
    return prof, (dict(named, capacity=float(cap)) if cap is not None else named)


def _named_profile(m: _Doc, prof_name, cfg, gpu, base_dir: str, build_prior) -> tuple[Profile, dict]:
    if cfg is not None:
        if prof_name is not None:
            raise m.err("hf_config", "and model.profile both given: give one")
        if gpu is None:
            raise m.err("gpu", "is missing: hf_config needs the GPU (h100, h200, a100, ...)")
        if build_prior is None:
            raise m.err("hf_config", "needs the roofline prior, which this caller does not provide")
        path = os.path.join(base_dir, cfg)
        try:
            raw = build_prior(path, gpu)
            prof = from_dict(raw, path)
        except (OSError, ValueError, KeyError) as e:
            raise m.err("hf_config", f"{path}: {e}") from None
        return prof, {"hf_config": cfg, "gpu": gpu}
    if gpu is not None:
        raise m.err("gpu", "only goes with model.hf_config")
    name = prof_name or DEFAULT_MODEL
    if name not in embedded_names() and not os.path.isabs(name) and os.path.exists(os.path.join(base_dir, name)):
        name = os.path.join(base_dir, name)
    try:
        return load_profile(name), {"profile": prof_name or DEFAULT_MODEL}
    except ProfileError as e:
        raise m.err("profile", str(e)) from None


def _phases(w: _Doc, measures: _Doc) -> tuple[dict, str | None]:
    """Scenario fields of the arrivals, and the burst's phase name."""
    if w.has("phases") and any(w.has(k) for k in FLAT_PHASE_KEYS):
        k = next(k for k in FLAT_PHASE_KEYS if w.has(k))
        raise w.err(k, "and workload.phases both given: give the phases one way")
    burst = measures.str_("burst")
    if not w.has("phases"):
        flat = {k: w.num(k, getattr(PAPER, k), positive=True, allow_zero=k.endswith("load") or k == "pulse")
                for k in FLAT_PHASE_KEYS}
        for k in ("pulse_s", "hold_s"):
            if flat[k] <= 0:
                raise w.err(k, f"must be positive, got {flat[k]!r}")
        if burst not in (None, "pulse"):
            raise measures.err("burst", f"names no phase: the phases are base, pulse, hold; got {burst!r}")
        return flat, "pulse"
    ph = w.d["phases"]
    if not isinstance(ph, list) or not ph:
        raise w.err("phases", "must be a non-empty list of tables {duration_s, load | rate, name}")
    phases = []
    for i, p in enumerate(ph):
        d = _Doc(w.source, f"workload.phases[{i}]", p, "phase")
        dur = d.num("duration_s")
        if dur is None:
            raise d.err("duration_s", "is missing")
        if dur <= 0:
            raise d.err("duration_s", f"must be positive, got {dur!r}")
        load, rate = d.num("load", positive=True), d.num("rate", positive=True)
        if load is not None and rate is not None:
            raise d.err("load", "and rate both given: give the rate in calls/s or as a load in multiples of Ĉ, not both")
        if load is None and rate is None:
            raise d.err("load", "is missing: give load (x Ĉ) or rate (calls/s)")
        arrivals = d.str_("arrivals", "poisson")
        if arrivals not in ("poisson", "constant"):
            raise d.err("arrivals", f"must be poisson or constant, got {arrivals!r}")
        phases.append(Phase(float(dur), None if load is None else float(load), None if rate is None else float(rate),
                            d.str_("name", f"phase {i + 1}"), arrivals))
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise w.err("phases", f"names must differ, got {names}")
    if burst is not None and burst not in names:
        close = difflib.get_close_matches(burst, names, n=1)
        raise measures.err("burst", f"names no phase ({', '.join(names)})" +
                           (f"; did you mean {close[0]!r}?" if close else f", got {burst!r}"))
    if burst is None:
        return {"phases": tuple(phases), "base_s": sum(p.duration_s for p in phases), "pulse_s": 0.0,
                "hold_s": 0.0}, None
    k = names.index(burst)
    b = phases[k]
    out = {"base_s": sum(p.duration_s for p in phases[:k]), "pulse_s": b.duration_s,
           "hold_s": sum(p.duration_s for p in phases[k + 1:])}
    reference = (len(phases) == 3 and k == 1 and all(p.load is not None for p in phases)
                 and names == ["base", "pulse", "hold"])
    if reference:                          # the reference design's shape: its own fields, no phase list
        out.update(base_load=phases[0].load, pulse=b.load, hold_load=phases[2].load)
    else:
        out.update(phases=tuple(phases), pulse=b.load if b.load is not None else PAPER.pulse,
                   base_load=PAPER.base_load, hold_load=PAPER.hold_load)
    return out, burst


def from_document(d: dict, source: str = "scenario", base_dir: str = ".", build_prior=None,
                  trace_speedup: float | None = None) -> "Deployment":
    """The deployment a parsed scenario document describes (see the module
    docstring); `trace_speedup`, when given, replaces the file's."""
    doc = _Doc(source, "", d)
    secs = {s: doc.sub(s, s) if doc.has(s) else _Doc(source, s, {})
            for s in ("model", "engine", "workload", "client", "proxy", "measures")}
    name = doc.str_("name", os.path.splitext(os.path.basename(source))[0])
    seed = doc.num("seed", 0, positive=True, whole=True)
    about = doc.str_("about", "")
    prof, model_doc = _profile(doc, base_dir, build_prior)
    prof, engine_cap = _engine(secs["engine"], prof)
    w, me = secs["workload"], secs["measures"]
    if w.has("trace"):
        sc, trace_src, burst = _replayed(w, me, base_dir, trace_speedup)
    else:
        (sc, burst), trace_src = _generated(w, me, base_dir), None
    scenario = _scenario(sc, secs["client"], me, prof, trace_src is None)
    if doc.has("faults"):
        scenario = scenario.with_(**_faults(doc.sub("faults", "faults")))
    _check_lengths(w, scenario, trace_src, prof)
    cond, proxy_doc = _proxy(secs["proxy"])
    fleet = None
    if doc.has("fleet"):
        fl = doc.sub("fleet", "fleet")
        overrides = {k: v for k, v in secs["engine"].d.items() if k != "max_num_queued_reqs"}
        try:
            fleet = fleet_spec(fl.d, prof, lambda name: _replica_profile(fl, name, base_dir, overrides))
        except ValueError as e:
            raise ScenarioError(f"{source}: fleet.{e}") from None
    return Deployment(name=name, about=about, profile=prof, model=model_doc, scenario=scenario, condition=cond,
                      engine_cap=engine_cap, proxy=proxy_doc, seed=int(seed), trace_source=trace_src, burst=burst,
                      base_dir=base_dir, build_prior=build_prior, fleet=fleet)


def _faults(f: _Doc) -> dict:
    """[faults]: engine stalls as [[T, S], ...] (the engine does nothing for S
    seconds from T) and a KV block leak on abort."""
    out: dict = {}
    if f.has("stalls"):
        v = f.d["stalls"]
        if not isinstance(v, list) or not all(isinstance(x, list) and len(x) == 2 for x in v):
            raise f.err("stalls", f"must be a list of [start_s, duration_s] pairs, got {v!r}")
        stalls = []
        for i, (t, d) in enumerate(v):
            pair = _Doc(f.source, f"{f.where('stalls')}[{i}]", {"start_s": t, "duration_s": d}, "stall")
            stalls.append((float(pair.num("start_s", positive=True)),
                           float(pair.num("duration_s", positive=True, allow_zero=False))))
        out["stalls"] = tuple(sorted(stalls))
    if f.has("leak_blocks_on_abort"):
        out["leak_blocks_on_abort"] = f.bool_("leak_blocks_on_abort") or None
    return out


def _engine(eng: _Doc, prof: Profile) -> tuple[Profile, int | None]:
    """[engine]: the profile with vLLM's flags changed, and the engine cap."""
    overrides = {k: v for k, v in eng.d.items() if k != "max_num_queued_reqs"}
    try:
        prof = with_engine(prof, overrides)
    except ProfileError as e:
        raise ScenarioError(f"{eng.source}: engine: {e}") from None
    return prof, eng.num("max_num_queued_reqs", None, positive=True, allow_zero=False, whole=True)


def _replayed(w: _Doc, me: _Doc, base_dir: str, trace_speedup: float | None) -> tuple[dict, TraceSource, str | None]:
    """[workload] trace: Scenario fields, the trace and the burst's name."""
    clash = [k for k in ("phases", "prompt", "response", "mixed_share", "prefix_groups") + FLAT_PHASE_KEYS
             + ("prompt_mean", "prompt_sd", "response_median", "response_mean") if w.has(k)]
    if clash:
        raise w.err(clash[0], "and workload.trace both given: a trace fixes arrivals and lengths")
    if me.has("burst"):
        raise me.err("burst", "names a phase, but a trace has none: give burst_start_s and burst_end_s")
    path = os.path.join(base_dir, w.str_("trace"))
    speed = trace_speedup if trace_speedup is not None else w.num("trace_speedup", 1.0, positive=True,
                                                                 allow_zero=False)
    try:
        tr, info = read_trace(path, speed, int(w.num("shared_prefix", 0, positive=True, whole=True)))
    except TraceError as e:
        raise ScenarioError(f"{w.source}: workload.trace: {e}") from None
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()[:16]
    a, b = me.num("burst_start_s", positive=True), me.num("burst_end_s", positive=True)
    if (a is None) != (b is None):
        raise me.err("burst_start_s" if a is None else "burst_end_s", "is missing: give both ends of the burst")
    end = me.num("hold_end_s", float(tr.arrival[-1]), positive=True)
    if a is not None and not b > a:
        raise me.err("burst_end_s", f"must be after burst_start_s ({a}), got {b}")
    if a is not None and not end > b:
        raise me.err("hold_end_s", f"must be after burst_end_s ({b}), got {end} (the trace's last call "
                                   f"arrives at {tr.arrival[-1]:.1f} s)")
    sc = dict(base_s=float(a if a is not None else end), pulse_s=float(b - a) if a is not None else 0.0,
              hold_s=float(end - b) if a is not None else 0.0, shared_prefix=int(tr.shared_prefix),
              prompt=Lengths("empirical", values=tuple(int(x) for x in tr.prompt_len), source=f"trace:{sha}"),
              response=Lengths("empirical", values=tuple(int(x) for x in tr.max_tokens), source=f"trace:{sha}"),
              prompt_mean=float(tr.prompt_len.mean()), response_mean=float(tr.max_tokens.mean()))
    return sc, TraceSource(w.str_("trace"), float(speed), sha, tr, info), ("trace" if a is not None else None)


def _generated(w: _Doc, me: _Doc, base_dir: str) -> tuple[dict, str | None]:
    """[workload] phases and lengths: Scenario fields and the burst's name."""
    for k in ("burst_start_s", "burst_end_s", "hold_end_s"):
        if me.has(k):
            raise me.err(k, "only goes with workload.trace; name the burst phase with measures.burst")
    if w.has("trace_speedup"):
        raise w.err("trace_speedup", "only goes with workload.trace")
    sc, burst = _phases(w, me)
    for k in ("prompt", "response"):
        if w.has(k):
            flat = [f for f in ((("prompt_mean", "prompt_sd") if k == "prompt" else
                                 ("response_median", "response_mean"))) if w.has(f)]
            if flat:
                raise w.err(flat[0], f"and workload.{k} both given: give the {k} lengths one way")
            L = _lengths(w, k, base_dir)
            if k == "prompt" and L.kind == "normal":
                sc.update(prompt_mean=float(L.mean), prompt_sd=float(L.sd))
            elif k == "response" and L.kind == "lognormal":
                sc.update(response_median=float(L.median), response_mean=float(L.mean))
            else:
                sc[k] = L
    for k in ("prompt_mean", "prompt_sd", "response_median", "response_mean"):
        if w.has(k):
            sc[k] = float(w.num(k, positive=True, allow_zero=k == "prompt_sd"))
    if w.has("shared_prefix"):
        sc["shared_prefix"] = int(w.num("shared_prefix", positive=True, whole=True))
    if w.has("prefix_groups"):
        if w.has("shared_prefix"):
            raise w.err("shared_prefix", "and workload.prefix_groups both given: give the prefixes one way")
        groups = _prefix_groups(w)
        sc.update(prefix_groups=groups, shared_prefix=min(g[0] for g in groups))
    for k, L in (("prompt_mean", sc.get("prompt")), ("response_mean", sc.get("response"))):
        if L is not None:                # the mean the proxy's first throughput estimate uses
            sc[k] = float(L.expected)
    if w.has("mixed_prompt_len"):
        sc["mixed_prompt_len"] = int(w.num("mixed_prompt_len", positive=True, allow_zero=False, whole=True))
    share = w.num("mixed_share", None, positive=True)
    if share is not None:
        if share > 1:
            raise w.err("mixed_share", f"must lie in [0, 1], got {share!r}")
        sc["mixed_share"] = float(share) if share > 0 else None
    return sc, burst


def _scenario(sc: dict, cl: _Doc, me: _Doc, prof: Profile, generated: bool) -> Scenario:
    """The Scenario: the workload's fields, [client] and [measures], with the
    defaults that follow the deadline (Retry-After cap, primary cohort's
    start, delivery horizon = hold + one deadline)."""
    for k in CLIENT_KEYS:
        if cl.has(k):
            sc[k] = cl.num(k, positive=True, allow_zero=k != "deadline_s", whole=k == "max_retries")
    deadline = sc.get("deadline_s", PAPER.deadline_s)
    sc.setdefault("max_retry_after_s", float(deadline))
    if sc.get("backoff_min_s", PAPER.backoff_min_s) > sc.get("backoff_max_s", PAPER.backoff_max_s):
        raise cl.err("backoff_min_s", "must not exceed client.backoff_max_s")
    for k in MEASURE_KEYS:
        if me.has(k):
            sc[k] = me.num(k, positive=True, allow_zero=k in ("recovery_queue_mean", "recovery_queue_growth"))
    if sc.get("window_s", 1.0) <= 0:
        raise me.err("window_s", "must be positive")
    if not 0 < sc.get("recovery_delivery", PAPER.recovery_delivery) <= 1:
        raise me.err("recovery_delivery", "must lie in (0, 1]")
    sc.setdefault("primary_skip_s", float(deadline))
    sc.setdefault("delivery_horizon_s", float(sc.get("hold_s", PAPER.hold_s) + deadline))
    if generated and (sc.get("prompt") is not None or sc.get("response") is not None):
        sc["max_call_tokens"] = int(prof.engine["max_model_len"])
    return PAPER.with_(**{k: (float(v) if isinstance(v, int) and k.endswith("_s") else v) for k, v in sc.items()})


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


def _proxy(px: _Doc) -> tuple[Condition, dict]:
    """[proxy]: the condition, and the section as resolved."""
    cname = px.str_("condition", "no-control")
    if cname not in CONDITIONS:
        close = difflib.get_close_matches(cname, list(CONDITIONS), n=1)
        raise px.err("condition", f"{cname!r} is not a named condition" +
                     (f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(CONDITIONS)}"))
    changes = {}
    if px.has("retries"):
        changes["retries"] = px.bool_("retries")
    if px.has("cancel"):
        try:
            parse_cancel(px.str_("cancel"))
        except ValueError as e:
            raise px.err("cancel", str(e)) from None
        changes["cancel"] = px.str_("cancel")
    if px.has("coalesce"):
        changes["coalesce"] = px.bool_("coalesce")
    if px.has("budget"):
        changes["budget"] = px.num("budget", positive=True)
    for k, valid in (("order", ("budget-first", "lookup-first")), ("queue", ("fifo", "deadline", "lifo"))):
        if px.has(k):
            v = px.str_(k)
            if v not in valid:
                raise px.err(k, f"must be one of {', '.join(valid)}, got {v!r}")
            changes[k] = v
    if px.has("proxy_cap"):
        changes["proxy_cap"] = int(px.num("proxy_cap", positive=True, whole=True))
    cond = compose(cname, **changes) if changes else get_condition(cname)
    times = {k: float(px.num(k, positive=True, allow_zero=k == "defer_s")) for k in ("defer_s", "budget_window_s")
             if px.has(k)}
    if times.get("budget_window_s", 1.0) <= 0:
        raise px.err("budget_window_s", "must be positive")
    others = {k: px.d[k] for k in PROXY_KEYS if k not in ("condition", "defer_s", "budget_window_s") and px.has(k)}
    return cond, {"condition": cname, **others, **times}


def _prefix_groups(w: _Doc) -> tuple:
    v = w.d["prefix_groups"]
    if not isinstance(v, list) or not v:
        raise w.err("prefix_groups", "must be a non-empty list of tables {tokens, share}")
    out = []
    for i, g in enumerate(v):
        d = _Doc(w.source, f"workload.prefix_groups[{i}]", g, "prefix_group")
        tok, share = d.num("tokens", positive=True, whole=True), d.num("share", positive=True, allow_zero=False)
        if tok is None or share is None:
            raise d.err("tokens" if tok is None else "share", "is missing")
        out.append((int(tok), float(share)))
    total = sum(g[1] for g in out)
    if abs(total - 1.0) > 1e-9:
        raise w.err("prefix_groups", f"shares must add up to 1, got {total:g}")
    return tuple(out)


def _replica_profile(fl: "_Doc", name: str, base_dir: str, overrides: dict) -> Profile:
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


def load(path_or_name: str, build_prior=None, trace_speedup: float | None = None) -> "Deployment":
    """A scenario file (TOML) or a named scenario (`sim.scenario.SCENARIOS`)."""
    if path_or_name in SCENARIOS and not os.path.isfile(path_or_name):
        return from_named(path_or_name)     # a directory of that name (`llmsim paper`'s output) is no scenario
    if not os.path.isfile(path_or_name):
        raise ScenarioError(f"unknown scenario {path_or_name!r}: not a file nor a named scenario "
                            f"({', '.join(SCENARIOS)})")
    try:
        with open(path_or_name, "rb") as f:
            d = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path_or_name}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{path_or_name}: not a text file (a byte that is not UTF-8 at offset {e.start}); "
                            "a scenario file is TOML") from None
    except RecursionError:
        raise ScenarioError(f"{path_or_name}: nested too deeply to be a scenario file") from None
    except OSError as e:
        raise ScenarioError(f"cannot read {path_or_name}: {e.strerror or e}") from None
    return from_document(d, path_or_name, os.path.dirname(os.path.abspath(path_or_name)), build_prior,
                         trace_speedup)


@functools.lru_cache(maxsize=8)
def from_named(name: str) -> "Deployment":
    """A named scenario as a deployment, on its usual profile."""
    ns = SCENARIOS[name]
    base = get_condition("no-control").proxy
    px = {"condition": "no-control", "defer_s": base.defer_s / ns.time_scale,
          "budget_window_s": base.budget_window_s / ns.time_scale}
    prof = SCENARIO_MODEL.get(name, DEFAULT_MODEL)
    return Deployment(name=name, about=ns.about, profile=load_profile(prof), model={"profile": prof},
                      scenario=ns.scenario, condition=get_condition("no-control"), engine_cap=None, proxy=px,
                      seed=ns.seed, trace_source=None, burst="pulse")


# ---------------------------------------------------------------- the object
@dataclass(frozen=True)
class Deployment:
    name: str
    about: str
    profile: Profile
    model: dict                     # how the profile was named: {"profile": ...} or {"hf_config", "gpu"}
    scenario: Scenario
    condition: Condition            # from [proxy]; commands may run others through condition_for
    engine_cap: int | None          # [engine] max_num_queued_reqs
    proxy: dict                     # the [proxy] section as resolved: condition and its changes
    seed: int
    trace_source: TraceSource | None
    burst: str | None               # the burst phase's name (cohorts need one)
    base_dir: str = field(default=".", compare=False)        # relative paths in the document are from here
    build_prior: object = field(default=None, compare=False, repr=False)
    fleet: FleetSpec | None = None  # [fleet]: replicas behind a router; None: one engine

    @property
    def proxy_times(self) -> dict:
        """[proxy] defer_s / budget_window_s, applied to every condition."""
        return {k: self.proxy[k] for k in ("defer_s", "budget_window_s") if k in self.proxy}

    # -- identity
    def document(self) -> dict:
        """The resolved deployment as a document `from_document` accepts."""
        s = self.scenario
        doc: dict = {"name": self.name, "about": self.about, "seed": self.seed, "model": dict(self.model)}
        eng = dict(self.profile.raw.get("engine_overrides") or {})
        if self.engine_cap is not None:
            eng["max_num_queued_reqs"] = self.engine_cap
        doc["engine"] = eng
        w: dict = {}
        me: dict = {}
        if self.trace_source is not None:
            w = {"trace": self.trace_source.path, "trace_speedup": self.trace_source.speedup,
                 "shared_prefix": int(self.trace_source.trace.shared_prefix)}
            if self.burst is not None:
                me.update(burst_start_s=s.pulse_start, burst_end_s=s.pulse_end)
            me["hold_end_s"] = s.hold_end if self.burst is not None else s.base_s
        else:
            if s.phases is None:
                w["phases"] = [{"name": "base", "duration_s": s.base_s, "load": s.base_load},
                               {"name": "pulse", "duration_s": s.pulse_s, "load": s.pulse},
                               {"name": "hold", "duration_s": s.hold_s, "load": s.hold_load}]
            else:
                w["phases"] = [p.to_dict() for p in s.phases]
            if self.burst is not None:
                me["burst"] = self.burst
            w["prompt"] = _lengths_doc(s.prompt) if s.prompt else {"dist": "normal", "mean": s.prompt_mean,
                                                                    "sd": s.prompt_sd}
            w["response"] = _lengths_doc(s.response) if s.response else {
                "dist": "lognormal", "median": s.response_median, "mean": s.response_mean}
            if s.prefix_groups:
                w["prefix_groups"] = [{"tokens": t, "share": sh} for t, sh in s.prefix_groups]
            else:
                w["shared_prefix"] = s.shared_prefix
            w["mixed_share"] = s.mixed_share or 0.0
            w["mixed_prompt_len"] = s.mixed_prompt_len
        doc["workload"] = w
        doc["client"] = {k: getattr(s, k) for k in CLIENT_KEYS}
        doc["proxy"] = dict(self.proxy)
        me.update({k: getattr(s, k) for k in MEASURE_KEYS})
        doc["measures"] = me
        faults = {}
        if s.stalls:
            faults["stalls"] = [list(x) for x in s.stalls]
        if s.leak_blocks_on_abort:
            faults["leak_blocks_on_abort"] = True
        if faults:
            doc["faults"] = faults
        if self.fleet is not None:
            doc["fleet"] = self.fleet.document()
        return doc

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 (16 hex digits) of the resolved deployment: the scenario,
        the profile's contents with its overrides, the proxy condition, the
        trace's contents and the seed."""
        ident = {"document": self.document(), "scenario": self.scenario.to_dict(),
                 "profile": _profile_hash(self.profile),
                 "trace": self.trace_source.sha256 if self.trace_source else None}
        return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def identity(self) -> dict:
        """What a record carries to be re-run exactly."""
        return {"name": self.name, "content_hash": self.content_hash,
                "profile": {"name": self.profile.name, **self.model, "sha256": _profile_hash(self.profile),
                            "engine": dict(self.profile.engine),
                            "engine_overrides": dict(self.profile.raw.get("engine_overrides") or {}),
                            "provenance": self.profile.provenance.get("kind")},
                "capacity": self.capacity, "capacity_source": self.capacity_info["source"],
                "trace": self.trace_source.to_dict() if self.trace_source else None,
                "toml": self.to_toml()}

    # -- capacity
    @functools.cached_property
    def capacity_info(self) -> dict:
        """Ĉ of this workload on this engine and where it came from."""
        if self.fleet is not None:
            return self.fleet.capacity_info(self.scenario)
        if "capacity" in self.model:
            return {"capacity": self.model["capacity"], "source": "given in the scenario file", "key": None}
        try:
            info = workload_capacity(self.profile, self.scenario)
        except RuntimeError as e:
            raise ScenarioError(f"{self.name}: the capacity protocol found no Ĉ for this workload: {e}") from None
        if self.profile.provenance.get("kind") == "roofline prior":
            info = dict(info, source=info["source"] + " (on a roofline prior: not a measurement)")
        return info

    @property
    def capacity(self) -> float:
        return float(self.capacity_info["capacity"])

    # -- running
    def require_burst(self) -> None:
        if self.burst is None:
            if self.trace_source is not None:
                raise ScenarioError(f"{self.name}: no burst declared, and the cohorts need one: give "
                                    "[measures] burst_start_s and burst_end_s")
            raise ScenarioError(f"{self.name}: no burst declared, and the cohorts need one: name the burst "
                                "phase with [measures] burst = \"PHASE\"")

    def trace(self, seed: int | None = None) -> Trace:
        """The calls of `seed` (default the deployment's): generated from the
        phases at this workload's Ĉ, or the replayed trace (any seed)."""
        if self.trace_source is not None:
            return self.trace_source.trace
        return make_trace(self.capacity, self.scenario, self.seed if seed is None else seed)

    def condition_for(self, cond: Condition | str | None = None) -> Condition:
        """`cond` (default the deployment's) with the deployment's engine cap
        (unless it has its own) and proxy times: they replace the reference's
        (10 s deferral, 60 s budget window) where `cond` keeps those, so an
        explicitly set deferral W stays."""
        c = self.condition if cond is None else (get_condition(cond) if isinstance(cond, str) else cond)
        ref = ProxyConfig()
        times = {k: v for k, v in self.proxy_times.items() if getattr(c.proxy, k) == getattr(ref, k)}
        if times:
            c = dataclasses.replace(c, proxy=dataclasses.replace(c.proxy, **times))
        if self.engine_cap is not None and c.engine_cap is None:
            c = dataclasses.replace(c, engine_cap=self.engine_cap)
        return c

    @property
    def run_pulse(self) -> float | None:
        """The burst's load (x Ĉ) as records give it as `pulse`; None for a
        replayed trace or a burst given as a rate."""
        if self.trace_source is not None:
            return None
        if self.scenario.phases is None:
            return self.scenario.pulse
        b = _burst_phase(self)
        return b.load if b is not None else None

    def run(self, seed: int | None = None, condition: Condition | str | None = None,
            trace: Trace | None = None) -> dict:
        """One run; the result record with `deployment` (`identity()`) and
        `engine_config` (the scheduler's flags the engine was built with)."""
        self.require_burst()
        seed = self.seed if seed is None else seed
        if trace is None:
            trace = self.trace(seed)
        s = self.scenario
        pulse = self.run_pulse
        cfg = dataclasses.asdict(self.profile.scheduler_config())
        extra = {"deployment": self.identity(), "engine_config": dict(cfg, depth=self.profile.depth)}
        if self.fleet is not None:
            return run_fleet(list(self.fleet.profiles), self.condition_for(condition), trace, s,
                             self.fleet.capacities(s), self.fleet.router, seed, pulse, extra=extra)
        return run_one(self.profile, self.condition_for(condition), pulse, seed, trace=trace, scenario=s,
                       capacity=self.capacity, extra=extra)

    def with_changes(self, model: str | None = None, pulse: float | None = None,
                     max_batched_tokens: int | None = None,
                     mixed_prompts: bool = False) -> "Deployment":
        """The deployment with the command line's flags applied: another
        profile, the burst phase's load, the step budget, mixed prompts. A
        flag that changes nothing leaves the deployment (and its hash) as is."""
        if model is not None and model == self.model.get("profile"):
            model = None
        if max_batched_tokens is not None and max_batched_tokens == self.profile.engine["max_num_batched_tokens"]:
            max_batched_tokens = None
        if pulse is not None and self.run_pulse is not None and pulse == self.run_pulse:
            pulse = None
        if mixed_prompts and self.scenario.mixed_share == 0.5:
            mixed_prompts = False
        doc = copy.deepcopy(self.document())
        if model is not None:
            doc["model"] = {"profile": model}           # another model: its own Ĉ, not the file's
        if max_batched_tokens is not None:
            doc["engine"]["max_num_batched_tokens"] = max_batched_tokens
        if pulse is not None:
            if self.trace_source is not None or self.burst is None:
                raise ScenarioError(f"{self.name}: --pulse needs a burst phase given as a load")
            for p in doc["workload"]["phases"]:
                if p.get("name") == self.burst:
                    p.pop("rate", None)
                    p["load"] = pulse
        if mixed_prompts:
            if self.trace_source is not None:
                raise ScenarioError(f"{self.name}: --mixed-prompts does not apply to a replayed trace")
            doc["workload"]["mixed_share"] = 0.5
        if model is None and max_batched_tokens is None and pulse is None and not mixed_prompts:
            return self
        return from_document(doc, self.name, self.base_dir, self.build_prior,
                             self.trace_source.speedup if self.trace_source else None)

    # -- presenting
    def to_toml(self) -> str:
        return to_toml(self.document(), self.profile.engine)

    def implications(self) -> dict:
        """What the scenario implies: calls per phase at Ĉ, the burst's
        backlog (arrivals beyond capacity over the burst, in seconds of work
        at capacity) against the deadline, and the KV seats for the mean
        prompt plus mean response."""
        s, cap = self.scenario, self.capacity
        out: dict = {"capacity": cap, "capacity_source": self.capacity_info["source"]}
        if self.trace_source is not None:
            tr = self.trace_source.trace
            out["phases"] = [{"name": "trace", "duration_s": float(tr.arrival[-1]), "calls": len(tr)}]
            if self.burst is not None:
                n = int(np.count_nonzero((tr.arrival >= s.pulse_start) & (tr.arrival < s.pulse_end)))
                burst_rate = n / s.pulse_s
        else:
            out["phases"] = []
            names = ([p.name for p in s.phases] if s.phases is not None else ["base", "pulse", "hold"])
            for name, (a, b, r) in zip(names, s.arrival_phases(cap)):
                out["phases"].append({"name": name, "duration_s": b - a, "rate": r, "calls": r * (b - a)})
            if self.burst is not None:
                burst_rate = next(p["rate"] for p in out["phases"] if p["name"] == self.burst)
        if self.burst is not None:
            backlog = max(0.0, burst_rate - cap) * s.pulse_s / cap
            out["burst"] = {"name": self.burst, "start_s": s.pulse_start, "end_s": s.pulse_end,
                            "rate": burst_rate, "load": burst_rate / cap, "backlog_s": backlog,
                            "deadline_s": s.deadline_s, "beyond_deadline": backlog > s.deadline_s}
        mean_prompt = (s.prompt.expected if s.prompt else s.prompt_mean)
        if s.mixed_share:
            mean_prompt = (1 - s.mixed_share) * mean_prompt + s.mixed_share * s.mixed_prompt_len
        mean_resp = s.response.expected if s.response else s.response_mean
        e = self.profile.engine
        per = math.ceil((mean_prompt + mean_resp) / e["block_size"])
        out["kv"] = {"tokens": e["num_gpu_blocks"] * e["block_size"], "blocks": e["num_gpu_blocks"],
                     "mean_prompt": mean_prompt, "mean_response": mean_resp, "blocks_per_call": per,
                     "seats": e["num_gpu_blocks"] // per, "max_num_seqs": e["max_num_seqs"]}
        return out


def _burst_phase(dep: Deployment) -> Phase | None:
    if dep.scenario.phases is None or dep.burst is None:
        return None
    return next((p for p in dep.scenario.phases if p.name == dep.burst), None)


def _profile_hash(p: Profile) -> str:
    return hashlib.sha256(json.dumps(p.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _lengths_doc(L: Lengths) -> dict:
    if L.kind == "empirical":
        path, _, col = L.source.rpartition(":")
        return {"dist": "empirical", "file": path, "column": col}
    return {"dist": L.kind, **{k: getattr(L, k) for k in ("mean", "sd", "median", "value")
                               if getattr(L, k) is not None}}


# ------------------------------------------------------------------ writing
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


COMMENTS = {
    "model": "an embedded profile (" + ", ".join(["qwen2.5-7b", "qwen3-14b", "llama-3.1-8b", "vllm-cpu-tiny"])
             + ") or a profile JSON path;\n# or hf_config = \"config.json\" with gpu = \"h100\" (a roofline prior, "
               "not a measurement);\n# capacity = Ĉ in calls/s of this workload when known (else the profile's, or "
               "the\n# capacity protocol's on this workload where its mix or engine differs)",
    "engine": "overrides of the profile's flags, named as vLLM's: max_num_seqs, max_num_batched_tokens,\n"
              "# block_size, max_model_len, async_scheduling, and the KV cache as ONE of kv_cache_tokens,\n"
              "# num_gpu_blocks or gpu_memory_utilization; max_num_queued_reqs: the engine refuses (503) beyond it.\n"
              "# The profile's values:",
    "workload": "phases: duration_s and a load (x the workload's Ĉ) or a rate (calls/s); lengths:\n"
                "# {dist = \"normal\", mean, sd} | {dist = \"lognormal\", median, mean} | {dist = \"fixed\", value}\n"
                "# | {dist = \"empirical\", file, column}; or trace = \"calls.csv\" (Vidur's arrived_at,\n"
                "# num_prefill_tokens, num_decode_tokens or Azure's TIMESTAMP, ContextTokens, GeneratedTokens)",
    "client": "each call: a deadline, up to max_retries retries after a uniform backoff wait, Retry-After\n"
              "# honoured up to max_retry_after_s",
    "proxy": "a named condition (llmsim conditions) and changes to it: retries, cancel, coalesce, budget,\n"
             "# order, proxy_cap, queue; defer_s and budget_window_s set the proxy's own times",
    "faults": "engine faults: stalls = [[start_s, duration_s], ...] (the engine does nothing meanwhile); "
              "leak_blocks_on_abort = true (aborted requests' KV blocks are never returned)",
    "fleet": "replicas behind a router: router = round-robin | least-outstanding | least-kv | prefix-affinity |\n"
             "# call-affinity; router_retries: other replicas tried on a 503; proxy = deployment (one proxy before\n"
             "# the router) | replica (a sidecar proxy before each engine); profiles: one per replica (default the\n"
             "# model's for all)",
    "measures": "burst: the burst phase (pulse cohort; hold = after it; primary = primary_skip_s after its end);\n"
                "# with a trace, burst_start_s and burst_end_s",
}


def to_toml(doc: dict, engine: dict | None = None) -> str:
    """A resolved document as a commented TOML file; `engine` (the profile's
    flags) is listed, commented out, under [engine]."""
    lines = [f"# llmsim scenario {doc['name']}" + (f": {doc['about']}" if doc.get("about") else ""),
             "# every key is optional; an absent key takes the reference design's value (docs/model.md)"]
    for k in ("name", "about", "seed"):
        lines.append(f"{k} = {_toml_value(doc[k])}")
    for sec in ("model", "engine", "workload", "client", "proxy", "measures", "faults", "fleet"):
        if sec not in doc:
            continue
        lines += ["", f"[{sec}]", f"# {COMMENTS[sec]}"]
        if sec == "engine" and engine:
            shown = dict(engine, async_scheduling=engine["depth"] > 1)
            shown.pop("depth")
            lines += [f"#   {k} = {_toml_value(v)}" for k, v in shown.items() if k not in doc[sec]]
        for k, v in doc[sec].items():
            if k == "phases":
                lines.append("phases = [")
                lines += [f"  {_toml_value(p)}," for p in v]
                lines.append("]")
            else:
                lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
