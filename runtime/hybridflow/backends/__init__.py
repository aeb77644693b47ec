"""Training backends: how a role's model is loaded, sharded, trained and read back out.

Each backend is a small set of plain functions with the same file layout (``load``,
``parallelize``, ``weights``, ``logprobs``, ``optim``, ``checkpoint``), called by the Ray worker
classes in :mod:`hybridflow.workers`. The functions know nothing about Ray or the controller: a
worker process joins a ``torch.distributed`` world, then calls them in SPMD fashion, every rank
the same function in the same order. Which calls are collectives (and so must be made by every
rank in lockstep) is stated in each function's docstring.

* :mod:`hybridflow.backends.fsdp`: PyTorch FSDP2 (``fully_shard``) over one data-parallel
  mesh; runs on CUDA/NCCL and on CPU/gloo alike.
"""
