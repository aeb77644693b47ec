"""Checkpoints: sharded worker state plus the controller's state, published atomically."""

from hybridflow.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
