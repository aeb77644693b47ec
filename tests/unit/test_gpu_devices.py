"""Which GPU ``placement: auto`` and ``hybridflow plan`` plan for (``hybridflow.planner.gpus``).

The table of known GPUs and the names that find an entry; the local view of a CUDA device (a fake
``torch`` in ``sys.modules`` stands for the CUDA read, so nothing here needs a GPU or torch); the
cluster's view from ``gpuType`` and the ``nvidia.com/gpu.product`` label; and each refusal, which
must name what was seen, the field to set and its allowed values.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.cli import _resolve_auto_placement, main
from hybridflow.metrics.flops import peak_flops
from hybridflow.planner import PlannerInputError
from hybridflow.planner.gpus import (
    GPU_TYPES,
    KNOWN_GPUS,
    CudaDevice,
    cluster_device,
    cuda_device,
    declared_device,
    device_for_cuda,
    gpu_type_of,
    local_device,
)
from hybridflow.planner.hardware import A100_80GB, SIMULATED_CPU_GPU
from hybridflow.spec import IN_CLUSTER_RULES, RLHFJobSpec, SpecError, in_cluster_problems, parse_job_manifest
from hybridflow.spec.resources import GPU_PRODUCT_LABEL

pytestmark = pytest.mark.unit

ALLOWED = ", ".join(repr(gpu_type) for gpu_type in GPU_TYPES)
"""How the refusals list the ``gpuType`` values."""

H100_MEMORY = 85_520_809_984
"""What ``total_memory`` reports for an H100 80GB HBM3 (79.6 GiB), not the datasheet's 80e9."""


def manifest(pool: dict[str, Any], *, model: str = "/models/actor") -> dict[str, Any]:
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "t"},
        "spec": {
            "models": {"actor": {"path": model}},
            "data": {"trainFiles": ["/data/x.jsonl"], "maxPromptTokens": 64},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 4},
            "rollout": {"maxResponseTokens": 32},
            "training": {
                "totalSteps": 2,
                "promptsPerStep": 8,
                "miniBatchSize": 16,
                "microBatchSizePerGpu": 4,
            },
            "rewards": [{"function": "target_char"}],
            "resourcePools": [{"name": "gpus", "nodes": 1, "gpusPerNode": 4, **pool}],
            "roles": {"actor": "gpus"},
            "placement": "auto",
        },
    }


def spec_of(pool: dict[str, Any]) -> RLHFJobSpec:
    return parse_job_manifest(manifest(pool), source="test").spec


