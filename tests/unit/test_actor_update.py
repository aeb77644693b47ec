"""The FSDP actor's update loop in one process (FSDP2 over a gloo world of one, no Ray).

* On-policy (one mini-batch, one epoch) the actor may skip the separate old-log-prob pass and
  use the detached log-probs of its own forward: after N steps the parameters equal those of the
  two-pass path.
* The micro-batch size does not change the update (global loss counts).
* The contract is enforced: no old log-probs with several mini-batches is an error, not a
  silently wrong ratio.
* ``targetKl`` stops the epochs early.
* A ``miniBatchSize`` that does not divide the step leaves a last, smaller mini-batch whose
  gradient is that of its own loss (normalized by its own counts), computed here by hand.
* Offloading the training state during generation (a real round trip through host buffers,
  also on the CPU) leaves the training bit for bit what it was; on CUDA the memory drops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.backends.fsdp import full_state_dict, load_causal_lm
from hybridflow.backends.fsdp.weights import hf_name
from hybridflow.controller import Batch, WorkerContext
from hybridflow.mesh import DeviceMesh
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.mini_batches import token_budget_micro_batches, trim_padding
from hybridflow.workers.policy import ActorWorker

pytestmark = pytest.mark.unit

PROMPT, RESPONSE, ROWS = 5, 6, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("actor-update") / "qwen2", "qwen2", seed=5)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a torch.distributed process group is already initialised in the test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spec(
    model_dir: Path,
    mini_batch: int = ROWS,
    training: dict[str, Any] | None = None,
    engine: str = "torch",
    **algorithm: Any,
) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2, "entropyCoef": 0.01, **algorithm},
            "rollout": {"engine": engine},
            "training": {
                "totalSteps": 10,
                "promptsPerStep": ROWS // 2,
                "miniBatchSize": mini_batch,
                "microBatchSizePerGpu": 2,
                "learningRate": 1e-2,
                "precision": "fp32",
                **(training or {}),
            },
            "rewards": [{"function": "target_char"}],
        }
    )


def _actor(spec: RLHFJobSpec, device: str = "cpu") -> ActorWorker:
    ctx = WorkerContext(
        role="actor",
        pool="default",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_id="local",
        mesh=DeviceMesh.data_parallel(1),
        device=device,
        backend="gloo" if device == "cpu" else "nccl",
    )
    return ActorWorker(ctx, spec)


def _rollout(seed: int) -> Batch:
    """A rollout batch in the engine layout: left-padded prompts, right-padded responses of unequal length."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.full((ROWS, PROMPT + RESPONSE), PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(ROWS):
        prompt_len, response_len = 2 + row % 3, 1 + (row * 5) % RESPONSE
        start = PROMPT - prompt_len
        input_ids[row, start : PROMPT + response_len] = torch.randint(
            40, 120, (prompt_len + response_len,), generator=g
        )
        attention_mask[row, start : PROMPT + response_len] = 1
    mask = attention_mask[:, PROMPT:]
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
            "responses": input_ids[:, PROMPT:],
            "response_mask": mask,
            "advantages": torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE) * mask,
        }
    )


def _train(actor: ActorWorker, steps: int, *, two_pass: bool) -> list[dict[str, float]]:
    metrics = []
    for step in range(steps):
        batch = _rollout(step)
        if two_pass:
            batch = batch.union(actor.compute_log_probs(batch))
        metrics.append(actor.update_policy(batch))
    return metrics


@pytest.mark.usefixtures("world_of_one")
def test_on_policy_update_without_the_old_log_prob_pass_equals_the_two_pass_path(model_dir: Path) -> None:
    spec = _spec(model_dir)
    two_pass, one_pass = _actor(spec), _actor(spec)
    _train(two_pass, 2, two_pass=True)
    metrics = _train(one_pass, 2, two_pass=False)
    expected, got = full_state_dict(two_pass.model), full_state_dict(one_pass.model)
    initial = full_state_dict(_actor(spec).model)
    assert any(not torch.equal(got[name], p) for name, p in initial.items())
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert all(m["actor/approx_kl_k3"] == 0.0 and m["actor/clipfrac"] == 0.0 for m in metrics)


