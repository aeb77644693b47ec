"""Continuous batching for the torch engine: a request queue over a slot-based static cache.

A rollout replica in server mode (``spec.rollout.mode: server``, docs/rollout.md) serves
requests as they come instead of one batch per step: a request is one prompt with its ``n``
samples, and each sample occupies one *slot* (a row of a preallocated KV cache) from the step
it is admitted to the step it ends. The moment a sample ends, its slot takes the next waiting
sample, so a long response no longer holds the whole batch back.

The cache is one ``StaticCache`` of ``slots`` rows and ``width = 2 * max_sequence`` columns
(``max_sequence``: the longest prompt plus the longest response a request may ask for), with
one column clock ``t`` shared by every row:

* A decode step feeds every row's last token and writes its key and value at column ``t``
  (HF's static layer writes at its ``cumulative_length``, which :meth:`ContinuousBatcher.step`
  sets to ``t``), then ``t`` advances. Each row's attention mask covers its own live columns
  only, and its position ids count its own tokens, so a row decodes exactly as it would alone.
* Admitting a sample of ``L`` tokens (its prompt, plus what it generated before, when it
  continues an aborted sample) prefills them in one forward pass (the fresh samples of one
  request share one prefill row) and copies their keys and values into columns ``t-L .. t-1``
  of the slot's row. ``t >= max_sequence`` always holds, so any sample fits behind the clock.
* When ``t`` reaches ``width``, every row's live columns move left by ``max_sequence`` (live
  rows started at ``>= max_sequence`` since none is longer than that): the copy is made once
  per ``max_sequence`` steps, and the cache never grows.

Each sample draws from its own ``torch.Generator`` (seeded from the request's seed and the
sample's index), so which samples share a batch never changes what a sample draws. Each
generated token records the *policy version* of the weights whose forward pass produced its
logits (:attr:`ContinuousBatcher.version`, set by the replica after each weight load): a
sample that spans a weight update (a partial rollout) carries both versions, and the trainer's
importance correction uses its per-token log-probs.

Threading: a batcher is not thread-safe. The replica (``workers/rollout_server.py``) calls
every method under one lock, and loads weights only between two :meth:`step` calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn
from transformers import StaticCache

from hybridflow.engines.base import SamplingParams, check_prompts
from hybridflow.engines.torch_engine import choose_next_tokens

__all__ = [
    "ContinuousBatcher",
    "GenerationRequest",
    "RequestResult",
    "SampleProgress",
    "SampleResult",
    "continuation_of",
]

SampleFinish = Literal["stop", "length", "abort"]
"""``"stop"``/``"length"`` as in :data:`~hybridflow.engines.base.FinishReason`; ``"abort"``: the
replica was paused with abort (or stopped) before the sample ended; it continues elsewhere."""


@dataclass
class SampleProgress:
    """What one sample generated so far: empty for a fresh sample, filled for a continuation.

    ``rng_state`` is the sample's generator state after its last draw, so that a continuation
    draws what the sample would have drawn next (``None``: not started).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rng_state: torch.Tensor | None = None


@dataclass
class GenerationRequest:
    """One prompt and its ``params.n`` samples; ``progress[i]`` continues sample ``i`` (aborted before).

    ``session_id`` names a multi-turn trajectory (the router keeps it on one replica);
    ``tag`` is the caller's (the rollout service keeps the prompt's row there) and comes back
    unchanged in the :class:`RequestResult`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    progress: list[SampleProgress] = field(default_factory=list)
    session_id: str | None = None
    tag: Any = None

    def __post_init__(self) -> None:
        if self.progress and len(self.progress) != self.params.n:
            raise ValueError(
                f"request {self.request_id}: {len(self.progress)} sample progresses for n={self.params.n}"
            )


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: SampleFinish
    rng_state: torch.Tensor | None = None
    """An aborted sample's generator state after its last draw (what a continuation starts from)."""


@dataclass
class RequestResult:
    """A request's samples, in sample order, each ended (``"abort"`` only from :meth:`ContinuousBatcher.abort`)."""

    request: GenerationRequest
    samples: list[SampleResult]


@dataclass
class _Sample:
    request: GenerationRequest
    index: int
    progress: SampleProgress
    generator: torch.Generator | None
    # Set while in a slot: the logits the next token is drawn from, and their forward's version.
    pending_logits: torch.Tensor | None = None
    pending_version: int = 0
    position: int = 0  # the position id of the next fed token: the sample's length so far

    def finished_reason(self, eos_ids: set[int]) -> SampleFinish | None:
        tokens = self.progress.token_ids
        if tokens and tokens[-1] in eos_ids:
            return "stop"
        if len(tokens) >= self.request.params.max_new_tokens:
            return "length"
        return None


@dataclass
class _Open:
    """A request some of whose samples are still waiting or in a slot."""

    request: GenerationRequest
    results: list[SampleResult | None]


