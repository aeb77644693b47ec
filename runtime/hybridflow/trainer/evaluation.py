"""Evaluation on ``spec.data.valFiles``: greedy and sampled passes, scored, never trained on.

Protocol (``trainer/runner.py`` calls, in this order):

1. Before any worker starts, :meth:`ValidationSet.load` reads and tokenizes the validation
   files (``spec.data.promptKey`` and ``maxPromptTokens`` as for training), first
   ``spec.evaluation.maxPrompts`` rows in file order; bad data stops the run there, as bad
   training data does.
2. On a fresh run (not a resume) with ``atStart``, :func:`evaluate` before the first step: its
   figures are the record of step 0. Then after each step ``k`` for which
   :func:`evaluation_due` holds (every ``everySteps`` and the last), once the step's own seconds
   are measured and before its checkpoint: the figures join step ``k``'s record.
3. :func:`evaluate` brings the rollout up to date only where the step's own generation would
   (``sync``: a colocated rollout that loads the actor's weights); an overlapped rollout had the
   step's push already (Ray runs its calls in order, so the evaluation sees version ``k``);
   server mode generates through the service's direct path, outside the replay buffer.

Why it changes no training result, and a resumed run evaluates as an uninterrupted one: it reads
no state a checkpoint saves and writes none the next step reads. Prompts come from the
validation set in file order, never from the training sampler; the greedy pass draws no random
number; the sampled pass's seed is :func:`sampled_pass_seed` of (``training.seed``, step, chunk)
and goes to the engine's own per-call generator (the torch engine's ``torch.Generator``, vLLM's
per-request seed), never to a process-wide RNG. The same weights therefore give the same
figures, whichever attempt computes them.

Metrics (``metrics/catalogue.py`` exports them; ``<pass>`` is ``greedy`` or ``sampled``):
``val/<pass>/reward/mean`` and ``/reward/std`` over all responses,
``val/<pass>/<data_source>/reward/mean`` per data source, ``val/<pass>/response/length_mean``,
``val/<pass>/reward/best_of_n_mean`` (sampled, ``samples > 1``: the mean over prompts of the
best of their responses), ``val/prompts`` and ``val/seconds``.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

from hybridflow.controller import Batch
from hybridflow.data import PromptDataset
from hybridflow.data.files import PromptDataError, read_prompt_files
from hybridflow.rewards.scorer import RewardScorer
from hybridflow.spec import EvaluationSpec, RLHFJobSpec
from hybridflow.spec.evaluation import EvaluationPass

__all__ = [
    "EVALUATION_SEED_OFFSET",
    "PassResult",
    "ValidationSet",
    "evaluate",
    "evaluation_due",
    "metric_segment",
    "pass_metrics",
    "prompt_chunks",
    "sampled_pass_seed",
]

EVALUATION_SEED_OFFSET = 1 << 40
"""Added to every sampled-pass seed. Training's seeds (``training.seed * 100_003 + step``) stay far
below it, so no evaluation reuses a training step's sampling stream, even in an engine that kept
one per seed; every seed stays below ``2**41``, so the rollout's ``seed * 1000 + rank`` fits in 64 bits."""

_NOT_IN_A_KEY_SEGMENT = re.compile(r"[^A-Za-z0-9_.+-]")


def evaluation_due(step: int, total_steps: int, every_steps: int) -> bool:
    """Whether step ``step`` ends with an evaluation: every ``every_steps`` steps (0: never) and the last.

    >>> [s for s in range(1, 6) if evaluation_due(s, 5, 2)], [s for s in range(1, 6) if evaluation_due(s, 5, 0)]
    ([2, 4, 5], [5])
    """
    return step == total_steps or (every_steps > 0 and step % every_steps == 0)


def sampled_pass_seed(training_seed: int, step: int, chunk: int) -> int:
    """The seed of the sampled pass's ``chunk``-th generation after step ``step`` (0: at the start).

    A function of the step, not of how many evaluations ran before: a resumed run draws what an
    uninterrupted one draws. Chunks of one evaluation never share a seed (``chunk < 2**16``).

    >>> sampled_pass_seed(0, 2, 1) - EVALUATION_SEED_OFFSET
    131073
    """
    if not 0 <= chunk < 1 << 16:
        raise ValueError(f"chunk {chunk} must be in [0, 65536)")
    return EVALUATION_SEED_OFFSET + (((training_seed * 100_003 + step) % (1 << 24)) << 16) + chunk


