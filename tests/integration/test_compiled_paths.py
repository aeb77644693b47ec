"""torch.compile on the hot paths (``rollout.compile``, ``training.compile``) against eager, on the tiny model.

No Ray; each case compiles once (seconds to tens of seconds on 2 cores), so they live in the
integration tier. The tolerance: compiled kernels reassociate floating-point sums, so log-probs
may differ from eager by a few ulps of their magnitude (1e-4 absolute, measured 5e-7), and
greedy tokens are equal.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.backends.fsdp import load_causal_lm, shard_model, token_logprobs_and_entropy
from hybridflow.backends.fsdp.parallelize import compile_regions
from hybridflow.compilation import compile_cache_counters, use_compile_cache
from hybridflow.engines import SamplingParams
from hybridflow.engines.torch_engine import TorchRolloutEngine
from hybridflow.models import build_tiny_model, write_tiny_model
from hybridflow.spec.training import DEFAULT_FSDP_UNIT_MIN_PARAMETERS

pytestmark = pytest.mark.integration

LOG_PROB_TOLERANCE = 1e-4
PROMPTS = [list(b"Hello"), [257, *b"user\n", 10], list(b"The quick brown fox")]
OTHER_PROMPTS = [list(b"Hi"), list(b"a longer prompt than those"), list(b"xyz")]


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A compile cache of this module's own (as a job's checkpoint volume holds one), not the user's."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    directory = use_compile_cache(tmp_path_factory.mktemp("checkpoints"))
    yield directory
    if saved is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def test_compiled_decoding_equals_eager_and_keeps_one_shape(compile_cache: Path) -> None:
    from torch._dynamo.utils import counters

    # One layer: each fused kernel is a C++ build on CPU, and a second layer proves nothing more.
    eager = TorchRolloutEngine(build_tiny_model("qwen2", 384, layers=1, seed=1), eos_token_ids=[])
    compiled = TorchRolloutEngine(
        build_tiny_model("qwen2", 384, layers=1, seed=1),
        eos_token_ids=[],
        compile_decode=True,
        cache_width=48,
    )
    params = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for prompts in (PROMPTS, OTHER_PROMPTS):  # other prompt widths: the same decode shape
        expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
        assert got.response_token_ids == expected.response_token_ids
        assert expected.logprobs is not None and got.logprobs is not None
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=LOG_PROB_TOLERANCE, rtol=0
        )
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one compile served both calls
    assert compiled.compile_seconds > 0 and eager.compile_seconds == 0
    assert any(compile_cache.iterdir())  # inductor wrote into the job's cache
    with pytest.raises(ValueError, match="more than the engine's cache_width=48"):
        compiled.generate([list(range(40))], params)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _scores_and_gradients(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    input_ids = torch.randint(0, 300, (6, 14))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # a left-padded row
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    model.train()
    log_probs, entropy = token_logprobs_and_entropy(
        model, input_ids, attention_mask, position_ids, response_len=5
    )
    assert entropy is not None
    ((-0.7 * log_probs - 0.01 * entropy) * attention_mask[:, -5:]).sum().backward()
    grads = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        grad = parameter.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return log_probs.detach(), grads


@pytest.mark.usefixtures("world_of_one")
def test_compiled_fsdp_training_equals_eager(tmp_path: Path) -> None:
    """The tiny model's layers join the root FSDP unit: the decoder body compiles as one graph (one
    layer keeps its C++ builds few); the per-layer regions run the same code on smaller graphs
    (which regions each layout gets: the test below)."""
    model_dir = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=3, layers=1)
    cpu = torch.device("cpu")
    eager = shard_model(load_causal_lm(model_dir), device=cpu)
    compiled = shard_model(load_causal_lm(model_dir), device=cpu, compile_forward=True)
    # Compiling replaces forward methods only: the parameters and their names are the model's.
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]
    misses_before = compile_cache_counters()["misses"]
    expected_scores, expected_grads = _scores_and_gradients(eager)
    scores, grads = _scores_and_gradients(compiled)
    assert compile_cache_counters()["misses"] > misses_before  # it did compile
    torch.testing.assert_close(scores, expected_scores, atol=LOG_PROB_TOLERANCE, rtol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("unit_min_parameters", "regions"),
    [(DEFAULT_FSDP_UNIT_MIN_PARAMETERS, ["model"]), (0, ["model.layers.0", "model.layers.1"])],
    ids=["layers-in-the-root-unit", "a-unit-per-layer"],
)
def test_compiled_regions_leave_fsdp_units_whole(
    tmp_path: Path, unit_min_parameters: int, regions: list[str]
) -> None:
    """Compiling replaces forwards of modules with no FSDP unit inside: the decoder body when the
    layers share the root unit, each layer when they are units; nothing compiles until a forward."""
    model_dir = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=3)
    cpu = torch.device("cpu")
    model = shard_model(load_causal_lm(model_dir), device=cpu, unit_min_parameters=unit_min_parameters)
    names = [name for name, _ in model.named_parameters()]
    assert compile_regions(model, device=cpu, layers_are_units=unit_min_parameters == 0) == regions
    modules = dict(model.named_modules())
    for region in regions:
        assert type(modules[region].__dict__["forward"]).__name__ == "function"  # torch.compile's wrapper
        # A layer that is a unit keeps its FSDP hooks in __call__, outside the compiled forward.
        assert isinstance(modules[region], FSDPModule) == (unit_min_parameters == 0)
    assert [name for name, _ in model.named_parameters()] == names  # weights keep their names
