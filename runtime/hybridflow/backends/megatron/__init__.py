"""The megatron-core backend: load, parallelize, score, train, export and checkpoint an HF model with TP/PP/DP.

Megatron-core backend
=====================

What it is
----------
Actor, reference and critic models as megatron-core ``GPTModel`` stages (tensor, pipeline and
data parallel through megatron's ``parallel_state``), loaded from and exported to HF Qwen2/Llama
checkpoints. Same file set and, where the concepts coincide, the same function names and
contracts as :mod:`hybridflow.backends.fsdp`; the
megatron-only steps are :func:`initialize_parallel_state` (before loading) and
:func:`wrap_data_parallel` (before building the optimizer), and the train step is one
:func:`forward_backward` call per mini-batch instead of a ``backward()`` per micro-batch.

Call order on every rank, after joining the ``torch.distributed`` world:

1. :func:`initialize_parallel_state` (``tp_size``, ``pp_size``; DP is what remains).
2. :func:`load_causal_lm` / :func:`load_value_model`: each rank builds its stage and reads its
   own slices from the safetensors files (no communication).
3. Trained roles: :func:`wrap_data_parallel`, :func:`build_optimizer`, :func:`build_lr_scheduler`.
4. Scoring: :func:`token_logprobs_and_entropy` / :func:`token_values` (collective; results on
   every rank). Training: :func:`forward_backward` then :func:`clip_grad_norm_and_step` per
   mini-batch, ``scheduler.step()`` per RL step.
5. Weight sync: :func:`iter_full_weight_buckets` (full HF tensors on every rank, bucket by
   bucket) or :func:`training_shard` (this rank's HF slices as views of its parameters, for the
   3D-HybridEngine resharding; :func:`local_shards` lists them).
6. :func:`save_train_state` / :func:`load_train_state` (megatron ``dist_checkpointing``).

Weight layouts
--------------
Rank order is megatron's ``tp-cp-ep-dp-pp`` = the controller's
:meth:`~hybridflow.mesh.DeviceMesh.training` (checked at initialisation). Pipeline
stage ``s`` of ``p`` holds layers ``[s*L/p, (s+1)*L/p)``, the embedding on stage 0, final norm
and head on stage ``p-1``. TP rank ``r`` of ``t`` holds, for every HF parameter, exactly the
even slice the resharding layout assigns to ``r``:

* ``q/k/v_proj`` (+ Qwen2 biases): rows of key/value groups ``[r*G/t, (r+1)*G/t)`` with their
  query heads, stored fused as megatron's ``linear_qkv``, interleaved per group
  ``[q_g (H/G heads); k_g; v_g]``;
* ``gate_proj``/``up_proj``: rows ``[r*F/t, (r+1)*F/t)``, stored fused as
  ``linear_fc1 = [gate_r; up_r]``; ``o_proj``/``down_proj``: the same ranges of columns;
* ``embed_tokens``/``lm_head``: vocabulary rows ``[r*V/t, (r+1)*V/t)`` (vocab-parallel; padded
  with zero rows only when ``t`` does not divide ``V``, see :func:`padded_vocab_size`);
* RMSNorm weights whole on every TP rank.

:func:`local_shards` returns these as ``HF name -> (tensor, partition dim, [start, stop), tp
rank/size, pp stage)``; :mod:`~hybridflow.backends.megatron.convert` documents the packing.

CPU and GPU
-----------
The product code is written for CUDA (NCCL) as megatron-core is. On CPU (gloo), megatron-core
0.16.1 runs only under the test-only shim ``tests/megatron_shim.py``, which maps its CUDA calls
(devices, RNG, synchronisation, CUDA tensor-type asserts) onto the CPU; with it every function
here runs and is tested on CPU with TP = 2, PP = 2 and TP x PP = 2 x 2 over gloo. Only the
``gpu``-marked tests exercise NCCL and CUDA (``tests/integration/test_megatron_gpu.py``).

Exact and approximate
---------------------
* HF -> megatron -> HF (load, then :func:`iter_full_weight_buckets`) is bit-exact for every
  layout, and :func:`local_shards` are bit-exact slices of the HF tensors.
* Log-probs, entropy and values equal the HF model's to ~1e-6 in fp32: different kernels
  (megatron's attention and ``torch.nn.RMSNorm`` against HF's sdpa and RMSNorm) and, under TP,
  different summation order. RoPE positions equal HF's ``position_ids`` exactly: rows are
  left-aligned before the forward (:mod:`~hybridflow.backends.megatron.pipeline`).
* The gradient norm equals the HF model's to ~1e-6 relative, and one clipped AdamW step under
  TP=1, TP=2 and TP=2 x PP=2 gives the HF step's weights within 1e-6, when Adam's ``eps`` is
  not below the smallest gradients (the tests use 1e-4: with 1e-8, a gradient of ~1e-8 turns
  fp32 rounding differences into steps of up to the learning rate, in any two implementations).
* Checkpoint save/load restores model, optimizer and scheduler bit-exactly, also into another
  TP/PP/DP layout (megatron's sharded state dicts carry global offsets).
* The distributed optimizer's steps equal the non-distributed optimizer's within fp32 rounding
  (1e-6; the gradients are reduce-scattered instead of all-reduced).

Known limits
------------
* Qwen2/Llama decoders with untied embeddings, default RoPE, no sliding window; TP must divide
  the key/value heads (no KV replication) and the intermediate size; PP must divide the layers.
* One parallel layout per process (megatron's global ``parallel_state``): roles colocated in a
  process share it.
* No sequence parallelism, context parallelism, virtual pipeline stages, Transformer Engine
  kernels or fp16; bf16 uses megatron's mixed precision (bf16 parameters, fp32 main weights in
  the optimizer).
* The optimizer is megatron's distributed optimizer at every DP size (Adam's state, and bf16's
  fp32 main weights, split over the DP ranks: ``1/d`` per rank); the checkpoint keeps it in a
  layout-independent format, so a run resumes into other TP/PP/DP sizes.
* Gradient clipping and the norm use megatron's own helpers, which assert CUDA tensor types;
  on CPU they run only under the test shim (the product has no CPU branch).
* Saving a checkpoint starts megatron's writer processes (a spawned multiprocessing manager per
  rank, once per process): a few seconds on small CPU machines.
* The workers (:mod:`hybridflow.workers.policy`, :mod:`hybridflow.workers.value`) drive it
  through :class:`~hybridflow.backends.megatron.training.MegatronTrainingBackend`, the
  :class:`~hybridflow.backends.api.TrainingBackend` of ``spec.training.backend: megatron``; with
  t*p > 1 the rollout reshards through the 3D-HybridEngine
  (``hybridflow.workers.hybrid_rollout``).
"""

