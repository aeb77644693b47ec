"""Prompt datasets for RL training, in veRL's row schema.

Three steps, one module each:

* :mod:`hybridflow.data.files`: read ``.parquet``/``.jsonl`` rows and validate them
  (:class:`PromptRow`); errors name the file, the row and the field.
* :mod:`hybridflow.data.prompts`: render each prompt (chat template or plain text), tokenize
  it, drop the over-long ones (:class:`PromptDataset`), and gather rows into a
  :class:`PromptBatch`.
* :mod:`hybridflow.data.sampler`: the shuffled, resumable order batches are drawn in
  (:class:`PromptSampler`).

Typical use by the single controller::

    dataset = PromptDataset.from_spec(spec.data, tokenizer)
    sampler = PromptSampler(dataset, seed=spec.data.seed, shuffle=spec.data.shuffle)
    sampler.load_state_dict(checkpoint["sampler"])          # when resuming
    batch = sampler.next_batch(batch_size).to_batch_fields()  # once per step
"""

from hybridflow.data.files import (
    SUPPORTED_SUFFIXES,
    ChatMessage,
    PromptDataError,
    PromptRow,
    read_prompt_file,
    read_prompt_files,
)
from hybridflow.data.prompts import (
    BATCH_FIELD_NAMES,
    PromptBatch,
    PromptDataset,
    PromptTokenizer,
    TokenizedPrompt,
    plain_chat_text,
    render_prompt,
)
from hybridflow.data.sampler import PromptSampler, SamplerState, SamplerStateError, epoch_order

__all__ = [
    "BATCH_FIELD_NAMES",
    "SUPPORTED_SUFFIXES",
    "ChatMessage",
    "PromptBatch",
    "PromptDataError",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "PromptTokenizer",
    "SamplerState",
    "SamplerStateError",
    "TokenizedPrompt",
    "epoch_order",
    "plain_chat_text",
    "read_prompt_file",
    "read_prompt_files",
    "render_prompt",
]
