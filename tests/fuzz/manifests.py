"""Hypothesis strategies for RLHFJob manifests: the examples, then up to four edits each.

An edit sets a field the CRD schema knows (found by walking the committed CRD, so new fields are
fuzzed without touching this file) to a value drawn around its bounds and enums, or to a value
of the wrong type; deletes a field; or adds an unknown one. About half the cases stay valid,
which is what makes the agreement checks worth something: a fuzzer whose cases are all rejected
at the first schema check never reaches the CEL rules or the builders.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from admission import openapi_schema
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
Path_ = tuple[str | int, ...]


def as_in_a_cluster(manifest: dict[str, Any]) -> dict[str, Any]:
    """A laptop example as a cluster user would write it: files on a claim, checkpoints on another.

    The laptop examples set ``maxRestarts > 0`` with relative paths and no checkpoint volume,
    which admission rejects (a retry must resume from a claim); fuzzing only them would reach the
    builders almost never. Their cluster forms keep every other field as the example has it.
    """
    document = copy.deepcopy(manifest)
    spec = document["spec"]

    def on_claim(path: str) -> str:
        return path if path.startswith("/") else "/data/" + path.removeprefix("../")

    for model in spec["models"].values():
        model["path"] = on_claim(model["path"])
    spec["data"]["trainFiles"] = [on_claim(path) for path in spec["data"]["trainFiles"]]
    if "valFiles" in spec["data"]:
        spec["data"]["valFiles"] = [on_claim(path) for path in spec["data"]["valFiles"]]
    spec["volumes"] = [{"claimName": "data", "mountPath": "/data"}]
    spec["checkpoint"]["volume"] = {"claimName": "checkpoints", "mountPath": "/checkpoints"}
    spec["outputDir"] = "/checkpoints/outputs"
    return document


@cache
def examples() -> tuple[dict[str, Any], ...]:
    """Every example as written, and the cluster form of each laptop one."""
    written = [yaml.safe_load(path.read_text()) for path in EXAMPLES]
    laptop = [m for m in written if not m["spec"]["outputDir"].startswith("/")]
    return tuple(written + [as_in_a_cluster(m) for m in laptop])


def _fields(schema: dict[str, Any], path: Path_ = ()) -> list[tuple[Path_, dict[str, Any]]]:
    """Every property path under ``spec`` (list items as index 0, map values under key ``k``)."""
    found: list[tuple[Path_, dict[str, Any]]] = []
    if path:
        found.append((path, schema))
    for name, child in schema.get("properties", {}).items():
        found += _fields(child, (*path, name))
    if "items" in schema:
        found += _fields(schema["items"], (*path, 0))
    if isinstance(schema.get("additionalProperties"), dict):
        found += _fields(schema["additionalProperties"], (*path, "k"))
    return found


@cache
def spec_fields() -> tuple[tuple[Path_, dict[str, Any]], ...]:
    return tuple(_fields(openapi_schema()["properties"]["spec"], ("spec",)))


NAMES = [
    "default",
    "gpus",
    "rollout",
    "actor",
    "head",
    "submitter",
    "sandbox",
    "a",
    "x" * 64,
    "Bad_Name",
    "",
    "-x",
]
ENV_NAMES = [
    # What KubeRay refuses or sets itself (kube.kuberay_rules; common/pod.go), and plain ones.
    "RAY_REDIS_ADDRESS",
    "REDIS_USERNAME",
    "REDIS_PASSWORD",
    "RAY_enable_autoscaler_v2",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_ADDRESS",
    "HYBRIDFLOW_METRICS_PORT",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",
    "HF_HOME",
    "NCCL_DEBUG",
    "1BAD",
]
TEXT = st.one_of(st.sampled_from(NAMES), st.text(max_size=12))
# Fresh containers each draw (deep copies): a shared one, once inserted twice or edited through,
# would make the manifest a cyclic graph that no API server could ever receive.
WRONG_TYPE = st.sampled_from([None, "7", 7, 2.5, True, [], {}, [1], {"a": 1}]).map(copy.deepcopy)


def value_for(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values around what ``schema`` allows: its enum, its bounds and one past them, other types."""
    kind = schema.get("type")
    if "enum" in schema:
        valid: st.SearchStrategy[Any] = st.sampled_from(schema["enum"])
        return st.one_of(valid, valid, valid, valid, TEXT, WRONG_TYPE)
    if kind in ("integer", "number"):
        anchors = [0, 1, 2, 3, 4, 8, 16, 64, -1, 1000]
        for bound in ("minimum", "maximum"):
            if bound in schema:
                anchors += [schema[bound] - 1, schema[bound], schema[bound] + 1]
        numbers: st.SearchStrategy[Any] = st.sampled_from(anchors)
        if kind == "number":
            numbers = st.one_of(numbers, st.floats(-2, 2, allow_nan=False), st.sampled_from([0.5, 1e-3, 1e9]))
        return st.one_of(*[numbers] * 6, WRONG_TYPE)
    if kind == "boolean":
        return st.one_of(st.booleans(), st.booleans(), st.booleans(), WRONG_TYPE)
    if kind == "string":
        return st.one_of(
            TEXT, st.sampled_from(["/abs/path", "rel/path", "data.jsonl", "x.parquet"]), WRONG_TYPE
        )
    if kind == "array":
        return st.one_of(
            st.builds(list), WRONG_TYPE, st.lists(value_for(schema.get("items", {})), max_size=2)
        )
    if kind == "object":
        return st.one_of(st.builds(dict), WRONG_TYPE)
    return WRONG_TYPE


