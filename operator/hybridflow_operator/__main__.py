"""``python -m hybridflow_operator``: run the operator (all namespaces, or those in $WATCH_NAMESPACES)."""

import os

import kopf

from hybridflow_operator.main import OperatorConfig, register

register(kopf.get_default_registry(), config=OperatorConfig())
namespaces = [n for n in os.environ.get("WATCH_NAMESPACES", "").split(",") if n]
kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True)
