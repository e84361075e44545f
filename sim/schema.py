"""The scenario file's keys as one table (`SCHEMA`): one row (`Key`) per key
with its section, type, bounds, default and comment. The table drives the
checking of a scenario file (unknown sections and keys, types, bounds, a cap
below its base; every error one line naming the file and `section.key`), the
commented TOML that `llmsim scenario show` prints and records carry
(`sim.scenario_writer`), and the `[section]` tables of layers that no
resolver of `sim.scenario_file` reads (kept as checked and given back by
`Deployment.sections`).

A section is itself a row: `Key("", "fleet", TABLE, ...)` declares `[fleet]`;
`Key("workload", "phases", TABLES, of="phase")` declares a list of tables,
each checked against the rows of section `phase`. Adding a key to a layer is
one row here (plus the code that uses its value); adding a layer's section is
one row for the section and one per key. A kind of `[[layer]]` is registered by
its module (`sim.policy.layers`; the built-in ones, `gateway` and
`preset_client`, are imported here) and its keys are rows of section `layer`.

API: `Key`; `Schema(keys)` with `rows(section)`, `names(section)`,
`row(section, name)`, `check(doc, source)` (the whole document, checked:
raises `ScenarioError`), `check_table(d, section, where, source)`,
`comment(section)`; `SCHEMA`, the scenario file's table.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from .conditions import CONDITIONS
from .engine.scheduler import SCHEDULING_POLICIES
from .policy import gateway, preset_client  # noqa: F401  (the built-in layer kinds: importing them registers them)
from .policy.autoscaler import DRAIN, METRICS, PROVISIONING, AutoscalerConfig
from .policy.layers import kinds
from .policy.presets import PRESETS
from .policy.proxy import SHED_RETRY_AFTER, SHED_WHEN
from .policy.retry import GatewayPolicy, RetryPolicy
from .policy.router import PROXY_PLACEMENTS, ROUTERS
from .profile import ENGINE_FLAGS
from .scenario import ARRIVALS, LENGTH_KINDS, PAPER

NUMBER, WHOLE, STRING, BOOL, TABLE, TABLES, PAIRS, STRINGS = (
    "number", "whole number", "string", "true or false", "table", "list of tables", "list of pairs",
    "list of strings")


class ScenarioError(ValueError):
    """A document that does not fit the table: one line naming the source and `section.key`."""


@dataclass(frozen=True)
class Key:
    """One key of a scenario file. `section` is "" for the file's top level;
    `lo`/`hi` bound a number (`open_lo`/`open_hi`: the bound itself
    excluded); `choices` the strings it may take; `not_below` another key of
    the same table this one may not be below (a cap and its base);
    `default` the value an absent key takes (None: unset, or derived as the
    comment says); `of` the section describing a TABLE's or TABLES' entries
    (default: this key's name); `field`: the value is the `Scenario` field of
    the same name (read and written without code of its own)."""
    section: str
    name: str
    type: str
    comment: str = ""
    default: object = None
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple = ()
    not_below: str | None = None
    of: str | None = None
    field: bool = False

    @property
    def table(self) -> str:
        """The section a TABLE or TABLES row's entries are checked against."""
        return self.of or self.name

    def bounds(self) -> str:
        """The bounds in words, '' when none."""
        if self.lo is not None and self.hi is not None:
            return f"lie in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}{')' if self.open_hi else ']'}"
        if self.lo is not None:
            if self.lo == 0:
                return "be positive" if self.open_lo else "be non-negative"
            return f"be {'>' if self.open_lo else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"be {'<' if self.open_hi else '<='} {self.hi:g}"
        return ""

    def within(self, v) -> bool:
        if self.lo is not None and (v < self.lo or (self.open_lo and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.open_hi and v == self.hi)):
            return False
        return True


def _where(where: str, k: str) -> str:
    return f"{where}.{k}" if where else k


class Schema:
    """A table of `Key` rows (see the module docstring)."""

    def __init__(self, keys):
        self.keys = tuple(keys)
        self._rows: dict[str, dict[str, Key]] = {}
        for k in self.keys:
            sec = self._rows.setdefault(k.section, {})
            if k.name in sec:
                raise ValueError(f"two rows for {_where(k.section, k.name)}")
            sec[k.name] = k
        for k in self.keys:
            if k.type in (TABLE, TABLES) and k.table not in self._rows:
                raise ValueError(f"{_where(k.section, k.name)}: no rows for its section {k.table!r}")
            if k.not_below is not None and k.not_below not in self._rows[k.section]:
                raise ValueError(f"{_where(k.section, k.name)}: not_below names no key {k.not_below!r}")

    def with_rows(self, *keys: Key) -> "Schema":
        """This table with more rows."""
        return Schema(self.keys + tuple(keys))

    def rows(self, section: str) -> tuple[Key, ...]:
        return tuple(self._rows.get(section, {}).values())

    def names(self, section: str) -> tuple[str, ...]:
        return tuple(self._rows.get(section, {}))

    def row(self, section: str, name: str) -> Key:
        return self._rows[section][name]

    def sections(self) -> tuple[str, ...]:
        """The file's [sections], in the table's order."""
        return tuple(k.name for k in self.rows("") if k.type == TABLE)

    def comment(self, section: str) -> str:
        """A top-level section's comment (its row's)."""
        return self.row("", section).comment

    def defaults(self, section: str) -> dict:
        """The section's keys that have a default, with it."""
        return {k.name: k.default for k in self.rows(section) if k.default is not None}

    # ---------------------------------------------------------------- checking
    def check(self, doc, source: str) -> dict:
        """The whole document checked against the table (unknown sections
        and keys, types, bounds, caps below their bases, recursively into
        its tables); returns it unchanged. Raises ScenarioError."""
        return self.check_table(doc, "", "", source)

    def check_table(self, d, section: str, where: str, source: str) -> dict:
        if not isinstance(d, dict):
            raise ScenarioError(f"{source}: {where or 'the file'} must be a table, got {d!r}")
        rows = self._rows.get(section, {})
        for k in d:
            if k not in rows:
                valid = list(rows)
                close = difflib.get_close_matches(k, valid, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
                what = "section" if not where else "key"
                raise ScenarioError(f"{source}: unknown {what} {_where(where, k)!r}{hint}")
        for k, v in d.items():
            self._check_value(rows[k], v, _where(where, k), source)
        for k, v in d.items():
            r = rows[k]
            if r.not_below is not None and r.not_below in d and v < d[r.not_below]:
                raise ScenarioError(f"{source}: {_where(where, k)} ({v!r}) must not be below "
                                  f"{_where(where, r.not_below)} ({d[r.not_below]!r})")
        return d

    def _check_value(self, r: Key, v, where: str, source: str) -> None:
        def bad(msg: str):
            return ScenarioError(f"{source}: {where} {msg}")
        t = r.type
        if t in (NUMBER, WHOLE):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (t == WHOLE and not isinstance(v, int)):
                raise bad(f"must be a {t}, got {v!r}")
            if not math.isfinite(v):
                raise bad(f"must be finite, got {v!r}")
            if not r.within(v):
                raise bad(f"must {r.bounds()}, got {v!r}")
        elif t == STRING:
            if not isinstance(v, str):
                raise bad(f"must be a string, got {v!r}")
            if r.choices and v not in r.choices:
                close = difflib.get_close_matches(v, list(r.choices), n=1)
                raise bad(f"must be one of {', '.join(r.choices)}, got {v!r}"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
        elif t == BOOL:
            if not isinstance(v, bool):
                raise bad(f"must be true or false, got {v!r}")
        elif t == TABLE:
            self.check_table(v, r.table, where, source)
        elif t == TABLES:
            if not isinstance(v, list) or not v:
                raise bad(f"must be a non-empty list of tables {{{', '.join(self.names(r.table))}}}")
            for i, x in enumerate(v):
                self.check_table(x, r.table, f"{where}[{i}]", source)
        elif t == PAIRS:
            names = self.names(r.table)
            if not isinstance(v, list) or not all(isinstance(x, list) and len(x) == len(names) for x in v):
                raise bad(f"must be a list of [{', '.join(names)}] pairs, got {v!r}")
            for i, x in enumerate(v):
                self.check_table(dict(zip(names, x)), r.table, f"{where}[{i}]", source)
        elif t == STRINGS:
            if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
                raise bad(f"must be a non-empty list of strings, got {v!r}")
        else:
            raise ValueError(f"{where}: unknown type {t!r} in the schema")


def _client(name, comment, lo=0.0, open_lo=False, whole=False, not_below=None) -> Key:
    return Key("client", name, WHOLE if whole else NUMBER, comment, getattr(PAPER, name), lo=lo, open_lo=open_lo,
               not_below=not_below, field=True)


def _measure(name, comment, derived=False, **kw) -> Key:
    return Key("measures", name, NUMBER, comment, None if derived else getattr(PAPER, name), field=True,
               **{"lo": 0.0, **kw})


_LAYER_TYPES = {"float": NUMBER, "float | None": NUMBER, "int": WHOLE, "int | None": WHOLE, "bool": BOOL,
                "str": STRING, "tuple": STRINGS}


def _layer_rows() -> list:
    """One row per setting a [[layer]] may override: the fields of
    RetryPolicy and GatewayPolicy (a preset's keys, docs/presets.md), typed
    from them; the policies check the values' meaning (choices, a cap below
    its base) once the preset's values are merged in."""
    out, seen = [], set()
    for cls, who in ((RetryPolicy, "any layer"), (GatewayPolicy, "a gateway")):
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            t = _LAYER_TYPES[f.type]
            out.append(Key("layer", f.name, t, f"{who}: overrides the preset's {f.name} (docs/presets.md)",
                           **({"lo": 0} if t in (NUMBER, WHOLE) else {})))
    return out


_AUTOSCALER = (
    ("metric", STRING, "waiting: engine waiting requests per replica; kv: KV cache usage (0..1); in_flight: "
                       "requests a replica holds; proxy_queue: the proxy's queue (per replica)", dict(choices=METRICS)),
    ("target", NUMBER, "the metric's target value", dict(lo=0.0, open_lo=True)),
    ("min_replicas", WHOLE, "replicas at least", dict(lo=1)),
    ("max_replicas", WHOLE, "replicas at most (the fleet is built at this many)", dict(lo=1, not_below="min_replicas")),
    ("initial_replicas", WHOLE, "replicas ready at the start (default: min_replicas)", dict(lo=1)),
    ("tolerance", NUMBER, "no change while |metric/target - 1| is within this", dict(lo=0.0)),
    ("sync_period_s", NUMBER, "the HPA's sync period (--horizontal-pod-autoscaler-sync-period)",
     dict(lo=0.0, open_lo=True)),
    ("scale_up_stabilization_s", NUMBER, "scale-up stabilisation window", dict(lo=0.0)),
    ("scale_down_stabilization_s", NUMBER, "scale-down stabilisation window", dict(lo=0.0)),
    ("scale_up_percent", NUMBER, "scale-up policy: +this % of the replicas per period ...", dict(lo=0.0)),
    ("scale_up_pods", WHOLE, "... or +this many, whichever is more", dict(lo=0)),
    ("scale_up_period_s", NUMBER, "the scale-up policies' period", dict(lo=0.0, open_lo=True)),
    ("scale_down_percent", NUMBER, "scale-down policy: -this % of the replicas per period", dict(lo=0.0, hi=100.0)),
    ("scale_down_period_s", NUMBER, "the scale-down policy's period", dict(lo=0.0, open_lo=True)),
    ("provisioning", STRING, "a new replica's provisioning delay (model load, warm-up): fixed, uniform or lognormal",
     dict(choices=PROVISIONING)),
    ("provisioning_s", NUMBER, "fixed: the delay; uniform: its low end; lognormal: its median", dict(lo=0.0)),
    ("provisioning_max_s", NUMBER, "uniform: the delay's high end", dict(lo=0.0, not_below="provisioning_s")),
    ("provisioning_sigma", NUMBER, "lognormal: the log's standard deviation", dict(lo=0.0)),
    ("drain", STRING, "a replica scaled down takes no new call; its running ones finish, or are cancelled (503)",
     dict(choices=DRAIN)),
)


def _autoscaler_rows() -> list:
    """[autoscaler]: one row per `AutoscalerConfig` field, its default the config's."""
    defaults = AutoscalerConfig()
    return [Key("autoscaler", name, t, comment, getattr(defaults, name), **kw) for name, t, comment, kw in _AUTOSCALER]


POSITIVE = dict(lo=0.0, open_lo=True)
AT_LEAST_1 = dict(lo=1)

SCHEMA = Schema([
    # -- the file's top level: its name, and one row per [section]
    Key("", "name", STRING, "the scenario's name (default: the file's name)"),
    Key("", "about", STRING, "one line on what it describes", default=""),
    Key("", "seed", WHOLE, "the seed of the generated calls", default=0, lo=0),
    Key("", "model", TABLE,
        "the engine's step-time profile, and Ĉ of this workload when known (else the profile's, or the\n"
        "capacity protocol's on this workload where its mix or engine differs)"),
    Key("", "engine", TABLE,
        "overrides of the profile's flags, named as vLLM's; the KV cache as ONE of kv_cache_tokens,\n"
        "num_gpu_blocks or gpu_memory_utilization; max_num_queued_reqs: the engine refuses (503) beyond it.\n"
        "The profile's values:"),
    Key("", "workload", TABLE,
        "the arrivals as phases (the reference design: base 0.6 Ĉ 120 s, pulse 2.7 Ĉ 107 s, hold 0.6 Ĉ 720 s),\n"
        "prompt and response lengths, prefixes; or trace = \"calls.csv\" (Vidur's arrived_at,\n"
        "num_prefill_tokens, num_decode_tokens or Azure's TIMESTAMP, ContextTokens, GeneratedTokens)"),
    Key("", "client", TABLE,
        "each call: a deadline, up to max_retries retries after a uniform backoff wait, Retry-After\n"
        "honoured up to max_retry_after_s"),
    Key("", "proxy", TABLE, "a named condition (llmsim conditions) and changes to it; defer_s and budget_window_s\n"
                            "set the proxy's own times"),
    Key("", "measures", TABLE, "burst: the burst phase (pulse cohort; hold = after it; primary = primary_skip_s after "
                               "its end);\nwith a trace, burst_start_s and burst_end_s"),
    Key("", "faults", TABLE, "engine faults"),
    Key("", "fleet", TABLE, "replicas behind a router (absent: one engine)"),
    Key("", "autoscaler", TABLE, "Kubernetes' Horizontal Pod Autoscaler on one metric: replicas between min and max\n"
                                 "(the fleet is built at max_replicas; docs/autoscaling.md)"),
    Key("", "layer", TABLES, "the stack's layers from the application down, each a preset of real software with\n"
                             "its keys overridden (docs/presets.md; `llmsim stack` prints the stack)", of="layer"),
    # -- [model]
    Key("model", "profile", STRING, "an embedded profile (qwen2.5-7b, qwen3-14b, llama-3.1-8b, vllm-cpu-tiny) or a "
                                    "profile JSON path", default="qwen2.5-7b"),
    Key("model", "hf_config", STRING, "instead of profile, a model's config.json: a roofline prior from its shape "
                                      "(not a measurement), with gpu"),
    Key("model", "gpu", STRING, "the GPU of a roofline prior (h100, h100-pcie, h200, a100, a100-40gb, a100-pcie, "
                                "l40s, l4, b200, or the name a server reports)"),
    Key("model", "tensor_parallel_size", WHOLE, "with hf_config: the GPUs the model is split over (vLLM's flag)",
        **AT_LEAST_1),
    Key("model", "dtype", STRING, "with hf_config: vLLM's --dtype (auto: the config's)",
        choices=("auto", "bfloat16", "float16", "float32")),
    Key("model", "quantization", STRING, "with hf_config: vLLM's --quantization of a 16-bit checkpoint (an FP8 "
                                         "checkpoint says so itself)", choices=("fp8",)),
    Key("model", "cpu_offload_gb", NUMBER, "with hf_config: GiB of weights per GPU kept in CPU memory "
                                           "(vLLM's flag)", lo=0),
    Key("model", "capacity", NUMBER, "Ĉ of this workload in calls/s, when known", **POSITIVE),
    # -- [engine]: vLLM's flags (sim.profile.with_engine applies them)
    Key("engine", "max_num_seqs", WHOLE, "requests running at once", **AT_LEAST_1),
    Key("engine", "max_num_batched_tokens", WHOLE, "tokens in one step", **AT_LEAST_1),
    Key("engine", "block_size", WHOLE, "tokens per KV block", **AT_LEAST_1),
    Key("engine", "max_model_len", WHOLE, "prompt + response tokens of one request at most", **AT_LEAST_1),
    Key("engine", "async_scheduling", BOOL, "two steps in flight (false: one)"),
    Key("engine", "kv_cache_tokens", WHOLE, "the KV cache in tokens", **AT_LEAST_1),
    Key("engine", "num_gpu_blocks", WHOLE, "the KV cache in blocks", **AT_LEAST_1),
    Key("engine", "gpu_memory_utilization", NUMBER, "the KV cache from the GPU's memory share", lo=0.0, hi=1.0,
        open_lo=True),
    Key("engine", "max_num_queued_reqs", WHOLE, "the engine cap: waiting requests beyond it are refused (503)",
        **AT_LEAST_1),
    Key("engine", "scheduling_policy", STRING, "the waiting queue's order and the preemption victim (vLLM's "
                                               "--scheduling-policy; priority: by each class's priority)",
        choices=SCHEDULING_POLICIES),
    # -- [workload]
    Key("workload", "phases", TABLES, "the arrivals, phase after phase", of="phase"),
    Key("workload", "prompt", TABLE, "prompt lengths: dist = normal (mean, sd), lognormal (median, mean), fixed "
                                     "(value) or empirical (file, column)", of="lengths"),
    Key("workload", "response", TABLE, "response lengths, as prompt's", of="lengths"),
    Key("workload", "shared_prefix", WHOLE, "tokens every prompt starts with", default=PAPER.shared_prefix, lo=0),
    Key("workload", "prefix_groups", TABLES, "instead of shared_prefix: groups of calls, each with its prefix",
        of="prefix_group"),
    Key("workload", "prompt_pool", WHOLE, "a pool of this many whole prompts (lengths drawn once from prompt), sent "
                                          "in turn: call n of a phase sends prompt n mod prompt_pool, a repeat hit "
                                          "whole in the prefix cache (as a load generator's prompt set); its prompts "
                                          "start with the system prompts shared_prefix or prefix_groups give (the "
                                          "groups' shares of the pool), none without them", **AT_LEAST_1),
    Key("workload", "mixed_share", NUMBER, "share of calls given mixed_prompt_len-token prompts", default=0.0,
        lo=0.0, hi=1.0),
    Key("workload", "mixed_prompt_len", WHOLE, "the mixed calls' prompt tokens", default=PAPER.mixed_prompt_len,
        **AT_LEAST_1),
    Key("workload", "trace", STRING, "a CSV of calls replayed instead of phases and lengths"),
    Key("workload", "trace_speedup", NUMBER, "the trace's times divided by this", default=1.0, **POSITIVE),
    Key("workload", "classes", TABLES, "traffic classes (each call drawn into one by share; own lengths, client, "
                                       "priority; verdicts per class)",
        of="class"),
    # one class of [workload] classes (unset keys: the workload's lengths, the [client] settings)
    Key("class", "name", STRING, "the class's name"),
    Key("class", "share", NUMBER, "its share of the calls (shares add up to 1)", **POSITIVE),
    Key("class", "prompt", TABLE, "its prompt lengths, as the workload's", of="lengths"),
    Key("class", "response", TABLE, "its response lengths, as the workload's", of="lengths"),
    Key("class", "deadline_s", NUMBER, "its calls' deadline", **POSITIVE),
    Key("class", "max_retries", WHOLE, "its calls' retries", lo=0),
    Key("class", "backoff_min_s", NUMBER, "its shortest backoff wait", lo=0.0),
    Key("class", "backoff_max_s", NUMBER, "its longest backoff wait", lo=0.0, not_below="backoff_min_s"),
    Key("class", "max_retry_after_s", NUMBER, "Retry-After honoured up to this (default: its deadline)", lo=0.0),
    Key("class", "priority", WHOLE, "the engine priority of its executions (smaller first under the priority "
                                    "policy)", default=0),
    Key("class", "must_recover", BOOL, "the deployment recovers only if this class does", default=True),
    # one phase of [workload] phases
    Key("phase", "name", STRING, "the phase's name (default: phase N)"),
    Key("phase", "duration_s", NUMBER, "its length in seconds", **POSITIVE),
    Key("phase", "load", NUMBER, "calls/s in multiples of the workload's Ĉ (or rate)", lo=0.0),
    Key("phase", "rate", NUMBER, "calls/s (or load)", lo=0.0),
    Key("phase", "arrivals", STRING, "poisson; constant: one call every 1/rate s (guidellm's constant); "
                                     "poisson_exact: int(rate x duration_s) calls, exponential gaps rescaled to "
                                     "the phase's length (inference-perf's constant); uniform_exact: int(rate x "
                                     "duration_s) calls at uniform random times in it", default="poisson",
        choices=ARRIVALS),
    Key("phase", "drained", BOOL, "the phase starts once every call of the phase before has finished (a load "
                                  "generator's stage; llmsim latency --stages)", default=False),
    Key("phase", "shares", PAIRS, "with classes: [[class, share], ...] of this phase's calls (default: the "
                                  "classes' shares)", of="class_share"),
    Key("class_share", "class", STRING, "a class's name"),
    Key("class_share", "share", NUMBER, "its share of the phase's calls (shares add up to 1)", lo=0.0),
    # one group of [workload] prefix_groups
    Key("prefix_group", "tokens", WHOLE, "the group's prefix tokens", lo=0),
    Key("prefix_group", "share", NUMBER, "the group's share of the calls (shares add up to 1)", **POSITIVE),
    # a length distribution ([workload] prompt, response)
    Key("lengths", "dist", STRING, "the distribution", choices=LENGTH_KINDS),
    Key("lengths", "mean", NUMBER, "normal, lognormal: the mean", **POSITIVE),
    Key("lengths", "sd", NUMBER, "normal: the standard deviation", lo=0.0),
    Key("lengths", "median", NUMBER, "lognormal: the median", **POSITIVE),
    Key("lengths", "value", WHOLE, "fixed: the length", **AT_LEAST_1),
    Key("lengths", "file", STRING, "empirical: a CSV file"),
    Key("lengths", "column", STRING, "empirical: its column"),
    # -- [client]: each a Scenario field
    _client("deadline_s", "a call's deadline", open_lo=True),
    _client("max_retries", "retries after the first attempt", lo=0, whole=True),
    _client("backoff_min_s", "the shortest backoff wait"),
    _client("backoff_max_s", "the longest backoff wait", not_below="backoff_min_s"),
    Key("client", "max_retry_after_s", NUMBER, "Retry-After honoured up to this (default: the deadline)", lo=0.0,
        field=True),
    # -- [proxy]
    Key("proxy", "condition", STRING, "a named condition", default="no-control", choices=tuple(CONDITIONS)),
    Key("proxy", "retries", BOOL, "the client's retries pass"),
    Key("proxy", "cancel", STRING, "off | now | deferred | deferred:W"),
    Key("proxy", "coalesce", BOOL, "a retry joins its call's live execution"),
    Key("proxy", "budget", NUMBER, "the retry budget's share", lo=0.0),
    Key("proxy", "order", STRING, "budget and lookup order", choices=("budget-first", "lookup-first")),
    Key("proxy", "proxy_cap", WHOLE, "the proxy's queue cap", lo=0),
    Key("proxy", "queue", STRING, "the proxy queue's order", choices=("fifo", "deadline", "lifo")),
    Key("proxy", "defer_s", NUMBER, "the deferral W of deferred cancellation", lo=0.0),
    Key("proxy", "budget_window_s", NUMBER, "the retry budget's window", **POSITIVE),
    # shedding by class (docs/classes.md): the classes refused while the proxy is saturated, per-class budgets, caps
    Key("proxy", "shed_classes", STRINGS, "classes refused while saturated (shed_when over shed_above)"),
    Key("proxy", "shed_when", STRING, "saturated by: the proxy's queue, the engine's waiting requests, its KV usage",
        choices=SHED_WHEN),
    Key("proxy", "shed_above", NUMBER, "saturated while the measure is above this (kv_usage: a share)", lo=0.0),
    Key("proxy", "shed_status", WHOLE, "a shed attempt's refusal: 429 or 503", lo=429, hi=503),
    Key("proxy", "shed_retry_after", STRING, "none, or estimate: the wait estimate as a 429's Retry-After",
        choices=SHED_RETRY_AFTER),
    Key("proxy", "class_budget", PAIRS, "[[class, share], ...]: a retry budget per class", of="class_budget"),
    Key("proxy", "class_cap", PAIRS, "[[class, N], ...]: most live executions per class (beyond: shed)",
        of="class_cap"),
    Key("class_budget", "class", STRING, "a class's name"),
    Key("class_budget", "share", NUMBER, "its retries within this share of its first attempts", lo=0.0),
    Key("class_cap", "class", STRING, "a class's name"),
    Key("class_cap", "cap", WHOLE, "its live executions at most", **AT_LEAST_1),
    # -- [measures]
    Key("measures", "burst", STRING, "the burst phase's name"),
    Key("measures", "burst_start_s", NUMBER, "with a trace: the burst's start", lo=0.0),
    Key("measures", "burst_end_s", NUMBER, "with a trace: the burst's end", lo=0.0, not_below="burst_start_s"),
    Key("measures", "hold_end_s", NUMBER, "with a trace: the hold cohort's end (default: the last arrival)",
        lo=0.0, not_below="burst_end_s"),
    _measure("delivery_horizon_s", "calls are followed this long after the last arrival (default: the hold's "
                                   "length + the deadline)", derived=True),
    _measure("primary_skip_s", "the primary cohort starts this long after the burst (default: the deadline)",
             derived=True),
    _measure("window_s", "the recovery windows' length", **POSITIVE),
    _measure("recovery_delivery", "a recovered window's on-time delivery share at least", hi=1.0, open_lo=True),
    _measure("recovery_queue_mean", "a recovered window's mean waiting queue at most"),
    _measure("recovery_queue_growth", "a recovered window's queue growth (1/s) at most"),
    # -- [faults]
    Key("faults", "stalls", PAIRS, "[[start_s, duration_s], ...]: the engine does nothing meanwhile", of="stall"),
    Key("faults", "leak_blocks_on_abort", BOOL, "aborted requests' KV blocks are never returned", default=False),
    Key("stall", "start_s", NUMBER, "when the stall starts", lo=0.0),
    Key("stall", "duration_s", NUMBER, "how long it lasts", **POSITIVE),
    # -- [fleet]
    Key("fleet", "replicas", WHOLE, "engines behind the router (default: one per profiles entry, else 1)",
        **AT_LEAST_1),
    Key("fleet", "router", STRING, "how the router places a request", default="round-robin", choices=ROUTERS),
    Key("fleet", "router_retries", WHOLE, "other replicas tried on a 503", default=0, lo=0),
    Key("fleet", "proxy", STRING, "deployment: one proxy before the router; replica: a sidecar before each engine",
        default="deployment", choices=PROXY_PLACEMENTS),
    Key("fleet", "profiles", STRINGS, "one profile per replica (default: the model's for all)"),
    # -- [autoscaler]: the HPA's settings (defaults: its own) and the replicas' provisioning and drain
    *_autoscaler_rows(),
    # -- [[layer]]: a preset and its keys overridden
    # the kinds are those registered (sim.policy.layers): a test or a new layer module adds one
    Key("layer", "kind", STRING, f"the layer's kind, one of {', '.join(kinds())} (default: the preset's)"),
    Key("layer", "preset", STRING, "the software whose defaults the layer takes", choices=tuple(PRESETS)),
    Key("layer", "name", STRING, "the layer's name in `llmsim stack` (default: the preset's)"),
    *_layer_rows(),
])

assert set(SCHEMA.names("engine")) == set(ENGINE_FLAGS) | {"max_num_queued_reqs"}
