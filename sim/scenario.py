"""The workload, client and measure constants as one value (`Scenario`), every
one a parameter, and the registry of named scenarios (`SCENARIOS`) that
simulation, calibration and validation share.

The arrivals are a list of `phases` (`Phase`: a duration and a load in
multiples of Ĉ or a rate in calls/s) and the index of the burst phase; the
reference design's base / pulse / hold is a preset of them
(`reference_phases`), and the cohorts' bounds (`base_s`, `pulse_s`,
`hold_s`, `pulse_end`, `hold_end`) are computed from them. Beyond the
reference design a Scenario may carry prompt and response length
distributions (`Lengths`), prefix groups with shares, a mixed-prompt share
and a cut to the engine's context length. Each is left out of `to_dict`
while unset, and phases of the reference design's shape are given there by
its six fields, so the reference scenarios read exactly as before; scenario
files (`sim.scenario_file`) set them.

Named scenarios:
- `paper`: the reference design as written (947 s of arrivals, 120 s deadline) — the default
  for `--engine gpu`, where a point takes ~17 minutes live.
- `cpu-small`: the same dynamics on the tiny CPU engine in about 8 minutes a
  point. All times are the reference design's divided by 4 (base 30 s, pulse 26.75 s at 2.7 Ĉ,
  deadline 30 s, 15 s recovery windows, horizon 210 s; the
  queue-growth bound of the recovery rule scales the other way, to 0.04/s), so
  the pulse's backlog still exceeds one deadline (1.7 x 26.75 s = 45 s of work
  at capacity against a 30 s deadline), but for the hold: 300 s (`CPU_SMALL_HOLD_S`), ten deadlines
  where the reference design's /4 would be six. The time a backlog takes to
  drain moves by 3-4% for each 1% of engine speed, and on a CPU engine
  whose speed during a point is known to ±10% the reference's six deadlines
  put the end of no-retry's and coalesce's drain in the hold's last windows,
  where their recovery verdicts turn on a few percent of speed; over ten, their
  recovery time is what the speed moves, not whether they recover. Prompts are 3,600 ±
  360 tokens with a 600-token shared prefix and responses median 90 / mean 120
  tokens (the reference design's ratios, 30:1 prompt to response, at 0.3 of its lengths), which
  keeps the call rate at the CPU engine's capacity low enough (a few calls/s)
  that the load generator and proxy, sharing two cores with the engine, do not
  starve it. The client's backoff wait (0.25–3 s) is kept: it is a client
  constant, not a time scale of the engine. The proxy's own times (deferral
  W = 10 s, the retry budget's 60 s window) are divided by 4 too.
- `cpu-tiny`: cpu-small's workload at times / 16: a 3-minute smoke test of the
  harness (CI runs it), too short to judge the model by.
- `scaled`: the reference workload shrunk to the tiny CPU engine for its
  capacity protocol: prompts and responses a tenth as long (1,200 ± 120
  prompt tokens with a 200-token shared prefix, responses median 30 / mean
  40 tokens), the reference's times.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field, fields, replace

LENGTH_KINDS = ("normal", "lognormal", "fixed", "empirical")
# how a phase's calls arrive (sim.workload.phase_arrivals): a Poisson process; one call every 1/rate s; or
# int(rate x duration) calls with exponential gaps rescaled to the phase's length (inference-perf's `constant` load);
# or int(rate x duration) calls at uniform random times in it (a Poisson process given its count: the calls an
# engine's metrics count between two scrapes)
ARRIVALS = ("poisson", "constant", "poisson_exact", "uniform_exact")


@dataclass(frozen=True)
class Phase:
    """One phase of the arrivals: `duration_s` seconds of arrivals at `rate`
    calls/s, or at `load` x the workload's capacity Ĉ (at most one of the two
    is given; neither: a window of a replayed trace, whose calls come from the
    trace). `arrivals`: `poisson` (the default) or `constant` (one call every
    1/rate seconds from the phase's start, as load generators such as
    inference-perf and guidellm send)."""
    duration_s: float
    load: float | None = None
    rate: float | None = None
    name: str = ""
    arrivals: str = "poisson"
    # with traffic classes: ((class name, share), ...) of this phase's calls; None: the classes' own shares
    shares: tuple | None = None
    drained: bool = False

    def __post_init__(self):
        if self.shares is not None:
            object.__setattr__(self, "shares", tuple((str(c), float(x)) for c, x in self.shares))
        if not (isinstance(self.duration_s, (int, float)) and math.isfinite(self.duration_s)
                and self.duration_s > 0):
            raise ValueError(f"phase duration_s must be positive, got {self.duration_s!r}")
        if self.load is not None and self.rate is not None:
            raise ValueError("a phase gives either load (x Ĉ) or rate (calls/s), not both")
        if self.load is None and self.rate is None:
            return
        v = self.load if self.load is not None else self.rate
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"phase {'load' if self.load is not None else 'rate'} must be non-negative, got {v!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"phase arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")

    def calls_per_s(self, capacity: float) -> float:
        if self.load is None and self.rate is None:
            raise ValueError(f"phase {self.name!r} is a window of a replayed trace: it generates no calls")
        return self.rate if self.rate is not None else self.load * capacity

    def to_dict(self) -> dict:
        """As JSON; Poisson arrivals and a start on time (the defaults) are left out."""
        d = {k: v for k, v in asdict(self).items() if v is not None and v != "" and
             not (k == "arrivals" and v == "poisson") and not (k == "drained" and not v)}
        if "shares" in d:
            d["shares"] = [list(x) for x in d["shares"]]
        return d


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: `normal` (mean, sd), `lognormal`
    (median, mean), `fixed` (value) or `empirical` (values drawn uniformly
    with replacement; `source` says where they came from). Draws are rounded
    to whole tokens; the caller clamps them to its minimum."""
    kind: str
    mean: float | None = None
    sd: float | None = None
    median: float | None = None
    value: int | None = None
    values: tuple = ()
    source: str = ""

    def __post_init__(self):
        k = self.kind
        if k not in LENGTH_KINDS:
            raise ValueError(f"length distribution must be one of {', '.join(LENGTH_KINDS)}, got {k!r}")
        need = {"normal": ("mean", "sd"), "lognormal": ("median", "mean"), "fixed": ("value",), "empirical": ()}[k]
        for f in need:
            v = getattr(self, f)
            if v is None:
                raise ValueError(f"a {k} length distribution needs {', '.join(need)}")
            if not (math.isfinite(v) and (v >= 0 if f == "sd" else v > 0)):
                raise ValueError(f"{k} {f} must be {'non-negative' if f == 'sd' else 'positive'}, got {v!r}")
        if k == "lognormal" and not self.mean > self.median:
            raise ValueError(f"a lognormal's mean must exceed its median, got median {self.median}, mean {self.mean}")
        if k == "empirical" and (not self.values or min(self.values) < 1):
            raise ValueError("an empirical length distribution needs positive token counts")

    @property
    def expected(self) -> float:
        """The mean token count."""
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "empirical":
            return sum(self.values) / len(self.values)
        return float(self.mean)

    def to_dict(self) -> dict:
        """As JSON; an empirical distribution by its source, count and content hash."""
        if self.kind == "empirical":
            h = hashlib.sha256(",".join(map(str, self.values)).encode()).hexdigest()[:16]
            return {"dist": "empirical", "source": self.source, "n": len(self.values), "sha256": h}
        return {"dist": self.kind, **{f: getattr(self, f) for f in ("mean", "sd", "median", "value")
                                      if getattr(self, f) is not None}}


