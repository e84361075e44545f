"""Step-time model (docs/model.md): a physically shaped function of a step's
composition — fixed cost, per request, per token, prefill attention (query x
key pairs) and decode attention (context tokens read).

Two forms (a profile's `step_time.form`):
  linear    (the default) the sum of the five terms (`StepTimeModel`);
  roofline  each kernel the larger of its compute and its memory time
            (`RooflineStepTimeModel`, docs/profiles.md#the-step-time-form):
              fixed_s + per_request_s * reqs
                + max(per_token_s * tokens, weights_s)       matrix products
                + per_prefill_pair_s * pairs                 prefill attention (compute)
                + per_decode_ctx_s * decode context          decode attention (memory)
  moe       the roofline of a mixture-of-experts model
            (`MoEStepTimeModel`): the dense matrix products as the roofline's
            (per_token_s, weights_s) plus the routed experts' grouped GEMMs,
            kernels of their own bound by their compute
            (`expert_per_token_s` x tokens) or their memory (the share of
            the experts' weights its tokens route to: `expert_weights_s` x
            the expected share of distinct experts under top-k routing of
            that many tokens);
the roofline and moe forms take an optional `comm_per_token_s` (0 unless
given): the tensor-parallel all-reduces' time per scheduled token, added to
the step (an all-reduce runs between the matrix products, not under their
weights' read), and the optional bulk regime of large all-reduces
(`comm_bulk_fixed_s`, `comm_bulk_per_token_s`; both 0 unless given): a step's
all-reduce time is min(comm_per_token_s x tokens, comm_bulk_fixed_s +
comm_bulk_per_token_s x tokens), so a prefill chunk's all-reduces, past the
size at which they leave vLLM's custom all-reduce for NCCL, run at NCCL's
bandwidth rather than the small messages' rate;
`step_time_model(d)` builds any of them from a profile's `step_time` object."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

COEFFICIENTS = ("fixed_s", "per_request_s", "per_token_s", "per_prefill_pair_s", "per_decode_ctx_s")
ROOFLINE_COEFFICIENTS = COEFFICIENTS + ("weights_s",)
# optional in the roofline and moe forms (0 when absent), written only when not 0
OPTIONAL_COEFFICIENTS = ("comm_per_token_s", "comm_bulk_fixed_s", "comm_bulk_per_token_s")
MOE_COEFFICIENTS = ROOFLINE_COEFFICIENTS + ("expert_weights_s", "expert_per_token_s")
FORMS = ("linear", "roofline", "moe")


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
        first_step_s = self.fixed_s + (self.per_request_s + self.per_token_s) * n + self.per_decode_ctx_s * ctx
        done = _steps_within(first_step_s, self.per_decode_ctx_s * n, t - start)
        return 1 << 30 if done < 0 else self._exact_steps_before(n, ctx, start, t, done)

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
    """A step runs, layer by layer, the linear layers' matrix products (the
    layer's weights read once, `weights_s` in all; 2 x parameters FLOPs a
    scheduled token, `per_token_s`) and the attention (the prefill chunks'
    query-key pairs, compute-bound, `per_prefill_pair_s`; the decode
    requests' KV context read, memory-bound, `per_decode_ctx_s`), plus the
    fixed (`fixed_s`: launch and scheduling) and per-request
    (`per_request_s`) overheads. Each kernel takes the larger of its compute
    and its memory time: the matrix products max(per_token_s x tokens,
    weights_s), so below the ridge point (weights_s / per_token_s tokens) a
    step's tokens ride on the weights' read and a decode batch grows its time
    by its context only; the attention kernels are bound each by one of them.
    `comm_per_token_s` (tensor parallelism) is the all-reduces' bandwidth
    time per token: a separate kernel between the matrix products, so it
    adds to the step whatever bounds them; with a bulk regime
    (`comm_bulk_per_token_s` not 0) a step's all-reduces take the smaller of
    that and `comm_bulk_fixed_s` + `comm_bulk_per_token_s` x tokens
    (`comm_s`)."""
    weights_s: float
    comm_per_token_s: float = field(default=0.0, kw_only=True)
    comm_bulk_fixed_s: float = field(default=0.0, kw_only=True)
    comm_bulk_per_token_s: float = field(default=0.0, kw_only=True)

    form = "roofline"
    coefficients = ROOFLINE_COEFFICIENTS

    def __post_init__(self):
        super().__post_init__()
        for k in OPTIONAL_COEFFICIENTS:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"step-time coefficient {k} must be a non-negative number, got {v!r}")

    def comm_s(self, num_tokens: int) -> float:
        """The all-reduces' time of a step of `num_tokens` tokens."""
        comm = self.comm_per_token_s * num_tokens
        if self.comm_bulk_per_token_s:
            bulk = self.comm_bulk_fixed_s + self.comm_bulk_per_token_s * num_tokens
            if bulk < comm:
                return bulk
        return comm

    def duration(self, num_reqs: int, num_tokens: int, prefill_pairs: float, decode_ctx: float) -> float:
        matmul = self.per_token_s * num_tokens
        if matmul < self.weights_s:
            matmul = self.weights_s
        comm = self.comm_per_token_s * num_tokens        # comm_s inlined: no call on every step
        if self.comm_bulk_per_token_s:
            bulk = self.comm_bulk_fixed_s + self.comm_bulk_per_token_s * num_tokens
            if bulk < comm:
                comm = bulk
        return (self.fixed_s + (self.per_request_s * num_reqs + comm) + matmul
                + self.per_prefill_pair_s * prefill_pairs + self.per_decode_ctx_s * decode_ctx)

    def _first_step_s(self, n: int, ctx: float) -> float:
        """The first of a run of decode-only steps of n requests, context ctx."""
        matmul = self.per_token_s * n
        return (self.fixed_s + self.per_request_s * n + self.comm_s(n)
                + (matmul if matmul > self.weights_s else self.weights_s) + self.per_decode_ctx_s * ctx)

    def scaled(self, factor: float) -> "StepTimeModel":
        return replace(super().scaled(factor), **{k: getattr(self, k) * factor for k in OPTIONAL_COEFFICIENTS})

    def fast_forward_duration(self, num_decode_reqs: int, decode_context: float, num_steps: int) -> float:
        n, m = num_decode_reqs, num_steps
        return m * self._first_step_s(n, decode_context) + self.per_decode_ctx_s * n * (m * (m - 1) / 2.0)

    def fast_forward_steps_before(self, num_decode_reqs: int, decode_context: float, start: float, t: float) -> int:
        n, ctx = num_decode_reqs, decode_context
        done = _steps_within(self._first_step_s(n, ctx), self.per_decode_ctx_s * n, t - start)
        return 1 << 30 if done < 0 else self._exact_steps_before(n, ctx, start, t, done)

    def to_dict(self) -> dict:
        d = {"form": self.form, **asdict(self)}
        for k in OPTIONAL_COEFFICIENTS:
            if not d[k]:
                del d[k]
        return d


@dataclass(frozen=True)
class MoEStepTimeModel(RooflineStepTimeModel):
    """The roofline of a mixture-of-experts model. Each MoE layer routes every
    token to `experts_per_token` of its `experts` experts; a step reads the
    weights of the experts its tokens route to, whose expected share under
    uniform top-k routing of n tokens is 1 - (1 - k/E)^n: a decode step of a
    few requests reads a few experts, a prefill chunk all of them. n is the
    step's tokens as vLLM runs them: a step of up to `GRAPH_MAX_TOKENS`
    tokens runs in the CUDA graph captured for the next size up
    (`graph_tokens`), and its padding rows pass through the router and the
    experts like the real ones (a decode step of 11 runs as 16: a share of
    0.64 of 16 experts, not 0.51). The
    dense matrix products (attention, shared experts, LM head) take
    max(per_token_s x tokens, weights_s) and the experts' grouped GEMMs,
    kernels of their own, max(expert_per_token_s x tokens, expert_weights_s
    x that share): a prefill chunk whose experts ride on their weights' read
    still pays its dense layers' compute."""
    expert_weights_s: float
    expert_per_token_s: float
    experts: int
    experts_per_token: int

    form = "moe"
    coefficients = MOE_COEFFICIENTS

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.experts, int) and isinstance(self.experts_per_token, int)
                and 1 <= self.experts_per_token <= self.experts):
            raise ValueError(f"step_time.experts and experts_per_token must be whole numbers with "
                             f"1 <= experts_per_token <= experts, got {self.experts!r}, {self.experts_per_token!r}")

    def experts_read_s(self, num_tokens: int) -> float:
        """The experts' weights a step of `num_tokens` tokens reads (the share
        they route to, routed as the CUDA graph it runs in pads them: `graph_tokens`)."""
        missed = (1.0 - self.experts_per_token / self.experts) ** graph_tokens(num_tokens)
        return self.expert_weights_s * (1.0 - missed)

    def matmul_s(self, num_tokens: int) -> float:
        """The matrix products of a step: the dense ones and the experts', each the larger of compute and memory."""
        dense, experts = self.per_token_s * num_tokens, self.expert_per_token_s * num_tokens
        read = self.experts_read_s(num_tokens)
        return max(dense, self.weights_s) + max(experts, read)

    def duration(self, num_reqs: int, num_tokens: int, prefill_pairs: float, decode_ctx: float) -> float:
        return (self.fixed_s + (self.per_request_s * num_reqs + self.comm_s(num_tokens)) + self.matmul_s(num_tokens)
                + self.per_prefill_pair_s * prefill_pairs + self.per_decode_ctx_s * decode_ctx)

    def _first_step_s(self, n: int, ctx: float) -> float:
        return (self.fixed_s + self.per_request_s * n + self.comm_s(n) + self.matmul_s(n)
                + self.per_decode_ctx_s * ctx)


