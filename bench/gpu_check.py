"""The GPU check: what only a CUDA GPU can show, in one run on a bare GPU machine (``make gpu-check``).

Runs where the GPU machine lent to a session runs: one CUDA GPU, a Python with CUDA torch and
transformers, **no Ray, no vLLM, no package registry**, at most 64 MiB of the tree carried,
10 minutes. Whatever else the runtime imports (pydantic for the spec) comes as wheels that
``make gpu-wheels`` downloads here into ``.whl/`` (ignored by git; carry it); the check
installs them into a scratch directory when the interpreter lacks them.

What it measures, each on the same random-initialised Qwen2-shaped model (``--shape``, a name
of :data:`hybridflow.models.shapes.SHAPES`; default ``qwen2.5-1.5b``: Qwen2.5-1.5B's shapes,
1.54B parameters with tied embeddings, bf16, written locally, no hub):

* ``gpu_tests``: every ``gpu``-marked test that can run there (those needing Ray, vLLM or
  megatron skip), as pytest counts; ``failed`` must be 0.
* ``train_*``: one FSDP2 bf16 training step (world of one, NCCL) through
  :class:`~hybridflow.backends.fsdp.training.FSDPTrainingBackend`, ``--train-rows`` rows of
  ``--train-tokens`` tokens, the median of ``--repeats`` timed steps after one warm-up;
  ``train_mfu`` is model FLOPs (6 x parameters x tokens, plus attention's 12 x layers x hidden x
  sequence per token; the tied embedding is counted once, as the LM head's matmul) over the
  step's seconds and the GPU's dense bf16 peak (target >= 0.40).
* ``decode_*``: the torch engine's generation in bf16 against HF ``generate`` (its default
  dynamic cache, greedy) on the same module, prompts and lengths: tokens per second each, and
  ``decode_vs_hf_generate`` (target >= 2).
* ``compiled_*`` (unless ``--no-compile``): the same decode with ``rollout.compile`` (the engine's
  decode step through ``torch.compile``, CUDA graphs on the GPU) and the same training step with
  ``training.compile``, each against its eager figure above, with its first call (the compile,
  cold) apart: whether the compiled hot paths pay on a GPU, which is what their default should
  follow (off, from the CPU measurements).
* ``colocated_*``: the trainer's parameter and optimizer bytes next to the engine's weights,
  the CUDA peak of a generation with the trainer resident and with it offloaded
  (``DeviceOffload``, the mechanism of ``training.offloadDuringGeneration``), and the seconds
  the offload and reload take: what offloading frees and costs per step on this GPU.
* ``sync_*``: CUDA peak memory around one weight sync as the rollout runs it between steps:
  the torch engine's bf16 replica released (``sleep(level=2)``) and woken empty, then the FSDP
  actor's buckets streamed in (``load_weight_buckets``): the peak above what was allocated
  before, next to the bucket size and the bytes loaded.

The last line printed is one JSON object. ``--smoke`` (or ``HYBRIDFLOW_BENCH_QUICK=1``) runs
every phase on the CPU with a tiny model and no pytest; ``make bench-smoke`` runs it in CI so that
this file cannot rot where no GPU is lent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
SITE = Path(tempfile.gettempdir()) / "hybridflow-gpu-site"
NEEDED_MODULES = ("pydantic", "transformers", "safetensors", "tokenizers", "yaml")
MIN_TRANSFORMERS = (5, 19)  # pyproject's gpu extra
GPU_TEST_FILES = (
    "tests/unit/test_fsdp_backend.py",
    "tests/unit/test_actor_update.py",
    "tests/unit/test_torch_engine.py",
    "tests/integration/test_resharding.py",
    "tests/integration/test_vllm_engine.py",
    "tests/integration/test_megatron_gpu.py",
)


def ensure_dependencies() -> None:
    """Put the carried wheels (``make gpu-wheels``) first on the path when this Python lacks a module.

    The GPU image has torch, tokenizers, safetensors and an older transformers, and no pydantic;
    the wheels hold the versions the runtime is tested with here. Installed once per machine into
    a scratch directory (nothing from a registry), then first on ``sys.path`` and ``PYTHONPATH``
    so that the pytest subprocess sees the same.
    """
    if not lacking():
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    marker = SITE / ".installed"
    listing = "\n".join(w.name for w in wheels)
    if wheels and (not marker.exists() or marker.read_text() != listing):
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        done = subprocess.run([*pip, "--upgrade", "--target", str(SITE), *map(str, wheels)], check=False)
        if done.returncode:
            sys.exit(
                f"gpu-check: pip could not install the wheels of {WHEELS} for this Python "
                f"({sys.version_info.major}.{sys.version_info.minor}); fetch them for it with "
                f"`make gpu-wheels GPU_PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}`"
            )
        marker.write_text(listing)
    sys.path.insert(0, str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    if missing := lacking():
        sys.exit(
            f"gpu-check: this Python lacks {', '.join(missing)} and {WHEELS} does not provide it; "
            "run `make gpu-wheels` here and carry .whl"
        )


def lacking() -> list[str]:
    """The modules this interpreter lacks, or has older than the runtime needs."""
    import importlib.metadata

    missing = [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if "transformers" not in missing:
        major, minor = (int(part) for part in importlib.metadata.version("transformers").split(".")[:2])
        if (major, minor) < MIN_TRANSFORMERS:
            missing.append(f"transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}")
    return missing


def run_gpu_tests(out_dir: Path) -> dict[str, Any]:
    """pytest -m gpu over the files that hold gpu tests; counts from its JUnit report.

    A file that cannot be collected because it imports what the machine lacks by design (Ray,
    vLLM, megatron) is counted under ``not_runnable_here`` with the module, not as an error.
    """
    report = out_dir / "gpu-tests.xml"
    paths = [str(ROOT / "runtime"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "--continue-on-collection-errors", f"--junitxml={report}", *GPU_TEST_FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
    counts: dict[str, Any] = {
        "passed": 0,
        "failed": 0,
        "skipped": 0,
        "errors": 0,
        "exit_code": done.returncode,
    }
    not_runnable: dict[str, str] = {}
    if not report.exists():
        counts["errors"] = 1
        return counts
    for case in ET.parse(report).getroot().iter("testcase"):
        label = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
        elif (error := case.find("error")) is not None:
            text = f"{error.get('message', '')} {error.text or ''}"
            lacking_module = re.search(r"No module named '(ray|vllm|megatron)", text)
            if lacking_module:
                not_runnable[label] = lacking_module.group(1)
            else:
                counts["errors"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["not_runnable_here"] = not_runnable
    return counts


def timed(fn: Callable[[], Any], device: Any, repeats: int) -> float:
    """The median seconds of ``repeats`` calls after one warm-up, synchronising the device."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def job_spec(model_dir: Path, precision: str) -> Any:
    from hybridflow.spec import RLHFJobSpec

    return RLHFJobSpec.model_validate(
        {
            "models": {"actor": {"path": str(model_dir)}},
            "data": {"trainFiles": ["/data/prompts.jsonl"]},
            "algorithm": {"name": "grpo", "samplesPerPrompt": 2},
            "training": {
                "totalSteps": 10,
                "promptsPerStep": 2,
                "miniBatchSize": 4,
                "microBatchSizePerGpu": 1,
                "precision": precision,
            },
            "rewards": [{"function": "target_char"}],
        }
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hybridflow.backends.fsdp.training import FSDPTrainingBackend
    from hybridflow.engines import SamplingParams
    from hybridflow.engines.torch_engine import TorchRolloutEngine
    from hybridflow.metrics.flops import peak_flops
    from hybridflow.models.shapes import write_shaped_model

    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    started = time.perf_counter()
    model_dir = write_shaped_model(work / "model", args.shape, dtype=torch.bfloat16)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "shape": args.shape,
        "write_model_seconds": time.perf_counter() - started,
    }

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{work / 'store'}",
        rank=0,
        world_size=1,
    )
    try:
        backend = FSDPTrainingBackend(job_spec(model_dir, "bf16"), device)
        backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-5)
        parameters = sum(p.numel() for p in backend.model.parameters())
        config = backend.model.config
        rows, tokens = args.train_rows, args.train_tokens
        response = tokens // 4
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(300, config.vocab_size, (rows, tokens), generator=generator)
        batch = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(tokens).expand(rows, tokens).contiguous(),
            "responses": input_ids[:, -response:],
            "response_mask": torch.ones(rows, response, dtype=torch.long),
        }
        micro = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(rows)]

        def loss_fn(
            log_probs: torch.Tensor, entropy: torch.Tensor | None, fields: dict[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, float]]:
            mask = fields["response_mask"].float()
            return -(log_probs * mask).sum() / mask.sum(), {}

        def train_step() -> None:
            backend.forward_backward(micro, loss_fn, fields=["response_mask"], entropy_grad=False)
            backend.clip_and_step(max_grad_norm=1.0)

        step_seconds = timed(train_step, device, args.repeats)
        flops_per_token = 6 * parameters + 12 * config.num_hidden_layers * config.hidden_size * tokens
        peak = peak_flops(result["device"]) if device.type == "cuda" else None
        result.update(
            {
                "parameters": parameters,
                "train_tokens_per_step": rows * tokens,
                "train_step_seconds": step_seconds,
                "train_flops_per_step": flops_per_token * rows * tokens,
                "train_peak_flops": peak,
                "train_mfu": (flops_per_token * rows * tokens / step_seconds / peak) if peak else None,
            }
        )

        # ---------------------------------------------------------------- decode
        engine = TorchRolloutEngine(
            model_dir, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        prompts = [
            torch.randint(300, config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
            for _ in range(args.decode_rows)
        ]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
        ours: list[int] = []

        def ours_decode() -> None:
            output = engine.generate(prompts, params)
            ours[:] = [len(r) for r in output.response_token_ids]

        engine_seconds = timed(ours_decode, device, args.repeats)
        hf_model = engine.model
        prompt_tensor = torch.tensor(prompts, device=device)
        hf_generated: list[int] = []

        def hf_decode() -> None:
            with torch.no_grad():
                out = hf_model.generate(
                    prompt_tensor,
                    attention_mask=torch.ones_like(prompt_tensor),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                )
            hf_generated[:] = [out.shape[1] - args.prompt_tokens] * len(prompts)

        hf_seconds = timed(hf_decode, device, args.repeats)
        result.update(
            {
                "decode_rows": args.decode_rows,
                "decode_tokens_per_second": sum(ours) / engine_seconds,
                "hf_generate_tokens_per_second": sum(hf_generated) / hf_seconds,
            }
        )
        result["decode_vs_hf_generate"] = (
            result["decode_tokens_per_second"] / result["hf_generate_tokens_per_second"]
        )
        if args.compile:
            result.update(
                compiled_figures(
                    args, device, engine.model, prompts, params, model_dir, micro, loss_fn, result
                )
            )

        # ---------------------------------------------------------------- one weight sync
        # As the rollout does it between steps (workers/rollout.py): the replica released with
        # sleep(level=2), woken empty, and one streamed sync from the FSDP actor's buckets.
        bucket_bytes = args.bucket_mib << 20
        engine.sleep(level=2)
        engine.wake_up()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        loaded = engine.load_weight_buckets(
            backend.weight_buckets(
                bucket_bytes, dtype=torch.bfloat16 if device.type == "cuda" else None, meter=None
            )
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
            result["sync_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
        else:
            result["sync_peak_extra_bytes"] = None
        result["sync_seconds"] = time.perf_counter() - started
        result["sync_bucket_bytes"] = bucket_bytes
        result["sync_loaded_bytes"] = loaded
        # generate refuses while any parameter the level-2 sleep released has not been loaded.
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
        result["sync_complete"] = True

        # ---------------------------------------------------------------- colocated generation memory
        # The trainer's resident bytes next to the engine's while it generates, with the trainer
        # left in place and with spec.training.offloadDuringGeneration's mechanism (DeviceOffload):
        # what offloading frees and what it costs per step, the figures its default rests on.
        from hybridflow.backends.offload import DeviceOffload

        def storage_bytes(tensors: list[torch.Tensor]) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(storages.values())

        params, optimizer_state = backend.offload_tensors()
        result["colocated_trainer_parameter_bytes"] = storage_bytes(params)
        result["colocated_trainer_optimizer_bytes"] = storage_bytes(optimizer_state)
        result["colocated_engine_weight_bytes"] = storage_bytes(list(engine.model.parameters()))
        for offloaded in (False, True):
            offload = DeviceOffload("the trainer")
            moved = offload.offload([*params, *optimizer_state]) if offloaded else None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0))
            key = "offloaded" if offloaded else "resident"
            if device.type == "cuda":
                torch.cuda.synchronize()
                result[f"colocated_generate_peak_bytes_{key}"] = torch.cuda.max_memory_allocated()
            if moved is not None:
                back = offload.reload()
                result["colocated_offload_bytes"] = moved.bytes
                result["colocated_offload_seconds"] = moved.seconds
                result["colocated_reload_seconds"] = back.seconds
    finally:
        dist.destroy_process_group()
    return result


def compiled_figures(
    args: argparse.Namespace,
    device: Any,
    model: Any,
    prompts: list[list[int]],
    params: Any,
    model_dir: Path,
    micro: list[dict[str, Any]],
    loss_fn: Callable[..., Any],
    eager: dict[str, Any],
) -> dict[str, Any]:
    """The decode and the training step again, compiled (``rollout.compile``, ``training.compile``)."""
    from hybridflow.backends.fsdp.training import FSDPTrainingBackend
    from hybridflow.engines.torch_engine import TorchRolloutEngine

    figures: dict[str, Any] = {}
    engine = TorchRolloutEngine(model, compile_decode=True, cache_width=args.prompt_tokens + args.new_tokens)
    produced: list[int] = []

    def decode() -> None:
        produced[:] = [len(r) for r in engine.generate(prompts, params).response_token_ids]

    started = time.perf_counter()
    decode()
    figures["compiled_decode_first_call_seconds"] = time.perf_counter() - started
    seconds = timed(decode, device, args.repeats)
    figures["compiled_decode_tokens_per_second"] = sum(produced) / seconds
    figures["compiled_decode_vs_eager"] = (
        figures["compiled_decode_tokens_per_second"] / eager["decode_tokens_per_second"]
    )
    engine.close()

    spec = job_spec(model_dir, "bf16")
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"compile": True})})
    backend = FSDPTrainingBackend(spec, device)
    backend.load(str(model_dir), kind="causal-lm", learning_rate=1e-5)

    def train_step() -> None:
        backend.forward_backward(micro, loss_fn, fields=["response_mask"], entropy_grad=False)
        backend.clip_and_step(max_grad_norm=1.0)

    started = time.perf_counter()
    train_step()
    figures["compiled_train_first_call_seconds"] = time.perf_counter() - started
    figures["compiled_train_step_seconds"] = timed(train_step, device, args.repeats)
    figures["compiled_train_vs_eager"] = eager["train_step_seconds"] / figures["compiled_train_step_seconds"]
    if eager.get("train_mfu") is not None:
        figures["compiled_train_mfu"] = eager["train_mfu"] * figures["compiled_train_vs_eager"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every phase on the CPU, tiny model, no pytest")
    parser.add_argument("--shape", default=None, help="a name of hybridflow.models.shapes.SHAPES")
    parser.add_argument("--train-rows", type=int, default=8)
    parser.add_argument("--train-tokens", type=int, default=4096)
    parser.add_argument("--decode-rows", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip the compiled decode and training step",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.gettempdir())))
    args = parser.parse_args()
    args.smoke = args.smoke or os.environ.get("HYBRIDFLOW_BENCH_QUICK") == "1"  # make bench-smoke
    if args.smoke:
        args.shape = args.shape or "tiny"
        (
            args.train_rows,
            args.train_tokens,
            args.decode_rows,
            args.prompt_tokens,
            args.new_tokens,
            args.repeats,
        ) = 2, 32, 2, 8, 8, 1
    args.shape = args.shape or "qwen2.5-1.5b"
    ensure_dependencies()
    sys.path.insert(0, str(ROOT / "runtime"))
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit(
            "gpu-check: no CUDA device here (torch.cuda.is_available() is False); use --smoke for the CPU run"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"torch": torch.__version__}
    if not args.smoke:
        result["gpu_tests"] = run_gpu_tests(args.out)
    result.update(measure(args))
    if torch.cuda.is_available() and not args.smoke:
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    (args.out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
