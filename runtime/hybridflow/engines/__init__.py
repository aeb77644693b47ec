"""Generation behind one interface: :class:`RolloutEngine` and the tensors the trainer gets back.

This package's top level imports only torch: the engines themselves live in their own modules
and are imported from there (``hybridflow.engines.torch_engine.TorchRolloutEngine``), because
each pulls in its own heavy stack (transformers, vLLM) that a worker not using it should not
pay for.
"""

from hybridflow.engines.base import (
    EngineStateError,
    FinishReason,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
)
from hybridflow.engines.layout import RolloutTensors, response_tensors

__all__ = [
    "EngineStateError",
    "FinishReason",
    "RolloutEngine",
    "RolloutOutput",
    "RolloutTensors",
    "SamplingParams",
    "response_tensors",
]
