"""What a network plugin enforcing ``networking.k8s.io/v1`` NetworkPolicy lets a pod send.

The rules of the API's contract (``k8s.io/api/networking/v1/types.go``, the NetworkPolicy field
docs, v1.25+, where ``endPort`` is GA), as every conformant plugin applies them to egress:

* a pod is isolated for egress when at least one policy of its namespace selects it
  (``podSelector``) and lists ``Egress`` in ``policyTypes``; a pod that is not isolated may send
  anything;
* an isolated pod may send a packet when some egress rule of some such policy allows it (rules
  add up, never subtract);
* a rule allows a destination when its ``to`` is empty or absent (every destination) or one of
  its peers matches: ``podSelector`` alone (pods of the policy's namespace), ``namespaceSelector``
  alone (every pod of the matching namespaces), both (matching pods of matching namespaces);
  ``ipBlock`` peers are not modelled (no pod IPs here);
* and a port when its ``ports`` is empty or absent (every port) or an entry matches: the same
  protocol (default TCP), ``port`` absent (every port), equal, or with ``endPort`` the inclusive
  range ``port..endPort``. Named ports are not modelled.

Selectors here are ``matchLabels`` only (the builders use nothing else); an empty selector selects
everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Json = Mapping[str, Any]


@dataclass(frozen=True)
class Endpoint:
    """A pod: its namespace, its labels and its namespace's labels."""

    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)


def _selects(selector: Json | None, labels: Mapping[str, str]) -> bool:
    wanted = (selector or {}).get("matchLabels") or {}
    return all(labels.get(key) == value for key, value in wanted.items())


def _peer_matches(peer: Json, policy_namespace: str, destination: Endpoint) -> bool:
    if "namespaceSelector" in peer:
        in_namespace = _selects(peer["namespaceSelector"], destination.namespace_labels)
    else:
        in_namespace = destination.namespace == policy_namespace
    if not in_namespace:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], destination.labels)


def _port_matches(entry: Json, protocol: str, port: int) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    first = int(entry["port"])
    return first <= port <= int(entry.get("endPort", first))


def egress_allowed(
    policies: Iterable[Json], source: Endpoint, destination: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """Whether ``source`` may open ``protocol``/``port`` to ``destination`` under ``policies``."""
    isolating = [
        policy
        for policy in policies
        if (policy.get("metadata") or {}).get("namespace", source.namespace) == source.namespace
        and "Egress" in (policy["spec"].get("policyTypes") or [])
        and _selects(policy["spec"].get("podSelector"), source.labels)
    ]
    if not isolating:
        return True
    for policy in isolating:
        namespace = (policy.get("metadata") or {}).get("namespace", source.namespace)
        for rule in policy["spec"].get("egress") or []:
            peers, ports = rule.get("to") or [], rule.get("ports") or []
            to_ok = not peers or any(_peer_matches(peer, namespace, destination) for peer in peers)
            port_ok = not ports or any(_port_matches(entry, protocol, port) for entry in ports)
            if to_ok and port_ok:
                return True
    return False
