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
offline; deterministic (the same files every time).

guidellm's synthetic prompts are English text (Faker's) cut to a token
count by the client's tokenizer, which the word-level one reads as <unk>
only (the prompt decodes to nothing). `write_tokenizer(..., spell=True)`
writes guidellm's copy: the same vocabulary and decoding, with a normalizer
that spells text as the model's words, a letter a word (`a` to `t3` ... `z`
to `t28`, anything else dropped), so that the decoded prompt is n of the
model's words, n tokens to the server's tokenizer too (prompts of distinct
letter sequences, as distinct to the prefix cache as the text was)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ("<unk>", "<bos>", "<eos>")


def word(i: int) -> str:
    return SPECIAL[i] if i < len(SPECIAL) else f"t{i}"


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def spelling() -> dict:
    """The normalizer of the spelling tokenizer: lower case, only letters
    kept, each letter its word (`t` first: the words written contain it)."""
    order = "t" + LETTERS.replace("t", "")
    return {"type": "Sequence", "normalizers": [
        {"type": "Lowercase"}, {"type": "Replace", "pattern": {"Regex": "[^a-z]"}, "content": ""},
        *({"type": "Replace", "pattern": {"String": c}, "content": f" {word(len(SPECIAL) + LETTERS.index(c))} "}
          for c in order)]}


def tokenizer_json(vocab_size: int, spell: bool = False) -> dict:
    vocab = {word(i): i for i in range(vocab_size)}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(SPECIAL)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": spelling() if spell else None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
            "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}


def write_tokenizer(folder: Path, model: Path, spell: bool = False) -> Path:
    """Writes the tokenizer of `model` (its config.json's vocab_size, bos and
    eos ids) into `folder`; returns the folder. `spell`: guidellm's, which
    spells any text as the model's words (module docstring)."""
    cfg = json.loads((model / "config.json").read_text())
    if (cfg.get("bos_token_id"), cfg.get("eos_token_id")) != (1, 2):
        raise ValueError(f"{model}: the word-level tokenizer has <bos> 1 and <eos> 2; the config says "
                         f"{cfg.get('bos_token_id')} and {cfg.get('eos_token_id')}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(int(cfg["vocab_size"]), spell)))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(cfg["max_position_embeddings"]),
        "unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False,
        "clean_up_tokenization_spaces": False}, indent=1))
    return folder
