"""The megatron-core backend on four gloo ranks (CPU, through ``tests/megatron_shim.py``) against HF references.

One spawned four-rank job (no Ray, no torchrun) runs every check in order, switching megatron's
parallel layout between checks (``destroy_parallel_state`` / ``initialize_parallel_state`` over
the same world): TP=2 (DP=2), PP=2 (DP=2), TP=2 x PP=2, TP=4 and TP=1 (DP=4). The HF references
(weights, log-probs, values, one optimizer step) are computed once in this pytest process and
handed to the ranks in a file, so the ranks run megatron only. Each check's outcome (a traceback
or ``None``) comes back per rank in a JSON file and each test below asserts one check; spawning
once keeps the cost to one import of torch + megatron per rank.

Data parallelism is real: the rows are split by DP rank, the loss is normalised by the global
token count and scaled by the DP size (megatron's DDP averages gradients over DP ranks), so
every layout's gradient is the reference's full-batch gradient. Inside a check every
collective runs before the first assertion, so a failing rank does not leave its peers waiting;
the gloo timeout and the job deadline bound the damage if that rule is ever broken.

The shim is applied inside the spawned ranks only (never in this process).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spawned_ranks import run_spawned_ranks

pytest.importorskip("megatron.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

pytestmark = pytest.mark.integration

TESTS_DIR = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4
JOB_DEADLINE_SECONDS = 420
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)

CHECKS = [
    "hf_round_trip_is_bit_exact",
    "local_shards_are_the_hf_slices",
    "logprobs_and_entropy_match_hf",
    "critic_values_and_step_match_hf",
    "train_step_matches_hf_and_tp1",
    "checkpoint_round_trip_continues_identically",
    "checkpoint_loads_into_another_layout",
    "distributed_optimizer_shards_adam_state_over_dp",
    "distributed_optimizer_steps_like_the_non_distributed_one",
    "distributed_optimizer_checkpoint_resumes_exactly_at_dp2",
    "non_finite_grad_skips_the_step_everywhere",
    "activation_checkpointing_gives_the_same_step",
    "chunked_vocab_parallel_logprobs_equal_the_full_softmax",
    "offload_round_trip_continues_identically",
    "training_shard_reaches_generation_without_a_copy",
]

ROWS = 8
PROMPT_WIDTH = 6
RESPONSE_WIDTH = 5
TEMPERATURE = 0.8
LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.1
# Adam's first step moves a weight by ~lr * g / (|g| + eps): with the default eps (1e-8) the few
# gradients of ~1e-8 that a tiny random model has turn fp32 rounding differences between
# kernels into lr-sized steps. eps = 1e-4 keeps the step a smooth function of the gradient.
ADAM_EPS = 1e-4
MAX_GRAD_NORM = 0.5  # below the first step's gradient norm, so clipping is exercised
BUCKET_BYTES = 150_000  # below the 384 x 128 fp32 embedding (196,608 bytes), above a layer's q/k/v


def batch(seed: int) -> dict[str, torch.Tensor]:
    """Engine-layout rows of varied prompt and response lengths, with advantages."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((ROWS, PROMPT_WIDTH + RESPONSE_WIDTH), 259)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(ROWS):
        prompt_len = 1 + row % PROMPT_WIDTH
        response_len = RESPONSE_WIDTH - row % 3
        start, end = PROMPT_WIDTH - prompt_len, PROMPT_WIDTH + response_len
        input_ids[row, start:end] = torch.randint(0, 256, (end - start,), generator=generator)
        attention_mask[row, start:end] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp_min(0),
        "response_mask": attention_mask[:, PROMPT_WIDTH:].float(),
        "advantages": torch.randn(ROWS, RESPONSE_WIDTH, generator=generator),
        "returns": torch.randn(ROWS, RESPONSE_WIDTH, generator=generator),
    }


def value_loss(values: torch.Tensor, part: Mapping[str, torch.Tensor], scale: float) -> torch.Tensor:
    """``scale`` * the sum over response tokens of the squared error to the returns."""
    return scale * ((values - part["returns"]) ** 2 * part["response_mask"]).sum()


def policy_loss(
    log_probs: torch.Tensor, entropy: torch.Tensor | None, part: Mapping[str, torch.Tensor], scale: float
) -> torch.Tensor:
    """``scale`` * sum over response tokens of (-A * log p - 0.01 H): log-probs and entropy both carry grads."""
    assert entropy is not None
    return scale * ((-part["advantages"] * log_probs - 0.01 * entropy) * part["response_mask"]).sum()


# ------------------------------------------------------------------------------ references (this process)


