"""The FSDP2 backend on two gloo ranks against a single-process reference.

One spawned two-rank job (no Ray, no torchrun) runs every check in order, each rank also
holding an unsharded reference model it drives through the same data; each check's outcome (a
traceback or ``None``) comes back per rank in a JSON file, and each test below asserts one
check. Spawning once keeps the cost to one torch + transformers import per rank (~5 s on two
cores) instead of one per test.

Data parallelism is real: rank ``r`` trains on its half of the batch while the reference
accumulates both halves, so equal results mean the gradient reduce-scatter, the sharded
gradient norm and the sharded AdamW state are right. Inside a check every collective runs
before the first assertion, so a failing rank does not leave its peer waiting in a collective;
the gloo timeout and the job deadline bound the damage if that rule is ever broken.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spawned_ranks import run_spawned_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hybridflow.backends.fsdp import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    full_state_dict,
    iter_full_weight_buckets,
    load_causal_lm,
    load_train_state,
    load_value_model,
    save_train_state,
    shard_model,
    token_logprobs_and_entropy,
    token_values,
)
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model

pytestmark = pytest.mark.integration

WORLD_SIZE = 2
JOB_DEADLINE_SECONDS = 240
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)

CHECKS = [
    "buckets_reassemble_the_unsharded_state_dict",
    "sharded_loss_and_step_match_unsharded",
    "every_unit_grouping_trains_identically",
    "checkpoint_round_trip_continues_identically",
    "sharded_value_model_matches_unsharded",
    "non_finite_grad_on_one_rank_skips_the_step_everywhere",
    "shared_prompt_training_matches_unshared",
]

PROMPT_WIDTH = 6
RESPONSE_WIDTH = 5
ROWS_PER_RANK = 2
BUCKET_BYTES = 40_000  # below the 384 x 64 fp32 embedding (98,304 bytes)
LEARNING_RATE = 1e-2
MAX_GRAD_NORM = 0.5  # below the first step's gradient norm, so clipping is exercised


def global_batch(seed: int) -> dict[str, torch.Tensor]:
    """A batch in the engine layout for all ranks; rows of varied prompt and response lengths."""
    rows = WORLD_SIZE * ROWS_PER_RANK
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((rows, PROMPT_WIDTH + RESPONSE_WIDTH), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(rows):
        prompt_len = 1 + row % PROMPT_WIDTH
        response_len = RESPONSE_WIDTH - row % 3
        start, end = PROMPT_WIDTH - prompt_len, PROMPT_WIDTH + response_len
        input_ids[row, start:end] = torch.randint(0, 256, (end - start,), generator=generator)
        attention_mask[row, start:end] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp_min(0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, PROMPT_WIDTH:].float(),
    }


def rank_slice(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return {name: tensor[rows] for name, tensor in batch.items()}


SHARED_PROMPT_ROWS = 4
"""Rows per rank in the shared-prompt check: prompts A, B, A, A (A and B of different lengths)."""


def shared_prompt_batch(seed: int) -> dict[str, torch.Tensor]:
    """A batch whose rank ``r`` rows carry two prompts in the order A, B, A, A, with different responses."""
    generator = torch.Generator().manual_seed(seed)
    rows = WORLD_SIZE * SHARED_PROMPT_ROWS
    input_ids = torch.full((rows, PROMPT_WIDTH + RESPONSE_WIDTH), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for rank in range(WORLD_SIZE):
        prompts = [torch.randint(0, 256, (length,), generator=generator) for length in (PROMPT_WIDTH, 3)]
        for offset, which in enumerate((0, 1, 0, 0)):
            row = rank * SHARED_PROMPT_ROWS + offset
            prompt, response_len = prompts[which], RESPONSE_WIDTH - offset % 3
            start, end = PROMPT_WIDTH - len(prompt), PROMPT_WIDTH + response_len
            input_ids[row, start:PROMPT_WIDTH] = prompt
            input_ids[row, PROMPT_WIDTH:end] = torch.randint(0, 256, (response_len,), generator=generator)
            attention_mask[row, start:end] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp_min(0),
        "response_mask": attention_mask[:, PROMPT_WIDTH:].float(),
    }


def policy_loss(
    model: nn.Module,
    part: dict[str, torch.Tensor],
    scale: float,
    *,
    shared_prompt_min_tokens: int | None = None,
) -> torch.Tensor:
    """``scale`` * the sum over response tokens of (NLL - 0.01 entropy): log-probs and entropy both carry grads."""
    log_probs, entropy = token_logprobs_and_entropy(
        model,
        part["input_ids"],
        part["attention_mask"],
        part["position_ids"],
        response_len=RESPONSE_WIDTH,
        temperature=0.8,
        shared_prompt_min_tokens=shared_prompt_min_tokens,
    )
    assert entropy is not None
    return scale * ((-log_probs - 0.01 * entropy) * part["response_mask"]).sum()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    parts: list[dict[str, torch.Tensor]],
    scale: float,
) -> tuple[list[float], float]:
    """Accumulate ``parts`` (micro-batches), then one clipped step and one scheduler step, as the workers do."""
    losses = []
    for part in parts:
        loss = policy_loss(model, part, scale)
        loss.backward()
        losses.append(loss.item())
    norm = clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
    scheduler.step()
    return losses, norm


def build_trainer(
    model_dir: Path, *, sharded: bool, unit_min_parameters: int | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """``unit_min_parameters`` None: ``shard_model``'s default (the tiny model's layers join the root unit)."""
    model = load_causal_lm(model_dir)
    if sharded:
        grouping = {} if unit_min_parameters is None else {"unit_min_parameters": unit_min_parameters}
        model = shard_model(model, device=torch.device("cpu"), **grouping)
    optimizer = build_optimizer(model, learning_rate=LEARNING_RATE, weight_decay=0.1)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="cosine")
    return model, optimizer, scheduler


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        try:
            torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def run_checks(rank: int, port: int, model_dir: str, work_dir: str) -> None:
    """One rank of the job: every check in order, each outcome recorded in ``rank<r>.json``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=COLLECTIVE_TIMEOUT,
    )
    directory, work = Path(model_dir), Path(work_dir)
    cpu = torch.device("cpu")
    outcomes: dict[str, str | None] = {}
    shared: dict[str, Any] = {}
    batch = global_batch(seed=0)
    mine = rank_slice(batch, rank)
    halves = [rank_slice(batch, r) for r in range(WORLD_SIZE)]
    tokens = batch["response_mask"].sum().item()

    def check(name: str, body: Callable[[], None]) -> None:
        try:
            body()
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()

    def buckets() -> None:
        reference = load_causal_lm(directory).state_dict()
        model = shard_model(load_causal_lm(directory), device=cpu)
        names: list[str] = []
        gathered: dict[str, torch.Tensor] = {}
        sizes: list[tuple[int, int]] = []
        for bucket in iter_full_weight_buckets(model, bucket_bytes=BUCKET_BYTES):
            names.extend(name for name, _ in bucket)
            gathered.update(bucket)
            sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
        as_bf16 = {  # also collectives: gathered before the first assertion
            name: tensor
            for bucket in iter_full_weight_buckets(model, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16)
            for name, tensor in bucket
        }
        whole = full_state_dict(model)
        torch.manual_seed(0)  # the same weights on both ranks, as shard_model requires
        odd = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))  # 3 and 5 rows: rank 1 holds fewer
        odd_reference = {name: tensor.clone() for name, tensor in odd.state_dict().items()}
        fully_shard(odd, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
        odd_gathered = {
            name: tensor
            for bucket in iter_full_weight_buckets(odd, bucket_bytes=1 << 20, dtype=torch.float64)
            for name, tensor in bucket
        }
        assert names == list(reference), "names and order must be the HF state_dict's"
        assert all(torch.equal(gathered[name], tensor) for name, tensor in reference.items())
        assert all(size <= BUCKET_BYTES or count == 1 for count, size in sizes), sizes
        assert len(sizes) > 3 and any(count > 1 for count, _ in sizes), sizes
        assert all(torch.equal(whole[name], tensor) for name, tensor in reference.items())
        assert all(
            torch.equal(as_bf16[name], tensor.to(torch.bfloat16)) for name, tensor in reference.items()
        )
        assert odd_gathered.keys() == odd_reference.keys()
        assert all(
            torch.equal(odd_gathered[name], tensor.double()) for name, tensor in odd_reference.items()
        ), "uneven rows (padded chunks) must be cut back to the full shape"

    def train() -> None:
        # Reference: the whole batch, both halves accumulated, loss normalised by the global
        # token count. Rank r: its half, scaled by the world size, because FSDP2 averages the
        # gradients over ranks. Same gradients, exactly, if the sharding is right.
        reference = build_trainer(directory, sharded=False)
        sharded = build_trainer(directory, sharded=True)
        ref_losses, ref_norm = train_step(*reference, halves, 1.0 / tokens)
        (loss,), norm = train_step(*sharded, [mine], WORLD_SIZE / tokens)
        state = full_state_dict(sharded[0])
        shared["reference"], shared["sharded"] = reference, sharded
        assert loss == pytest.approx(WORLD_SIZE * ref_losses[rank], rel=1e-6, abs=1e-7)
        assert norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > MAX_GRAD_NORM
        assert_same_weights(state, reference[0].state_dict(), atol=1e-6)

    def unit_grouping() -> None:
        # Per-layer units (0), both layers in one unit (a minimum above one layer's size) and the
        # default (layers in the root unit): different collectives, the same sums, the same bits.
        layer = sum(p.numel() for p in load_causal_lm(directory).model.layers[0].parameters())
        groupings = {"per-layer": 0, "two-layer unit": layer + 1}
        states = {}
        for label, minimum in groupings.items():
            trainer = build_trainer(directory, sharded=True, unit_min_parameters=minimum)
            # One FSDP state per unit; a grouped unit's modules share theirs.
            units = {id(m._get_fsdp_state()) for m in trainer[0].modules() if isinstance(m, FSDPModule)}
            train_step(*trainer, [mine], WORLD_SIZE / tokens)
            states[label] = (full_state_dict(trainer[0]), len(units))
        default_state = full_state_dict(shared["sharded"][0])
        assert [count for _, count in states.values()] == [3, 2], states
        for label, (state, _) in states.items():
            try:
                assert_same_weights(state, default_state, atol=0.0)
            except AssertionError as error:
                raise AssertionError(f"{label}: {error}") from None

    def checkpoint() -> None:
        model, optimizer, scheduler = shared["sharded"]
        save_train_state(work / "train-state", model, optimizer, scheduler)
        restored = build_trainer(directory, sharded=True)
        load_train_state(work / "train-state", *restored)
        same_after_load = full_state_dict(restored[0]), full_state_dict(model)
        second_batch = global_batch(seed=1)
        part = rank_slice(second_batch, rank)
        scale = WORLD_SIZE / second_batch["response_mask"].sum().item()
        continued = train_step(model, optimizer, scheduler, [part], scale)
        resumed = train_step(*restored, [part], scale)
        after = full_state_dict(model), full_state_dict(restored[0])
        assert_same_weights(*same_after_load, atol=0.0)
        assert restored[2].last_epoch == scheduler.last_epoch == 2
        assert restored[2].get_last_lr() == scheduler.get_last_lr()
        assert resumed == continued
        assert_same_weights(after[1], after[0], atol=0.0)
        files = sorted(path.name for path in (work / "train-state").iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "scheduler.pt"], files

    def value_model() -> None:
        head = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))  # same on both ranks
        reference = load_value_model(directory)
        model = load_value_model(directory)
        for critic in (reference, model):
            with torch.no_grad():
                critic.value_head.weight.copy_(head)
        sharded = shard_model(model, device=cpu)
        inputs = (mine["input_ids"], mine["attention_mask"], mine["position_ids"])
        with torch.no_grad():
            got = token_values(sharded, *inputs, response_len=RESPONSE_WIDTH)
            expected = token_values(reference, *inputs, response_len=RESPONSE_WIDTH)
        state = full_state_dict(sharded)
        assert got.shape == (ROWS_PER_RANK, RESPONSE_WIDTH)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert_same_weights(state, reference.state_dict(), atol=0.0)

    def non_finite() -> None:
        trainer = build_trainer(directory, sharded=True)
        model: Any = trainer[0]
        optimizer, scheduler = trainer[1], trainer[2]
        before = full_state_dict(model)
        policy_loss(model, mine, 1.0 / tokens).backward()
        if rank == 0:  # poison only rank 0's shard of one gradient
            grad = model.model.layers[0].mlp.up_proj.weight.grad
            grad.to_local().fill_(float("nan"))
        norm = clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
        after = full_state_dict(model)
        assert norm != norm, f"rank {rank} saw norm {norm}"  # NaN everywhere: the norm is global
        assert_same_weights(after, before, atol=0.0)
        assert not optimizer.state
        assert all(parameter.grad is None for parameter in model.parameters())

    def shared_prompts() -> None:
        # Each rank's rows share a prompt: the sharded model runs it once (two forward passes of
        # every FSDP unit before backward, per-layer units), the reference runs every row whole.
        # Gradients are compared, not weights after AdamW: the two paths sum in different orders,
        # and AdamW's g / sqrt(v) turns a last-bit difference in a near-zero gradient into a
        # visible step.
        prompt_batch = shared_prompt_batch(seed=2)
        scale = 1.0 / prompt_batch["response_mask"].sum().item()
        reference = load_causal_lm(directory)
        sharded = shard_model(load_causal_lm(directory), device=cpu, unit_min_parameters=0)
        policy_loss(reference, prompt_batch, scale).backward()
        mine = {
            name: tensor[rank * SHARED_PROMPT_ROWS : (rank + 1) * SHARED_PROMPT_ROWS]
            for name, tensor in prompt_batch.items()
        }
        loss = policy_loss(sharded, mine, WORLD_SIZE * scale, shared_prompt_min_tokens=0)
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
        expected = {name: p.grad for name, p in reference.named_parameters()}
        assert grads.keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-4, msg=name)

    try:
        check("buckets_reassemble_the_unsharded_state_dict", buckets)
        check("sharded_loss_and_step_match_unsharded", train)
        check("every_unit_grouping_trains_identically", unit_grouping)
        check("checkpoint_round_trip_continues_identically", checkpoint)
        check("sharded_value_model_matches_unsharded", value_model)
        check("non_finite_grad_on_one_rank_skips_the_step_everywhere", non_finite)
        check("shared_prompt_training_matches_unshared", shared_prompts)
    finally:
        (work / f"rank{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, str | None]]:
    """Runs the two-rank job once; ``{check: {rank: traceback or None}}``."""
    root = tmp_path_factory.mktemp("fsdp-2ranks")
    model_dir = write_tiny_model(root / "qwen2", "qwen2", seed=11)
    results: dict[str, dict[int, str | None]] = run_spawned_ranks(
        run_checks,
        (str(model_dir), str(root)),
        world_size=WORLD_SIZE,
        work_dir=root,
        deadline_seconds=JOB_DEADLINE_SECONDS,
        expected=CHECKS,
        what="the two-rank FSDP job",
    )
    return results


@pytest.mark.parametrize("check", CHECKS)
def test_two_rank_fsdp(outcomes: dict[str, dict[int, str | None]], check: str) -> None:
    per_rank = outcomes[check]
    assert sorted(per_rank) == list(range(WORLD_SIZE)), f"{check} did not run on every rank: {per_rank}"
    failures = {rank: trace for rank, trace in per_rank.items() if trace is not None}
    assert not failures, "\n".join(f"--- rank {rank}\n{trace}" for rank, trace in failures.items())
