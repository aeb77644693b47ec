"""A rollout engine in plain torch over any HF causal LM: the reference engine and the CPU fallback.

It is slower than vLLM (no paged attention, no continuous batching: a batch decodes until its
longest response ends) but it runs wherever the model runs, needs nothing beyond
``transformers``, and is simple enough to be the reference the vLLM engine is tested against.

Decoding, for ``B = len(prompts) * n`` rows:

1. Prompts are left-padded to the longest one, so every row's last prompt token sits in the
   same column and all rows decode in lockstep. ``position_ids`` count real tokens only
   (``cumsum(attention_mask) - 1``), so a padded row sees the same positions as it would alone
   and as the trainer's forward pass gives it (:mod:`hybridflow.engines.layout`). RoPE only
   sees position differences, so shifted positions would barely change the output of these
   models; they would still break absolute-position models and exact comparisons.
2. One prefill forward pass fills a preallocated ``StaticCache`` (prompt width +
   ``max_new_tokens`` columns) with the prompts' keys and values. It runs each prompt once,
   not once per sample: the ``n`` rows of a prompt get copies of its keys and values and of
   its last column's logits (a sliding-window model, whose cache keeps only its window,
   prefills every row). Each following step feeds
   only the tokens just chosen, writes them into the next cache column in place, unmasks that
   column of a preallocated attention mask and advances each row's position by one.
3. A row stops when it emits an eos token (kept as its last token); after that it is fed pad
   tokens, whose outputs are discarded. The loop ends when every row stopped or after
   ``max_new_tokens`` steps.

The pad token is never chosen (greedy or sampled) unless it is also an eos id
(:func:`~hybridflow.engines.base.unsampled_token`); the log-probs stay the unmasked policy's.
With ``temperature == 0`` the tokens equal ``model.generate(do_sample=False,
suppress_tokens=[pad])`` with the same eos ids, token for token (the tests check it).

Compiled decoding (``compile_decode=True``, ``spec.rollout.compile``): the decode step, the one
forward pass that runs ``max_new_tokens`` times per call, goes through ``torch.compile`` with
static shapes, and on CUDA through CUDA graphs (``mode="reduce-overhead"``). Its inputs keep one
shape for the whole job: the cache is ``cache_width`` columns wide (the worker passes
``data.maxPromptTokens + rollout.maxResponseTokens``) and reused from call to call, and every
step passes the whole attention mask, whose columns past the current one are still 0 (causality
masks them anyway). A new batch size compiles once more. The prefill, whose width follows the
batch's longest prompt, stays eager. Tokens equal the eager engine's up to floating-point
reassociation inside the fused kernels (a test bounds the log-prob difference).
:attr:`compile_seconds` is the time ``torch.compile`` has spent in this process, which the
rollout reports as its own step phase.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, StaticCache

from hybridflow.compilation import compile_seconds_so_far, compiled_module
from hybridflow.engines.base import (
    EngineStateError,
    FinishReason,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    check_prompts,
    unsampled_token,
    without_token,
)
from hybridflow.models.lora import LoRAConfig, apply_lora, initialize_adapters
from hybridflow.resharding.fingerprint import FingerprintPlan, state_dict_fingerprint

EngineState = Literal["awake", "asleep", "closed"]


def _as_id_list(value: Any) -> list[int]:
    """A config's token id field (``None``, an int, or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token_id) for token_id in value]


def _configured_eos_ids(model: nn.Module) -> list[int]:
    """The eos ids HF ``generate`` would stop on: the generation config's, else the model config's."""
    generation_config = getattr(model, "generation_config", None)
    eos_ids = _as_id_list(getattr(generation_config, "eos_token_id", None))
    return eos_ids or _as_id_list(getattr(getattr(model, "config", None), "eos_token_id", None))


