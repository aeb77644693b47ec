"""Cross-field validation rules, each written twice on purpose: as CEL for the API server and as Python.

Protocol. The rules about one section (``spec.algorithm``, ``spec.training``, ...) are a
module-level tuple next to that section's class; the rules across sections sit next to
``RLHFJobSpec``. All of them run in one ``after`` validator of ``RLHFJobSpec``, so validation
is two-phase: first every field error of the manifest, then, once all fields are valid,
every broken rule at once (a section built alone in Python is not checked against them).
The CRD generator reads the same records (``hybridflow.spec.VALIDATION_RULES``) and emits
each one, via :meth:`CrossFieldRule.as_x_kubernetes_validation`, as an
``x-kubernetes-validations`` entry on the schema node at ``node_path``. So ``kubectl apply``
rejects a bad manifest with the same message ``hybridflow run`` prints, and the tests hold
the two implementations of each rule to the same verdicts.

CEL conventions the expressions rely on: ``self`` is the node at ``node_path``; field names
are the camelCase keys; fields with a default are present (the CRD carries the defaults, and
the API server applies them before it evaluates rules), fields without one are guarded with
``has()``. Each expression is a plain comparison of fields, cheap enough for the API
server's cost budget given the schema's ``maxItems``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

NodeT = TypeVar("NodeT")
# Contravariant: a rule that checks an AlgorithmSpec checks any subtype of it too, including the
# ``Self`` type a model validator sees.
NodeT_contra = TypeVar("NodeT_contra", contravariant=True)


@dataclass(frozen=True)
class CrossFieldRule(Generic[NodeT_contra]):
    """One rule over several fields of the node at ``node_path``.

    ``holds`` is the Python twin of ``cel``: both must accept and reject the same nodes.
    ``observed`` renders the values the rule looked at, for the Python error line, because a
    static CEL message cannot name them.
    """

    name: str
    """Stable identifier, for tests and docs; not emitted into the CRD."""
    node_path: str
    """Dot path of the schema node the rule attaches to, e.g. ``spec.algorithm``."""
    field_path: str
    """Where the error points, relative to the node (CEL ``fieldPath`` syntax), e.g. ``.roles.critic``."""
    cel: str
    message: str
    """Static text shown by the API server after the field path, and by Python before the observed values."""
    holds: Callable[[NodeT_contra], bool]
    observed: Callable[[NodeT_contra], str]

    @property
    def path(self) -> str:
        """The full dot path the error names: ``node_path`` joined with ``field_path``."""
        return self.node_path + self.field_path

    def violation(self, node: NodeT_contra) -> str:
        """The error line for a node that breaks the rule: path, message, the values seen."""
        return f"{self.path}: {self.message} (got {self.observed(node)})"

    def as_x_kubernetes_validation(self) -> dict[str, str]:
        """The CRD form of the rule, one entry of the node's ``x-kubernetes-validations`` list."""
        return {"rule": self.cel, "message": self.message, "fieldPath": self.field_path}


class RuleViolations(ValueError):
    """Raised by the spec's validator when cross-field rules fail; carries one finished line per rule.

    It subclasses ``ValueError`` so pydantic turns it into a ``value_error`` whose context
    keeps this instance; the manifest loader unpacks ``lines`` instead of printing
    pydantic's wrapper text.
    """

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = tuple(lines)
        super().__init__("\n".join(self.lines))


def broken_rules(node: NodeT, rules: Sequence[CrossFieldRule[NodeT]]) -> list[str]:
    """The error line of every rule in ``rules`` that ``node`` breaks, in rule order."""
    return [rule.violation(node) for rule in rules if not rule.holds(node)]


def quoted_list(values: Sequence[object]) -> str:
    """``'a', 'b', 'c'``: how error messages list names and allowed values."""
    return ", ".join(repr(value) for value in values)
