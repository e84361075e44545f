"""Step-time model (docs/model.md): a physically shaped function of a step's
composition — fixed cost, per request, per token, prefill attention (query x
key pairs) and decode attention (context tokens read).

Two forms (a profile's `step_time.form`):
  linear    (the default) the sum of the five terms (`StepTimeModel`);
  roofline  the larger of the step's compute time and its memory time, plus
            the fixed and per-request overheads (`RooflineStepTimeModel`):
              fixed_s + per_request_s * reqs
                + max(per_token_s * tokens + per_prefill_pair_s * pairs,     compute
                      weights_s + per_decode_ctx_s * decode context)         memory
            (`docs/profiles.md#the-step-time-form`).
`step_time_model(d)` builds either from a profile's `step_time` object."""
from __future__ import annotations

import math

from dataclasses import dataclass, asdict, replace

COEFFICIENTS = ("fixed_s", "per_request_s", "per_token_s", "per_prefill_pair_s", "per_decode_ctx_s")
ROOFLINE_COEFFICIENTS = COEFFICIENTS + ("weights_s",)
FORMS = ("linear", "roofline")


@dataclass(frozen=True)
class StepTimeModel:
    fixed_s: float
    per_request_s: float
    per_token_s: float
    per_prefill_pair_s: float
    per_decode_ctx_s: float

    form = "linear"
    coefficients = COEFFICIENTS

    def __post_init__(self):
        for k in self.coefficients:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"step-time coefficient {k} must be a non-negative number, got {v!r}")

    def duration(self, num_reqs: int, num_tokens: int, prefill_pairs: float, decode_ctx: float) -> float:
        return (self.fixed_s + self.per_request_s * num_reqs + self.per_token_s * num_tokens
                + self.per_prefill_pair_s * prefill_pairs + self.per_decode_ctx_s * decode_ctx)

    def fast_forward_duration(self, num_decode_reqs: int, decode_context: float, num_steps: int) -> float:
        """Total time of `num_steps` decode-only steps of `num_decode_reqs`
        requests whose context sum is `decode_context` in the first step and
        grows by num_decode_reqs per step (closed form)."""
        n, m = num_decode_reqs, num_steps
        a = self.fixed_s + (self.per_request_s + self.per_token_s) * n + self.per_decode_ctx_s * decode_context
        return m * a + self.per_decode_ctx_s * n * (m * (m - 1) / 2.0)

    def fast_forward_steps_before(self, num_decode_reqs: int, decode_context: float, start: float, t: float) -> int:
        """How many of the decode-only steps of `fast_forward_duration`, run
        one after another from `start`, end before `t` (at most 2**30)."""
        n, ctx = num_decode_reqs, decode_context
        # the i-th step ends at start + cum(i), cum(i) = i * first_step_s + growth_s * i * (i - 1) / 2
        first_step_s = self.fixed_s + (self.per_request_s + self.per_token_s) * n + self.per_decode_ctx_s * ctx
        growth_s = self.per_decode_ctx_s * n
        room = t - start
        if room <= 0:
            done = 0
        elif growth_s > 0:
            half = first_step_s - growth_s / 2
            done = min(int((-half + math.sqrt(half ** 2 + 2 * growth_s * room)) / growth_s), 1 << 30)
        elif first_step_s > 0:
            done = min(int(room / first_step_s), 1 << 30)
        else:
            return 1 << 30              # steps take no time
        return self._exact_steps_before(n, ctx, start, t, done)

    def _exact_steps_before(self, n: int, ctx: float, start: float, t: float, done: int) -> int:
        """`done`, an estimate of fast_forward_steps_before, made exact."""
        while done > 0 and start + self.fast_forward_duration(n, ctx, done) >= t:
            done -= 1
        while done < 1 << 30 and start + self.fast_forward_duration(n, ctx, done + 1) < t:
            done += 1
        return done

    def scaled(self, factor: float) -> "StepTimeModel":
        """The model with every coefficient x `factor`."""
        return replace(self, **{k: getattr(self, k) * factor for k in self.coefficients})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RooflineStepTimeModel(StepTimeModel):
    """A step takes the larger of its compute time (every scheduled token's
    matrix products, `per_token_s`, and the prefill chunks' attention,
    `per_prefill_pair_s`) and its memory time (the weights read once,
    `weights_s`, and the decode requests' KV context read,
    `per_decode_ctx_s`), plus the fixed (`fixed_s`: launch and scheduling)
    and per-request (`per_request_s`) overheads. Below the ridge point
    (weights_s / per_token_s tokens) a step is memory-bound: a decode batch
    grows its time by its context only."""
    weights_s: float

    form = "roofline"
    coefficients = ROOFLINE_COEFFICIENTS

    def duration(self, num_reqs: int, num_tokens: int, prefill_pairs: float, decode_ctx: float) -> float:
        compute = self.per_token_s * num_tokens + self.per_prefill_pair_s * prefill_pairs
        memory = self.weights_s + self.per_decode_ctx_s * decode_ctx
        return self.fixed_s + self.per_request_s * num_reqs + (compute if compute > memory else memory)

    def _compute_bound_steps(self, n: int, ctx: float) -> float:
        """How many decode-only steps from the first (context `ctx`, growing by
        n a step) are compute-bound (memory time below compute time); inf for
        all of them."""
        gap = self.per_token_s * n - (self.weights_s + self.per_decode_ctx_s * ctx)
        if gap <= 0:
            return 0
        growth = self.per_decode_ctx_s * n
        return math.ceil(gap / growth) if growth > 0 else math.inf

    def fast_forward_duration(self, num_decode_reqs: int, decode_context: float, num_steps: int) -> float:
        """As `StepTimeModel.fast_forward_duration`: the first k steps
        compute-bound, the rest memory-bound (closed form)."""
        n, m = num_decode_reqs, num_steps
        k = min(self._compute_bound_steps(n, decode_context), m)
        growth = self.per_decode_ctx_s * n
        memory0 = self.weights_s + self.per_decode_ctx_s * decode_context
        return (m * (self.fixed_s + self.per_request_s * n) + k * self.per_token_s * n + (m - k) * memory0
                + growth * (m * (m - 1) - k * (k - 1)) / 2.0)

    def fast_forward_steps_before(self, num_decode_reqs: int, decode_context: float, start: float, t: float) -> int:
        n, ctx = num_decode_reqs, decode_context
        room = t - start
        base = self.fixed_s + self.per_request_s * n
        k = self._compute_bound_steps(n, ctx)
        compute_step = base + self.per_token_s * n
        growth = self.per_decode_ctx_s * n
        if room <= 0:
            done = 0
        elif k > 0 and (k == math.inf or room <= k * compute_step):
            if compute_step <= 0:
                return 1 << 30          # steps take no time
            done = min(int(room / compute_step), 1 << 30)
        else:
            # k compute-bound steps, then memory-bound ones from context ctx + k n
            room -= k * compute_step
            first_step_s = base + self.weights_s + self.per_decode_ctx_s * (ctx + k * n)
            if growth > 0:
                half = first_step_s - growth / 2
                done = min(k + int((-half + math.sqrt(half ** 2 + 2 * growth * room)) / growth), 1 << 30)
            elif first_step_s > 0:
                done = min(k + int(room / first_step_s), 1 << 30)
            else:
                return 1 << 30
        return self._exact_steps_before(n, ctx, start, t, done)

    def to_dict(self) -> dict:
        return {"form": self.form, **asdict(self)}


def step_time_model(d: dict) -> StepTimeModel:
    """The model of a profile's `step_time` object: `form` (default linear)
    and its coefficients (`StepTimeModel.coefficients`), as floats."""
    form = d.get("form", "linear")
    if form not in FORMS:
        raise ValueError(f"step_time.form must be one of {', '.join(FORMS)}, got {form!r}")
    cls = FORM_MODELS[form]
    return cls(**{k: float(d[k]) for k in cls.coefficients})


FORM_MODELS = {"linear": StepTimeModel, "roofline": RooflineStepTimeModel}


def prefill_pairs(q: int, ctx_before: int) -> float:
    """Query-key pairs of a causal prefill chunk of q tokens after ctx_before."""
    return q * (ctx_before + (q + 1) / 2.0)

