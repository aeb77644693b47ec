"""The generated RLHFJob CRD: up to date, structural, documented, and enforcing what the models enforce.

What the API server would do with the CRD is replayed here without one: defaulting (a small
re-implementation of structural defaulting), schema validation (jsonschema's draft 4, whose
``exclusiveMinimum: true`` flag is OpenAPI v3.0's), and the ``x-kubernetes-validations``
rules (cel-python), including the transition rules that see ``oldSelf``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft4Validator
from pydantic import BaseModel, Field

from hybridflow.spec import IN_CLUSTER_RULES, VALIDATION_RULES, CrossFieldRule, SpecError, parse_job_manifest
from hybridflow_operator import crd
from hybridflow_operator.builders import JobRef, RayJobDefaults, build_rayjob
from hybridflow_operator.crd import (
    CRD_PATH,
    IMMUTABLE_FIELD_RULES,
    PRINTER_COLUMNS,
    SchemaConversionError,
    TransitionRule,
    build_crd,
    render_crd,
    structural_schema,
)
from kube.kueue import MAX_POD_SETS, kueue_rayjob_webhook, rayjob_pod_sets, workload_refusal

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
Manifest = dict[str, Any]


def openapi() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does: fill missing defaulted properties, recursively."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            value = {key: apply_defaults(extra, item) for key, item in value.items()}
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def example(path: Path) -> Manifest:
    manifest: Manifest = yaml.safe_load(path.read_text())
    return manifest


def defaulted(manifest: Manifest) -> Manifest:
    result: Manifest = apply_defaults(openapi(), manifest)
    return result


def node_at(value: Any, dotted: str) -> Any:
    """The value at a dot path; numeric parts index lists (``spec.resourcePools.0``)."""
    for key in dotted.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def has_node(value: Any, dotted: str) -> bool:
    """Whether the manifest has a node at the dot path (the API server runs no rule of an absent one)."""
    try:
        node_at(value, dotted)
    except (KeyError, IndexError):
        return False
    return True


def schema_node(dotted: str) -> dict[str, Any]:
    node = openapi()
    for key in dotted.split("."):
        node = node["properties"][key]
    return node


# --------------------------------------------------------------------------- the committed file


def test_committed_crd_is_what_the_models_generate() -> None:
    assert CRD_PATH == ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml"
    assert CRD_PATH.read_text(encoding="utf-8") == render_crd(), (
        "crds/ is stale: run `python -m hybridflow_operator.crd`"
    )
    assert yaml.safe_load(CRD_PATH.read_text()) == build_crd()


def test_check_mode_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "crd.yaml"
    assert crd.main(["--output", str(target)]) == 0
    assert crd.main(["--check", "--output", str(target)]) == 0
    target.write_text(target.read_text().replace("shortNames", "shortNamez"))
    assert crd.main(["--check", "--output", str(target)]) == 1
    err = capsys.readouterr().err
    assert "-    shortNamez:" in err and "+    shortNames:" in err and "is stale" in err


def test_crd_is_a_valid_apiextensions_v1_object() -> None:
    """Every key of the CRD, schema nodes included, is one the API server knows (strict validation)."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate==1.37.0 to check the CRD offline"
    )
    kubernetes_validate.validate(build_crd(), "1.33.0", strict=True)
    broken = build_crd()
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-rules"
    ] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33.0", strict=True)


def test_crd_identity_status_subresource_and_columns() -> None:
    spec = build_crd()["spec"]
    assert build_crd()["metadata"]["name"] == "rlhfjobs.hybridflow.io"
    assert spec["group"] == "hybridflow.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "RLHFJob" and spec["names"]["plural"] == "rlhfjobs"
    assert "rlhf" in spec["names"]["shortNames"] and spec["names"]["categories"]
    [version] = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    names = [column["name"] for column in version["additionalPrinterColumns"] if not column.get("priority")]
    assert names[0] == "Phase" and names[-1] == "Age"
    assert {"Step", "Reward", "Tokens/s"} <= set(names)


