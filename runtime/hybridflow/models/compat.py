"""Checks that a model directory and its tokenizer belong together, before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["tokenizer_model_mismatch"]


def tokenizer_model_mismatch(model_dir: str | Path, tokenizer_dir: str | Path) -> str | None:
    """Why the tokenizer cannot drive the model, or None when it can.

    A tokenizer may have fewer tokens than the model's embedding rows (vocabularies are padded
    to a multiple for kernels), never more: a token id past the last row would index outside
    the embedding at the first forward pass, on a GPU far from any useful error message.
    """
    from transformers import AutoTokenizer

    config_file = Path(model_dir) / "config.json"
    vocab_size = json.loads(config_file.read_text(encoding="utf-8")).get("vocab_size")
    if not isinstance(vocab_size, int):
        return f"{config_file} has no integer vocab_size"
    tokenizer_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    if tokenizer_size > vocab_size:
        return (
            f"the tokenizer at {tokenizer_dir} has {tokenizer_size} tokens but the model at {model_dir} "
            f"has only {vocab_size} embedding rows (config.json vocab_size); use the model's own tokenizer"
        )
    return None
