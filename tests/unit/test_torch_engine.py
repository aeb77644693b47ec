"""The pure-torch rollout engine against HF generate and a full forward pass; the trainer's tensor layout."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from hybridflow.engines import (
    EngineStateError,
    RolloutOutput,
    SamplingParams,
    response_tensors,
)
from hybridflow.engines.base import unsampled_token, without_token
from hybridflow.engines.torch_engine import TorchRolloutEngine, choose_next_tokens
from hybridflow.models import PAD_TOKEN_ID, build_tiny_model, write_tiny_model

pytestmark = pytest.mark.unit

VOCAB = 384
ARCHS = ["qwen2", "llama"]
# Different lengths, so left padding and per-row positions matter; one starts with a special token.
PROMPTS = [
    list(b"Hello"),
    [257, *b"user\n", 10],
    list(b"The quick brown fox"),
]
NEW_TOKENS = 10


def tiny(arch: str, seed: int = 1) -> PreTrainedModel:
    return build_tiny_model(arch, VOCAB, seed=seed)  # type: ignore[arg-type]


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int, eos_ids: list[int]) -> list[list[int]]:
    """``model.generate(do_sample=False)`` on left-padded prompts, the pad token suppressed unless
    it is an eos token; each row cut after its first eos."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=PAD_TOKEN_ID,
        suppress_tokens=None if PAD_TOKEN_ID in eos_ids else [PAD_TOKEN_ID],  # as the engine
    )
    rows = []
    for tokens in generated[:, width:].tolist():
        stop = next((i for i, token in enumerate(tokens) if token in eos_ids), len(tokens) - 1)
        rows.append(tokens[: stop + 1])
    return rows


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=7)


# --------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate_on_left_padded_batch(arch: str) -> None:
    model = tiny(arch)
    engine = TorchRolloutEngine(model)
    output = engine.generate(PROMPTS, GREEDY)
    assert output.response_token_ids == hf_greedy(model, PROMPTS, NEW_TOKENS, engine.eos_token_ids)
    assert all(len(r) == NEW_TOKENS for r in output.response_token_ids)  # a random model rarely stops
    assert output.logprobs is None


@pytest.mark.parametrize("arch", ARCHS)
def test_each_row_stops_at_its_own_eos(arch: str) -> None:
    model = tiny(arch)
    free_run = TorchRolloutEngine(model).generate(PROMPTS, GREEDY).response_token_ids
    eos = free_run[0][3]  # make prompt 0's fourth token an eos
    engine = TorchRolloutEngine(model, eos_token_ids=[eos])
    output = engine.generate(PROMPTS, GREEDY)
    stop = free_run[0].index(eos)
    assert output.response_token_ids[0] == free_run[0][: stop + 1]
    assert output.finish_reasons[0] == "stop"
    assert output.response_token_ids == hf_greedy(model, PROMPTS, NEW_TOKENS, [eos])
    for row, tokens in enumerate(output.response_token_ids):
        assert (output.finish_reasons[row] == "stop") == (eos in tokens)
        assert eos not in tokens[:-1]


def test_batched_rows_equal_each_prompt_decoded_alone() -> None:
    engine = TorchRolloutEngine(tiny("qwen2"))
    batched = engine.generate(PROMPTS, GREEDY).response_token_ids
    alone = [engine.generate([prompt], GREEDY).response_token_ids[0] for prompt in PROMPTS]
    assert batched == alone


