"""The Event reasons are a typed catalogue, and docs/operator.md lists exactly that catalogue."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hybridflow_operator.events import EVENT_REASONS, Event, api_failure_reason
from hybridflow_operator.status import PHASES

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- event reasons -->\n(?P<body>.*?)<!-- /event reasons -->", re.S)


def test_docs_list_every_reason_with_its_type() -> None:
    match = TABLE.search((ROOT / "docs" / "operator.md").read_text())
    assert match is not None, "docs/operator.md lost its event reasons table"
    rows = re.findall(r"^\| `(\w+)` \| (Normal|Warning) \|", match["body"], re.M)
    assert dict(rows) == {reason: kind for reason, (kind, _) in EVENT_REASONS.items()}


def test_a_reason_outside_the_catalogue_is_refused() -> None:
    with pytest.raises(ValueError, match="not in the catalogue"):
        Event("Warning", "SomethingHappened", "x")


def test_every_phase_that_emits_an_event_is_in_the_catalogue() -> None:
    assert set(PHASES) <= set(EVENT_REASONS)


def test_reason_literals_in_the_operator_are_in_the_catalogue() -> None:
    for path in (ROOT / "operator" / "hybridflow_operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Event"
                and len(node.args) >= 2
            ):
                reason = node.args[1]
                if isinstance(reason, ast.Constant):
                    assert reason.value in EVENT_REASONS, f"{path}: {reason.value}"


class Failure:
    def __init__(self, status: int, kind: str) -> None:
        self.status, self.kind, self.message = status, kind, ""


@pytest.mark.parametrize(
    ("status", "kind", "reason"),
    [
        (404, "RayJob", "KubeRayMissing"),
        (404, "Role", "ApiError"),
        (403, "Role", "Forbidden"),
        (422, "RayJob", "Invalid"),
        (500, "ConfigMap", "ApiError"),
    ],
)
def test_api_failures_map_to_catalogue_reasons(status: int, kind: str, reason: str) -> None:
    assert api_failure_reason(Failure(status, kind)) == reason
