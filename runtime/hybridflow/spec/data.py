"""``spec.data``: the prompt dataset the rollouts start from, and the validation prompts."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from hybridflow.spec.base import SpecModel
from hybridflow.spec.models import LOCAL_PATH_HELP

TRAIN_FILE_PATTERN = r"^.+\.(parquet|jsonl)$"
"""Readers exist for these two formats only; the suffix picks the reader."""

TrainFile = Annotated[str, StringConstraints(pattern=TRAIN_FILE_PATTERN, max_length=4096)]


class DataSpec(SpecModel):
    """Prompt files (training and validation), how prompts are read from them, and the training order."""

    train_files: tuple[TrainFile, ...] = Field(
        min_length=1,
        max_length=256,
        description=(
            "Prompt files, .parquet or .jsonl, one prompt per row; rows of all files form one dataset. "
            f"{LOCAL_PATH_HELP}"
        ),
    )
    val_files: tuple[TrainFile, ...] = Field(
        default=(),
        max_length=256,
        description=(
            "Validation prompts, .parquet or .jsonl, in the trainFiles format; never trained on, scored as "
            "spec.evaluation says (by default after the last step). Empty: no evaluation. "
            f"{LOCAL_PATH_HELP}"
        ),
    )
    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        max_length=256,
        description=(
            "Column (or JSON key) holding the prompt: a string, or a list of chat messages "
            "({role, content}) rendered with the tokenizer's chat template."
        ),
    )
    max_prompt_tokens: int = Field(
        default=512,
        ge=1,
        description=(
            "Longest prompt in tokens after templating; longer prompts are dropped from the dataset "
            "rather than truncated, so no prompt loses its question."
        ),
    )
    shuffle: bool = Field(
        default=True,
        description="Visit prompts in a random order, reshuffled every epoch.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="Seed of the shuffle, so a resumed or repeated run sees the same prompt order.",
    )
