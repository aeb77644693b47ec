"""LoRA adapters on an HF model's linear layers: training only a low-rank update of a frozen base.

An adapted linear computes ``W x + b + scaling * B (A dropout(x))`` with the base ``W``, ``b``
frozen, ``A`` of shape ``[rank, in]``, ``B`` of ``[out, rank]`` and ``scaling = alpha / rank``
(Hu et al., 2021; the parametrisation PEFT and vLLM use). ``B`` starts at zero, so the adapted
model starts as the base model exactly, and ``A`` from a seeded Kaiming-uniform draw.

Names. :class:`LoRALinear` *is* the ``nn.Linear`` it adapts (same ``weight`` and ``bias``
parameters, same place in the module tree), with two submodules ``lora_A`` and ``lora_B``.
So the base keeps its HF name (``model.layers.0.self_attn.q_proj.weight``) and the adapter's
tensors are ``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``: PEFT's layout minus
its ``base_model.model.`` prefix, which an export adds back. Everything that moves weights by
HF name (the weight sync, the sync check, checkpoints) works on adapted models unchanged, and
:func:`is_adapter_name` tells an adapter's tensor from the base's.

Protocol, on every rank alike (identical results, no communication):

1. :func:`apply_lora` on the loaded (or meta) model, before FSDP sharding: swaps the target
   linears for :class:`LoRALinear` and freezes every other parameter.
2. After sharding and loading, :func:`initialize_adapters` fills ``A`` and ``B``: each rank
   draws the whole ``A`` of a module from a generator seeded by the seed and the module's name
   and keeps its own rows, so FSDP's shards together are one draw, whatever the world size.
3. :func:`adapters_disabled` switches every adapter off for the block: the frozen base model
   (the reference policy, with no second model loaded).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.spec.training import DEFAULT_LORA_TARGETS, LoRASpec

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LoRAConfig",
    "LoRALinear",
    "adapters_disabled",
    "apply_lora",
    "initialize_adapters",
    "is_adapter_name",
    "lora_config",
]

DEFAULT_TARGET_MODULES: tuple[str, ...] = DEFAULT_LORA_TARGETS
"""Every linear of a Qwen2/Llama decoder layer: what LoRA papers and RL recipes find works best
for RL (adapting the MLPs as well as attention), and what vLLM's LoRA supports for these models.
Defined with the spec's default (``spec.training.lora.targetModules``), which imports no torch."""

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoRAConfig:
    """An adapter's shape: what ``spec.training.lora`` holds, without the spec's types."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be positive")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(
                f"lora.target_modules={list(self.target_modules)!r} must be a non-empty list of "
                "module names (e.g. ['q_proj', 'v_proj'])"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout!r} must be in [0, 1)")

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor of ``B @ A`` (plain LoRA; rsLoRA is not supported)."""
        return self.alpha / self.rank

    def targets(self, module: str) -> bool:
        """Whether the module at path ``module`` is adapted: its last component is a target (PEFT's matching)."""
        return any(module == target or module.endswith("." + target) for target in self.target_modules)


