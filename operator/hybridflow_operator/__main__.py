"""``python -m hybridflow_operator``: run the operator (all namespaces, or those in $WATCH_NAMESPACES).

The garbage collector's settings are the operator process's own (tests run the handlers in
theirs). Two changes keep its work per job flat as jobs grow (``bench/operator_scale.py`` at 2,000
jobs, the first alone: 34 full collections, 6.0 s of CPU; both: 2 full collections, 0.8 s):

* ``gc.freeze()`` once everything is imported: the kubernetes client's models, pydantic's and
  kopf's machinery live as long as the process, and each full collection walked them again;
* young collections every 10,000 allocations instead of 700: each watch event allocates
  thousands of objects (the decoded body, kopf's per-event structures) that live across awaits;
  collected every 700 many survived two young collections, reached the old generation and died
  there, and each such object brings the next full collection nearer, which walks the whole
  cache (every job's objects). Objects still die by reference counting (the resident memory at
  2,000 jobs measured the same).
"""

import gc
import os

import kopf

from hybridflow_operator.main import OperatorConfig, register

YOUNG_COLLECTION_ALLOCATIONS = 10_000

register(kopf.get_default_registry(), config=OperatorConfig())
namespaces = [n for n in os.environ.get("WATCH_NAMESPACES", "").split(",") if n]
gc.freeze()
gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])
kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True)
