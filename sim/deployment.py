"""A deployment and its traffic: the profile with its engine flags changed,
the `Scenario`, the proxy's `Condition`, the fleet, the layers, and the
calls (generated from phases, or replayed from a trace file), as a
scenario file (`sim.scenario_file`) or a named scenario describes them.

API (what commands build on):
- `load(path_or_name, build_prior=None, trace_speedup=None) -> Deployment`:
  a scenario file, or a name of `sim.scenario.SCENARIOS`.
  `build_prior(hf_config_path, gpu, **serving) -> dict` makes a profile dict for
  `[model] hf_config` (the roofline prior lives above sim). Raises
  `ScenarioError` (one line naming the file and key).
- `from_document(doc, source, base_dir, build_prior, trace_speedup, schema)`:
  the same from a parsed document (a dict shaped like the file), checked
  against `schema` (default `sim.schema.SCHEMA`, read when called).
- `from_named(name)`: a named scenario on its usual profile (cached).
- `Deployment`, frozen:
  - `name`, `profile` (overrides applied), `scenario`, `condition` (from
    `[proxy]`), `engine_cap`, `seed`, `trace_source` (a `TraceSource` or
    None), `content_hash` (of the resolved deployment, not of the file's
    text), `document()` (the resolved document, `sim.scenario_writer`),
    `identity()` (what a record carries), `fleet` (a `sim.fleet.FleetSpec` or
    None), `sections` (the sections of layers no resolver reads, as
    checked, with defaults).
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
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field

from . import scenario_file, scenario_writer, schema as _schema
from .conditions import Condition, get_condition
from .fleet import FleetSpec, run_fleet
from .policy.layers import layer_kind
from .policy.proxy import ProxyConfig
from .policy.stack import Stack, check_group
from .profile import Profile
from .run import run_one, workload_capacity
from .scenario import Scenario
from .scenario_file import TraceSource, layer_settings
from .schema import ScenarioError, Schema
from .workload import Trace, make_trace

__all__ = ["Deployment", "ScenarioError", "TraceSource", "from_document", "from_named", "layer_settings", "load"]


def load(path_or_name: str, build_prior=None, trace_speedup: float | None = None) -> "Deployment":
    """A scenario file (TOML) or a named scenario (`sim.scenario.SCENARIOS`)."""
    if scenario_file.is_named(path_or_name):
        return from_named(path_or_name)
    return from_document(scenario_file.read(path_or_name), path_or_name,
                         os.path.dirname(os.path.abspath(path_or_name)), build_prior, trace_speedup)


def from_document(d: dict, source: str = "scenario", base_dir: str = ".", build_prior=None,
                  trace_speedup: float | None = None, schema: Schema | None = None) -> "Deployment":
    """The deployment a parsed scenario document describes
    (`sim.scenario_file.resolve`), checked against `schema`; `trace_speedup`,
    when given, replaces the file's."""
    return Deployment(**scenario_file.resolve(d, source, base_dir, build_prior, trace_speedup, schema))


