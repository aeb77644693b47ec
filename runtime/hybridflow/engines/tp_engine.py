"""A tensor- and pipeline-parallel rollout engine for Qwen2/Llama in plain torch, fed by resharding.

Each rank of a generation replica (the ranks sharing one generation DP index of a
:class:`~hybridflow.mesh.DeviceMesh`) runs this engine on its own slice of the
weights, a :class:`~hybridflow.resharding.transfer.GenerationShard`, and the replica decodes
as one model:

* tensor parallelism (Megatron's): q/k/v, gate/up and ``lm_head`` are column-parallel (each
  rank computes its output features: its attention heads, its FFN columns, its vocabulary
  rows), ``o_proj`` and ``down_proj`` row-parallel (partial sums all-reduced over the TP
  group), the embedding vocab-parallel (each rank looks up the ids in its rows, the rest are
  zeros, then an all-reduce). The full logits are all-gathered over the TP group. RMSNorm
  weights are replicated.
* pipeline parallelism, simply: stage ``s`` runs its layers on the whole batch and sends the
  hidden states to stage ``s+1`` (point to point, TP rank to TP rank); the last stage makes
  the logits. No micro-batching: while one stage works the others wait, which is correct and
  simple, and costs throughput only when ``p_g > 1``.
* the output rank (TP rank 0 of the last stage) chooses the next tokens and broadcasts them
  over the replica, so every rank of a replica returns the same :class:`RolloutOutput` and
  feeds the same tokens into the next step; sampling randomness lives on that rank alone.

Weights are read where the resharding put them: a generation slice may be several blocks (the
training shards of a micro-DP group, one of them the rank's own training memory), and the
linear layers compute on the blocks one by one (column-parallel: concatenated outputs;
row-parallel: summed partial products), so nothing is copied. The engine never writes into
those blocks: :meth:`load_weights` replaces a parameter's blocks with an engine-owned copy.

Protocol. Construction is collective over the world the first time a mesh's groups are asked
for (see :class:`~hybridflow.resharding.transfer.SubgroupCache`). ``generate`` is collective
over the replica: every rank of it calls it with the same prompts and parameters. After
:meth:`Resharder.to_training` released the shard, ``generate`` raises until
:meth:`set_weights` gives the next one. ``sleep``/``wake_up`` only change the state: the
weights belong to the resharder (which frees them) and the KV cache lives inside one
``generate`` call.

Decoding follows :class:`~hybridflow.engines.torch_engine.TorchRolloutEngine` (left padding,
positions counting real tokens, eos kept, pad after stop and never sampled), so greedy output matches HF
``generate(do_sample=False)`` up to floating-point summation order, which TP changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
from hybridflow.mesh import DeviceMesh
from hybridflow.resharding.layout import DecoderSpec, ModelLayout, decoder_layout
from hybridflow.resharding.transfer import GenerationShard, SubgroupCache

__all__ = ["TensorParallelRolloutEngine"]

EngineState = Literal["awake", "asleep", "closed"]


@dataclass
class _LayerCache:
    """Keys and values of one layer for the local KV heads: ``[batch, kv_heads, capacity, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen2/Llama RMSNorm, with the same float32 upcast."""
    dtype = hidden.dtype
    hidden32 = hidden.to(torch.float32)
    hidden32 = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TensorParallelRolloutEngine(RolloutEngine):
    """Generation over a TP x PP replica; see the module docstring for the protocol.

    * ``spec``: the decoder's architecture (:meth:`DecoderSpec.from_hf_config`).
    * ``weights``: this rank's generation shard (``Resharder.to_generation`` or
      :meth:`GenerationShard.from_full`); it must hold every parameter of the rank's stage.
    * ``mesh``, ``rank``: the generation layout and this process's global rank in it.
    * ``groups``: the process's :class:`SubgroupCache` (shared with the resharder).
    * ``eos_token_ids``, ``pad_token_id``: as in the torch engine (the model's generation
      config, which this engine cannot read: it is given no HF model).
    """

    def __init__(
        self,
        spec: DecoderSpec,
        weights: GenerationShard,
        mesh: DeviceMesh,
        rank: int,
        groups: SubgroupCache,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty; the engine needs at least one id to stop on")
        self._spec = spec
        self._layout: ModelLayout = decoder_layout(spec)
        self._layout.check(mesh.pp_size, mesh.tp_size)
        if spec.num_heads % mesh.tp_size or spec.num_kv_heads % mesh.tp_size:
            raise ValueError(
                f"tp={mesh.tp_size} must divide num_heads={spec.num_heads} and num_kv_heads={spec.num_kv_heads}"
            )
        coord = mesh.coord(rank)
        self._rank = rank
        self._tp_size, self._tp_rank = mesh.tp_size, coord.tp
        self._pp_size, self._pp_rank = mesh.pp_size, coord.pp
        replicas: dict[int, list[int]] = {}
        for other, c in enumerate(mesh.coords):
            replicas.setdefault(c.dp, []).append(other)
        replica = replicas[coord.dp]
        self._tp_group = groups.get(mesh.groups("tp"))
        self._replica_group = groups.get(list(replicas.values()))
        stage_ranks = {mesh.coord(r).pp: r for r in replica if mesh.coord(r).tp == coord.tp}
        self._previous_stage = stage_ranks.get(coord.pp - 1)
        self._next_stage = stage_ranks.get(coord.pp + 1)
        self._output_rank = next(
            r for r in replica if mesh.coord(r).tp == 0 and mesh.coord(r).pp == mesh.pp_size - 1
        )
        per_stage = spec.num_layers // mesh.pp_size
        self._layers = range(coord.pp * per_stage, (coord.pp + 1) * per_stage)
        self._local_heads = spec.num_heads // mesh.tp_size
        self._local_kv_heads = spec.num_kv_heads // mesh.tp_size
        self._eos_token_ids = [int(token) for token in eos_token_ids]
        self._pad_token_id = int(pad_token_id)
        self._unsampled = unsampled_token(self._pad_token_id, self._eos_token_ids)
        self._weights: GenerationShard | None = None
        self._device, self._dtype = torch.device("cpu"), torch.float32
        self.set_weights(weights)
        self._state: EngineState = "awake"

    # ------------------------------------------------------------------ weights

    def set_weights(self, weights: GenerationShard) -> None:
        """Generate from ``weights`` from now on (the next transition's shard). Local, no copy."""
        expected = {param.name for param in self._layout.stage_params(self._pp_size, self._pp_rank)}
        missing = sorted(expected - set(weights.names()))
        if missing:
            raise ValueError(
                f"the generation shard lacks {missing[0]} (and {len(missing) - 1} more) for stage {self._pp_rank}"
            )
        first = weights.blocks(f"model.layers.{self._layers[0]}.input_layernorm.weight")[0]
        self._device, self._dtype = first.device, first.dtype
        self._weights = weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """See :meth:`RolloutEngine.load_weights`: full HF tensors; this rank keeps a copy of its slice.

        Parameters of other pipeline stages are skipped (their ranks load them); the copy never
        writes into resharded memory, which may be the trainer's.
        """
        weights = self._awake_weights("load_weights")
        known = {param.name for param in self._layout}
        for name, tensor in named_tensors:
            if name not in known:
                raise ValueError(f"load_weights: the model has no parameter {name!r}")
            if name not in weights:
                continue
            block = weights.slice(name)
            full_shape = self._layout.param(name).shape
            if tuple(tensor.shape) != full_shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {full_shape} in the model, got {tuple(tensor.shape)}"
                )
            dtype = weights.blocks(name)[0].dtype
            weights.replace(name, tensor[block.index()].to(device=self._device, dtype=dtype).clone())

    def _awake_weights(self, call: str) -> GenerationShard:
        """The weights, checked before any collective so that every rank of a replica fails alike."""
        if self._state == "closed" or self._weights is None:
            raise EngineStateError(f"{call}: the engine is closed")
        if self._state != "awake":
            raise EngineStateError(f"{call}: the engine is asleep; call wake_up() first")
        if self._weights.released:
            raise EngineStateError(
                f"{call}: the generation shard was released (Resharder.to_training); set_weights() the next one"
            )
        return self._weights

    # ------------------------------------------------------------------ parallel layers

    def _column(self, x: torch.Tensor, name: str, bias: bool) -> torch.Tensor:
        """Column-parallel linear: this rank's output features, block by block."""
        weights = self._live_weights()
        blocks = weights.blocks(f"{name}.weight")
        biases: Sequence[torch.Tensor | None] = (
            weights.blocks(f"{name}.bias") if bias else [None] * len(blocks)
        )
        if len(blocks) == 1:
            return F.linear(x, blocks[0], biases[0])
        return torch.cat([F.linear(x, w, b) for w, b in zip(blocks, biases, strict=True)], dim=-1)

    def _row(self, x: torch.Tensor, name: str, bias: bool) -> torch.Tensor:
        """Row-parallel linear: this rank's input features, partial sums all-reduced over TP."""
        weights = self._live_weights()
        out: torch.Tensor | None = None
        offset = 0
        for w in weights.blocks(f"{name}.weight"):
            part = F.linear(x[..., offset : offset + w.shape[1]], w)
            out = part if out is None else out + part
            offset += w.shape[1]
        assert out is not None
        if self._tp_size > 1:
            dist.all_reduce(out, group=self._tp_group)
        if bias:
            out = out + weights.blocks(f"{name}.bias")[0]
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: rows this rank holds, zeros elsewhere, all-reduced over TP (exact)."""
        weights = self._live_weights()
        name = "model.embed_tokens.weight"
        start = weights.slice(name).start
        out: torch.Tensor | None = None
        for rows in weights.blocks(name):
            stop = start + rows.shape[0]
            inside = (input_ids >= start) & (input_ids < stop)
            looked_up = F.embedding((input_ids - start).clamp(0, rows.shape[0] - 1), rows)
            part = looked_up * inside.unsqueeze(-1).to(looked_up.dtype)
            out = part if out is None else out + part
            start = stop
        assert out is not None
        if self._tp_size > 1:
            dist.all_reduce(out, group=self._tp_group)
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[batch, vocab]`` for the last position, gathered over TP."""
        local = self._column(hidden, "lm_head", bias=False)
        if self._tp_size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(self._tp_size)]
        dist.all_gather(pieces, local.contiguous(), group=self._tp_group)
        return torch.cat(pieces, dim=-1)

    def _live_weights(self) -> GenerationShard:
        if self._weights is None:
            raise EngineStateError("the engine is closed")
        return self._weights

    # ------------------------------------------------------------------ the decoder

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's default RoPE (cos, sin) for ``positions`` ``[batch, seq]``, computed in float32."""
        dim = self._spec.head_dim
        inv_freq = 1.0 / (
            self._spec.rope_theta
            ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=self._device, dtype=torch.float) / dim)
        )
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def _attention(
        self,
        hidden: torch.Tensor,
        layer: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
        cache: _LayerCache,
        cached: int,
    ) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        prefix = f"model.layers.{layer}.self_attn."
        head_dim, bias = self._spec.head_dim, self._spec.qkv_bias
        q = self._column(hidden, prefix + "q_proj", bias).view(batch, seq, self._local_heads, head_dim)
        k = self._column(hidden, prefix + "k_proj", bias).view(batch, seq, self._local_kv_heads, head_dim)
        v = self._column(hidden, prefix + "v_proj", bias).view(batch, seq, self._local_kv_heads, head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.keys[:, :, cached : cached + seq] = k
        cache.values[:, :, cached : cached + seq] = v
        keys, values = cache.keys[:, :, : cached + seq], cache.values[:, :, : cached + seq]
        groups = self._local_heads // self._local_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=head_dim**-0.5)
        out = out.transpose(1, 2).reshape(batch, seq, self._local_heads * head_dim)
        return self._row(out, prefix + "o_proj", self._spec.o_bias)

    def _stage_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        caches: dict[int, _LayerCache],
        cached: int,
    ) -> torch.Tensor | None:
        """This stage's part of one forward pass; the last stage returns the last position's logits.

        Collective over the replica: TP all-reduces inside each layer, and the hidden states
        pass from stage to stage point to point.
        """
        weights = self._live_weights()
        batch, seq = input_ids.shape
        if self._previous_stage is None:
            hidden = self._embed(input_ids)
        else:
            hidden = torch.empty(batch, seq, self._spec.hidden_size, dtype=self._dtype, device=self._device)
            dist.recv(hidden, src=self._previous_stage, group=self._replica_group)
        rope = self._rope(positions, hidden.dtype)
        eps = self._spec.rms_norm_eps
        for layer in self._layers:
            prefix = f"model.layers.{layer}."
            normed = _rms_norm(hidden, weights.blocks(prefix + "input_layernorm.weight")[0], eps)
            hidden = hidden + self._attention(normed, layer, rope, allowed, caches[layer], cached)
            normed = _rms_norm(hidden, weights.blocks(prefix + "post_attention_layernorm.weight")[0], eps)
            mlp_bias = self._spec.mlp_bias
            gate = self._column(normed, prefix + "mlp.gate_proj", mlp_bias)
            up = self._column(normed, prefix + "mlp.up_proj", mlp_bias)
            hidden = hidden + self._row(F.silu(gate) * up, prefix + "mlp.down_proj", mlp_bias)
        if self._next_stage is not None:
            dist.send(hidden.contiguous(), dst=self._next_stage, group=self._replica_group)
            return None
        last = _rms_norm(hidden[:, -1], weights.blocks("model.norm.weight")[0], eps)
        return self._logits(last)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """See :meth:`RolloutEngine.generate`; collective over the replica (same arguments on every rank)."""
        self._awake_weights("generate")
        if not prompt_token_ids:
            return RolloutOutput([], [], [] if params.return_logprobs else None)
        check_prompts(
            prompt_token_ids,
            params,
            vocab_size=self._spec.vocab_size,
            max_length=self._spec.max_position_embeddings,
            max_length_name="the model's max_position_embeddings",
        )
        rows = [prompt for prompt in prompt_token_ids for _ in range(params.n)]
        with torch.inference_mode():
            return self._decode(rows, params)

    def _decode(self, rows: list[list[int]], params: SamplingParams) -> RolloutOutput:
        device = self._device
        batch, width = len(rows), max(len(row) for row in rows)
        capacity = width + params.max_new_tokens
        input_ids = torch.full((batch, width), self._pad_token_id, dtype=torch.long)
        valid = torch.zeros((batch, capacity), dtype=torch.bool)
        for index, row in enumerate(rows):
            input_ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            valid[index, width - len(row) : width] = True
        input_ids, valid = input_ids.to(device), valid.to(device)
        positions = (valid[:, :width].long().cumsum(dim=-1) - 1).clamp_min(0)
        # A query attends to valid keys up to itself, and always to itself, so that the rows of
        # padded query positions are never empty (an empty row makes SDPA return NaN, which the
        # cache would then feed, times zero, into every later position).
        causal = torch.ones(capacity, capacity, dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(capacity, dtype=torch.bool, device=device)

        def allowed(first: int, count: int) -> torch.Tensor:
            keys = first + count
            mask = causal[first:keys, :keys] & valid[:, None, :keys]
            return (mask | diagonal[first:keys, :keys])[:, None]

        dtype = self._dtype
        caches = {
            layer: _LayerCache(
                torch.empty(
                    batch, self._local_kv_heads, capacity, self._spec.head_dim, dtype=dtype, device=device
                ),
                torch.empty(
                    batch, self._local_kv_heads, capacity, self._spec.head_dim, dtype=dtype, device=device
                ),
            )
            for layer in self._layers
        }
        generator: torch.Generator | None = None
        if not params.greedy and self._rank == self._output_rank:
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

        logits = self._stage_forward(input_ids, positions, allowed(0, width), caches, 0)
        cached, next_positions = width, positions[:, -1:] + 1
        for step in range(params.max_new_tokens):
            chosen, chosen_logprobs = self._choose(logits, params, generator, batch)
            if params.return_logprobs:
                logprobs[:, step] = chosen_logprobs
            chosen = chosen.masked_fill(finished, self._pad_token_id)
            tokens[:, step] = chosen
            stopped_now = torch.isin(chosen, eos_ids) & ~finished
            lengths = torch.where(stopped_now, step + 1, lengths)
            finished |= stopped_now
            if step + 1 == params.max_new_tokens or bool(finished.all()):
                break
            valid[:, cached] = True
            logits = self._stage_forward(chosen[:, None], next_positions, allowed(cached, 1), caches, cached)
            cached += 1
            next_positions = next_positions + 1

        token_rows, logprob_rows, row_lengths = (
            tokens.cpu().tolist(),
            logprobs.cpu().tolist(),
            lengths.cpu().tolist(),
        )
        finish_reasons: list[FinishReason] = [
            "stop" if done else "length" for done in finished.cpu().tolist()
        ]
        return RolloutOutput(
            response_token_ids=[row[:n] for row, n in zip(token_rows, row_lengths, strict=True)],
            finish_reasons=finish_reasons,
            logprobs=(
                [row[:n] for row, n in zip(logprob_rows, row_lengths, strict=True)]
                if params.return_logprobs
                else None
            ),
        )

    def _choose(
        self,
        logits: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        batch: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output rank picks the next tokens (and their log-probs); a broadcast gives them to the replica."""
        chosen = torch.empty(batch, dtype=torch.long, device=self._device)
        chosen_logprobs = torch.zeros(batch, dtype=torch.float32, device=self._device)
        if self._rank == self._output_rank:
            assert logits is not None
            scores = logits.float()
            choosable = without_token(scores, self._unsampled)  # the log-probs stay the policy's
            if params.greedy:
                chosen = choosable.argmax(dim=-1)
            else:
                # Imported here: the torch engine's module imports transformers (seconds per
                # process), which greedy decoding on a TP worker never needs.
                from hybridflow.engines.torch_engine import choose_next_tokens

                chosen = choose_next_tokens(choosable, params, generator)
            if params.return_logprobs:
                chosen_logprobs = scores.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        if self._replica_size > 1:
            dist.broadcast(chosen, src=self._output_rank, group=self._replica_group)
            if params.return_logprobs:
                dist.broadcast(chosen_logprobs, src=self._output_rank, group=self._replica_group)
        return chosen, chosen_logprobs

    @property
    def _replica_size(self) -> int:
        return self._tp_size * self._pp_size

    # ------------------------------------------------------------------ lifecycle

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    @property
    def state(self) -> EngineState:
        return self._state

    def sleep(self) -> None:
        """Mark the engine asleep. The weights are the resharder's to free (``to_training``)."""
        if self._state == "closed":
            raise EngineStateError("sleep: the engine is closed")
        self._state = "asleep"

    def wake_up(self) -> None:
        if self._state == "closed":
            raise EngineStateError("wake_up: the engine is closed")
        self._state = "awake"

    def close(self) -> None:
        """Drop the reference to the generation shard; the process groups stay in the cache."""
        self._weights = None
        self._state = "closed"
