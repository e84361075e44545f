"""Time a decoder's engine steps with random weights in plain PyTorch, and
write a steps file that `llmsim calibrate fit` fits (a GPU step-time prior
grounded in measured kernels, for machines without vLLM).

What it builds: ``--layers`` decoder layers (default 2) of the model's shape
with random weights (no checkpoint): RMSNorm, a fused q/k/v projection (with
bias, as Qwen2) and the output projection with grouped-query attention
(``kv_heads``), attention over a per-request KV cache, a gated SiLU MLP and
the residuals; plus the token embedding, the final norm and the LM head with
a greedy pick, the head only on the last token of each request (as vLLM
computes logits). A step is a flat batch of tokens through the linear layers;
attention is per request: a prefill chunk of q tokens after c cached ones is
causal with offset (``scaled_dot_product_attention`` with a lower-right
causal mask, GQA native), the chunk's keys and values written into the cache
first; decodes of equal context are batched, the query heads of one KV head
folded into the query length (as decode kernels do). The time of the timed
layers is scaled to the model's full layer count; embedding and head are
timed once:  duration = embed + layers * (L / timed layers) + head.

What it does not model: vLLM's paged KV cache and block tables (contiguous
tensors here), its attention and fused kernels (FlashAttention/FlashInfer,
fused RMSNorm+residual, SiLU-and-mul), rotary embeddings, CUDA graphs (so
small decode steps here carry eager launch overhead vLLM partly avoids),
tensor parallelism, sampling beyond argmax, the scheduler's and the
input preparation's CPU time, and the overlap of CPU work with the GPU in
async scheduling. The fit's fixed and per-request terms therefore describe
this harness, not a served engine; the token, attention and decode-context
terms are the physically grounded part.

Grid (cells of the paper workload: 12,000-token prompts, an 8,192-token step
budget, up to ~100 running requests of ~12k context): decode-only batches of
n requests at context L, prefill chunks of q tokens after c cached tokens,
and mixed steps of n decodes plus one prefill chunk. Every length scales with
``--max-batched-tokens`` (default 8192 on cuda, 1024 on cpu, the CPU
engine's), so the same grid shrinks for a tiny model on a CPU. Cells whose KV
cache the engine could not hold (``kv_cache_tokens``), longer than
``--max-model-len`` or with more than ``--max-num-seqs`` requests are left
out; on CUDA a cell whose tensors would not fit in free memory is skipped and
logged. Each cell: warm-up runs, then ``--repeats`` timed runs (CUDA events
on cuda, perf_counter on cpu), one row per run; the median is logged.

Output: the steps-file format of ``calibrate/capture.py`` (first line
``{"meta": {...}}``, then one JSON row per step), written cell by cell; on
Ctrl-C or SIGTERM the finished cells are kept (meta ``"complete": false``) and
it exits 130.

How to use it on a GPU (one H200, PyTorch there, no vLLM needed; the full
grid for Qwen2.5-7B takes a few minutes with the default 2 layers)::

    PYTHONUNBUFFERED=1 python -m calibrate.torch_steps --model qwen2.5-7b --gpu h200 --device cuda \\
        --grid full --out $OUT/h200-steps.jsonl

then, on a machine with this project installed::

    llmsim calibrate fit h200-steps.jsonl --name qwen2.5-7b-h200-torch -o qwen2.5-7b-h200-torch.json

(``calibrate fit`` runs the capacity protocol on the simulator with
the paper workload for steps timed on cuda, with the scaled-down CPU scenario
otherwise; ``--capacity-scenario`` chooses.)

Needs only torch, the standard library, ``calibrate.prior`` and
``sim.engine.step_time`` (both standard-library only).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

from calibrate.prior import GPUS, MODELS, ModelShape, kv_cache, shape_from_config
from sim.engine.step_time import prefill_pairs  # stdlib only, like calibrate.prior
from validate.machine import describe as describe_machine

GiB = 1024 ** 3
PAPER_PROMPT = 12000            # the paper workload's mean prompt length
PAPER_BUDGET = 8192             # the published figures' chunked-prefill step budget
BLOCK_SIZE = 16
CPU_KV_SPACE = 2 * GiB         # the CPU engine's VLLM_CPU_KVCACHE_SPACE (validate/engine.py)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class StepsError(Exception):
    """A one-line reason to stop (exit 2)."""


# ------------------------------------------------------------------ grid (no torch)
@dataclasses.dataclass(frozen=True)
class Cell:
    """One engine-step composition: prefill chunks (q, ctx_before) and decode
    groups (n requests, each with ctx_before tokens of context)."""
    label: str
    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[tuple[int, int], ...] = ()

    @property
    def num_reqs(self) -> int:
        return len(self.prefill) + sum(n for n, _ in self.decode)

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.prefill) + sum(n for n, _ in self.decode)

    @property
    def kv_tokens(self) -> int:
        """KV cache slots the step's requests hold once it has run."""
        return sum(q + c for q, c in self.prefill) + sum(n * (ctx + 1) for n, ctx in self.decode)

    @property
    def max_len(self) -> int:
        return max([q + c for q, c in self.prefill] + [ctx + 1 for _, ctx in self.decode] + [0])


