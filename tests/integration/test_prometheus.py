"""The chart's dashboards and alert rules on a real Prometheus (Debian's ``prometheus`` package).

A Prometheus server scrapes the controller's exporter (``TrainingMetricsExporter``) and the
operator's (``OperatorMetrics``) with the labels the chart's PodMonitor and ServiceMonitor make
the prometheus-operator attach (``honorLabels: true``: the exporters' own ``namespace`` and
``rlhfjob`` win). Then every query of every dashboard panel is run on it: each must evaluate, and
each returns a series with the job's labels (the exporter was given every catalogued metric).
The alert rules pass ``promtool check rules`` and each fires on the server for the state it is
about (a NaN reward, replicas replaced, a stalled step: with its windows shortened).
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.incluster import TrainingMetricsExporter
from hybridflow.metrics.catalogue import PHASES, TRAINING_METRICS
from hybridflow.metrics.step_report import StepReport
from hybridflow_operator.metrics import OperatorMetrics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm" / "hybridflow" / "rules" / "hybridflow.rules.yaml"
DASHBOARDS = sorted((ROOT / "helm" / "hybridflow" / "dashboards").glob("*.json"))
JOB_NAMESPACE, JOB = "research", "grpo-tiny"
OPERATOR_NAMESPACE, OPERATOR_SERVICE = "hybridflow-system", "hybridflow"
LABEL_VALUES = {
    "phase": [phase.name for phase in PHASES],
    "staleness": ["0", "1"],
    "span": ["0", "1"],
    "mode": ["greedy", "sampled"],
}


def binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        pytest.fail(f"no {name}: `make setup` installs Debian's prometheus package")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def every_catalogued_key(value: float) -> dict[str, float]:
    """One step report value for every training metric of the catalogue (each label value used)."""
    metrics: dict[str, float] = {}
    for definition in TRAINING_METRICS:
        if definition.key is None or definition.key in {"step", "total_steps", "eta_seconds"}:
            continue
        if not definition.labels:
            metrics[definition.key] = value
            continue
        choices = [LABEL_VALUES.get(label, ["a"]) for label in definition.labels]
        for values in itertools.product(*choices):
            metrics[definition.key_for(**dict(zip(definition.labels, values, strict=True)))] = value
    return metrics


@dataclass
class Server:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant query's result; fails the test on an evaluation error (the server's message)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as err:
            pytest.fail(f"Prometheus refused {expr}: {err.read().decode()[:500]}")
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_ready(self, process: subprocess.Popen[bytes], timeout_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"Prometheus did not become ready (exit code {process.poll()}); see its log")

    def alerts(self) -> list[dict[str, Any]]:
        body = json.loads(urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10).read())
        return list(body["data"]["alerts"])


def scrape_config(controller_port: int, operator_port: int) -> dict[str, Any]:
    """What the chart's monitors make the prometheus-operator generate, as static targets: the
    PodMonitor's job is ``<namespace>/<name>``, the ServiceMonitor's the Service's name."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": f"{OPERATOR_NAMESPACE}/{OPERATOR_SERVICE}-jobs",
                "honor_labels": True,
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{controller_port}"],
                        "labels": {
                            "namespace": JOB_NAMESPACE,
                            "pod": f"{JOB}-head",
                            "endpoint": "hf-metrics",
                        },
                    }
                ],
            },
            {
                "job_name": OPERATOR_SERVICE,
                "honor_labels": True,
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{operator_port}"],
                        "labels": {
                            "namespace": OPERATOR_NAMESPACE,
                            "service": OPERATOR_SERVICE,
                            "endpoint": "metrics",
                        },
                    }
                ],
            },
        ],
    }


