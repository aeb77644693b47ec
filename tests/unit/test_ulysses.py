"""Ulysses sequence parallelism (``backends/fsdp/ulysses.py``) gives what the unsplit forward gives.

One spawned 2-rank gloo job, a tiny grouped-query Qwen2 (4 query heads, 2 KV heads: one of each
per rank), float32. Three batches: left-padded prompts and right-padded responses of different
lengths in 11 columns (padded to 12 for two ranks) whose scored columns span both ranks, or lie
on the second rank only (the first then scores nothing and must still take part in backward);
and full rows of 12 columns, no padding at all (sdpa's ``is_causal`` path, no mask).
Each rank checks, against the plain sdpa forward of the whole batch in its own process:

* the gathered response log-probs and entropy are equal within 1e-5;
* the parameter gradients of a masked-mean loss, summed over the two ranks, are equal within
  1e-5 of each parameter's gradient norm, while one rank's alone is not (each holds a share).

FSDP2 with activation checkpointing and ``fsdp_loss_scale`` is the backend's business, tested
there against size 1 (``tests/unit/test_sequence_parallel_backend.py``).

Without processes: the head-layout refusals, the column split, and a forward outside the context.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spawned_ranks import run_spawned_ranks

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5
HEADS, KV_HEADS = 4, 2

# name -> (prompt width, response width, [(prompt ids, response ids)]).
BATCHES: dict[str, tuple[int, int, list[tuple[list[int], list[int]]]]] = {
    # Column 5 (rank 0's last of 6) scores the first response token.
    "scored-on-both-ranks": (
        6,
        5,
        [
            ([72, 105, 33, 10], [65, 66, 67, 68, 258]),
            ([257, 117, 115, 101, 114, 10], [33, 258]),
            ([84], [117, 118, 119, 258]),
        ],
    ),
    # Only columns 8 and 9 score, both on rank 1.
    "scored-on-one-rank": (
        9,
        2,
        [
            ([72, 105, 33, 10, 65, 66, 67], [68, 258]),
            ([257, 117, 115, 101, 114, 10, 72, 105, 33], [258]),
            ([84, 104], [117, 258]),
        ],
    ),
    "unpadded": (
        6,
        6,
        [
            ([72, 105, 33, 10, 65, 66], [67, 68, 69, 70, 71, 258]),
            ([257, 117, 115, 101, 114, 10], [72, 105, 33, 10, 65, 258]),
            ([84, 104, 101, 32, 113, 117], [105, 99, 107, 32, 98, 258]),
        ],
    ),
}


def make_batch(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask`` and the response width."""
    from hybridflow.models import PAD_TOKEN_ID

    prompt_width, response_len, rows = BATCHES[name]
    input_ids = torch.full((len(rows), prompt_width + response_len), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(rows):
        start, end = prompt_width - len(prompt), prompt_width + len(response)
        input_ids[row, start:end] = torch.tensor(prompt + response)
        attention_mask[row, start:end] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp_min(0)
    return input_ids, attention_mask, position_ids, attention_mask[:, prompt_width:], response_len


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def relative_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        name: float((grads[name] - ref).norm() / ref.norm().clamp_min(1e-12))
        for name, ref in reference.items()
    }


def ranks(rank: int, port: int, model_dir: str, work: str) -> None:
    import torch.distributed as dist

    from hybridflow.backends.fsdp import load_causal_lm, token_logprobs_and_entropy
    from hybridflow.backends.fsdp.ulysses import (
        ulysses_context,
        ulysses_token_logprobs_and_entropy,
        use_ulysses_attention,
    )

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    results: dict[str, Any] = {}
    plain = load_causal_lm(model_dir)
    split = load_causal_lm(model_dir)
    use_ulysses_attention(split, 2)
    reference_grads: dict[str, dict[str, torch.Tensor]] = {}
    for name in BATCHES:
        input_ids, attention_mask, position_ids, response_mask, response_len = make_batch(name)
        plain.zero_grad()
        log_probs, entropy = token_logprobs_and_entropy(
            plain, input_ids, attention_mask, position_ids, response_len=response_len
        )
        masked_mean(log_probs, response_mask).backward()
        reference_grads[name] = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}

        split.zero_grad()
        with ulysses_context(group, attention_mask):
            split_log_probs, split_entropy = ulysses_token_logprobs_and_entropy(
                split, input_ids, position_ids, response_len=response_len
            )
            masked_mean(split_log_probs, response_mask).backward()
        assert split_entropy is not None and entropy is not None
        own = {n: p.grad.clone() for n, p in split.named_parameters() if p.grad is not None}
        for parameter in split.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=group)
        summed = {n: p.grad for n, p in split.named_parameters() if p.grad is not None}
        valid = response_mask.bool()
        results[name] = {
            "log_prob_error": float((split_log_probs - log_probs).detach()[valid].abs().max()),
            "entropy_error": float((split_entropy - entropy).detach()[valid].abs().max()),
            "same_parameters": sorted(summed) == sorted(reference_grads[name]),
            "grad_errors": relative_errors(summed, reference_grads[name]),
            "own_share_error": max(relative_errors(own, reference_grads[name]).values()),
        }

    (Path(work) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.models import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("ulysses") / "qwen2-gqa",
        "qwen2",
        seed=3,
        hidden=128,
        heads=HEADS,
        kv_heads=KV_HEADS,
    )


