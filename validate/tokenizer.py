"""A tokenizer for the tiny dummy-weight model (validate/models/tiny-qwen2),
for the tools that need one: the load testers (`vllm bench serve`,
inference-perf, guidellm) make their prompts by decoding token ids and count
what comes back by encoding it, and the server then takes text prompts.

A word-level tokenizer over the model's whole vocabulary: token i is the
word `t{i}` (ids 0-2 the special `<unk>`, `<bos>`, `<eos>`, as the model's
config names them), words split on whitespace. Every id decodes to one word
and every word encodes back to its id, so a prompt of n ids is n tokens on
both sides. Written in the `tokenizers` JSON format with a
`PreTrainedTokenizerFast` config, which transformers' AutoTokenizer loads
offline; deterministic (the same files every time)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ("<unk>", "<bos>", "<eos>")


def word(i: int) -> str:
    return SPECIAL[i] if i < len(SPECIAL) else f"t{i}"


def tokenizer_json(vocab_size: int) -> dict:
    vocab = {word(i): i for i in range(vocab_size)}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(SPECIAL)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
            "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}


def write_tokenizer(folder: Path, model: Path) -> Path:
    """Writes the tokenizer of `model` (its config.json's vocab_size, bos and
    eos ids) into `folder`; returns the folder."""
    cfg = json.loads((model / "config.json").read_text())
    if (cfg.get("bos_token_id"), cfg.get("eos_token_id")) != (1, 2):
        raise ValueError(f"{model}: the word-level tokenizer has <bos> 1 and <eos> 2; the config says "
                         f"{cfg.get('bos_token_id')} and {cfg.get('eos_token_id')}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(int(cfg["vocab_size"]))))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(cfg["max_position_embeddings"]),
        "unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False,
        "clean_up_tokenization_spaces": False}, indent=1))
    return folder
