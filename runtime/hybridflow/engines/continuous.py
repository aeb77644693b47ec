"""Continuous batching for the torch engine: a request queue over a slot-based static cache.

A rollout replica in server mode (``spec.rollout.mode: server``, docs/rollout.md) serves
requests as they come instead of one batch per step: a request is one prompt with its ``n``
samples, and each sample occupies one *slot* (a row of a preallocated KV cache) from the step
it is admitted to the step it ends. The moment a sample ends, its slot takes the next waiting
sample, so a long response no longer holds the whole batch back. Sampling is vectorised over
the rows that share sampling parameters; only the draw itself is per row.

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
* The running samples hold rows ``0 .. running - 1``: when one ends, the last running row moves
  into its place (its keys, values, mask and pending logits), so a decode step runs over the
  running rows only, never over idle slots, and attends over the columns from the oldest
  running row's first one to ``t`` only (views of the cache: the rows and the window).

Each sample draws from a counter-based random stream of its own (:func:`counter_uniforms`, keyed
by the request's seed and the sample's index, counted by the token's position), so which
samples share a batch never changes what a sample draws, and a continuation draws what the
sample would have drawn. Each
generated token records the *policy version* of the weights whose forward pass produced its
logits (:attr:`ContinuousBatcher.version`, set by the replica after each weight load): a
sample that spans a weight update (a partial rollout) carries both versions, and the trainer's
importance correction uses its per-token log-probs.

Threading: a batcher is not thread-safe. The replica (``workers/rollout_server.py``) calls
every method under one lock, and loads weights only between two :meth:`step` calls.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn
from transformers import StaticCache

from hybridflow.engines.base import SamplingParams, check_prompts, unsampled_token, without_token
from hybridflow.engines.torch_engine import filtered_probabilities

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


_MASK64 = (1 << 64) - 1


def sampling_key(params: SamplingParams, index: int, progress: SampleProgress) -> int:
    """Sample ``index``'s key to its random stream: kept by a continuation, else from the request's seed."""
    if progress.sampling_key is not None:
        return progress.sampling_key
    if params.seed is None:
        return random.getrandbits(63)
    return (params.seed * 1009 + index) & _MASK64


def counter_uniforms(keys: list[int], counters: list[int]) -> torch.Tensor:
    """One uniform in [0, 1) per (key, counter): SplitMix64 of ``key * FNV prime + counter``.

    A counter-based stream: the draw for token ``t`` of a sample depends on its key and ``t``
    only, never on which samples share the batch or what was drawn before, so the rows draw
    in one vectorised call and a continuation needs no state but the key.
    """
    z = np.asarray(keys, dtype=np.uint64) * np.uint64(0x100000001B3) + np.asarray(counters, dtype=np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r``'s token by inverse transform: the first whose cumulative probability exceeds ``u_r``."""
    cumulative = probs.double().cumsum(dim=-1)
    targets = uniforms[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


@dataclass
class SampleProgress:
    """What one sample generated so far: empty for a fresh sample, filled for a continuation.

    ``sampling_key`` is the sample's key to the counter-based random stream (``None``: derived
    from the request's seed, or drawn fresh for an unseeded request), so that a continuation
    draws what the sample would have drawn next (``None``: not started).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sampling_key: int | None = None


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
    sampling_key: int | None = None
    """The sample's key to its random stream (what a continuation draws with)."""
    loss_mask: list[int] | None = None
    """A multi-turn trajectory's: 1 where the engine generated the token, 0 where it was inserted."""
    answer_span: tuple[int, int] | None = None
    """A multi-turn trajectory's last model turn, ``token_ids[start:end]`` (what its reward reads)."""
    prompt_token_ids: list[int] | None = None
    """A trajectory whose prompt is its own (an agent's first messages, ``rollout/endpoint.py``)."""


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
    key: int
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
        self._unsampled = unsampled_token(pad_token_id, eos_token_ids)
        self._vocab_size: int | None = getattr(config, "vocab_size", None)
        self._cache = StaticCache(config=config, max_cache_len=self.width)
        self._full: list[tuple[torch.Tensor, torch.Tensor]] = []  # each layer's keys and values, all slots
        self._mask = torch.zeros((slots, self.width), dtype=torch.long, device=self._device)
        self._pending: torch.Tensor | None = None  # [slots, vocab]: the logits each row draws from next
        self._pending_versions: list[int] = [0] * slots
        self._clock = max_sequence
        # Rows 0 .. len(self._running) - 1 hold the running samples, in cache-row order: a finished
        # row is filled by the last one, so a decode step runs over exactly the running rows.
        self._running: list[_Sample] = []
        self._starts: list[int] = []  # each running row's first live column
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
            sample = _Sample(request, index, done, sampling_key(params, index, done))
            reason = sample.finished_reason(self._eos_ids)
            if reason is not None:  # a continuation whose sample had ended already
                opened.results[index] = _result(sample, reason)
            else:
                self._waiting.append(sample)
        self._open[request.request_id] = opened
        self._close_if_done(request.request_id)

    @property
    def busy(self) -> bool:
        """Whether any sample waits or decodes."""
        return bool(self._waiting) or bool(self._running)

    @property
    def waiting_samples(self) -> int:
        return len(self._waiting)

    @property
    def running_samples(self) -> int:
        return len(self._running)

    def take_finished(self) -> list[RequestResult]:
        """Requests whose every sample ended since the last call, in the order they ended."""
        done, self._done = self._done, []
        return done

    def abort(self) -> list[RequestResult]:
        """End every open request now: finished samples as they are, the others as ``"abort"``.

        Returns them (and clears the batcher); the caller resubmits the unfinished ones as
        continuations (:func:`continuation_of`) on this or another replica.
        """
        running, self._running, self._starts = self._running, [], []
        for sample in running:
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
            if self._running:
                self._decode()
        self.tokens_generated += drawn
        return drawn

    def _admit(self) -> None:
        admitted: list[_Sample] = []
        while len(self._running) + len(admitted) < self.slots and self._waiting:
            admitted.append(self._waiting.popleft())
        if not admitted:
            return
        # One prefill row per request's fresh samples, one per continuation.
        rows: list[list[int]] = []
        row_of: dict[tuple[str, int], int] = {}
        for sample in admitted:
            key = (sample.request.request_id, sample.index if sample.progress.token_ids else -1)
            if key not in row_of:
                row_of[key] = len(rows)
                rows.append(sample.request.prompt_token_ids + sample.progress.token_ids)
        keys, values, last_logits = self._prefill(rows)
        self._ensure_cache(keys[0], last_logits.shape[-1])
        assert self._pending is not None
        t = self._clock
        for sample in admitted:
            slot = len(self._running)
            key = (sample.request.request_id, sample.index if sample.progress.token_ids else -1)
            row, length = row_of[key], len(rows[row_of[key]])
            for (cache_keys, cache_values), layer_keys, layer_values in zip(
                self._full, keys, values, strict=True
            ):
                cache_keys[slot, :, t - length : t] = layer_keys[row, :, -length:]
                cache_values[slot, :, t - length : t] = layer_values[row, :, -length:]
            self._mask[slot].zero_()
            self._mask[slot, t - length : t] = 1
            self._pending[slot] = last_logits[row]
            self._pending_versions[slot] = self.version
            sample.position = length
            self._running.append(sample)
            self._starts.append(t - length)

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

    def _ensure_cache(self, keys: torch.Tensor, vocab: int) -> None:
        if self._full:
            return
        for layer in self._layers():
            shape = (self.slots, keys.shape[1], 0, keys.shape[3])
            empty = torch.empty(shape, dtype=keys.dtype, device=keys.device)
            layer.lazy_initialization(empty, empty)
            self._full.append((layer.keys, layer.values))
        self._pending = torch.zeros((self.slots, vocab), dtype=torch.float32, device=self._device)

    def _draw(self) -> int:
        """One token per running row from its pending logits; ended rows leave (the last row fills the hole)."""
        running = len(self._running)
        if running == 0:
            return 0
        assert self._pending is not None
        logits = self._pending[:running]
        choosable = without_token(logits, self._unsampled)  # the log-probs stay the policy's
        tokens = torch.empty(running, dtype=torch.long, device=self._device)
        # Rows that sample alike share the vectorised filters; each draws from its own stream.
        by_params: dict[SamplingParams, list[int]] = {}
        for row, sample in enumerate(self._running):
            by_params.setdefault(sample.request.params, []).append(row)
        for params, rows in by_params.items():
            index = torch.tensor(rows, device=self._device)
            if params.greedy:
                tokens[index] = choosable[index].argmax(dim=-1)
                continue
            probs = filtered_probabilities(choosable[index], params)
            uniforms = counter_uniforms(
                [self._running[row].key for row in rows],
                [len(self._running[row].progress.token_ids) for row in rows],
            )
            tokens[index] = draw_from(probs, uniforms.to(probs.device))
        chosen_logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        ended: list[tuple[int, SampleFinish]] = []
        for row, (sample, token, logprob) in enumerate(
            zip(self._running, tokens.tolist(), chosen_logprobs.tolist(), strict=True)
        ):
            progress = sample.progress
            progress.token_ids.append(token)
            progress.logprobs.append(logprob)
            progress.versions.append(self._pending_versions[row])
            reason = sample.finished_reason(self._eos_ids)
            if reason is not None:
                ended.append((row, reason))
        for row, reason in reversed(ended):  # highest row first: each move fills a hole below
            sample = self._running[row]
            self._remove_row(row)
            self._record(sample, reason)
        return running

    def _remove_row(self, row: int) -> None:
        """Drop running row ``row``: the last running row moves into it (cache, mask, pending logits)."""
        last = len(self._running) - 1
        if row != last:
            assert self._pending is not None
            for keys, values in self._full:
                keys[row] = keys[last]
                values[row] = values[last]
            self._mask[row] = self._mask[last]
            self._pending[row] = self._pending[last]
            self._pending_versions[row] = self._pending_versions[last]
            self._running[row] = self._running[last]
            self._starts[row] = self._starts[last]
        self._running.pop()
        self._starts.pop()

    def _decode(self) -> None:
        """One forward pass over the running rows only (views of the first rows of every cache tensor)."""
        if self._clock == self.width:
            self._compact()
        t, running = self._clock, len(self._running)
        input_ids = torch.tensor(
            [[sample.progress.token_ids[-1]] for sample in self._running],
            dtype=torch.long,
            device=self._device,
        )
        positions = torch.tensor(
            [[sample.position] for sample in self._running], dtype=torch.long, device=self._device
        )
        self._mask[:running, t] = 1
        # Attention reads only the window every running row lives in: columns lo .. t.
        lo = min(self._starts)
        layers = self._layers()
        for layer, (keys, values) in zip(layers, self._full, strict=True):
            # Views of the running rows and the window: the new column lands in the full tensors.
            layer.keys, layer.values = keys[:running, :, lo : t + 1], values[:running, :, lo : t + 1]
            layer.cumulative_length.fill_(t - lo)
            layer.max_cache_len = t + 1 - lo
        try:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=self._mask[:running, lo : t + 1],
                position_ids=positions,
                past_key_values=self._cache,
                cache_position=torch.tensor([t - lo], device=self._device),
                use_cache=True,
            )
        finally:
            for layer, (keys, values) in zip(layers, self._full, strict=True):
                layer.keys, layer.values, layer.max_cache_len = keys, values, self.width
        assert self._pending is not None
        self._pending[:running] = outputs.logits[:, -1, :].float()
        for row, sample in enumerate(self._running):
            self._pending_versions[row] = self.version
            sample.position += 1
        self._clock = t + 1

    def _compact(self) -> None:
        """Move every row's live columns ``max_sequence`` to the left (see the module docstring)."""
        shift, t = self.max_sequence, self._clock
        for keys, values in self._full:
            for tensor in (keys, values):
                tensor[:, :, : t - shift] = tensor[:, :, shift:t].clone()
        self._mask[:, : t - shift] = self._mask[:, shift:t].clone()
        self._mask[:, t - shift :] = 0
        self._starts = [start - shift for start in self._starts]
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
    key = sample.key if reason == "abort" else None
    return SampleResult(
        list(progress.token_ids), list(progress.logprobs), list(progress.versions), reason, key
    )


def continuation_of(result: RequestResult, request_id: str | None = None) -> GenerationRequest | None:
    """The request that continues ``result``'s aborted samples (``None`` when none was aborted).

    Every sample keeps what it generated (tokens, log-probs, versions) and its random stream's key;
    ended samples come back ended.
    """
    if all(sample.finish_reason != "abort" for sample in result.samples):
        return None
    request = result.request
    progress = [
        SampleProgress(list(s.token_ids), list(s.logprobs), list(s.versions), s.sampling_key)
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
