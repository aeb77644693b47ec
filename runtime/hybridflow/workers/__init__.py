"""The roles the controller drives: actor, reference, rollout, critic and reward model.

Each role is a :class:`hybridflow.controller.Worker` constructed with the job's
:class:`hybridflow.spec.RLHFJobSpec`; its registered methods are the whole worker API.
"""