def prompt_chunks(count: int, chunk_size: int) -> list[range]:
    """Indices ``0 .. count-1`` in order, cut into generations of at most ``chunk_size`` prompts.

    >>> prompt_chunks(5, 2)
    [range(0, 2), range(2, 4), range(4, 5)]
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size} must be >= 1")
    return [range(start, min(start + chunk_size, count)) for start in range(0, count, chunk_size)]


def metric_segment(name: str) -> str:
    """``name`` (a data source) as one segment of a metric key: no ``/``, only ``[A-Za-z0-9_.+-]``.

    >>> metric_segment("openai/gsm8k"), metric_segment("")
    ('openai_gsm8k', 'unknown')
    """
    return _NOT_IN_A_KEY_SEGMENT.sub("_", name) or "unknown"


@dataclass(frozen=True)
class PassResult:
    """One pass over the validation prompts: per response, rows interleaved per prompt
    (``samples`` consecutive rows are one prompt's responses)."""

    scores: tuple[float, ...]
    lengths: tuple[float, ...]
    data_sources: tuple[str, ...]
    samples: int


def pass_metrics(name: EvaluationPass, result: PassResult) -> dict[str, float]:
    """The ``val/<name>/...`` figures of one pass (see the module docstring)."""
    scores, n = result.scores, result.samples
    if not scores or len(scores) % n:
        raise ValueError(f"{len(scores)} responses do not split into prompts of {n} samples each")
    prefix = f"val/{name}"
    metrics = {
        f"{prefix}/reward/mean": statistics.fmean(scores),
        f"{prefix}/reward/std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
        f"{prefix}/response/length_mean": statistics.fmean(result.lengths),
    }
    by_source: dict[str, list[float]] = {}
    for source, score in zip(result.data_sources, scores, strict=True):
        by_source.setdefault(metric_segment(source), []).append(score)
    for source, values in sorted(by_source.items()):
        metrics[f"{prefix}/{source}/reward/mean"] = statistics.fmean(values)
    if n > 1:
        best = [max(scores[start : start + n]) for start in range(0, len(scores), n)]
        metrics[f"{prefix}/reward/best_of_n_mean"] = statistics.fmean(best)
    return metrics


@dataclass(frozen=True)
class ValidationSet:
    """The tokenized validation prompts and the evaluation settings they are scored with."""

    dataset: PromptDataset
    settings: EvaluationSpec

    @classmethod
    def load(cls, spec: RLHFJobSpec, tokenizer: Any) -> ValidationSet | None:
        """The job's validation set; None when it has no ``spec.data.valFiles``.

        Raises :class:`PromptDataError` naming ``spec.data.valFiles`` when the files hold no usable prompt.
        """
        settings = spec.evaluation_settings
        if settings is None:
            return None
        try:
            rows = read_prompt_files(spec.data.val_files, prompt_key=spec.data.prompt_key)
            if settings.max_prompts is not None:
                rows = rows[: settings.max_prompts]
            dataset = PromptDataset.from_rows(
                rows,
                tokenizer,
                max_prompt_tokens=spec.data.max_prompt_tokens,
                source=", ".join(spec.data.val_files),
            )
        except PromptDataError as error:
            raise PromptDataError(f"spec.data.valFiles: {error}") from error
        return cls(dataset, settings)


def evaluate(
    validation: ValidationSet,
    rollout: Any,
    scorer: RewardScorer,
    spec: RLHFJobSpec,
    *,
    step: int,
    sync: bool,
) -> dict[str, float]:
    """Every pass of ``validation.settings`` over the validation prompts with the rollout's current
    weights; the ``val/...`` figures (protocol: the module docstring).

    ``rollout`` is what the step generates with (a worker group, or server mode's
    ``ServedRollout``); ``sync``: load the actor's weights into it first.
    """
    started = time.monotonic()
    if sync:
        rollout.sync_weights()
    metrics: dict[str, float] = {}
    for name in validation.settings.passes:
        result = _run_pass(validation, rollout, scorer, spec, name, step)
        metrics.update(pass_metrics(name, result))
    metrics["val/prompts"] = float(len(validation.dataset))
    metrics["val/seconds"] = time.monotonic() - started
    return metrics


def _run_pass(
    validation: ValidationSet,
    rollout: Any,
    scorer: RewardScorer,
    spec: RLHFJobSpec,
    name: EvaluationPass,
    step: int,
) -> PassResult:
    """Generate and score one pass, a training step's worth of prompts per generation."""
    samples = 1 if name == "greedy" else validation.settings.samples
    scores: list[float] = []
    lengths: list[float] = []
    sources: list[str] = []
    chunks = prompt_chunks(len(validation.dataset), spec.training.prompts_per_step)
    for index, chunk in enumerate(chunks):
        meta: dict[str, Any] = {"samples": samples, "greedy": name == "greedy"}
        if name == "sampled":
            meta["seed"] = sampled_pass_seed(spec.training.seed, step, index)
        prompts = Batch.from_dict(validation.dataset.take(chunk).to_batch_fields(), meta=meta)
        responses = rollout.generate_sequences(prompts)
        chunk_scores, _ = scorer.scores(responses)
        scores += [float(score) for score in chunk_scores]
        lengths += [float(length) for length in responses.tensors["response_mask"].sum(dim=1)]
        sources += [str(source) for source in responses.non_tensors["data_source"]]
    return PassResult(tuple(scores), tuple(lengths), tuple(sources), samples)
