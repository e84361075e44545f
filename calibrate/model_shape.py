"""A model's shape as the physical step-time model (`calibrate.prior`) needs
it, read from a Hugging Face `config.json` as published (`shape_from_config`):
dense decoders (Llama, Qwen2/3, Mistral, Yi), mixtures of experts (Mixtral,
Qwen-MoE, Llama 4), multimodal checkpoints (the language model's
`text_config`; the vision tower's weights counted for memory, never run
for a text call), and FP8 checkpoints (`quantization_config`, with its
ignore list: which weights stay in 16 bits).

Parameters are grouped by what a step does with them (`ModelShape.groups`):
  embed        the token embedding (a lookup: rows read, not the table)
  lm_head      the output projection (one sampled token a request, unless tied)
  attention    q/k/v/o projections with biases and norms (the remainder of `params`)
  mlp          the dense layers' gated MLPs
  experts      every routed expert's gated MLP (a step reads the ones its tokens route to)
  shared       shared experts (every token)
  router       the MoE layers' gates
  vision       the vision tower and projector (memory only)"""
from __future__ import annotations

import os
from dataclasses import dataclass

GROUPS = ("embed", "lm_head", "attention", "mlp", "experts", "shared", "router", "vision")
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": None}
QUANTIZATIONS = ("fp8",)
# where a checkpoint's ignore list names a weight, the group it belongs to
_IGNORE_MARKERS = (("vision", "vision"), ("multi_modal_projector", "vision"), ("lm_head", "lm_head"),
                   ("shared_expert", "shared"), ("router", "router"), (".gate.", "router"),
                   ("self_attn", "attention"), ("experts", "experts"), ("mlp", "mlp"))
# vLLM's FP8 leaves these in 16 bits unless told otherwise (ParallelLMHead, the MoE gates, embeddings)
FP8_UNQUANTIZED = ("embed", "lm_head", "router")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int          # a dense layer's MLP
    vocab: int
    params: int                # total parameters, embeddings (and vision) included
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    experts: int = 0           # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    shared_intermediate: int = 0   # shared experts' MLP width per MoE layer (0: none)
    vision_params: int = 0
    quantization: str | None = None    # "fp8": 8-bit weights outside `unquantized`
    unquantized: tuple = ()            # the groups an FP8 checkpoint keeps in 16 bits

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(self.group_bytes(g) for g in GROUPS)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def non_embedding_params(self) -> int:
        return self.params - self.embedding_params - self.vision_params

    @property
    def groups(self) -> dict:
        """Parameters per group (module docstring)."""
        h = self.hidden
        g = {"embed": self.vocab * h, "lm_head": 0 if self.tied_embeddings else self.vocab * h,
             "mlp": (self.layers - self.moe_layers) * 3 * h * self.intermediate,
             "experts": self.moe_layers * self.experts * 3 * h * self.expert_intermediate,
             "shared": self.moe_layers * 3 * h * self.shared_intermediate,
             "router": self.moe_layers * h * self.experts, "vision": self.vision_params}
        g["attention"] = self.params - sum(g.values())
        return g

    @property
    def routed_params(self) -> int:
        """The routed experts' parameters a token runs through (k of them a MoE layer; 0 for a dense model)."""
        return self.moe_layers * self.experts_per_token * 3 * self.hidden * self.expert_intermediate

    @property
    def active_params(self) -> int:
        """Parameters a token runs through in the decoder's matrix products
        (not the embedding, the LM head or the vision tower; k of the experts)."""
        g = self.groups
        return g["attention"] + g["mlp"] + g["shared"] + g["router"] + self.routed_params

    def quantized(self, group: str) -> bool:
        return self.quantization == "fp8" and group not in self.unquantized

    def group_bytes(self, group: str) -> int:
        return self.groups[group] * (1 if self.quantized(group) else self.dtype_bytes)

    def active_quantized_share(self, experts: bool = True) -> float:
        """The share of `active_params` in FP8 matrix products (`experts`
        False: of the dense ones only, the routed experts left out)."""
        g = self.groups
        parts = {"attention": g["attention"], "mlp": g["mlp"], "shared": g["shared"], "router": g["router"],
                 "experts": self.routed_params if experts else 0}
        total = sum(parts.values())
        return sum(v for k, v in parts.items() if self.quantized(k)) / total if total else 0.0


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


def name_of_config(path: str) -> str:
    """A model's name from where its config.json lies: the folder's name
    (models/llama-3.1-70b/config.json: llama-3.1-70b), else the file's."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if base == "config.json" else os.path.splitext(base)[0]


def _need(cfg: dict, key: str, where: str = "config.json"):
    if cfg.get(key) is None:
        raise ValueError(f"{where} lacks {key}")
    return cfg[key]


def _text_config(cfg: dict) -> dict:
    """The language model's settings: a multimodal checkpoint's text_config
    over the top level (whose dtype and quantization a text_config may lack)."""
    text = cfg.get("text_config") or cfg.get("language_config") or {}
    return dict({k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **text)


def _moe(cfg: dict, layers: int, inter: int) -> dict:
    """Experts per layer, k, the experts' and shared experts' widths and how
    many layers are MoE, as Mixtral, Qwen-MoE and Llama 4 name them."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return {}
    k = int(_need(cfg, "num_experts_per_tok"))
    width = int(cfg.get("moe_intermediate_size") or inter)
    if cfg.get("model_type", "").startswith("llama4"):
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        moe_layers, shared = layers // step, inter        # one shared expert of intermediate_size
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not 1 <= k <= experts:
        raise ValueError(f"config.json: num_experts_per_tok {k} must be between 1 and the experts ({experts})")
    return {"experts": int(experts), "experts_per_token": k, "expert_intermediate": width,
            "moe_layers": moe_layers, "shared_intermediate": shared}