CLIENT_FIELDS = ("deadline_s", "max_retries", "backoff_min_s", "backoff_max_s", "max_retry_after_s")


@dataclass(frozen=True)
class TrafficClass:
    """One class of calls (docs/classes.md): its `share` of the calls, its
    prompt and response lengths (None: the workload's), its client settings
    (None: the scenario's [client]), the `priority` its executions carry to
    the engine (vLLM's request priority: smaller is served first under the
    priority policy) and whether the deployment's verdict needs it to
    recover (`must_recover`)."""
    name: str
    share: float
    prompt: Lengths | None = None
    response: Lengths | None = None
    deadline_s: float | None = None
    max_retries: int | None = None
    backoff_min_s: float | None = None
    backoff_max_s: float | None = None
    max_retry_after_s: float | None = None
    priority: int = 0
    must_recover: bool = True

    def __post_init__(self):
        if not (math.isfinite(self.share) and self.share >= 0):
            raise ValueError(f"class {self.name!r}: share must be non-negative, got {self.share!r}")

    def client(self, scenario: "Scenario") -> "Scenario":
        """`scenario` with this class's client settings (a Retry-After cap
        left unset follows the class's deadline when the class sets one)."""
        kw = {k: getattr(self, k) for k in CLIENT_FIELDS if getattr(self, k) is not None}
        if self.deadline_s is not None and self.max_retry_after_s is None:
            kw["max_retry_after_s"] = float(self.deadline_s)
        return scenario.with_(**kw) if kw else scenario

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        for k in ("prompt", "response"):
            if k in d:
                d[k] = d[k].to_dict()
        return d


