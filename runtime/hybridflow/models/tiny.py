"""Tiny random HF-format models and a byte-level tokenizer, built from code alone.

Tests, demos and benchmarks need a real Hugging Face checkpoint directory (``config.json``,
``model.safetensors``, ``tokenizer.json``...) that loads through the same code paths as a
production model (``AutoModelForCausalLM``, ``AutoTokenizer``, vLLM, FSDP, Megatron weight
conversion), but nothing may come from a model hub. This module makes one in well under a
second on a CPU:

* :func:`build_tokenizer`: byte-level BPE with no merges. Token id ``b`` is the byte ``b``
  (so ``"a"`` is 97), which represents any text, ASCII or not, and round-trips exactly. Four
  special tokens follow the 256 bytes (:data:`BOS_TOKEN` ... :data:`PAD_TOKEN`), with a
  ChatML chat template, as Qwen2 checkpoints have.
* :func:`build_tiny_model`: a Qwen2 or Llama causal LM with random weights that depend only
  on the seed.
* :func:`write_tiny_model`: both saved into one directory, atomically and idempotently, so
  any number of tests or Ray workers may ask for the same directory at once.

The model's vocabulary (rows of the embedding and of ``lm_head``) is larger than the
tokenizer's, as in real checkpoints (Qwen2.5: 151,936 rows for 151,665 tokens): the model may
emit an id the tokenizer does not know, and decoding skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

TinyArch = Literal["qwen2", "llama"]
"""Architectures :func:`build_tiny_model` can build: the two families the runtime's backends
(FSDP, Megatron weight conversion, vLLM) are tested against."""

TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)

BOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

BYTE_VOCAB_SIZE = 256
BOS_TOKEN_ID = 256
IM_START_TOKEN_ID = 257
IM_END_TOKEN_ID = 258
PAD_TOKEN_ID = 259
TOKENIZER_VOCAB_SIZE = 260
"""Bytes 0-255 first (id = byte value), then the special tokens in the order above."""

EOS_TOKEN = IM_END_TOKEN
EOS_TOKEN_ID = IM_END_TOKEN_ID
"""A chat response ends with ``<|im_end|>``; that is the tokenizer's eos, as in Qwen2 chat
checkpoints. The model's generation config stops on both ``<|im_end|>`` and ``<|endoftext|>``
(end of plain text), so engines are exercised with a list of eos ids, as real checkpoints
need."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the format of Qwen2 chat models: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, and ``<|im_start|>assistant\\n`` when a generation prompt is asked for."""

VOCAB_MULTIPLE = 128
"""Default model vocabularies are rounded up to a multiple of 128. vLLM pads its vocab-parallel
embedding to a multiple of 64 and Megatron to ``make_vocab_size_divisible_by`` (128) times the
TP size; a checkpoint that is already a multiple of 128 has the same shape in HF, vLLM and
Megatron (TP 1), so weight sync and resharding tests copy tensors without slicing padding, and
the rows split evenly for tensor parallelism."""

MIN_HEAD_DIM = 32
MAX_HEAD_DIM = 256
"""Head dims are multiples of 32 in [32, 256]: the sizes every vLLM attention backend accepts
(the CPU backend, FlashAttention); vLLM refuses a model with head_dim 16 at load time."""

DEFAULT_ROPE_THETA = 10_000.0

_MARKER_FILE = "hybridflow_tiny.json"
"""Written last into a tiny-model directory: the parameters it was built from. A directory
with this marker is complete, and its contents say whether a later request can reuse it."""

_MARKER_FORMAT = 1

TinyHead = Literal["lm", "score"]
"""``lm``: a causal LM (policy, critic start); ``score``: a scalar-head reward model."""
"""Bump when the files :func:`write_tiny_model` writes change for the same parameters, so that
directories written by an older version are not mistaken for current ones."""


# --------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters.

    Byte-level BPE works on these characters instead of raw bytes so that every token is a
    printable string in ``tokenizer.json``; the tokenizers library's ``ByteLevel`` pre-tokenizer
    and decoder apply the same map.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(BYTE_VOCAB_SIZE):
        if byte not in mapping:
            mapping[byte] = chr(BYTE_VOCAB_SIZE + shifted)
            shifted += 1
    return mapping


