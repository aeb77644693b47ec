"""What the planner plans for: the models of a job and the work of one RL step (pure).

A :class:`ModelShape` is a decoder's architecture (the resharding module's
:class:`~hybridflow.resharding.layout.DecoderSpec`), so the planner counts parameters and the
bytes the 3D-HybridEngine moves with the same layout code the transfer runs on. A
:class:`Workload` is one RL step of a job: which models exist, which of them train, how many
sequences of which lengths pass through each phase.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from hybridflow.resharding.layout import DecoderSpec, ModelLayout, ReshardingError, decoder_layout
from hybridflow.spec.training import DEFAULT_FSDP_UNIT_MIN_PARAMETERS

__all__ = [
    "PAPER_MODELS",
    "ModelRole",
    "ModelShape",
    "PlannerInputError",
    "Workload",
    "model_shape_from_dir",
]

ModelRole = Literal["actor", "reference", "critic", "reward", "cost"]
"""The models of an RL step. The rollout is not a model of its own: it is the actor, resharded
to its generation layout on the actor's GPUs (the 3D-HybridEngine), so it never gets a pool."""


class PlannerInputError(ValueError):
    """A job the planner cannot plan for (the message names the field, the value and what is allowed)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model: its name (for the printout) and its architecture."""

    name: str
    decoder: DecoderSpec

    @property
    def params(self) -> int:
        """Number of parameters (untied embedding and ``lm_head`` both counted)."""
        return _param_bytes(self.decoder, 1)[0] + _param_bytes(self.decoder, 1)[1]

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (every layer of a decoder has the same)."""
        return sum(param.numel for param in _layout(self.decoder, 1).params if param.layer == 0)

    def param_bytes(self, itemsize: int) -> tuple[int, int]:
        """``(partitioned, replicated)`` bytes of the weights: ``ModelLayout``'s two kinds (cached)."""
        return _param_bytes(self.decoder, itemsize)

    def layout(self, itemsize: int) -> ModelLayout:
        """The HF parameter layout with ``itemsize`` bytes per element (cached: the search asks often)."""
        return _layout(self.decoder, itemsize)

    def replicated_bytes_from_other_stages(self, pp: int, itemsize: int) -> int:
        """The most TP-replicated bytes a rank lacks when its generation stage spans all ``pp`` stages."""
        return _replicated_from_other_stages(self.decoder, pp, itemsize)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V cache one token takes over all layers (the whole model, before TP)."""
        d = self.decoder
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * itemsize


@lru_cache(maxsize=64)
def _param_bytes(decoder: DecoderSpec, itemsize: int) -> tuple[int, int]:
    layout = _layout(decoder, itemsize)
    return layout.partitioned_bytes, layout.replicated_bytes


@lru_cache(maxsize=256)
def _replicated_from_other_stages(decoder: DecoderSpec, pp: int, itemsize: int) -> int:
    layout = _layout(decoder, itemsize)
    per_stage = [
        sum(param.numel for param in layout.stage_params(pp, stage) if not param.partitioned) * itemsize
        for stage in range(pp)
    ]
    return sum(per_stage) - min(per_stage)


@lru_cache(maxsize=64)
def _layout(decoder: DecoderSpec, itemsize: int) -> ModelLayout:
    return decoder_layout(decoder, itemsize)


def _llama(
    name: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int = 32000
) -> ModelShape:
    return ModelShape(
        name,
        DecoderSpec(
            arch="llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hidden // heads,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            qkv_bias=False,
        ),
    )


PAPER_MODELS: dict[str, ModelShape] = {
    # The Llama-2 family the HybridFlow paper evaluates (7B-70B); shapes from the published HF
    # configs (meta-llama/Llama-2-*-hf, codellama/CodeLlama-34b-hf). 34B and 70B use GQA.
    "llama-7b": _llama("llama-7b", layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32),
    "llama-13b": _llama("llama-13b", layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40),
    "llama-34b": _llama("llama-34b", layers=48, hidden=8192, ffn=22016, heads=64, kv_heads=8),
    "llama-70b": _llama("llama-70b", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8),
}


def model_shape_from_dir(path: str | Path, *, field: str) -> ModelShape:
    """Read ``config.json`` of an HF model directory into a :class:`ModelShape`.

    Only the JSON is read (no transformers, no weights), so planning a 70B job is instant.
    ``field`` is the spec path named in errors, e.g. ``spec.models.actor.path``.
    """
    config_path = Path(path) / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise PlannerInputError(f"{field}: cannot read {config_path}: {err}") from err
    config = SimpleNamespace(**raw)
    try:
        decoder = DecoderSpec.from_hf_config(config)
    except (ReshardingError, AttributeError, TypeError) as err:
        raise PlannerInputError(f"{field}: {config_path} is not a supported decoder config: {err}") from err
    return ModelShape(Path(path).name or str(path), decoder)


@dataclass(frozen=True)
class Workload:
    """One RL step: the models, the sequences and the numeric formats.

    ``sequences`` responses of ``response_tokens`` tokens are generated for prompts of
    ``prompt_tokens`` tokens; every scoring model runs one forward pass over all of them, the
    actor and the critic one optimizer pass (``update_epochs`` passes over the batch).
    ``backend`` decides which training layouts exist (``fsdp``: data parallel only).

    Two constraints of this runtime, off for the paper-scale study: ``mini_batch_sequences``
    (when set) and ``sequences`` must split into whole micro-batches on every data-parallel rank
    of a trained model (``spec.training``'s rules; the last mini-batch may be smaller), and ``shared_model_parallel`` makes the actor, reference and critic use one
    ``(p, t)`` (``spec.training``) and the reward and cost models plain data parallelism.
    """

    actor: ModelShape
    sequences: int
    prompt_tokens: int
    response_tokens: int
    critic: ModelShape | None = None
    reward: ModelShape | None = None
    cost: ModelShape | None = None
    backend: Literal["fsdp", "megatron"] = "megatron"
    rollout_engine: Literal["torch", "vllm"] = "torch"
    """The actor's generation engine, which decides the generation layouts it can reshard to:
    megatron's shards go to every ``t_g`` dividing ``t`` (the 3D-HybridEngine's layouts) on
    either engine; FSDP's to ``t_g = 1`` on the torch engine and to any ``t_g`` dividing the pool
    on vLLM (``vllm-tensor-parallel-divides-actor-pool``)."""
    param_bytes: int = 2
    micro_batch_sequences: int = 8
    update_epochs: int = 1
    mini_batch_sequences: int | None = None
    shared_model_parallel: bool = False
    fsdp_unit_min_parameters: int = DEFAULT_FSDP_UNIT_MIN_PARAMETERS
    """FSDP's smallest unit of decoder layers (``spec.training.fsdpUnitMinParameters``): how many
    units, hence collectives, a pass issues."""

    def __post_init__(self) -> None:
        for name in (
            "sequences",
            "prompt_tokens",
            "response_tokens",
            "micro_batch_sequences",
            "update_epochs",
        ):
            if getattr(self, name) < 1:
                raise PlannerInputError(f"workload.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def tokens(self) -> int:
        """Tokens of every sequence of the step, prompt and response (the paper's throughput unit)."""
        return self.sequences * (self.prompt_tokens + self.response_tokens)

    def models(self) -> dict[ModelRole, ModelShape]:
        """Every model of the step by role; the reference is a copy of the actor."""
        found: dict[ModelRole, ModelShape] = {"actor": self.actor, "reference": self.actor}
        if self.critic is not None:
            found["critic"] = self.critic
        if self.reward is not None:
            found["reward"] = self.reward
        if self.cost is not None:
            found["cost"] = self.cost
        return found

    @staticmethod
    def trains(role: ModelRole) -> bool:
        return role in ("actor", "critic")