def test_positions_count_real_tokens_in_prefill_and_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    # RoPE only sees position differences, so parity tests cannot catch positions shifted by the
    # padding; watch what the engine feeds the model instead.
    model = tiny("qwen2")
    fed: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = model.forward

    def recording_forward(*args: object, **kwargs: torch.Tensor) -> object:
        fed.append((kwargs["position_ids"].clone(), kwargs["attention_mask"].clone()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    prompts = [[5, 6], [7, 8, 9, 10]]
    TorchRolloutEngine(model, eos_token_ids=[]).generate(
        prompts, SamplingParams(max_new_tokens=3, temperature=0)
    )
    (prefill_positions, prefill_mask), *decode_steps = fed
    assert prefill_positions.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert prefill_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert [positions.tolist() for positions, _ in decode_steps] == [[[2], [4]], [[3], [5]]]
    assert [mask.shape[1] for _, mask in decode_steps] == [5, 6]


def test_engine_loads_a_model_directory(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny", arch="llama", seed=1, vocab_size=VOCAB)
    from_directory = TorchRolloutEngine(path).generate(PROMPTS, GREEDY)
    in_memory = TorchRolloutEngine(tiny("llama")).generate(PROMPTS, GREEDY)
    assert from_directory.response_token_ids == in_memory.response_token_ids
    with pytest.raises(FileNotFoundError, match="local paths only"):
        TorchRolloutEngine(tmp_path / "missing")


# --------------------------------------------------------------------------- weights and lifecycle


@pytest.mark.parametrize("arch", ARCHS)
def test_load_weights_switches_to_the_other_models_outputs(arch: str) -> None:
    engine = TorchRolloutEngine(tiny(arch, seed=1))
    other = tiny(arch, seed=2)
    before = engine.generate(PROMPTS, GREEDY).response_token_ids
    engine.load_weights(other.state_dict().items())
    after = engine.generate(PROMPTS, GREEDY).response_token_ids
    assert after != before
    assert after == hf_greedy(other, PROMPTS, NEW_TOKENS, engine.eos_token_ids)


def test_load_weights_accepts_streamed_buckets_and_rejects_unknown_names_and_shapes() -> None:
    engine = TorchRolloutEngine(tiny("qwen2", seed=1))
    other = tiny("qwen2", seed=2).state_dict()
    names = list(other)
    engine.load_weights((name, other[name].to(torch.bfloat16).float()) for name in names[:5])
    engine.load_weights((name, other[name]) for name in names[5:])
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], other["lm_head.weight"])
    with pytest.raises(
        ValueError, match=r"no parameter 'model.layers.0.mlp.up_proj.weights'.*up_proj.weight'"
    ):
        engine.load_weights(
            [("model.layers.0.mlp.up_proj.weights", other["model.layers.0.mlp.up_proj.weight"])]
        )
    with pytest.raises(
        ValueError, match=r"'lm_head.weight' has shape \(384, 64\) in the model, got \(2, 2\)"
    ):
        engine.load_weights([("lm_head.weight", torch.zeros(2, 2))])


def test_sleep_wake_up_and_close_follow_the_lifecycle() -> None:
    model = tiny("qwen2")
    model.train()
    with TorchRolloutEngine(model) as engine:
        before = engine.generate(PROMPTS, GREEDY)
        assert model.training  # generate restores the caller's mode
        engine.sleep()
        engine.sleep()
        assert engine.state == "asleep"
        with pytest.raises(EngineStateError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(EngineStateError, match="asleep"):
            engine.load_weights([])
        engine.wake_up()
        engine.wake_up()
        assert engine.generate(PROMPTS, GREEDY) == before  # weights survive sleep
    assert engine.state == "closed"
    with pytest.raises(EngineStateError, match="closed"):
        engine.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineStateError, match="closed"):
        engine.wake_up()
    engine.close()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_sleep_level_2_discards_the_weights_until_a_sync_restores_them(device: str) -> None:
    """A per-step sync reloads every weight: level 2 frees the device copy instead of moving it to the host."""
    model = tiny("qwen2").to(device)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = TorchRolloutEngine(model)
    before = engine.generate(PROMPTS, GREEDY)
    if device == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
    engine.sleep(level=2)
    if device == "cuda":
        assert allocated - torch.cuda.memory_allocated() >= parameter_bytes  # released, not moved
    assert all(p.device.type == device for p in model.parameters())  # nothing went to the host
    engine.wake_up()
    with pytest.raises(
        EngineStateError, match=r"discarded the weights and \d+ parameters have not been loaded"
    ):
        engine.generate(PROMPTS, GREEDY)
    names = list(state)
    engine.load_weights((name, state[name]) for name in names[: len(names) // 2])
    with pytest.raises(EngineStateError, match="discarded"):
        engine.generate(PROMPTS, GREEDY)  # half a sync is not enough
    # A level-1 sleep now moves the loaded half to the host; waking brings it back and re-creates
    # the still-empty half on the device, for the rest of the sync.
    engine.sleep()
    engine.wake_up()
    assert all(p.device.type == device for p in model.parameters())
    engine.load_weights((name, state[name]) for name in names[len(names) // 2 :])
    assert engine.generate(PROMPTS, GREEDY) == before
    with pytest.raises(ValueError, match=r"levels are 1 \(to host memory\) and 2 \(discard\)"):
        engine.sleep(level=3)


def test_bad_prompts_are_rejected_with_the_row() -> None:
    engine = TorchRolloutEngine(tiny("llama"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], GREEDY)
    with pytest.raises(
        ValueError, match=r"prompt 0 holds token id 384, outside the model's vocabulary \[0, 384\)"
    ):
        engine.generate([[1, 384]], GREEDY)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        engine.generate([[1] * 510], GREEDY)
    assert engine.generate([], GREEDY) == RolloutOutput([], [], None)


# --------------------------------------------------------------------------- sampling


def test_sampling_with_a_seed_is_reproducible_and_n_samples_are_interleaved() -> None:
    engine = TorchRolloutEngine(tiny("qwen2"))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=3, seed=11)
    first = engine.generate(PROMPTS[:2], params)
    assert len(first) == 6
    assert engine.generate(PROMPTS[:2], params) == first
    assert engine.generate(PROMPTS[:2], dataclasses.replace(params, seed=12)) != first
    # n samples of prompt i are rows i*n .. i*n+n-1: the same as repeating each prompt n times.
    repeated = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    single = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=1, seed=11)
    assert engine.generate(repeated, single) == first
    assert len({tuple(r) for r in first.response_token_ids[:3]}) > 1  # the samples differ


def test_greedy_n_samples_are_copies_and_top_k_1_or_tiny_top_p_is_greedy() -> None:
    engine = TorchRolloutEngine(tiny("llama"))
    greedy = engine.generate(PROMPTS, GREEDY).response_token_ids
    doubled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, n=2))
    assert doubled.response_token_ids == [r for r in greedy for _ in range(2)]
    for params in (
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1, seed=0),
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1e-6, seed=0),
    ):
        assert engine.generate(PROMPTS, params).response_token_ids == greedy