@functools.lru_cache(maxsize=8)
def from_named(name: str) -> "Deployment":
    """A named scenario as a deployment, on its usual profile."""
    return Deployment(**scenario_file.named(name))


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
    sections: dict = field(default_factory=dict)   # sections of layers no resolver here reads, as checked
    stack_layers: tuple = ()        # [[layer]]: each table as given (kind filled in), application first
    schema: Schema | None = field(default=None, compare=False, repr=False)   # None: sim.schema.SCHEMA

    @property
    def proxy_times(self) -> dict:
        """[proxy] defer_s / budget_window_s, applied to every condition."""
        return {k: self.proxy[k] for k in ("defer_s", "budget_window_s") if k in self.proxy}

    # -- identity
    def document(self) -> dict:
        """The resolved deployment as a document `from_document` accepts
        (`sim.scenario_writer.document`)."""
        return scenario_writer.document(self)

    def layer_settings(self) -> list:
        """Each [[layer]]'s effective settings (`layer_settings`: its
        preset's values with the table's keys on top)."""
        return [layer_settings(t) for t in self.stack_layers]

    def require_simulated(self, layers: bool = False) -> None:
        """Raises unless the simulator runs every layer of the stack: with
        `layers` (as `run` does), any layers on one engine or a fleet, the
        layers that stand at the client's place (`LayerKind.top`) first, one
        inside another (with traffic classes, each class's client keys on the
        innermost: `sim.classes.class_layer_settings`); without, none (the
        commands that do not run through `run`)."""
        for i, t in enumerate(self.stack_layers):
            top = layer_kind(t["kind"]).top
            if layers and (not top or all(layer_kind(u["kind"]).top for u in self.stack_layers[:i])):
                continue
            what = " (client layers first, above every other layer)" if top else " by this command"
            raise ScenarioError(f"{self.name}: layer[{i}] ({t.get('preset', t['kind'])}): {t['kind']} layers are "
                                "described by `llmsim stack` but not yet simulated" + what)

    def stack_for(self, condition: Condition) -> Stack | None:
        """The stack a run of `condition` drives: None for the reference
        design's (the condition's client and proxy); with [[layer]] tables,
        the condition's proxy and the router ([fleet]'s, else the default
        one) under them (a client layer, whose
        retries are off where the condition turns them off, in the client's
        place; the others between it and the proxy, in order)."""
        if not self.stack_layers:
            return None
        self.require_simulated(layers=True)
        router = self.fleet.router if self.fleet is not None else None
        stack = Stack.under_layers(condition, self.run_layers(), self.scenario, router)
        if stack.upstream_group:
            self.require_group(stack)
        return stack

    def require_group(self, stack: Stack) -> None:
        """Raises (one line) unless a gateway's upstream group can balance
        the fleet's replicas (`sim.policy.stack.check_group`): a [fleet] of
        as many replicas (with an [autoscaler], its max_replicas: the group
        lists every replica it may bring up, as open-source nginx's upstream
        block lists fixed servers)."""
        if self.fleet is None:
            raise ScenarioError(f"{self.name}: upstream_servers = {stack.upstream_group}: a gateway's upstream "
                                "group balances a [fleet]'s replicas; give [fleet] replicas (and proxy = \"replica\")")
        if self.fleet.autoscaler is not None and stack.upstream_group != self.fleet.replicas:
            raise ScenarioError(f"{self.name}: upstream_servers: the gateway's upstream group lists every replica "
                                f"the [autoscaler] may bring up: give upstream_servers = max_replicas "
                                f"({self.fleet.replicas}), not {stack.upstream_group}")
        try:
            check_group(stack, self.fleet.replicas)
        except ValueError as e:
            raise ScenarioError(f"{self.name}: {e}") from None

    def run_layers(self) -> tuple | None:
        """The [[layer]] tables' effective settings as a run takes them
        (`Stack.under_layers`; application first), or None: the reference
        design's client."""
        return tuple(self.layer_settings()) if self.stack_layers else None

    @property
    def table(self) -> Schema:
        """The schema the deployment was read with."""
        return self.schema or _schema.SCHEMA

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
            info = dict(info, source=info["source"] + " (on a derived profile: not a measurement)")
        return info

    @property
    def capacity(self) -> float:
        return float(self.capacity_info["capacity"])

    # -- running
    def require_burst(self) -> None:
        late = next((i for i, p in enumerate(self.scenario.phases) if p.drained), None)
        if late is not None and self.trace_source is None:
            raise ScenarioError(f"{self.name}: workload.phases[{late}].drained: a phase that starts once the one "
                                "before has drained is a load test's stage (llmsim latency --stages); a run with "
                                "cohorts plans every arrival in advance")
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
        b = self.scenario.burst_phase
        return b.load if b is not None else None

    def run(self, seed: int | None = None, condition: Condition | str | None = None,
            trace: Trace | None = None) -> dict:
        """One run; the result record with `deployment` (`identity()`) and
        `engine_config` (the scheduler's flags the engine was built with)."""
        self.require_burst()
        self.require_simulated(layers=True)
        seed = self.seed if seed is None else seed
        if trace is None:
            trace = self.trace(seed)
        s = self.scenario
        pulse = self.run_pulse
        cfg = dataclasses.asdict(self.profile.scheduler_config())
        if cfg["scheduling_policy"] == "fcfs":
            del cfg["scheduling_policy"]        # the default: records read as before
        extra = {"deployment": self.identity(), "engine_config": dict(cfg, depth=self.profile.depth)}
        cond = self.condition_for(condition)
        if self.fleet is not None:
            return run_fleet(list(self.fleet.profiles), cond, trace, s, self.fleet.capacities(s), self.fleet.router,
                             seed, pulse, extra=extra, stack=self.stack_for(cond),
                             autoscaler=self.fleet.autoscaler)
        return run_one(self.profile, cond, pulse, seed, trace=trace, scenario=s, capacity=self.capacity,
                       extra=extra, stack=self.stack_for(cond))

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
                             self.trace_source.speedup if self.trace_source else None, self.schema)

    # -- presenting
    def to_toml(self) -> str:
        """The resolved deployment as a complete, commented scenario file."""
        return scenario_writer.to_toml(self.document(), self.profile.engine, self.table)


def _profile_hash(p: Profile) -> str:
    return hashlib.sha256(json.dumps(p.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]