@pytest.mark.usefixtures("world_of_one")
def test_micro_batch_size_does_not_change_the_update(model_dir: Path) -> None:
    """Same gradient (its norm, before clipping) for 1 and 4 rows per micro-batch.

    Parameters agree to ~1e-4 only: Adam divides by sqrt(v), which turns float-summation noise
    of near-zero gradient entries into steps of up to ``lr``; the gradient norm shows the
    weighting itself is the same.
    """
    norms, params = [], []
    for micro in (1, 4):
        spec = _spec(model_dir)
        spec = spec.model_copy(
            update={"training": spec.training.model_copy(update={"micro_batch_size_per_gpu": micro})}
        )
        actor = _actor(spec)
        norms.append([m["actor/grad_norm"] for m in _train(actor, 1, two_pass=True)])
        params.append(full_state_dict(actor.model))
    for other_norms, other_params in zip(norms[1:], params[1:], strict=True):
        assert other_norms == pytest.approx(norms[0], rel=1e-5)
        for name, tensor in params[0].items():
            torch.testing.assert_close(other_params[name], tensor, rtol=0, atol=1e-3, msg=name)


@pytest.mark.usefixtures("world_of_one")
def test_without_old_log_probs_several_mini_batches_are_refused(model_dir: Path) -> None:
    actor = _actor(_spec(model_dir, mini_batch=4))
    with pytest.raises(ValueError, match="only allowed for one mini-batch and one epoch"):
        actor.update_policy(_rollout(0))


@pytest.mark.usefixtures("world_of_one")
def test_target_kl_stops_the_epochs(model_dir: Path) -> None:
    actor = _actor(_spec(model_dir, ppoEpochs=4, targetKl=1e-9))
    batch = _rollout(0)
    metrics = actor.update_policy(batch.union(actor.compute_log_probs(batch)))
    # Epoch 1 measures the rollout policy itself (KL 0) and steps; epoch 2 sees the moved policy.
    assert metrics["actor/epochs"] == 2.0
    free = _actor(_spec(model_dir, ppoEpochs=2))
    assert free.update_policy(batch.union(free.compute_log_probs(batch)))["actor/epochs"] == 2.0


def test_trimming_keeps_every_valid_token_in_the_layout() -> None:
    batch = _rollout(0)
    short = batch.rows([0, 3, 6])  # response lengths 1, 4, 1 and prompt lengths 2, 2, 2
    trimmed = trim_padding(short)
    assert trimmed.tensors["responses"].shape[1] == 4 and trimmed.tensors["input_ids"].shape[1] == 2 + 4
    for name in ("response_mask", "advantages"):
        assert torch.equal(trimmed.tensors[name], short.tensors[name][:, :4])
    assert torch.equal(trimmed.tensors["input_ids"], short.tensors["input_ids"][:, PROMPT - 2 : PROMPT + 4])
    assert int(trimmed.tensors["attention_mask"].sum()) == int(short.tensors["attention_mask"].sum())


def test_token_budget_packs_sorted_rows_and_keeps_every_row() -> None:
    batch = _rollout(0)
    micro = token_budget_micro_batches(batch, 24, dp_sum=lambda t: t, dp_size=1, dp_rank=0)
    assert sum(len(m) for m in micro) == ROWS and len(micro) > 1
    for m in micro:
        assert len(m) == 1 or len(m) * m.tensors["input_ids"].shape[1] <= 24
    assert sum(int(m.tensors["response_mask"].sum()) for m in micro) == int(
        batch.tensors["response_mask"].sum()
    )
    # another DP rank needing 5 micro-batches: this rank splits to match
    matched = token_budget_micro_batches(
        batch, 24, dp_sum=lambda t: t + torch.tensor([[0.0, 5.0], [0.0, float(ROWS)]]), dp_size=2, dp_rank=0
    )
    assert len(matched) == max(5, len(micro))


