"""Facts about the host this process runs on (a leaf: no torch, no Ray)."""

from __future__ import annotations

import os

__all__ = ["available_cores"]


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