@pytest.mark.parametrize("column", PRINTER_COLUMNS, ids=lambda column: column["name"])
def test_printer_columns_point_at_schema_fields(column: dict[str, Any]) -> None:
    path = column["jsonPath"].lstrip(".")
    if path == "metadata.creationTimestamp":
        return
    node = schema_node(path)
    expected = {"integer": "integer", "number": "number", "string": "string"}[column["type"]]
    assert node["type"] == expected


# --------------------------------------------------------------------------- structural schema

FORBIDDEN_KEYS = {
    "$ref",
    "$defs",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "nullable",
    "const",
    "title",
    "definitions",
}


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def contains_null(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return any(contains_null(item) for item in value.values())
    if isinstance(value, list):
        return any(contains_null(item) for item in value)
    return False


def test_schema_is_structural() -> None:
    problems = []
    for path, node in walk(openapi()):
        if not node.get("type"):
            problems.append(f"{path}: no type")
        if FORBIDDEN_KEYS & set(node):
            problems.append(f"{path}: {sorted(FORBIDDEN_KEYS & set(node))}")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties")
        if node.get("additionalProperties") is False:
            problems.append(f"{path}: additionalProperties false")
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(
            node["exclusiveMinimum"], bool
        ):
            problems.append(f"{path}: numeric exclusiveMinimum (JSON Schema 2020), not OpenAPI v3.0's flag")
        if "default" in node:
            if contains_null(node["default"]):
                problems.append(f"{path}: null inside the default")
            errors = list(Draft4Validator(node).iter_errors(node["default"]))
            if errors:
                problems.append(f"{path}: default does not validate: {errors[0].message}")
        if node.get("type") == "object" and not (
            "properties" in node
            or "additionalProperties" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
            or path == ".metadata"
        ):
            problems.append(f"{path}: object without properties")
    assert problems == []


def test_every_property_has_a_description() -> None:
    missing = [
        f"{path}.{name}"
        for path, node in walk(openapi())
        for name, child in node.get("properties", {}).items()
        if not str(child.get("description", "")).strip()
    ]
    assert missing == []


def test_enums_bounds_and_maps_survive_the_conversion() -> None:
    assert schema_node("spec.algorithm.lossAggregation")["enum"] == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
    ]
    algorithm = schema_node("spec.algorithm.name")  # a built-in or a plugin 'package.module:function'
    assert algorithm["pattern"].startswith("^(ppo|grpo|remax|safe-rlhf|rloo|reinforce\\+\\+|")
    clip_low = schema_node("spec.algorithm.clipRatioLow")
    assert clip_low["maximum"] == 1 and clip_low["exclusiveMaximum"] is True
    assert schema_node("spec.rollout.topP") == {
        **schema_node("spec.rollout.topP"),
        "minimum": 0,
        "exclusiveMinimum": True,
    }
    assert schema_node("spec.schedulerLabels")["additionalProperties"] == {"type": "string"}
    pool = schema_node("spec.resourcePools")["items"]["properties"]
    assert pool["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert pool["tolerations"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert "nullable" not in str(openapi())
    assert schema_node("spec.roles")["default"] == {"actor": "default"}
    assert schema_node("status.phase")["enum"] == [
        "Pending",
        "Suspended",
        "Queued",
        "Initializing",
        "Running",
        "Retrying",
        "Succeeded",
        "Failed",
    ]
    progress = schema_node("status.progress")["properties"]
    assert set(progress) == {
        "step",
        "totalSteps",
        "percent",
        "reward",
        "tokensPerSecond",
        "etaSeconds",
        "lastCheckpointStep",
        "updatedAt",
        "placement",
        "rollout",
    }
    replica = schema_node("status.progress.rollout.replicas")["items"]["properties"]
    assert replica["state"]["enum"] == ["Serving", "Starting"]
    assert schema_node("status.progress.placement")["required"] == ["kind", "summary"]
    conditions = schema_node("status.conditions")
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == [
        "type"
    ]


def test_generation_refuses_what_a_structural_schema_cannot_say() -> None:
    class Undocumented(BaseModel):
        documented: int = Field(description="has one")
        bare: int = 0

    class Union(BaseModel):
        either: int | str = Field(description="an int or a string")

    with pytest.raises(SchemaConversionError, match=r"Undocumented\.bare: no description"):
        structural_schema(Undocumented.model_json_schema())
    with pytest.raises(SchemaConversionError, match=r"Union\.either: only Optional"):
        structural_schema(Union.model_json_schema())
    with pytest.raises(SchemaConversionError, match="keyword 'oneOf'"):
        structural_schema({"type": "object", "oneOf": [{"type": "object"}]})


# --------------------------------------------------------------------------- examples against the schema


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    Draft4Validator(openapi()).validate(defaulted(example(path)))


def _without_empty_maps(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_empty_maps(item) for key, item in value.items() if item != {}}
    if isinstance(value, list):
        return [_without_empty_maps(item) for item in value]
    return value


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_crd_defaults_are_the_model_defaults(path: Path) -> None:
    """The API server fills in exactly what the model fills in (maps defaulting to {} aside)."""
    manifest = example(path)
    from_crd = defaulted(manifest)["spec"]
    from_model = parse_job_manifest(manifest, path.name).to_manifest()["spec"]
    assert _without_empty_maps(from_crd) == _without_empty_maps(from_model)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spec.algorithm.name", "dpo"),
        ("spec.training.totalSteps", 0),
        ("spec.rollout.topP", 0),
        ("spec.resourcePools", []),
        ("spec.data.trainFiles", ["prompts.csv"]),
        ("spec.queueName", "-bad-"),
    ],
)
def test_schema_rejects_bad_fields(field: str, value: Any) -> None:
    manifest = defaulted(example(EXAMPLES[0]))
    parent, key = field.rsplit(".", 1)
    node_at(manifest, parent)[key] = value
    assert list(Draft4Validator(openapi()).iter_errors(manifest)), f"{field}={value!r} was accepted"