def _record_forward_rows(monkeypatch: pytest.MonkeyPatch, model: Any) -> list[int]:
    """The number of rows of every forward call ``model`` makes from now on."""
    rows: list[int] = []
    forward = model.forward

    def recording_forward(*args: object, **kwargs: torch.Tensor) -> object:
        rows.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    return rows


def test_prefill_runs_each_prompt_once_and_its_samples_decode_from_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny("qwen2")
    engine = TorchRolloutEngine(model)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=3, seed=5, return_logprobs=True)
    per_row = engine.generate(
        [prompt for prompt in PROMPTS for _ in range(3)], dataclasses.replace(params, n=1)
    )
    rows = _record_forward_rows(monkeypatch, model)
    shared = engine.generate(PROMPTS, params)
    assert rows[0] == len(PROMPTS)  # the prefill: one row per prompt
    assert set(rows[1:]) == {3 * len(PROMPTS)}  # decoding: one row per sample
    assert shared.response_token_ids == per_row.response_token_ids
    assert shared.logprobs is not None and per_row.logprobs is not None
    for got, expected in zip(shared.logprobs, per_row.logprobs, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)


def test_a_sliding_window_model_prefills_every_row_and_matches_hf_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sliding-window layer's dynamic cache keeps only its window, so it cannot be copied into
    # the static cache's prompt columns; the engine falls back to one prefill row per sample.
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=0, eos_token_id=258, pad_token_id=PAD_TOKEN_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    engine = TorchRolloutEngine(model)
    rows = _record_forward_rows(monkeypatch, model)
    output = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, n=2))
    assert rows[:2] == [len(PROMPTS), 2 * len(PROMPTS)]  # the shared prefill, then the per-row one
    repeated = [prompt for prompt in PROMPTS for _ in range(2)]
    assert output.response_token_ids == hf_greedy(model, repeated, 6, engine.eos_token_ids)


def test_top_k_and_top_p_keep_the_expected_tokens() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: the nucleus of 0.6 is {0, 1}; of 0.5, {0} alone.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    generator = torch.Generator().manual_seed(0)

    def drawn(params: SamplingParams) -> set[int]:
        return set(choose_next_tokens(logits, params, generator).tolist())

    assert drawn(SamplingParams(max_new_tokens=1)) == {0, 1, 2, 3}
    assert drawn(SamplingParams(max_new_tokens=1, top_k=2)) == {0, 1}
    assert drawn(SamplingParams(max_new_tokens=1, top_p=0.6)) == {0, 1}
    assert drawn(SamplingParams(max_new_tokens=1, top_p=0.5)) == {0}
    assert drawn(SamplingParams(max_new_tokens=1, top_k=3, top_p=0.99)) == {0, 1, 2}


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_equal_a_full_forward_pass_at_the_chosen_tokens(arch: str) -> None:
    model = tiny(arch)
    engine = TorchRolloutEngine(model)
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9, n=2, seed=3, return_logprobs=True
    )
    output = engine.generate(PROMPTS, params)
    assert output.logprobs is not None
    prompt_width, response_width = 24, NEW_TOKENS
    packed = response_tensors(PROMPTS, output, PAD_TOKEN_ID, prompt_width, response_width)
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            position_ids=packed["position_ids"],
        ).logits
    # The logits at column P + t - 1 predict response token t.
    predicting = logits[:, prompt_width - 1 : prompt_width + response_width - 1].float()
    expected = predicting.log_softmax(-1).gather(-1, packed["responses"][..., None]).squeeze(-1)
    valid = packed["response_mask"].bool()
    assert torch.allclose(packed["rollout_log_probs"][valid], expected[valid], atol=1e-5, rtol=0)
    assert (packed["rollout_log_probs"][~valid] == 0).all()


# --------------------------------------------------------------------------- the pad token


