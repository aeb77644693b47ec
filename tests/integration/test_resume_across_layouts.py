"""A training checkpoint written at one parallel layout resumes at another and trains on identically.

The claim under test (the module docstrings of :mod:`hybridflow.backends.fsdp.checkpoint` and
:mod:`hybridflow.backends.megatron.checkpoint`): a train-state checkpoint does not depend on the
layout that wrote it, so a job restarted on a different number of GPUs, or with another
tensor-parallel size, continues the run it left off. Every run goes through the backends'
public protocol (:class:`~hybridflow.backends.api.TrainingBackend`: ``load``,
``forward_backward``, ``clip_and_step``, ``step_lr_schedule``, ``save_state``/``load_state``,
``full_state_dict``), built from an :class:`~hybridflow.spec.RLHFJobSpec` as the workers build it.

The experiment, per backend:

* layout A takes 2 optimizer steps on a fixed batch, saves, and (a) takes 2 more steps;
* layout B builds a fresh backend, loads the checkpoint and (b) takes the same 2 steps.

(b) must equal (a): the weights right after the load are the saved ones bit for bit; the LR
scheduler's counter and Adam's per-parameter step count are the saved ones (2), then 4; the
global loss and gradient norm of each continued step and the final full weights agree up to
float32 summation order (another layout sums the same gradient in another order). The losses
of step 3 check the loaded weights, step 4's and the final weights check Adam's moments and
the learning rate (a cosine schedule: a lost scheduler counter changes the step size).

The batch is the same global mini-batch at every layout: DP rank ``r`` of ``d`` trains on
rows ``[r N/d, (r+1) N/d)`` (the controller's exact DP split), in micro-batches of
``microBatchSizePerGpu``, each micro-batch's token-mean loss divided by the token count of the
whole mini-batch, all-reduced over the DP group before any forward pass, and multiplied by
``d`` because FSDP and megatron's DDP average gradients (:mod:`hybridflow.rlmath.aggregation`).
So every layout descends the same loss.

Layouts: FSDP saved by 2 data-parallel ranks, loaded by 4 and by 1 (three spawned jobs, one
per world size: FSDP shards over the whole default group). Megatron-core saved at
tensor-parallel 2 (DP 1), loaded at tensor-parallel 1 (DP 2, so the distributed optimizer's
state is also split another way); both layouts span the same two ranks, so one spawned job runs
them in turn (megatron's parallel state torn down in between, the backend rebuilt from
scratch), on CPU through ``tests/megatron_shim.py`` as in ``test_megatron_backend_distributed.py``.

Each rank records its results with ``torch.save`` and its phases' outcomes (a traceback or
``None``) in ``rank<r>.json`` (:func:`spawned_ranks.run_spawned_ranks`); the comparisons run in
this process, so a rank never asserts between collectives.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hybridflow.spec import RLHFJobSpec
from spawned_ranks import run_spawned_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

pytestmark = pytest.mark.integration

TESTS_DIR = Path(__file__).resolve().parents[1]
JOB_DEADLINE_SECONDS = 180
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)

ROWS = 8  # divisible by every DP size below, so every layout sees the same global mini-batch
MICRO_BATCH_ROWS = 2
PROMPT_WIDTH = 6
RESPONSE_WIDTH = 5
TEMPERATURE = 0.8
LEARNING_RATE = 1e-2
MAX_GRAD_NORM = 0.5  # below the first steps' gradient norms, so clipping is part of every step
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 2
TOTAL_STEPS = STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE  # the cosine schedule ends here

RELATIVE_TOLERANCE = 1e-5
ABSOLUTE_TOLERANCE = 1e-6  # for weights near zero, where a relative bound means nothing in fp32


def spec_for(model_dir: Path, *, backend: str, tensor_parallel: int) -> RLHFJobSpec:
    """The job spec a worker would build this backend from (fp32, cosine LR over 4 steps, clipping)."""
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": {
                "backend": backend,
                "tensorParallelSize": tensor_parallel,
                "totalSteps": TOTAL_STEPS,
                "promptsPerStep": ROWS // 2,
                "miniBatchSize": ROWS,
                "microBatchSizePerGpu": MICRO_BATCH_ROWS,
                "learningRate": LEARNING_RATE,
                "lrSchedule": "cosine",
                "warmupSteps": 0,
                "maxGradNorm": MAX_GRAD_NORM,
                "precision": "fp32",
                # one FSDP unit per decoder layer (the tiny model's layers would join the root unit
                # under the default), so the checkpoint holds several units' shards
                "fsdpUnitMinParameters": 1,
            },
            "rewards": [{"function": "target_char"}],
            "resourcePools": [{"name": "default", "nodes": 1, "gpusPerNode": 4}],
        }
    )


def global_batch() -> dict[str, torch.Tensor]:
    """Engine-layout rows of varied prompt and response lengths, with advantages; the same every step."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.full((ROWS, PROMPT_WIDTH + RESPONSE_WIDTH), 259)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(ROWS):
        prompt_len = 1 + row % PROMPT_WIDTH
        response_len = RESPONSE_WIDTH - row % 3
        start, end = PROMPT_WIDTH - prompt_len, PROMPT_WIDTH + response_len
        input_ids[row, start:end] = torch.randint(0, 256, (end - start,), generator=generator)
        attention_mask[row, start:end] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=-1) - 1).clamp_min(0),
        "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": attention_mask[:, PROMPT_WIDTH:].float(),
        "advantages": torch.randn(ROWS, RESPONSE_WIDTH, generator=generator),
    }


