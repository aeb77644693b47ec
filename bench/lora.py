"""LoRA against full fine-tuning: sync bytes, trainer memory and step time at 0.5B, learning on the tiny task.

**At a real size** (``qwen2-0.5b`` of :mod:`hybridflow.models.shapes`: Qwen/Qwen2-0.5B's shapes,
494M random parameters), each mode in a fresh spawned process (a gloo world of one, the FSDP
backend as the actor loads it, fp32 on this CPU) so that each process's high-water mark is its
own:

* ``full``: every weight trains (AdamW over 494M parameters);
* ``lora``: ``spec.training.lora`` rank 16, alpha 32, every linear of every decoder layer.

Each loads the model, then takes :data:`UPDATES` updates on one batch of :data:`ROWS` sequences
of :data:`PROMPT` + :data:`RESPONSE` tokens (the actor's ``forward_backward`` and
``clip_and_step``). Measured:

* ``sync_bytes``: what one weight sync moves to the engine, counted from the actor's own
  ``weight_buckets`` in bf16 (the dtype a GPU engine serves in): the whole model for ``full``,
  the adapter alone for ``lora``. Target: ``sync_bytes_ratio`` (full / lora) >= 50 at rank 16.
* ``trainable_parameters``, ``optimizer_state_bytes`` (AdamW's tensors after the updates) and
  ``gradient_bytes`` (after a backward).
* ``trainer_peak_bytes``: the process's resident high-water mark over load and updates, above
  what it held before (``resharding.meter.PeakMemory``; on this CPU it includes the weights).
* ``step_seconds``: the mean of the updates after the first.
* The weight-sync check (``spec.rollout.weightSyncCheck``): one sync into a torch engine that
  holds the model (fp32 here; an engine with the adapter for ``lora``), timed without a check
  (``sync_seconds``) and with the sampled and the full check (``check_seconds_sampled``,
  ``check_seconds_full``: the trainer's checksums as the buckets pass plus the engine's over
  its copy); ``check_overhead_sampled`` = their ratio (target <= 0.05).

**Learning** (``learning``): examples/grpo-tiny.yaml with ``training.lora`` (rank 8, alpha 16,
learning rate 2e-2: an adapter starts at zero and needs a larger step than full fine-tuning's
2e-3) for :data:`STEPS` steps through the real job path; ``reward_gain`` is the mean reward of
the last 10 steps minus the first 10 (target >= 0.3). The tiny model's LM head is scaled by
:data:`HEAD_SCALE` first (``logit_std`` reports the result), so that its logits spread as a
trained model's do: the random tiny model's are nearly uniform (entropy 5.94 nats of at most
5.95), and an adapter on the decoder's linears cannot widen logits bounded by the final RMSNorm
and a head of std 0.02 (measured: 40 LoRA steps at learning rates 2e-2, 5e-2 and 1e-1 all end at
a reward of about 0.012 with the entropy unchanged; full fine-tuning trains the head itself).
``learning_unscaled`` (full run only) repeats the run on the unscaled model, for that record.

``--quick`` (CI): the tiny shape, 3 learning steps, no verdict. The last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # spawned_ranks.free_port

ROWS, PROMPT, RESPONSE = 4, 64, 64
UPDATES = 3
STEPS = 40
QUICK_STEPS = 3
LORA_RANK, LORA_ALPHA = 16, 32.0
TARGET_SYNC_RATIO = 50.0
TARGET_GAIN = 0.3
TARGET_CHECK_OVERHEAD = 0.05
HEAD_SCALE = 20.0


def _spec(model_dir: Path, lora: bool) -> Any:
    from hybridflow.spec import RLHFJobSpec

    training: dict[str, Any] = {
        "totalSteps": 10,
        "promptsPerStep": 2,
        "miniBatchSize": ROWS,
        "microBatchSizePerGpu": ROWS,
        "precision": "fp32",
    }
    if lora:
        training["lora"] = {"rank": LORA_RANK, "alpha": LORA_ALPHA}
    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": training,
            "rewards": [{"function": "target_char"}],
        }
    )


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, min(vocab, 256), (ROWS, PROMPT + RESPONSE), generator=generator)
    mask = torch.ones_like(input_ids)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": input_ids[:, PROMPT:],
        "response_mask": torch.ones(ROWS, RESPONSE, dtype=torch.long),
    }


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure_mode(rank: int, port: int, model_dir: str, mode: str, out: str) -> None:
    """One mode in a fresh process (spawned): load, updates, sync bytes, a checked sync. Writes JSON to ``out``."""
    import torch.distributed as dist

    from hybridflow.backends.fsdp.training import FSDPTrainingBackend
    from hybridflow.engines.torch_engine import TorchRolloutEngine
    from hybridflow.models.lora import lora_config
    from hybridflow.resharding.fingerprint import FingerprintPlan, SentFingerprint, verify_served
    from hybridflow.resharding.meter import PeakMemory

    del rank
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    spec = _spec(Path(model_dir), lora=mode == "lora")
    figures: dict[str, Any] = {}
    with PeakMemory("cpu") as probe:
        backend = FSDPTrainingBackend(spec, torch.device("cpu"))
        backend.load(model_dir, kind="causal-lm", learning_rate=1e-5)
        batch = _batch(int(backend.model.config.vocab_size))
        seconds: list[float] = []
        for _ in range(UPDATES):
            started = time.perf_counter()

            def loss_fn(log_probs, entropy, micro):  # type: ignore[no-untyped-def]
                return -(log_probs * micro["response_mask"]).sum() / micro["response_mask"].sum(), {}

            list(
                backend.forward_backward(
                    [batch], loss_fn, fields=["response_mask"], temperature=1.0, entropy_grad=False
                )
            )
            figures["gradient_bytes"] = _tensor_bytes(
                p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for p in backend.model.parameters()
                if p.grad is not None
            )
            backend.clip_and_step(max_grad_norm=1.0)
            seconds.append(time.perf_counter() - started)
    figures["trainer_peak_bytes"] = probe.bytes
    figures["step_seconds"] = statistics.mean(seconds[1:])
    figures["trainable_parameters"] = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    figures["optimizer_state_bytes"] = _tensor_bytes(
        tensor for state in backend.optimizer.state.values() for tensor in state.values()
    )
    figures["sync_bytes"] = sum(
        t.numel() * t.element_size()
        for bucket in backend.weight_buckets(64 << 20, dtype=torch.bfloat16, meter=None)
        for _, t in bucket
    )
    engine = TorchRolloutEngine(model_dir, lora=lora_config(spec.training.lora))
    syncs: dict[str, float] = {}
    for check in ("off", "sampled", "full", "off", "sampled", "full"):  # twice each; the second counts
        sent = SentFingerprint(FingerprintPlan(check, version=1))  # type: ignore[arg-type]
        started = time.perf_counter()
        engine.load_weight_buckets(
            sent.watch(backend.weight_buckets(64 << 20, dtype=torch.float32, meter=None))
        )
        loaded = time.perf_counter() - started
        report = verify_served(engine, sent.to_json(), sender_seconds=sent.seconds)
        if check == "off":
            syncs["sync_seconds"] = loaded
        else:
            assert report is not None and not report.unverified
            syncs[f"check_seconds_{check}"] = report.seconds
            syncs[f"checked_tensors_{check}"] = report.checked
    figures.update(syncs)
    figures["check_overhead_sampled"] = syncs["check_seconds_sampled"] / syncs["sync_seconds"]
    figures["check_overhead_full"] = syncs["check_seconds_full"] / syncs["sync_seconds"]
    Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def run_mode(model_dir: Path, mode: str, workdir: Path) -> dict[str, Any]:
    from spawned_ranks import free_port

    out = workdir / f"{mode}.json"
    mp.start_processes(
        measure_mode, args=(free_port(), str(model_dir), mode, str(out)), nprocs=1, start_method="spawn"
    )
    result: dict[str, Any] = json.loads(out.read_text())
    print(f"[lora bench] {mode}: {result}", file=sys.stderr)
    return result


def scale_lm_head(model_dir: Path, factor: float) -> float:
    """Multiply the model's LM head by ``factor`` in place; returns the std of its logits on random tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["lm_head.weight"] * factor
    save_file(state, str(path), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        return float(model(ids).logits.std())


def learning(workdir: Path, steps: int, head_scale: float = HEAD_SCALE) -> dict[str, Any]:
    from hybridflow.controller import init_local_ray
    from hybridflow.models.tiny import write_tiny_model
    from hybridflow.rewards import make_toy_dataset
    from hybridflow.spec import load_job_manifest
    from hybridflow.spec.training import LoRASpec
    from hybridflow.trainer.roles import resource_pools
    from hybridflow.trainer.runner import run_training

    model = write_tiny_model(workdir / f"tiny-model-x{head_scale:g}")
    logit_std = scale_lm_head(model, head_scale)
    data = workdir / "target_char.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in make_toy_dataset("target_char", 256, seed=0)))
    spec = load_job_manifest(ROOT / "examples" / "grpo-tiny.yaml").spec
    spec = spec.model_copy(
        update={
            "models": spec.models.model_validate({"actor": {"path": str(model)}}),
            "data": spec.data.model_copy(update={"train_files": (str(data),)}),
            "training": spec.training.model_copy(
                update={
                    "total_steps": steps,
                    "learning_rate": 2e-2,
                    "lora": LoRASpec.model_validate({"rank": 8, "alpha": 16}),
                }
            ),
            "output_dir": str(workdir / f"lora-job-x{head_scale:g}"),
        }
    )
    init_local_ray(resource_pools(spec, simulated=True))
    started = time.monotonic()
    summary = run_training(spec, on_step=lambda line: print(f"[lora learning] {line}", file=sys.stderr))
    rewards = [m["reward/mean"] for m in summary.metrics]
    window = min(10, max(1, len(rewards) // 2))
    first, last = statistics.mean(rewards[:window]), statistics.mean(rewards[-window:])
    return {
        "steps": steps,
        "head_scale": head_scale,
        "logit_std": round(logit_std, 3),
        "reward_first": round(first, 4),
        "reward_last": round(last, 4),
        "reward_gain": round(last - first, 4),
        "weight_sync_bytes_per_rank": summary.metrics[-1].get("reshard/bytes_sent_per_rank"),
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", default=os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"
    )
    args = parser.parse_args()
    from hybridflow.models.shapes import write_shaped_model

    workdir = Path(tempfile.mkdtemp(prefix="hybridflow-lora-bench-"))
    shape = "tiny" if args.quick else "qwen2-0.5b"
    model_dir = write_shaped_model(workdir / shape, shape)
    full, lora = run_mode(model_dir, "full", workdir), run_mode(model_dir, "lora", workdir)
    figures: dict[str, Any] = {
        "model": shape,
        "lora_rank": LORA_RANK,
        "batch": f"{ROWS} x ({PROMPT} + {RESPONSE}) tokens, fp32, CPU",
        "full": full,
        "lora": lora,
        "sync_bytes_ratio": round(full["sync_bytes"] / lora["sync_bytes"], 1),
        "optimizer_state_ratio": round(full["optimizer_state_bytes"] / lora["optimizer_state_bytes"], 1),
        "trainer_peak_ratio": round(lora["trainer_peak_bytes"] / full["trainer_peak_bytes"], 3)
        if full["trainer_peak_bytes"] and lora["trainer_peak_bytes"]
        else None,
        "step_seconds_ratio": round(lora["step_seconds"] / full["step_seconds"], 3),
        "learning": learning(workdir, QUICK_STEPS if args.quick else STEPS),
        "quick": args.quick,
    }
    if not args.quick:
        figures["learning_unscaled"] = learning(workdir, STEPS, head_scale=1.0)
    if not args.quick:
        figures["meets_targets"] = {
            "sync_bytes_ratio": figures["sync_bytes_ratio"] >= TARGET_SYNC_RATIO,
            "reward_gain": figures["learning"]["reward_gain"] >= TARGET_GAIN,
            "check_overhead_sampled": max(full["check_overhead_sampled"], lora["check_overhead_sampled"])
            <= TARGET_CHECK_OVERHEAD,
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
