"""Reading prompt files (veRL's row schema) into validated :class:`PromptRow` values.

Row schema, one prompt per row, the same for ``.parquet`` and ``.jsonl``::

    {
      "prompt": "text" | [{"role": "user", "content": "text"}, ...],  # column named by prompt_key
      "data_source": "gsm8k",                                          # picks the reward function
      "reward_model": {"style": "rule", "ground_truth": "72"},         # style optional
      "extra_info": {"index": 0, ...} | null                           # optional, passed through
    }

Keys not named here are ignored. ``ground_truth`` may be any non-null value and reaches the
reward function unchanged (the rule rewards in :mod:`hybridflow.rewards.rules` expect a string).

Numbering. Rows are numbered from 0 in file order, as pyarrow and pandas number them; this
row index, with the file's index in the job's ``train_files``, is the row's stable uid. A JSON
Lines message also gives the 1-based line number an editor shows, since blank lines (skipped)
can make the two differ. Every error names the file (the path as given), the row or line and
the field, e.g. ``train.jsonl row 17: 'reward_model.ground_truth' is missing``. A null value
counts as missing: parquet stores a field absent from some rows as null in those rows.

Parquet quirk: a struct column has the union of the keys of all rows, so an ``extra_info`` key
present in only some rows reads as ``None`` in the others. Chat messages drop ``None``-valued
keys for the same reason (a chat template may test ``'tool_calls' in message``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SUPPORTED_SUFFIXES",
    "ChatMessage",
    "PromptDataError",
    "PromptRow",
    "read_prompt_file",
    "read_prompt_files",
]

SUPPORTED_SUFFIXES: tuple[str, ...] = (".parquet", ".jsonl")
"""File types with a reader; the suffix alone picks it (as ``spec.data.TRAIN_FILE_PATTERN`` allows)."""

ChatMessage = dict[str, Any]
"""One chat message: at least ``role`` and ``content`` (both strings); other keys pass through."""


class PromptDataError(ValueError):
    """A prompt file cannot be read or a row breaks the schema; the message names file, row and field."""


@dataclass(frozen=True)
class PromptRow:
    """One validated row of a prompt file, before rendering and tokenizing.

    ``prompt`` is the raw prompt: a string, or a non-empty list of chat messages.
    """

    file_index: int
    row_index: int
    prompt: str | list[ChatMessage]
    data_source: str
    ground_truth: Any
    reward_style: str | None
    extra_info: dict[str, Any] | None

    @property
    def uid(self) -> str:
        """``"<file index>:<row index>"``: stable as long as the file list and the files are unchanged."""
        return f"{self.file_index}:{self.row_index}"


def read_prompt_files(paths: Sequence[str | Path], *, prompt_key: str = "prompt") -> list[PromptRow]:
    """The rows of all ``paths``, in order; file ``i`` of ``paths`` gets ``file_index=i``."""
    rows: list[PromptRow] = []
    for file_index, path in enumerate(paths):
        rows.extend(read_prompt_file(path, file_index=file_index, prompt_key=prompt_key))
    return rows


def read_prompt_file(path: str | Path, *, file_index: int = 0, prompt_key: str = "prompt") -> list[PromptRow]:
    """Read and validate every row of one ``.parquet`` or ``.jsonl`` file.

    Raises :class:`PromptDataError` at the first problem: unknown suffix, missing or unreadable
    file, invalid JSON, or a row that breaks the schema of the module docstring.
    """
    name = str(path)
    suffix = Path(path).suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        allowed = " or ".join(SUPPORTED_SUFFIXES)
        raise PromptDataError(
            f"{name}: unsupported file type {suffix or '(no suffix)'!r}; prompt files must be {allowed}"
        )
    if not Path(path).is_file():
        raise PromptDataError(f"{name}: no such file")
    records = _parquet_records(Path(path), name) if suffix == ".parquet" else _jsonl_records(Path(path), name)
    return [
        _validate_row(record, where=where, file_index=file_index, row_index=row_index, prompt_key=prompt_key)
        for row_index, (where, record) in enumerate(records)
    ]


# -- readers: (location for messages, raw record) per row ------------------------------------


def _jsonl_records(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    row_index = 0
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PromptDataError(
                    f"{name} line {line_number} is not valid UTF-8 ({error.reason})"
                ) from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise PromptDataError(
                    f"{name} line {line_number} is not valid JSON: {error.msg} at column {error.colno}"
                ) from None
            yield f"{name} row {row_index} (line {line_number})", record
            row_index += 1


def _parquet_records(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq  # imported here: only parquet needs it
    except ImportError:
        raise PromptDataError(f"{name}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError... for a damaged file
        raise PromptDataError(f"{name}: not a readable parquet file ({error})") from None
    for row_index, record in enumerate(table.to_pylist()):
        yield f"{name} row {row_index}", record


# -- schema ------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _validate_row(record: Any, *, where: str, file_index: int, row_index: int, prompt_key: str) -> PromptRow:
    if not isinstance(record, Mapping):
        raise PromptDataError(f"{where}: a row must be an object with named fields, got {_type_name(record)}")

    if record.get(prompt_key) is None:
        present = ", ".join(repr(k) for k in record) or "no fields"
        raise PromptDataError(
            f"{where}: {prompt_key!r} is missing (the row has {present}; "
            "spec.data.promptKey names the prompt column)"
        )
    prompt = _validate_prompt(record[prompt_key], where=where, prompt_key=prompt_key)

    data_source = record.get("data_source")
    if data_source is None:
        raise PromptDataError(f"{where}: 'data_source' is missing")
    if not isinstance(data_source, str):
        raise PromptDataError(f"{where}: 'data_source' must be a string, got {_type_name(data_source)}")

    reward_model = record.get("reward_model")
    if reward_model is None:
        raise PromptDataError(f"{where}: 'reward_model' is missing")
    if not isinstance(reward_model, Mapping):
        raise PromptDataError(
            f"{where}: 'reward_model' must be an object with 'ground_truth', got {_type_name(reward_model)}"
        )
    if reward_model.get("ground_truth") is None:
        raise PromptDataError(f"{where}: 'reward_model.ground_truth' is missing")
    style = reward_model.get("style")
    if style is not None and not isinstance(style, str):
        raise PromptDataError(f"{where}: 'reward_model.style' must be a string, got {_type_name(style)}")

    extra_info = record.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise PromptDataError(
            f"{where}: 'extra_info' must be an object or null, got {_type_name(extra_info)}"
        )

    return PromptRow(
        file_index=file_index,
        row_index=row_index,
        prompt=prompt,
        data_source=data_source,
        ground_truth=reward_model["ground_truth"],
        reward_style=style,
        extra_info=None if extra_info is None else dict(extra_info),
    )


def _validate_prompt(value: Any, *, where: str, prompt_key: str) -> str | list[ChatMessage]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list | tuple):
        raise PromptDataError(
            f"{where}: {prompt_key!r} must be a string or a list of chat messages "
            f"{{role, content}}, got {_type_name(value)}"
        )
    if not value:
        raise PromptDataError(f"{where}: {prompt_key!r} is an empty list of chat messages")
    messages: list[ChatMessage] = []
    for position, message in enumerate(value):
        field = f"{prompt_key}[{position}]"
        if not isinstance(message, Mapping):
            raise PromptDataError(
                f"{where}: {field!r} must be an object with 'role' and 'content', got {_type_name(message)}"
            )
        for key in ("role", "content"):
            if message.get(key) is None:
                raise PromptDataError(f"{where}: '{field}.{key}' is missing")
            if not isinstance(message[key], str):
                raise PromptDataError(
                    f"{where}: '{field}.{key}' must be a string, got {_type_name(message[key])}"
                )
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages
