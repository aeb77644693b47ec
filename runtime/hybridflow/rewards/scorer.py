"""Sequence scores for a rollout batch: weighted rule/user functions plus the reward model.

Rule and user functions run on the decoded response text in a pool of processes on the
controller's node (:mod:`hybridflow.rewards.parallel`), a chunk of samples per process, so a
slow function (a verifier, a math checker) uses the node's cores instead of one driver loop.
The reward model, when the job has one, is a worker group; its scores are requested before
the functions run, so both proceed at once. A function that raises is reported with its name
and the sample it failed on, not as a bare traceback.

The pool starts when the scorer is made, each process with a no-op task to run, so the trainer
makes the scorer before it deploys the workers and the processes start while the workers do,
not inside the first step. (A spawned child imports the parent's main script again: a few
milliseconds for ``hybridflow run``, seconds for a script that imports the ML stack at its top.)
The reward model's group, known only once the workers are deployed, is handed over with
:meth:`RewardScorer.use_reward_model`.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor

import torch

from hybridflow.controller import Batch, WorkerGroup
from hybridflow.host import available_cores
from hybridflow.rewards import resolve_reward_function
from hybridflow.rewards.parallel import Sample, SampleFailure, Score, score_chunk
from hybridflow.rlmath import core
from hybridflow.spec import RLHFJobSpec

__all__ = ["RewardFunctionError", "RewardScorer", "reward_processes", "reward_samples"]


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned a non-number; names the function and the sample."""


def reward_samples(batch: Batch) -> list[Sample]:
    """What the reward functions read of each row of a rollout batch.

    The token ids are the row's response columns under its attention mask (the engine layout:
    right-padded responses), so special tokens the decoded text drops are there; the finish
    reason is the rollout's ``finish_reason`` column. A hand-made batch without them gives None.
    """
    tensors, non_tensors = batch.tensors, batch.non_tensors
    token_ids: list[list[int] | None] = [None] * len(batch)
    if "responses" in tensors and "attention_mask" in tensors:
        responses = tensors["responses"]
        lengths = tensors["attention_mask"][:, -responses.shape[1] :].sum(dim=1).tolist()
        token_ids = [responses[row, :length].tolist() for row, length in enumerate(lengths)]
    reasons = non_tensors.get("finish_reason")
    return [
        Sample(
            data_source=str(non_tensors["data_source"][row]),
            response=str(non_tensors["response_text"][row]),
            ground_truth=non_tensors["ground_truth"][row],
            extra_info=non_tensors["extra_info"][row] or {},
            response_token_ids=token_ids[row],
            finish_reason=None if reasons is None else str(reasons[row]),
        )
        for row in range(len(batch))
    ]


def reward_processes() -> int:
    """Processes of the reward pool: the cores this process may use, at most 8."""
    return max(1, min(8, available_cores()))


class RewardScorer:
    """Scores batches for one job. ``close()`` (or a ``with`` block) stops the process pool."""

    def __init__(
        self, spec: RLHFJobSpec, reward_model: WorkerGroup | None, *, processes: int | None = None
    ) -> None:
        for index, f in enumerate(spec.rewards):  # fail fast, in the controller, on a bad name
            resolve_reward_function(f.function, f"spec.rewards[{index}].function")
        self.functions = [(f.function, f.weight) for f in spec.rewards]
        self.reward_model = reward_model
        self.processes = reward_processes() if processes is None else processes
        self._pool: Executor | None = None
        if self.functions:
            pool = self._executor()
            for _ in range(self.processes):
                pool.submit(int)  # each spawns a process now; nothing waits for them here

    def use_reward_model(self, reward_model: WorkerGroup | None) -> None:
        """The reward model's worker group (None: the job has none), once deployed."""
        self.reward_model = reward_model

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _executor(self) -> Executor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _function_scores(self, batch: Batch) -> list[list[Score]]:
        """``[function][row]`` scores, computed in chunks across the pool."""
        texts = batch.non_tensors["response_text"]
        samples = reward_samples(batch)
        names = [name for name, _ in self.functions]
        chunk = -(-len(samples) // self.processes)
        starts = list(range(0, len(samples), chunk))
        pool = self._executor()
        futures = [pool.submit(score_chunk, names, samples[start : start + chunk]) for start in starts]
        per_function: list[list[Score]] = [[] for _ in names]
        for start, future in zip(starts, futures, strict=True):
            result = future.result()
            if isinstance(result, SampleFailure):
                row = start + result.row
                raise RewardFunctionError(
                    f"reward function {result.function!r} failed on sample {batch.non_tensors['uid'][row]} "
                    f"(response {str(texts[row])[:80]!r}): {result.error}"
                )
            for values, chunk_values in zip(per_function, result, strict=True):
                values.extend(chunk_values)
        return per_function

    def scores(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per row (a token-level reward summed), and the mean of each component for the metrics."""
        scores, _, metrics = self.score_tokens(batch)
        return scores, metrics

    def score_tokens(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """``(scores, token_scores, metrics)``: :meth:`scores`, and where a function returned one value
        per response token, every row's rewards per token ``[rows, response columns]``.

        ``token_scores`` is None when every score is a number (the algorithms then place each
        score on the last response token, as they always did); otherwise it holds the token-level
        values where they fall and every number (the reward model's too) on the row's last
        response token (:func:`hybridflow.rlmath.core.place_token_rewards`). ``scores`` is always
        each row's total, what an algorithm that needs one number per response (GRPO, RLOO,
        ReMax, dynamic sampling) uses: a token-level reward counts as its sum.
        """
        total = torch.zeros(len(batch), dtype=torch.float32)
        outcome = torch.zeros(len(batch), dtype=torch.float32)  # the numbers: on the last token
        per_token: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        model_scores = (
            self.reward_model.compute_scores.submit(batch) if self.reward_model is not None else None
        )
        if self.functions:
            for (name, weight), values in zip(self.functions, self._function_scores(batch), strict=True):
                sums = torch.tensor(
                    [sum(v) if isinstance(v, list) else v for v in values], dtype=torch.float32
                )
                total += weight * sums
                metrics[f"reward/{name}"] = float(sums.mean())
                outcome += weight * torch.tensor([0.0 if isinstance(v, list) else v for v in values])
                if any(isinstance(v, list) for v in values):
                    per_token = (
                        torch.zeros(batch.tensors["responses"].shape) if per_token is None else per_token
                    )
                    for row, value in enumerate(values):
                        if isinstance(value, list):
                            per_token[row, : len(value)] += weight * torch.tensor(value)
        if model_scores is not None:
            rm = model_scores.result()["rm_scores"].float()
            total += rm
            outcome += rm
            metrics["reward/model"] = float(rm.mean())
        if per_token is None:
            return total, None, metrics
        token_scores = core.place_token_rewards(outcome, per_token, batch.tensors["response_mask"])
        return total, token_scores, metrics
