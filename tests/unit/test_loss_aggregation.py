"""Loss aggregation: one mini-batch's gradient does not depend on how it is split.

The split the workers make (DP ranks by contiguous rows, then micro-batches per rank) is
reproduced here on a tiny differentiable policy; the gradients of every rank are averaged as
FSDP/DDP average them. Responses have unequal lengths, the case where a per-micro-batch mean
weighted by rows (the old scheme) gets the weighting wrong.
"""

import pytest
import torch
from torch import nn

from hybridflow.rlmath import aggregation
from hybridflow.rlmath.aggregation import LossNormalizer, aggregate, local_counts
from hybridflow.rlmath.objectives import actor_objective
from hybridflow.spec import AlgorithmSpec

pytestmark = pytest.mark.unit

ROWS, LENGTH, VOCAB = 8, 6, 11
LENGTHS = [1, 6, 2, 5, 3, 6, 1, 4]  # valid response tokens per row


class TinyPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 5)
        self.head = nn.Linear(5, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(tokens)))
        log_probs = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        probs = torch.softmax(logits, -1)
        entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        return log_probs, entropy


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(LENGTH)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    return {
        "tokens": torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
        "old": -torch.rand(ROWS, LENGTH, generator=g) * 3,
        "ref": -torch.rand(ROWS, LENGTH, generator=g) * 3,
        "adv": torch.randn(ROWS, LENGTH, generator=g),
        "mask": mask,
    }


def _algo(mode: str) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate(
        {
            "name": "grpo",
            "samplesPerPrompt": 2,
            "entropyCoef": 0.1,
            "kl": {"coef": 0.2},
            "lossAggregation": mode,
        }
    )


def _loss(
    model: TinyPolicy, algo: AlgorithmSpec, rows: slice, normalizer: LossNormalizer | None
) -> torch.Tensor:
    d = _data()
    log_probs, entropy = model(d["tokens"][rows])
    loss, _ = actor_objective(
        algo,
        log_probs,
        entropy,
        old_log_probs=d["old"][rows],
        advantages=d["adv"][rows],
        response_mask=d["mask"][rows],
        ref_log_probs=d["ref"][rows],
        normalizer=normalizer,
    )
    return loss


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _split_gradient(mode: str, dp: int, micro: int, *, old_scheme: bool = False) -> list[torch.Tensor]:
    """Each DP rank accumulates over its micro-batches; the ranks' gradients are then averaged."""
    algo, mask = _algo(mode), _data()["mask"]
    rows_per_rank = ROWS // dp
    counts = torch.tensor(
        [local_counts(mask[r * rows_per_rank : (r + 1) * rows_per_rank]) for r in range(dp)]
    )
    tokens, sequences = counts.sum(0).tolist()  # what the DP all-reduce returns to every rank
    normalizer = LossNormalizer(tokens=tokens, sequences=sequences, dp_size=dp)
    per_rank = []
    for rank in range(dp):
        model = TinyPolicy()
        start = rank * rows_per_rank
        for first in range(start, start + rows_per_rank, micro):
            rows = slice(first, min(first + micro, start + rows_per_rank))
            if old_scheme:  # the micro-batch's own mean, weighted by its share of the rank's rows
                loss = _loss(model, algo, rows, None) * (rows.stop - rows.start) / rows_per_rank
            else:
                loss = _loss(model, algo, rows, normalizer)
            loss.backward()
        per_rank.append(_grads(model))
    return [torch.stack(parts).mean(0) for parts in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("mode", aggregation.LOSS_AGGREGATIONS)
@pytest.mark.parametrize(("dp", "micro"), [(1, 8), (1, 4), (1, 2), (2, 4), (2, 2), (2, 1)])
def test_gradient_of_a_mini_batch_does_not_depend_on_micro_batches_or_dp(
    mode: str, dp: int, micro: int
) -> None:
    whole = TinyPolicy()
    _loss(whole, _algo(mode), slice(0, ROWS), None).backward()
    expected = _grads(whole)
    for got, want in zip(_split_gradient(mode, dp, micro), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_per_micro_batch_mean_weighted_by_rows_would_get_unequal_lengths_wrong() -> None:
    """Guards the test above: with unequal lengths the old weighting really differs."""
    whole = TinyPolicy()
    _loss(whole, _algo("token-mean"), slice(0, ROWS), None).backward()
    old = _split_gradient("token-mean", 2, 2, old_scheme=True)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(old, _grads(whole), strict=True))


def test_modes_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean") == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(values, mask, "seq-mean-token-sum") == pytest.approx((6 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
    share = aggregate(values, mask, "token-mean", LossNormalizer(tokens=10, sequences=5, dp_size=2))
    assert share == pytest.approx(10 * 2 / 10)
    assert aggregate(values, torch.zeros_like(mask), "seq-mean-token-mean") == 0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(values, mask, "sum")  # type: ignore[arg-type]
