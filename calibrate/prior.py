"""The physical step-time model: a prior for the step-time model and the KV
capacity from a model's shape (`calibrate.model_shape`) and a GPU's
datasheet (`calibrate.gpus`), served as vLLM serves it (`Serving`: tensor
parallelism, FP8 weights, CPU weight offload, memory utilization).

Per GPU, with TP the tensor-parallel size (every matrix product split TP
ways, the vocabulary too) and the efficiencies (`mfu`, `bw_eff`, `attn_eff`,
`allreduce_eff`, the overheads):
  weights read    the dense weights' bytes / TP (FP8 weights 1 byte, others the
                  dtype's; the embedding table is looked up, not read)
                  / (bandwidth * bw_eff)
  per_token_s     2 * active params / TP / (peak * mfu), the FP8 share at the FP8
                  peak (a GPU without FP8 runs them at the 16-bit peak: weight-only);
                  a mixture of experts: the dense ones only, its routed experts' apart
                  (expert_per_token_s, the same rule over k experts a MoE layer)
  comm_per_token_s  (TP > 1) 2 all-reduces a layer of hidden x 2 bytes a token, a ring
                  moving 2 (TP-1)/TP of them over the link at allreduce_eff over NVLink,
                  PCIE_ALLREDUCE_EFF over PCIe (the
                  linear form adds it to per_token_s); the roofline forms' bulk
                  regime: past CUSTOM_ALLREDUCE_MAX_BYTES a message (vLLM's custom
                  all-reduce's largest; NCCL beyond) the further tokens at
                  ALLREDUCE_BULK_EFF of the link (comm_bulk_fixed_s,
                  comm_bulk_per_token_s: sim.engine.step_time)
  fixed_s         step_overhead_s + MoE layers x moe_layer_overhead_s (a MoE block's fixed
                  time a step, whatever its batch: routing, top-k, the tokens' alignment by
                  expert, the grouped GEMMs' launches over many small problems, the combine)
                  + 2 layers x the link's all-reduce latency (TP > 1)
                  + offloaded bytes / (host link bandwidth * bw_eff) (`cpu_offload_gb`
                  of weights per GPU cross PCIe every step)
  per_request_s   2 * hidden * vocab / TP / (peak * mfu)   (LM head, sampled token) + request_overhead_s
  per_prefill_pair_s = 4 * layers * heads/TP * head_dim / (peak * attn_eff)   (QK^T and PV per query-key pair)
  per_decode_ctx_s   = KV bytes per token per GPU / (bandwidth * kv_bw_eff)   (paged KV reads: kv_bw_eff,
                       bw_eff unless given)
The linear form (form="linear", dense models) adds the weights' read to
fixed_s; the roofline form (form="roofline") keeps it apart (`weights_s`) and
a step takes the larger of its compute and its memory time; a mixture of
experts takes the moe form (`sim.engine.step_time.MoEStepTimeModel`): its
experts' weights (`expert_weights_s`) read in the share its tokens route to.
The all-reduces are kernels of their own between the matrix products: in
the roofline forms their bandwidth time (`comm_per_token_s`) adds to a step
whatever bounds its matrix products, as their latency (in fixed_s) does.

KV capacity (vLLM's profiling run, per GPU): blocks = floor((memory * utilization
- weights per GPU - activation/graph reserve) / (KV bytes per token per GPU * block size)),
KV heads split TP ways (replicated when TP exceeds them, as vLLM does).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .gpus import CATALOGUE, GPU, GiB, gpu as find_gpu, gpu_key
from .model_shape import MODELS, ModelShape, shape_from_config

GPUS = CATALOGUE
__all__ = ["GPU", "GPUS", "MODELS", "ModelShape", "Serving", "kv_cache", "prior_profile", "shape_from_config",
           "step_time", "gpu_key"]
ALLREDUCE_BYTES = 2         # activations all-reduced in 16 bits
# vLLM's custom all-reduce takes messages up to 8 MiB (CustomAllreduce's max_size,
# vllm/distributed/device_communicators/custom_all_reduce.py); larger ones go to NCCL, whose ring reaches most
# of the link's bandwidth (nccl-tests' bus bandwidth at large sizes): an assumption, not fitted, since the
# measurements' prefills are prefix-cached and their all-reduces small
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024
ALLREDUCE_BULK_EFF = 0.8
# over PCIe the link itself bounds a decode step's all-reduces: NCCL's ring moved 128-384 kB messages at 0.76 of
# a PCIe Gen3 x16 link (bus bandwidth, 4 V100s behind one PCIe switch, inside CUDA graphs:
# haohervchb/sglang-V100#2), where over NVLink vLLM's custom all-reduce reaches a tenth of the link
# (`allreduce_eff`, fitted on H100s: only NVLink in the handed data); an assumption, not fitted
PCIE_ALLREDUCE_EFF = 0.75


@dataclass(frozen=True)
class Serving:
    """How vLLM serves the model (its flags of the same names)."""
    tensor_parallel_size: int = 1
    cpu_offload_gb: float = 0.0          # GiB of weights per GPU kept in CPU memory
    gpu_memory_utilization: float = 0.9

    def check(self, shape: ModelShape) -> list[str]:
        """ValueError where vLLM would refuse the split; the notes of what it does instead."""
        tp = self.tensor_parallel_size
        if not (isinstance(tp, int) and tp >= 1):
            raise ValueError(f"tensor_parallel_size must be a whole number of at least 1, got {tp!r}")
        if shape.heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {shape.heads} attention heads "
                             f"of {shape.name} (vLLM requires it)")
        if shape.kv_heads >= tp and shape.kv_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {shape.kv_heads} KV heads of "
                             f"{shape.name} (vLLM requires it)")
        if shape.kv_heads < tp and tp % shape.kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the {shape.kv_heads} KV heads of "
                             f"{shape.name} (vLLM replicates KV heads only then)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be at least 0, got {self.cpu_offload_gb!r}")
        if shape.kv_heads < tp:
            return [f"{shape.kv_heads} KV heads on {tp} GPUs: each GPU holds a replica of one (vLLM's rule)"]
        return []

    def kv_heads_per_gpu(self, shape: ModelShape) -> int:
        return max(1, shape.kv_heads // self.tensor_parallel_size)


def _per_gpu(shape: ModelShape, serving: Serving) -> dict:
    """Bytes per GPU: the weights held, the dense weights read a step, the
    experts' weights, the offloaded bytes, the KV cache's bytes a token."""
    tp = serving.tensor_parallel_size
    held = shape.weight_bytes / tp
    offload = serving.cpu_offload_gb * GiB
    if offload > held:
        raise ValueError(f"cpu_offload_gb {serving.cpu_offload_gb:g} exceeds the {held / GiB:.1f} GiB of weights "
                         f"per GPU of {shape.name} on {tp} GPU(s)")
    dense = sum(shape.group_bytes(g) for g in ("lm_head", "attention", "mlp", "shared", "router"))
    return {"held": held - offload, "offload": offload, "dense_read": dense / tp,
            "experts_read": shape.group_bytes("experts") / tp,
            "kv_per_token": 2 * shape.layers * serving.kv_heads_per_gpu(shape) * shape.head_dim * shape.dtype_bytes}


def kv_cache(shape: ModelShape, gpu: GPU, utilization: float = 0.9, block_size: int = 16,
             reserve_bytes: int = int(2.5 * GiB), serving: Serving | None = None) -> dict:
    """vLLM's KV sizing, step by step, per GPU (every GPU holds every
    block's share of the KV heads, so the engine's blocks are one GPU's)."""
    serving = serving or Serving(gpu_memory_utilization=utilization)
    per = _per_gpu(shape, serving)
    budget = gpu.memory_bytes * utilization
    tp = serving.tensor_parallel_size
    on = f"{gpu.name}" + (f" x {tp}" if tp > 1 else "")
    if per["held"] > budget:
        raise ValueError(f"{shape.name} does not fit: {per['held'] / GiB:.1f} GiB of weights per GPU on {on}, "
                         f"which holds {budget / GiB:.1f} GiB at gpu_memory_utilization {utilization:g}")
    kv_bytes = budget - per["held"] - reserve_bytes
    per_block = per["kv_per_token"] * block_size
    if kv_bytes < per_block:
        raise ValueError(f"{shape.name} fits on {on} but leaves no memory for the KV cache at "
                         f"gpu_memory_utilization {utilization:g} ({per['held'] / GiB:.1f} GiB of weights and "
                         f"{reserve_bytes / GiB:.1f} GiB of activations per GPU of {budget / GiB:.1f} GiB)")
    blocks = int(kv_bytes // per_block)
    return {"gpu_memory_bytes": gpu.memory_bytes, "utilization": utilization,
            "weights_bytes": int(per["held"]), "reserve_bytes": reserve_bytes,
            "kv_bytes": int(kv_bytes), "kv_bytes_per_token": per["kv_per_token"],
            "block_size": block_size, "bytes_per_block": per_block, "num_gpu_blocks": blocks,
            "kv_tokens": blocks * block_size, "tensor_parallel_size": tp,
            "formula": "floor((memory*utilization - weights per GPU - reserve)"
                       " / (2*layers*kv_heads per GPU*head_dim*dtype_bytes*block_size))"}


def step_time(shape: ModelShape, gpu: GPU, mfu: float, bw_eff: float, attn_eff: float | None = None,
              step_overhead_s: float = 0.002, request_overhead_s: float = 2e-5, form: str = "linear",
              serving: Serving | None = None, allreduce_eff: float = 0.7, kv_bw_eff: float | None = None,
              moe_bw_eff: float | None = None, moe_layer_overhead_s: float = 0.0) -> dict:
    """The step-time coefficients of the module docstring, as a profile's
    `step_time` object."""
    serving = serving or Serving()
    if shape.experts and form != "moe":
        raise ValueError(f"{shape.name} is a mixture of experts: its step time takes form moe, not {form}")
    if form not in ("linear", "roofline", "moe"):
        raise ValueError(f"form must be linear, roofline or moe, got {form!r}")
    if form == "moe" and not shape.experts:
        raise ValueError(f"form moe needs a mixture of experts; {shape.name} is dense")
    attn_eff = mfu if attn_eff is None else attn_eff
    kv_bw_eff = bw_eff if kv_bw_eff is None else kv_bw_eff
    tp, per = serving.tensor_parallel_size, _per_gpu(shape, serving)
    fp8 = gpu.fp8_flops or gpu.peak_flops         # without FP8 tensor cores FP8 weights run at the 16-bit peak

    def compute_s(params: int, share: float) -> float:      # a token's matrix products, `share` of them in FP8
        return 2 * params / tp * (share / fp8 + (1 - share) / gpu.peak_flops) / mfu

    if form == "moe":        # the routed experts' grouped GEMMs are kernels of their own (expert_per_token_s)
        flops_s = compute_s(shape.active_params - shape.routed_params, shape.active_quantized_share(experts=False))
        expert_s = compute_s(shape.routed_params, 1.0 if shape.quantized("experts") else 0.0)
    else:
        flops_s = compute_s(shape.active_params, shape.active_quantized_share())
    allreduce_s, latency_s = 0.0, 0.0
    bulk = {}
    if tp > 1:
        ring_bytes = 2 * shape.layers * 2 * (tp - 1) / tp * shape.hidden * ALLREDUCE_BYTES   # a token, a step
        eff = allreduce_eff if gpu.link.startswith("NVLink") else PCIE_ALLREDUCE_EFF
        allreduce_s = ring_bytes / (gpu.link_bandwidth * eff)
        latency_s = 2 * shape.layers * gpu.allreduce_latency_s
        bulk_s = ring_bytes / (gpu.link_bandwidth * ALLREDUCE_BULK_EFF)
        if bulk_s < allreduce_s:     # past the custom all-reduce's largest message: NCCL's rate
            knee = CUSTOM_ALLREDUCE_MAX_BYTES / (shape.hidden * ALLREDUCE_BYTES)
            bulk = {"comm_bulk_fixed_s": (allreduce_s - bulk_s) * knee, "comm_bulk_per_token_s": bulk_s}
    offload_s = per["offload"] / (gpu.host_bandwidth * bw_eff) if per["offload"] else 0.0
    weights_s = per["dense_read"] / (gpu.bandwidth * bw_eff)
    fixed_s = step_overhead_s + shape.moe_layers * moe_layer_overhead_s + latency_s + offload_s
    out = {
        "fixed_s": fixed_s if form != "linear" else weights_s + fixed_s,
        "per_request_s": 2 * shape.hidden * shape.vocab / tp / (gpu.peak_flops * mfu) + request_overhead_s,
        "per_token_s": flops_s + (allreduce_s if form == "linear" else 0.0),
        "per_prefill_pair_s": 4 * shape.layers * shape.heads / tp * shape.head_dim / (gpu.peak_flops * attn_eff),
        "per_decode_ctx_s": per["kv_per_token"] / (gpu.bandwidth * kv_bw_eff),
    }
    if form == "linear":
        return out
    out = {"form": form, **out, "weights_s": weights_s}
    if allreduce_s:
        out["comm_per_token_s"] = allreduce_s
        out |= bulk
    if form == "moe":
        moe_bw_eff = bw_eff if moe_bw_eff is None else moe_bw_eff
        out |= {"expert_weights_s": per["experts_read"] / (gpu.bandwidth * moe_bw_eff), "expert_per_token_s": expert_s,
                "experts": shape.experts, "experts_per_token": shape.experts_per_token}
    return out


def prior_profile(model: str, gpu: str = "h100", mfu: float = 0.6, bw_eff: float = 0.8,
                  utilization: float = 0.9, block_size: int = 16, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 8192, max_model_len: int = 32768, depth: int = 2,
                  capacity: float = 1.0, serving: Serving | None = None, **kw) -> dict:
    """A profile (a JSON object, `sim.profile`) of `model` (an embedded
    shape's name or a ModelShape) on `gpu` (a catalogue key, a reported name
    or a GPU), served as `serving` says (its memory utilization wins over
    `utilization`); a mixture of experts takes form moe."""
    shape = MODELS[model] if isinstance(model, str) else model
    g = find_gpu(gpu) if isinstance(gpu, str) else gpu
    serving = serving or Serving(gpu_memory_utilization=utilization)
    notes = serving.check(shape)
    if shape.experts:
        kw["form"] = "moe"
    kv = kv_cache(shape, g, serving.gpu_memory_utilization, block_size, serving=serving)
    kv_note = {}
    if shape.vision_params or shape.experts:        # said apart: a scenario that gives its KV cache drops it
        parts = " and ".join(x for x in ("a vision tower's profiling run" if shape.vision_params else "",
                                         "MoE buffers" if shape.experts else "") if x)
        kv_note["kv_note"] = (f"the KV blocks leave {kv['reserve_bytes'] / GiB:.1f} GiB a GPU for activations; "
                              f"{parts} take more (Llama-4-Scout's servers reported 21 % fewer blocks than "
                              f"derived): where the server's log gives its 'GPU KV cache size', give it "
                              f"(llmsim calibrate prior --kv-cache-tokens, a scenario's [engine] kv_cache_tokens)")
    if serving.tensor_parallel_size > 4:
        tp = serving.tensor_parallel_size
        notes.append(f"TP {tp}: the all-reduce rate was fitted on engines of 2 and 4 GPUs and carries more than the "
                     f"kernels' bytes; a loaded step at TP {tp} reads as an upper end (docs/any-model.md)")
    if shape.quantization == "fp8" and not g.fp8_flops:
        notes.append(f"{g.name} has no FP8 tensor cores: FP8 weights are read in 8 bits and multiplied at the "
                     f"16-bit peak (weight-only, as vLLM's Marlin kernels run them)")
    return {
        "name": model if isinstance(model, str) else shape.name,
        "model": asdict(shape),
        "hardware": asdict(g),
        "serving": asdict(serving),
        "engine": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "block_size": block_size, "num_gpu_blocks": kv["num_gpu_blocks"], "depth": depth,
                   "max_model_len": max_model_len},
        "kv_cache": kv,
        "step_time": step_time(shape, g, mfu, bw_eff, serving=serving, **kw),
        "capacity": capacity,
        "provenance": {"kind": "roofline prior", "mfu": mfu, "bw_eff": bw_eff, "notes": notes, **kv_note},
    }