def reference_phases(base_s: float = 120.0, pulse_s: float = 107.0, hold_s: float = 720.0, base_load: float = 0.6,
                     pulse: float = 2.7, hold_load: float = 0.6) -> tuple[Phase, ...]:
    """The reference design's arrivals as phases: base, the burst (pulse) and
    hold, each at a load in multiples of Ĉ."""
    return (Phase(float(base_s), load=base_load, name="base"), Phase(float(pulse_s), load=pulse, name="pulse"),
            Phase(float(hold_s), load=hold_load, name="hold"))


REFERENCE_PHASES = reference_phases()
# the reference design's arrivals by their old names: durations and loads of the phase before the burst, the
# burst, and the phase after it (`Scenario.with_` and the constructor take them)
PHASE_FIELDS = ("base_s", "pulse_s", "hold_s", "base_load", "hold_load", "pulse")


@dataclass(frozen=True, init=False)
class Scenario:
    """The workload, client and measure constants. The arrivals are `phases`
    with `burst` the index of the burst phase (None: no burst); the cohorts'
    bounds follow from them: `base_s` (the phases before the burst),
    `pulse_s` (the burst's), `hold_s` (the phases after it), and the loads
    `base_load`, `pulse`, `hold_load` of the phase before, at and after the
    burst. Those six names are also accepted by the constructor and `with_`,
    which set the phases' durations and loads (the reference design's
    shape: one phase before the burst, one after)."""
    # the workload (docs/model.md#workload): the arrivals, and prompts and responses (tokens)
    phases: tuple[Phase, ...] = REFERENCE_PHASES
    burst: int | None = 1
    prompt_mean: float = 12_000.0
    prompt_sd: float = 1_200.0
    shared_prefix: int = 2_000
    mixed_prompt_len: int = 3_000
    response_median: float = 300.0
    response_mean: float = 400.0
    # client: docs/model.md#client
    deadline_s: float = 120.0
    max_retries: int = 3
    backoff_min_s: float = 0.25
    backoff_max_s: float = 3.0
    max_retry_after_s: float = 120.0
    # measures: docs/model.md#measures
    delivery_horizon_s: float = 840.0
    primary_skip_s: float = 120.0   # primary cohort starts this long after the pulse ends
    window_s: float = 60.0
    recovery_delivery: float = 0.98
    recovery_queue_mean: float = 2.0
    recovery_queue_growth: float = 0.01
    # Beyond the reference design; each is left out of `to_dict` while unset.
    prompt: Lengths | None = None       # unset: normal(prompt_mean, prompt_sd)
    response: Lengths | None = None     # unset: lognormal(response_median, response_mean)
    mixed_share: float | None = None    # share of calls given mixed_prompt_len-token prompts
    max_call_tokens: int | None = None  # prompt + response cut to this (the engine's max_model_len)
    prefix_groups: tuple[tuple[int, float], ...] | None = None   # (prefix tokens, share): unset, one shared_prefix
    # a pool of this many whole prompts (lengths drawn once from the prompt distribution) sent in turn: call n of a
    # phase sends prompt n mod N, the turn restarting at every phase (a load generator's stage); a repeated prompt
    # is the same tokens, so the prefix cache can serve all of it. Unset: every call its own prompt after the prefix
    prompt_pool: int | None = None
    # faults of the engine: stalls (T, S), the engine doing nothing for S seconds from T (a long GC pause, a
    # device hiccup); leak_blocks_on_abort, an aborted request's KV blocks never returned. Unset: none
    stalls: tuple[tuple[float, float], ...] | None = None
    leak_blocks_on_abort: bool | None = None
    # traffic classes (TrafficClass), each call drawn into one by their shares. Unset: one class, as before
    classes: tuple[TrafficClass, ...] | None = None

    def __init__(self, **kw):
        flat = {k: kw.pop(k) for k in PHASE_FIELDS if k in kw}
        for f in fields(self):
            object.__setattr__(self, f.name, kw.pop(f.name, f.default))
        if kw:
            raise TypeError(f"Scenario has no field {next(iter(kw))!r}")
        object.__setattr__(self, "phases", tuple(self.phases))
        if self.burst is not None and not 0 <= self.burst < len(self.phases):
            raise ValueError(f"the burst phase {self.burst} is not one of the {len(self.phases)} phases")
        n = self.prompt_pool
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"prompt_pool must be a whole number of prompts >= 1, got {n!r}")
        if flat:
            object.__setattr__(self, "phases", self._set_phases(flat))

    def _set_phases(self, flat: dict) -> tuple[Phase, ...]:
        """The phases with the durations and loads named as the reference
        design's changed (one phase before the burst, one after)."""
        ph, k = list(self.phases), self.burst
        if k is None:
            raise ValueError(f"{', '.join(flat)}: the scenario has no burst phase to set them around")
        where = {"base_s": (k - 1, "duration_s"), "pulse_s": (k, "duration_s"), "hold_s": (k + 1, "duration_s"),
                 "base_load": (k - 1, "load"), "pulse": (k, "load"), "hold_load": (k + 1, "load")}
        for name, v in flat.items():
            i, attr = where[name]
            if not (0 <= i < len(ph)) or (name.startswith("base") and k != 1) or \
                    (name.startswith("hold") and k != len(ph) - 2):
                raise ValueError(f"{name}: the scenario's phases have not one phase {'before' if i < k else 'after'} "
                                 "the burst; set the phases")
            ph[i] = replace(ph[i], **({attr: v, "rate": None} if attr == "load" else {attr: v}))
        return tuple(ph)

    # -- the arrivals as the cohorts read them
    @property
    def burst_phase(self) -> Phase | None:
        return None if self.burst is None else self.phases[self.burst]

    @property
    def base_s(self) -> float:
        k = len(self.phases) if self.burst is None else self.burst
        return float(sum(p.duration_s for p in self.phases[:k]))

    @property
    def pulse_s(self) -> float:
        return 0.0 if self.burst is None else float(self.phases[self.burst].duration_s)

    @property
    def hold_s(self) -> float:
        return 0.0 if self.burst is None else float(sum(p.duration_s for p in self.phases[self.burst + 1:]))

    def _load(self, i: int, default: float) -> float | None:
        if self.burst is None or not 0 <= i < len(self.phases) or self.phases[i].load is None:
            return default
        return self.phases[i].load

    @property
    def base_load(self) -> float:
        """The load of the phase before the burst (the reference design's when it has none)."""
        return self._load(self.burst - 1 if self.burst else -1, REFERENCE_PHASES[0].load)

    @property
    def pulse(self) -> float:
        """The burst's load (the reference design's when given as a rate or with no burst)."""
        return self._load(-1 if self.burst is None else self.burst, REFERENCE_PHASES[1].load)

    @property
    def hold_load(self) -> float:
        return self._load(-1 if self.burst is None else self.burst + 1, REFERENCE_PHASES[2].load)

    @property
    def is_reference_shape(self) -> bool:
        """Three phases named base, pulse, hold, each at a load, the burst the second."""
        return ([p.name for p in self.phases] == ["base", "pulse", "hold"] and self.burst == 1
                and all(p.load is not None for p in self.phases))

    @property
    def replayed(self) -> bool:
        """The phases are windows of a replayed trace (no loads, no rates)."""
        return all(p.load is None and p.rate is None for p in self.phases)

    @property
    def pulse_start(self) -> float:
        return self.base_s

    @property
    def pulse_end(self) -> float:
        return self.base_s + self.pulse_s

    @property
    def hold_end(self) -> float:
        return self.pulse_end + self.hold_s

    @property
    def primary_start(self) -> float:
        return self.pulse_end + self.primary_skip_s

    def cohorts(self) -> dict[str, tuple[float, float]]:
        return {
            "pulse": (self.pulse_start, self.pulse_end),
            "hold": (self.pulse_end, self.hold_end),
            "primary": (self.primary_start, self.hold_end),
        }

    def with_(self, **kw) -> "Scenario":
        """The scenario with fields changed; also the six names of
        `PHASE_FIELDS` (the phases' durations and loads around the burst).
        New `phases` keep the burst's index unless `burst` is given."""
        flat = {k: kw.pop(k) for k in PHASE_FIELDS if k in kw}
        out = replace(self, **kw)
        return Scenario(**{f.name: getattr(out, f.name) for f in fields(out)}, **flat) if flat else out

    def arrival_phases(self, capacity: float) -> list[tuple[float, float, float]]:
        """(start, end, calls/s) of each phase, loads taken at `capacity`
        (`arrival_kinds` gives how each phase's calls arrive)."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((t, t + p.duration_s, p.calls_per_s(capacity)))
            t += p.duration_s
        return out

    def arrival_kinds(self) -> list[str]:
        """How the calls of each phase of `arrival_phases` arrive (`ARRIVALS`)."""
        return [p.arrivals for p in self.phases]

    @property
    def workload_key(self) -> dict:
        """What the capacity Ĉ depends on besides the engine: the prompt and
        response mix (not the arrivals, not the client)."""
        return {"prompt": (self.prompt.to_dict() if self.prompt else
                           {"dist": "normal", "mean": self.prompt_mean, "sd": self.prompt_sd}),
                "response": (self.response.to_dict() if self.response else
                             {"dist": "lognormal", "median": self.response_median, "mean": self.response_mean}),
                "shared_prefix": self.shared_prefix,
                "prefix_groups": [list(g) for g in self.prefix_groups] if self.prefix_groups else None,
                "mixed": ({"share": self.mixed_share, "len": self.mixed_prompt_len} if self.mixed_share else None),
                **({"prompt_pool": self.prompt_pool} if self.prompt_pool else {}),
                **({"classes": [{"share": c.share, "prompt": c.prompt and c.prompt.to_dict(),
                                 "response": c.response and c.response.to_dict()} for c in self.classes]}
                   if self.classes and any(c.prompt or c.response for c in self.classes) else {})}

    def to_dict(self) -> dict:
        """As records give it: the cohorts' bounds (base_s, pulse_s, hold_s)
        and the loads (base_load, hold_load, pulse) first; the phases as a
        list unless they are the reference design's shape (or a replayed
        trace's windows), whose loads the three say."""
        plain = self.is_reference_shape or self.replayed
        ref = REFERENCE_PHASES
        b = self.burst_phase
        d: dict = {"base_s": self.base_s, "pulse_s": self.pulse_s, "hold_s": self.hold_s,
                   "base_load": self.phases[0].load if self.is_reference_shape else ref[0].load,
                   "hold_load": self.phases[2].load if self.is_reference_shape else ref[2].load,
                   "pulse": b.load if b is not None and b.load is not None else ref[1].load}
        d.update({f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ("phases", "burst") + _EXTENDED or getattr(self, f.name) is not None})
        d.pop("phases", None)
        d.pop("burst", None)
        for k in _EXTENDED:                  # the extended fields after the others, phases first
            if k in d:
                d[k] = d.pop(k)
        if not plain:
            d = {**{k: v for k, v in d.items() if k not in _EXTENDED}, "phases": [p.to_dict() for p in self.phases],
                 **{k: v for k, v in d.items() if k in _EXTENDED}}
        if self.prefix_groups is not None:
            d["prefix_groups"] = [list(g) for g in self.prefix_groups]
        if self.stalls is not None:
            d["stalls"] = [list(x) for x in self.stalls]
        if self.classes is not None:
            d["classes"] = [c.to_dict() for c in self.classes]
        for k in ("prompt", "response"):
            if d.get(k) is not None:
                d[k] = d[k].to_dict()
        return d