def _configured_pad_id(model: nn.Module, eos_ids: Sequence[int]) -> int:
    """A token id to fill padded positions with; any valid id works, since they are masked."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        pad_ids = _as_id_list(getattr(source, "pad_token_id", None))
        if pad_ids:
            return pad_ids[0]
    return eos_ids[0] if eos_ids else 0


def _filter_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Scores with everything below the k-th largest of each row set to ``-inf`` (ties kept)."""
    if top_k < 0 or top_k >= scores.shape[-1]:
        return scores
    kth_largest = torch.topk(scores, top_k, dim=-1).values[:, -1:]
    return scores.masked_fill(scores < kth_largest, float("-inf"))


def _filter_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside each row's nucleus set to ``-inf``.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``:
    a token is kept while the mass of the tokens ranked above it is still below ``top_p``, so
    the most likely token is always kept.
    """
    if top_p >= 1.0:
        return scores
    sorted_scores, sorted_ids = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_ranked_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = mass_ranked_above >= top_p
    remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_ids, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def choose_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]`` (float32): argmax when greedy, else a draw.

    Sampling applies temperature, then top-k, then top-p (vLLM's order), then draws from the
    renormalised distribution with ``generator``.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probabilities(logits, params)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a sampled token is drawn from: softmax after temperature, top-k, then top-p (vLLM's order)."""
    scores = logits / params.temperature
    scores = _filter_top_p(_filter_top_k(scores, params.top_k), params.top_p)
    return scores.softmax(dim=-1)


