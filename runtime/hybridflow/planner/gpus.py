"""The GPUs the planner knows, how it recognises one by name, and which one a job is planned for.

Every GPU of ``spec.resourcePools[].gpuType`` (``hybridflow.spec.resources.GpuType``) has an entry
in :data:`KNOWN_GPUS`: its datasheet figures, each with its source next to it, and the names CUDA
and NVML give it. The peaks come from :data:`hybridflow.metrics.flops.PEAK_BF16_FLOPS`, the table
the MFU metric reads, so the planner and the metric never disagree about a GPU. What no datasheet
states (the fraction of peak a pass sustains, fixed per-call costs) is the A100 testbed's
assumption for every GPU (:data:`~hybridflow.planner.hardware.A100_80GB`); ``hybridflow plan
--profile`` measures them.

Names. CUDA's name of a device (``torch.cuda.get_device_properties(0).name``) and NVIDIA GPU
feature discovery's node label ``nvidia.com/gpu.product`` spell the same NVML name, the label with
dashes for spaces (``NVIDIA H100 80GB HBM3``, ``NVIDIA-H100-80GB-HBM3``); older drivers leave out
the ``NVIDIA`` prefix. :func:`gpu_type_of` compares names with case, dashes, underscores and that
prefix ignored, and only with the names listed: a variant it has not seen (an H100 NVL, an H200
NVL, a MIG slice, a time-shared GPU) is refused, not planned for as the GPU it resembles.

Which GPU a plan is for (the resolution of ``placement: auto`` and ``hybridflow plan``):

* In a cluster (:func:`cluster_device`, ``hybridflow run --in-cluster``): the controller runs in
  the Ray head pod, which has no GPU to look at, so the budget pool must say: its ``gpuType``,
  else its ``nodeSelector`` on ``nvidia.com/gpu.product``. Neither is refused (at admission by
  the CRD's rule ``auto-placement-knows-the-gpu``; here too, for a manifest that skipped it), as is
  a label value not in the table.
* A local run (:func:`local_device`): on a machine without CUDA, the simulated GPU that the
  workers are (:data:`~hybridflow.planner.hardware.SIMULATED_CPU_GPU` on this machine's cores).
  With CUDA, device 0: its table entry by name, with the memory the device reports; a
  ``gpuType`` on the pool stands in for the name (how to plan a GPU the table does not know, as
  its closest known one). An unknown name without ``gpuType`` is refused.
* ``hybridflow plan`` (:func:`declared_device`, then :func:`local_device`): what the pools
  declare, else this machine's device as a local run sees it.

Everything here but :func:`cuda_device` is pure: the CUDA read is that one thin function, and
the rest takes its result (a :class:`CudaDevice`) as an argument.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import get_args

from hybridflow.metrics.flops import peak_flops
from hybridflow.planner.hardware import A100_80GB, SIMULATED_CPU_GPU, DeviceConstants
from hybridflow.planner.shapes import PlannerInputError
from hybridflow.spec import RLHFJobSpec
from hybridflow.spec.resources import GPU_PRODUCT_LABEL, GpuType, ResourcePoolSpec
from hybridflow.spec.rules import quoted_list

__all__ = [
    "GPU_TYPES",
    "KNOWN_GPUS",
    "CudaDevice",
    "KnownGpu",
    "cluster_device",
    "cuda_device",
    "declared_device",
    "device_for_cuda",
    "gpu_constants",
    "gpu_type_of",
    "local_device",
    "simulated_device",
]

GPU_TYPES: tuple[GpuType, ...] = get_args(GpuType)
"""The allowed values of ``gpuType``, in the spec's order."""


@dataclass(frozen=True)
class KnownGpu:
    """One GPU of the table: its constants and the names CUDA/NVML give it (first: the usual one)."""

    constants: DeviceConstants
    device_names: tuple[str, ...]

    @property
    def product_labels(self) -> tuple[str, ...]:
        """The ``nvidia.com/gpu.product`` values GPU feature discovery gives nodes of this GPU."""
        return tuple(name.replace(" ", "-") for name in self.device_names)


def _datasheet_peak(device_name: str) -> float:
    """The dense bf16 peak of ``device_name`` from the MFU table (one source for both)."""
    flops = peak_flops(device_name)
    if flops is None:
        raise AssertionError(f"hybridflow.metrics.flops.PEAK_BF16_FLOPS has no row for {device_name!r}")
    return flops


