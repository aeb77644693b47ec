"""Training backends: how a role's model is loaded, sharded, trained and read back out.

Each backend is a small set of plain functions with the same file layout (``load``,
``parallelize``, ``weights``, ``logprobs``, ``optim``, ``checkpoint``) and a ``training`` module
that implements :class:`hybridflow.backends.api.TrainingBackend` over them; the Ray workers of
:mod:`hybridflow.workers` (one class per role, whatever the backend) look it up by
``spec.training.backend`` with :func:`hybridflow.backends.api.training_backend`. The functions
know nothing about Ray or the controller: a worker process joins a ``torch.distributed``
world, then calls them in SPMD fashion, every rank the same function in the same order. Which calls are collectives (and so must be made by every
rank in lockstep) is stated in each function's docstring.

* :mod:`hybridflow.backends.fsdp`: PyTorch FSDP2 (``fully_shard``) over one data-parallel
  mesh; runs on CUDA/NCCL and on CPU/gloo alike.
* :mod:`hybridflow.backends.megatron`: megatron-core with tensor, pipeline and data parallelism.
* :mod:`hybridflow.backends.schedule`, :mod:`hybridflow.backends.offload`: what both share (the
  LR schedule, moving training state off the device during generation); backends do not import
  each other.
"""
