"""The rollout engine interface: what a rollout worker may ask of any generation backend.

A rollout worker owns one engine (the pure-torch :class:`~hybridflow.engines.torch_engine.
TorchRolloutEngine`, or vLLM) and drives it through this lifecycle, which every engine
implements and every caller may rely on:

1. Construction loads the weights and leaves the engine *awake*.
2. In a colocated step the worker calls ``wake_up()`` (restore memory), ``load_weights(...)``
   (sync the actor's new weights, by HF parameter name, possibly streamed in several calls),
   ``generate(...)`` any number of times, then ``sleep()`` (free accelerator memory so the
   trainer can use it). Weights survive ``sleep()``: a ``wake_up()`` with no
   ``load_weights`` generates with the weights the engine had before it slept.
3. ``generate`` and ``load_weights`` are only valid while awake; calling them while asleep or
   after ``close()`` raises :class:`EngineStateError` (never silently reloads). ``sleep`` and
   ``wake_up`` are idempotent. ``close()`` releases everything and is idempotent; the engine
   cannot be used afterwards.

Token ids in and out are plain ``list[int]``; tokenisation and tensor layout for training are
the caller's business (:func:`hybridflow.engines.layout.response_tensors`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Self

import torch

if TYPE_CHECKING:
    from hybridflow.resharding.fingerprint import FingerprintPlan

FinishReason = Literal["stop", "length"]
"""Why a response ended: ``"stop"``, it emitted an eos token (the last token of the
response); ``"length"``, it reached ``max_new_tokens``. The same words vLLM uses."""


class EngineStateError(RuntimeError):
    """An engine was used in a state that does not allow the call (asleep, or closed)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; the same meaning in every engine (vLLM's, where it has one).

    * ``max_new_tokens``: the most tokens generated per response (including the eos token).
    * ``temperature``: logits are divided by it before sampling; ``0`` means greedy decoding
      (argmax; ``top_p``, ``top_k`` and ``seed`` are then irrelevant).
    * ``top_k``: sample among the ``top_k`` most likely tokens; ``-1`` turns it off.
    * ``top_p``: nucleus sampling, sample among the smallest set of most likely tokens whose
      probability (after temperature and top-k) adds up to at least ``top_p``; ``1.0`` is off.
    * ``n``: responses per prompt. Outputs are interleaved: the ``n`` responses of prompt ``i``
      are rows ``i*n`` to ``i*n + n - 1`` (what GRPO/RLOO group statistics expect).
    * ``seed``: makes sampling reproducible: the same seed, prompts and weights give the same
      responses from the same engine. ``None`` draws fresh randomness each call.
    * ``return_logprobs``: also return each sampled token's log-probability (see
      :class:`RolloutOutput`). The rollout workers always ask: the actor measures the
      train-inference mismatch with them and corrects for it (``workers/rollout.py``). Off by
      default for other callers, since vLLM compiles a kernel on a process's first request.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    return_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 turns it off)")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be a positive count, or -1 to turn it off")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be at least 1")

    @property
    def greedy(self) -> bool:
        """Greedy (argmax) decoding, selected by ``temperature == 0``."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class RolloutOutput:
    """Responses for ``len(prompts) * n`` rows, interleaved (see :class:`SamplingParams`).

    * ``response_token_ids[row]``: the generated tokens only (no prompt, no padding). A response
      that stopped at eos ends with that eos token.
    * ``logprobs[row][t]`` (when asked for): log-probability of token ``t`` under the model's
      raw distribution, ``log_softmax(logits)`` at temperature 1, before temperature, top-k
      and top-p. This is what a training forward pass computes, so they compare directly
      with the actor's log-probs; they are *not* the log-probs of the (tempered, truncated)
      distribution the token was drawn from. ``None`` when not asked for.
    * ``finish_reasons[row]``: see :data:`FinishReason`.
    * ``loss_masks[row][t]`` (multi-turn trajectories only): 1 where the engine generated token
      ``t``, 0 where it was inserted (a tool result); ``None``: every token was generated.
    """

    response_token_ids: list[list[int]]
    finish_reasons: list[FinishReason]
    logprobs: list[list[float]] | None = None
    loss_masks: list[list[int]] | None = None

    def __post_init__(self) -> None:
        rows = len(self.response_token_ids)
        if len(self.finish_reasons) != rows:
            raise ValueError(f"{len(self.finish_reasons)} finish_reasons for {rows} responses")
        if self.logprobs is not None:
            if len(self.logprobs) != rows:
                raise ValueError(f"{len(self.logprobs)} logprob rows for {rows} responses")
            for row, (tokens, logprobs) in enumerate(
                zip(self.response_token_ids, self.logprobs, strict=True)
            ):
                if len(tokens) != len(logprobs):
                    raise ValueError(f"response {row}: {len(tokens)} tokens but {len(logprobs)} logprobs")
        if self.loss_masks is not None:
            if len(self.loss_masks) != rows:
                raise ValueError(f"{len(self.loss_masks)} loss-mask rows for {rows} responses")
            for row, (tokens, mask) in enumerate(zip(self.response_token_ids, self.loss_masks, strict=True)):
                if len(tokens) != len(mask):
                    raise ValueError(f"response {row}: {len(tokens)} tokens but a loss mask of {len(mask)}")

    def __len__(self) -> int:
        return len(self.response_token_ids)


class RolloutEngine(ABC):
    """A generation backend with the lifecycle described in this module's docstring.

    Engines are used from one thread (the rollout worker's); they are not thread-safe. An engine
    is a context manager that calls :meth:`close` on exit.
    """

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses for each prompt (each a non-empty list of token ids).

        Returns ``len(prompt_token_ids) * params.n`` rows, the ``n`` samples of a prompt
        adjacent. Raises :class:`EngineStateError` unless awake, ``ValueError`` for an empty
        prompt or one that leaves no room for ``max_new_tokens`` within the model's context.
        """

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights into the engine by HF parameter name (``model.layers.0.mlp.up_proj.weight``).

        Full (unsharded) tensors in the HF checkpoint layout; any dtype and device (they are
        converted). The iterable may hold any subset of the parameters, so large models can be
        streamed in buckets over several calls; parameters not named keep their values. An
        unknown name or a wrong shape raises ``ValueError`` naming it; tensors copied before
        the error stay copied, so after an error the engine's weights are a mix: load again.
        """

    def load_weight_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """One weight sync, streamed bucket by bucket; returns the bytes loaded.

        What a sync calls: ``buckets`` is lazy (each bucket is gathered or received only when
        the engine asks for it, and may be cleared once the next is asked for), and the engine
        consumes it exactly once, in order. The same contract as :meth:`load_weights` otherwise,
        which this default calls once per bucket; an engine whose load has a per-call cost over
        the whole model (vLLM's in-place reload) overrides it to pay that cost once per sync.
        """
        loaded = 0
        for bucket in buckets:
            self.load_weights(bucket)
            loaded += sum(t.numel() * t.element_size() for _, t in bucket)
        return loaded

    def weight_fingerprint(
        self, plan: FingerprintPlan, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, int | None]:
        """Checksums of the weights this engine serves, by HF name, as ``plan`` selects (the sync check).

        Read back from where the engine generates from, after a load (see
        :mod:`hybridflow.resharding.fingerprint`): ``None`` for a tensor the engine cannot read
        back, a missing name for one it does not hold. This default reads nothing back: every
        tensor is unverified, which the check reports as such.
        """
        return {name: None for name in shapes}

    @abstractmethod
    def sleep(self) -> None:
        """Free the accelerator memory the engine holds (KV cache; weights move to host memory).

        Idempotent. Weights are kept: :meth:`wake_up` restores them.
        """

    @abstractmethod
    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed, so that generate and load_weights work again. Idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine for good (memory, processes, threads). Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def check_prompts(
    prompt_token_ids: list[list[int]],
    params: SamplingParams,
    *,
    vocab_size: int | None,
    max_length: int | None,
    max_length_name: str,
) -> None:
    """The prompt checks every engine makes before generating (``ValueError`` naming the prompt).

    Every prompt needs a token, every token id must index the vocabulary, and the longest prompt
    plus ``max_new_tokens`` must fit ``max_length`` (``max_length_name`` says which setting that
    is, e.g. the model's ``max_position_embeddings`` or vLLM's ``max_model_len``).
    """
    for index, prompt in enumerate(prompt_token_ids):
        if not prompt:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        if vocab_size is not None:
            bad = [token for token in prompt if not 0 <= token < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})"
                )
    longest = max(len(prompt) for prompt in prompt_token_ids)
    if max_length is not None and longest + params.max_new_tokens > max_length:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={params.max_new_tokens} exceeds "
            f"{max_length_name}={max_length}"
        )


def unsampled_token(pad_token_id: int, eos_token_ids: Sequence[int]) -> int | None:
    """The token no draw may pick: the pad id, unless it is also an eos id (then it ends a turn).

    The pad id fills positions nobody reads; a random or half-trained model still gives it
    probability, and a pad the engine sampled would reach the tool parser, an environment's
    ``step`` and the trainer as if the model had meant it. Where pad and eos are one token (Qwen's
    ``<|endoftext|>``), banning it would forbid stopping, so nothing is banned.
    """
    return None if pad_token_id in eos_token_ids else pad_token_id


def without_token(logits: torch.Tensor, token_id: int | None) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with ``token_id``'s column at ``-inf`` (a copy), for choosing only.

    The log-probs an engine reports stay those of the unmasked logits: the policy's, as the
    trainer computes them (top-k and top-p filter the draw the same way and not the log-prob).
    """
    if token_id is None or not 0 <= token_id < logits.shape[-1]:
        return logits
    return logits.index_fill(-1, torch.tensor([token_id], device=logits.device), float("-inf"))
