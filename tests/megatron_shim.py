"""Test-only: run megatron-core 0.16 on a CPU-only torch by pointing its CUDA calls at the CPU.

Megatron-core assumes CUDA throughout: it allocates on ``torch.cuda.current_device()``, moves
tensors with ``.cuda()`` / ``.to("cuda")`` / ``device="cuda"``, synchronises streams, and
keeps its tensor-parallel RNG states with ``torch.cuda.get_rng_state`` and friends. None of that
exists in the CPU wheel of torch. :func:`install` makes those calls land on the CPU, in the
calling process only:

* a :class:`~torch.overrides.TorchFunctionMode`, entered for the rest of the process, rewrites
  every CUDA device argument (``device="cuda"``, ``device=0``, ``torch.device("cuda", i)``,
  positional devices of ``Tensor.to``) to ``"cpu"``, makes ``Tensor.cuda()`` the identity,
  drops ``pin_memory=True`` (pinning needs an accelerator) and makes ``Tensor.type()`` of a CPU
  tensor report the CUDA type (``"torch.cuda.FloatTensor"``: megatron's gradient clipping
  asserts it);
* ``torch.cuda.current_device`` returns 0 (an index the mode maps to the CPU wherever it is
  used as a device), ``synchronize`` and ``empty_cache`` do nothing, ``torch.cuda.nvtx`` range
  calls do nothing;
* the CUDA RNG calls (``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed``,
  megatron's ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state``) use the
  CPU generator, so megatron's RNG tracker forks and restores the CPU RNG state exactly as it
  would the CUDA one.

Why here and never in the product (``hybridflow.backends.megatron``): these patches change
global torch behaviour for the whole process (every ``.cuda()`` becomes a no-op), which is only
acceptable in a process that exists to run a test. The product runs megatron on CUDA as
intended, and its code stays free of CPU special cases except where noted in its docstrings
(gradient clipping, which megatron implements with CUDA-only kernels).

Protocol: call :func:`install` in each spawned test process before building any megatron
model (importing megatron before or after does not matter; the patches are looked up at call
time). It is idempotent. Never call it in the pytest process itself: it would change torch for
every other test of the session.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install"]

_CPU = torch.device("cpu")
_installed = False


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal wherever torch accepts a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch function call to the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts types like "torch.cuda.FloatTensor" (gradient clipping).
            name: str = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which is left unpatched.
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def _no_range(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def install() -> None:
    """Apply every patch listed in the module docstring to this process (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_shim is for CPU-only test processes; this one has CUDA")
    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = _nothing
    cuda.empty_cache = _nothing
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.random.get_rng_state = _cpu_rng_state
    cuda.random.set_rng_state = _set_cpu_rng_state
    cuda.nvtx.range_push = _nothing
    cuda.nvtx.range_pop = _nothing
    cuda.nvtx.range = _no_range
    from megatron.core.tensor_parallel import random as megatron_random

    patched: Any = megatron_random
    patched._get_cuda_rng_state = _cpu_rng_state
    patched._set_cuda_rng_state = _set_cpu_rng_state
    # The RNG tracker warns when the CPU RNG state changes inside one of its forks; with the CUDA
    # RNG mapped onto the CPU one, every fork that draws (weight initialisation) changes it.
    logging.getLogger(megatron_random.__name__).setLevel(logging.ERROR)
    # Enter the mode for the rest of the process: it must cover every call megatron makes,
    # including those inside autograd's backward (same thread on CPU).
    _CudaToCpu().__enter__()
    _installed = True