def _decode(n: int, ctx: int) -> Cell:
    return Cell(f"decode n={n} L={ctx}", decode=((n, ctx),))


def _prefill(q: int, c: int) -> Cell:
    return Cell(f"prefill q={q} c={c}", prefill=((q, c),))


def _mixed(n: int, ctx: int, q: int, c: int) -> Cell:
    return Cell(f"mixed n={n} L={ctx} q={q} c={c}", prefill=((q, c),), decode=((n, ctx),))


def make_grid(kind: str = "full", budget: int = PAPER_BUDGET, max_model_len: int = 32768,
              max_num_seqs: int = 256, kv_tokens: int | None = None) -> list[Cell]:
    """The grid's cells, lengths scaled by budget / 8192, in timing order
    (prefill, decode, mixed), without cells the engine could not form."""
    s = budget / PAPER_BUDGET

    def L(x: float) -> int:
        return max(16, int(round(x * s)))

    prompt = L(PAPER_PROMPT)
    rest = prompt - budget                         # the second chunk of a prompt after a full first one
    if kind == "full":
        pq = sorted({L(256), L(1024), L(2048), rest, budget})
        pc = [0, L(4096), budget]
        dn, dl = [1, 8, 32, 64, 100, 128, 256], sorted({L(1024), L(4096), prompt, L(16384)})
        mixed = [(n, prompt, budget - n, 0) for n in (8, 32, 64, 100, 200)]
        mixed += [(n, prompt, min(rest, budget - n), budget) for n in (8, 32, 64, 100, 200)]
        mixed += [(64, prompt, L(512), L(4096))]
    elif kind == "quick":
        pq, pc = [L(512), L(2048), budget], [0, budget]
        dn, dl = [1, 4, 16, 32], [L(2048), prompt]
        mixed = [(n, prompt, L(2048), 0) for n in (4, 16)]
    else:
        raise ValueError(f"unknown grid {kind!r} (quick, full)")
    cells = [_prefill(q, c) for c in pc for q in pq]
    cells += [_decode(n, ctx) for ctx in dl for n in dn]
    cells += [_mixed(*m) for m in mixed]
    return [c for c in cells
            if c.num_reqs <= max_num_seqs and c.num_tokens <= budget and c.max_len <= max_model_len
            and (kv_tokens is None or c.kv_tokens <= kv_tokens)]


def step_row(cell: Cell, duration_s: float, repeat: int = 0, **extra) -> dict:
    """One steps-file row (the keys of calibrate/capture.py's rows)."""
    chunks = [[q, c] for q, c in cell.prefill]
    return {"i": extra.pop("i", None), "duration_s": duration_s, "phase": cell.label, "repeat": repeat,
            "num_reqs": cell.num_reqs, "num_tokens": cell.num_tokens,
            "prefill_reqs": len(chunks), "prefill_tokens": sum(q for q, _ in chunks),
            "prefill_ctx": sum(c for _, c in chunks),
            "prefill_pairs": sum(prefill_pairs(q, c) for q, c in chunks), "prefill_chunks": chunks,
            "decode_reqs": sum(n for n, _ in cell.decode), "decode_tokens": sum(n for n, _ in cell.decode),
            "decode_ctx": sum(n * ctx for n, ctx in cell.decode), **extra}


