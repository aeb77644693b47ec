"""LoRA adapters: the module, and the FSDP backend training an adapter (one process, gloo world of one).

Rules (``hybridflow.models.lora``, ``backends/fsdp/training.py``):
* an adapted linear keeps its base parameters and HF name, and computes ``W x + b + s B A x``;
* a fresh adapter is the base model exactly (``B = 0``); switched off, any adapter is the base;
* a target that matches no linear fails naming the model's linears;
* ``A``'s draw depends on the seed and the module's path only (every rank draws the same);
* the FSDP backend trains the adapters alone: only they require grad and carry optimizer state,
  the base stays bit for bit, and the weight sync streams the adapters' tensors alone;
* the spec refuses LoRA with megatron, with another reference model, and with a tensor-parallel rollout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from pydantic import ValidationError

from hybridflow.backends.fsdp.training import FSDPTrainingBackend
from hybridflow.models import PAD_TOKEN_ID, build_tiny_model, write_tiny_model
from hybridflow.models.lora import (
    LoRAConfig,
    LoRALinear,
    adapters_disabled,
    apply_lora,
    initialize_adapters,
    is_adapter_name,
)
from hybridflow.spec import RLHFJobSpec

pytestmark = pytest.mark.unit

CONFIG = LoRAConfig(rank=4, alpha=8.0)


def _ids() -> torch.Tensor:
    return torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))


def test_an_adapted_linear_keeps_its_base_and_adds_the_scaled_low_rank_update() -> None:
    model = build_tiny_model("qwen2", 384, seed=1)
    base_q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    adapted = apply_lora(model, CONFIG)
    assert len(adapted) == 7 * model.config.num_hidden_layers and "lm_head" not in adapted
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, LoRALinear) and q.weight is base_q  # the same parameter: no copy
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in trainable
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()  # the HF name is kept
    x = torch.randn(3, q.in_features)
    initialize_adapters(model, seed=0)
    assert torch.equal(q(x), torch.nn.functional.linear(x, q.weight, q.bias))  # B = 0: the base
    with torch.no_grad():
        q.lora_B.weight.normal_()
    expected = (
        torch.nn.functional.linear(x, q.weight, q.bias) + 2.0 * x @ q.lora_A.weight.T @ q.lora_B.weight.T
    )
    torch.testing.assert_close(q(x), expected)
    with adapters_disabled(model):
        assert torch.equal(q(x), torch.nn.functional.linear(x, q.weight, q.bias))
    assert q.enabled  # restored


def test_a_fresh_adapter_is_the_base_model_and_a_trained_one_switched_off_too() -> None:
    base = build_tiny_model("llama", 384, seed=2).eval()
    model = build_tiny_model("llama", 384, seed=2).eval()
    apply_lora(model, CONFIG)
    initialize_adapters(model, seed=0)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B.weight"):
                parameter.normal_(std=0.1)
        assert not torch.allclose(model(ids).logits, base(ids).logits)
        with adapters_disabled(model):
            assert torch.equal(model(ids).logits, base(ids).logits)


def test_the_draw_depends_on_the_seed_and_path_only_and_a_typo_names_the_linears() -> None:
    first, second = build_tiny_model("qwen2", 384, seed=1), build_tiny_model("qwen2", 384, seed=5)
    for model in (first, second):
        apply_lora(model, CONFIG)
        initialize_adapters(model, seed=7)
    a = "model.layers.1.mlp.up_proj.lora_A.weight"
    assert torch.equal(first.get_parameter(a), second.get_parameter(a))
    assert not torch.equal(first.get_parameter(a), first.get_parameter(a.replace("layers.1", "layers.0")))
    adapter_elements = sum(p.numel() for name, p in first.named_parameters() if is_adapter_name(name))
    assert adapter_elements == sum(
        4 * (m.in_features + m.out_features) for m in first.modules() if isinstance(m, LoRALinear)
    )
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear module.*'down_proj'"):
        apply_lora(
            build_tiny_model("qwen2", 384, seed=1),
            LoRAConfig(rank=2, alpha=2, target_modules=("q_proj", "qkv")),
        )


def _spec(model_dir: Path, **lora: object) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": {
                "totalSteps": 2,
                "promptsPerStep": 2,
                "miniBatchSize": 4,
                "microBatchSizePerGpu": 2,
                "precision": "fp32",
                "lora": {"rank": 4, "alpha": 8, **lora},
            },
            "rewards": [{"function": "target_char"}],
        }
    )


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_the_fsdp_backend_trains_the_adapter_alone_and_syncs_it_alone(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "model", "qwen2", seed=3)
    backend = FSDPTrainingBackend(_spec(model_dir), torch.device("cpu"))
    backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-2)
    trainable = {name for name, p in backend.model.named_parameters() if p.requires_grad}
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in backend.model.parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    before = {name: tensor.clone() for name, tensor in backend.full_state_dict().items()}

    rows, prompt, response = 4, 4, 3
    input_ids = torch.randint(3, 200, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    input_ids[0, :2] = PAD_TOKEN_ID
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": input_ids[:, prompt:],
        "response_mask": torch.ones(rows, response, dtype=torch.long),
    }
    reference, _ = backend.log_probs(batch, temperature=1.0, with_entropy=False)
    for _ in range(2):  # the first step moves B off zero, the second moves the output

        def loss_fn(log_probs, entropy, micro):  # type: ignore[no-untyped-def]
            return -(log_probs * micro["response_mask"]).sum(), {}

        list(
            backend.forward_backward(
                [batch], loss_fn, fields=["response_mask"], temperature=1.0, entropy_grad=False
            )
        )
        backend.clip_and_step(max_grad_norm=0.0)
    state = {name: len(s) for name, s in backend.optimizer.state.items() if s}
    assert len(state) == len(trainable)  # Adam's moments for the adapters only
    after = backend.full_state_dict()
    for name, tensor in after.items():
        if is_adapter_name(name) and name.endswith("lora_B.weight"):
            assert not torch.equal(tensor, before[name]), name
        elif not is_adapter_name(name):
            assert torch.equal(tensor, before[name]), f"the base weight {name} changed"
    trained, _ = backend.log_probs(batch, temperature=1.0, with_entropy=False)
    assert not torch.allclose(trained, reference)
    with adapters_disabled(backend.model):
        base, _ = backend.log_probs(batch, temperature=1.0, with_entropy=False)
    torch.testing.assert_close(base, reference, rtol=0, atol=1e-6)
    synced = [
        name for bucket in backend.weight_buckets(1 << 20, dtype=None, meter=None) for name, _ in bucket
    ]
    assert synced and sorted(synced) == sorted(name for name in after if is_adapter_name(name))


def test_the_spec_refuses_lora_where_it_cannot_run(tmp_path: Path) -> None:
    spec = _spec(tmp_path).model_dump(by_alias=True, exclude_none=True)
    assert spec["training"]["lora"]["targetModules"][0] == "q_proj"
    megatron = {**spec, "training": {**spec["training"], "backend": "megatron"}}
    with pytest.raises(ValidationError, match=r"spec.training.lora: is supported with backend 'fsdp' only"):
        RLHFJobSpec.model_validate(megatron)
    other_reference = {**spec, "models": {**spec["models"], "reference": {"path": "/models/other"}}}
    with pytest.raises(ValidationError, match=r"spec.models.reference: must be unset with training.lora"):
        RLHFJobSpec.model_validate(other_reference)


@pytest.mark.usefixtures("world_of_one")
def test_a_lora_critic_trains_its_adapters_and_its_value_head_and_the_default_critic_everything(
    tmp_path: Path,
) -> None:
    model_dir = write_tiny_model(tmp_path / "model", "qwen2", seed=3)
    for critic, expect_lora in ((True, True), (False, False)):
        backend = FSDPTrainingBackend(_spec(model_dir, critic=critic), torch.device("cpu"))
        backend.load(str(model_dir), kind="value", learning_rate=1e-3)
        trainable = {name for name, p in backend.model.named_parameters() if p.requires_grad}
        if expect_lora:
            assert backend.lora is not None
            assert {name for name in trainable if not is_adapter_name(name)} == {
                "value_head.weight",
                "value_head.bias",
            }
        else:
            assert backend.lora is None and not any(is_adapter_name(name) for name in trainable)
            assert len(trainable) == len(list(backend.model.parameters()))
