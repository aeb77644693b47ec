"""Megatron's TP shards are exactly the slices the 3D-HybridEngine's layout assigns (pure, no processes).

The resharding plan (``hybridflow.resharding``) reasons about abstract per-parameter shards; the
Megatron backend hands it each rank's HF-named pieces (``megatron_to_hf_shards``). This checks,
for every parameter and TP rank, that the piece Megatron holds is the layout's block, bit for bit.
"""

import pytest
import torch

from hybridflow.backends.megatron.config import DecoderArch
from hybridflow.backends.megatron.convert import hf_to_megatron, megatron_to_hf_shards, units
from hybridflow.models.tiny import build_tiny_model, padded_vocab_size
from hybridflow.resharding.layout import DecoderSpec, decoder_layout

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_tp_pieces_are_the_layout_blocks(arch: str, tp: int) -> None:
    model = build_tiny_model(arch, padded_vocab_size(), hidden=128, layers=2, heads=4, kv_heads=4, seed=1)  # type: ignore[arg-type]
    full = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    megatron_arch = DecoderArch.from_hf_config(model.config)
    layout = decoder_layout(DecoderSpec.from_hf_config(model.config))
    checked = set()
    for tp_rank in range(tp):
        for unit in units(megatron_arch):
            local = hf_to_megatron(megatron_arch, unit, full, tp_rank=tp_rank, tp_size=tp)
            for name, piece in megatron_to_hf_shards(
                megatron_arch, unit, local, tp_rank=tp_rank, tp_size=tp
            ).items():
                index = layout.shard_index(name, 1, tp, 0, tp_rank)
                assert index is not None
                assert torch.equal(piece.tensor, full[name][index]), (name, tp_rank)
                assert piece.index() == index or piece.dim is None, (name, piece.index(), index)
                checked.add(name)
    assert checked == set(full)
