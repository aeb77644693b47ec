"""Chunked log-probs/entropy equal the whole-tensor computation, values and gradients."""

import pytest
import torch

from hybridflow.rlmath.core import entropy_from_logits
from hybridflow.rlmath.logits import token_logprobs_and_entropy_from_logits

pytestmark = pytest.mark.unit


def _plain(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float() / temperature
    return torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_logits(z)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_equal_the_whole_tensor_in_values_and_gradients(chunk_tokens: int, temperature: float) -> None:
    torch.manual_seed(0)
    base = torch.randn(3, 7, 13) * 4
    base[0, 0, 2] = float("-inf")  # a masked vocabulary entry stays finite
    targets = torch.randint(0, 13, (3, 7))
    targets[0, 0] = 1
    weights = torch.randn(3, 7)

    plain_logits = base.clone().requires_grad_(True)
    lp, ent = _plain(plain_logits, targets, temperature)
    ((lp * weights).sum() + (ent * weights).sum()).backward()

    chunked_logits = base.clone().requires_grad_(True)
    clp, cent = token_logprobs_and_entropy_from_logits(
        chunked_logits, targets, temperature=temperature, chunk_tokens=chunk_tokens
    )
    assert cent is not None and clp.dtype == torch.float32
    ((clp * weights).sum() + (cent * weights).sum()).backward()
    torch.testing.assert_close(clp, lp)
    torch.testing.assert_close(cent, ent)
    torch.testing.assert_close(chunked_logits.grad, plain_logits.grad)


def test_bf16_logits_give_fp32_results_and_entropy_is_optional() -> None:
    logits = torch.randn(2, 4, 9).to(torch.bfloat16)
    targets = torch.randint(0, 9, (2, 4))
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy_from_logits(logits, targets, with_entropy=False, chunk_tokens=3)
    assert ent is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp, _plain(logits, targets, 1.0)[0])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs_and_entropy_from_logits(logits, targets, chunk_tokens=0)


@pytest.mark.parametrize("chunk_tokens", [5, 1000])
def test_entropy_without_grad_is_a_metric_and_log_prob_gradients_are_unchanged(chunk_tokens: int) -> None:
    torch.manual_seed(1)
    base = torch.randn(3, 7, 13) * 3
    targets = torch.randint(0, 13, (3, 7))
    weights = torch.randn(3, 7)

    plain_logits = base.clone().requires_grad_(True)
    lp, ent = _plain(plain_logits, targets, 0.8)
    (lp * weights).sum().backward()  # the entropy takes no part in the loss

    logits = base.clone().requires_grad_(True)
    clp, cent = token_logprobs_and_entropy_from_logits(
        logits, targets, temperature=0.8, entropy_grad=False, chunk_tokens=chunk_tokens
    )
    assert cent is not None and cent.grad_fn is None and not cent.requires_grad
    assert clp.requires_grad
    (clp * weights).sum().backward()
    torch.testing.assert_close(cent, ent.detach())
    torch.testing.assert_close(clp, lp)
    torch.testing.assert_close(logits.grad, plain_logits.grad)


def test_a_single_chunk_is_not_recomputed_and_several_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointing recomputes each chunk's softmax in backward; one chunk gains no memory from it."""
    base = torch.randn(2, 6, 11)
    targets = torch.randint(0, 11, (2, 6))
    real_log_softmax = torch.log_softmax
    calls = []
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or real_log_softmax(*a, **k))
    for chunk_tokens, expected in ((12, 1), (4, 6)):  # 1 chunk: 1 call; 3 chunks: 3 + 3 recomputed
        calls.clear()
        logits = base.clone().requires_grad_(True)
        lp, _ = token_logprobs_and_entropy_from_logits(
            logits, targets, with_entropy=False, chunk_tokens=chunk_tokens
        )
        lp.sum().backward()
        assert len(calls) == expected, (chunk_tokens, len(calls))
