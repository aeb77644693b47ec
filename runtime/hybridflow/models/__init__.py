"""Models built from code: tiny random HF checkpoints and their tokenizer, for tests and demos.

Nothing here downloads anything; see :mod:`hybridflow.models.tiny`.
"""

from hybridflow.models.tiny import (
    BOS_TOKEN,
    BOS_TOKEN_ID,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    IM_END_TOKEN,
    IM_END_TOKEN_ID,
    IM_START_TOKEN,
    IM_START_TOKEN_ID,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    TINY_ARCHS,
    TOKENIZER_VOCAB_SIZE,
    TinyArch,
    build_tiny_model,
    build_tokenizer,
    padded_vocab_size,
    tiny_config,
    write_tiny_model,
)

__all__ = [
    "BOS_TOKEN",
    "BOS_TOKEN_ID",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "IM_END_TOKEN",
    "IM_END_TOKEN_ID",
    "IM_START_TOKEN",
    "IM_START_TOKEN_ID",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "TINY_ARCHS",
    "TOKENIZER_VOCAB_SIZE",
    "TinyArch",
    "build_tiny_model",
    "build_tokenizer",
    "padded_vocab_size",
    "tiny_config",
    "write_tiny_model",
]