def pad_loving(arch: str) -> PreTrainedModel:
    """A tiny model whose most likely next token is always the pad token (a bias of 30 on its logit)."""
    model = tiny(arch)
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[PAD_TOKEN_ID] = 30.0
    model.lm_head = biased
    return model


def test_only_a_pad_that_is_not_an_eos_is_banned_and_only_from_the_choice() -> None:
    assert unsampled_token(5, [1, 2]) == 5
    assert unsampled_token(2, [1, 2]) is None  # pad == eos (Qwen's <|endoftext|>): it must stay
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    banned = without_token(logits, 1)
    assert banned[:, 1].isneginf().all() and torch.equal(banned[:, [0, 2]], logits[:, [0, 2]])
    assert logits[0, 1] == 3.0  # a copy: the log-probs are taken from the unmasked logits
    assert without_token(logits, None) is logits and without_token(logits, 99) is logits


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_that_prefers_pad_never_gets_it_and_its_logprobs_stay_the_policys(arch: str) -> None:
    model = pad_loving(arch)
    engine = TorchRolloutEngine(model)
    assert PAD_TOKEN_ID not in engine.eos_token_ids
    greedy = engine.generate(PROMPTS, GREEDY)
    sampled = engine.generate(PROMPTS, dataclasses.replace(SAMPLED, n=4, return_logprobs=True))
    assert all(PAD_TOKEN_ID not in row for row in greedy.response_token_ids + sampled.response_token_ids)
    assert greedy.response_token_ids == hf_greedy(model, PROMPTS, NEW_TOKENS, engine.eos_token_ids)
    assert sampled.logprobs is not None  # the pad keeps its mass: every other token is unlikely
    assert max(max(row) for row in sampled.logprobs) < -10
    as_eos = TorchRolloutEngine(model, eos_token_ids=[PAD_TOKEN_ID], pad_token_id=PAD_TOKEN_ID)
    assert as_eos.generate(PROMPTS, GREEDY).response_token_ids == [[PAD_TOKEN_ID]] * len(PROMPTS)


# --------------------------------------------------------------------------- parameters and layout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k=0"),
        ({"n": 0}, "n=0"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs: dict[str, float], message: str) -> None:
    arguments: dict[str, float] = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**arguments)  # type: ignore[arg-type]


def test_layout_left_pads_prompts_right_pads_responses_and_counts_positions() -> None:
    prompts = [[11, 12], [21, 22, 23]]
    output = RolloutOutput(
        response_token_ids=[[1], [2, 3, 4], [5, 6], []],  # n = 2, interleaved
        finish_reasons=["stop", "length", "stop", "stop"],
        logprobs=[[-0.1], [-0.2, -0.3, -0.4], [-0.5, -0.6], []],
    )
    packed = response_tensors(prompts, output, pad_id=0, max_prompt_len=4, max_response_len=3)
    assert packed["input_ids"].tolist() == [
        [0, 0, 11, 12, 1, 0, 0],
        [0, 0, 11, 12, 2, 3, 4],
        [0, 21, 22, 23, 5, 6, 0],
        [0, 21, 22, 23, 0, 0, 0],
    ]
    assert packed["attention_mask"].tolist() == [
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 1, 0],
        [0, 1, 1, 1, 0, 0, 0],
    ]
    assert packed["position_ids"].tolist() == [
        [0, 0, 0, 1, 2, 3, 4],
        [0, 0, 0, 1, 2, 3, 4],
        [0, 0, 1, 2, 3, 4, 5],
        [0, 0, 1, 2, 3, 4, 5],
    ]
    assert packed["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert torch.equal(packed["prompts"], packed["input_ids"][:, :4])
    assert torch.equal(packed["responses"], packed["input_ids"][:, 4:])
    assert packed["rollout_log_probs"][1].tolist() == pytest.approx([-0.2, -0.3, -0.4])
    int_fields = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask")
    assert {packed[field].dtype for field in int_fields} == {torch.long}  # type: ignore[literal-required]

    without_logprobs = RolloutOutput([[1], [2]], ["stop", "stop"])
    assert "rollout_log_probs" not in response_tensors([[7]], without_logprobs, 0, 1, 1)


def test_layout_rejects_what_it_would_have_to_cut() -> None:
    output = RolloutOutput([[1, 2, 3]], ["length"])
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens, more than max_prompt_len=2"):
        response_tensors([[1, 2, 3]], output, 0, max_prompt_len=2, max_response_len=3)
    with pytest.raises(ValueError, match="response 0 has 3 tokens, more than max_response_len=2"):
        response_tensors([[1]], output, 0, max_prompt_len=2, max_response_len=2)
    with pytest.raises(ValueError, match="3 responses for 2 prompts"):
        response_tensors([[1], [2]], RolloutOutput([[1], [2], [3]], ["stop"] * 3), 0, 2, 2)
