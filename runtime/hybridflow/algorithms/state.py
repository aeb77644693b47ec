"""Controller-side algorithm state that must survive a restart (saved in every checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.rlmath.core import AdaptiveKLController, FixedKLController, LagrangeMultiplier
from hybridflow.spec import RLHFJobSpec

__all__ = ["AlgorithmState"]


def _kl_controller(spec: RLHFJobSpec) -> FixedKLController | AdaptiveKLController:
    kl = spec.algorithm.kl
    if kl.controller == "adaptive":
        return AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon)
    return FixedKLController(kl.coef)


INITIAL_LAGRANGE_LAMBDA = 1.0
MAX_LAGRANGE_LAMBDA = 100.0


@dataclass
class AlgorithmState:
    """The KL controller, and for Safe-RLHF the Lagrange multiplier of the cost constraint."""

    spec: RLHFJobSpec
    kl_controller: FixedKLController | AdaptiveKLController = field(init=False)
    lagrange: LagrangeMultiplier | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.kl_controller = _kl_controller(self.spec)
        algo = self.spec.algorithm
        if algo.name == "safe-rlhf":
            self.lagrange = LagrangeMultiplier(
                INITIAL_LAGRANGE_LAMBDA, algo.cost_limit, algo.lagrangian_learning_rate, MAX_LAGRANGE_LAMBDA
            )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_controller": self.kl_controller.state_dict()}
        if self.lagrange is not None:
            state["lagrange"] = self.lagrange.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        if self.lagrange is not None:
            self.lagrange.load_state_dict(state["lagrange"])