def compute_references(model_dir: Path, reward_dir: Path, path: Path) -> None:
    """HF results every check compares against, written to ``path`` (torch.save)."""
    from hybridflow.backends import fsdp

    data = {"first": batch(seed=0), "second": batch(seed=1)}
    first = data["first"]
    inputs = (first["input_ids"], first["attention_mask"], first["position_ids"])
    model = fsdp.load_causal_lm(model_dir)
    refs: dict[str, Any] = {"data": data, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    with torch.no_grad():
        refs["log_probs"], refs["entropy"] = fsdp.token_logprobs_and_entropy(
            model, *inputs, response_len=RESPONSE_WIDTH, temperature=TEMPERATURE
        )
        refs["values"] = fsdp.token_values(
            fsdp.load_value_model(reward_dir), *inputs, response_len=RESPONSE_WIDTH
        )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
    )
    scheduler = fsdp.build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="cosine")
    log_probs, entropy = fsdp.token_logprobs_and_entropy(
        model, *inputs, response_len=RESPONSE_WIDTH, temperature=TEMPERATURE
    )
    assert entropy is not None
    per_token = (-first["advantages"] * log_probs - 0.01 * entropy) * first["response_mask"]
    refs["row_losses"] = per_token.detach().sum(dim=1) / first["response_mask"].sum()
    policy_loss(log_probs, entropy, first, 1.0 / first["response_mask"].sum().item()).backward()
    refs["grad_norm"] = fsdp.clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
    refs["stepped"] = {k: v.clone() for k, v in model.state_dict().items()}
    # The critic: one clipped step on the value loss, its weights under the megatron export's names.
    critic = fsdp.load_value_model(reward_dir)
    critic_optimizer = torch.optim.AdamW(
        critic.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
    )
    critic_scheduler = fsdp.build_lr_scheduler(
        critic_optimizer, warmup_steps=0, total_steps=4, schedule="cosine"
    )
    values = fsdp.token_values(critic, *inputs, response_len=RESPONSE_WIDTH)
    value_loss(values, first, 1.0 / first["response_mask"].sum().item()).backward()
    refs["critic_grad_norm"] = fsdp.clip_grad_norm_and_step(
        critic, critic_optimizer, critic_scheduler, max_grad_norm=MAX_GRAD_NORM
    )
    refs["critic_stepped"] = {
        name.replace("backbone.", "model.", 1): tensor.clone() for name, tensor in critic.state_dict().items()
    }
    torch.save(refs, path)


# ------------------------------------------------------------------------------ the ranks


