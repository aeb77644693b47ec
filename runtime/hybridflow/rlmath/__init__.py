"""The RL math every layer shares: advantages, losses, KL, loss aggregation, log-probs and entropy.

A leaf package: it imports torch and the spec, nothing else of the runtime. The algorithms
(controller side) compute advantages with it; the workers and backends (GPU side) compute
log-probs, entropy and the actor/critic objectives with it, so both sides agree on one
definition of every quantity.
"""
