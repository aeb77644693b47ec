"""Rendering and tokenizing prompts; the in-memory :class:`PromptDataset` and its :class:`PromptBatch`.

Rendering rules (what text the policy sees, decided once when the dataset is built):

* A **chat** prompt (a list of ``{role, content}`` messages) goes through
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` when
  the tokenizer has a chat template. Without one, the messages are joined in the plain format
  of :func:`plain_chat_text`: one ``"<role>: <content>"`` line per message, then
  ``"assistant:"`` as the generation prompt.
* A **string** prompt is used exactly as written, never templated: it is how a dataset hands
  over text it has already formatted (or a completion prompt for a base model). To get the
  tokenizer's template, write the prompt as a one-message chat instead.

Tokenizing: templated text is encoded with ``add_special_tokens=False`` (the template writes
its own BOS; a second one would double it); plain and string prompts with
``add_special_tokens=True``, so a tokenizer that prepends BOS does so. A prompt longer than
``max_prompt_tokens`` tokens is dropped, not truncated, so no prompt loses its question; the
dataset counts the drops in ``filtered_too_long``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hybridflow.data.files import ChatMessage, PromptDataError, PromptRow, read_prompt_files

if TYPE_CHECKING:
    from hybridflow.spec.data import DataSpec

__all__ = [
    "BATCH_FIELD_NAMES",
    "PromptBatch",
    "PromptDataset",
    "PromptTokenizer",
    "TokenizedPrompt",
    "plain_chat_text",
    "render_prompt",
]


class PromptTokenizer(Protocol):
    """What the dataset needs of a tokenizer; a Hugging Face ``PreTrainedTokenizer(Fast)`` has it.

    ``chat_template`` is read with ``getattr`` (absent or ``None``: no template).
    """

    def apply_chat_template(
        self, conversation: list[ChatMessage], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


def _has_chat_template(tokenizer: PromptTokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_chat_text(messages: Sequence[ChatMessage]) -> str:
    """Messages for a tokenizer without a chat template: ``"user: Hi\\nassistant:"``.

    One ``"<role>: <content>"`` line per message, joined by newlines, then a final
    ``"assistant:"`` line that plays the part of ``add_generation_prompt``.
    """
    lines = [f"{message['role']}: {message['content']}" for message in messages]
    return "\n".join([*lines, "assistant:"])


def render_prompt(prompt: str | Sequence[ChatMessage], tokenizer: PromptTokenizer) -> tuple[str, bool]:
    """The text the policy sees for ``prompt``, and whether it came from the chat template.

    See the module docstring for the rules.
    """
    if isinstance(prompt, str):
        return prompt, False
    if _has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text, True
    return plain_chat_text(prompt), False


@dataclass(frozen=True)
class TokenizedPrompt:
    """A row with the text it renders to and that text's token ids."""

    row: PromptRow
    text: str
    token_ids: tuple[int, ...]


BATCH_FIELD_NAMES: tuple[str, ...] = (
    "uid",
    "prompt_token_ids",
    "prompt_text",
    "raw_prompt",
    "data_source",
    "ground_truth",
    "extra_info",
)
"""Keys of :meth:`PromptBatch.to_batch_fields`, one per-row value each."""


@dataclass(frozen=True)
class PromptBatch:
    """Prompts for one training step, row-aligned lists of plain Python values.

    Rows are the prompts in sampling order; a batch owns its values (copies, so a consumer may
    mutate them without touching the dataset). ``uids`` are the rows' stable ``"file:row"``
    ids; a batch that crosses an epoch boundary may hold a prompt twice, with the same uid, so
    group baselines keyed by uid (GRPO, RLOO) pool the responses to that prompt, which is
    still a baseline for the same question.
    """

    uids: list[str]
    prompt_token_ids: list[list[int]]
    prompt_texts: list[str]
    raw_prompts: list[str | list[ChatMessage]]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict[str, Any] | None]

    def __post_init__(self) -> None:
        sizes = {len(column) for column in self._columns()}
        if len(sizes) > 1:
            raise ValueError(f"PromptBatch columns disagree on the number of rows: {sorted(sizes)}")

    def _columns(self) -> tuple[list[Any], ...]:
        return (
            self.uids,
            self.prompt_token_ids,
            self.prompt_texts,
            self.raw_prompts,
            self.data_sources,
            self.ground_truths,
            self.extra_infos,
        )

    def __len__(self) -> int:
        return len(self.uids)

    def to_batch_fields(self) -> dict[str, np.ndarray]:
        """One 1-D ``dtype=object`` array per name of :data:`BATCH_FIELD_NAMES`, for the batch container.

        The controller wraps these as its batch's non-tensor fields; padding the token ids into
        tensors is the rollout's business, since it knows the pad side and id.
        """
        return {
            name: _object_array(column)
            for name, column in zip(BATCH_FIELD_NAMES, self._columns(), strict=True)
        }


