"""A roofline prior for the step-time model and the KV capacity, from a
model's shape and a GPU's published peak compute and memory bandwidth.

Step time (the linear form of `sim.engine.step_time`):
  fixed_s            = weight bytes / (bandwidth * bw_eff) + step_overhead_s
  per_request_s      = 2 * hidden * vocab / (peak * mfu)   (LM head, sampled token) + request_overhead_s
  per_token_s        = 2 * non-embedding params / (peak * mfu)
  per_prefill_pair_s = 4 * layers * heads * head_dim / (peak * attn_eff)   (QK^T and PV per query-key pair)
  per_decode_ctx_s   = KV bytes per token / (bandwidth * bw_eff)
The roofline form (form="roofline") takes the weights' read out of fixed_s:
  fixed_s            = step_overhead_s
  weights_s          = weight bytes / (bandwidth * bw_eff)
and a step the larger of its compute and its memory time (sim.engine.step_time).

KV capacity (vLLM's profiling run): blocks = floor((total memory * utilization
- weights - activation/graph reserve) / (bytes per token * block size)).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # as the CUDA driver reports it (torch.cuda.mem_get_info total)
    peak_flops: float          # dense bf16/fp16 tensor FLOP/s
    bandwidth: float           # HBM bytes/s


GPUS = {
    # H100 SXM5 80 GB: 989.4 TFLOP/s dense BF16, 3.35 TB/s; the driver reports 79.1 GiB
    "h100": GPU("NVIDIA H100 80GB HBM3 (SXM)", int(79.1 * GiB), 989.4e12, 3.35e12),
    # H200 SXM 141 GB: same compute as H100 SXM, 4.8 TB/s; the driver reports 139.8 GiB
    "h200": GPU("NVIDIA H200 (SXM, 141 GB)", int(139.8 * GiB), 989.4e12, 4.8e12),
    # A100 SXM 80 GB: 312 TFLOP/s dense BF16, 2.039 TB/s; the driver reports 79.2 GiB
    "a100": GPU("NVIDIA A100-SXM4-80GB", int(79.2 * GiB), 312e12, 2.039e12),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int                # total parameters, embeddings included
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def non_embedding_params(self) -> int:
        return self.params - self.embedding_params


MODELS = {
    # Qwen/Qwen2.5-7B-Instruct config.json
    "qwen2.5-7b": ModelShape("Qwen2.5-7B-Instruct", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128,
                             intermediate=18944, vocab=152064, params=7_615_616_512),
    # Qwen/Qwen3-14B config.json
    "qwen3-14b": ModelShape("Qwen3-14B", layers=40, hidden=5120, heads=40, kv_heads=8, head_dim=128,
                            intermediate=17408, vocab=151936, params=14_768_307_200),
    # meta-llama/Llama-3.1-8B-Instruct config.json
    "llama-3.1-8b": ModelShape("Llama-3.1-8B-Instruct", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                               intermediate=14336, vocab=128256, params=8_030_261_248),
}


def kv_cache(shape: ModelShape, gpu: GPU, utilization: float = 0.9, block_size: int = 16,
             reserve_bytes: int = int(2.5 * GiB)) -> dict:
    """vLLM's KV sizing, step by step."""
    budget = gpu.memory_bytes * utilization
    kv_bytes = budget - shape.weight_bytes - reserve_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{shape.name} does not fit on {gpu.name} at utilization {utilization}")
    per_block = shape.kv_bytes_per_token * block_size
    blocks = int(kv_bytes // per_block)
    return {"gpu_memory_bytes": gpu.memory_bytes, "utilization": utilization,
            "weights_bytes": shape.weight_bytes, "reserve_bytes": reserve_bytes,
            "kv_bytes": int(kv_bytes), "kv_bytes_per_token": shape.kv_bytes_per_token,
            "block_size": block_size, "bytes_per_block": per_block, "num_gpu_blocks": blocks,
            "kv_tokens": blocks * block_size,
            "formula": "floor((memory*utilization - weights - reserve)"
                       " / (2*layers*kv_heads*head_dim*dtype_bytes*block_size))"}


def step_time(shape: ModelShape, gpu: GPU, mfu: float, bw_eff: float, attn_eff: float | None = None,
              step_overhead_s: float = 0.002, request_overhead_s: float = 2e-5, form: str = "linear") -> dict:
    attn_eff = mfu if attn_eff is None else attn_eff
    weights_s = shape.weight_bytes / (gpu.bandwidth * bw_eff)
    if form not in ("linear", "roofline"):
        raise ValueError(f"form must be linear or roofline, got {form!r}")
    out = {"form": "roofline"} if form == "roofline" else {}
    return out | {
        "fixed_s": step_overhead_s if form == "roofline" else weights_s + step_overhead_s,
        "per_request_s": 2 * shape.hidden * shape.vocab / (gpu.peak_flops * mfu) + request_overhead_s,
        "per_token_s": 2 * shape.non_embedding_params / (gpu.peak_flops * mfu),
        "per_prefill_pair_s": 4 * shape.layers * shape.heads * shape.head_dim / (gpu.peak_flops * attn_eff),
        "per_decode_ctx_s": shape.kv_bytes_per_token / (gpu.bandwidth * bw_eff),
    } | ({"weights_s": weights_s} if form == "roofline" else {})


def prior_profile(model: str, gpu: str = "h100", mfu: float = 0.6, bw_eff: float = 0.8,
                  utilization: float = 0.9, block_size: int = 16, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 8192, max_model_len: int = 32768, depth: int = 2,
                  capacity: float = 1.0, **kw) -> dict:
    shape = MODELS[model] if isinstance(model, str) else model
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    kv = kv_cache(shape, g, utilization, block_size)
    return {
        "name": model if isinstance(model, str) else shape.name,
        "model": asdict(shape),
        "hardware": asdict(g),
        "engine": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "block_size": block_size, "num_gpu_blocks": kv["num_gpu_blocks"], "depth": depth,
                   "max_model_len": max_model_len},
        "kv_cache": kv,
        "step_time": step_time(shape, g, mfu, bw_eff, **kw),
        "capacity": capacity,
        "provenance": {"kind": "roofline prior", "mfu": mfu, "bw_eff": bw_eff},
    }


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8": 1, "fp8": 1}


def shape_from_config(cfg: dict, name: str | None = None, dtype_bytes: int | None = None) -> ModelShape:
    """A model shape from a Hugging Face ``config.json`` (Llama/Qwen/Mistral
    style decoder). Parameters are counted from the shape: embeddings (and an
    untied LM head), per layer q/k/v/o projections (with q/k/v biases for
    Qwen2), a gated MLP and two RMSNorms, and the final norm."""
    cfg = dict(cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"})
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    miss = [k for k in need if k not in cfg]
    if miss:
        raise ValueError(f"config.json lacks {', '.join(miss)}")
    L, h, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd if bias else 0)
    if cfg.get("model_type") == "qwen3":
        attn += 2 * hd                                  # q_norm and k_norm
    per_layer = attn + 3 * h * inter + 2 * h
    params = L * per_layer + h + vocab * h * (1 if tied else 2)
    if dtype_bytes is None:
        dtype_bytes = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "model")])[0]
    return ModelShape(name or cfg.get("_name_or_path") or arch, layers=L, hidden=h, heads=heads, kv_heads=kv,
                      head_dim=hd, intermediate=inter, vocab=vocab, params=params, dtype_bytes=dtype_bytes,
                      tied_embeddings=tied)
