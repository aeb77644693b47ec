"""Write a trained actor as a Hugging Face directory, with a sha256 manifest, atomically.

Who calls what: at the end of training (or every N steps) each rank assembles the actor's full
state dict ``{hf_name: tensor}`` (the names ``model.state_dict()`` of the transformers model gives);
rank 0 alone calls :func:`export_hf` with it, the source model directory (its ``config.json`` and
``generation_config.json`` are copied) and the tokenizer directory. One writer per export
directory: two processes exporting to the same path at once is not supported. Afterwards anyone
may call :func:`verify_export` (re-hash) and :func:`hybridflow.export.parity.check_export_parity`
(compare log-probs with the trainer's) before the directory is published further.

Three kinds of export:

* ``full``: the plain model. A state dict holding LoRA tensors is refused (use ``merged`` or
  ``adapter``): silently dropping the adapters would ship the untrained base.
* ``merged``: each adapted linear's weight becomes ``W + scaling * B @ A`` (computed in float32,
  ``scaling = alpha / rank``), the LoRA tensors are dropped; the result is a plain model that
  loads and serves like ``full``.
* ``adapter``: PEFT's LoRA format only, what PEFT and vLLM's LoRA loader read
  (``vllm/lora/lora_model.py``, ``peft_helper.py``): ``adapter_config.json`` and
  ``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight`` (``[r, in]``)
  and ``...lora_B.weight`` (``[out, r]``). The base weights are not written: the adapter is only
  valid on the unchanged source model, which ``base_model_name_or_path`` names.

Trainer LoRA naming (the contract with the trainer): for each adapted linear ``<module>`` the
state dict holds the frozen base ``<module>.weight`` (and ``<module>.bias`` if any), plus
``<module>.lora_A.weight`` and ``<module>.lora_B.weight``; the adapter adds
``scaling * B @ A @ x`` to the module's output.

Directory layout (full/merged)::

    model.safetensors                or model-00001-of-0000N.safetensors + model.safetensors.index.json
    config.json                      the source's, with "dtype" set to the saved dtype
    generation_config.json           the source's, byte for byte (when it has one)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   the tokenizer's, byte for byte
    hybridflow-export.json           the manifest, written last

The weight files follow ``save_pretrained``: shards above ``max_shard_bytes``, the index with
``metadata.total_size`` / ``total_parameters`` and ``weight_map``, ``{"format": "pt"}`` safetensors
metadata, tied weights stored once (with ``tie_word_embeddings`` the ``lm_head.weight`` alias is
left out, as transformers does; it reties on load), and transformers' load-time weight conversions
reverted (``revert_weight_conversion``: identity for dense Llama/Qwen2, un-fuses MoE experts).

Publication protocol: every file is written (and fsynced) into a hidden sibling
``.<name>.partial-<random>``, the manifest last; the staging directory is then renamed to
``<name>``. If ``<name>`` exists (re-export of the same step) it is first renamed to
``.<name>.replaced-<random>`` and removed only after the new export is in place. So a directory
at ``<name>`` is always a complete export with its manifest; a crash leaves either the old export
at ``<name>``, the new one, or (between the two renames) the old one under ``.replaced-*`` and
nothing at ``<name>``. Never a half-written export under the final name. Stale ``.partial-*``
directories are removed by the next export to the same name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors.torch import save_file

from hybridflow.models.lora import LoRAConfig

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "EXPORT_DTYPES",
    "EXPORT_KINDS",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT_VERSION",
    "PEFT_KEY_PREFIX",
    "ExportDtype",
    "ExportKind",
    "ExportVerificationError",
    "Manifest",
    "ManifestFile",
    "export_hf",
    "peft_adapter_config",
    "verify_export",
]

ExportKind = Literal["full", "merged", "adapter"]
EXPORT_KINDS: tuple[str, ...] = get_args(ExportKind)

ExportDtype = Literal["float32", "bfloat16", "float16"]
EXPORT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtype the weights are saved in. ``float32`` keeps the trainer's master weights exactly;
``bfloat16`` halves the files (what most published checkpoints use) at the cost of rounding,
which the parity gate's tolerance must then allow."""

MANIFEST_FILE = "hybridflow-export.json"
MANIFEST_FORMAT_VERSION = 1
"""Bump when the manifest's fields or the directory layout change meaning."""

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model."
"""PEFT saves a ``PeftModel``'s tensors under ``base_model.model.<module name>``; vLLM's
``parse_fine_tuned_lora_name`` strips exactly this prefix to find the module."""

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files ``save_pretrained`` of a tokenizer may write; those present are copied. An allowlist
rather than "everything in the directory" because the tokenizer directory is usually the model
directory too, and its weights must not be copied next to the exported ones."""
TOKENIZER_DIRECTORIES = ("additional_chat_templates",)

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""5 GB per safetensors file, the size the Hugging Face Hub recommends for uploads."""