def build_tokenizer(
    padding_side: Literal["left", "right"] = "left", model_max_length: int = 512
) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ChatML special tokens, built without any download.

    Byte-level BPE with an empty merge list: every byte is one token and token id = byte value,
    so any string (ASCII or UTF-8) encodes and decodes back exactly, and ids are readable in
    test failures. Sequences are as long as the text in bytes, which is fine for tiny models.

    Special tokens (ids 256-259): ``<|endoftext|>`` (bos), ``<|im_start|>``, ``<|im_end|>``
    (eos: a chat turn ends there), ``<|pad|>`` (pad; distinct from eos so that padding is
    never mistaken for a generated end of turn). Encoding adds no special tokens: prompts get
    them from the chat template, as with Qwen2.

    ``padding_side`` defaults to ``"left"``, what batched generation needs (every prompt ends at
    the same column, where decoding starts). ``model_max_length`` should match the model's
    ``max_position_embeddings``.

    Reloading from a directory: transformers 5 picks the tokenizer class from ``config.json``'s
    model type. Next to a Llama config, ``AutoTokenizer`` rebuilds exactly this tokenizer; next
    to a Qwen2 config it builds ``Qwen2Tokenizer`` from the same vocabulary, which adds NFC
    normalisation and Qwen's word-splitting regex. With no merges the split changes nothing,
    so ids agree for all ASCII and NFC-normalised text; only non-NFC Unicode (a decomposed
    "é") encodes differently. vLLM loads tokenizers through ``AutoTokenizer`` too, so every
    engine and trainer reading the directory agrees.
    """
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[byte]: byte for byte in range(BYTE_VOCAB_SIZE)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges there is nothing for word boundaries to confine.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token in (BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side=padding_side,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids([BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN])
    if (
        ids != [BOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID, PAD_TOKEN_ID]
        or len(tokenizer) != TOKENIZER_VOCAB_SIZE
    ):
        raise AssertionError(f"tokenizer layout changed: special ids {ids}, size {len(tokenizer)}")
    return tokenizer


# --------------------------------------------------------------------------- model


def padded_vocab_size(token_count: int = TOKENIZER_VOCAB_SIZE, multiple: int = VOCAB_MULTIPLE) -> int:
    """``token_count`` rounded up to a multiple of ``multiple`` (see :data:`VOCAB_MULTIPLE`)."""
    return -(-token_count // multiple) * multiple


def tiny_config(
    arch: TinyArch,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    intermediate: int = 128,
    max_position: int = 512,
) -> PretrainedConfig:
    """The HF config of a tiny model; :func:`build_tiny_model` documents the parameters.

    Raises ``ValueError`` naming the parameter when a size would make a model that the
    runtime's engines or backends cannot load.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; allowed: {', '.join(TINY_ARCHS)}")
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer's {TOKENIZER_VOCAB_SIZE} tokens; "
            f"use at least {padded_vocab_size()}"
        )
    if heads < 1 or hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be a positive multiple of heads={heads}")
    head_dim = hidden // heads
    if head_dim % MIN_HEAD_DIM != 0 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"hidden/heads = {hidden}/{heads} = head_dim {head_dim}; vLLM needs a multiple of "
            f"{MIN_HEAD_DIM} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (e.g. hidden=64, heads=2)"
        )
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    for name, value in (("layers", layers), ("intermediate", intermediate), ("max_position", max_position)):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position,
        "rope_parameters": {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA},
        "rms_norm_eps": 1e-6,
        # Untied: the actor's lm_head and embedding are separate tensors in every backend, so
        # weight-sync tests see every parameter move; a tied model hides a missed lm_head.
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "float32",
    }
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, head_dim=head_dim, attention_bias=False, mlp_bias=False)


def build_tiny_model(
    arch: TinyArch,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    intermediate: int = 128,
    max_position: int = 512,
    seed: int = 0,
    head: TinyHead = "lm",
) -> PreTrainedModel:
    """A float32 causal LM with random weights that are a function of ``seed`` alone.

    ``head="score"`` builds the same decoder with a scalar ``score`` head instead of the LM head
    (``*ForSequenceClassification``, ``num_labels=1``): a tiny reward model for tests and demos.

    * ``arch``: ``"qwen2"`` (q/k/v biases) or ``"llama"`` (no biases); both use RMSNorm,
      SwiGLU and RoPE (theta 10,000).
    * ``vocab_size``: rows of the embedding and of ``lm_head``, at least the tokenizer's 260;
      :func:`padded_vocab_size` gives the default 384 (a multiple of 128, see
      :data:`VOCAB_MULTIPLE`).
    * ``hidden / heads`` is the head dim and must be a multiple of 32 in [32, 256] (vLLM's
      attention backends accept no smaller head; see :data:`MIN_HEAD_DIM`). The defaults,
      64 and 2, give head dim 32: the smallest model vLLM serves.
    * ``kv_heads`` defaults to ``heads`` (plain multi-head attention) so that two-way tensor
      parallelism splits the KV heads evenly in vLLM and Megatron; pass ``kv_heads=1`` to
      exercise grouped-query attention.
    * ``tie_word_embeddings`` is False (see :func:`tiny_config`).

    The global torch RNG is left as it was: initialisation runs under a forked RNG seeded with
    ``seed``, so the same seed gives the same weights whatever ran before.
    """
    config = tiny_config(arch, vocab_size, hidden, layers, heads, kv_heads, intermediate, max_position)
    if head == "score":
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            scorer: PreTrainedModel = AutoModelForSequenceClassification.from_config(
                config, dtype=torch.float32
            )
        return scorer.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=[EOS_TOKEN_ID, BOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
    )
    return model.eval()


