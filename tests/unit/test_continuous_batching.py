"""The torch engine's continuous batcher against the batch engine: same tokens, whatever shares the slots."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import PreTrainedModel

from hybridflow.engines import SamplingParams
from hybridflow.engines.continuous import (
    ContinuousBatcher,
    GenerationRequest,
    RequestResult,
    continuation_of,
)
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.models import PAD_TOKEN_ID, build_tiny_model

pytestmark = pytest.mark.unit

VOCAB = 384
PROMPTS = [list(b"Hello"), [257, *b"user\n", 10], list(b"The quick brown fox"), list(b"ab")]
NEW_TOKENS = 12
MAX_SEQUENCE = 20 + NEW_TOKENS


def tiny(arch: str = "qwen2") -> PreTrainedModel:
    return build_tiny_model(arch, VOCAB, seed=3)  # type: ignore[arg-type]


def batcher(model: PreTrainedModel, slots: int, max_sequence: int = MAX_SEQUENCE) -> ContinuousBatcher:
    engine = TorchRolloutEngine(model)
    return ContinuousBatcher(
        model,
        slots=slots,
        max_sequence=max_sequence,
        eos_token_ids=engine.eos_token_ids,
        pad_token_id=PAD_TOKEN_ID,
    )


def serve(
    b: ContinuousBatcher, requests: list[GenerationRequest], *, add_every: int = 0
) -> dict[str, RequestResult]:
    """Runs ``b`` until every request ended; with ``add_every`` > 0 the requests arrive one per that many steps."""
    results: dict[str, RequestResult] = {}
    queue = list(requests)
    steps = 0
    while queue or b.busy:
        if queue and (add_every == 0 or steps % add_every == 0):
            for _ in range(len(queue) if add_every == 0 else 1):
                b.add(queue.pop(0))
        b.step()
        steps += 1
        for done in b.take_finished():
            results[done.request.request_id] = done
        assert steps < 10_000
    return results


def request(index: int, params: SamplingParams) -> GenerationRequest:
    return GenerationRequest(f"r{index}", PROMPTS[index % len(PROMPTS)], params)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(("slots", "add_every"), [(8, 0), (3, 0), (2, 3)])
def test_greedy_tokens_equal_the_batch_engine_whatever_the_slots_and_arrivals(
    arch: str, slots: int, add_every: int
) -> None:
    """Fewer slots than samples (slots are reused) and staggered arrivals change nothing."""
    model = tiny(arch)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, n=2, return_logprobs=True)
    expected = TorchRolloutEngine(model).generate(PROMPTS, params)
    results = serve(
        batcher(model, slots), [request(i, params) for i in range(len(PROMPTS))], add_every=add_every
    )
    for index in range(len(PROMPTS)):
        for sample in range(2):
            got = results[f"r{index}"].samples[sample]
            row = index * 2 + sample
            assert got.token_ids == expected.response_token_ids[row]
            assert got.finish_reason == expected.finish_reasons[row]
            assert expected.logprobs is not None
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs[row]), atol=1e-4)


def test_the_column_clock_wraps_many_times_without_changing_a_token() -> None:
    """A narrow cache (max_sequence just above the longest request) compacts every few steps."""
    model = tiny()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, n=1)
    expected = TorchRolloutEngine(model).generate(PROMPTS * 3, params)
    b = batcher(model, 2, max_sequence=max(map(len, PROMPTS)) + NEW_TOKENS)
    requests = [
        GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], params) for i in range(3 * len(PROMPTS))
    ]
    results = serve(b, requests, add_every=2)
    assert [
        results[f"r{i}"].samples[0].token_ids for i in range(len(requests))
    ] == expected.response_token_ids
    assert b.tokens_generated == sum(map(len, expected.response_token_ids))


def test_a_seeded_sample_draws_the_same_tokens_alone_or_in_a_crowd() -> None:
    model = tiny()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=3, seed=11)
    alone = serve(batcher(model, 4), [GenerationRequest("x", PROMPTS[2], params)])["x"]
    others = [request(i, SamplingParams(max_new_tokens=NEW_TOKENS, n=2, seed=i)) for i in range(3)]
    crowd = serve(batcher(model, 5), [*others, GenerationRequest("x", PROMPTS[2], params)], add_every=2)["x"]
    assert [s.token_ids for s in crowd.samples] == [s.token_ids for s in alone.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # the samples differ from each other


def test_an_aborted_request_continues_to_the_tokens_it_would_have_drawn() -> None:
    """Abort midway, continue on a fresh batcher (another replica): the same tokens, versions per token."""
    model = tiny()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=5, return_logprobs=True)
    uninterrupted = serve(batcher(model, 4), [GenerationRequest("x", PROMPTS[0], params)])["x"]

    first = batcher(model, 4)
    first.add(GenerationRequest("x", PROMPTS[0], params))
    for _ in range(4):
        first.step()
    (aborted,) = first.abort()
    assert not first.busy and {s.finish_reason for s in aborted.samples} == {"abort"}
    assert all(len(s.token_ids) == 4 and s.versions == [0] * 4 for s in aborted.samples)
    continuation = continuation_of(aborted)
    assert continuation is not None
    second = batcher(model, 4)
    second.version = 1
    resumed = serve(second, [continuation])["x"]
    for got, want in zip(resumed.samples, uninterrupted.samples, strict=True):
        assert got.token_ids == want.token_ids
        assert got.versions == [0] * 4 + [1] * (len(got.token_ids) - 4)
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4)


def test_tokens_record_the_version_of_the_forward_that_produced_their_logits() -> None:
    model = tiny()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, n=1)
    b = batcher(model, 2)
    b.add(GenerationRequest("x", PROMPTS[2], params))
    b.step()  # prefill (version 0), draws token 1, decodes (version 0)
    b.version = 7  # a weight load between two steps
    b.step()  # draws token 2 from the version-0 decode, decodes with version 7
    results = serve(b, [])
    versions = results["x"].samples[0].versions
    assert versions[:2] == [0, 0] and set(versions[2:]) == {7}


def test_bad_requests_name_the_request_and_the_limit() -> None:
    b = batcher(tiny(), 2, max_sequence=16)
    with pytest.raises(ValueError, match="max_sequence"):
        b.add(GenerationRequest("long", list(b"far too long a prompt"), SamplingParams(max_new_tokens=4)))
    b.add(GenerationRequest("ok", list(b"hi"), SamplingParams(max_new_tokens=4)))
    with pytest.raises(ValueError, match="request ok is already being served"):
        b.add(GenerationRequest("ok", list(b"hi"), SamplingParams(max_new_tokens=4)))


def test_the_counter_based_draws_follow_the_distribution_and_never_pick_a_filtered_token() -> None:
    from hybridflow.engines.continuous import counter_uniforms, draw_from

    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    uniforms = counter_uniforms(list(range(20_000)), [7] * 20_000)
    assert float(uniforms.min()) >= 0.0 and float(uniforms.max()) < 1.0
    counts = torch.bincount(draw_from(probs, uniforms), minlength=4).double() / 20_000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64), atol=0.015)
    assert counts[3] == 0
    # The same key and counter draw the same number; another counter another one.
    again = counter_uniforms([3, 3], [5, 6])
    assert float(again[0]) == float(counter_uniforms([3], [5])[0]) and float(again[0]) != float(again[1])


def test_the_pad_token_is_never_drawn_greedy_or_sampled() -> None:
    model = tiny()
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[PAD_TOKEN_ID] = 30.0  # the pad is the most likely token everywhere
    model.lm_head = biased
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=3, seed=4)
    results = serve(batcher(model, slots=3), [request(0, greedy), request(1, sampled)])
    tokens = [sample.token_ids for result in results.values() for sample in result.samples]
    assert len(tokens) == 4 and all(tokens) and all(PAD_TOKEN_ID not in t for t in tokens)