# ------------------------------------------------------------------------------ the ranks


def adam_steps(backend: Any) -> list[float]:
    """Adam's step count of every parameter (range) this rank's optimizer holds, sorted."""
    if backend.name == "megatron":
        from hybridflow.backends.megatron.optim import torch_optimizer

        optimizer = torch_optimizer(backend.optimizer)
    else:
        optimizer = backend.optimizer
    return sorted(float(state["step"]) for state in optimizer.state.values())


def train_steps(backend: Any, batch: Mapping[str, torch.Tensor], steps: int) -> list[tuple[float, float]]:
    """``steps`` worker-style updates on the global ``batch``; each step's (global loss, grad norm).

    Collective over the world (every rank, same ``batch``): this rank trains on its DP rank's
    rows; the token count and the loss are summed over the DP group.
    """
    from hybridflow.rlmath.aggregation import LossNormalizer, aggregate, local_counts

    group = backend.dp_group()
    dp_size, dp_rank = dist.get_world_size(group), dist.get_rank(group)
    rows = slice(dp_rank * ROWS // dp_size, (dp_rank + 1) * ROWS // dp_size)
    mine = {name: tensor[rows] for name, tensor in batch.items()}
    micro_batches = [
        {name: tensor[start : start + MICRO_BATCH_ROWS] for name, tensor in mine.items()}
        for start in range(0, ROWS // dp_size, MICRO_BATCH_ROWS)
    ]
    counts = torch.tensor(local_counts(mine["response_mask"]), dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    normalizer = LossNormalizer(tokens=float(counts[0]), sequences=float(counts[1]), dp_size=dp_size)

    def loss_fn(
        log_probs: torch.Tensor, entropy: torch.Tensor | None, micro: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert entropy is not None
        per_token = -micro["advantages"] * log_probs - 0.01 * entropy
        loss = aggregate(per_token, micro["response_mask"], "token-mean", normalizer)
        return loss, {"loss": loss.detach()}

    figures = []
    for _ in range(steps):
        metrics = backend.forward_backward(
            micro_batches, loss_fn, fields=["advantages", "response_mask"], temperature=TEMPERATURE
        )
        # Each share is scaled by dp_size (gradient averaging): the mini-batch's loss is the sum / d.
        loss = torch.tensor([sum(m["loss"] for m in metrics)], dtype=torch.float64)
        dist.all_reduce(loss, group=group)
        norm = backend.clip_and_step(max_grad_norm=MAX_GRAD_NORM)
        backend.step_lr_schedule()
        figures.append((float(loss[0]) / dp_size, norm))
    return figures


def build_backend(backend_name: str, model_dir: Path, tensor_parallel: int) -> Any:
    """A trained actor as the workers build it: the backend from the spec, then ``load``."""
    from hybridflow.backends.api import training_backend

    spec = spec_for(model_dir, backend=backend_name, tensor_parallel=tensor_parallel)
    backend = training_backend(backend_name)(spec, torch.device("cpu"))
    backend.load(str(model_dir), kind="causal-lm", learning_rate=LEARNING_RATE)
    return backend


def save_phase(backend: Any, checkpoint: Path) -> dict[str, Any]:
    """Layout A: 2 steps, save, then (a) 2 more steps."""
    batch = global_batch()
    before = train_steps(backend, batch, STEPS_BEFORE_SAVE)
    backend.save_state(checkpoint)
    at_save = {
        "before_save": before,
        "saved": backend.full_state_dict(),
        "lr_steps_at_save": backend.lr_steps,
        "learning_rate_at_save": backend.learning_rate,
        "adam_steps_at_save": adam_steps(backend),
    }
    continued = train_steps(backend, batch, STEPS_AFTER_SAVE)
    return {
        **at_save,
        "continued": continued,
        "final": backend.full_state_dict(),
        "lr_steps_final": backend.lr_steps,
        "adam_steps_final": adam_steps(backend),
    }


def resume_phase(backend: Any, checkpoint: Path) -> dict[str, Any]:
    """Layout B: load the checkpoint into a freshly built backend, then (b) the same 2 steps."""
    backend.load_state(checkpoint)
    loaded = {
        "loaded": backend.full_state_dict(),
        "lr_steps_after_load": backend.lr_steps,
        "learning_rate_after_load": backend.learning_rate,
        "adam_steps_after_load": adam_steps(backend),
    }
    continued = train_steps(backend, global_batch(), STEPS_AFTER_SAVE)
    return {
        **loaded,
        "continued": continued,
        "final": backend.full_state_dict(),
        "lr_steps_final": backend.lr_steps,
        "adam_steps_final": adam_steps(backend),
    }


def run_phases(
    rank: int,
    port: int,
    world_size: int,
    backend_name: str,
    phases: Sequence[tuple[str, int]],
    model_dir: str,
    checkpoint: str,
    work_dir: str,
) -> None:
    """One rank of a job: each ``(phase, tensor_parallel)`` in turn, results in ``<phase>-tp<t>-rank<r>.pt``.

    A phase that fails records its traceback and ends the job on this rank (the next phase
    would wait for it in a collective); the job deadline ends its peers.
    """
    torch.set_num_threads(1)
    if backend_name == "megatron":
        sys.path.insert(0, str(TESTS_DIR))
        import megatron_shim

        megatron_shim.install()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    work = Path(work_dir)
    outcomes: dict[str, str | None] = {}
    try:
        for phase, tensor_parallel in phases:
            name = f"{phase}-tp{tensor_parallel}"
            try:
                backend = build_backend(backend_name, Path(model_dir), tensor_parallel)
                body = save_phase if phase == "save" else resume_phase
                torch.save(body(backend, Path(checkpoint)), work / f"{name}-rank{rank}.pt")
                outcomes[name] = None
            except Exception:
                outcomes[name] = traceback.format_exc()
                break
            finally:
                if backend_name == "megatron":
                    from hybridflow.backends.megatron import destroy_parallel_state

                    destroy_parallel_state()
    finally:
        (work / f"rank{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


def run_job(
    root: Path,
    backend_name: str,
    *,
    world_size: int,
    phases: Sequence[tuple[str, int]],
    model_dir: Path,
    checkpoint: Path,
) -> dict[str, list[dict[str, Any]]]:
    """Spawn one job; ``{"<phase>-tp<t>": [rank 0's results, rank 1's, ...]}``, failing on any traceback."""
    work = root / f"{backend_name}-world{world_size}"
    work.mkdir()
    names = [f"{phase}-tp{tp}" for phase, tp in phases]
    outcomes = run_spawned_ranks(
        run_phases,
        (world_size, backend_name, list(phases), str(model_dir), str(checkpoint), str(work)),
        world_size=world_size,
        work_dir=work,
        deadline_seconds=JOB_DEADLINE_SECONDS,
        expected=names,
        what=f"the {world_size}-rank {backend_name} job",
    )
    for name in names:
        per_rank = outcomes[name]
        failures = {rank: trace for rank, trace in per_rank.items() if trace is not None}
        assert sorted(per_rank) == list(range(world_size)) and not failures, (
            f"{backend_name} {name} on {world_size} ranks: {per_rank if not failures else ''}\n"
            + "\n".join(f"--- rank {rank}\n{trace}" for rank, trace in failures.items())
        )
    return {
        name: [torch.load(work / f"{name}-rank{rank}.pt", weights_only=True) for rank in range(world_size)]
        for name in names
    }


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridflow.models import write_tiny_model

    # Llama, not Qwen2: Qwen2's key bias gets a gradient that is zero up to rounding (adding a
    # constant to every key of a query shifts its attention scores alike, which the softmax
    # ignores), and Adam, which divides by the gradient's own magnitude, turns that rounding
    # noise into steps of up to the learning rate: its value after training depends on the
    # summation order of the layout (measured: 4e-6 apart at TP=1 vs TP=2, 1.7e-4 of its size),
    # where every other weight agrees to 5e-7 of its tensor's largest value.
    return write_tiny_model(tmp_path_factory.mktemp("resume-across-layouts") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def fsdp_runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Saved by 2 DP ranks (``save``, then continued), resumed by 4 (``dp4``).

    Resuming on 1 rank passed the same checks (2026-12-05); it is left out to keep the suite's
    time: one more spawned job proves the same DCP resharding."""
    root = tmp_path_factory.mktemp("fsdp-layouts")
    checkpoint = root / "train-state"
    run = {"model_dir": model_dir, "checkpoint": checkpoint}
    saved = run_job(root, "fsdp", world_size=2, phases=[("save", 1)], **run)
    dp4 = run_job(root, "fsdp", world_size=4, phases=[("resume", 1)], **run)
    return {"save": saved["save-tp1"], "dp4": dp4["resume-tp1"]}


@pytest.fixture(scope="module")
def megatron_runs(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """Saved at TP=2 (``save``, then continued), resumed at TP=1 with DP=2 (``tp1``), on two ranks."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron-layouts")
    runs = run_job(
        root,
        "megatron",
        world_size=2,
        phases=[("save", 2), ("resume", 1)],
        model_dir=model_dir,
        checkpoint=root / "train-state",
    )
    return {"save": runs["save-tp2"], "tp1": runs["resume-tp1"]}


# ------------------------------------------------------------------------------ comparisons


def assert_weights_close(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        try:
            torch.testing.assert_close(got[name], tensor, rtol=RELATIVE_TOLERANCE, atol=ABSOLUTE_TOLERANCE)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def assert_loads_exactly(saving: dict[str, Any], resumed: dict[str, Any]) -> None:
    """Right after the load: the saved weights bit for bit, the saved scheduler counter and Adam steps."""
    assert list(resumed["loaded"]) == list(saving["saved"])
    differing = [
        name for name, tensor in saving["saved"].items() if not torch.equal(resumed["loaded"][name], tensor)
    ]
    assert not differing, f"loaded weights differ from the saved ones: {differing}"
    assert resumed["lr_steps_after_load"] == saving["lr_steps_at_save"] == STEPS_BEFORE_SAVE
    assert resumed["learning_rate_after_load"] == saving["learning_rate_at_save"]
    assert saving["adam_steps_at_save"] and set(saving["adam_steps_at_save"]) == {float(STEPS_BEFORE_SAVE)}
    assert resumed["adam_steps_after_load"] and set(resumed["adam_steps_after_load"]) == {
        float(STEPS_BEFORE_SAVE)
    }


def assert_continues_alike(saving: dict[str, Any], resumed: dict[str, Any]) -> None:
    """(b) after the load at another layout == (a) continued at the saving layout, up to fp32 order."""
    for step, ((loss, norm), (expected_loss, expected_norm)) in enumerate(
        zip(resumed["continued"], saving["continued"], strict=True), start=STEPS_BEFORE_SAVE + 1
    ):
        assert loss == pytest.approx(expected_loss, rel=RELATIVE_TOLERANCE), f"loss of step {step}"
        assert norm == pytest.approx(expected_norm, rel=RELATIVE_TOLERANCE), f"grad norm of step {step}"
        assert norm > MAX_GRAD_NORM, f"step {step} was not clipped: {norm}"
    assert_weights_close(resumed["final"], saving["final"])
    assert resumed["lr_steps_final"] == saving["lr_steps_final"] == TOTAL_STEPS
    assert set(resumed["adam_steps_final"]) == set(saving["adam_steps_final"]) == {float(TOTAL_STEPS)}
    # Not vacuous: the continued steps moved the weights by far more than the tolerance, and the
    # losses of the steps around the save differ.
    moved = max((saving["final"][n] - t).abs().max().item() for n, t in saving["saved"].items())
    assert moved > 1e3 * ABSOLUTE_TOLERANCE, moved
    losses = [loss for loss, _ in saving["before_save"] + saving["continued"]]
    assert len(set(losses)) == TOTAL_STEPS, losses


def assert_ranks_agree(per_rank: Sequence[dict[str, Any]]) -> None:
    """Every rank of a job reports the same global losses and norms (they are all-reduced)."""
    assert all(rank["continued"] == per_rank[0]["continued"] for rank in per_rank), [
        rank["continued"] for rank in per_rank
    ]


@pytest.mark.parametrize("layout", ["dp4"])
def test_fsdp_checkpoint_of_two_ranks_loads_exactly(fsdp_runs: dict[str, Any], layout: str) -> None:
    for resumed in fsdp_runs[layout]:
        assert_loads_exactly(fsdp_runs["save"][0], resumed)


@pytest.mark.parametrize("layout", ["dp4"])
def test_fsdp_training_resumed_at_another_dp_size_continues_as_on_two_ranks(
    fsdp_runs: dict[str, Any], layout: str
) -> None:
    assert_ranks_agree(fsdp_runs["save"])
    assert_ranks_agree(fsdp_runs[layout])
    for resumed in fsdp_runs[layout]:
        assert_continues_alike(fsdp_runs["save"][0], resumed)


def test_megatron_checkpoint_of_tp2_loads_exactly_at_tp1(megatron_runs: dict[str, Any]) -> None:
    for resumed in megatron_runs["tp1"]:
        assert_loads_exactly(megatron_runs["save"][0], resumed)


def test_megatron_training_resumed_at_tp1_continues_as_at_tp2(megatron_runs: dict[str, Any]) -> None:
    assert_ranks_agree(megatron_runs["save"])
    assert_ranks_agree(megatron_runs["tp1"])
    for resumed in megatron_runs["tp1"]:
        assert_continues_alike(megatron_runs["save"][0], resumed)
