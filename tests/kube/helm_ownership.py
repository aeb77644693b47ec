"""Helm's ownership check, replayed in Python: which rendered objects a release may not create.

Follows ``pkg/action/validate.go`` of Helm v3.17 to v4.2 (unchanged between them):
``existingResourceConflict`` looks up every object a release is about to create (on install:
all of them; on upgrade: those its previous manifest did not hold, ``upgrade.go``), and each one
that already exists must pass ``checkOwnership``: the label ``app.kubernetes.io/managed-by=Helm``
and the annotations ``meta.helm.sh/release-name`` and ``meta.helm.sh/release-namespace`` naming
this release, else Helm stops before it writes anything, with ``<Kind> "<name>" in namespace
"<ns>" exists and cannot be imported into the current release: invalid ownership metadata; ...``.
``--take-ownership`` (Helm >= 3.17) skips the check, and ``setMetadataVisitor`` then writes the
three keys onto every object the release applies, as it does on every install and upgrade.

What Helm does not look at here: the chart's ``crds/`` folder (installed on first install only,
without any of these keys, never upgraded), and objects the release already holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_HELM = "Helm"
RELEASE_NAME_ANNOTATION = "meta.helm.sh/release-name"
RELEASE_NAMESPACE_ANNOTATION = "meta.helm.sh/release-namespace"

Json = Mapping[str, Any]
Key = tuple[str, str, str]
"""(kind, namespace, name): how an object is looked up (cluster-scoped ones have namespace "")."""


def key_of(obj: Json) -> Key:
    metadata = obj.get("metadata") or {}
    return (str(obj["kind"]), str(metadata.get("namespace") or ""), str(metadata["name"]))


def _require(values: Mapping[str, str], key: str, wanted: str) -> str | None:
    # requireValue
    if key not in values:
        return f"missing key {key!r}: must be set to {wanted!r}"
    if values[key] != wanted:
        return f"key {key!r} must equal {wanted!r}: current value is {values[key]!r}"
    return None


def ownership_problem(existing: Json, release: str, namespace: str) -> str | None:
    """``checkOwnership``: why ``existing`` cannot be taken into ``release`` of ``namespace``, or None."""
    metadata = existing.get("metadata") or {}
    labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}
    errors = [
        f"label validation error: {problem}"
        for problem in [_require(labels, MANAGED_BY_LABEL, MANAGED_BY_HELM)]
        if problem
    ]
    errors += [
        f"annotation validation error: {problem}"
        for problem in (
            _require(annotations, RELEASE_NAME_ANNOTATION, release),
            _require(annotations, RELEASE_NAMESPACE_ANNOTATION, namespace),
        )
        if problem
    ]
    return f"invalid ownership metadata; {'; '.join(errors)}" if errors else None


def conflicts(
    to_create: Iterable[Json],
    cluster: Mapping[Key, Json],
    release: str,
    namespace: str,
    *,
    take_ownership: bool = False,
) -> list[str]:
    """``existingResourceConflict``: Helm's error for each object of ``to_create`` that ``cluster``
    holds and this release may not take (none with ``take_ownership``)."""
    if take_ownership:
        return []
    found = []
    for obj in to_create:
        kind, object_namespace, name = key = key_of(obj)
        existing = cluster.get(key)
        problem = None if existing is None else ownership_problem(existing, release, namespace)
        if problem is not None:
            found.append(
                f"{kind} {name!r} in namespace {object_namespace!r} exists and cannot be imported into "
                f"the current release: {problem}"
            )
    return found


def applied(obj: Json, release: str, namespace: str) -> dict[str, Any]:
    """``obj`` as Helm stores it: ``setMetadataVisitor`` adds the release's label and annotations."""
    metadata = dict(obj.get("metadata") or {})
    metadata["labels"] = {**(metadata.get("labels") or {}), MANAGED_BY_LABEL: MANAGED_BY_HELM}
    metadata["annotations"] = {
        **(metadata.get("annotations") or {}),
        RELEASE_NAME_ANNOTATION: release,
        RELEASE_NAMESPACE_ANNOTATION: namespace,
    }
    return {**obj, "metadata": metadata}