def lora_config(spec: LoRASpec | None) -> LoRAConfig | None:
    """The adapter ``spec.training.lora`` describes (``None``: no LoRA)."""
    if spec is None:
        return None
    return LoRAConfig(
        rank=spec.rank, alpha=spec.alpha, target_modules=tuple(spec.target_modules), dropout=spec.dropout
    )


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` (an HF state-dict key) is an adapter's tensor rather than the base model's."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter; see the module docstring.

    Built from an existing linear by :meth:`adapt`, which keeps that linear's own parameters
    (no copy); the adapter's parameters are created on the same device and dtype (``meta``
    included), uninitialised until :func:`initialize_adapters`.
    """

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    enabled: bool

    @classmethod
    def adapt(cls, linear: nn.Linear, config: LoRAConfig) -> LoRALinear:
        adapted = cls.__new__(cls)
        nn.Module.__init__(adapted)
        adapted.in_features, adapted.out_features = linear.in_features, linear.out_features
        adapted.weight = linear.weight
        adapted.bias = linear.bias
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        adapted.lora_A = nn.Linear(linear.in_features, config.rank, bias=False, **factory)
        adapted.lora_B = nn.Linear(config.rank, linear.out_features, bias=False, **factory)
        adapted.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        adapted.scaling = config.scaling
        adapted.enabled = True
        return adapted

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = F.linear(input, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(input))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def apply_lora(model: nn.Module, config: LoRAConfig, *, skip: Sequence[str] = ("lm_head",)) -> list[str]:
    """Adapt every linear :meth:`LoRAConfig.targets` names (PEFT's matching); freeze the rest.

    Returns the adapted modules' paths. ``skip`` names modules never adapted (the LM head: its
    rows are the vocabulary, and vLLM does not adapt it). Raises ``ValueError`` naming the
    targets and the model's linear names when a target matches nothing: a typo would otherwise
    train nothing at all.
    """
    if config.rank < 1:
        raise ValueError(f"LoRA rank={config.rank} must be >= 1")
    adapted: list[str] = []
    for path in _linear_names(model):
        if not config.targets(path) or path.rsplit(".", 1)[-1] in skip:
            continue
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, attribute)
        if isinstance(linear, LoRALinear):
            raise ValueError(f"{path} is adapted already: apply_lora runs once per model")
        setattr(parent, attribute, LoRALinear.adapt(linear, config))
        adapted.append(path)
    missing = [
        target
        for target in config.target_modules
        if not any(path == target or path.endswith("." + target) for path in adapted)
    ]
    if missing:
        leaves = sorted({path.rsplit(".", 1)[-1] for path in _linear_names(model)} - set(skip))
        raise ValueError(
            f"LoRA targetModules {list(config.target_modules)}: {missing} match no linear module of the "
            f"model; its linear modules are {leaves}"
        )
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter_name(name))
    return adapted


def _module_seed(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{path}".encode()).digest()[:8], "little") >> 1


def _local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """This rank's rows of dim 0 of the global tensor ``tensor`` stands for (all of them if not a DTensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return 0, int(tensor.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return int(offset[0]), int(offset[0]) + int(local_shape[0])


def initialize_adapters(model: nn.Module, *, seed: int) -> int:
    """Fill every adapter: ``A`` Kaiming-uniform from a per-module seed, ``B`` zero; returns the count.

    ``A``'s bound is ``1 / sqrt(in_features)`` (``kaiming_uniform_`` with ``a = sqrt(5)``,
    ``nn.Linear``'s own default, as PEFT uses). Works on FSDP2-sharded (``DTensor``) adapters:
    each rank keeps its rows of the same draw.
    """
    count = 0
    with torch.no_grad():
        for path, module in model.named_modules():
            if not isinstance(module, LoRALinear):
                continue
            a, b = module.lora_A.weight, module.lora_B.weight
            generator = torch.Generator().manual_seed(_module_seed(seed, path))
            bound = 1.0 / math.sqrt(a.shape[1])
            full = torch.empty(tuple(a.shape), dtype=torch.float32).uniform_(
                -bound, bound, generator=generator
            )
            start, stop = _local_rows(a)
            local_a = a.to_local() if hasattr(a, "to_local") else a
            local_a.copy_(full[start:stop])
            local_b = b.to_local() if hasattr(b, "to_local") else b
            local_b.zero_()
            count += 1
    return count


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model for the block: every :class:`LoRALinear` computes ``W x + b`` alone.

    Restores each adapter's previous state on the way out, also when the block raises.
    """
    adapted = [module for module in model.modules() if isinstance(module, LoRALinear)]
    before = [module.enabled for module in adapted]
    for module in adapted:
        module.enabled = False
    try:
        yield
    finally:
        for module, state in zip(adapted, before, strict=True):
            module.enabled = state
