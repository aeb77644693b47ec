"""FSDP2 sharding of a loaded model over the whole default process group (the role's pool).

Protocol: every rank of the worker group loads the same weights
(:mod:`~hybridflow.backends.fsdp.load`), then calls :func:`shard_model` with its own device.
``fully_shard`` keeps, on each rank, that rank's dim-0 slice of its *local* full copy and frees
the rest, so the ranks must hold identical weights before the call; nothing is broadcast.

Layout: consecutive decoder layers form FSDP units (:func:`fsdp_units`: one all-gather before
a unit's forward, a reduce-scatter of its gradients after its backward, parameters freed again
after use), and the root is one more unit holding what is left (embeddings, final norm, LM or
value head). Peak parameter memory is thus the shards plus about one or two gathered units, and
the communication of one unit overlaps the compute of its neighbour on GPUs.

Why units have a minimum size (``spec.training.fsdpUnitMinParameters``, like FSDP1's size-based
wrapping policy): every unit costs a fixed latency per collective and per hook on top of its
bytes, three collectives per update (all-gather for the forward and again for the backward,
reduce-scatter of the gradients). A 7B model's layers hold about 200M parameters each, far
above the default 100M, so each is its own unit; the layers of a small model are grouped until a
unit reaches the minimum, and layers too small to make one join the root unit. Measured on the
tiny model (131,776 parameters, 2 gloo ranks on 2 cores, 32 rows each): one update took
0.094 s with a unit per layer and 0.076 s with the root as the only unit. Grouping changes
neither a parameter's sharding (each is split on dim 0 alone) nor any value: the gradients are
the same sums, reduced in bigger pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hybridflow.compilation import compiled_module
from hybridflow.mesh import DeviceMesh
from hybridflow.spec.training import DEFAULT_FSDP_UNIT_MIN_PARAMETERS, fsdp_units

__all__ = [
    "SequenceParallelGroups",
    "compile_regions",
    "decoder_layers",
    "enable_activation_checkpointing",
    "fsdp_units",
    "sequence_parallel_groups",
    "shard_model",
]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model``, in execution order, found without knowing its class.

    A Hugging Face model names its block class in ``_no_split_modules`` (``Qwen2DecoderLayer``,
    ``LlamaDecoderLayer``...: the unit that must never be split across devices, which is exactly
    the unit FSDP should wrap). That finds the blocks of a causal LM (``model.model.layers``) and
    of a :class:`~hybridflow.backends.fsdp.load.ValueModel` (``backbone.layers``) alike. A model
    without that attribute falls back to the children of a ``ModuleList`` named ``layers``.
    Raises ``ValueError`` naming the model's class when neither finds anything.
    """
    block_names: set[str] = set()
    for module in model.modules():
        block_names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    if blocks:
        return blocks
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return list(module)
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: it names no block class in "
        "_no_split_modules and has no ModuleList called 'layers'"
    )


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer's activations in backward (transformers' gradient checkpointing).

    Called before :func:`shard_model` (``shard_model(..., activation_checkpointing=True)`` does
    it): the layers must still be the plain HF classes. The checkpoint is non-reentrant
    (``use_reentrant=False``), the variant that composes with FSDP2: the layer's FSDP
    pre-forward hook runs inside the checkpointed call and, during the recompute, sees the
    pre-backward state and leaves the unsharding to FSDP's pre-backward hook. It applies only
    in train mode (HF checks ``self.training``), so scoring passes are unchanged; the
    gradients equal those without it (``tests/unit/test_fsdp_backend.py``).

    ``model`` is an HF ``PreTrainedModel`` or a :class:`~hybridflow.backends.fsdp.load.ValueModel`
    (its ``backbone`` is one); anything else raises ``TypeError`` naming the class.
    """
    target = model if hasattr(model, "gradient_checkpointing_enable") else getattr(model, "backbone", None)
    enable = getattr(target, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TypeError(
            f"{type(model).__name__} is neither a Hugging Face model nor a value model around one: "
            "activation checkpointing needs transformers' gradient_checkpointing_enable"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _decoder_body(model: nn.Module) -> nn.Module | None:
    """The module that runs the embeddings, every decoder layer and the final norm: ``model.model``
    of a causal LM, ``backbone`` of a value model; None when neither is there."""
    for name in ("model", "backbone"):
        body = getattr(model, name, None)
        if isinstance(body, nn.Module):
            return body
    return None


def compile_regions(model: nn.Module, *, device: torch.device, layers_are_units: bool) -> list[str]:
    """Compile ``model``'s forward (and with it, through AOTAutograd, its backward) in regions FSDP leaves whole.

    ``spec.training.compile``. FSDP2 unshards and reshards in module hooks, which a compiled
    graph must not contain; so a region is a module's ``forward`` (hooks run in ``__call__``,
    outside it) with no FSDP unit inside:

    * ``layers_are_units`` false (the decoder layers joined the root unit, as in a small model):
      the decoder body, embeddings to final norm, one graph;
    * otherwise each decoder layer (the layers repeat one code object, so the first compile
      serves the rest when their shapes match).

    The LM or value head and the loss stay eager. Parameters and their names are untouched (the
    forward method is replaced, not the module), so weights, checkpoints and the rollout's sync
    are the same with and without it. Every dimension is symbolic from the first compile
    (micro-batch widths and row counts vary: :func:`~hybridflow.compilation.compiled_module`), so
    a region compiles once per mode (training, and scoring under no_grad). Returns what was
    compiled, by module path, for the worker's log.
    """
    body = _decoder_body(model)
    regions: list[nn.Module] = [body] if body is not None and not layers_are_units else decoder_layers(model)
    names = {id(module): name for name, module in model.named_modules()}
    for region in regions:
        region.forward = compiled_module(region.forward, device, static=False)
    return [names.get(id(region), type(region).__name__) for region in regions]


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    unit_min_parameters: int = DEFAULT_FSDP_UNIT_MIN_PARAMETERS,
    compile_forward: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2 across every rank of the default process group; returns it.

    Collective: every rank of the default group calls it, with the same (identically loaded)
    model, before any forward pass. The caller has joined the process group and, on CUDA, set
    its current device (``torch.cuda.set_device(local_rank)``): the 1-D mesh is
    ``init_device_mesh(device.type, (world_size,))`` and parameters move to that device here.

    The returned object is ``model`` itself (FSDP2 swaps its class in place, e.g. to
    ``FSDPQwen2ForCausalLM``). Parameter and ``state_dict`` names stay the plain HF names, with
    the values now ``DTensor`` shards (``Shard(0)``).

    ``mixed_precision``: compute with bf16 parameters and reduce gradients in fp32
    (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``); the sharded
    parameters, gradients and optimizer state stay in the model's own dtype (load fp32 for
    training). Meant for GPUs; on CPU it works too but buys nothing. Outputs (logits, values)
    come back in bf16 then; :mod:`~hybridflow.backends.fsdp.logprobs` upcasts them to fp32.

    ``unit_min_parameters``: the smallest FSDP unit of decoder layers (:func:`fsdp_units`; 0: one
    unit per layer).

    ``activation_checkpointing``: :func:`enable_activation_checkpointing` first
    (``spec.training.activationCheckpointing``).

    ``compile_forward``: :func:`compile_regions` after sharding (``spec.training.compile``).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed to be initialised (the worker joins its group first)"
        )
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    # fully_shard moves each unit's parameters to the mesh's device as it shards them; moving
    # the whole model first would need a device copy of every full weight at once.
    layers = decoder_layers(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    units = fsdp_units(sizes, unit_min_parameters)
    for unit in units:
        members = [layers[index] for index in unit]
        fully_shard(members[0] if len(members) == 1 else members, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if compile_forward:
        compile_regions(model, device=device, layers_are_units=bool(units))
    return model


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's two process groups under Ulysses sequence parallelism of ``size`` ranks.

    ``sequence``: the ``size`` consecutive ranks that share rows and split their columns
    (:mod:`~hybridflow.backends.fsdp.ulysses`); ``data``: one rank of every such group, the
    same position in each, over which the workers sum their loss counts (each row counted once).
    FSDP itself still shards over the whole default group (:func:`shard_model`).
    """

    size: int
    sequence: dist.ProcessGroup
    data: dist.ProcessGroup


def sequence_parallel_groups(size: int) -> SequenceParallelGroups:
    """Build the Ulysses and data-parallel groups of ``size`` over the default group; this rank's pair.

    Collective: every rank of the default group calls it, in the same order relative to its
    other group creations (``new_group`` is collective even for non-members). The groups are
    the ``tp`` and ``dp`` groups of ``DeviceMesh.training(world, tp=size)``, the mesh the
    controller dispatches the actor's and reference's rows by (``trainer/roles.py``): its
    ``DP_SPLIT`` gives every rank of one ``tp`` group the same rows. Raises
    :class:`~hybridflow.mesh.MeshError` when ``size`` does not divide the world.
    """
    rank = dist.get_rank()
    mesh = DeviceMesh.training(dist.get_world_size(), tp=size)
    mine: dict[str, dist.ProcessGroup] = {}
    for axis in ("tp", "dp"):
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return SequenceParallelGroups(size=size, sequence=mine["tp"], data=mine["dp"])
