"""A multi-turn trajectory, token-exact: what the engine generated and what was inserted, and which is which.

Everything after the prompt is one token list. Model turns append the engine's token ids with
their log-probs and policy versions (``loss_mask`` 1); inserted turns (tool results,
observations) append the ids their text encoded to (``loss_mask`` 0, log-prob 0, and the
version of the model token before them, so that they never make a sample look older). The
trainer gets these lists as they are: no model turn is ever decoded and encoded again, so the
trainer scores exactly the tokens the engine sampled (``response_tensors`` with ``loss_masks``:
inserted tokens are attended to and excluded from the loss and the KL).

The budget is ``rollout.maxResponseTokens`` for everything after the prompt, the training
layout's response width. An insertion that would leave no room for a model token is dropped and
the trajectory ends: a trajectory always ends with a model turn, where its reward is placed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Trajectory"]


@dataclass
class Trajectory:
    prompt_ids: list[int]
    budget: int
    started_at: float
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    last_turn: tuple[int, int] = (0, 0)
    """Where the last model turn lies in ``token_ids`` (its text is what the reward reads)."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: list[float] = field(default_factory=list)
    env_steps: int = 0
    """Model turns an environment's ``step`` took (``EnvironmentLoop``; tool loops take none)."""
    reward: float | None = None
    """The score the loop gave last (an environment's summed rewards so far, or at its end), if any."""
    finish_reason: str | None = None
    """``None`` while running; then ``answer``, ``max_turns``, ``budget``, ``timeout`` or the loop's reason."""

    @property
    def tokens_left(self) -> int:
        return self.budget - len(self.token_ids)

    @property
    def context_ids(self) -> list[int]:
        """The next model turn's prompt: the prompt and everything so far."""
        return self.prompt_ids + self.token_ids

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if len(token_ids) > self.tokens_left:
            raise ValueError(f"a model turn of {len(token_ids)} tokens exceeds the {self.tokens_left} left")
        start = len(self.token_ids)
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns += 1
        self.last_turn = (start, len(self.token_ids))

    def insert(self, token_ids: list[int]) -> bool:
        """Append an inserted turn if a model token still fits after it; else end the trajectory (``budget``)."""
        if len(token_ids) >= self.tokens_left:
            self.finish_reason = "budget"
            return False
        version = self.versions[-1] if self.versions else 0
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        return True

    @property
    def masked_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)
