"""Ulysses sequence parallelism on CPU/gloo: the response length that fits a per-rank activation budget.

What it shows: at ``spec.training.sequenceParallelSize: 2`` each rank holds the activations of half
of every sequence, so a response too long for a rank's activation budget at size 1 fits at size
2. For each response length of a ladder, one forward + backward of one row (a prompt, then the
response; log-probs and entropy of the response tokens, the actor's loss terms) runs

* at size 1 in one process: the plain pass the FSDP backend runs at size 1
  (:func:`~hybridflow.backends.fsdp.logprobs.token_logprobs_and_entropy`, transformers' sdpa);
* at size 2 in two spawned gloo processes, each holding the whole model and half the columns:
  the pass the backend runs at size 2 (:func:`~hybridflow.backends.fsdp.ulysses.use_ulysses_attention`,
  then :func:`~hybridflow.backends.fsdp.ulysses.ulysses_token_logprobs_and_entropy` with the
  backward inside :func:`~hybridflow.backends.fsdp.ulysses.ulysses_context`).

The model: Qwen2-0.5B's shapes (hidden 896, 14 query / 2 key-value heads of 64, FFN 4864,
vocabulary 151,936, tied embeddings, RoPE theta 1e6) with 4 of its 24 decoder layers
(``--quick``: 1), random weights drawn from one seed (the same on every rank), float32, no
activation checkpointing. Fewer layers keep a CPU run to minutes; the LM head, which a whole
vocabulary of logits per scored column makes the largest activation at this depth, is the real
one. FSDP is left out: it shards the weights, not the activations, and its gathered units would
blur the figure.

Measured per rank and run (the budget is checked against the first):

* ``saved_bytes``: the activation memory, i.e. the bytes of the distinct tensor storages autograd
  saves for the backward pass during the window, parameters excluded, recorded by a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook. Saved tensors only accumulate during
  the forward and are released during the backward, so their total at the end of the forward is
  the window's peak of saved activations. It leaves out transient buffers (an op's workspace, a
  gradient while it is being accumulated), which ``rss_peak_bytes`` includes.
* ``rss_peak_bytes``: the process's resident high-water mark during forward + backward over its
  resident size before (``VmHWM`` after ``VmRSS``, the mark reset through
  ``/proc/self/clear_refs``: :class:`~hybridflow.resharding.meter.PeakMemory`, as
  ``bench/resharding.py`` measures), with every parameter's gradient allocated before the window
  (so only activations and transients count). Allocator effects make it noisier; ``None`` where
  ``/proc`` cannot be written.
* ``seconds``: wall time of forward + backward (one thread per process).

The budget: ``ACTIVATION_BUDGET_BYTES`` of saved activations per rank (1 GiB; ``--quick``: 256
MiB), a stand-in at this model's depth for what a GPU has left for activations once weights,
gradients and optimizer state are resident. The JSON reports, per size, the longest response of
the ladder whose per-rank ``saved_bytes`` stays within it, and ``shown``: the longest response
that fits at size 2 but not at size 1, with both measurements. Where both sizes ran a length, the
largest difference of their response log-probs is reported too (rounding only).

Why size 2 saves less than half here: each rank computes logits only for its own columns that
score a response token, and the response is the tail of the sequence, so the last rank holds
most of them (with a 256-token prompt and 512 response tokens, 384 of the 513 scored columns),
and a whole vocabulary of logits per scored column is the largest activation at this depth. The
per-rank peak is that rank's; the share tends to half as responses outgrow prompts.

``--quick`` (or ``HYBRIDFLOW_BENCH_QUICK=1``): one layer and a shorter ladder, for CI; the JSON
line has the same keys. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN2_0_5B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}
"""Qwen2-0.5B's config.json shapes (24 layers there)."""

FULL = {"layers": 4, "prompt_tokens": 256, "response_tokens": [256, 384, 512, 768], "budget": 1 << 30}
QUICK = {"layers": 1, "prompt_tokens": 32, "response_tokens": [64, 128, 192], "budget": 256 << 20}
SIZES = (1, 2)
WARM_UP_RESPONSE_TOKENS = 8
SEED = 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class SavedActivations:
    """``with SavedActivations(parameters) as saved: ...`` then ``saved.bytes``: see the module docstring.

    Storages are told apart by address: a saved tensor stays alive until the backward releases it,
    so no other storage can take its address inside the window.
    """

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedActivations:
        self._storages.clear()
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, trace)


