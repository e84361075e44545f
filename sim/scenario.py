"""The workload, client and measure constants as one value (`Scenario`), every
one a parameter, and the registry of named scenarios (`SCENARIOS`) that
simulation, calibration and validation share.

Beyond the reference design a Scenario may carry a list of arrival `phases`
(`Phase`: a duration and a load in multiples of Ĉ or a rate in calls/s; the
burst is the phase starting at `base_s` and lasting `pulse_s`, so the cohorts
follow from it), prompt and response length distributions (`Lengths`),
prefix groups with shares, a mixed-prompt share and a cut to the engine's
context length. Each is left out of `to_dict` while unset, so the reference
scenarios read exactly as before; scenario files (`sim.deployment`) set them.

Named scenarios:
- `paper`: the reference design as written (947 s of arrivals, 120 s deadline) — the default
  for `--engine gpu`, where a point takes ~17 minutes live.
- `cpu-small`: the same dynamics on the tiny CPU engine in about 6 minutes a
  point. All times are the reference design's divided by 4 (base 30 s, pulse 26.75 s at 2.7 Ĉ,
  hold 180 s, deadline 30 s, 15 s recovery windows, horizon 210 s; the
  queue-growth bound of the recovery rule scales the other way, to 0.04/s), so
  the pulse's backlog still exceeds one deadline (1.7 x 26.75 s = 45 s of work
  at capacity against a 30 s deadline) and the hold still spans six deadlines. Prompts are 3,600 ±
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
from dataclasses import dataclass, asdict, field, fields, replace

LENGTH_KINDS = ("normal", "lognormal", "fixed", "empirical")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class Phase:
    """One phase of the arrivals: `duration_s` seconds of arrivals at `rate`
    calls/s, or at `load` x the workload's capacity Ĉ (exactly one of the two
    is given). `arrivals`: `poisson` (the default) or `constant` (one call
    every 1/rate seconds from the phase's start, as load generators such as
    inference-perf and guidellm send)."""
    duration_s: float
    load: float | None = None
    rate: float | None = None
    name: str = ""
    arrivals: str = "poisson"

    def __post_init__(self):
        if not (isinstance(self.duration_s, (int, float)) and math.isfinite(self.duration_s)
                and self.duration_s > 0):
            raise ValueError(f"phase duration_s must be positive, got {self.duration_s!r}")
        if (self.load is None) == (self.rate is None):
            raise ValueError("a phase gives either load (x Ĉ) or rate (calls/s), not both and not neither")
        v = self.load if self.load is not None else self.rate
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"phase {'load' if self.load is not None else 'rate'} must be non-negative, got {v!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"phase arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")

    def calls_per_s(self, capacity: float) -> float:
        return self.rate if self.rate is not None else self.load * capacity

    def to_dict(self) -> dict:
        """As JSON; Poisson arrivals (the default) are left out."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != "" and
                not (k == "arrivals" and v == "poisson")}


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


@dataclass(frozen=True)
class Scenario:
    # §1 workload phases (seconds) and rates (multiples of capacity)
    base_s: float = 120.0
    pulse_s: float = 107.0
    hold_s: float = 720.0
    base_load: float = 0.6
    hold_load: float = 0.6
    pulse: float = 2.7
    # §1 prompts and responses (tokens)
    prompt_mean: float = 12_000.0
    prompt_sd: float = 1_200.0
    shared_prefix: int = 2_000
    mixed_prompt_len: int = 3_000
    response_median: float = 300.0
    response_mean: float = 400.0
    # §2 client
    deadline_s: float = 120.0
    max_retries: int = 3
    backoff_min_s: float = 0.25
    backoff_max_s: float = 3.0
    max_retry_after_s: float = 120.0
    # §5 measures
    delivery_horizon_s: float = 840.0
    primary_skip_s: float = 120.0   # primary cohort starts this long after the pulse ends
    window_s: float = 60.0
    recovery_delivery: float = 0.98
    recovery_queue_mean: float = 2.0
    recovery_queue_growth: float = 0.01
    # Beyond the reference design; each is left out of `to_dict` while unset.
    # phases: the arrivals as a list of phases, the burst (pulse) being the one
    # that starts at base_s and lasts pulse_s; unset: base / pulse / hold above
    phases: tuple[Phase, ...] | None = None
    prompt: Lengths | None = None       # unset: normal(prompt_mean, prompt_sd)
    response: Lengths | None = None     # unset: lognormal(response_median, response_mean)
    mixed_share: float | None = None    # share of calls given mixed_prompt_len-token prompts
    max_call_tokens: int | None = None  # prompt + response cut to this (the engine's max_model_len)
    prefix_groups: tuple[tuple[int, float], ...] | None = None   # (prefix tokens, share): unset, one shared_prefix
    # faults of the engine: stalls (T, S), the engine doing nothing for S seconds from T (a long GC pause, a
    # device hiccup); leak_blocks_on_abort, an aborted request's KV blocks never returned. Unset: none
    stalls: tuple[tuple[float, float], ...] | None = None
    leak_blocks_on_abort: bool | None = None

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
        return replace(self, **kw)

    def arrival_phases(self, capacity: float) -> list[tuple[float, float, float]]:
        """(start, end, calls/s) of each phase, loads taken at `capacity`
        (`arrival_kinds` gives how each phase's calls arrive)."""
        if self.phases is None:
            return [(0.0, self.base_s, self.base_load * capacity),
                    (self.pulse_start, self.pulse_end, self.pulse * capacity),
                    (self.pulse_end, self.hold_end, self.hold_load * capacity)]
        out, t = [], 0.0
        for p in self.phases:
            out.append((t, t + p.duration_s, p.calls_per_s(capacity)))
            t += p.duration_s
        return out

    def arrival_kinds(self) -> list[str]:
        """How the calls of each phase of `arrival_phases` arrive: poisson or constant."""
        if self.phases is None:
            return ["poisson"] * 3
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
                "mixed": ({"share": self.mixed_share, "len": self.mixed_prompt_len} if self.mixed_share else None)}

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in _EXTENDED or getattr(self, f.name) is not None}
        if self.phases is not None:
            d["phases"] = [p.to_dict() for p in self.phases]
        if self.prefix_groups is not None:
            d["prefix_groups"] = [list(g) for g in self.prefix_groups]
        if self.stalls is not None:
            d["stalls"] = [list(x) for x in self.stalls]
        for k in ("prompt", "response"):
            if d.get(k) is not None:
                d[k] = d[k].to_dict()
        return d


_EXTENDED = ("phases", "prompt", "response", "mixed_share", "max_call_tokens", "prefix_groups", "stalls",
             "leak_blocks_on_abort")


PAPER = Scenario()

SCALE = 4.0


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


def _scaled(k: float) -> Scenario:
    return PAPER.with_(base_s=PAPER.base_s / k, pulse_s=PAPER.pulse_s / k, hold_s=PAPER.hold_s / k,
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
    NamedScenario("cpu-small", _scaled(SCALE), time_scale=SCALE,
                  about="the reference design's times / 4, prompts and responses x 0.3, for the tiny CPU engine"),
    NamedScenario("cpu-tiny", _scaled(16.0), time_scale=16.0,
                  about="cpu-small's workload at the reference design's times / 16 (7.5 s deadline): a smoke test of "
                        "the harness in about 3 minutes a point, not a validation"),
]}


def get_scenario(name: str) -> NamedScenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}") from None
