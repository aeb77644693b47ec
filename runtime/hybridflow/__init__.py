"""HybridFlow on Ray: a single controller over SPMD worker groups for RLHF post-training.

The package never imports kopf; the operator (``hybridflow_operator``) never imports this
package's ML dependencies. ``hybridflow.spec`` is the one module both sides share.
"""

__version__ = "0.1.0"