def shortened_rules() -> str:
    """The chart's rules with their windows cut to seconds, so that each can fire in a test."""
    text = RULES.read_text()
    for long, short in (("[30m]", "[6s]"), ("offset 30m", "offset 6s"), ("[1h]", "[20s]"), ("[10m]", "[5s]")):
        text = text.replace(long, short)
    return re.sub(r"for: \d+m", "for: 0s", text)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, TrainingMetricsExporter, OperatorMetrics]]:
    """A Prometheus scraping a controller's exporter and the operator's metrics."""
    scratch = tmp_path_factory.mktemp("prometheus")
    exporter = TrainingMetricsExporter(JOB_NAMESPACE, JOB)
    controller_port, operator_port, web_port = free_port(), free_port(), free_port()
    exporter.serve(controller_port)
    operator = OperatorMetrics()
    operator.serve(operator_port)
    operator.reconciles.labels(trigger="rlhfjob").inc()
    operator.errors.labels(error="Forbidden").inc()
    operator.latency.observe(0.05)
    operator.writes.inc()
    operator.observe_phase(f"{JOB_NAMESPACE}/{JOB}", "Running")
    operator.observe_attempts(f"{JOB_NAMESPACE}/{JOB}", 2)
    (scratch / "rules.yaml").write_text(shortened_rules())
    (scratch / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(controller_port, operator_port)))
    log = open(scratch / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            binary("prometheus"), f"--config.file={scratch / 'prometheus.yml'}",
            f"--storage.tsdb.path={scratch / 'data'}", f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = Server(f"http://127.0.0.1:{web_port}")
    try:
        server.wait_ready(process)
        yield server, exporter, operator
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def wait_for(server: Server, expr: str, *, timeout_seconds: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            found = server.query(expr)
        except OSError:
            found = []
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"no series for {expr} within {timeout_seconds} s")


def panel_queries() -> list[tuple[str, str]]:
    """(where, expr) of every panel target of every dashboard."""
    found = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                found.append((f"{path.stem}: {panel.get('title')}", target["expr"]))
    return found


def grafana_to_promql(expr: str, dashboard: str) -> str:
    """The query Grafana sends for the test's job: the variables substituted as Grafana does."""
    namespace, job = (
        (OPERATOR_NAMESPACE, OPERATOR_SERVICE) if dashboard == "operator" else (JOB_NAMESPACE, JOB)
    )
    expr = re.sub(r"\$__(rate_interval|interval|range)", "15s", expr)
    return expr.replace("$namespace", namespace).replace("$job", job)


def test_the_rules_pass_promtool() -> None:
    result = subprocess.run(
        [binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_evaluates_and_returns_the_jobs_series(
    stack: tuple[Server, TrainingMetricsExporter, OperatorMetrics],
) -> None:
    server, exporter, _ = stack
    for step in (1, 2, 3):
        exporter(
            StepReport(
                step, 10, every_catalogued_key(0.5 + step), eta_seconds=60.0, last_checkpoint_step=step
            )
        )
        time.sleep(1.5)
    wait_for(server, f'hybridflow_step{{rlhfjob="{JOB}"}} == 3')
    wait_for(server, "rate(hybridflow_operator_reconciles_total[15s]) >= 0")
    empty = []
    for where, expr in panel_queries():
        dashboard = where.split(":")[0]
        result = server.query(grafana_to_promql(expr, dashboard))
        if not result:
            empty.append((where, expr))
            continue
        labels = result[0]["metric"]
        if dashboard != "operator":
            assert labels.get("namespace") == JOB_NAMESPACE and labels.get("rlhfjob") == JOB, (where, labels)
    assert empty == [], f"{len(empty)} panels have no data: {empty[:5]}"


def firing(server: Server, name: str, timeout_seconds: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        for alert in server.alerts():
            if alert["labels"]["alertname"] == name and alert["state"] == "firing":
                return alert
        time.sleep(0.5)
    pytest.fail(f"{name} did not fire within {timeout_seconds} s; alerts: {server.alerts()}")


def test_the_alerts_fire_on_what_they_are_about(
    stack: tuple[Server, TrainingMetricsExporter, OperatorMetrics],
) -> None:
    server, exporter, operator = stack
    metrics = every_catalogued_key(1.0)
    exporter(
        StepReport(
            4,
            10,
            {**metrics, "reward/mean": float("nan"), "rollout/replicas_replaced": 10.0},
            eta_seconds=1.0,
            last_checkpoint_step=4,
        )
    )
    nan = firing(server, "HybridFlowNonFiniteTraining")
    assert (
        nan["labels"]["rlhfjob"] == JOB
        and nan["labels"].get("__name__", "hybridflow_reward_mean") == "hybridflow_reward_mean"
    )
    replaced = firing(server, "HybridFlowRolloutReplicasReplacedRepeatedly")
    assert replaced["labels"]["namespace"] == JOB_NAMESPACE
    stalled = firing(server, "HybridFlowJobStalled")  # the step stays at 4 of 10 past the window
    assert stalled["labels"]["rlhfjob"] == JOB and float(stalled["value"]) == 4
    assert firing(server, "HybridFlowJobRetried")["labels"]["rlhfjob"] == JOB
    operator.errors.labels(error="Forbidden").inc(3)  # a rate above 0 over the (shortened) window
    assert firing(server, "HybridFlowOperatorReconcileErrors")["labels"]["error"] == "Forbidden"
    assert firing(server, "HybridFlowWeightSyncUnverified")["labels"]["rlhfjob"] == JOB