# vLLM's default CUDA graph sizes (V1): 1, 2, 4, then every 8 to 256 and every 16 to min(2 x max_num_seqs,
# 512); a step of more tokens runs without a graph, unpadded. The largest is taken as 512 for every engine: a
# smaller max_num_seqs ends the graphs sooner, which changes nothing past 256 tokens, where every expert is read
GRAPH_MAX_TOKENS = 512


def graph_tokens(n: int) -> int:
    """The tokens a step of `n` runs as: the CUDA graph size it is padded to."""
    if n <= 4 or n > GRAPH_MAX_TOKENS:
        return n if n != 3 else 4
    step = 8 if n <= 256 else 16
    return -(-n // step) * step


ROUTING = ("experts", "experts_per_token")      # a MoE model's routing: whole numbers, not coefficients


def step_time_model(d: dict) -> StepTimeModel:
    """The model of a profile's `step_time` object: `form` (default linear)
    and its coefficients (`StepTimeModel.coefficients`), as floats; a MoE
    model's routing (`ROUTING`) as whole numbers."""
    form = d.get("form", "linear")
    if form not in FORMS:
        raise ValueError(f"step_time.form must be one of {', '.join(FORMS)}, got {form!r}")
    cls = FORM_MODELS[form]
    routing = {k: d[k] for k in ROUTING} if form == "moe" else {}
    optional = {k: float(d.get(k, 0.0)) for k in OPTIONAL_COEFFICIENTS} if form != "linear" else {}
    return cls(**{k: float(d[k]) for k in cls.coefficients}, **routing, **optional)


FORM_MODELS = {"linear": StepTimeModel, "roofline": RooflineStepTimeModel, "moe": MoEStepTimeModel}


def _steps_within(first_step_s: float, growth_s: float, room: float) -> int:
    """About how many steps, the i-th (from 0) taking first_step_s + i x
    growth_s, end within `room` seconds, at most 2**30; -1 when steps take
    no time (all of them end before any time)."""
    # the i-th step ends at cum(i) = i * first_step_s + growth_s * i * (i - 1) / 2
    if room <= 0:
        return 0
    if growth_s > 0:
        half = first_step_s - growth_s / 2
        return min(int((-half + math.sqrt(half ** 2 + 2 * growth_s * room)) / growth_s), 1 << 30)
    if first_step_s > 0:
        return min(int(room / first_step_s), 1 << 30)
    return -1                   # steps take no time


def prefill_pairs(q: int, ctx_before: int) -> float:
    """Query-key pairs of a causal prefill chunk of q tokens after ctx_before."""
    return q * (ctx_before + (q + 1) / 2.0)