def run_checks(rank: int, port: int, root: str) -> None:
    """One rank of the job: every check in order, each outcome recorded in ``rank<r>.json``."""
    sys.path.insert(0, str(TESTS_DIR))
    import megatron_shim

    megatron_shim.install()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=COLLECTIVE_TIMEOUT,
    )
    from megatron.core import parallel_state

    from hybridflow.backends import megatron as mb
    from hybridflow.backends.megatron.config import DecoderArch
    from hybridflow.backends.megatron.convert import units
    from hybridflow.backends.megatron.optim import torch_optimizer

    work = Path(root)
    qwen, llama, reward = work / "qwen2", work / "llama", work / "reward"
    refs = torch.load(work / "references.pt", weights_only=False)
    first: dict[str, torch.Tensor] = refs["data"]["first"]
    tokens = first["response_mask"].sum().item()
    outcomes: dict[str, str | None] = {}
    shared: dict[str, Any] = {}

    def check(name: str, body: Callable[[], None], *, keep_layout: bool = False) -> None:
        try:
            body()
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()
            keep_layout = False
        if not keep_layout:
            mb.destroy_parallel_state()

    def my_rows(layout: mb.ParallelLayout, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = slice(layout.dp_rank * ROWS // layout.dp_size, (layout.dp_rank + 1) * ROWS // layout.dp_size)
        return {name: tensor[rows] for name, tensor in data.items()}

    def trainer(
        directory: Path, *, activation_checkpointing: bool = False, distributed_optimizer: bool = True
    ) -> tuple[Any, Any, Any]:
        model = mb.wrap_data_parallel(
            mb.load_causal_lm(directory, activation_checkpointing=activation_checkpointing),
            distributed_optimizer=distributed_optimizer,
        )
        optimizer = mb.build_optimizer(
            model, learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
        )
        scheduler = mb.build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="cosine")
        return model, optimizer, scheduler

    def train_step(
        parts: tuple[Any, Any, Any], layout: mb.ParallelLayout, data: Mapping[str, torch.Tensor]
    ) -> tuple[float, float]:
        model, optimizer, scheduler = parts
        mine = my_rows(layout, data)
        half = (mine["input_ids"].shape[0] + 1) // 2
        micro = [{k: v[:half] for k, v in mine.items()}, {k: v[half:] for k, v in mine.items()}]
        scale = layout.dp_size / data["response_mask"].sum().item()

        def loss_fn(
            log_probs: torch.Tensor, entropy: torch.Tensor | None, part: Mapping[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = policy_loss(log_probs, entropy, part, scale)
            return loss, {"loss": loss.detach()}

        metrics = mb.forward_backward(
            model, micro, loss_fn, response_len=RESPONSE_WIDTH, temperature=TEMPERATURE
        )
        norm = mb.clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
        scheduler.step()
        return sum(m["loss"] for m in metrics), norm

    def assert_same(
        got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], atol: float
    ) -> None:
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            try:
                torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from None

    def round_trip() -> None:
        exports: list[tuple[tuple[int, int], dict[str, torch.Tensor]]] = []
        buckets: list[tuple[list[str], int]] = []
        as_bf16: dict[str, torch.Tensor] = {}
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            model = mb.load_causal_lm(qwen)
            exports.append(((tp, pp), mb.full_state_dict(model)))
            if (tp, pp) == (2, 2):
                for bucket in mb.iter_full_weight_buckets(model, bucket_bytes=BUCKET_BYTES):
                    buckets.append(
                        ([n for n, _ in bucket], sum(t.numel() * t.element_size() for _, t in bucket))
                    )
                for bucket in mb.iter_full_weight_buckets(
                    model, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16
                ):
                    as_bf16.update(bucket)
            mb.destroy_parallel_state()
        mb.initialize_parallel_state(tp_size=4, pp_size=1)
        llama_export = mb.full_state_dict(mb.load_causal_lm(llama))
        llama_state = torch.load(work / "llama_state.pt", weights_only=True)
        for layout, export in exports:
            assert list(export) == list(refs["state"]), layout
            assert all(torch.equal(export[k], v) for k, v in refs["state"].items()), layout
        assert list(llama_export) == list(llama_state)
        assert all(torch.equal(llama_export[k], v) for k, v in llama_state.items()), "llama tp=4"
        # A bucket stays within budget unless it is one conversion unit (q/k/v, gate/up never split).
        unit_of = {
            name: i
            for i, unit in enumerate(units(DecoderArch.from_directory(qwen)))
            for name in unit.hf_names
        }
        for names, size in buckets:
            assert size <= BUCKET_BYTES or len({unit_of[n] for n in names}) == 1, (names, size)
        assert len(buckets) > 3 and any(len({unit_of[n] for n in names}) > 1 for names, _ in buckets)
        assert [n for names, _ in buckets for n in names] == list(refs["state"])
        assert all(torch.equal(as_bf16[k], v.to(torch.bfloat16)) for k, v in refs["state"].items())

    def shards() -> None:
        for tp, pp in ((2, 1), (2, 2)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            pieces = mb.local_shards(mb.load_causal_lm(qwen))
            owned = [name for name in refs["state"] if name in pieces]
            assert list(pieces) == owned
            for name, piece in pieces.items():
                full = refs["state"][name]
                assert torch.equal(piece.tensor, full[piece.index()]), name
                assert (piece.tp_rank, piece.tp_size, piece.pp_rank) == (layout.tp_rank, tp, layout.pp_rank)
                if piece.dim is not None:
                    width = full.shape[piece.dim] // tp
                    assert (piece.start, piece.stop) == (layout.tp_rank * width, (layout.tp_rank + 1) * width)
            stage_layers = {int(n.split(".")[2]) for n in owned if n.startswith("model.layers.")}
            assert stage_layers == ({layout.pp_rank} if pp == 2 else {0, 1}), stage_layers
            mb.destroy_parallel_state()

    def logprobs() -> None:
        results = []
        for tp, pp in ((2, 1), (1, 2), (2, 2)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            mine = my_rows(layout, first)
            got = mb.token_logprobs_and_entropy(
                mb.load_causal_lm(qwen),
                mine["input_ids"],
                mine["attention_mask"],
                mine["position_ids"],
                response_len=RESPONSE_WIDTH,
                temperature=TEMPERATURE,
                micro_batch_size=3,  # uneven micro-batches: 3 + 1 rows, or 3 + 3 + 2
            )
            results.append((layout, mine["response_mask"].bool(), got))
            mb.destroy_parallel_state()
        for layout, mask, (log_probs, entropy) in results:
            rows = my_rows(layout, {"lp": refs["log_probs"], "ent": refs["entropy"]})
            assert entropy is not None
            torch.testing.assert_close(log_probs[mask], rows["lp"][mask], atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[mask], rows["ent"][mask], atol=1e-5, rtol=0)

    def critic_loss(
        values: torch.Tensor, _: torch.Tensor | None, part: Mapping[str, torch.Tensor], *, scale: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return value_loss(values, part, scale), {}

    def values() -> None:
        results = []
        for tp, pp in ((2, 1), (2, 2)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            mine = my_rows(layout, first)
            critic = mb.load_value_model(reward)
            got = mb.token_values(
                critic,
                mine["input_ids"],
                mine["attention_mask"],
                mine["position_ids"],
                response_len=RESPONSE_WIDTH,
            )
            names = list(mb.full_state_dict(critic))
            results.append((layout, mine["response_mask"].bool(), got, names))
            if (tp, pp) == (2, 2):  # and one clipped step of the critic on the value loss
                ddp = mb.wrap_data_parallel(critic)
                optimizer = mb.build_optimizer(
                    ddp, learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
                )
                scheduler = mb.build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="cosine")
                scale = layout.dp_size / first["response_mask"].sum().item()
                mb.forward_backward(
                    ddp,
                    [mine],
                    partial(critic_loss, scale=scale),
                    response_len=RESPONSE_WIDTH,
                )
                critic_norm = mb.clip_grad_norm_and_step(
                    ddp, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM
                )
                critic_state = mb.full_state_dict(ddp)
            mb.destroy_parallel_state()
        for layout, mask, got, names in results:
            expected = my_rows(layout, {"values": refs["values"]})["values"]
            torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
            assert names[-2:] == ["value_head.weight", "value_head.bias"] and "lm_head.weight" not in names
        assert critic_norm == pytest.approx(refs["critic_grad_norm"], rel=1e-5)
        assert critic_norm > MAX_GRAD_NORM
        assert_same(critic_state, refs["critic_stepped"], atol=1e-6)

    def train() -> None:
        stepped: dict[tuple[int, int], tuple[float, float, dict[str, torch.Tensor]]] = {}
        for tp, pp in ((1, 1), (2, 1), (2, 2)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            parts = trainer(qwen)
            loss, norm = train_step(parts, layout, first)
            stepped[(tp, pp)] = (loss, norm, mb.full_state_dict(parts[0]))
            if (tp, pp) == (2, 2):
                shared["trainer"] = parts
                continue
            mb.destroy_parallel_state()
        for (tp, pp), (loss, norm, state) in stepped.items():
            dp = WORLD_SIZE // (tp * pp)
            dp_rank = rank // tp % dp
            # Each rank's loss is its DP shard's share of the reference loss, scaled by dp.
            expected_loss = dp * refs["row_losses"].chunk(dp)[dp_rank].sum().item()
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6), (tp, pp)
            assert norm == pytest.approx(refs["grad_norm"], rel=1e-5) and norm > MAX_GRAD_NORM, (tp, pp)
            assert_same(state, refs["stepped"], atol=1e-6)
            assert_same(state, stepped[(1, 1)][2], atol=1e-6)

    def checkpoint() -> None:
        # Continues from the TP=2 x PP=2 trainer of the previous check (one step taken), whose
        # parallel state is still up: its modules hold that state's process groups.
        layout = mb.current_layout()
        model, optimizer, scheduler = shared["trainer"]
        directory = work / "train-state"
        mb.save_train_state(directory, model, optimizer, scheduler)
        restored = trainer(qwen)
        mb.load_train_state(directory, *restored)
        same_after_load = mb.full_state_dict(restored[0]), mb.full_state_dict(model)
        continued = train_step((model, optimizer, scheduler), layout, refs["data"]["second"])
        resumed = train_step(restored, layout, refs["data"]["second"])
        after = mb.full_state_dict(model), mb.full_state_dict(restored[0])
        shared["saved"] = same_after_load[1]
        shared["continued"] = after[0]
        assert_same(*same_after_load, atol=0.0)
        assert restored[2].last_epoch == scheduler.last_epoch == 2
        assert restored[2].get_last_lr() == scheduler.get_last_lr()
        assert resumed == continued
        assert_same(after[1], after[0], atol=0.0)
        files = sorted(path.name for path in directory.iterdir())
        assert {".metadata", "common.pt", "metadata.json"} <= set(files), files

    def reshard_checkpoint() -> None:
        # Saved by TP=2 x PP=2 above (DP=1); loaded by TP=1 x PP=2 (DP=2) and by TP=1 (DP=4),
        # whose distributed optimizers split the state 2 and 4 ways: the weights are the saved
        # ones, and the next step (which reads Adam's moments and step) is the one the saving
        # layout took, up to the summation order of another layout.
        loaded = []
        for tp, pp in ((1, 2), (1, 1)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            restored = trainer(qwen)
            mb.load_train_state(work / "train-state", *restored)
            state = mb.full_state_dict(restored[0])
            train_step(restored, layout, refs["data"]["second"])
            loaded.append((state, mb.full_state_dict(restored[0])))
            mb.destroy_parallel_state()
        for state, stepped in loaded:
            assert_same(state, shared["saved"], atol=0.0)
            assert_same(stepped, shared["continued"], atol=1e-6)

    def optimizer_state_bytes(parts: tuple[Any, Any, Any]) -> tuple[int, int]:
        """(bytes of this rank's Adam moments, bytes of its model parameters), measured from the tensors.

        The moments are the optimizer state tensors with a dimension; the 0-d step counters
        (4 bytes per parameter range) are left out.
        """
        model, optimizer, _ = parts
        state = [t for t in mb.offload_tensors(model, optimizer)[1] if t.dim() > 0]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}
        return sum(storages.values()), sum(p.numel() * p.element_size() for p in model.parameters())

    def sharded_state() -> None:
        # One step in each layout (Adam's state exists from the first step on), then every rank's
        # measured state bytes against its parameter bytes: 2x (two fp32 moments) at DP=1,
        # split over the DP group at DP=2 and 4; the non-distributed optimizer holds 2x at DP=2.
        measured = {}
        for tp, pp, distributed in ((2, 2, True), (2, 1, True), (1, 1, True), (2, 1, False)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            parts = trainer(qwen, distributed_optimizer=distributed)
            train_step(parts, layout, first)
            state, params = optimizer_state_bytes(parts)
            group = [torch.zeros(2, dtype=torch.int64) for _ in range(layout.dp_size)]
            dist.all_gather(
                group, torch.tensor([state, params]), group=parallel_state.get_data_parallel_group()
            )
            measured[(tp, pp, distributed)] = (layout.dp_size, state, params, [g.tolist() for g in group])
            mb.destroy_parallel_state()
        for (tp, pp, distributed), (dp, state, params, group) in measured.items():
            if not distributed:
                assert state == 2 * params, (tp, pp, state, params)
                continue
            # Every moment of every parameter is held exactly once in the DP group...
            assert all(other_params == params for _, other_params in group)
            assert sum(other_state for other_state, _ in group) == 2 * params, (tp, pp, group)
            # ...and each rank holds 1/d of it (megatron's buckets align the ranges, hence 1%).
            assert abs(state - 2 * params / dp) <= 0.01 * 2 * params / dp, (tp, pp, state, params)
        ratio = {dp: state / params for (_, _, d), (dp, state, params, _) in measured.items() if d}
        assert ratio[1] == 2.0
        assert ratio[2] / ratio[1] == pytest.approx(0.5, rel=0.01), ratio
        assert ratio[4] / ratio[1] == pytest.approx(0.25, rel=0.02), ratio
        non_distributed = measured[(2, 1, False)]
        assert measured[(2, 1, True)][1] <= 0.51 * non_distributed[1]

    def distributed_like_non_distributed() -> None:
        # Three steps at DP=2 (TP=2) and DP=4 with each optimizer: the same losses, norms and
        # weights up to fp32 rounding (reduce-scatter vs all-reduce order).
        runs: dict[tuple[int, bool], list[Any]] = {}
        for tp in (2, 1):
            for distributed in (True, False):
                layout = mb.initialize_parallel_state(tp_size=tp, pp_size=1)
                parts = trainer(qwen, distributed_optimizer=distributed)
                figures = []
                for data in (first, refs["data"]["second"], first):
                    figures.append(train_step(parts, layout, data))
                runs[(tp, distributed)] = [figures, mb.full_state_dict(parts[0])]
                mb.destroy_parallel_state()
        for tp in (2, 1):
            (figures, state), (expected_figures, expected_state) = runs[(tp, True)], runs[(tp, False)]
            for (loss, norm), (expected_loss, expected_norm) in zip(figures, expected_figures, strict=True):
                assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
                assert norm == pytest.approx(expected_norm, rel=1e-5)
            assert_same(state, expected_state, atol=1e-6)
            assert any(not torch.equal(state[k], v) for k, v in refs["state"].items())  # it trained

    def distributed_checkpoint() -> None:
        # TP=2, DP=2: each DP rank holds half of Adam's state. Save after a step, load into a fresh
        # trainer of the same layout: the same weights and state, bit for bit, and the next step too.
        layout = mb.initialize_parallel_state(tp_size=2, pp_size=1)
        model, optimizer, scheduler = trainer(qwen)
        train_step((model, optimizer, scheduler), layout, first)
        directory = work / "train-state-dp2"
        mb.save_train_state(directory, model, optimizer, scheduler)
        restored = trainer(qwen)
        mb.load_train_state(directory, *restored)
        saved, loaded = torch_optimizer(optimizer), torch_optimizer(restored[1])
        pairs = [
            (mine, theirs)
            for group, other in zip(saved.param_groups, loaded.param_groups, strict=True)
            for mine, theirs in zip(group["params"], other["params"], strict=True)
        ]
        same_state = all(
            torch.equal(mine, theirs)
            and sorted(saved.state[mine]) == sorted(loaded.state[theirs])
            and all(torch.equal(value, loaded.state[theirs][key]) for key, value in saved.state[mine].items())
            for mine, theirs in pairs
        )
        continued = train_step((model, optimizer, scheduler), layout, refs["data"]["second"])
        resumed = train_step(restored, layout, refs["data"]["second"])
        after = mb.full_state_dict(model), mb.full_state_dict(restored[0])
        assert same_state and pairs
        assert resumed == continued
        assert_same(after[1], after[0], atol=0.0)
        shutil.rmtree(directory, ignore_errors=True)

    def non_finite() -> None:
        layout = mb.initialize_parallel_state(tp_size=2, pp_size=1)
        model, optimizer, scheduler = trainer(qwen)
        before = mb.full_state_dict(model)
        mine = my_rows(layout, first)

        def loss_fn(
            log_probs: torch.Tensor, entropy: torch.Tensor | None, part: Mapping[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, float]]:
            return policy_loss(log_probs, entropy, part, 1.0 / tokens), {}

        mb.forward_backward(model, [mine], loss_fn, response_len=RESPONSE_WIDTH)
        if rank == 0:  # poison the gradients of one rank only (the distributed optimizer reads
            # only the range of the reduced gradients this rank owns: poison all of them)
            for parameter in mb.unwrap(model).parameters():
                parameter.main_grad.fill_(float("nan"))
        norm = mb.clip_grad_norm_and_step(model, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
        after = mb.full_state_dict(model)
        assert norm != norm, f"rank {rank} saw norm {norm}"  # NaN everywhere: the norm is global
        assert_same(after, before, atol=0.0)
        assert not torch_optimizer(optimizer).state  # no Adam state: no step was taken

    def recompute() -> None:
        # Full recompute of every layer, through the pipeline: the same step as without it.
        stepped = []
        for tp, pp in ((2, 1), (2, 2)):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
            parts = trainer(qwen, activation_checkpointing=True)
            config = mb.unwrap(parts[0]).config
            assert (config.recompute_granularity, config.recompute_method) == ("full", "uniform")
            loss, norm = train_step(parts, layout, first)
            stepped.append((layout, loss, norm, mb.full_state_dict(parts[0])))
            mb.destroy_parallel_state()
        for layout, loss, norm, state in stepped:
            expected_loss = (
                layout.dp_size * refs["row_losses"].chunk(layout.dp_size)[layout.dp_rank].sum().item()
            )
            assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
            assert norm == pytest.approx(refs["grad_norm"], rel=1e-5)
            assert_same(state, refs["stepped"], atol=1e-6)

    def chunked_logprobs() -> None:
        # Every rank draws the same full logits, takes its TP slice, and must match a plain
        # log-softmax over the unpadded vocabulary, in values and gradients, for any chunking.
        from hybridflow.backends.megatron.logprobs import vocab_parallel_logprobs_and_entropy

        results = []
        for tp in (2, 4):
            layout = mb.initialize_parallel_state(tp_size=tp, pp_size=1)
            generator = torch.Generator().manual_seed(7)
            padded, vocab = 24, 21  # the last TP rank holds padding columns
            full = torch.randn(3, 5, padded, generator=generator) * 3
            targets = torch.randint(0, vocab, (3, 5), generator=generator)
            weights = torch.randn(2, 3, 5, generator=generator)
            width = padded // tp
            columns = slice(layout.tp_rank * width, (layout.tp_rank + 1) * width)
            for chunk in (4, 1 << 20):
                local = full[..., columns].clone().requires_grad_(True)
                log_probs, entropy = vocab_parallel_logprobs_and_entropy(
                    local, targets, vocab_size=vocab, temperature=TEMPERATURE, chunk_tokens=chunk
                )
                assert entropy is not None
                (weights[0] * log_probs + weights[1] * entropy).sum().backward()
                results.append((columns, log_probs.detach(), entropy.detach(), local.grad))
            mb.destroy_parallel_state()
        reference = full.clone().requires_grad_(True)
        z = reference[..., :vocab] / TEMPERATURE
        log_softmax = torch.log_softmax(z, dim=-1)
        expected_lp = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        expected_entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
        (weights[0] * expected_lp + weights[1] * expected_entropy).sum().backward()
        assert reference.grad is not None
        for columns, log_probs, entropy, grad in results:
            torch.testing.assert_close(log_probs, expected_lp.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(grad, reference.grad[..., columns], atol=1e-5, rtol=0)

    def offload() -> None:
        # Two steps with the training state offloaded (parameters, gradient buffers, Adam's
        # state) and reloaded before each, as around generation: the same as without.
        from hybridflow.backends.offload import DeviceOffload

        layout = mb.initialize_parallel_state(tp_size=2, pp_size=2)
        plain, moved = trainer(qwen), trainer(qwen)
        round_trip = DeviceOffload("the test trainer")
        seen = []  # asserted after the loop: no rank may skip a collective its peers run
        for data in (first, refs["data"]["second"]):
            parameters, optimizer_state = mb.offload_tensors(moved[0], moved[1])
            stats = round_trip.offload(parameters + optimizer_state)
            emptied = all(p.untyped_storage().nbytes() == 0 for p in moved[0].parameters())
            grads_emptied = all(p.main_grad.untyped_storage().nbytes() == 0 for p in moved[0].parameters())
            round_trip.reload()
            seen.append((stats.bytes > 0, emptied, grads_emptied))
            seen.append(train_step(moved, layout, data) == train_step(plain, layout, data))
        assert seen == [(True, True, True), True] * 2, seen
        assert_same(mb.full_state_dict(moved[0]), mb.full_state_dict(plain[0]), atol=0.0)
        assert torch_optimizer(moved[1]).state

    def shard_to_generation() -> None:
        # The 3D-HybridEngine fed from megatron's own parameters (DDP with the distributed
        # optimizer keeps them in one flat buffer): TP=2 (one key/value group per rank: every
        # block a view) and TP=1 (two groups: q/k/v copied), both gathered into t_g = 1.
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        from hybridflow.mesh import DeviceMesh
        from hybridflow.resharding import DecoderSpec, decoder_layout, hybridflow_plan
        from hybridflow.resharding.meter import TrafficMeter
        from hybridflow.resharding.transfer import BucketRecord, Resharder, SubgroupCache

        class Allocations(TorchDispatchMode):
            """Bytes of the fresh storages torch ops create (the transfer's temporaries), per window."""

            def __init__(self) -> None:
                super().__init__()
                self.window = 0
                self.largest = 0
                self.seen: set[int] = set()

            def close_window(self) -> None:
                # Freed storages' addresses may be reused by the next window's allocations.
                self.largest, self.window, self.seen = max(self.largest, self.window), 0, set()

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                inputs = {
                    leaf.untyped_storage().data_ptr()
                    for leaf in tree_flatten((args, kwargs))[0]
                    if isinstance(leaf, torch.Tensor)
                }
                for tensor in tree_flatten(out)[0]:
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        # A view or an in-place result shares an input's storage: not an allocation.
                        if storage.data_ptr() not in inputs | self.seen:
                            self.seen.add(storage.data_ptr())
                            self.window += storage.nbytes()
                return out

        outcomes_by_layout = []
        # Qwen2 (2 key/value groups): one group per TP rank, every block a view. Llama (4 groups):
        # two per rank, whose q/k/v megatron interleaves, so those are copies.
        for arch, directory, state in (
            ("qwen2", qwen, refs["state"]),
            ("llama", llama, torch.load(work / "llama_state.pt", weights_only=True)),
        ):
            config = SimpleNamespace(**json.loads((directory / "config.json").read_text()))
            spec_layout = decoder_layout(DecoderSpec.from_hf_config(config))
            mb.initialize_parallel_state(tp_size=2, pp_size=1)
            model = mb.wrap_data_parallel(mb.load_causal_lm(directory))
            train = mb.current_layout().mesh()
            plan = hybridflow_plan(spec_layout, train, DeviceMesh.generation(train, pp=1, tp=1))
            blocks = plan.rank(rank).training
            shard = mb.training_shard(model, blocks)
            live = {p.untyped_storage().data_ptr() for p in model.parameters()}
            views = sum(
                tensor.nbytes for _, tensor in shard.tensors() if tensor.untyped_storage().data_ptr() in live
            )
            copied = mb.shard_copy_bytes(model, shard)
            qkv = sum(b.numel * 4 for b in blocks if any(f"{x}_proj" in b.name for x in "qkv"))
            meter = TrafficMeter()
            resharder = Resharder(plan, rank, SubgroupCache(), meter)
            # The whole shard at once, as the torch TP engine reads it: own blocks in place.
            generation, stats = resharder.to_generation(shard)
            whole_exact = all(
                torch.equal(generation.tensor(name), state[name][generation.slice(name).index()])
                for name in generation.names()
            )
            resharder.to_training(generation, shard)
            # Bucket by bucket into memory the consumer already holds (as vLLM does), fp32 and bf16.
            bucketed = {}
            for dtype in (torch.float32, torch.bfloat16):
                engine = {
                    want.name: torch.empty(want.shape, dtype=dtype) for want, _ in plan.rank(rank).generation
                }
                record, before, allocations = BucketRecord(), meter.total, Allocations()
                in_place = 0  # bytes of the buckets' pieces that are megatron's own parameter memory
                with allocations:
                    for bucket in resharder.generation_buckets(
                        shard, bucket_bytes=BUCKET_BYTES // 3, dtype=dtype, record=record
                    ):
                        for name in bucket.names():
                            want, pieces = bucket.slice(name), bucket.blocks(name)
                            in_place += sum(
                                piece.nbytes for piece in pieces if piece.untyped_storage().data_ptr() in live
                            )
                            offset = 0
                            for piece in pieces:
                                along = want.dim if want.dim is not None else 0
                                engine[name].narrow(along, offset, piece.shape[along]).copy_(piece)
                                offset += piece.shape[along]
                        allocations.close_window()
                wire = meter.total - before
                exact = all(
                    torch.equal(engine[want.name], state[want.name][want.index()].to(dtype))
                    for want, _ in plan.rank(rank).generation
                )
                bucketed[str(dtype)] = (record, wire, allocations.largest, exact, in_place)
            largest_param = max(want.numel * 4 for want, _ in plan.rank(rank).generation)
            outcomes_by_layout.append(
                (arch, stats, whole_exact, views, copied, qkv, bucketed, largest_param, plan)
            )
            mb.destroy_parallel_state()
        for (
            arch,
            stats,
            whole_exact,
            views,
            copied,
            qkv,
            bucketed,
            largest_param,
            plan,
        ) in outcomes_by_layout:
            training_bytes = plan.training_bytes(rank).total
            # Zero copy where megatron's layout allows: everything for qwen2, all but q/k/v for llama.
            assert copied == (0 if arch == "qwen2" else qkv) and qkv > 0, (arch, copied, qkv)
            assert views + copied == training_bytes
            # The whole transfer: exact, reading the rank's own blocks in place, nothing redundant.
            assert whole_exact
            assert stats.reused == training_bytes and stats.redundant.total == 0
            assert stats.wire_received == plan.bytes_received(rank).total
            fp32_record, fp32_wire, fp32_largest, fp32_exact, fp32_in_place = bucketed[str(torch.float32)]
            bf16_record, bf16_wire, bf16_largest, bf16_exact, bf16_in_place = bucketed[str(torch.bfloat16)]
            assert fp32_exact and bf16_exact
            # fp32 into fp32: every view of the shard reaches the consumer as megatron's own
            # memory; bf16: none does (each is cast once).
            assert fp32_in_place == views and bf16_in_place == 0
            # Bytes on the wire: the plan's in fp32, half of them in bf16 (cast before sending).
            assert fp32_wire.received == plan.bytes_received(rank).total > 0
            assert 2 * bf16_wire.received == fp32_wire.received
            # fp32 into fp32: own blocks handed over as they are; bf16: each cast once.
            assert fp32_record.cast_bytes == 0 and fp32_record.own_bytes == training_bytes
            assert bf16_record.cast_bytes == training_bytes // 2 == bf16_record.own_bytes
            assert fp32_record.buckets > 3
            # The largest temporary, measured from the storages torch created in a bucket, is the
            # record's, bounded by the bucket size (or one parameter that fills a bucket alone),
            # and far below the generation shard the whole transfer would hold.
            for record, largest in ((fp32_record, fp32_largest), (bf16_record, bf16_largest)):
                assert largest == record.largest_bucket_bytes, (largest, record)
                assert 0 < largest <= max(BUCKET_BYTES // 3, largest_param)
            assert fp32_largest < plan.bytes_received(rank).total / 2

    try:
        check("hf_round_trip_is_bit_exact", round_trip)
        check("local_shards_are_the_hf_slices", shards)
        check("logprobs_and_entropy_match_hf", logprobs)
        check("critic_values_and_step_match_hf", values)
        # The next three share state: train leaves its TP=2 x PP=2 trainer (and layout) to
        # checkpoint, which leaves its save to the resharded load.
        check("train_step_matches_hf_and_tp1", train, keep_layout=True)
        check("checkpoint_round_trip_continues_identically", checkpoint)
        check("checkpoint_loads_into_another_layout", reshard_checkpoint)
        check("distributed_optimizer_shards_adam_state_over_dp", sharded_state)
        check("distributed_optimizer_steps_like_the_non_distributed_one", distributed_like_non_distributed)
        check("distributed_optimizer_checkpoint_resumes_exactly_at_dp2", distributed_checkpoint)
        check("training_shard_reaches_generation_without_a_copy", shard_to_generation)
        check("non_finite_grad_skips_the_step_everywhere", non_finite)
        check("activation_checkpointing_gives_the_same_step", recompute)
        check("chunked_vocab_parallel_logprobs_equal_the_full_softmax", chunked_logprobs)
        check("offload_round_trip_continues_identically", offload)
    finally:
        (work / f"rank{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, str | None]]:
    """Runs the four-rank job once; ``{check: {rank: traceback or None}}``."""
    from hybridflow.models import build_tiny_model, write_tiny_model

    root = tmp_path_factory.mktemp("megatron-4ranks")
    sizes: dict[str, Any] = {"hidden": 128, "heads": 4, "layers": 2, "intermediate": 256}
    model_dir = write_tiny_model(root / "qwen2", "qwen2", seed=11, kv_heads=2, **sizes)
    reward_dir = write_tiny_model(root / "reward", "qwen2", seed=12, kv_heads=2, head="score", **sizes)
    write_tiny_model(root / "llama", "llama", seed=13, kv_heads=4, **sizes)
    llama = build_tiny_model("llama", 384, kv_heads=4, seed=13, **sizes)
    torch.save(llama.state_dict(), root / "llama_state.pt")
    compute_references(model_dir, reward_dir, root / "references.pt")
    results: dict[str, dict[int, str | None]] = run_spawned_ranks(
        run_checks,
        (str(root),),
        world_size=WORLD_SIZE,
        work_dir=root,
        deadline_seconds=JOB_DEADLINE_SECONDS,
        expected=CHECKS,
        what="the four-rank megatron job",
    )
    shutil.rmtree(root / "train-state", ignore_errors=True)
    return results


@pytest.mark.parametrize("check", CHECKS)
def test_four_rank_megatron(outcomes: dict[str, dict[int, str | None]], check: str) -> None:
    per_rank = outcomes[check]
    assert sorted(per_rank) == list(range(WORLD_SIZE)), f"{check} did not run on every rank: {per_rank}"
    failures = {rank: trace for rank, trace in per_rank.items() if trace is not None}
    assert not failures, "\n".join(f"--- rank {rank}\n{trace}" for rank, trace in failures.items())
