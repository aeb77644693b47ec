"""The chart's Grafana dashboards against the metrics the code exports.

Every panel's PromQL (and every template variable's query) is parsed with promql-parser; each
metric it names must be one the metric catalogues define (training: hybridflow.metrics.catalogue,
operator: hybridflow_operator.metrics), each label it matches or groups by must be one the metric
carries, or one Prometheus attaches to every scraped target. Every metric is on some dashboard,
and every dashboard has the namespace and job variables.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from hybridflow.metrics.catalogue import (
    CHECKPOINT_PHASE,
    OTHER_PHASE,
    STEP_PHASES,
    TRAINING_METRICS,
    UNCATALOGUED,
)
from hybridflow_operator.metrics import OPERATOR_METRICS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "helm" / "hybridflow" / "dashboards").glob("*.json"))
# Labels Prometheus (and the prometheus-operator's monitors) attach to every scraped series.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}
EXPOSED: dict[str, set[str]] = {}
for _definition in (*TRAINING_METRICS, UNCATALOGUED, *OPERATOR_METRICS):
    for _name in _definition.exposed_names:
        EXPOSED[_name] = set(_definition.all_labels) | ({"le"} if _name.endswith("_bucket") else set())


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def grafana_to_promql(expr: str) -> str:
    """Grafana's range variables become a plain duration; label-value variables sit inside quotes."""
    return re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)


def selectors_and_groupings(node: Any) -> tuple[list[Any], set[str]]:
    """Every vector selector in the expression, and every label it groups or matches on."""
    selectors: list[Any] = []
    grouping: set[str] = set()

    def visit(item: Any) -> None:
        if isinstance(item, promql_parser.VectorSelector):
            selectors.append(item)
        elif isinstance(item, promql_parser.MatrixSelector):
            visit(item.vector_selector)
        elif isinstance(item, promql_parser.AggregateExpr):
            if item.modifier is not None:
                grouping.update(item.modifier.labels)
            visit(item.expr)
            if item.param is not None:
                visit(item.param)
        elif isinstance(item, promql_parser.BinaryExpr):
            modifier = item.modifier
            if modifier is not None:
                if modifier.matching is not None:
                    grouping.update(modifier.matching.labels)
                grouping.update(modifier.group_labels or [])
            visit(item.lhs)
            visit(item.rhs)
        elif isinstance(item, promql_parser.Call):
            for arg in item.args:
                visit(arg)
        elif isinstance(item, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr):
            visit(item.expr)

    visit(node)
    return selectors, grouping


def check_query(expr: str, where: str) -> set[str]:
    """Fail unless every metric and label of ``expr`` exists; returns the metric names."""
    try:
        tree = promql_parser.parse(grafana_to_promql(expr))
    except Exception as err:
        pytest.fail(f"{where}: not PromQL ({err}): {expr}")
    selectors, grouping = selectors_and_groupings(tree)
    assert selectors, f"{where}: no metric in {expr}"
    names: set[str] = set()
    for selector in selectors:
        assert selector.name in EXPOSED, f"{where}: {selector.name} is not a metric the code exports"
        allowed = EXPOSED[selector.name] | TARGET_LABELS
        for matcher in selector.matchers.matchers:
            assert matcher.name in allowed, f"{where}: {selector.name} has no label {matcher.name!r}"
        names.add(selector.name)
    allowed = set().union(*(EXPOSED[name] for name in names)) | TARGET_LABELS
    assert grouping <= allowed, f"{where}: groups by labels the metrics lack: {grouping - allowed}"
    return names


def test_there_are_the_five_dashboards_and_they_are_current() -> None:
    assert [p.stem for p in DASHBOARDS] == ["gpu", "learning", "operator", "resharding", "throughput"]
    spec = importlib.util.spec_from_file_location("render_dashboards", ROOT / "helm" / "render_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    for name, text in module.rendered_files().items():
        assert (ROOT / "helm" / "hybridflow" / "dashboards" / name).read_text() == text, (
            f"{name} is stale: run `python helm/render_dashboards.py`"
        )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_queries_real_metrics_and_labels(path: Path) -> None:
    dashboard = load(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= set(variables), f"{path.name}: template variables"
    for name in ("namespace", "job"):
        query = variables[name]["query"]["query"]
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert found, f"{path.name}: variable {name}: {query}"
        (metric,) = check_query(found.group(1), f"{path.name} variable {name}")
        assert found.group(2) in EXPOSED[metric] | TARGET_LABELS
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = target["expr"]
            check_query(expr, f"{path.name} panel {panel['title']!r}")
            # Every query is scoped to the selected job(s): $job, and $namespace except where the
            # series carries the job's namespace rather than the scrape target's.
            assert '"$job"' in expr, f"{path.name} panel {panel['title']!r}: not filtered by $job"


def test_every_metric_is_on_a_dashboard() -> None:
    shown: set[str] = set()
    for path in DASHBOARDS:
        for panel in load(path)["panels"]:
            for target in panel["targets"]:
                shown |= check_query(target["expr"], path.name)
    for definition in (*TRAINING_METRICS, *OPERATOR_METRICS):
        assert set(definition.exposed_names) & shown, f"{definition.name} is on no dashboard"


def test_the_step_breakdown_shows_every_phase_of_the_catalogue_in_step_order() -> None:
    panels = {
        panel["title"]: panel for panel in load(ROOT / "helm/hybridflow/dashboards/throughput.json")["panels"]
    }

    def phases(title: str) -> list[str]:
        found = []
        for target in panels[title]["targets"]:
            (phase,) = re.findall(r'hybridflow_phase_seconds\{[^}]*phase="([a-z_]+)"', target["expr"])
            assert target["legendFormat"] == f"{{{{rlhfjob}}}} {phase}", title
            found.append(phase)
        return found

    in_step = [phase.name for phase in (*STEP_PHASES, OTHER_PHASE)]
    assert phases("Step time by phase") == in_step
    assert phases("Phase share of the step") == in_step
    assert panels["Step time by phase"]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    (checkpoint,) = panels["Checkpoint seconds"]["targets"]
    assert f'phase="{CHECKPOINT_PHASE.name}"' in checkpoint["expr"]


def test_a_wrong_metric_or_label_is_caught() -> None:
    with pytest.raises(AssertionError, match="not a metric the code exports"):
        check_query('hybridflow_reward{rlhfjob=~"$job"}', "probe")
    with pytest.raises(AssertionError, match="has no label 'phase'"):
        check_query('hybridflow_reward_mean{phase="generate"}', "probe")
    with pytest.raises(AssertionError, match="groups by labels"):
        check_query("sum by (role) (hybridflow_reward_mean)", "probe")


def test_observability_doc_lists_each_dashboards_panels() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    for path in DASHBOARDS:
        dashboard = load(path)
        heading = f"### {dashboard['title']} (`{path.name}`)"
        assert heading in doc, f"docs/observability.md lacks {heading}"
        section = doc.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        for panel in dashboard["panels"]:
            assert f"**{panel['title']}**" in section, (
                f"{path.name}: panel {panel['title']!r} not in the docs"
            )