def _object_array(values: Sequence[Any]) -> np.ndarray:
    # Filled element by element: np.array(list_of_lists) would build a 2-D array or fail.
    array = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        array[index] = value
    return array


class PromptDataset:
    """Tokenized prompts held in memory, in file order; rows too long are already gone.

    Built once by the single controller at startup (``from_spec`` or ``from_files``) and read
    through a :class:`hybridflow.data.sampler.PromptSampler`; nothing changes after that, so
    a given set of files, tokenizer and limit always gives the same rows at the same indices
    (which is what makes a sampler position resumable).
    """

    def __init__(
        self,
        prompts: Iterable[TokenizedPrompt],
        *,
        filtered_too_long: int = 0,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self._prompts: tuple[TokenizedPrompt, ...] = tuple(prompts)
        if not self._prompts:
            raise PromptDataError("a PromptDataset needs at least one prompt")
        self.filtered_too_long: int = filtered_too_long
        """Rows dropped because they rendered to more than ``max_prompt_tokens`` tokens."""
        self.max_prompt_tokens: int | None = max_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"PromptDataset(prompts={len(self)}, filtered_too_long={self.filtered_too_long}, "
            f"max_prompt_tokens={self.max_prompt_tokens})"
        )

    @classmethod
    def from_spec(cls, spec: DataSpec, tokenizer: PromptTokenizer) -> PromptDataset:
        """The dataset a job's ``spec.data`` describes (files, prompt key, token limit)."""
        return cls.from_files(
            spec.train_files, tokenizer, max_prompt_tokens=spec.max_prompt_tokens, prompt_key=spec.prompt_key
        )

    @classmethod
    def from_files(
        cls,
        paths: Sequence[str | Path],
        tokenizer: PromptTokenizer,
        *,
        max_prompt_tokens: int,
        prompt_key: str = "prompt",
    ) -> PromptDataset:
        """Read, validate, render and tokenize every row of ``paths`` (file order, then row order)."""
        if not paths:
            raise PromptDataError("no prompt files given")
        rows = read_prompt_files(paths, prompt_key=prompt_key)
        source = ", ".join(str(path) for path in paths)
        return cls.from_rows(rows, tokenizer, max_prompt_tokens=max_prompt_tokens, source=source)

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[PromptRow],
        tokenizer: PromptTokenizer,
        *,
        max_prompt_tokens: int,
        source: str = "the prompt rows",
    ) -> PromptDataset:
        """Render and tokenize ``rows``, dropping those over ``max_prompt_tokens``.

        Raises :class:`PromptDataError` when there are no rows or every row is too long.
        """
        if max_prompt_tokens < 1:
            raise PromptDataError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        kept: list[TokenizedPrompt] = []
        too_long = 0
        shortest_too_long: int | None = None
        for row in rows:
            text, templated = render_prompt(row.prompt, tokenizer)
            token_ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=not templated))
            if len(token_ids) > max_prompt_tokens:
                too_long += 1
                shortest_too_long = min(len(token_ids), shortest_too_long or len(token_ids))
                continue
            kept.append(TokenizedPrompt(row=row, text=text, token_ids=token_ids))
        if not kept and too_long:
            raise PromptDataError(
                f"every one of the {too_long} prompts in {source} is longer than max_prompt_tokens="
                f"{max_prompt_tokens} (the shortest has {shortest_too_long} tokens); raise "
                "spec.data.maxPromptTokens or shorten the prompts"
            )
        if not kept:
            raise PromptDataError(f"{source} holds no prompts")
        return cls(kept, filtered_too_long=too_long, max_prompt_tokens=max_prompt_tokens)

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> TokenizedPrompt:
        return self._prompts[index]

    def __iter__(self) -> Iterator[TokenizedPrompt]:
        return iter(self._prompts)

    def take(self, indices: Iterable[int]) -> PromptBatch:
        """The rows at ``indices`` (repeats allowed), as a batch that owns copies of its values."""
        chosen = [self._prompts[int(i)] for i in indices]
        return PromptBatch(
            uids=[p.row.uid for p in chosen],
            prompt_token_ids=[list(p.token_ids) for p in chosen],
            prompt_texts=[p.text for p in chosen],
            raw_prompts=[copy.deepcopy(p.row.prompt) for p in chosen],
            data_sources=[p.row.data_source for p in chosen],
            ground_truths=[copy.deepcopy(p.row.ground_truth) for p in chosen],
            extra_infos=[copy.deepcopy(p.row.extra_info) for p in chosen],
        )