# --------------------------------------------------------------------------- CEL rules


def attached_rules() -> Iterator[tuple[str, dict[str, str]]]:
    for path, node in walk(openapi()):
        for rule in node.get("x-kubernetes-validations", []):
            yield path.lstrip("."), rule


def evaluate(rule: str, node: Any, old: Any = None) -> bool:
    """The rule's verdict on ``node`` (``self``) and, for transition rules, ``old`` (``oldSelf``)."""
    celpy = pytest.importorskip("celpy", reason="install cel-python to evaluate the CRD's CEL rules")
    environment = celpy.Environment()
    program = environment.program(environment.compile(rule))
    activation = {"self": celpy.json_to_cel(node)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    verdict = program.evaluate(activation)
    assert isinstance(verdict, celpy.celtypes.BoolType), f"{rule!r} gave {verdict!r}"
    return bool(verdict)


def test_every_spec_rule_is_attached_at_its_node() -> None:
    attached = list(attached_rules())
    expected: list[CrossFieldRule[Any] | TransitionRule] = [
        *VALIDATION_RULES,
        *IN_CLUSTER_RULES,
        *IMMUTABLE_FIELD_RULES,
    ]
    assert sorted((path, rule["rule"]) for path, rule in attached) == sorted(
        (rule.node_path, rule.cel) for rule in expected
    )
    for path, rule in attached:
        assert rule.keys() == {"rule", "message", "fieldPath"}
        target = schema_node(path)
        for key in rule["fieldPath"].removeprefix(".").split("."):
            target = target["properties"][key]


def failing_rules(manifest: Manifest) -> set[str]:
    """Names of the validation rules whose CEL, as attached in the CRD, rejects ``manifest``."""
    by_cel = {rule.cel: rule.name for rule in VALIDATION_RULES}
    return {
        by_cel[rule["rule"]]
        for path, rule in attached_rules()
        if rule["rule"] in by_cel
        and has_node(manifest, path)
        and not evaluate(rule["rule"], node_at(manifest, path))
    }


def python_failures(manifest: Manifest) -> set[str]:
    """Names of the rules the model rejects ``manifest`` for (its SpecError lines name them)."""
    try:
        parse_job_manifest(manifest, "test")
    except SpecError as error:
        return {
            rule.name
            for rule in VALIDATION_RULES
            for problem in error.problems
            if problem.startswith(f"{rule.path}: {rule.message} (got ")
        }
    return set()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_cel_rules_accept_the_examples_after_crd_defaulting(path: Path) -> None:
    assert failing_rules(defaulted(example(path))) == set()


def _set(dotted: str, value: Any) -> Callable[[Manifest], None]:
    def mutate(manifest: Manifest) -> None:
        parent_path, key = dotted.rsplit(".", 1)
        parent = node_at(manifest, parent_path)
        if isinstance(parent, list):
            parent[int(key)] = value
        else:
            parent[key] = value

    return mutate


# Invalid specs that reach every node carrying rules. The CRD's CEL and the model's Python must
# reject each for the same rules (tests/unit/test_spec.py covers every rule one by one).
INVALID_SPECS: dict[str, list[Callable[[Manifest], None]]] = {
    "adaptive kl at zero": [
        _set("spec.algorithm.kl.controller", "adaptive"),
        _set("spec.algorithm.kl.coef", 0.0),
    ],
    "grpo with one sample": [
        _set("spec.algorithm.samplesPerPrompt", 1),
        _set("spec.training.miniBatchSize", 8),
    ],
    "top-k zero": [_set("spec.rollout.topK", 0)],
    "warmup past the end": [_set("spec.training.warmupSteps", 1000)],
    "role on a missing pool": [_set("spec.roles.rollout", "nowhere")],
    "ppo without a critic": [_set("spec.algorithm.name", "ppo")],
    "tensor parallel over the pool": [_set("spec.training.tensorParallelSize", 4)],
    "tensor-parallel generation on fsdp": [_set("spec.rollout.tensorParallelSize", 2)],
    "vllm tensor parallel not dividing the training's": [
        _set("spec.training.backend", "megatron"),
        _set("spec.training.tensorParallelSize", 4),
        _set("spec.resourcePools.0.gpusPerNode", 4),
        _set("spec.rollout.tensorParallelSize", 3),
        _set("spec.rollout.engine", "vllm"),
    ],
    "vllm with pipeline-parallel generation": [
        _set("spec.training.backend", "megatron"),
        _set("spec.training.pipelineParallelSize", 2),
        _set("spec.resourcePools.0.gpusPerNode", 2),
        _set("spec.rollout.pipelineParallelSize", 2),
        _set("spec.rollout.engine", "vllm"),
    ],
    "parameter offload from the engine's own weights": [
        _set("spec.rollout.engine", "torch"),
        _set("spec.resourcePools.0.gpusPerNode", 1),
        _set("spec.training.offloadDuringGeneration.parameters", True),
    ],
    "duplicate mount paths": [
        _set("spec.volumes", [{"claimName": "a", "mountPath": "/m"}, {"claimName": "b", "mountPath": "/m"}])
    ],
    "evaluation without validation files": [
        _set("spec.evaluation", {"everySteps": 2, "atStart": False, "greedy": True, "samples": 1})
    ],
    "evaluation with neither pass": [
        _set("spec.data.valFiles", ["/data/val.jsonl"]),
        _set("spec.evaluation", {"everySteps": 0, "atStart": False, "greedy": False, "samples": 0}),
    ],
    "several at once": [
        _set("spec.rollout.topK", 0),
        _set("spec.rewards", []),
        _set("spec.roles.cost", "default"),
    ],
}


@pytest.mark.parametrize("case", sorted(INVALID_SPECS))
def test_cel_rejects_what_the_model_rejects(case: str) -> None:
    manifest = defaulted(example(ROOT / "examples" / "grpo-tiny.yaml"))
    for mutate in INVALID_SPECS[case]:
        mutate(manifest)
    rejected = failing_rules(manifest)
    assert rejected, case
    assert rejected == python_failures(manifest)


def test_cel_and_the_model_accept_vllm_between_1_and_the_training_tensor_parallel_size() -> None:
    # Megatron t 4 -> vLLM t_g 2: the 3D-HybridEngine's strided generation groups, built in vLLM.
    manifest = defaulted(example(ROOT / "examples" / "grpo-tiny.yaml"))
    for mutate in INVALID_SPECS["vllm tensor parallel not dividing the training's"]:
        mutate(manifest)
    _set("spec.rollout.tensorParallelSize", 2)(manifest)
    assert failing_rules(manifest) == set()
    spec = parse_job_manifest(manifest, "test").spec
    assert (spec.training.tensor_parallel_size, spec.rollout.tensor_parallel_size) == (4, 2)


# --------------------------------------------------------------------------- immutability (oldSelf)

IMMUTABLE_BY_NAME = {rule.name: rule for rule in IMMUTABLE_FIELD_RULES}


def transition_failures(old: Manifest, new: Manifest) -> set[str]:
    return {
        rule.name
        for rule in IMMUTABLE_FIELD_RULES
        if not evaluate(rule.cel, node_at(new, rule.node_path), node_at(old, rule.node_path))
    }


CHANGES: dict[str, tuple[list[Callable[[Manifest], None]], set[str]]] = {
    "actor model path": ([_set("spec.models.actor.path", "/models/other")], {"models-immutable"}),
    "a reference model added": (
        [_set("spec.models.reference", {"path": "/models/ref"})],
        {"models-immutable"},
    ),
    "algorithm": ([_set("spec.algorithm.name", "rloo")], {"algorithm-immutable"}),
    "training backend": ([_set("spec.training.backend", "megatron")], {"training-backend-immutable"}),
    "gpus per node": ([_set("spec.resourcePools.0.gpusPerNode", 4)], {"pool-layout-immutable"}),
    "gpu type": ([_set("spec.resourcePools.0.gpuType", "H100-80GB")], {"pool-layout-immutable"}),
    "gpu label under auto placement": (
        [
            _set("spec.placement", "auto"),
            _set("spec.resourcePools.0.nodeSelector", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
        ],
        {"auto-placement-gpu-label-immutable"},
    ),
    "pool renamed": (
        [_set("spec.resourcePools.0.name", "gpu"), _set("spec.roles.actor", "gpu")],
        {"pool-layout-immutable", "roles-immutable"},
    ),
    "pool added": (
        [lambda m: m["spec"]["resourcePools"].append({**m["spec"]["resourcePools"][0], "name": "more"})],
        {"pool-layout-immutable"},
    ),
    "rollout moved": ([_set("spec.roles.rollout", "default")], {"roles-immutable"}),
    "checkpoint volume added": (
        [_set("spec.checkpoint.volume", {"claimName": "ckpt", "mountPath": "/ckpt"})],
        {"checkpoint-volume-immutable"},
    ),
    "checkpoint path": ([_set("spec.checkpoint.path", "elsewhere")], {"checkpoint-path-immutable"}),
    # Editable: they apply from the next attempt on.
    "learning rate, steps, lifecycle": (
        [
            _set("spec.training.learningRate", 1e-4),
            _set("spec.training.totalSteps", 80),
            _set("spec.suspend", True),
            _set("spec.maxRestarts", 10),
            _set("spec.queueName", "team"),
        ],
        set(),
    ),
    "pool scheduling fields": (
        [
            _set("spec.resourcePools.0.nodeSelector", {"gpu": "h100"}),
            _set("spec.resourcePools.0.tolerations", [{"key": "gpu", "operator": "Exists"}]),
            _set("spec.resourcePools.0.cpusPerGpu", 8),
            _set("spec.resourcePools.0.memoryPerGpu", "64Gi"),
        ],
        set(),
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_transition_rules_guard_what_checkpoints_depend_on(change: str) -> None:
    old = defaulted(example(ROOT / "examples" / "grpo-tiny.yaml"))
    new = copy.deepcopy(old)
    mutations, expected = CHANGES[change]
    for mutate in mutations:
        mutate(new)
    assert transition_failures(old, defaulted(new)) == expected


def test_unchanged_spec_passes_every_transition_rule() -> None:
    for path in EXAMPLES:
        manifest = defaulted(example(path))
        assert transition_failures(manifest, copy.deepcopy(manifest)) == set()
    assert set(IMMUTABLE_BY_NAME) == {name for _, names in CHANGES.values() for name in names}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_in_cluster_rules_agree_with_their_python_twins(path: Path) -> None:
    """The CRD's admission and `hybridflow validate --in-cluster` reject the same manifests."""
    manifest = defaulted(example(path))
    spec = parse_job_manifest(manifest, "test").spec
    for rule in IN_CLUSTER_RULES:
        assert evaluate(rule.cel, node_at(manifest, rule.node_path)) == rule.holds(spec), rule.name
    # The cluster examples are written for a cluster; the laptop ones (relative paths, no claim) are not.
    expected = set() if path.name.endswith("-cluster.yaml") else LAPTOP_ONLY
    assert {rule.name for rule in IN_CLUSTER_RULES if not rule.holds(spec)} == expected


LAPTOP_ONLY = {"restarts-need-a-checkpoint-volume", "restarts-need-absolute-paths"}
"""The in-cluster rules the laptop examples break (relative paths, no checkpoint claim)."""


def _pools(*names: str) -> Callable[[Manifest], None]:
    def mutate(manifest: Manifest) -> None:
        manifest["spec"]["resourcePools"] = [{"name": name, "gpusPerNode": 1} for name in names]
        manifest["spec"]["roles"] = {"actor": names[0]}

    return mutate


def _env(name: str) -> Callable[[Manifest], None]:
    def mutate(manifest: Manifest) -> None:
        manifest["spec"].setdefault("pods", {})["env"] = [
            {"name": "PYTHONPATH", "value": "/x"},
            {"name": name},
        ]

    return mutate


SIX_ROLES = ("actor", "rollout", "reference", "critic", "reward", "cost")


def _six_pools_and_a_sandbox(manifest: Manifest) -> None:
    """Safe-RLHF with every role on a pool of its own and the agent example's tool loop with a
    sandbox worker: 7 worker groups, the most a spec can ask for."""
    agent = example(ROOT / "examples" / "grpo-tiny-agent.yaml")["spec"]
    spec = manifest["spec"]
    spec["agent"] = {**agent["agent"], "sandbox": {**agent["agent"]["sandbox"], "workers": 1}}
    spec["rollout"] = agent["rollout"]
    spec["algorithm"] = {"name": "safe-rlhf", "samplesPerPrompt": 4}
    spec["models"].update(
        {role: {"path": f"/data/{role}"} for role in ("reference", "critic", "reward", "cost")}
    )
    spec.pop("rewards", None)
    spec["resourcePools"] = [{"name": f"pool-{role}", "gpusPerNode": 1} for role in SIX_ROLES]
    spec["roles"] = {role: f"pool-{role}" for role in SIX_ROLES}


QUEUED = _set("spec.queueName", "research")
ADMISSION_CASES: dict[str, tuple[str, list[Callable[[Manifest], None]]]] = {
    "a capability off the allow-list": (
        "capabilities-from-the-allow-list",
        [
            lambda m: (
                m["spec"]
                .setdefault("pods", {})
                .update(headContainerSecurityContext={"capabilities": {"add": ["SYS_ADMIN"]}})
            )
        ],
    ),
    "a queued pool named head": ("kueue-reserved-pool-name", [QUEUED, _pools("head")]),
    "a queued pool named submitter": ("kueue-reserved-pool-name", [QUEUED, _pools("submitter")]),
    "6 queued pools and the sandbox group": ("kueue-worker-groups", [QUEUED, _six_pools_and_a_sandbox]),
    **{
        f"env {name}": ("pods-env-not-kuberays", [_env(name)])
        for name in (
            "RAY_REDIS_ADDRESS",
            "REDIS_USERNAME",
            "RAY_enable_autoscaler_v2",
            "RAY_AUTH_TOKEN",
            "RAY_AUTH_MODE",
        )
    },
}


@pytest.mark.parametrize("case", sorted(ADMISSION_CASES))
def test_pod_security_and_kueue_rules_refuse_what_they_name(case: str) -> None:
    """Each admission rule refuses its own crafted manifest, in CEL and in Python, and the cluster
    example passes it; Kueue's and KubeRay's refusals come from their stand-ins (``tests/kube``)."""
    rule_name, mutations = ADMISSION_CASES[case]
    manifest = example(ROOT / "examples" / "grpo-cluster.yaml")
    for mutate in mutations:
        mutate(manifest)
    manifest = defaulted(manifest)
    spec = parse_job_manifest(manifest, "test").spec
    rule = next(r for r in IN_CLUSTER_RULES if r.name == rule_name)
    assert [r.name for r in IN_CLUSTER_RULES if not r.holds(spec)] == [rule_name]
    assert not evaluate(rule.cel, node_at(manifest, rule.node_path))
    fine = defaulted(example(ROOT / "examples" / "grpo-cluster.yaml"))
    assert rule.holds(parse_job_manifest(fine, "test").spec) and evaluate(
        rule.cel, node_at(fine, rule.node_path)
    )


@pytest.mark.parametrize(
    "case",
    ["a queued pool named head", "a queued pool named submitter", "6 queued pools and the sandbox group"],
)
def test_what_admission_lets_through_kueue_can_queue(case: str) -> None:
    """A queued spec the CRD admits must give a RayJob whose Workload every supported Kueue makes
    (``kube.kueue``: the webhook, then the Workload's pod sets: unique names, at most MaxPodSets)."""
    manifest = example(ROOT / "examples" / "grpo-cluster.yaml")
    for mutate in ADMISSION_CASES[case][1]:
        mutate(manifest)
    manifest = defaulted(manifest)
    spec = parse_job_manifest(manifest, "test").spec
    admitted = all(evaluate(rule.cel, node_at(manifest, rule.node_path)) for rule in IN_CLUSTER_RULES)
    assert admitted == all(rule.holds(spec) for rule in IN_CLUSTER_RULES)
    job = parse_job_manifest({**manifest, "metadata": {"name": "q", "namespace": "n", "uid": "u"}}, "test")
    rayjob = build_rayjob(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image="img"))
    rayjob["metadata"]["uid"] = "u"
    refusals = [
        f"Kueue {version}: {problem}"
        for version in MAX_POD_SETS
        for problem in (
            kueue_rayjob_webhook(f"{version[0]}.{version[1]}").check(rayjob, None),
            workload_refusal(rayjob_pod_sets(rayjob), version),
        )
        if problem is not None
    ]
    assert not admitted and refusals, refusals  # refused at admission: Kueue would never start it


def test_a_queued_sandbox_job_with_five_pools_is_admitted() -> None:
    """The sandbox group counts as one of the 6 worker groups every supported Kueue admits."""
    manifest = example(ROOT / "examples" / "grpo-cluster.yaml")
    for mutate in (QUEUED, _six_pools_and_a_sandbox):
        mutate(manifest)
    manifest["spec"]["resourcePools"].pop()
    manifest["spec"]["roles"]["cost"] = "pool-reward"
    manifest = defaulted(manifest)
    spec = parse_job_manifest(manifest, "test").spec
    assert spec.agent.sandbox_workers == 1 and len(spec.resource_pools) == 5
    for rule in IN_CLUSTER_RULES:
        assert rule.holds(spec) and evaluate(rule.cel, node_at(manifest, rule.node_path)), rule.name


def test_hybridflow_validate_in_cluster_prints_the_admission_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridflow.cli import main

    laptop = str(ROOT / "examples" / "grpo-tiny.yaml")
    assert main(["validate", laptop]) == 0  # fine on a laptop; the cluster's rules are notes
    assert "note: in a cluster: spec.checkpoint.volume: " in capsys.readouterr().err
    assert main(["validate", "--in-cluster", laptop]) == 2
    err = capsys.readouterr().err
    for rule in IN_CLUSTER_RULES:  # the very message the CRD's CEL rule gives
        if rule.name in LAPTOP_ONLY:
            assert f"error: in a cluster: {rule.path}: {rule.message}" in err
    assert main(["validate", "--in-cluster", str(ROOT / "examples" / "grpo-cluster.yaml")]) == 0


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*-cluster.yaml")), ids=lambda p: p.name)
def test_cluster_examples_keep_their_outputs_on_the_checkpoint_volume(path: Path) -> None:
    """The head pod's disk is deleted with the attempt's cluster: metrics go where checkpoints go."""
    spec = parse_job_manifest(example(path), "test").spec
    assert spec.checkpoint.volume is not None
    assert spec.output_dir.startswith(spec.checkpoint.volume.mount_path.rstrip("/") + "/"), spec.output_dir