def scaled_duration(embed_s: float, layers_s: float, head_s: float, timed_layers: int, layers: int) -> float:
    return embed_s + layers_s * layers / timed_layers + head_s


def cpu_kv_tokens(shape: ModelShape, space: int = CPU_KV_SPACE, block: int = BLOCK_SIZE) -> int:
    """KV tokens of a CPU engine with `space` bytes of KV cache."""
    return space // (shape.kv_bytes_per_token * block) * block


def build_meta(shape_name: str, shape: ModelShape, grid_kind: str, cells: list[Cell], *, kv_tokens: int,
               budget: int, max_num_seqs: int, max_model_len: int, timed_layers: int, torch_version: str,
               hardware: dict, device: str, dtype: str, repeats: int, warmup: int, attention: str = "") -> dict:
    return {"engine": {"kind": "torch", "kv_cache_tokens": int(kv_tokens), "version": torch_version,
                       "model": shape_name,
                       "flags": {"block-size": BLOCK_SIZE, "max-num-batched-tokens": budget,
                                 "max-num-seqs": max_num_seqs, "max-model-len": max_model_len}},
            "hardware": hardware, "device": device, "dtype": dtype,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "grid": {"kind": grid_kind, "cells": [c.label for c in cells], "repeats": repeats, "warmup": warmup},
            "steps": 0, "complete": False,
            "model_shape": dataclasses.asdict(shape), "layers": shape.layers, "timed_layers": timed_layers,
            "attention": attention,
            "duration": "embed + timed layers * layers / timed_layers + final norm and LM head, per step",
            "source": {"kind": "grid", "timer": "calibrate/torch_steps.py: random-weight PyTorch forward passes, "
                                                "not a vLLM engine"}}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------ model (torch)
