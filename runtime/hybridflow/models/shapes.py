"""Random models with real architectures' shapes, for figures that must be measured at real sizes.

Memory and time claims are measured on models of at least 0.5B parameters with the shapes of a
published architecture, never only on the tiny test model; there is no model hub here, so the
weights are random and the shapes come from the architectures' ``config.json`` files
(``Qwen/Qwen2-0.5B`` and ``Qwen/Qwen2.5-1.5B`` on Hugging Face), copied below as numbers.

:func:`write_shaped_model` writes one as an HF directory (``config.json``, ``generation_config``,
bf16 safetensors as released checkpoints are, the tiny tokenizer): it loads with
``from_pretrained``, in every backend and engine, like any checkpoint. Initialisation is
transformers' own for the architecture, under a seeded RNG, so a shape and a seed give the same
weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from hybridflow.models.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_tokenizer, tiny_config

__all__ = ["SHAPES", "ModelShape", "write_shaped_model"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen2-family decoder (the fields of its ``config.json`` that set memory and FLOPs)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position: int = 4096


SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen2-0.5B config.json: 494M parameters, embeddings tied.
    "qwen2-0.5b": ModelShape(896, 24, 14, 2, 4864, 151_936, tie_word_embeddings=True),
    # The same with a separate LM head (630M parameters): resharding into vLLM supports untied
    # embeddings only (resharding/layout.py), as in Qwen2-7B and larger.
    "qwen2-0.5b-untied": ModelShape(896, 24, 14, 2, 4864, 151_936, tie_word_embeddings=False),
    # Qwen/Qwen2.5-1.5B config.json: 1.54B parameters, embeddings tied.
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151_936, tie_word_embeddings=True),
    # The tiny test model's sizes, for quick runs of the same code.
    "tiny": ModelShape(64, 2, 2, 2, 128, 384, tie_word_embeddings=False, max_position=512),
}


def write_shaped_model(
    output_dir: str | Path, shape: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write a random Qwen2 model of ``SHAPES[shape]`` to ``output_dir`` (atomically); returns it.

    An existing model directory is returned as it is (these take seconds to minutes to write);
    a non-empty directory of anything else raises ``FileExistsError``. Raises ``KeyError`` naming
    the known shapes for an unknown one.
    """
    if shape not in SHAPES:
        raise KeyError(f"shape {shape!r} is not one of {', '.join(sorted(SHAPES))}")
    sizes = SHAPES[shape]
    output_dir = Path(output_dir)
    if (output_dir / "config.json").is_file() and any(output_dir.glob("*.safetensors")):
        existing = json.loads((output_dir / "config.json").read_text())
        wanted = {
            "hidden_size": sizes.hidden,
            "num_hidden_layers": sizes.layers,
            "num_attention_heads": sizes.heads,
            "num_key_value_heads": sizes.kv_heads,
            "intermediate_size": sizes.intermediate,
            "vocab_size": sizes.vocab_size,
            "tie_word_embeddings": sizes.tie_word_embeddings,
        }
        differences = {k: (existing.get(k), v) for k, v in wanted.items() if existing.get(k) != v}
        if differences:
            raise FileExistsError(
                f"{output_dir} holds a model of other shapes than {shape!r} (found, wanted: {differences}); "
                "delete it or choose another directory"
            )
        return output_dir
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(
            f"{output_dir} exists and is not a model directory; delete it or choose another"
        )
    config = tiny_config(
        "qwen2",
        sizes.vocab_size,
        hidden=sizes.hidden,
        layers=sizes.layers,
        heads=sizes.heads,
        kv_heads=sizes.kv_heads,
        intermediate=sizes.intermediate,
        max_position=sizes.max_position,
    )
    config.tie_word_embeddings = sizes.tie_word_embeddings
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=[EOS_TOKEN_ID, BOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID
    )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        staging.chmod(0o755)
        model.save_pretrained(staging)
        build_tokenizer(model_max_length=sizes.max_position).save_pretrained(staging)
        del model
        if output_dir.exists():
            output_dir.rmdir()  # empty (checked above)
        staging.rename(output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