_LORA_A_SUFFIX = ".lora_A.weight"
_LORA_B_SUFFIX = ".lora_B.weight"


# --------------------------------------------------------------------------- settings


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ManifestFile:
    """One file of an export: its path relative to the export directory (POSIX separators)."""

    path: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    """What ``hybridflow-export.json`` records: every other file of the export, and how it was made."""

    format_version: int
    kind: ExportKind
    step: int
    dtype: ExportDtype
    files: tuple[ManifestFile, ...]
    lora: LoRAConfig | None = None

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "kind": self.kind,
            "step": self.step,
            "dtype": self.dtype,
            "lora": None
            if self.lora is None
            else {
                "rank": self.lora.rank,
                "alpha": self.lora.alpha,
                "target_modules": list(self.lora.target_modules),
                "dropout": self.lora.dropout,
            },
            "files": [{"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in self.files],
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        """Parse a manifest; a bad one raises ``ValueError`` naming ``source``, the field and its value."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from error
        if not isinstance(body, dict):
            raise ValueError(f"{source}: expected a JSON object, found {type(body).__name__}")

        def field(name: str, allowed: str, ok: Any) -> Any:
            value = body.get(name)
            if not ok(value):
                raise ValueError(f"{source}: field {name}={value!r} is not allowed; expected {allowed}")
            return value

        version = field(
            "format_version", f"{MANIFEST_FORMAT_VERSION}", lambda v: v == MANIFEST_FORMAT_VERSION
        )
        kind = field("kind", f"one of {', '.join(EXPORT_KINDS)}", lambda v: v in EXPORT_KINDS)
        step = field("step", "an integer >= 0", lambda v: isinstance(v, int) and v >= 0)
        dtype = field("dtype", f"one of {', '.join(EXPORT_DTYPES)}", lambda v: v in EXPORT_DTYPES)
        entries = field("files", "a list of {path, sha256, size_bytes}", lambda v: isinstance(v, list))
        files = tuple(_parse_manifest_file(entry, f"{source}: files[{i}]") for i, entry in enumerate(entries))
        lora_body = body.get("lora")
        lora = None
        if lora_body is not None:
            try:
                lora = LoRAConfig(
                    rank=lora_body["rank"],
                    alpha=lora_body["alpha"],
                    target_modules=tuple(lora_body["target_modules"]),
                    dropout=lora_body.get("dropout", 0.0),
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{source}: field lora={lora_body!r} is not valid: {error}") from error
        return cls(version, kind, step, dtype, files, lora)


def _parse_manifest_file(entry: Any, where: str) -> ManifestFile:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}={entry!r} must be an object with path, sha256, size_bytes")
    path, digest, size = entry.get("path"), entry.get("sha256"), entry.get("size_bytes")
    # A listed path is joined to the export directory: it must stay inside it.
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or ".." in path.split("/")
        or path == MANIFEST_FILE
    ):
        raise ValueError(f"{where}.path={path!r} must be a relative path inside the export, not the manifest")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"{where}.sha256={digest!r} must be 64 lowercase hex digits")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{where}.size_bytes={size!r} must be an integer >= 0")
    return ManifestFile(path, digest, size)


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _listed_files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted POSIX relative paths."""
    return sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.relative_to(directory).as_posix() != MANIFEST_FILE
    )


class ExportVerificationError(Exception):
    """An export's files differ from its manifest; ``problems`` has one line per file."""

    def __init__(self, directory: Path, problems: list[str]) -> None:
        self.directory = directory
        self.problems = tuple(problems)
        lines = "\n".join(f"  {problem}" for problem in problems)
        super().__init__(f"export {directory} does not match its {MANIFEST_FILE}:\n{lines}")


def verify_export(directory: str | os.PathLike[str]) -> Manifest:
    """Re-hash every file of an export against its manifest; return the manifest when all match.

    Raises ``ExportVerificationError`` listing each problem by file: a listed file that is
    missing (its expected sha256), one whose bytes changed (expected and found sha256 and
    sizes), and a file present but not listed (its found sha256). ``FileNotFoundError`` when
    there is no manifest (not an export, or one whose write never finished), ``ValueError``
    when the manifest is malformed.
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {MANIFEST_FILE}: it is not a hybridflow export (or its write never finished)"
        )
    manifest = Manifest.from_json(manifest_path.read_text(), manifest_path)
    problems: list[str] = []
    listed = {entry.path: entry for entry in manifest.files}
    for entry in manifest.files:
        path = directory / entry.path
        if not path.is_file():
            problems.append(
                f"{entry.path}: missing; expected sha256 {entry.sha256} ({entry.size_bytes} bytes)"
            )
            continue
        found = _sha256(path)
        if found != entry.sha256:
            problems.append(
                f"{entry.path}: changed; expected sha256 {entry.sha256} ({entry.size_bytes} bytes), "
                f"found sha256 {found} ({path.stat().st_size} bytes)"
            )
    for extra in _listed_files(directory):
        if extra not in listed:
            problems.append(f"{extra}: not listed in the manifest; found sha256 {_sha256(directory / extra)}")
    if problems:
        raise ExportVerificationError(directory, problems)
    return manifest


# --------------------------------------------------------------------------- state dict


@dataclass(frozen=True)
class _Adapter:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


def _split_lora(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, _Adapter]]:
    """Separate the base weights from the LoRA pairs, keyed by module name."""
    base: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if name.endswith(_LORA_A_SUFFIX):
            halves.setdefault(name.removesuffix(_LORA_A_SUFFIX), {})["a"] = tensor
        elif name.endswith(_LORA_B_SUFFIX):
            halves.setdefault(name.removesuffix(_LORA_B_SUFFIX), {})["b"] = tensor
        elif ".lora_" in name:
            raise ValueError(
                f"state dict key {name!r} looks like a LoRA tensor but is neither "
                f"<module>{_LORA_A_SUFFIX} nor <module>{_LORA_B_SUFFIX}"
            )
        else:
            base[name] = tensor
    adapters: dict[str, _Adapter] = {}
    for module, pair in sorted(halves.items()):
        for half, suffix in (("a", _LORA_A_SUFFIX), ("b", _LORA_B_SUFFIX)):
            if half not in pair:
                raise ValueError(
                    f"state dict has {module}{_LORA_A_SUFFIX if half == 'b' else _LORA_B_SUFFIX} "
                    f"but no {module}{suffix}"
                )
        adapters[module] = _Adapter(pair["a"], pair["b"])
    return base, adapters


def _check_adapters(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, _Adapter], lora: LoRAConfig
) -> None:
    """Every LoRA pair sits on a targeted module with a base weight, at ``lora.rank``, shapes agreeing."""
    if not adapters:
        raise ValueError(
            "the state dict holds no LoRA tensors (<module>.lora_A.weight / lora_B.weight); "
            "export it with kind='full'"
        )
    for module, adapter in adapters.items():
        if not lora.targets(module):
            raise ValueError(
                f"state dict adapts {module!r}, which lora.target_modules={list(lora.target_modules)!r} "
                "does not target"
            )
        weight = base.get(f"{module}.weight")
        if weight is None or weight.dim() != 2:
            raise ValueError(
                f"LoRA module {module!r} has no 2-D base weight {module}.weight in the state dict"
            )
        out_features, in_features = weight.shape
        expected_a, expected_b = (lora.rank, in_features), (out_features, lora.rank)
        if tuple(adapter.a.shape) != expected_a or tuple(adapter.b.shape) != expected_b:
            raise ValueError(
                f"LoRA module {module!r}: lora_A is {list(adapter.a.shape)} and lora_B "
                f"{list(adapter.b.shape)}; with rank {lora.rank} and base weight "
                f"{list(weight.shape)} they must be {list(expected_a)} and {list(expected_b)}"
            )


def _merged(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, _Adapter], scaling: float
) -> dict[str, torch.Tensor]:
    """``W + scaling * B @ A`` for each adapted module, in float32 (cast to the export dtype later)."""
    merged = dict(base)
    for module, adapter in adapters.items():
        name = f"{module}.weight"
        delta = adapter.b.detach().float() @ adapter.a.detach().float()
        merged[name] = base[name].detach().float() + scaling * delta
    return merged


def _checkpoint_weights(tensors: dict[str, torch.Tensor], source_model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` would store them, after checking them against the architecture.

    A skeleton of the source config's model on the meta device (no memory) gives the expected
    names and shapes and the tied pairs; a wrong name (an FSDP or Megatron prefix, a missing
    layer) fails here naming the keys, not later at load. Tied aliases (``lm_head.weight`` with
    ``tie_word_embeddings``) are dropped after checking they still equal their source: a
    trained, diverged ``lm_head`` would otherwise be lost silently on reload.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(source_model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    tied: dict[str, str] = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    tensors = dict(tensors)
    for alias, source in tied.items():
        if alias in tensors:
            if source in tensors and not torch.equal(tensors[alias], tensors[source]):
                raise ValueError(
                    f"{alias} is tied to {source} (tie_word_embeddings in {source_model_dir / CONFIG_FILE}) "
                    "but the state dict holds different values for them; the export stores only "
                    f"{source}, so the trained {alias} would be lost"
                )
            del tensors[alias]
    missing = sorted(expected.keys() - tied.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"the state dict does not match the architecture of {source_model_dir / CONFIG_FILE}: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"state dict tensor {name} has shape {list(tensor.shape)}; the architecture of "
                f"{source_model_dir / CONFIG_FILE} has {list(expected[name])}"
            )
    return dict(revert_weight_conversion(skeleton, tensors))


# --------------------------------------------------------------------------- writing


def _fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` survive a power loss (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shards(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in key order, sizes counted in the saved dtype (huggingface_hub's rule).

    A tensor larger than ``max_shard_bytes`` gets a shard of its own, as in ``save_pretrained``.
    """
    shards: list[list[str]] = [[]]
    current = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, tensor in tensors.items():
        size = tensor.numel() * itemsize
        if shards[-1] and current + size > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += size
    return shards


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """One file, each tensor cast to ``dtype`` only now, so at most one shard's casts exist at once."""
    cast = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in tensors.items()}
    # A tensor already in ``dtype`` passes through ``to`` as is; safetensors refuses tensors
    # that share storage (aliases, views into one flat buffer), so those are cloned.
    storages: set[int] = set()
    for name, tensor in cast.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
            cast[name] = tensor
        storages.add(tensor.untyped_storage().data_ptr())
    save_file(cast, str(path), metadata={"format": "pt"})
    _fsync_file(path)