# Collectives inside a node: per-GPU bandwidth in one direction, of which a ring attains ~80%
# (as A100_80GB's NVLink figure). NVLink 3 (A100 SXM4): 600 GB/s both directions; NVLink 4 (H100,
# H200 SXM5): 900 GB/s; PCIe Gen4 x16: 64 GB/s, Gen5 x16: 128 GB/s (the datasheets'
# "Interconnect" rows, both directions). PCIe cards' optional NVLink bridges join pairs only, so
# an 8-GPU node of them reduces over PCIe.
_RING_SHARE = 0.8
_NVLINK3 = _RING_SHARE * 600e9 / 2
_NVLINK4 = _RING_SHARE * 900e9 / 2
_PCIE4 = _RING_SHARE * 64e9 / 2
_PCIE5 = _RING_SHARE * 128e9 / 2


def _gpu(name: str, device_name: str, *, memory_bytes: float, hbm: float, intra: float) -> DeviceConstants:
    """A GPU with the A100 testbed's assumed efficiencies and overheads and its own datasheet figures.

    The network between nodes is the cluster's, not the GPU's: every GPU keeps the testbed's
    200 Gbps per node (``A100_80GB.inter_node_bytes_per_second``).
    """
    return replace(
        A100_80GB,
        name=name,
        peak_flops=_datasheet_peak(device_name),
        memory_bytes=memory_bytes,
        memory_bandwidth_bytes_per_second=hbm,
        intra_node_bytes_per_second=intra,
    )


