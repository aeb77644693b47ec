"""``python -m hybridflow_operator``: run the operator (all namespaces, or those in $WATCH_NAMESPACES)."""

import gc
import os

import kopf

from hybridflow_operator.main import OperatorConfig, register

register(kopf.get_default_registry(), config=OperatorConfig())
namespaces = [n for n in os.environ.get("WATCH_NAMESPACES", "").split(",") if n]
# What exists now (the kubernetes client's models, pydantic's, kopf's and the operator's modules)
# lives as long as the process: keep it out of the cyclic collector's full passes, each of which
# would walk it all again (about 200,000 objects). Only the operator's own process does this (tests
# run the handlers in theirs); objects still die by reference counting.
gc.freeze()
kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True)