def _vision_params(cfg: dict) -> int:
    """The vision tower's parameters, estimated from its shape: per layer the
    attention (4 h^2) and MLP (2 h i), and the projector to the text width."""
    v = cfg.get("vision_config")
    if not v:
        return 0
    h, i = int(v.get("hidden_size") or 0), int(v.get("intermediate_size") or 0)
    tower = int(v.get("num_hidden_layers") or v.get("depth") or 0) * (4 * h * h + 2 * h * i)
    out = int(v.get("projector_output_dim") or v.get("out_hidden_size") or h)
    return tower + out * int(_text_config(cfg).get("hidden_size") or 0)


def quantization_of(cfg: dict) -> tuple[str | None, tuple]:
    """A checkpoint's quantization ("fp8" or None) and the groups its ignore
    list keeps in 16 bits; ValueError for a quantization not modelled."""
    q = cfg.get("quantization_config") or _text_config(cfg).get("quantization_config")
    if not q:
        return None, ()
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8" or (method == "compressed-tensors" and _float8(q)):
        ignore = q.get("ignore") or q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        groups = {next((g for marker, g in _IGNORE_MARKERS if marker in name), "attention") for name in ignore}
        return "fp8", tuple(sorted(groups | {"embed"}))
    raise ValueError(f"config.json: quantization {method or q!r} is not modelled (8-bit floating point is: "
                     f"quant_method fp8, or compressed-tensors with float 8-bit weights)")


def _float8(q: dict) -> bool:
    w = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
    return bool(w) and all(x.get("num_bits") == 8 and x.get("type") == "float" for x in w)


def shape_from_config(cfg: dict, name: str | None = None, dtype_bytes: int | None = None,
                      dtype: str | None = None, quantization: str | None = None) -> ModelShape:
    """A model shape from a Hugging Face ``config.json`` (module docstring).
    Parameters are counted from the shape: embeddings (and an untied LM
    head), per layer q/k/v/o projections (with q/k/v biases for Qwen2), a
    gated MLP or the experts, two RMSNorms, the final norm, and the vision
    tower. `dtype` (vLLM's --dtype: auto is the config's) and
    `quantization` ("fp8": vLLM's --quantization fp8, dynamic FP8 of a 16-bit
    checkpoint) override the config's. ValueError names a missing field."""
    if "architectures" in cfg and any("DeepseekV" in a for a in cfg["architectures"]) or "kv_lora_rank" in cfg:
        raise ValueError("config.json: multi-head latent attention (kv_lora_rank, DeepSeek V2/V3) is not modelled")
    t = _text_config(cfg)
    L, h = int(_need(t, "num_hidden_layers")), int(_need(t, "hidden_size"))
    heads, vocab = int(_need(t, "num_attention_heads")), int(_need(t, "vocab_size"))
    inter = int(t.get("intermediate_size_mlp") or _need(t, "intermediate_size"))
    kv = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or h // heads)
    tied = bool(t.get("tie_word_embeddings", False))
    moe = _moe(t, L, int(_need(t, "intermediate_size")))
    bias = t.get("model_type") == "qwen2" or bool(t.get("attention_bias", False))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd if bias else 0)
    if t.get("model_type") in ("qwen3", "qwen3_moe"):
        attn += 2 * hd                                  # q_norm and k_norm
    shape = ModelShape("", layers=L, hidden=h, heads=heads, kv_heads=kv, head_dim=hd, intermediate=inter,
                       vocab=vocab, params=0, tied_embeddings=tied, **moe)
    g = shape.groups
    vision = _vision_params(cfg)
    params = L * (attn + 2 * h) + h + sum(v for k, v in g.items() if k != "attention") + vision
    if dtype_bytes is None:
        want = dtype if dtype not in (None, "auto") else str(t.get("torch_dtype") or t.get("dtype") or "bfloat16")
        if want not in DTYPE_BYTES:
            raise ValueError(f"dtype {want!r} is not one of {', '.join(k for k in DTYPE_BYTES if k != 'auto')}")
        dtype_bytes = DTYPE_BYTES[want]
    quant, unquantized = quantization_of(cfg)
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r} is not modelled: {', '.join(QUANTIZATIONS)}")
        if quant is None:
            quant, unquantized = quantization, FP8_UNQUANTIZED
    arch = (cfg.get("architectures") or [cfg.get("model_type", "model")])[0]
    return ModelShape(name or cfg.get("_name_or_path") or arch, layers=L, hidden=h, heads=heads, kv_heads=kv,
                      head_dim=hd, intermediate=inter, vocab=vocab, params=params, dtype_bytes=dtype_bytes,
                      tied_embeddings=tied, vision_params=vision, quantization=quant,
                      unquantized=tuple(unquantized), **moe)