class DummyDecoder:
    """`timed_layers` decoder layers of `shape` with random weights."""

    def __init__(self, torch, shape: ModelShape, timed_layers: int, dtype, device):
        self.t, self.F, self.shape, self.dtype, self.device = torch, torch.nn.functional, shape, dtype, device
        h, hd = shape.hidden, shape.head_dim
        qkv = (shape.heads + 2 * shape.kv_heads) * hd

        def w(*size, std=0.02):
            return torch.empty(*size, dtype=dtype, device=device).normal_(0.0, std)

        self.embed = w(shape.vocab, h)
        self.layers = [{"ln1": torch.ones(h, dtype=dtype, device=device), "wqkv": w(qkv, h), "bqkv": w(qkv),
                        "wo": w(h, shape.heads * hd), "ln2": torch.ones(h, dtype=dtype, device=device),
                        "wgu": w(2 * shape.intermediate, h), "wd": w(h, shape.intermediate)}
                       for _ in range(timed_layers)]
        self.norm = torch.ones(h, dtype=dtype, device=device)
        self.lm_head = w(shape.vocab, h)
        self.group = shape.heads // shape.kv_heads
        self.gqa = self._probe_gqa()

    def _probe_gqa(self) -> bool:
        """Whether sdpa takes enable_gqa (torch >= 2.5); else K/V are repeated."""
        t = self.t
        q = t.zeros(1, 2, 1, 8, dtype=self.dtype, device=self.device)
        kv = t.zeros(1, 1, 1, 8, dtype=self.dtype, device=self.device)
        try:
            self.F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            return True
        except TypeError:
            return False

    def _rms(self, x, w):
        x32 = x.float()
        return (x32 * self.t.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    def cache(self, cell: Cell) -> list:
        """Per timed layer, per request group: (K, V) of shape (n, kv_heads, len, head_dim)."""
        s = self.shape

        def kv(n, length):
            return [self.t.empty(n, s.kv_heads, length, s.head_dim, dtype=self.dtype,
                                 device=self.device).normal_() for _ in range(2)]
        return [([kv(1, q + c) for q, c in cell.prefill], [kv(n, ctx + 1) for n, ctx in cell.decode])
                for _ in self.layers]

    def _prefill_attn(self, q, k_new, v_new, K, V, c):
        F, s = self.F, self.shape
        ql = q.shape[0]
        K[0, :, c:c + ql] = k_new.view(ql, s.kv_heads, s.head_dim).transpose(0, 1)
        V[0, :, c:c + ql] = v_new.view(ql, s.kv_heads, s.head_dim).transpose(0, 1)
        qq = q.view(ql, s.heads, s.head_dim).transpose(0, 1).unsqueeze(0)
        Kc, Vc = K[:, :, :c + ql], V[:, :, :c + ql]
        if not self.gqa:
            Kc, Vc = Kc.repeat_interleave(self.group, 1), Vc.repeat_interleave(self.group, 1)
        kw = {"enable_gqa": True} if self.gqa else {}
        mask = {"is_causal": True}
        if c:
            from torch.nn.attention.bias import causal_lower_right
            mask = {"attn_mask": causal_lower_right(ql, c + ql)}
        try:
            o = F.scaled_dot_product_attention(qq, Kc, Vc, **mask, **kw)
        except RuntimeError as e:
            if not self.gqa:
                raise
            self.gqa = False                  # a backend without GQA: repeat K/V from now on
            _say(f"sdpa with enable_gqa failed ({str(e).splitlines()[0][:120]}); repeating K/V instead")
            return self._prefill_attn(q, k_new, v_new, K, V, c)
        return o[0].transpose(0, 1).reshape(ql, s.heads * s.head_dim)

    def _decode_attn(self, q, k_new, v_new, K, V, ctx):
        s = self.shape
        n = q.shape[0]
        K[:, :, ctx] = k_new.view(n, s.kv_heads, s.head_dim)
        V[:, :, ctx] = v_new.view(n, s.kv_heads, s.head_dim)
        # head h reads KV head h // group: fold the group into the query length
        qq = q.view(n, s.kv_heads, self.group, s.head_dim)
        o = self.F.scaled_dot_product_attention(qq, K, V)
        return o.reshape(n, s.heads * s.head_dim)

    def _layer(self, x, p, cache, cell: Cell):
        t, F, s = self.t, self.F, self.shape
        qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        qkv = F.linear(self._rms(x, p["ln1"]), p["wqkv"], p["bqkv"])
        q, k, v = qkv[:, :qd], qkv[:, qd:qd + kd], qkv[:, qd + kd:]
        out = t.empty(x.shape[0], qd, dtype=x.dtype, device=x.device)
        pre, dec = cache
        off = 0
        for (ql, c), (K, V) in zip(cell.prefill, pre):
            out[off:off + ql] = self._prefill_attn(q[off:off + ql], k[off:off + ql], v[off:off + ql], K, V, c)
            off += ql
        for (n, ctx), (K, V) in zip(cell.decode, dec):
            out[off:off + n] = self._decode_attn(q[off:off + n], k[off:off + n], v[off:off + n], K, V, ctx)
            off += n
        x = x + F.linear(out, p["wo"])
        g, u = F.linear(self._rms(x, p["ln2"]), p["wgu"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, p["wd"])

    def last_tokens(self, cell: Cell):
        idx, off = [], 0
        for ql, _ in cell.prefill:
            off += ql
            idx.append(off - 1)
        for n, _ in cell.decode:
            idx.extend(range(off, off + n))
            off += n
        return self.t.tensor(idx, dtype=self.t.long, device=self.device)

    def step(self, cell: Cell, ids, last, cache, mark):
        """One forward pass; mark() is called between embedding, layers and head."""
        m0 = mark()
        x = self.embed[ids]
        m1 = mark()
        for p, c in zip(self.layers, cache):
            x = self._layer(x, p, c, cell)
        m2 = mark()
        logits = self.F.linear(self._rms(x[last], self.norm), self.lm_head)
        logits.argmax(-1)
        m3 = mark()
        return m0, m1, m2, m3

    def bytes_needed(self, cell: Cell) -> int:
        """Rough upper bound of the tensors a cell allocates (KV, activations, a mask)."""
        s = self.shape
        b = s.dtype_bytes
        kv = 2 * len(self.layers) * cell.kv_tokens * s.kv_heads * s.head_dim * b
        act = cell.num_tokens * (6 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim
                                 + 3 * s.intermediate) * b
        mask = sum(q * (q + c) for q, c in cell.prefill)
        return kv + act + mask + cell.num_reqs * s.vocab * 4


class Clock:
    """Marks and elapsed seconds: CUDA events on cuda, perf_counter on cpu."""

    def __init__(self, torch, device: str):
        self.t, self.cuda = torch, device == "cuda"

    def mark(self):
        if self.cuda:
            e = self.t.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            self.t.cuda.synchronize()

    def between(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


def time_cell(model: DummyDecoder, clock: Clock, cell: Cell, repeats: int, warmup: int) -> list[tuple]:
    """(embed_s, layers_s, head_s) for each timed run of the cell."""
    t = model.t
    ids = t.randint(3, model.shape.vocab, (cell.num_tokens,), device=model.device)
    last = model.last_tokens(cell)
    cache = model.cache(cell)
    out = []
    with t.inference_mode():
        for k in range(warmup + repeats):
            clock.sync()
            marks = model.step(cell, ids, last, cache, clock.mark)
            clock.sync()
            if k >= warmup:
                out.append(tuple(clock.between(a, b) for a, b in zip(marks, marks[1:])))
    del cache
    return out


# ------------------------------------------------------------------ command
def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_shape(model: str | None, config: str | None) -> tuple[str, ModelShape]:
    if config:
        try:
            cfg = json.loads(Path(config).read_text())
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
            name = model or Path(config).resolve().parent.name
            return name, shape_from_config(cfg, name=name)
        except (OSError, ValueError) as e:
            raise StepsError(f"cannot read model config {config}: {e}") from None
    if not model:
        raise StepsError(f"give --model ({', '.join(sorted(MODELS))}) or --config config.json")
    if model not in MODELS:
        raise StepsError(f"unknown model {model!r}; valid: {', '.join(sorted(MODELS))} (or --config config.json)")
    return model, MODELS[model]


class _Writer:
    """The steps file, appended cell by cell, rewritten with the final meta."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta, self.rows = path, meta, []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w")
        self.f.write(json.dumps({"meta": meta}) + "\n")
        self.f.flush()

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            r["i"] = len(self.rows)
            self.rows.append(r)
            self.f.write(json.dumps(r) + "\n")
        self.f.flush()

    def close(self, **final) -> None:
        self.f.close()
        self.meta.update(final, steps=len(self.rows))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"meta": self.meta}) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        os.replace(tmp, self.path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m calibrate.torch_steps",
                                description="Time a model shape's engine steps with random weights in PyTorch "
                                            "and write a steps file for `llmsim calibrate fit`.")
    p.add_argument("--model", default=None, help=f"model shape: {', '.join(sorted(MODELS))} "
                                                 "(with --config: the name to record)")
    p.add_argument("--config", default=None, help="a Hugging Face config.json giving the shape instead")
    p.add_argument("--out", "-o", required=True, help="steps file (JSONL)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                   help="GPU whose KV cache size (calibrate.prior.kv_cache) the profile gets, on cuda")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="the engine's KV cache size in tokens (default: --gpu's on cuda, 2 GiB on cpu)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers to build and time")
    p.add_argument("--grid", choices=("quick", "full"), default="full")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3 quick, 5 full)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="step token budget; grid lengths scale with it (default 8192 on cuda, 1024 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=32768)
    return p


def attention(model: DummyDecoder) -> str:
    return ("sdpa; prefill GQA native (enable_gqa)" if model.gqa else "sdpa; prefill K/V repeated per query head") \
        + "; decode query heads folded per KV head"


def run(a) -> int:
    name, shape = resolve_shape(a.model, a.config)
    dtype_name = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    shape = dataclasses.replace(shape, dtype_bytes=DTYPE_BYTES[dtype_name])
    budget = a.max_batched_tokens or (PAPER_BUDGET if a.device == "cuda" else 1024)
    timed = max(1, min(a.layers, shape.layers))
    repeats = a.repeats or (3 if a.grid == "quick" else 5)
    if a.kv_tokens:
        kv_tokens = a.kv_tokens
    elif a.device == "cuda":
        try:
            kv_tokens = kv_cache(shape, GPUS[a.gpu], block_size=BLOCK_SIZE)["kv_tokens"]
        except ValueError as e:
            raise StepsError(f"{e}; give --kv-tokens") from None
    else:
        kv_tokens = cpu_kv_tokens(shape)
    cells = make_grid(a.grid, budget, a.max_model_len, a.max_num_seqs, kv_tokens)
    if not cells:
        raise StepsError("no grid cell fits these limits (--max-batched-tokens, --kv-tokens, --max-num-seqs)")
    try:
        import torch
    except ImportError:
        raise StepsError(f"no PyTorch in this Python ({sys.executable}); calibrate.torch_steps needs "
                         "PyTorch (torch)") from None
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise StepsError(f"--device cuda, but this PyTorch ({torch.__version__}, {sys.executable}) sees no "
                             "CUDA device; use --device cpu")
        hardware = {"device": torch.cuda.get_device_name(0), "memory_bytes": torch.cuda.mem_get_info()[1],
                    "cuda": torch.version.cuda}
    else:
        hardware = {"device": _cpu_name(), "machine": platform.machine(), "threads": torch.get_num_threads()}
    hardware = {**describe_machine(), **hardware}
    device = torch.device(a.device)
    dtype = getattr(torch, dtype_name)
    t0 = time.monotonic()
    torch.manual_seed(0)
    model = DummyDecoder(torch, shape, timed, dtype, device)
    clock = Clock(torch, a.device)
    _say(f"{name}: {timed} of {shape.layers} layers, {dtype_name} on {hardware['device']}, "
         f"{len(cells)} cells x {repeats} runs (+{a.warmup} warm-up), KV {kv_tokens} tokens "
         f"(built in {time.monotonic() - t0:.1f} s)")
    meta = build_meta(name, shape, a.grid, cells, kv_tokens=kv_tokens, budget=budget,
                      max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, timed_layers=timed,
                      torch_version=torch.__version__, hardware=hardware, device=a.device, dtype=dtype_name,
                      repeats=repeats, warmup=a.warmup,
                      attention=attention(model))
    try:
        out = _Writer(Path(a.out), meta)
    except OSError as e:
        raise StepsError(f"cannot write {a.out}: {e}") from None
    skipped = []

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)            # `timeout` and job limits end it like Ctrl-C
    try:
        time_cell(model, clock, min(cells, key=lambda c: c.kv_tokens), 1, a.warmup)   # first-call set-up, untimed
        for k, cell in enumerate(cells, 1):
            if a.device == "cuda":
                free = torch.cuda.mem_get_info()[0]
                need = model.bytes_needed(cell)
                if need > 0.9 * free:
                    skipped.append(cell.label)
                    _say(f"[{k}/{len(cells)}] {cell.label}: skipped, needs ~{need / GiB:.1f} GiB of "
                         f"{free / GiB:.1f} GiB free")
                    continue
            try:
                runs = time_cell(model, clock, cell, repeats, a.warmup)
            except RuntimeError as e:            # out of memory, a kernel this backend lacks
                if a.device != "cuda":
                    raise
                skipped.append(cell.label)
                torch.cuda.empty_cache()
                _say(f"[{k}/{len(cells)}] {cell.label}: skipped, {str(e).splitlines()[0][:160]}")
                continue
            rows = [step_row(cell, scaled_duration(e, lay, h, timed, shape.layers), r, embed_s=e,
                             timed_layers_s=lay, head_s=h) for r, (e, lay, h) in enumerate(runs)]
            med = statistics.median(r["duration_s"] for r in rows)
            for r in rows:
                r["cell_median_s"] = med
            out.add(rows)
            _say(f"[{k}/{len(cells)}] {cell.label}: {1e3 * med:.2f} ms median step "
                 f"({len(rows)} runs, {time.monotonic() - t0:.0f} s)")
    except KeyboardInterrupt:
        out.meta["attention"] = attention(model)
        out.close(complete=False, interrupted=True, skipped=skipped, wall_s=time.monotonic() - t0)
        _say(f"interrupted: {len(out.rows)} steps of finished cells kept in {a.out}")
        return 130
    out.meta["attention"] = attention(model)
    if not out.rows:
        out.close(complete=False, skipped=skipped, wall_s=time.monotonic() - t0)
        raise StepsError(f"every cell was skipped ({len(skipped)}); see the log above")
    out.close(complete=True, skipped=skipped, wall_s=time.monotonic() - t0)
    print(f"{len(out.rows)} steps from {len(cells) - len(skipped)} cells in {time.monotonic() - t0:.1f} s "
          f"-> {a.out}")
    return 0


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        return run(a)
    except StepsError as e:
        print(f"torch_steps: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