def _write_model_weights(
    staging: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int
) -> None:
    shards = _shards(tensors, dtype, max_shard_bytes)
    if len(shards) == 1:
        _write_safetensors(staging / WEIGHTS_FILE, tensors, dtype)
        return
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(staging / filename, {name: tensors[name] for name in names}, dtype)
        weight_map.update(dict.fromkeys(names, filename))
    itemsize = torch.empty((), dtype=dtype).element_size()
    parameters = sum(t.numel() for t in tensors.values())
    index_body = {
        "metadata": {"total_parameters": parameters, "total_size": parameters * itemsize},
        "weight_map": weight_map,
    }
    _write_text(staging / WEIGHTS_INDEX_FILE, json.dumps(index_body, indent=2, sort_keys=True) + "\n")


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    _fsync_file(path)


def _copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    _fsync_file(target)


def _write_model_configs(staging: Path, source_model_dir: Path, dtype: ExportDtype) -> None:
    """``config.json`` with its dtype set to the saved one (loaders with ``dtype="auto"`` and vLLM
    read it to pick the compute dtype); ``generation_config.json`` copied unchanged."""
    config_path = source_model_dir / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"source_model_dir: cannot read {config_path}: {error}") from error
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    for key in keys:
        config[key] = dtype
    _write_text(staging / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (source_model_dir / GENERATION_CONFIG_FILE).is_file():
        _copy(source_model_dir / GENERATION_CONFIG_FILE, staging / GENERATION_CONFIG_FILE)


def _copy_tokenizer(staging: Path, tokenizer_dir: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if "tokenizer_config.json" not in present:
        raise FileNotFoundError(
            f"tokenizer_dir: {tokenizer_dir} has no tokenizer_config.json; pass the directory a "
            "tokenizer was saved to (it may be the model directory)"
        )
    for name in present:
        _copy(tokenizer_dir / name, staging / name)
    for name in TOKENIZER_DIRECTORIES:
        if (tokenizer_dir / name).is_dir():
            (staging / name).mkdir()
            for source in sorted((tokenizer_dir / name).iterdir()):
                if source.is_file():
                    _copy(source, staging / name / source.name)


def peft_adapter_config(lora: LoRAConfig, base_model_name_or_path: str) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for a plain LoRA adapter.

    vLLM's ``PEFTHelper`` requires ``r``, ``lora_alpha`` and ``target_modules``, computes the
    scaling as ``lora_alpha / r`` unless ``use_rslora``, and rejects ``bias != "none"``, DoRA and
    ``modules_to_save`` (other than a classifier); PEFT's ``LoraConfig`` reads the rest.
    """
    alpha: float | int = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


@contextlib.contextmanager
def _published(output_dir: Path) -> Iterator[Path]:
    """Yield a staging directory; on normal exit rename it to ``output_dir`` (see the module docstring)."""
    parent, name = output_dir.parent, output_dir.name
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; an export is for everyone to read
        yield staging
        _fsync_directory(staging)
        replaced: Path | None = None
        if output_dir.exists() or output_dir.is_symlink():
            replaced = parent / f".{name}.replaced-{secrets.token_hex(4)}"
            output_dir.rename(replaced)
        try:
            staging.rename(output_dir)
        except OSError:
            if replaced is not None:
                replaced.rename(output_dir)
            raise
        _fsync_directory(parent)
        for old in parent.glob(f".{name}.replaced-*"):
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_directory(value: str | os.PathLike[str], argument: str, required_file: str) -> Path:
    path = Path(value)
    if not (path / required_file).is_file():
        raise FileNotFoundError(f"{argument}={str(path)!r} has no {required_file}")
    return path


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    output_dir: str | os.PathLike[str],
    *,
    step: int,
    kind: ExportKind,
    source_model_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    dtype: ExportDtype,
    lora: LoRAConfig | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base_model_name_or_path: str | None = None,
) -> Manifest:
    """Write ``state_dict`` as a Hugging Face export at ``output_dir``; return its manifest.

    ``kind`` and the layout are described in the module docstring. ``lora`` is required for
    ``merged`` and ``adapter`` (the scaling and the adapter config come from it).
    ``base_model_name_or_path`` goes into an adapter's config; it defaults to the absolute path
    of ``source_model_dir`` (pass a hub id when publishing). ``output_dir`` is replaced if it
    exists (re-export of a step). The tensors are not modified; each is cast to ``dtype`` (on
    the CPU) only while its file is written.

    Raises ``ValueError`` naming the argument or state-dict key for a bad request (LoRA tensors
    in a ``full`` export, names or shapes that do not fit the source architecture, ...), and
    ``FileNotFoundError`` for a directory without its config or tokenizer files. Nothing is
    left at ``output_dir`` (or the previous export stays) when any step fails.
    """
    if kind not in EXPORT_KINDS:
        raise ValueError(f"kind={kind!r} is not supported; allowed: {', '.join(EXPORT_KINDS)}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(EXPORT_DTYPES)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    if kind != "full" and lora is None:
        raise ValueError(
            f"kind={kind!r} needs lora= (rank, alpha, target_modules) to scale and describe the adapters"
        )
    source_model_dir = _check_directory(source_model_dir, "source_model_dir", CONFIG_FILE)
    tokenizer_dir = Path(tokenizer_dir)
    output_dir = Path(output_dir)
    torch_dtype = EXPORT_DTYPES[dtype]

    base, adapters = _split_lora(state_dict)
    if kind == "full" and adapters:
        raise ValueError(
            f"the state dict holds LoRA tensors for {len(adapters)} modules (e.g. {next(iter(adapters))}); "
            "kind='full' would drop them and export the untrained base: use kind='merged' (adapters "
            "folded into the weights) or kind='adapter' (PEFT adapter only)"
        )
    if kind != "full":
        assert lora is not None
        _check_adapters(base, adapters, lora)

    with _published(output_dir) as staging:
        if kind == "adapter":
            assert lora is not None
            peft_tensors: dict[str, torch.Tensor] = {}
            for module, adapter in adapters.items():
                peft_tensors[f"{PEFT_KEY_PREFIX}{module}{_LORA_A_SUFFIX}"] = adapter.a
                peft_tensors[f"{PEFT_KEY_PREFIX}{module}{_LORA_B_SUFFIX}"] = adapter.b
            _write_safetensors(staging / ADAPTER_WEIGHTS_FILE, peft_tensors, torch_dtype)
            base_name = base_model_name_or_path or str(source_model_dir.resolve())
            config_text = json.dumps(peft_adapter_config(lora, base_name), indent=2, sort_keys=True) + "\n"
            _write_text(staging / ADAPTER_CONFIG_FILE, config_text)
        else:
            weights = dict(base)
            if kind == "merged":
                assert lora is not None
                weights = _merged(base, adapters, lora.scaling)
            weights = _checkpoint_weights(weights, source_model_dir)
            _write_model_weights(staging, weights, torch_dtype, max_shard_bytes)
            _write_model_configs(staging, source_model_dir, dtype)
        _copy_tokenizer(staging, tokenizer_dir)
        files = tuple(
            ManifestFile(path, _sha256(staging / path), (staging / path).stat().st_size)
            for path in _listed_files(staging)
        )
        manifest = Manifest(
            MANIFEST_FORMAT_VERSION, kind, step, dtype, files, lora if kind != "full" else None
        )
        _write_text(staging / MANIFEST_FILE, manifest.to_json())
    return manifest
