"""What an algorithm's step sees: the worker groups, the reward scorer, its state, and which work it needs.

A step function is ``train_step(workers, prompts, scorer, state) -> metrics``: plain sequential
code over :class:`JobWorkers` (``workers.rollout.generate_sequences(prompts)``,
``workers.actor.update_policy(batch)``, ...), scoring with
:class:`~hybridflow.rewards.scorer.RewardScorer`, keeping what must survive a restart in
:class:`~hybridflow.algorithms.state.AlgorithmState`, and timing its phases with a
:class:`~hybridflow.algorithms.timing.StepTimer` (``timing/<phase>``; the trainer adds the rest
of the step as ``timing/other``). The built-ins (``ppo.py``, ``grpo.py``...)
and user plugins (``spec.algorithm.name: "package.module:train_step"``) are written against
this module alone; the trainer, which deploys the roles and runs the loop, sits above it.

Which work a step needs follows from the spec, not from the algorithm's code, so the trainer
deploys only the roles that will be called and the shared rollout skips passes nobody reads:

* :func:`needs_reference`: a reference model is loaded and run only with ``kl.coef > 0``.
* :func:`needs_old_log_probs`: the separate "old" log-prob pass runs only when the update is
  off-policy (more than one mini-batch or epoch, where the policy moves between the rollout and
  a later mini-batch) or the KL is a reward penalty (computed before the update). On-policy,
  the actor takes the detached log-probs of its own forward instead: the ratio is exactly 1
  and the gradient is the same.
* :func:`needs_weight_sync`: the rollout's engine is loaded with the actor's weights before
  each generation, except where the torch engine generates from the actor's own module (one
  GPU, FSDP, colocated): there is nothing to load, and the call would only cost a round trip.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.algorithms.prefetch import PrefetchedRollout
from hybridflow.algorithms.state import AlgorithmState
from hybridflow.algorithms.timing import StepTimer
from hybridflow.controller import Batch, Deployment, WorkerGroup
from hybridflow.rewards.scorer import RewardScorer
from hybridflow.spec import RLHFJobSpec

__all__ = [
    "AlgorithmState",
    "JobWorkers",
    "RewardScorer",
    "StepFunction",
    "StepTimer",
    "load_step_function",
    "needs_old_log_probs",
    "needs_reference",
    "needs_weight_sync",
    "reference_from_actor",
]


@dataclass(frozen=True)
class JobWorkers:
    """The worker groups a step talks to; reference, critics, reward and cost models only when the job has them."""

    actor: WorkerGroup
    rollout: WorkerGroup | PrefetchedRollout | Any
    """The rollout's group; in an overlapped job, its prefetching stand-in (``algorithms/prefetch.py``);
    in server mode, the service's :class:`~hybridflow.rollout.service.ServedRollout`."""
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    cost: WorkerGroup | None = None
    cost_critic: WorkerGroup | None = None

    @classmethod
    def of(
        cls, deployment: Deployment, rollout: Any = None, *, reference_from_actor: bool = False
    ) -> JobWorkers:
        """The deployment's groups; ``rollout`` stands in for a rollout the deployment does not hold.

        ``reference_from_actor``: the actor's group answers the reference's calls (with
        ``spec.training.lora`` the reference policy is the actor's base, its adapter switched off:
        :func:`reference_from_actor`).
        """
        groups = deployment.groups
        reference = groups.get("reference")
        if reference is None and reference_from_actor:
            reference = groups["actor"]
        return cls(
            actor=groups["actor"],
            rollout=rollout if rollout is not None else groups["rollout"],
            reference=reference,
            critic=groups.get("critic"),
            reward=groups.get("reward"),
            cost=groups.get("cost"),
            cost_critic=groups.get("cost_critic"),
        )


StepFunction = Callable[[JobWorkers, Batch, RewardScorer, AlgorithmState], dict[str, float]]


def reference_from_actor(spec: RLHFJobSpec) -> bool:
    """Whether the actor computes the reference's log-probs itself (a KL term with ``spec.training.lora``)."""
    return needs_reference(spec) and spec.training.lora is not None


def needs_reference(spec: RLHFJobSpec) -> bool:
    """Whether any KL term reads the reference's log-probs (``kl.coef`` 0 disables KL entirely)."""
    return spec.algorithm.kl.coef > 0


def is_on_policy(spec: RLHFJobSpec) -> bool:
    """One mini-batch and one epoch: the update's policy is the rollout's for every token."""
    sequences = spec.training.prompts_per_step * spec.algorithm.samples_per_prompt
    return spec.algorithm.ppo_epochs == 1 and spec.training.mini_batch_size >= sequences


def needs_old_log_probs(spec: RLHFJobSpec) -> bool:
    """Whether the rollout must run the actor's separate log-prob pass (see the module docstring)."""
    kl_in_reward = spec.algorithm.kl.mode == "reward" and needs_reference(spec)
    return kl_in_reward or not is_on_policy(spec)


def needs_weight_sync(spec: RLHFJobSpec) -> bool:
    """Whether a colocated rollout must load the actor's weights before generating.

    Not when its torch engine runs the actor's own module: the FSDP backend on a one-GPU actor
    pool shared with the rollout (``workers/rollout.py``, ``shares_actor_module``, decides the
    same from the deployed pool).
    """
    actor_pool = spec.pool("actor")
    return not (
        not spec.rollout_has_own_pool
        and actor_pool.nodes * actor_pool.gpus_per_node == 1
        and spec.training.backend == "fsdp"
        and spec.rollout.engine == "torch"
    )


def load_step_function(name: str) -> StepFunction:
    """The step function ``"package.module:function"`` names; errors name the value and what is wrong."""
    module_name, separator, attribute = name.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(
            f"spec.algorithm.name: {name!r} is neither a built-in nor 'package.module:train_step'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"spec.algorithm.name: {name!r}: module {module_name!r} could not be imported ({error})"
        ) from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(
            f"spec.algorithm.name: {name!r}: module {module_name!r} has no function {attribute!r}"
        )
    step: StepFunction = function
    return step