class ContinuousBatcher:
    """Serves :class:`GenerationRequest` s over ``slots`` cache rows (see the module docstring).

    ``model``: an HF causal LM whose layers all attend to the whole context (a sliding-window
    layer keeps only its window, which the column copies cannot follow: refused).
    ``max_sequence``: the most tokens any request's prompt plus ``max_new_tokens`` may take.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        slots: int,
        max_sequence: int,
        eos_token_ids: list[int],
        pad_token_id: int,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}: a batcher needs at least one slot")
        if max_sequence < 2:
            raise ValueError(f"max_sequence={max_sequence}: a prompt token and a new token need 2")
        config = cast(Any, model).config
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
            raise ValueError(
                "continuous batching needs every layer to attend to the whole context; this model "
                f"uses a sliding window of {config.sliding_window} tokens"
            )
        self.model = model
        self.slots = slots
        self.max_sequence = max_sequence
        self.width = 2 * max_sequence
        self.version = 0
        """The policy version of the weights loaded now; the replica sets it after each load."""
        self._device = next(model.parameters()).device
        self._eos_ids = set(eos_token_ids)
        self._pad_id = pad_token_id
        self._vocab_size: int | None = getattr(config, "vocab_size", None)
        self._cache = StaticCache(config=config, max_cache_len=self.width)
        self._cache_ready = False
        self._mask = torch.zeros((slots, self.width), dtype=torch.long, device=self._device)
        self._clock = max_sequence
        self._rows: list[_Sample | None] = [None] * slots
        self._waiting: deque[_Sample] = deque()
        self._open: dict[str, _Open] = {}
        self._done: list[RequestResult] = []
        self.tokens_generated = 0

    # ------------------------------------------------------------------ queue

    def add(self, request: GenerationRequest) -> None:
        """Queue the request's samples (their continuations, if it carries progress)."""
        if request.request_id in self._open:
            raise ValueError(f"request {request.request_id} is already being served")
        params = request.params
        check_prompts(
            [request.prompt_token_ids],
            params,
            vocab_size=self._vocab_size,
            max_length=self.max_sequence,
            max_length_name="the replica's max_sequence (data.maxPromptTokens + rollout.maxResponseTokens)",
        )
        progress = request.progress or [SampleProgress() for _ in range(params.n)]
        opened = _Open(request, [None] * params.n)
        for index, done in enumerate(progress):
            sample = _Sample(request, index, done, self._generator(params, index, done))
            reason = sample.finished_reason(self._eos_ids)
            if reason is not None:  # a continuation whose sample had ended already
                opened.results[index] = _result(sample, reason)
            else:
                self._waiting.append(sample)
        self._open[request.request_id] = opened
        self._close_if_done(request.request_id)

    def _generator(self, params: SamplingParams, index: int, done: SampleProgress) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = torch.Generator(device=self._device)
        if done.rng_state is not None:
            generator.set_state(done.rng_state)
        elif params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed * 1009 + index)
        return generator

    @property
    def busy(self) -> bool:
        """Whether any sample waits or decodes."""
        return bool(self._waiting) or any(row is not None for row in self._rows)

    @property
    def waiting_samples(self) -> int:
        return len(self._waiting)

    @property
    def running_samples(self) -> int:
        return sum(row is not None for row in self._rows)

    def take_finished(self) -> list[RequestResult]:
        """Requests whose every sample ended since the last call, in the order they ended."""
        done, self._done = self._done, []
        return done

    def abort(self) -> list[RequestResult]:
        """End every open request now: finished samples as they are, the others as ``"abort"``.

        Returns them (and clears the batcher); the caller resubmits the unfinished ones as
        continuations (:func:`continuation_of`) on this or another replica.
        """
        for row, sample in enumerate(self._rows):
            if sample is not None:
                self._rows[row] = None
                self._record(sample, "abort")
        while self._waiting:
            self._record(self._waiting.popleft(), "abort")
        aborted = self.take_finished()
        self._open.clear()
        return aborted

    # ------------------------------------------------------------------ decoding

    def step(self) -> int:
        """Admit waiting samples into free slots, draw one token per occupied slot, decode once.

        Returns the tokens drawn (0 when idle).
        """
        with torch.inference_mode():
            self._admit()
            drawn = self._draw()
            if any(row is not None for row in self._rows):
                self._decode()
        self.tokens_generated += drawn
        return drawn

    def _admit(self) -> None:
        free = [row for row, sample in enumerate(self._rows) if sample is None]
        admitted: list[tuple[int, _Sample]] = []
        while free and self._waiting:
            admitted.append((free.pop(0), self._waiting.popleft()))
        if not admitted:
            return
        # One prefill row per request's fresh samples, one per continuation.
        rows: list[list[int]] = []
        row_of: dict[tuple[str, int], int] = {}
        for _, sample in admitted:
            key = (sample.request.request_id, sample.index if sample.progress.token_ids else -1)
            if key not in row_of:
                row_of[key] = len(rows)
                rows.append(sample.request.prompt_token_ids + sample.progress.token_ids)
        keys, values, last_logits = self._prefill(rows)
        self._ensure_cache(keys[0])
        t = self._clock
        for slot, sample in admitted:
            key = (sample.request.request_id, sample.index if sample.progress.token_ids else -1)
            row, length = row_of[key], len(rows[row_of[key]])
            for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
                cache_layer = self._layers()[layer]
                cache_layer.keys[slot, :, t - length : t] = layer_keys[row, :, -length:]
                cache_layer.values[slot, :, t - length : t] = layer_values[row, :, -length:]
            self._mask[slot].zero_()
            self._mask[slot, t - length : t] = 1
            sample.pending_logits = last_logits[row]
            sample.pending_version = self.version
            sample.position = length
            self._rows[slot] = sample

    def _prefill(self, rows: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Left-padded forward of ``rows``: per layer keys and values ``[rows, heads, width, dim]``, last logits."""
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[index, width - len(row) :] = 1
        input_ids, mask = input_ids.to(self._device), mask.to(self._device)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=-1) - 1).clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
        )
        layers = list(outputs.past_key_values.layers)
        return (
            [layer.keys for layer in layers],
            [layer.values for layer in layers],
            outputs.logits[:, -1, :].float(),
        )

    def _layers(self) -> list[Any]:
        """The static cache's layers (every one a full-attention ``StaticLayer``: the constructor checks)."""
        return list(self._cache.layers)

    def _ensure_cache(self, keys: torch.Tensor) -> None:
        if self._cache_ready:
            return
        for layer in self._layers():
            shape = (self.slots, keys.shape[1], 0, keys.shape[3])
            empty = torch.empty(shape, dtype=keys.dtype, device=keys.device)
            layer.lazy_initialization(empty, empty)
        self._cache_ready = True

    def _draw(self) -> int:
        drawn = 0
        for row, sample in enumerate(self._rows):
            if sample is None or sample.pending_logits is None:
                continue
            logits = sample.pending_logits[None, :]
            token = int(choose_next_tokens(logits, sample.request.params, sample.generator)[0])
            progress = sample.progress
            progress.token_ids.append(token)
            progress.logprobs.append(float(logits.log_softmax(dim=-1)[0, token]))
            progress.versions.append(sample.pending_version)
            sample.pending_logits = None
            drawn += 1
            reason = sample.finished_reason(self._eos_ids)
            if reason is not None:
                self._rows[row] = None
                self._record(sample, reason)
        return drawn

    def _decode(self) -> None:
        if self._clock == self.width:
            self._compact()
        t = self._clock
        input_ids = torch.full((self.slots, 1), self._pad_id, dtype=torch.long, device=self._device)
        positions = torch.zeros((self.slots, 1), dtype=torch.long, device=self._device)
        for row, sample in enumerate(self._rows):
            if sample is not None:
                input_ids[row, 0] = sample.progress.token_ids[-1]
                positions[row, 0] = sample.position
        self._mask[:, t] = 1  # every row attends to its own new column (an idle row to nothing else)
        for layer in self._layers():
            layer.cumulative_length.fill_(t)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            cache_position=torch.tensor([t], device=self._device),
            use_cache=True,
        )
        logits = outputs.logits[:, -1, :].float()
        for row, sample in enumerate(self._rows):
            if sample is not None:
                sample.pending_logits = logits[row]
                sample.pending_version = self.version
                sample.position += 1
        self._clock = t + 1

    def _compact(self) -> None:
        """Move every row's live columns ``max_sequence`` to the left (see the module docstring)."""
        shift, t = self.max_sequence, self._clock
        for layer in self._layers():
            for tensor in (layer.keys, layer.values):
                tensor[:, :, : t - shift] = tensor[:, :, shift:t].clone()
        self._mask[:, : t - shift] = self._mask[:, shift:t].clone()
        self._mask[:, t - shift :] = 0
        self._clock = t - shift

    # ------------------------------------------------------------------ results

    def _record(self, sample: _Sample, reason: SampleFinish) -> None:
        opened = self._open[sample.request.request_id]
        opened.results[sample.index] = _result(sample, reason)
        self._close_if_done(sample.request.request_id)

    def _close_if_done(self, request_id: str) -> None:
        opened = self._open[request_id]
        if all(result is not None for result in opened.results):
            del self._open[request_id]
            self._done.append(RequestResult(opened.request, cast(list[SampleResult], opened.results)))


def _result(sample: _Sample, reason: SampleFinish) -> SampleResult:
    progress = sample.progress
    if reason != "abort":
        rng_state = None
    elif sample.generator is not None:
        rng_state = sample.generator.get_state()
    else:
        rng_state = progress.rng_state
    return SampleResult(
        list(progress.token_ids), list(progress.logprobs), list(progress.versions), reason, rng_state
    )


def continuation_of(result: RequestResult, request_id: str | None = None) -> GenerationRequest | None:
    """The request that continues ``result``'s aborted samples (``None`` when none was aborted).

    Every sample keeps what it generated (tokens, log-probs, versions, its generator's state);
    ended samples come back ended.
    """
    if all(sample.finish_reason != "abort" for sample in result.samples):
        return None
    request = result.request
    progress = [
        SampleProgress(list(s.token_ids), list(s.logprobs), list(s.versions), s.rng_state)
        for s in result.samples
    ]
    return GenerationRequest(
        request_id or request.request_id,
        request.prompt_token_ids,
        request.params,
        progress,
        request.session_id,
        request.tag,
    )