def tiny_model(tmp_path: Path) -> Path:
    """A ``config.json`` the planner reads the workload from (no weights)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    config = {
        "model_type": "qwen2",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def fake_torch(monkeypatch: pytest.MonkeyPatch, name: str | None, memory_bytes: int = 0) -> None:
    """``import torch`` gives a torch whose CUDA has one device ``name`` (None: no CUDA)."""
    properties = types.SimpleNamespace(name=name, total_memory=memory_bytes, major=9, minor=0)
    cuda = types.SimpleNamespace(
        is_available=lambda: name is not None,
        get_device_properties=lambda index: properties,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


# --------------------------------------------------------------------------- the table


def test_the_table_holds_every_gpu_type_of_the_spec_and_keeps_the_paper_testbed() -> None:
    assert tuple(KNOWN_GPUS) == GPU_TYPES
    assert all(gpu.constants.name == gpu_type for gpu_type, gpu in KNOWN_GPUS.items())
    a100 = KNOWN_GPUS["A100-80GB"].constants
    assert a100 is A100_80GB
    assert (a100.peak_flops, a100.memory_bandwidth_bytes_per_second, a100.memory_bytes) == (
        312e12,
        2.039e12,
        80e9,
    )
    assert (a100.intra_node_bytes_per_second, a100.inter_node_bytes_per_second) == (240e9, 25e9 / 8)


def test_datasheet_figures_and_links_follow_the_form_factor() -> None:
    h100, h200, pcie = (KNOWN_GPUS[t].constants for t in ("H100-80GB", "H200", "H100-PCIe"))
    assert (h100.peak_flops, h100.memory_bandwidth_bytes_per_second, h100.memory_bytes) == (
        989e12,
        3.35e12,
        80e9,
    )
    assert (h200.peak_flops, h200.memory_bandwidth_bytes_per_second, h200.memory_bytes) == (
        989e12,
        4.8e12,
        141e9,
    )
    # NVLink 4 (900 GB/s both ways) against PCIe Gen5 x16 (128 GB/s), 80% of one direction in a ring.
    assert h100.intra_node_bytes_per_second == pytest.approx(360e9)
    assert pcie.intra_node_bytes_per_second == pytest.approx(51.2e9)
    assert KNOWN_GPUS["L4"].constants.intra_node_bytes_per_second == pytest.approx(25.6e9)
    assert KNOWN_GPUS["A10G"].constants.peak_flops < KNOWN_GPUS["A10"].constants.peak_flops
    # What no datasheet says stays the testbed's assumption, for every GPU.
    assert {gpu.constants.train_efficiency for gpu in KNOWN_GPUS.values()} == {A100_80GB.train_efficiency}
    assert {gpu.constants.compute_slots for gpu in KNOWN_GPUS.values()} == {None}


def test_the_planner_and_the_mfu_metric_read_one_peak_per_name() -> None:
    for gpu in KNOWN_GPUS.values():
        for name in (*gpu.device_names, *gpu.product_labels):
            assert peak_flops(name) == gpu.constants.peak_flops, name


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("name", "gpu_type"),
    [
        # CUDA's names (torch.cuda.get_device_properties(0).name)
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("A100-SXM4-40GB", "A100-40GB"),  # drivers before R460 leave out "NVIDIA"
        ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        # GPU feature discovery's nvidia.com/gpu.product values
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
        ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA-A100-80GB-PCIe", "A100-PCIe-80GB"),
        ("NVIDIA-H200", "H200"),
        ("NVIDIA-L40S", "L40S"),
        ("NVIDIA-A10G", "A10G"),
        ("nvidia-l4", "L4"),
        # variants that look like a known GPU and are not it
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA-H100-NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None),
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", None),
        ("NVIDIA-A100-SXM4-80GB-SHARED", None),
        ("NVIDIA L40", None),
        ("Tesla T4", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_names_and_product_labels_find_their_gpu_or_nothing(name: str, gpu_type: str | None) -> None:
    assert gpu_type_of(name) == gpu_type


# --------------------------------------------------------------------------- a local run


def test_a_local_cuda_gpu_is_planned_with_the_memory_the_device_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_torch(monkeypatch, "NVIDIA H100 80GB HBM3", H100_MEMORY)
    seen = cuda_device()
    assert seen == CudaDevice("NVIDIA H100 80GB HBM3", H100_MEMORY)

    device = local_device(spec_of({}), seen, cores=16)

    h100 = KNOWN_GPUS["H100-80GB"].constants
    assert device.memory_bytes == H100_MEMORY
    assert (device.peak_flops, device.intra_node_bytes_per_second) == (
        h100.peak_flops,
        h100.intra_node_bytes_per_second,
    )
    assert device.compute_slots is None and device.host_cores is None
    assert device.name == "H100-80GB (CUDA device 'NVIDIA H100 80GB HBM3', 85.5 GB)"


def test_a_machine_without_cuda_keeps_the_simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, None)
    assert cuda_device() is None
    # Even a pool that names a GPU: the workers are CPU processes here.
    device = local_device(spec_of({"gpuType": "H200"}), None, cores=3)
    assert device.name == SIMULATED_CPU_GPU.name
    assert (device.compute_slots, device.host_cores, device.peak_flops) == (
        3,
        3,
        SIMULATED_CPU_GPU.peak_flops,
    )


def test_an_unknown_cuda_gpu_is_refused_naming_it_the_known_names_and_the_field() -> None:
    with pytest.raises(PlannerInputError) as refused:
        device_for_cuda("NVIDIA GeForce RTX 4090", 25_757_220_864)
    message = str(refused.value)
    assert message.startswith(
        "CUDA device 'NVIDIA GeForce RTX 4090', 25.8 GB is none of the GPUs the planner knows"
    )
    assert "'NVIDIA H100 80GB HBM3'" in message and "'NVIDIA A10G'" in message  # the known names
    assert f"set spec.resourcePools[0].gpuType to the closest of {ALLOWED}" in message
    with pytest.raises(PlannerInputError, match="a MIG slice: the planner plans whole GPUs"):
        device_for_cuda("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20e9)


def test_gpu_type_stands_in_for_a_name_the_table_does_not_know() -> None:
    device = local_device(
        spec_of({"gpuType": "L40S"}), CudaDevice("NVIDIA RTX 6000 Ada Generation", 51_000_000_000), cores=8
    )
    l40s = KNOWN_GPUS["L40S"].constants
    assert (device.peak_flops, device.memory_bandwidth_bytes_per_second) == (
        l40s.peak_flops,
        l40s.memory_bandwidth_bytes_per_second,
    )
    assert device.memory_bytes == 51e9  # the device's, not the L40S's 48 GB
    assert (
        device.name
        == "L40S (spec.resourcePools[0].gpuType, on CUDA device 'NVIDIA RTX 6000 Ada Generation', 51.0 GB)"
    )


# --------------------------------------------------------------------------- a cluster


def test_the_cluster_plans_for_the_pools_gpu_type() -> None:
    device = cluster_device(spec_of({"gpuType": "H200"}))
    assert device.name == "H200 (spec.resourcePools[0].gpuType)"
    assert (device.peak_flops, device.memory_bytes) == (989e12, 141e9)


def test_the_cluster_reads_the_gpu_from_the_product_label() -> None:
    device = cluster_device(
        spec_of({"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-A100-SXM4-40GB", "pool": "a"}})
    )
    assert device.name == "A100-40GB (nvidia.com/gpu.product NVIDIA-A100-SXM4-40GB)"
    assert (device.memory_bytes, device.memory_bandwidth_bytes_per_second) == (40e9, 1.555e12)
    # gpuType replaces a label the table does not know, and agrees with one it knows.
    unknown = {GPU_PRODUCT_LABEL: "NVIDIA-H100-NVL"}
    assert cluster_device(spec_of({"gpuType": "H100-PCIe", "nodeSelector": unknown})).name.startswith(
        "H100-PCIe"
    )
    known = {GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}
    assert cluster_device(spec_of({"gpuType": "H100-80GB", "nodeSelector": known})).name.startswith(
        "H100-80GB"
    )


def test_the_cluster_refuses_a_pool_that_does_not_say_naming_the_field_and_its_values() -> None:
    with pytest.raises(PlannerInputError) as refused:
        cluster_device(spec_of({"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}))
    message = str(refused.value)
    assert message.startswith("spec.resourcePools[0].gpuType: required in a cluster")
    assert "the Ray head pod, which has no GPU to look at" in message
    assert message.endswith(f"set it to one of {ALLOWED}")


def test_the_cluster_refuses_an_unknown_or_contradicted_product_label() -> None:
    with pytest.raises(PlannerInputError) as refused:
        cluster_device(spec_of({"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB-SHARED"}}))
    message = str(refused.value)
    assert message.startswith(
        "spec.resourcePools[0].nodeSelector['nvidia.com/gpu.product']: 'NVIDIA-A100-SXM4-80GB-SHARED' is none of "
        "the GPUs the planner knows (a time-shared GPU"
    )
    assert "'NVIDIA-H100-80GB-HBM3'" in message  # the known labels
    assert f"set spec.resourcePools[0].gpuType to the closest of {ALLOWED}" in message
    with pytest.raises(PlannerInputError, match=r"gpuType: 'H200' contradicts .* 'NVIDIA-L4', which is 'L4'"):
        cluster_device(spec_of({"gpuType": "H200", "nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-L4"}}))


def test_pools_that_declare_different_gpus_are_refused() -> None:
    document = manifest({"gpuType": "H200"})
    document["spec"]["placement"] = "manual"
    document["spec"]["resourcePools"].append({"name": "more", "gpuType": "L4"})
    document["spec"]["roles"]["reference"] = "more"
    with pytest.raises(PlannerInputError, match=r"one GPU type, and the pools declare H200 .*, L4"):
        declared_device(parse_job_manifest(document, source="test").spec)
    assert declared_device(spec_of({})) is None


def test_the_controller_exits_2_at_its_start_when_the_pool_does_not_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest({})))
    assert main(["run", "--in-cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: spec.placement auto: spec.resourcePools[0].gpuType: required in a cluster" in err


def test_the_controller_plans_the_declared_gpu_and_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = manifest(
        {"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}, model=str(tiny_model(tmp_path))
    )
    spec = parse_job_manifest(document, source="test").spec
    resolved = _resolve_auto_placement("job.yaml", spec, in_cluster=True)
    assert resolved is not None
    runnable, status = resolved
    assert runnable.placement == "manual"
    assert status["device"] == "H100-80GB (nvidia.com/gpu.product NVIDIA-H100-80GB-HBM3)"
    assert "; device H100-80GB (nvidia.com/gpu.product NVIDIA-H100-80GB-HBM3)" in capsys.readouterr().out


# --------------------------------------------------------------------------- the spec and admission


def test_the_spec_refuses_an_unknown_gpu_type_naming_the_field_and_the_values() -> None:
    with pytest.raises(SpecError) as refused:
        spec_of({"gpuType": "B300"})
    assert refused.value.problems == (f"spec.resourcePools[0].gpuType: 'B300' is not one of {ALLOWED}",)


def _admits(document: dict[str, Any]) -> tuple[bool, bool]:
    """The rule ``auto-placement-knows-the-gpu`` on ``document``: (CEL as the API server runs it, Python)."""
    celpy = pytest.importorskip("celpy", reason="install cel-python to evaluate the CRD's CEL rules")
    rule = next(r for r in IN_CLUSTER_RULES if r.name == "auto-placement-knows-the-gpu")
    spec = parse_job_manifest(document, source="test").spec
    # The API server evaluates the defaulted object: the spec's own defaults, as the CRD carries them.
    defaulted = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    environment = celpy.Environment()
    verdict = environment.program(environment.compile(rule.cel)).evaluate(
        {"self": celpy.json_to_cel(defaulted)}
    )
    return bool(verdict), rule.holds(spec)


@pytest.mark.parametrize(
    ("pool", "placement", "admitted"),
    [
        ({}, "auto", False),
        ({"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}, "auto", False),
        ({"gpuType": "H100-80GB"}, "auto", True),
        ({"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}, "auto", True),
        ({}, "manual", True),
    ],
)
def test_admission_refuses_an_auto_placed_pool_of_unknown_gpu(
    pool: dict[str, Any], placement: str, admitted: bool
) -> None:
    document = manifest(pool)
    document["spec"]["placement"] = placement
    assert _admits(document) == (admitted, admitted)


def test_validate_in_cluster_prints_the_admission_message_and_the_planned_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest({})))
    assert main(["validate", "--in-cluster", str(path)]) == 2
    [problem] = [line for line in in_cluster_problems(spec_of({})) if line.startswith("spec.resourcePools:")]
    assert problem.startswith("spec.resourcePools: must say which GPU the planner plans for")
    assert f"spec.resourcePools[0].gpuType (one of {ALLOWED})" in problem
    assert f"error: in a cluster: {problem}" in capsys.readouterr().err

    path.write_text(yaml.safe_dump(manifest({"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H100-NVL"}})))
    assert main(["validate", "--in-cluster", str(path)]) == 2
    assert (
        "error: in a cluster: spec.resourcePools[0].nodeSelector['nvidia.com/gpu.product']: 'NVIDIA-H100-NVL'"
        in (capsys.readouterr().err)
    )
    fine = manifest({"gpuType": "A10G"})
    fine["spec"]["maxRestarts"] = 0  # else the checkpoint-volume and absolute-path rules speak too
    path.write_text(yaml.safe_dump(fine))
    assert main(["validate", "--in-cluster", str(path)]) == 0
    assert "in a cluster it plans for A10G (spec.resourcePools[0].gpuType)" in capsys.readouterr().out


# --------------------------------------------------------------------------- hybridflow plan


@pytest.mark.parametrize(
    ("pool", "cuda", "args", "device"),
    [
        ({"gpuType": "H200"}, None, (), "H200 (spec.resourcePools[0].gpuType)"),
        (
            {"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-L40S"}},
            None,
            (),
            "L40S (nvidia.com/gpu.product NVIDIA-L40S)",
        ),
        ({"gpuType": "H200"}, None, ("--gpu-type", "A10G"), "A10G (--gpu-type)"),
        ({}, ("NVIDIA L4", 23_580_639_232), (), "L4 (CUDA device 'NVIDIA L4', 23.6 GB)"),
        ({}, None, (), SIMULATED_CPU_GPU.name),
    ],
)
def test_plan_plans_for_the_declared_gpu_else_this_machines(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    pool: dict[str, Any],
    cuda: tuple[str, int] | None,
    args: tuple[str, ...],
    device: str,
) -> None:
    fake_torch(monkeypatch, *(cuda or (None,)))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(pool, model=str(tiny_model(tmp_path)))))
    code = main(["plan", str(path), *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"budget: 4 GPU(s), 4 per node; device: {device}\n" in out


def test_plan_refuses_an_unknown_local_gpu_and_an_unknown_gpu_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_torch(monkeypatch, "NVIDIA B300", 288_000_000_000)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest({}, model=str(tiny_model(tmp_path)))))
    assert main(["plan", str(path)]) == 2
    assert (
        "CUDA device 'NVIDIA B300', 288.0 GB is none of the GPUs the planner knows" in capsys.readouterr().err
    )
    assert main(["plan", str(path), "--gpu-type", "H100"]) == 2
    assert "error: --gpu-type: 'H100' is not one of A100-40GB, A100-80GB" in capsys.readouterr().err