_EXTENDED = ("prompt", "response", "mixed_share", "max_call_tokens", "prefix_groups", "prompt_pool", "stalls",
             "leak_blocks_on_abort", "classes")


PAPER = Scenario()

SCALE = 4.0
CPU_SMALL_HOLD_S = 300.0   # ten deadlines, not the reference's six: see the module's docstring


@dataclass(frozen=True)
class NamedScenario:
    name: str
    scenario: Scenario
    engine_args: list[str] = field(default_factory=list)   # extra flags for the live engine
    seed: int = 0
    time_scale: float = 1.0          # the reference design's times are divided by this
    about: str = ""

    def condition(self, cond):
        """The condition (`sim.conditions.Condition`) with the proxy's own times (deferral W, the retry
        budget's window) divided by the time scale, like the workload's."""
        if self.time_scale == 1.0:
            return cond
        p = cond.proxy
        return replace(cond, proxy=replace(p, defer_s=p.defer_s / self.time_scale,
                                           budget_window_s=p.budget_window_s / self.time_scale))

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "engine_args": list(self.engine_args),
                "time_scale": self.time_scale, "about": self.about, **self.scenario.to_dict()}


def _scaled(k: float, hold_s: float | None = None) -> Scenario:
    return PAPER.with_(base_s=PAPER.base_s / k, pulse_s=PAPER.pulse_s / k, hold_s=hold_s or PAPER.hold_s / k,
                       deadline_s=PAPER.deadline_s / k, max_retry_after_s=PAPER.max_retry_after_s / k,
                       delivery_horizon_s=PAPER.delivery_horizon_s / k, primary_skip_s=PAPER.primary_skip_s / k,
                       window_s=PAPER.window_s / k, recovery_queue_growth=PAPER.recovery_queue_growth * k,
                       prompt_mean=3600.0, prompt_sd=360.0, shared_prefix=600, mixed_prompt_len=900,
                       response_median=90.0, response_mean=120.0)


SCALED = PAPER.with_(prompt_mean=1200.0, prompt_sd=120.0, shared_prefix=200, mixed_prompt_len=300,
                     response_median=30.0, response_mean=40.0)

SCENARIOS: dict[str, NamedScenario] = {s.name: s for s in [
    NamedScenario("paper", PAPER, about="the reference design as written"),
    NamedScenario("scaled", SCALED, about="the reference workload at a tenth of its lengths, for the tiny CPU "
                                          "engine's capacity protocol"),
    NamedScenario("cpu-small", _scaled(SCALE, CPU_SMALL_HOLD_S), time_scale=SCALE,
                  about="the reference design's times / 4 but a hold of ten deadlines (300 s), prompts and "
                        "responses x 0.3, for the tiny CPU engine"),
    NamedScenario("cpu-tiny", _scaled(16.0), time_scale=16.0,
                  about="cpu-small's workload at the reference design's times / 16 (7.5 s deadline): a smoke test of "
                        "the harness in about 3 minutes a point, not a validation"),
]}


def get_scenario(name: str) -> NamedScenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}") from None
