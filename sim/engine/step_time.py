"""Step-time model (docs/model.md): a physically shaped linear function of a step's
composition — fixed cost, per request, per token, prefill attention (query x
key pairs) and decode attention (context tokens read)."""
from __future__ import annotations

import math

from dataclasses import dataclass, asdict

COEFFICIENTS = ("fixed_s", "per_request_s", "per_token_s", "per_prefill_pair_s", "per_decode_ctx_s")


@dataclass(frozen=True)
class StepTimeModel:
    fixed_s: float
    per_request_s: float
    per_token_s: float
    per_prefill_pair_s: float
    per_decode_ctx_s: float

    def __post_init__(self):
        for k in COEFFICIENTS:
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
        while done > 0 and start + self.fast_forward_duration(n, ctx, done) >= t:
            done -= 1
        while done < 1 << 30 and start + self.fast_forward_duration(n, ctx, done + 1) < t:
            done += 1
        return done

    def to_dict(self) -> dict:
        return asdict(self)


def prefill_pairs(q: int, ctx_before: int) -> float:
    """Query-key pairs of a causal prefill chunk of q tokens after ctx_before."""
    return q * (ctx_before + (q + 1) / 2.0)