class TorchRolloutEngine(RolloutEngine):
    """Batched generation with a KV cache over a Hugging Face causal LM (see the module docstring).

    ``model`` is a local HF model directory, or an HF causal-LM module (``forward`` accepting
    ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values``, ``use_cache``,
    ``logits_to_keep``, as every ``*ForCausalLM`` does). A directory is loaded onto ``device``
    (default CPU) in ``dtype`` (default float32). A module is used as it is, shared and not
    copied: ``device``/``dtype``, when given, move it in place (``nn.Module.to``), and
    ``load_weights`` writes into it. That is how a colocated worker lets the trainer and the
    engine share one set of weights.

    ``eos_token_ids`` defaults to the model's generation config (what HF ``generate`` stops
    on), ``pad_token_id`` to its pad id; the pad id only fills masked positions and is never
    sampled unless it is also an eos id (:func:`~hybridflow.engines.base.unsampled_token`).

    ``compile_decode`` compiles the decode step (module docstring); ``cache_width`` is then the
    fixed width of the cache, the longest prompt plus ``max_new_tokens`` the caller will ask
    for (unset: rounded up to a multiple of 64 per call, a compile per distinct width).

    ``lora`` (a directory only) adapts the loaded model's linears (:mod:`hybridflow.models.lora`)
    with adapters at zero, the base model: a LoRA trainer's syncs then load the adapter's
    tensors alone (``...q_proj.lora_A.weight``), and the forward pass applies them.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | nn.Module,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        *,
        compile_decode: bool = False,
        cache_width: int | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        module: nn.Module
        if isinstance(model, nn.Module):
            module = model
            if device is not None or dtype is not None:
                module.to(device=device, dtype=dtype)
        else:
            path = Path(model)
            if not path.is_dir():
                raise FileNotFoundError(
                    f"model directory {path} does not exist (models load from local paths only)"
                )
            # cast: transformers types PreTrainedModel.to through a decorator mypy misreads.
            module = cast(nn.Module, AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32))
            if (
                lora is not None
            ):  # the base from the checkpoint; the adapter (zero until a sync) applied in forward
                apply_lora(module, lora)
                initialize_adapters(module, seed=0)
            module.to(device or "cpu")
        first_parameter = next(module.parameters(), None)
        if first_parameter is None:
            raise ValueError("the model has no parameters")
        self._model: nn.Module | None = module
        # A shared module may be FSDP2-sharded: its hooks unshard parameters on every forward,
        # which inference mode forbids (inference tensors have no version counter), so a shared
        # module decodes under no_grad instead.
        self._shared = isinstance(model, nn.Module)
        self._device = first_parameter.device
        config = getattr(module, "config", None)
        self._vocab_size: int | None = getattr(config, "vocab_size", None)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._eos_token_ids = (
            list(eos_token_ids) if eos_token_ids is not None else _configured_eos_ids(module)
        )
        self._pad_token_id = (
            pad_token_id if pad_token_id is not None else _configured_pad_id(module, self._eos_token_ids)
        )
        self._unsampled = unsampled_token(self._pad_token_id, self._eos_token_ids)
        self._state: EngineState = "awake"
        self._parameter_shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        self._discarded: set[str] = set()  # parameters sleep(level=2) released and no load has restored
        if cache_width is not None and cache_width < 2:
            raise ValueError(f"cache_width={cache_width}: a prompt token and a new token need 2 columns")
        self._cache_width = cache_width
        # The decode step's callable: the module itself, or its compiled wrapper (same parameters).
        self._decode_forward: Any = compiled_module(module, self._device) if compile_decode else module
        self._compiled = compile_decode
        self._cache: StaticCache | None = None  # reused between calls of one shape (compiled decoding)
        self._cache_shape: tuple[int, int] = (0, 0)

    # ------------------------------------------------------------------ introspection

    @property
    def model(self) -> nn.Module:
        """The module generating (shared, not a copy)."""
        return self._live_model("model")

    @property
    def device(self) -> torch.device:
        """Where the model runs while awake."""
        return self._device

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a response."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int:
        """The token fed at padded and finished positions (masked, so any valid id would do)."""
        return self._pad_token_id

    @property
    def compile_seconds(self) -> float:
        """Seconds ``torch.compile`` has spent in this process (0 without ``compile_decode``)."""
        return compile_seconds_so_far() if self._compiled else 0.0

    @property
    def state(self) -> EngineState:
        """``"awake"``, ``"asleep"`` or ``"closed"`` (see :mod:`hybridflow.engines.base`)."""
        return self._state

    def _live_model(self, call: str) -> nn.Module:
        if self._state == "closed" or self._model is None:
            raise EngineStateError(f"{call}: the engine is closed")
        return self._model

    def _awake_model(self, call: str) -> nn.Module:
        model = self._live_model(call)
        if self._state != "awake":
            raise EngineStateError(f"{call}: the engine is asleep; call wake_up() first")
        return model

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """See :meth:`RolloutEngine.generate`; decoding is described in the module docstring."""
        model = self._awake_model("generate")
        if self._discarded:
            raise EngineStateError(
                f"generate: sleep(level=2) discarded the weights and {len(self._discarded)} parameters have "
                f"not been loaded since (e.g. {sorted(self._discarded)[0]}); load every weight first"
            )
        if not prompt_token_ids:
            return RolloutOutput([], [], [] if params.return_logprobs else None)
        check_prompts(
            prompt_token_ids,
            params,
            vocab_size=self._vocab_size,
            max_length=self._max_positions,
            max_length_name="the model's max_position_embeddings",
        )
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad() if self._shared else torch.inference_mode():
                return self._decode(model, prompt_token_ids, params)
        finally:
            model.train(was_training)

    def _prefill(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: StaticCache,
        samples: int,
    ) -> torch.Tensor:
        """Fill ``cache`` with every row's prompt; the logits ``[rows, vocab]`` of each row's last column.

        ``input_ids`` holds each prompt once; row ``i`` of the batch is sample ``i % samples`` of
        prompt ``i // samples``. With ``samples > 1`` the prompts run once into a dynamic cache,
        whose keys and values are then written ``samples`` times into ``cache``: the samples of a
        prompt decode from the same prompt state, so the prefill costs one row per prompt
        instead of one per sample.
        """
        prompt_width = int(input_ids.shape[1])
        cache_position = torch.arange(prompt_width, device=input_ids.device)
        if samples > 1:
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
            )
            layers = list(outputs.past_key_values.layers)
            # A sliding-window layer keeps only its window: such a cache cannot be copied to
            # columns 0..prompt_width, so those models prefill every row instead.
            if all(layer.keys.shape[-2] == prompt_width for layer in layers):
                for layer_index, layer in enumerate(layers):
                    cache.update(
                        layer.keys.repeat_interleave(samples, dim=0),
                        layer.values.repeat_interleave(samples, dim=0),
                        layer_index,
                        {"cache_position": cache_position},
                    )
                return cast(torch.Tensor, outputs.logits[:, -1, :]).repeat_interleave(samples, dim=0)
            input_ids, attention_mask, position_ids = (
                tensor.repeat_interleave(samples, dim=0)
                for tensor in (input_ids, attention_mask, position_ids)
            )
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1,  # only the last column's logits are needed to start decoding
        )
        return cast(torch.Tensor, outputs.logits[:, -1, :])

    def _decode(self, model: nn.Module, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        device = self._device
        samples = params.n
        batch, prompt_width = len(prompts) * samples, max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), prompt_width), self._pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), prompt_width), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, prompt_width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[index, prompt_width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # Padded columns get position 0; they are masked out, so the value does not matter.
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp_min(0)

        generator: torch.Generator | None = None
        if not params.greedy:
            generator = torch.Generator(device=device)
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)

        eos_ids = torch.tensor(self._eos_token_ids, dtype=torch.long, device=device)
        tokens = torch.full(
            (batch, params.max_new_tokens), self._pad_token_id, dtype=torch.long, device=device
        )
        logprobs = torch.zeros((batch, params.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)

        # The cache and the attention mask are allocated once for prompt + max_new_tokens columns
        # and filled in place (a static cache): no per-step concatenation or reallocation.
        total_width = self._total_width(prompt_width + params.max_new_tokens)
        cache = self._static_cache(model, batch, total_width)
        full_mask = torch.zeros((batch, total_width), dtype=attention_mask.dtype, device=device)
        full_mask[:, :prompt_width] = attention_mask.repeat_interleave(samples, dim=0)
        last_logits = self._prefill(model, input_ids, attention_mask, position_ids, cache, samples)
        next_positions = position_ids[:, -1:].repeat_interleave(samples, dim=0) + 1
        for step in range(params.max_new_tokens):
            logits = last_logits.float()
            chosen = choose_next_tokens(without_token(logits, self._unsampled), params, generator)
            if params.return_logprobs:
                logprobs[:, step] = logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
            chosen = chosen.masked_fill(finished, self._pad_token_id)
            tokens[:, step] = chosen
            stopped_now = torch.isin(chosen, eos_ids) & ~finished
            lengths = torch.where(stopped_now, step + 1, lengths)
            finished |= stopped_now
            if step + 1 == params.max_new_tokens or bool(finished.all()):
                break
            column = prompt_width + step
            full_mask[:, column] = 1
            if self._compiled and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read already
            outputs = self._decode_forward(
                input_ids=chosen[:, None],
                # Compiled: the whole mask, one shape every step (later columns are still 0).
                attention_mask=full_mask if self._compiled else full_mask[:, : column + 1],
                position_ids=next_positions,
                past_key_values=cache,
                cache_position=torch.tensor([column], device=device),
                use_cache=True,
            )
            last_logits = outputs.logits[:, -1, :]
            if self._compiled:
                last_logits = last_logits.clone()  # CUDA graphs reuse their output buffer
            next_positions = next_positions + 1

        token_rows = tokens.cpu().tolist()
        logprob_rows = logprobs.cpu().tolist()
        row_lengths = lengths.cpu().tolist()
        finish_reasons: list[FinishReason] = [
            "stop" if done else "length" for done in finished.cpu().tolist()
        ]
        return RolloutOutput(
            response_token_ids=[row[:length] for row, length in zip(token_rows, row_lengths, strict=True)],
            finish_reasons=finish_reasons,
            logprobs=(
                [row[:length] for row, length in zip(logprob_rows, row_lengths, strict=True)]
                if params.return_logprobs
                else None
            ),
        )

    def _total_width(self, needed: int) -> int:
        """The cache's columns for a call that needs ``needed``: exact when eager, fixed when compiled."""
        if not self._compiled:
            return needed
        if self._cache_width is not None:
            if needed > self._cache_width:
                raise ValueError(
                    f"generate: the longest prompt plus max_new_tokens is {needed} tokens, more than the "
                    f"engine's cache_width={self._cache_width} (data.maxPromptTokens + "
                    "rollout.maxResponseTokens in a job)"
                )
            return self._cache_width
        return -(-needed // 64) * 64

    def _static_cache(self, model: nn.Module, batch: int, width: int) -> StaticCache:
        """A cache of ``batch`` rows and ``width`` columns: the previous call's, emptied, when compiled.

        A compiled decode step is specialised to its cache's tensors (static addresses, and the
        CUDA graph's buffers), so a compiled engine keeps one cache per shape; eager decoding
        allocates a fresh one per call and keeps nothing between calls.
        """
        if not self._compiled:
            return StaticCache(config=cast(Any, model).config, max_cache_len=width)
        if self._cache is None or self._cache_shape != (batch, width):
            self._cache = StaticCache(config=cast(Any, model).config, max_cache_len=width)
            self._cache_shape = (batch, width)
        else:
            self._cache.reset()
        return self._cache

    # ------------------------------------------------------------------ weights and memory

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See :meth:`RolloutEngine.load_weights`; names are the model's ``state_dict`` keys."""
        model = self._awake_model("load_weights")
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    close = difflib.get_close_matches(name, list(targets), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"load_weights: the model has no parameter {name!r}{hint}")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(target.shape)} in the model, "
                        f"got {tuple(tensor.shape)}"
                    )
                target.copy_(tensor)
                self._discarded.discard(name)

    def weight_fingerprint(
        self, plan: FingerprintPlan, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, int | None]:
        """See :meth:`RolloutEngine.weight_fingerprint`: read from the module's own parameters and buffers."""
        model = self._awake_model("weight_fingerprint")
        with torch.no_grad():
            return state_dict_fingerprint(model.state_dict(), plan, shapes)

    def sleep(self, *, level: int = 1) -> None:
        """Release the engine's accelerator memory between generations.

        ``level=1`` (the :class:`RolloutEngine` lifecycle): the weights move to host memory and
        the allocator's cached blocks are released; :meth:`wake_up` moves them back.
        ``level=2``: the weights are *discarded* (each parameter's storage released, nothing
        copied to the host), for a caller that reloads every weight after :meth:`wake_up`
        anyway, as a rollout's per-step sync does: a step then never moves a replica between
        host and device, and the device holds no replica while the trainer runs. Until every
        parameter has been loaded again, :meth:`generate` refuses, on CPU too (where nothing
        is released: the weights already live in host memory), so the contract is the same
        everywhere. Both levels drop the KV cache a compiled engine keeps between calls (an
        eager engine's lives only inside a ``generate`` call).

        Do not sleep an engine whose module a trainer is using at the same time (a shared
        module): it moves or empties that module.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}): the levels are 1 (to host memory) and 2 (discard)")
        model = self._live_model("sleep")
        if self._state == "asleep":
            return
        self._cache, self._cache_shape = None, (0, 0)  # the KV cache: rebuilt by the next generate
        if level == 2:
            self._discarded = {name for name, _ in model.named_parameters()}
            if self._device.type != "cpu":
                with torch.no_grad():
                    for parameter in model.parameters():
                        # Keep the Parameter objects (optimizers, hooks and load_weights hold
                        # them); only their storage goes, to come back empty in wake_up.
                        parameter.data = torch.empty(0, dtype=parameter.dtype, device=self._device)
        elif self._device.type != "cpu":
            model.to("cpu")
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._state = "asleep"

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` released: the weights (level 1), or empty ones to load into (level 2)."""
        model = self._live_model("wake_up")
        if self._state == "awake":
            return
        if self._device.type != "cpu":
            model.to(self._device)  # what a level-1 sleep moved to the host (a no-op for the rest)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if parameter.numel() == 0 and math.prod(self._parameter_shapes[name]) > 0:
                        # discarded by a level-2 sleep: empty storage again, for the sync to fill
                        shape = self._parameter_shapes[name]
                        parameter.data = torch.empty(shape, dtype=parameter.dtype, device=self._device)
        self._state = "awake"

    def close(self) -> None:
        """Drop the engine's reference to the model; a shared module stays usable by its owner."""
        self._model = None
        self._decode_forward = None
        self._cache = None
        self._state = "closed"
