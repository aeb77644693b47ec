"""Loading the models an FSDP worker trains or scores with, from a local HF directory.

Every rank of a worker group calls these functions itself, on the same directory, before
:func:`~hybridflow.backends.fsdp.parallelize.shard_model`. ``fully_shard`` keeps each rank's
own slice of its *local* copy, so all ranks must hold identical full weights first: that is
why nothing here draws random numbers (the value head is zero-initialised) and why loading
never falls back to randomly initialising a weight the checkpoint lacks (it raises instead).

Models come from a local path or a mounted volume only: ``local_files_only=True`` makes a
missing directory fail here, with its path, rather than turn into a model-hub request.

Attention implementation: ``"sdpa"``, as in the rollout engine
(:mod:`hybridflow.engines.torch_engine` loads with transformers' default, sdpa). On CPU
(torch 2.13, fp32) sdpa and eager agree to ~2e-7 on the logits of every real token of a
left-padded batch, and so does a left-padded row with the same row run alone; the two kernels
differ only at padding query positions, whose outputs no loss or log-prob reads. sdpa is also the
memory-efficient choice on GPUs, and matching the rollout engine keeps the trainer's log-probs
closest to the ones the engine sampled with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

ATTN_IMPLEMENTATION = "sdpa"
"""The attention kernel every model loaded here uses by default; see the module docstring for why."""


def attention_implementation(device: torch.device, *, packed: bool, bf16: bool) -> str:
    """The kernel for a trained or scoring model: flash-attention 2 for packed bf16 passes on CUDA.

    Packed rows (:func:`~hybridflow.backends.fsdp.logprobs.pack_sequences`) need the attention
    to stay within each sequence: flash-attention's variable-length kernel does that from the
    restarting position ids without any mask, where installed (it computes in bf16/fp16 only);
    everywhere else sdpa gets transformers' block-diagonal causal mask.
    """
    if packed and bf16 and device.type == "cuda":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return ATTN_IMPLEMENTATION


_HEAD_PREFIXES = ("lm_head.", "score.")
"""Checkpoint keys a backbone may leave unused: the LM head of a causal-LM directory, or the
scalar ``score`` head of a sequence-classification (reward model) directory, which
:func:`load_value_model` then loads into the value head itself. Any other unused or missing key
means the directory is not the architecture we think it is."""

SCORE_HEAD_KEY = "score.weight"
"""The head of ``*ForSequenceClassification`` checkpoints with ``num_labels=1`` (reward models)."""


def _model_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a Hugging Face model directory (no config.json); models load from "
            "a local path or volume, never from a model hub"
        )
    return directory


class _DropLoadReport(logging.Filter):
    """Drops transformers' "LOAD REPORT" warning; the caller checks the same facts itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextmanager
def _quiet_load_report() -> Iterator[None]:
    # transformers prints a table for every unused checkpoint key. Loading a backbone from a
    # causal-LM directory always leaves lm_head.weight unused, and every critic rank would print
    # it; _check_loading_info raises on the keys that do matter instead.
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _DropLoadReport()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _check_loading_info(directory: Path, info: dict[str, Any], allowed_unexpected: tuple[str, ...]) -> None:
    missing = sorted(info.get("missing_keys", ()))
    unexpected = sorted(
        key for key in info.get("unexpected_keys", ()) if not key.startswith(allowed_unexpected)
    )
    if missing or unexpected:
        raise ValueError(
            f"{directory} does not match its config.json architecture: missing weights {missing or 'none'}, "
            f"unused weights {unexpected or 'none'}; refusing to train a partly random model"
        )


def load_causal_lm(
    path: str | Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ATTN_IMPLEMENTATION
) -> nn.Module:
    """The causal LM in ``path`` (an HF directory) on the CPU, in ``dtype``, in eval mode.

    Called by the actor and reference workers on every rank before sharding. Keep ``dtype``
    float32 for a model that trains, also under mixed precision: the optimizer then holds fp32
    master weights and FSDP casts to bf16 for compute only
    (:func:`~hybridflow.backends.fsdp.parallelize.shard_model`).

    Eval mode is what ``from_pretrained`` returns. The Qwen2/Llama families have no dropout
    (``attention_dropout`` 0), so the workers' ``train()`` / ``eval()`` switches change no output;
    a config with dropout would make the update pass's log-probs differ from the old log-probs
    of the same weights (PPO's ratio would not start at 1). ``config.use_cache`` is turned off,
    since training forwards never decode. ``attn_implementation``: sdpa, or what
    :func:`attention_implementation` picks for packed passes.
    """
    directory = _model_dir(path)
    with _quiet_load_report():
        # Typed Any: with output_loading_info the call returns (model, info), which the stubs miss.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        )
    model, info = loaded
    _check_loading_info(directory, info, ())
    model.config.use_cache = False
    module: nn.Module = model
    return module.eval()