# --------------------------------------------------------------------------- directory


def _is_complete(directory: Path) -> bool:
    return (directory / _MARKER_FILE).is_file()


def _read_marker(directory: Path) -> dict[str, Any]:
    marker: dict[str, Any] = json.loads((directory / _MARKER_FILE).read_text())
    return marker


def write_tiny_model(
    output_dir: str | os.PathLike[str],
    arch: TinyArch = "qwen2",
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    intermediate: int = 128,
    max_position: int = 512,
    head: TinyHead = "lm",
) -> Path:
    """Write a tiny model and its tokenizer as one HF directory; returns its path.

    ``head="score"`` writes a tiny reward model instead (see :func:`build_tiny_model`).

    The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors``, the
    tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) and
    ``hybridflow_tiny.json`` (the parameters it was built from). It loads with
    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``
    and in vLLM. ``vocab_size=None`` means :func:`padded_vocab_size` (384); the other
    parameters are those of :func:`build_tiny_model`.

    Protocol, safe for concurrent callers (test workers, Ray actors on one node):

    * Atomic: everything is written into a temporary directory next to ``output_dir`` (same
      filesystem) and renamed into place in one step, so a reader sees no directory or a
      complete one.
    * Idempotent: if ``output_dir`` already holds a complete tiny model built from the same
      parameters, it is kept untouched and returned. A racing writer that loses the rename
      discards its copy and returns the winner's (the contents are identical).
    * Never destructive: an existing ``output_dir`` that is anything else (other parameters,
      files of its own) raises ``FileExistsError`` naming the difference; delete it or choose
      another path. An empty directory is replaced.

    Safe across processes, not across threads of one process: building seeds torch's global
    RNG (see :func:`build_tiny_model`), which threads share.
    """
    output_dir = Path(output_dir)
    vocab_size = padded_vocab_size() if vocab_size is None else vocab_size
    params: dict[str, Any] = {
        "format": _MARKER_FORMAT,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": heads if kv_heads is None else kv_heads,
        "intermediate": intermediate,
        "max_position": max_position,
    }
    if head != "lm":  # recorded only when set, so directories written before it still match
        params["head"] = head

    def reuse_existing() -> Path:
        if not _is_complete(output_dir):
            raise FileExistsError(
                f"{output_dir} exists but is not a tiny model written by write_tiny_model "
                f"(no {_MARKER_FILE}); delete it or choose another output_dir"
            )
        existing = _read_marker(output_dir)
        if existing != params:
            differences = ", ".join(
                f"{key}: {existing.get(key)!r} != {value!r}"
                for key, value in params.items()
                if existing.get(key) != value
            )
            raise FileExistsError(
                f"{output_dir} holds a tiny model built with other parameters ({differences}); "
                "delete it or choose another output_dir"
            )
        return output_dir

    # An empty directory (made by a fixture, say) counts as absent: renaming onto it replaces it.
    if output_dir.exists() and not (output_dir.is_dir() and not any(output_dir.iterdir())):
        return reuse_existing()

    model = build_tiny_model(
        arch, vocab_size, hidden, layers, heads, kv_heads, intermediate, max_position, seed, head
    )
    tokenizer = build_tokenizer(model_max_length=max_position)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the model directory is for everyone
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        try:
            # rename() of a directory onto an existing non-empty one fails on POSIX; that is
            # how a losing racer learns that another writer got there first.
            staging.rename(output_dir)
        except OSError as error:
            if _is_complete(output_dir):
                return reuse_existing()
            raise OSError(f"could not move the tiny model into {output_dir}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