KNOWN_GPUS: dict[GpuType, KnownGpu] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB): 312 TFLOPS bf16 dense,
    # HBM2 1,555 GB/s (40GB), HBM2e 1,935 GB/s (80GB PCIe) / 2,039 GB/s (80GB SXM), NVLink 600 GB/s
    # (SXM), PCIe Gen4 64 GB/s.
    "A100-40GB": KnownGpu(
        _gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", memory_bytes=40e9, hbm=1.555e12, intra=_NVLINK3),
        ("NVIDIA A100-SXM4-40GB",),
    ),
    # The paper's testbed, as it was (hardware.A100_80GB); "A100-SXM-80GB" on some HGX boards.
    "A100-80GB": KnownGpu(A100_80GB, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM-80GB")),
    "A100-PCIe-40GB": KnownGpu(
        _gpu("A100-PCIe-40GB", "NVIDIA A100-PCIE-40GB", memory_bytes=40e9, hbm=1.555e12, intra=_PCIE4),
        ("NVIDIA A100-PCIE-40GB",),
    ),
    "A100-PCIe-80GB": KnownGpu(
        _gpu("A100-PCIe-80GB", "NVIDIA A100 80GB PCIe", memory_bytes=80e9, hbm=1.935e12, intra=_PCIE4),
        ("NVIDIA A100 80GB PCIe",),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM 989 TFLOPS bf16 dense (1,979 sparse), 80 GB HBM3
    # at 3.35 TB/s, NVLink 900 GB/s; PCIe 756 TFLOPS (1,513 sparse), 80 GB HBM2e at 2 TB/s, PCIe Gen5
    # 128 GB/s.
    "H100-80GB": KnownGpu(
        _gpu("H100-80GB", "NVIDIA H100 80GB HBM3", memory_bytes=80e9, hbm=3.35e12, intra=_NVLINK4),
        ("NVIDIA H100 80GB HBM3",),
    ),
    "H100-PCIe": KnownGpu(
        _gpu("H100-PCIe", "NVIDIA H100 PCIe", memory_bytes=80e9, hbm=2.0e12, intra=_PCIE5),
        ("NVIDIA H100 PCIe",),
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: 989 TFLOPS bf16 dense (1,979 sparse), 141 GB
    # HBM3e at 4.8 TB/s, NVLink 900 GB/s. (The H200 NVL is another card: refused.)
    "H200": KnownGpu(
        _gpu("H200", "NVIDIA H200", memory_bytes=141e9, hbm=4.8e12, intra=_NVLINK4),
        ("NVIDIA H200",),
    ),
    # NVIDIA L40S datasheet: 362 TFLOPS bf16 dense (733 sparse), 48 GB GDDR6 at 864 GB/s, PCIe Gen4
    # x16 64 GB/s, no NVLink.
    "L40S": KnownGpu(
        _gpu("L40S", "NVIDIA L40S", memory_bytes=48e9, hbm=864e9, intra=_PCIE4),
        ("NVIDIA L40S",),
    ),
    # NVIDIA L4 datasheet: 121 TFLOPS bf16 dense (242 sparse), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16.
    "L4": KnownGpu(
        _gpu("L4", "NVIDIA L4", memory_bytes=24e9, hbm=300e9, intra=_PCIE4),
        ("NVIDIA L4",),
    ),
    # AWS's A10G (EC2 G5) has no NVIDIA datasheet: 24 GB GDDR6 at 600 GB/s as the A10, 70 TFLOPS
    # bf16 dense (Baseten, "NVIDIA A10 vs A10G for ML model inference"), PCIe Gen4 x16.
    "A10G": KnownGpu(
        _gpu("A10G", "NVIDIA A10G", memory_bytes=24e9, hbm=600e9, intra=_PCIE4),
        ("NVIDIA A10G",),
    ),
    # NVIDIA A10 datasheet: 125 TFLOPS bf16 dense (250 sparse), 24 GB GDDR6 at 600 GB/s, PCIe Gen4 64 GB/s.
    "A10": KnownGpu(
        _gpu("A10", "NVIDIA A10", memory_bytes=24e9, hbm=600e9, intra=_PCIE4),
        ("NVIDIA A10",),
    ),
}
"""Every ``gpuType``'s constants and names (a test holds the keys to ``GpuType``'s values)."""


def _normalised(name: str) -> str:
    """``name`` upper-cased, with dashes, underscores and runs of spaces as one space, without ``NVIDIA``."""
    tokens = [token for token in re.split(r"[\s_-]+", name.upper()) if token]
    if tokens and tokens[0] == "NVIDIA":
        tokens = tokens[1:]
    return " ".join(tokens)


_BY_NAME: dict[str, GpuType] = {
    _normalised(device_name): gpu_type
    for gpu_type, gpu in KNOWN_GPUS.items()
    for device_name in gpu.device_names
}
_KNOWN_DEVICE_NAMES = [name for gpu in KNOWN_GPUS.values() for name in gpu.device_names]
_KNOWN_PRODUCT_LABELS = [label for gpu in KNOWN_GPUS.values() for label in gpu.product_labels]


def gpu_type_of(name: str) -> GpuType | None:
    """The table's GPU a CUDA device name or ``nvidia.com/gpu.product`` value names, or None."""
    return _BY_NAME.get(_normalised(name))


def _why_not_whole(name: str) -> str:
    """Why a recognisable name is still not a GPU to plan for ('' when nothing is amiss)."""
    tokens = _normalised(name).split()
    if "MIG" in tokens:
        return " (a MIG slice: the planner plans whole GPUs)"
    if "SHARED" in tokens:
        return " (a time-shared GPU: the planner plans GPUs of its own)"
    return ""


def gpu_constants(gpu_type: GpuType, source: str) -> DeviceConstants:
    """The table's constants of ``gpu_type``, named after it and where it was read (``source``)."""
    return replace(KNOWN_GPUS[gpu_type].constants, name=f"{gpu_type} ({source})")


def _pool_gpu(pool: ResourcePoolSpec, field: str) -> tuple[GpuType, str] | None:
    """The GPU type ``pool`` declares and where (``field`` is the pool's path), or None if it says nothing.

    ``gpuType`` comes first; a product label that names another known GPU contradicts it and is
    refused (one of the two is a mistake), an unknown one is left to ``gpuType`` to replace.
    """
    label = pool.node_selector.get(GPU_PRODUCT_LABEL)
    labelled = gpu_type_of(label) if label is not None else None
    label_field = f"{field}.nodeSelector[{GPU_PRODUCT_LABEL!r}]"
    if pool.gpu_type is not None:
        if labelled is not None and labelled != pool.gpu_type:
            raise PlannerInputError(
                f"{field}.gpuType: {pool.gpu_type!r} contradicts {label_field} {label!r}, which is "
                f"{labelled!r}; set one of them to the pool's GPU"
            )
        return pool.gpu_type, f"{field}.gpuType"
    if label is None:
        return None
    if labelled is None:
        raise PlannerInputError(
            f"{label_field}: {label!r} is none of the GPUs the planner knows{_why_not_whole(label)} "
            f"(known: {quoted_list(_KNOWN_PRODUCT_LABELS)}); set {field}.gpuType to the closest of "
            f"{quoted_list(GPU_TYPES)} to plan for that GPU"
        )
    return labelled, f"{GPU_PRODUCT_LABEL} {label}"


def declared_device(spec: RLHFJobSpec) -> DeviceConstants | None:
    """The GPU the pools of ``spec`` declare (``gpuType``, else the product label), or None if none does.

    The planner costs one GPU type: pools that declare different ones are refused.
    """
    declared = [
        found
        for index, pool in enumerate(spec.resource_pools)
        if (found := _pool_gpu(pool, f"spec.resourcePools[{index}]")) is not None
    ]
    if len({gpu_type for gpu_type, _ in declared}) > 1:
        listed = ", ".join(f"{gpu_type} ({source})" for gpu_type, source in declared)
        raise PlannerInputError(
            f"spec.resourcePools: the planner plans for one GPU type, and the pools declare {listed}"
        )
    if not declared:
        return None
    gpu_type, source = declared[0]
    return gpu_constants(gpu_type, source)


def cluster_device(spec: RLHFJobSpec) -> DeviceConstants:
    """The GPU ``hybridflow run --in-cluster`` plans for: what the budget pool declares (see the module docstring)."""
    device = declared_device(spec)
    if device is None:
        raise PlannerInputError(
            f"spec.resourcePools[0].gpuType: required in a cluster when nodeSelector has no "
            f"{GPU_PRODUCT_LABEL} label: the controller runs in the Ray head pod, which has no GPU to look "
            f"at; set it to one of {quoted_list(GPU_TYPES)}"
        )
    return device


@dataclass(frozen=True)
class CudaDevice:
    """What CUDA reports of device 0 (``torch.cuda.get_device_properties(0)``)."""

    name: str
    memory_bytes: int


def cuda_device() -> CudaDevice | None:
    """This process's CUDA device 0, or None without CUDA: the one function here that asks torch."""
    import torch

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return CudaDevice(name=str(properties.name), memory_bytes=int(properties.total_memory))


def device_for_cuda(name: str, memory_bytes: float, *, gpu_type: GpuType | None = None) -> DeviceConstants:
    """The constants of a CUDA GPU named ``name`` with ``memory_bytes`` of memory.

    The table's entry for the name, or for ``gpu_type`` when the pool sets one (it replaces the
    name: a GPU the table does not know is planned as the GPU it names); the memory is always the
    device's. An unknown name without ``gpu_type`` is refused.
    """
    seen = f"CUDA device {name!r}, {memory_bytes / 1e9:.1f} GB"
    chosen = gpu_type or gpu_type_of(name)
    if chosen is None:
        raise PlannerInputError(
            f"{seen} is none of the GPUs the planner knows{_why_not_whole(name)} (known: "
            f"{quoted_list(_KNOWN_DEVICE_NAMES)}); set spec.resourcePools[0].gpuType to the closest of "
            f"{quoted_list(GPU_TYPES)} to plan as if it were that GPU (with this device's memory)"
        )
    source = seen if gpu_type is None else f"spec.resourcePools[0].gpuType, on {seen}"
    return replace(gpu_constants(chosen, source), memory_bytes=float(memory_bytes))


def simulated_device(cores: int) -> DeviceConstants:
    """The simulated GPU of a machine without CUDA: one worker process sharing ``cores`` cores with the others."""
    return replace(SIMULATED_CPU_GPU, compute_slots=cores, host_cores=cores)


def local_device(spec: RLHFJobSpec, cuda: CudaDevice | None, *, cores: int) -> DeviceConstants:
    """The GPU a local ``hybridflow run`` plans for: this machine's (see the module docstring).

    ``cuda`` is :func:`cuda_device`'s answer. The budget pool's ``gpuType`` replaces the CUDA
    device's name; without CUDA the workers are simulated GPUs on the CPU, whatever the pools say.
    """
    if cuda is None:
        return simulated_device(cores)
    pool = spec.resource_pools[0]
    return device_for_cuda(cuda.name, cuda.memory_bytes, gpu_type=pool.gpu_type)