class ValueModel(nn.Module):
    """A critic: a decoder backbone (no LM head) and a linear value head, one value per token.

    ``forward(input_ids, attention_mask, position_ids)`` returns ``values [B, T]``: the value of
    the state after reading tokens ``0..t`` at column ``t`` (see
    :func:`~hybridflow.backends.fsdp.logprobs.token_values` for which columns score a response).

    The value head is zero-initialised, so the critic starts at V = 0 everywhere (a neutral
    baseline) and, more importantly, every rank builds the identical head with no RNG and no
    broadcast: ``fully_shard`` keeps each rank's slice of its local copy, so a randomly drawn
    head would silently differ between shards. The backbone's gradients are zero for the first
    update (the head's weight is zero) and flow from the second on.

    A plain ``nn.Module``: ``state_dict()`` has the keys ``backbone.<HF base-model name>`` and
    ``value_head.weight`` / ``value_head.bias``, and ``load_state_dict`` restores it.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        config = getattr(backbone, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"backbone {type(backbone).__name__} has no Hugging Face config")
        first_parameter = next(backbone.parameters())
        self.backbone = backbone
        self.value_head = nn.Linear(
            config.hidden_size, 1, dtype=first_parameter.dtype, device=first_parameter.device
        )
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's HF config (hidden size, layer count...)."""
        config: PretrainedConfig = cast(PretrainedConfig, self.backbone.config)
        return config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        # A copy, not the squeeze view: FSDP2 hooks the root's output for backward, and an in-place
        # op on a view of it would bypass that hook (torch warns about returning views).
        values: torch.Tensor = self.value_head(hidden).squeeze(-1).clone()
        return values


def load_value_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = ATTN_IMPLEMENTATION
) -> ValueModel:
    """A :class:`ValueModel` whose backbone is the decoder of the causal LM in ``path``.

    Called by the critic workers on every rank before sharding. ``path`` is an ordinary
    causal-LM directory (the actor's initial checkpoint, as is usual for PPO critics); its LM head
    is left unused and the value head starts at zero. A reward-model directory
    (``*ForSequenceClassification`` with ``num_labels=1``) loads its ``score.weight`` into the
    value head, so the model scores as it was trained to (the reward worker reads the value at the
    last response token). Eval mode and ``use_cache=False`` as in :func:`load_causal_lm`.
    Resuming a trained critic goes through the DCP checkpoint, not through this function.
    ``attn_implementation`` as in :func:`load_causal_lm`.
    """
    directory = _model_dir(path)
    with _quiet_load_report():
        loaded: Any = AutoModel.from_pretrained(
            directory,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        )
    backbone, info = loaded
    _check_loading_info(directory, info, _HEAD_PREFIXES)
    backbone.config.use_cache = False
    model = ValueModel(backbone)
    score = _checkpoint_score_head(directory)
    if score is not None:
        if tuple(score.shape) != tuple(model.value_head.weight.shape):
            raise ValueError(
                f"{directory}: {SCORE_HEAD_KEY} has shape {tuple(score.shape)}; a reward model needs "
                f"num_labels=1, i.e. {tuple(model.value_head.weight.shape)}"
            )
        with torch.no_grad():
            model.value_head.weight.copy_(score.to(model.value_head.weight.dtype))
    return model.eval()


def _checkpoint_score_head(directory: Path) -> torch.Tensor | None:
    """The ``score.weight`` tensor of a reward-model checkpoint, or None for a causal-LM directory."""
    from safetensors import safe_open

    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if SCORE_HEAD_KEY in f.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                tensor: torch.Tensor = f.get_tensor(SCORE_HEAD_KEY)
                return tensor
    return None
