"""The 3D-HybridEngine: moving the actor's weights between its training and generation layouts.

* :mod:`~hybridflow.resharding.layout` (pure): how each HF parameter of a Qwen2/Llama decoder
  is split for tensor parallelism and which pipeline stage owns it.
* :mod:`~hybridflow.resharding.plan` (pure): who sends what to whom in a transition, for
  HybridFlow and for the two baselines of the paper's Table 2, with the bytes each rank
  receives and holds; the formulas of Table 2.
* :mod:`~hybridflow.resharding.post_order` (pure): the point-to-point ops each rank posts in a
  transition, in order (the lists the transfers execute), and the check that both ends of
  every rank pair post the same sequence, which NCCL's by-order matching needs.
* :mod:`~hybridflow.resharding.transfer`: runs a plan over ``torch.distributed`` (gloo or
  NCCL) and measures it.

``docs/hybrid-engine.md`` explains the grouping and gives the measured figures. The top level
imports only the pure modules; import the transfer (which needs ``torch.distributed``) from
its module.
"""

from hybridflow.resharding.layout import (
    Block,
    DecoderSpec,
    ModelLayout,
    ParamSpec,
    ReshardingError,
    decoder_layout,
)
from hybridflow.resharding.plan import (
    DESIGNS,
    BlockSource,
    Design,
    Message,
    ParamBytes,
    RankPlan,
    Table2Row,
    TransitionPlan,
    allgather_plan,
    build_plan,
    hybridflow_plan,
    micro_dp_groups,
    table2,
    vanilla_plan,
)
from hybridflow.resharding.post_order import (
    ExchangeBucket,
    PostedOp,
    PostOrderMismatch,
    check_post_order,
    exchange_buckets,
    exchange_posts,
    require_post_order,
)

__all__ = [
    "DESIGNS",
    "Block",
    "BlockSource",
    "DecoderSpec",
    "Design",
    "ExchangeBucket",
    "Message",
    "ModelLayout",
    "ParamBytes",
    "ParamSpec",
    "PostOrderMismatch",
    "PostedOp",
    "RankPlan",
    "ReshardingError",
    "Table2Row",
    "TransitionPlan",
    "allgather_plan",
    "build_plan",
    "check_post_order",
    "decoder_layout",
    "exchange_buckets",
    "exchange_posts",
    "hybridflow_plan",
    "micro_dp_groups",
    "require_post_order",
    "table2",
    "vanilla_plan",
]
