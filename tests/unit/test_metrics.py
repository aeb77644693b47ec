"""The metric catalogue and what comes from it: the controller's /metrics, derived figures, docs.

The scrape test starts the real HTTP server of the exporter on a free port, reads /metrics over
HTTP and parses the text with prometheus-client's own parser, as Prometheus would.
"""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridflow.incluster import TrainingMetricsExporter
from hybridflow.metrics.catalogue import (
    JOB_LABELS,
    PHASES,
    TRAINING_METRICS,
    UNCATALOGUED,
    MetricDefinition,
    find_definition,
)
from hybridflow.metrics.flops import decoder_parameter_count, peak_flops, throughput_metrics
from hybridflow.metrics.step_report import StepReport

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_LABELS = {
    "phase": "generate",
    "role": "actor",
    "source": "target_char",
    "pool": "rollout",
    "updates": "1",
    "replica": "0",
    "span": "1",
    "mode": "greedy",
    "data_source": "openai_gsm8k",
}


def every_catalogued_key() -> dict[str, float]:
    """One step-report key per catalogue entry (placeholders filled), each with a distinct value."""
    return {
        definition.key_for(**{label: SAMPLE_LABELS[label] for label in definition.labels}): float(i + 1)
        for i, definition in enumerate(TRAINING_METRICS)
        if definition.key is not None
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_names_are_unique_and_every_training_metric_has_a_key_and_the_job_labels() -> None:
    names = [d.name for d in TRAINING_METRICS]
    assert len(names) == len(set(names))
    for definition in TRAINING_METRICS:
        assert definition.key is not None, definition.name
        assert definition.all_labels[:2] == JOB_LABELS
        assert not {"step", "rank"} & set(definition.all_labels), definition.name


def test_keys_map_to_metrics_exact_keys_first() -> None:
    found = find_definition("timing/actor_update")
    assert found is not None and found[0].name == "hybridflow_phase_seconds"
    assert found[1] == {"phase": "actor_update"}
    # reward/mean is its own metric although reward/{source} would match it too.
    mean = find_definition("reward/mean")
    assert mean is not None and mean[0].name == "hybridflow_reward_mean" and mean[1] == {}
    source = find_definition("reward/target_char")
    assert source is not None and source[0].name == "hybridflow_reward_source_mean"
    memory = find_definition("memory/critic/reserved_bytes")
    assert memory is not None and memory[1] == {"role": "critic"}
    assert find_definition("nothing/like/this") is None


def test_a_key_whose_placeholders_differ_from_its_labels_is_refused() -> None:
    with pytest.raises(ValueError, match="placeholders"):
        MetricDefinition("hybridflow_x", "gauge", "s", "x", key="timing/{phase}", labels=("role",))
    with pytest.raises(ValueError, match="hybridflow_"):
        MetricDefinition("Bad-Name", "gauge", "s", "x", key="x")


def test_scraped_metrics_carry_every_catalogued_metric_with_its_labels() -> None:
    registry = CollectorRegistry()
    exporter = TrainingMetricsExporter("team-a", "grpo-qwen", registry=registry)
    keys = every_catalogued_key()
    metrics = {k: v for k, v in keys.items() if k not in {"step", "total_steps", "eta_seconds"}}
    metrics.pop("checkpoint/last_step")
    metrics["actor/some_new_figure"] = 7.5  # not catalogued: still exported, by name
    exporter(StepReport(keys["step"], int(keys["total_steps"]), metrics, keys["eta_seconds"], 4))
    port = free_port()
    exporter.serve(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()

    samples = {
        sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples
    }
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for definition in TRAINING_METRICS:
        assert definition.name in samples, f"{definition.name} missing from /metrics"
        sample = samples[definition.name]
        assert set(sample.labels) == set(definition.all_labels), definition.name
        assert sample.labels["namespace"] == "team-a" and sample.labels["rlhfjob"] == "grpo-qwen"
        expected = (
            4.0 if definition.key == "checkpoint/last_step" else keys[definition.key_for(**sample.labels)]
        )
        assert sample.value == expected, definition.name
        assert families[definition.name].type == definition.kind
        assert definition.unit in families[definition.name].documentation
    other = samples[UNCATALOGUED.name]
    assert other.labels["name"] == "actor/some_new_figure" and other.value == 7.5


def test_every_step_phase_is_scraped_as_its_own_phase_label() -> None:
    registry = CollectorRegistry()
    exporter = TrainingMetricsExporter("team-a", "ppo-qwen", registry=registry)
    timing = {f"timing/{phase.name}": 0.5 + i for i, phase in enumerate(PHASES)}
    exporter(StepReport(3, 10, {"perf/step_seconds": 99.0, **timing}, 12.0, 3))
    port = free_port()
    exporter.serve(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    scraped = {
        sample.labels["phase"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "hybridflow_phase_seconds"
    }
    assert scraped == {key.removeprefix("timing/"): value for key, value in timing.items()}
    for phase in PHASES:
        found = find_definition(f"timing/{phase.name}")
        assert found is not None and found[0].name == "hybridflow_phase_seconds", phase.name
    assert UNCATALOGUED.name not in {f.name for f in text_string_to_metric_families(text) if f.samples}


def test_per_gpu_throughput_and_mfu_from_the_step_figures() -> None:
    step = {
        "tokens/step": 40_000.0,
        "perf/step_seconds": 10.0,
        "perf/tokens_per_second": 4_000.0,
        "gpu/peak_flops": 989e12,
    }
    derived = throughput_metrics(step, gpus=8, actor_parameters=7_000_000_000)
    assert derived["perf/tokens_per_second_per_gpu"] == 500.0
    # 6 * 7e9 * 4e4 FLOPs in 10 s on 8 GPUs of 989 TFLOP/s.
    assert derived["perf/mfu"] == pytest.approx(6 * 7e9 * 4e4 / (10 * 8 * 989e12))
    # No known peak (a CPU run, an unknown GPU): no MFU rather than a made-up one.
    assert "perf/mfu" not in throughput_metrics({**step, "gpu/peak_flops": 0.0}, gpus=8, actor_parameters=7)
    assert "perf/mfu" not in throughput_metrics(
        {k: v for k, v in step.items() if k != "gpu/peak_flops"}, gpus=8, actor_parameters=7
    )


@pytest.mark.parametrize(
    ("device", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("Tesla T4", None),
        ("cpu", None),
    ],
)
def test_peak_table(device: str, flops: float | None) -> None:
    assert peak_flops(device) == flops


def test_parameter_count_from_the_config_equals_the_built_model() -> None:
    from hybridflow.models.tiny import build_tiny_model, padded_vocab_size

    model = build_tiny_model("llama", padded_vocab_size(), kv_heads=1, layers=3)
    counted = sum(p.numel() for p in model.parameters())
    assert decoder_parameter_count(model.config.to_dict()) == counted
    with pytest.raises(ValueError, match="hidden_size"):
        decoder_parameter_count({"vocab_size": 10})


def test_observability_doc_lists_every_metric_with_its_unit() -> None:
    from hybridflow_operator.metrics import OPERATOR_METRICS

    doc = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    rows = {
        match.group(1): match.group(0)
        for match in re.finditer(r"^\| `(hybridflow_[a-z0-9_]+)` \|.*$", doc, flags=re.MULTILINE)
    }
    for definition in (*TRAINING_METRICS, UNCATALOGUED, *OPERATOR_METRICS):
        assert definition.name in rows, f"docs/observability.md does not list {definition.name}"
        assert f"| {definition.unit} |" in rows[definition.name], definition.name
        if definition.key is not None:
            assert f"`{definition.key}`" in rows[definition.name], definition.name


def test_observability_doc_lists_every_step_phase() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z_]+)` \| `timing/([a-z_]+)` \| (.+) \|$", doc, flags=re.MULTILINE)
    assert [(name, key) for name, key, _ in rows] == [(phase.name, phase.name) for phase in PHASES]
    assert [meaning for _, _, meaning in rows] == [phase.help for phase in PHASES]


def test_operator_metrics_are_the_listed_ones_and_forget_deleted_jobs() -> None:
    from hybridflow_operator.metrics import OPERATOR_METRICS, OperatorMetrics

    metrics = OperatorMetrics(CollectorRegistry())
    metrics.reconciles.labels(trigger="rlhfjob").inc()
    metrics.errors.labels(error="ApiException").inc()
    metrics.latency.observe(0.02)
    metrics.writes.inc(3)
    metrics.observe_phase("team-a/grpo", "Running")
    metrics.observe_attempts("team-a/grpo", 2)
    port = free_port()
    metrics.serve(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    names = {name for name, _ in samples}
    for definition in OPERATOR_METRICS:
        assert set(definition.exposed_names) <= names, definition.name
    assert samples[("hybridflow_operator_job_attempts", (("namespace", "team-a"), ("rlhfjob", "grpo")))] == 2
    assert samples[("hybridflow_operator_jobs", (("phase", "Running"),))] == 1
    assert samples[("hybridflow_operator_reconcile_errors_total", (("error", "ApiException"),))] == 1
    metrics.observe_phase("team-a/grpo", None)  # deleted
    after = generate_latest(metrics.registry).decode()
    assert 'hybridflow_operator_job_attempts{namespace="team-a"' not in after
    assert 'hybridflow_operator_jobs{phase="Running"} 0.0' in after


def test_a_cpu_worker_reports_no_device_figures() -> None:
    """On CUDA the figures are the allocator's counters; without it nothing (no zeros that look real)."""
    import torch

    from hybridflow.metrics.device import device_metrics

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; this checks the CPU contract")
    assert device_metrics("actor") == {}


# --------------------------------------------------------------------------- sinks


def test_the_jsonl_record_is_written_at_once_and_tensorboard_gets_every_step(tmp_path: Path) -> None:
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridflow.metrics.writer import MetricsWriter

    writer = MetricsWriter(tmp_path)
    for step in range(1, 4):
        writer.write(step, {"reward/mean": step / 10, "perf/step_seconds": 0.5, "kl/actor_ref": float("nan")})
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["step"] == step  # the record is there before write returns
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert "kl/actor_ref" not in events.Tags()["scalars"]  # not finite: JSONL only


def test_a_tensorboard_failure_is_raised_not_lost(tmp_path: Path) -> None:
    from hybridflow.metrics.writer import MetricsWriter

    writer = MetricsWriter(tmp_path)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    writer._tensorboard.flush = full_disk  # type: ignore[method-assign]
    writer.write(1, {"reward/mean": 0.1})
    with pytest.raises(RuntimeError, match=r"TensorBoard events under .*tensorboard failed: .*No space left"):
        writer.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