def build_model(layers: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN2_0_5B, num_hidden_layers=layers, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(config).train()


def run_rank(rank: int, port: int, size: int, setting: dict[str, Any], out_dir: str) -> None:
    """One process of one size: every response length of the ladder, each measured in its own window."""
    from hybridflow.backends.fsdp.logprobs import token_logprobs_and_entropy
    from hybridflow.backends.fsdp.ulysses import (
        ulysses_context,
        ulysses_token_logprobs_and_entropy,
        use_ulysses_attention,
    )
    from hybridflow.resharding.meter import PeakMemory

    torch.set_num_threads(1)
    group = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        group = dist.new_group(list(range(size)))
    model = build_model(setting["layers"])
    if size > 1:
        use_ulysses_attention(model, size)
    parameters = list(model.parameters())
    for parameter in parameters:  # resident before every window: only activations and transients count
        parameter.grad = torch.zeros_like(parameter)
    records = []
    prompt = setting["prompt_tokens"]
    # The first pass pays one-time set-up (kernels, gloo buffers): a short one, not recorded.
    for response in [WARM_UP_RESPONSE_TOKENS, *setting["response_tokens"]]:
        generator = torch.Generator().manual_seed(SEED + response)
        input_ids = torch.randint(0, QWEN2_0_5B["vocab_size"], (1, prompt + response), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        position_ids = torch.arange(prompt + response)[None]
        saved = SavedActivations(parameters)
        start = time.perf_counter()
        with PeakMemory() as rss, saved:
            if group is None:
                log_probs, entropy = token_logprobs_and_entropy(
                    model, input_ids, attention_mask, position_ids, response_len=response
                )
                assert entropy is not None
                (-(log_probs.mean() + 0.01 * entropy.mean())).backward()
            else:
                with ulysses_context(group, attention_mask):
                    log_probs, entropy = ulysses_token_logprobs_and_entropy(
                        model, input_ids, position_ids, response_len=response
                    )
                    assert entropy is not None
                    (-(log_probs.mean() + 0.01 * entropy.mean())).backward()
        if response == WARM_UP_RESPONSE_TOKENS:
            continue
        records.append(
            {
                "response_tokens": response,
                "saved_bytes": saved.bytes,
                "rss_peak_bytes": rss.bytes,
                "seconds": time.perf_counter() - start,
                "log_probs": log_probs.detach()[0].tolist() if rank == 0 else None,
            }
        )
        del log_probs, entropy
    (Path(out_dir) / f"size{size}-rank{rank}.json").write_text(json.dumps(records))
    if group is not None:
        dist.destroy_process_group()


def summarise(runs: dict[int, list[list[dict[str, Any]]]], budget: int) -> dict[str, Any]:
    """Per size and length the worst rank's figures; the longest fits; the length only size 2 fits."""
    table: dict[int, dict[int, dict[str, Any]]] = {}
    for size, by_rank in runs.items():
        for records in zip(*by_rank, strict=True):
            rss = [r["rss_peak_bytes"] for r in records]
            table.setdefault(size, {})[records[0]["response_tokens"]] = {
                "saved_bytes": max(r["saved_bytes"] for r in records),
                "rss_peak_bytes": None if None in rss else max(rss),
                "seconds": max(r["seconds"] for r in records),
                "fits": max(r["saved_bytes"] for r in records) <= budget,
                "log_probs": records[0]["log_probs"],
            }
    longest = {
        str(size): max((length for length, row in rows.items() if row["fits"]), default=None)
        for size, rows in table.items()
    }
    only_split = [
        length for length, row in table[2].items() if row["fits"] and not table[1].get(length, row)["fits"]
    ]
    shown = None
    if only_split:
        length = max(only_split)
        shown = {
            "response_tokens": length,
            "saved_bytes": {"1": table[1][length]["saved_bytes"], "2": table[2][length]["saved_bytes"]},
            "rss_peak_bytes": {
                "1": table[1][length]["rss_peak_bytes"],
                "2": table[2][length]["rss_peak_bytes"],
            },
        }
    differences = [
        max(abs(a - b) for a, b in zip(table[1][length]["log_probs"], row["log_probs"], strict=True))
        for length, row in table[2].items()
        if length in table[1]
    ]
    return {
        "runs": [
            {"sequence_parallel_size": size, "response_tokens": length}
            | {key: value for key, value in row.items() if key != "log_probs"}
            for size, rows in table.items()
            for length, row in rows.items()
        ],
        "longest_fitting_response_tokens": longest,
        "shown": shown,
        "log_prob_max_abs_difference": max(differences) if differences else None,
    }


def main() -> None:
    quick = "--quick" in sys.argv[1:] or os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
    setting = QUICK if quick else FULL
    start = time.perf_counter()
    runs: dict[int, list[list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:  # one size at a time: the ranks of a size share the cores
            mp.start_processes(
                run_rank, args=(free_port(), size, setting, tmp), nprocs=size, start_method="spawn"
            )
            runs[size] = [
                json.loads((Path(tmp) / f"size{size}-rank{rank}.json").read_text()) for rank in range(size)
            ]
    layers = setting["layers"]
    summary = {
        "bench": "sequence_parallel",
        "quick": quick,
        "backend": "gloo",
        "device": "cpu",
        "dtype": "float32",
        "model": {"shapes": "Qwen2-0.5B", **QWEN2_0_5B, "layers": layers, "layers_of_the_real_model": 24},
        "prompt_tokens": setting["prompt_tokens"],
        "activation_budget_bytes": setting["budget"],
        "measure": "saved_bytes: autograd's saved-for-backward storages per rank, parameters excluded",
        **summarise(runs, setting["budget"]),
        "wall_seconds": time.perf_counter() - start,
    }
    print(f"{'size':>5}{'response':>10}{'saved MiB':>11}{'RSS MiB':>9}{'seconds':>9}  fits", file=sys.stderr)
    for run in summary["runs"]:
        rss = run["rss_peak_bytes"]
        print(
            f"{run['sequence_parallel_size']:>5}{run['response_tokens']:>10}{run['saved_bytes'] / 2**20:>11.1f}"
            f"{(rss or 0) / 2**20:>9.1f}{run['seconds']:>9.2f}  {run['fits']}",
            file=sys.stderr,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
