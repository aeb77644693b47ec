"""The process probes of ``hybridflow.resharding.meter``: memory high-water mark and loopback counter.

The traffic meter itself is checked on 8 gloo ranks in ``tests/integration/test_resharding.py``
(every transition's counted bytes equal the plan's messages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.resharding.meter import PeakMemory, Traffic, loopback_rx_bytes, resident_bytes

MIB = 1 << 20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_sees_a_transient_allocation_and_not_the_memory_resident_before() -> None:
    resident = torch.ones(32 * MIB // 4)  # resident before the window: not part of its peak
    with PeakMemory("cpu") as probe:
        transient = torch.ones(64 * MIB // 4)  # written, so resident; freed before the window ends
        del transient
    assert probe.bytes is not None
    # Page-granular and process-wide: other pages freed or touched meanwhile move it by KBs.
    assert 63 * MIB <= probe.bytes < 64 * MIB + 16 * MIB, probe.bytes
    with PeakMemory("cpu") as idle:
        pass
    assert idle.bytes is not None and idle.bytes < 16 * MIB
    assert resident_bytes() >= resident.nbytes


def test_loopback_counter_is_read_from_the_kernel() -> None:
    first = loopback_rx_bytes()
    if first is None:
        pytest.skip("no loopback counter in /sys/class/net or /proc/net/dev")
    second = loopback_rx_bytes()
    assert second is not None and second >= first >= 0


def test_traffic_adds_and_subtracts_fieldwise() -> None:
    total = Traffic(10, 20, 1) + Traffic(1, 2, 3)
    assert total == Traffic(11, 22, 4)
    assert total - Traffic(1, 2, 3) == Traffic(10, 20, 1)