from hybridflow.backends.megatron.checkpoint import load_train_state, save_train_state
from hybridflow.backends.megatron.config import DecoderArch, padded_vocab_size
from hybridflow.backends.megatron.load import (
    ModelInfo,
    ValueHead,
    build_gpt_model,
    load_causal_lm,
    load_hf_weights,
    load_value_model,
    model_info,
    unwrap,
)
from hybridflow.backends.megatron.logprobs import (
    token_logprobs_and_entropy,
    token_values,
    vocab_parallel_logprobs_and_entropy,
)
from hybridflow.backends.megatron.optim import (
    LossFn,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    forward_backward,
    offload_tensors,
)
from hybridflow.backends.megatron.parallelize import (
    ParallelLayout,
    current_layout,
    destroy_parallel_state,
    initialize_parallel_state,
    wrap_data_parallel,
)
from hybridflow.backends.megatron.weights import (
    LocalShard,
    full_state_dict,
    iter_full_weight_buckets,
    local_shards,
    shard_copy_bytes,
    training_shard,
)

__all__ = [
    "DecoderArch",
    "LocalShard",
    "LossFn",
    "ModelInfo",
    "ParallelLayout",
    "ValueHead",
    "build_gpt_model",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_and_step",
    "current_layout",
    "destroy_parallel_state",
    "forward_backward",
    "full_state_dict",
    "initialize_parallel_state",
    "iter_full_weight_buckets",
    "load_causal_lm",
    "load_hf_weights",
    "load_train_state",
    "load_value_model",
    "local_shards",
    "model_info",
    "offload_tensors",
    "padded_vocab_size",
    "save_train_state",
    "shard_copy_bytes",
    "token_logprobs_and_entropy",
    "token_values",
    "training_shard",
    "unwrap",
    "vocab_parallel_logprobs_and_entropy",
    "wrap_data_parallel",
]
