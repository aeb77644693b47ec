"""The rollout as a service (``spec.rollout.mode: server``): replicas, routing, the replay buffer.

* :mod:`~hybridflow.rollout.routing`: which replica serves a request (least in-flight tokens;
  a session stays on its replica).
* :mod:`~hybridflow.rollout.buffer`: finished groups waiting for the trainer, the staleness
  gate on what may be submitted, and dynamic sampling's filter.
* :mod:`~hybridflow.rollout.service`: the controller's client over the replicas.

docs/rollout.md has the modes, the guarantees and how to choose.
"""