@pytest.mark.usefixtures("world_of_one")
def test_token_budget_micro_batches_give_the_same_gradient(model_dir: Path) -> None:
    norms = []
    for budget in (None, 30):
        spec = _spec(model_dir)
        spec = spec.model_copy(
            update={"training": spec.training.model_copy(update={"max_tokens_per_micro_batch": budget})}
        )
        norms.append(_train(_actor(spec), 1, two_pass=True)[0]["actor/grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


# Parameter offload needs an engine with its own weights (the spec refuses it for the torch
# engine on one GPU); the actor alone never builds one, so "vllm" only satisfies the rule.
OFFLOAD_ALL = {"offloadDuringGeneration": {"parameters": True, "optimizerState": True}}


def _state_bytes(actor: ActorWorker) -> int:
    """Bytes of the actor's parameter shards and optimizer state (every storage counted once)."""
    storages = {}
    tensors = [p.to_local() for p in actor.model.parameters()]
    tensors += [
        v.to_local() if hasattr(v, "to_local") else v
        for st in actor.backend.optimizer.state.values()
        for v in st.values()
    ]
    for tensor in tensors:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.usefixtures("world_of_one")
def test_offload_during_generation_leaves_training_bit_for_bit_the_same(model_dir: Path) -> None:
    plain, offloaded = _actor(_spec(model_dir)), _actor(_spec(model_dir, training=OFFLOAD_ALL, engine="vllm"))
    moved = []
    for step in range(2):
        held = _state_bytes(offloaded)
        stats = offloaded.offload_for_generation()  # as the rollout does before generating
        assert stats is not None and stats.bytes == held
        assert all(p.to_local().untyped_storage().nbytes() == 0 for p in offloaded.model.parameters())
        with pytest.raises(RuntimeError, match="already offloaded"):
            offloaded.offload_for_generation()
        assert offloaded.reload_after_generation() is not None
        moved.append(stats.bytes)
        batch = _rollout(step)
        assert plain.update_policy(batch) == offloaded.update_policy(batch)
    assert moved[1] > moved[0]  # the second offload carries Adam's state too
    expected, got = full_state_dict(plain.model), full_state_dict(offloaded.model)
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    assert offloaded.reload_after_generation() is None  # nothing offloaded: nothing to do


def test_offload_only_the_optimizer_state_when_asked(model_dir: Path, tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        only = {"offloadDuringGeneration": {"optimizerState": True}}
        actor = _actor(_spec(model_dir, training=only))
        assert actor.offload_for_generation() is None  # no optimizer state before the first step
        actor.update_policy(_rollout(0))
        stats = actor.offload_for_generation()
        assert stats is not None
        assert all(p.to_local().untyped_storage().nbytes() > 0 for p in actor.model.parameters())
        moments = [v for st in actor.backend.optimizer.state.values() for v in st.values() if v.dim() > 0]
        assert moments and all(v.to_local().untyped_storage().nbytes() == 0 for v in moments)
        actor.reload_after_generation()
        actor.update_policy(_rollout(1))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the offload frees device memory")
def test_offload_frees_the_device_memory_of_parameters_and_optimizer_state(
    model_dir: Path, tmp_path: Path
) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        actor = _actor(_spec(model_dir, training=OFFLOAD_ALL, engine="vllm"), device="cuda:0")
        actor.update_policy(_rollout(0))
        before_state = full_state_dict(actor.model)
        held = _state_bytes(actor)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        stats = actor.offload_for_generation()
        freed = allocated - torch.cuda.memory_allocated()
        assert stats is not None and stats.bytes == held
        assert freed >= 0.99 * held, (freed, held)
        actor.reload_after_generation()
        assert torch.cuda.memory_allocated() - allocated < 0.01 * held
        after_state = full_state_dict(actor.model)
        assert all(torch.equal(after_state[name], tensor) for name, tensor in before_state.items())
        actor.update_policy(_rollout(1))
    finally:
        dist.destroy_process_group()


def test_packed_token_budget_counts_real_tokens() -> None:
    batch = _rollout(0)
    lengths = batch.tensors["attention_mask"].sum(dim=1)
    micro = token_budget_micro_batches(batch, 16, dp_sum=lambda t: t, dp_size=1, dp_rank=0, packed=True)
    assert sum(len(m) for m in micro) == ROWS
    for m in micro:
        assert len(m) == 1 or int(m.tensors["attention_mask"].sum()) <= 16
    padded = token_budget_micro_batches(batch, 16, dp_sum=lambda t: t, dp_size=1, dp_rank=0)
    assert len(micro) < len(padded)  # the padding no longer counts against the budget
    assert int(lengths.sum()) > 16


@pytest.mark.usefixtures("world_of_one")
def test_packed_update_equals_the_padded_one(model_dir: Path) -> None:
    """Two steps (old-log-prob pass, micro-batches of 2 rows of unequal lengths): packed and padded agree.

    The same micro-batches both ways: a packed token budget groups rows differently, which
    changes the per-micro-batch metrics' mean but not the update (global loss counts).
    """
    runs = []
    for pack in (False, True):
        actor = _actor(_spec(model_dir, training={"packSequences": pack}))
        metrics = _train(actor, 2, two_pass=True)
        runs.append((metrics, full_state_dict(actor.model)))
    (padded_metrics, padded_state), (packed_metrics, packed_state) = runs
    for padded, packed in zip(padded_metrics, packed_metrics, strict=True):
        assert packed["actor/grad_norm"] == pytest.approx(padded["actor/grad_norm"], rel=1e-4)
        assert packed["actor/policy_loss"] == pytest.approx(padded["actor/policy_loss"], rel=1e-4, abs=1e-6)
    for name, tensor in padded_state.items():
        torch.testing.assert_close(packed_state[name], tensor, rtol=0, atol=1e-3, msg=name)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_weight_decay_shrinks_the_weights_by_lr_times_decay_per_step(
    model_dir: Path, weight_decay: float
) -> None:
    """With zero advantages the gradient is 0 and Adam moves nothing: only the decay acts.

    AdamW's decoupled decay is ``p <- p * (1 - lr * weightDecay)`` per optimizer step; the default
    0 leaves the weights exactly as they were (today's behaviour).
    """
    spec = _spec(model_dir, entropyCoef=0.0, training={"weightDecay": weight_decay})
    assert _spec(model_dir).training.weight_decay == 0.0
    actor = _actor(spec)
    before = full_state_dict(actor.model)
    batch = _rollout(0)
    actor.update_policy(batch.with_fields(advantages=torch.zeros_like(batch.tensors["advantages"])))
    after = full_state_dict(actor.model)
    shrink = 1.0 - spec.training.learning_rate * weight_decay
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor * shrink, rtol=1e-6, atol=1e-7, msg=name)


def _clipped_surrogate_by_hand(
    params: dict[str, torch.Tensor], model_dir: Path, rows: Batch, aggregation: str
) -> dict[str, torch.Tensor]:
    """The gradient of PPO's clipped surrogate over ``rows`` alone, on a plain (unsharded) model."""
    model = load_causal_lm(model_dir)
    model.load_state_dict(params, strict=False)
    t = rows.tensors
    logits = model(
        input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
    ).logits
    # Column PROMPT + j - 1 predicts response token j.
    log_probs = torch.log_softmax(logits[:, PROMPT - 1 : -1].float(), dim=-1)
    log_probs = log_probs.gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(log_probs - t["old_log_probs"])
    advantages, mask = t["advantages"], t["response_mask"].float()
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)) * mask
    # token-mean: over the mini-batch's own tokens; seq-mean-token-sum: over its own sequences.
    loss = per_token.sum() / (mask.sum() if aggregation == "token-mean" else len(rows))
    loss.backward()
    return {hf_name(name): p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_the_last_smaller_mini_batch_has_the_gradient_of_its_own_loss(
    model_dir: Path, aggregation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 sequences in mini-batches of 6: one of 6 rows, then one of 2 normalized by its own counts."""
    spec = _spec(model_dir, mini_batch=6, entropyCoef=0.0, lossAggregation=aggregation)
    actor = _actor(spec)
    steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    step = actor.backend.clip_and_step

    def recording_step(*, max_grad_norm: float) -> float:
        grads = {
            hf_name(name): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in actor.model.named_parameters()
            if p.grad is not None
        }
        steps.append((full_state_dict(actor.model), grads))
        return step(max_grad_norm=max_grad_norm)

    monkeypatch.setattr(actor.backend, "clip_and_step", recording_step)
    batch = _rollout(0)
    batch = batch.union(actor.compute_log_probs(batch))
    actor.update_policy(batch)
    assert len(steps) == 2
    params, grads = steps[1]  # the weights after the first update, and the last mini-batch's gradient
    expected = _clipped_surrogate_by_hand(params, model_dir, batch.rows([6, 7]), aggregation)
    assert expected.keys() == grads.keys()
    assert any(float(g.abs().max()) > 1e-4 for g in expected.values())
    for name, gradient in expected.items():
        torch.testing.assert_close(grads[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