@pytest.fixture(scope="module")
def outcome(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    work = tmp_path_factory.mktemp("ulysses-ranks")
    return run_spawned_ranks(
        ranks,
        (str(model_dir), str(work)),
        world_size=2,
        work_dir=work,
        deadline_seconds=180,
        what="Ulysses sequence parallelism",
        expected=list(BATCHES),
    )


@pytest.mark.parametrize("batch", list(BATCHES))
def test_split_log_probs_equal_the_plain_forward(outcome: dict[str, dict[int, Any]], batch: str) -> None:
    assert set(outcome[batch]) == {0, 1}
    for rank, result in outcome[batch].items():
        assert result["log_prob_error"] <= TOLERANCE, (rank, result["log_prob_error"])
        assert result["entropy_error"] <= TOLERANCE, (rank, result["entropy_error"])


@pytest.mark.parametrize("batch", list(BATCHES))
def test_gradients_summed_over_the_group_equal_the_plain_ones(
    outcome: dict[str, dict[int, Any]], batch: str
) -> None:
    for rank, result in outcome[batch].items():
        assert result["same_parameters"], rank
        worst = max(result["grad_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE, (rank, worst)
        # One rank's gradient is only its tokens' share: the sum is what equals the plain gradient.
        assert result["own_share_error"] > 0.01, (rank, result["own_share_error"])


# --------------------------------------------------------------------------- no processes


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (3, 3, 2, r"num_attention_heads=3 is not divisible by the sequence-parallel size 2"),
        (4, 1, 2, r"num_key_value_heads=1 is smaller than the sequence-parallel size 2"),
        (6, 3, 2, r"num_key_value_heads=3 is not divisible by the sequence-parallel size 2"),
        (4, 4, 0, r"sequence-parallel size 0 must be at least 1"),
    ],
)
def test_head_layouts_that_do_not_split_are_refused(
    heads: int, kv_heads: int, size: int, message: str
) -> None:
    from hybridflow.backends.fsdp.ulysses import check_ulysses_layout

    with pytest.raises(ValueError, match=message):
        check_ulysses_layout(heads, kv_heads, size)


def test_head_layouts_that_split_are_accepted() -> None:
    from hybridflow.backends.fsdp.ulysses import check_ulysses_layout

    for heads, kv_heads, size in [(4, 2, 2), (4, 4, 4), (8, 2, 2), (2, 1, 1)]:
        check_ulysses_layout(heads, kv_heads, size)


def test_columns_are_padded_on_the_right_then_split_in_rank_order() -> None:
    from hybridflow.backends.fsdp.ulysses import padded_sequence_len, shard_sequence

    columns = torch.arange(10).view(2, 5)
    assert padded_sequence_len(5, 2) == 6 and padded_sequence_len(6, 2) == 6
    assert shard_sequence(columns, sp_rank=0, sp_size=2, fill=-1).tolist() == [[0, 1, 2], [5, 6, 7]]
    assert shard_sequence(columns, sp_rank=1, sp_size=2, fill=-1).tolist() == [[3, 4, -1], [8, 9, -1]]
    with pytest.raises(ValueError, match=r"sp_rank=2 is not a rank of a sequence-parallel group of 2"):
        shard_sequence(columns, sp_rank=2, sp_size=2, fill=0)


def test_model_setup_refuses_a_layout_and_a_forward_outside_the_context() -> None:
    from hybridflow.backends.fsdp.ulysses import use_ulysses_attention
    from hybridflow.models import build_tiny_model, padded_vocab_size

    one_kv_head = build_tiny_model("qwen2", padded_vocab_size(), kv_heads=1)
    with pytest.raises(
        ValueError, match=r"num_key_value_heads=1 is smaller than the sequence-parallel size 2"
    ):
        use_ulysses_attention(one_kv_head, 2)

    model = build_tiny_model("qwen2", padded_vocab_size())
    use_ulysses_attention(model, 2)
    with pytest.raises(RuntimeError, match=r"ran outside ulysses_context"):
        model(input_ids=torch.tensor([[72, 105]]))
