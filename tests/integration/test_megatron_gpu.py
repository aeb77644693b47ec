"""The megatron-core backend on CUDA/NCCL, one rank per visible GPU, without the CPU shim.

The same checks as the gloo job (``test_megatron_backend_distributed.py``), on the layouts the
GPU count allows: every (TP, PP) with TP dividing the model's 4 key/value heads, PP dividing its
4 layers and TP x PP dividing the world. With one GPU that is TP = PP = 1 (still NCCL, CUDA
allocation, CUDA RNG and megatron's CUDA-only clipping kernels). HF references are computed on
the CPU in this process, in fp32; the ranks turn TF32 off so fp32 matmuls stay fp32. One bf16
run checks megatron's mixed precision end to end (finite loss, a step that moves the weights).

Skipped without CUDA; run with ``pytest -m gpu``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL) and at least one GPU"),
]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_megatron_backend_distributed import (  # noqa: E402
    ADAM_EPS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    RESPONSE_WIDTH,
    ROWS,
    TEMPERATURE,
    WEIGHT_DECAY,
    compute_references,
    policy_loss,
)

from spawned_ranks import free_port  # noqa: E402

JOB_DEADLINE_SECONDS = 600
SIZES: dict[str, Any] = {"hidden": 256, "heads": 8, "kv_heads": 4, "layers": 4, "intermediate": 512}


def layouts(world: int) -> list[tuple[int, int]]:
    return [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 4) if world % (tp * pp) == 0]


def run_gpu_checks(rank: int, world: int, port: int, root: str) -> None:
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    from hybridflow.backends import megatron as mb

    work = Path(root)
    refs = torch.load(work / "references.pt", weights_only=False)
    first = refs["data"]["first"]
    outcomes: dict[str, str | None] = {}

    def rows_of(layout: Any, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        part = slice(layout.dp_rank * ROWS // layout.dp_size, (layout.dp_rank + 1) * ROWS // layout.dp_size)
        return {name: tensor[part] for name, tensor in data.items()}

    def layout_check(tp: int, pp: int) -> None:
        layout = mb.initialize_parallel_state(tp_size=tp, pp_size=pp)
        try:
            model = mb.load_causal_lm(work / "qwen2")
            export = {k: v.cpu() for k, v in mb.full_state_dict(model).items()}
            mine = rows_of(layout, first)
            inputs = (mine["input_ids"], mine["attention_mask"], mine["position_ids"])
            log_probs, entropy = mb.token_logprobs_and_entropy(
                model, *inputs, response_len=RESPONSE_WIDTH, temperature=TEMPERATURE, micro_batch_size=3
            )
            values = mb.token_values(
                mb.load_value_model(work / "reward"), *inputs, response_len=RESPONSE_WIDTH
            )
            ddp = mb.wrap_data_parallel(mb.load_causal_lm(work / "qwen2"))
            optimizer = mb.build_optimizer(
                ddp, learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
            )
            scheduler = mb.build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="cosine")
            scale = layout.dp_size / first["response_mask"].sum().item()
            half = (mine["input_ids"].shape[0] + 1) // 2
            micro = [{k: v[:half] for k, v in mine.items()}, {k: v[half:] for k, v in mine.items()}]
            mb.forward_backward(
                ddp,
                micro,
                lambda lp, ent, part: (policy_loss(lp, ent, part, scale), {}),
                response_len=RESPONSE_WIDTH,
                temperature=TEMPERATURE,
            )
            norm = mb.clip_grad_norm_and_step(ddp, optimizer, scheduler, max_grad_norm=MAX_GRAD_NORM)
            stepped = {k: v.cpu() for k, v in mb.full_state_dict(ddp).items()}
            directory = work / f"train-state-tp{tp}-pp{pp}"
            mb.save_train_state(directory, ddp, optimizer, scheduler)
            restored = mb.wrap_data_parallel(mb.load_causal_lm(work / "qwen2"))
            restored_optimizer = mb.build_optimizer(
                restored, learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
            )
            restored_scheduler = mb.build_lr_scheduler(
                restored_optimizer, warmup_steps=0, total_steps=4, schedule="cosine"
            )
            mb.load_train_state(directory, restored, restored_optimizer, restored_scheduler)
            reloaded = {k: v.cpu() for k, v in mb.full_state_dict(restored).items()}
        finally:
            mb.destroy_parallel_state()
        assert all(torch.equal(export[k], v) for k, v in refs["state"].items())
        mask = mine["response_mask"].bool()
        expected = rows_of(layout, {"lp": refs["log_probs"], "ent": refs["entropy"], "v": refs["values"]})
        assert entropy is not None
        torch.testing.assert_close(log_probs.cpu()[mask], expected["lp"][mask], atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy.cpu()[mask], expected["ent"][mask], atol=1e-4, rtol=0)
        torch.testing.assert_close(values.cpu()[mask], expected["v"][mask], atol=1e-4, rtol=0)
        assert norm == pytest.approx(refs["grad_norm"], rel=1e-4)
        for name, tensor in refs["stepped"].items():
            torch.testing.assert_close(stepped[name], tensor, atol=1e-5, rtol=0, msg=name)
        assert all(torch.equal(reloaded[k], v) for k, v in stepped.items())

    def bf16_check() -> None:
        layout = mb.initialize_parallel_state(tp_size=1, pp_size=1)
        try:
            ddp = mb.wrap_data_parallel(mb.load_causal_lm(work / "qwen2", dtype=torch.bfloat16))
            optimizer = mb.build_optimizer(ddp, learning_rate=LEARNING_RATE)
            scheduler = mb.build_lr_scheduler(optimizer, warmup_steps=0, total_steps=4, schedule="constant")
            before = {k: v.float().cpu() for k, v in mb.full_state_dict(ddp).items()}
            mine = rows_of(layout, first)
            metrics = mb.forward_backward(
                ddp,
                [mine],
                lambda lp, ent, part: (policy_loss(lp, ent, part, 1.0), {"lp": lp.detach().mean()}),
                response_len=RESPONSE_WIDTH,
            )
            norm = mb.clip_grad_norm_and_step(ddp, optimizer, scheduler, max_grad_norm=1.0)
            after = {k: v.float().cpu() for k, v in mb.full_state_dict(ddp).items()}
        finally:
            mb.destroy_parallel_state()
        assert torch.isfinite(torch.tensor(norm)) and all(m["lp"] == m["lp"] for m in metrics)
        assert any(not torch.equal(before[k], after[k]) for k in before)

    try:
        for tp, pp in layouts(world):
            name = f"tp{tp}_pp{pp}"
            try:
                layout_check(tp, pp)
                outcomes[name] = None
            except Exception:
                outcomes[name] = traceback.format_exc()
        try:
            bf16_check()
            outcomes["bf16"] = None
        except Exception:
            outcomes["bf16"] = traceback.format_exc()
    finally:
        (work / f"rank{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


def test_megatron_backend_on_nccl(tmp_path: Path) -> None:
    from hybridflow.models import write_tiny_model

    world = torch.cuda.device_count()
    model_dir = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=21, **SIZES)
    reward_dir = write_tiny_model(tmp_path / "reward", "qwen2", seed=22, head="score", **SIZES)
    compute_references(model_dir, reward_dir, tmp_path / "references.pt")
    context = mp.start_processes(
        run_gpu_checks,
        args=(world, free_port(), str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOB_DEADLINE_SECONDS
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world}-GPU megatron job did not finish within {JOB_DEADLINE_SECONDS} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
    failures = []
    for rank in range(world):
        outcomes = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(outcomes) == {f"tp{tp}_pp{pp}" for tp, pp in layouts(world)} | {"bf16"}, outcomes
        failures += [f"--- rank {rank} {name}\n{trace}" for name, trace in outcomes.items() if trace]
    assert not failures, "\n".join(failures)
