"""Controller-side algorithm state that must survive a restart (saved in every checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.algorithms.core import AdaptiveKLController, FixedKLController
from hybridflow.spec import RLHFJobSpec

__all__ = ["AlgorithmState"]


def _kl_controller(spec: RLHFJobSpec) -> FixedKLController | AdaptiveKLController:
    kl = spec.algorithm.kl
    if kl.controller == "adaptive":
        return AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon)
    return FixedKLController(kl.coef)


@dataclass
class AlgorithmState:
    spec: RLHFJobSpec
    kl_controller: FixedKLController | AdaptiveKLController = field(init=False)

    def __post_init__(self) -> None:
        self.kl_controller = _kl_controller(self.spec)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