def _parent(document: Any, path: Path_, *, create: bool) -> Any:
    node = document
    for key in path[:-1]:
        if isinstance(node, dict):
            if key not in node and create:
                node[key] = {}
            node = node.get(key) if isinstance(key, str) else None
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return None
        if node is None:
            return None
    return node


@st.composite
def edit(draw: st.DrawFn, document: dict[str, Any]) -> str:
    """Apply one random edit to ``document`` in place; return what it did (for failure reports)."""
    action = draw(st.sampled_from(["set", "set", "set", "set", "delete", "unknown", "name", "env"]))
    if action == "env":
        name = draw(st.sampled_from(ENV_NAMES))
        value = draw(st.sampled_from(["1", "true", "x"]))
        pods = _parent(document, ("spec", "pods", "env"), create=True)
        if not isinstance(pods, dict) or not isinstance(pods.setdefault("env", []), list):
            return "no-op"
        pods["env"].append({"name": name, "value": value})
        return f"spec.pods.env += {name}={value}"
    if action == "name":
        name = draw(
            st.sampled_from(["ok-name", "a.b", "UPPER", "under_score", "x" * 254, "", "1job", "-bad"])
        )
        document.setdefault("metadata", {})["name"] = name
        return f"metadata.name = {name!r}"
    path, schema = draw(st.sampled_from(spec_fields()))
    parent = _parent(document, path, create=action == "set")
    key = path[-1]
    if action == "set" and isinstance(parent, dict) and isinstance(key, str):
        parent[key] = draw(value_for(schema))
        return f"{'.'.join(map(str, path))} = {parent[key]!r}"
    if action == "set" and isinstance(parent, list) and isinstance(key, int) and key < len(parent):
        parent[key] = draw(value_for(schema))
        return f"{'.'.join(map(str, path))} = {parent[key]!r}"
    if action == "delete" and isinstance(parent, dict) and key in parent:
        del parent[key]
        return f"del {'.'.join(map(str, path))}"
    if action == "unknown" and isinstance(parent, dict):
        parent["surpriseField"] = 1
        return f"{'.'.join(map(str, path[:-1]))}.surpriseField = 1"
    return "no-op"


@st.composite
def manifests(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    """A manifest and the edits that made it from an example."""
    document = copy.deepcopy(draw(st.sampled_from(examples())))
    edits = [draw(edit(document)) for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4])))]
    return document, edits
