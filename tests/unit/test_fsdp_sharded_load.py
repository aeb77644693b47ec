"""Each FSDP rank reads only its shard (``backends/fsdp/sharded_load.py``), and gets what the plain path gives.

One spawned 2-rank gloo job checks, for an untied and a tied Qwen2 model, a causal LM and a value
model (from a causal-LM directory and from a reward-model directory):

* the sharded parameters equal the plain path's (every rank built the full model, then
  ``fully_shard``) bit for bit, and so do the logits / values of a batch (the rotary buffers
  are recomputed correctly);
* each rank read about half the checkpoint, and never a whole tensor of one that is split;
  with a 4 KiB read limit, no read is larger.

Without processes: a checkpoint missing a parameter is refused with the same message as the
plain path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spawned_ranks import run_spawned_ranks

pytestmark = pytest.mark.unit


def write_models(work: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, Qwen2ForSequenceClassification

    from hybridflow.models import padded_vocab_size, tiny_config, write_tiny_model

    untied = write_tiny_model(work / "untied", "qwen2", seed=4)
    tied = work / "tied"
    config = tiny_config("qwen2", padded_vocab_size())
    config.tie_word_embeddings = True
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tied)
    reward = work / "reward"
    config = tiny_config("qwen2", padded_vocab_size())
    config.num_labels = 1
    torch.manual_seed(6)
    Qwen2ForSequenceClassification(config).save_pretrained(reward)
    return {"untied": untied, "tied": tied, "reward": reward}


def ranks(rank: int, port: int, work: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridflow.backends.fsdp.load import load_causal_lm, load_value_model
    from hybridflow.backends.fsdp.parallelize import shard_model
    from hybridflow.backends.fsdp.sharded_load import build_on_meta, checkpoint_bytes, materialize_and_load
    from hybridflow.models import safetensors_rows

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    results: dict[str, Any] = {}
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, 9)
    cases = [
        ("untied", "causal-lm"),
        ("tied", "causal-lm"),
        ("untied", "value"),
        ("reward", "value"),
        ("chunked", "causal-lm"),
    ]
    for directory, kind in cases:
        # "chunked": the untied model read at most 4 KiB at a time (several reads per tensor).
        safetensors_rows.READ_CHUNK_BYTES = 4096 if directory == "chunked" else 64 << 20
        path = Path(work) / ("untied" if directory == "chunked" else directory)
        plain_model = load_causal_lm(path) if kind == "causal-lm" else load_value_model(path)
        plain = shard_model(plain_model, device=cpu)
        sharded = shard_model(
            build_on_meta(path, kind=kind, dtype=torch.float32, attn_implementation="sdpa"), device=cpu
        )
        report = materialize_and_load(sharded, path, kind=kind, device=cpu)
        plain_state, sharded_state = plain.state_dict(), sharded.state_dict()
        same = plain_state.keys() == sharded_state.keys() and all(
            torch.equal(
                p.to_local() if isinstance(p, DTensor) else p,
                s.to_local() if isinstance(s, DTensor) else s,
            )
            for p, s in ((plain_state[k], sharded_state[k]) for k in plain_state)
        )
        with torch.no_grad():
            if kind == "causal-lm":
                out_plain = plain(input_ids=ids, position_ids=positions).logits
                out_sharded = sharded(input_ids=ids, position_ids=positions).logits
            else:
                out_plain, out_sharded = plain(ids, None, positions), sharded(ids, None, positions)
        largest_full = max(p.numel() * p.element_size() for p in plain_state.values())
        results[f"{directory}-{kind}"] = {
            "same_shards": same,
            "same_outputs": bool(torch.equal(out_plain, out_sharded)),
            "bytes_read": report.bytes_read,
            "largest_read": report.largest_read_bytes,
            "largest_full_tensor": largest_full,
            "checkpoint_bytes": checkpoint_bytes(path),
        }
    (Path(work) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    work = tmp_path_factory.mktemp("sharded-load")
    write_models(work)
    return run_spawned_ranks(
        ranks, (str(work),), world_size=2, work_dir=work, deadline_seconds=240, what="sharded load"
    )


@pytest.mark.parametrize(
    "case", ["untied-causal-lm", "tied-causal-lm", "untied-value", "reward-value", "chunked-causal-lm"]
)
def test_each_rank_loads_what_the_plain_path_keeps(outcome: dict[str, dict[int, Any]], case: str) -> None:
    for rank, result in outcome[case].items():
        assert result["same_shards"], (rank, result)
        assert result["same_outputs"], (rank, result)
        # About half of what the model needs: each rank reads its rows, never the whole checkpoint.
        assert result["bytes_read"] < 0.6 * result["checkpoint_bytes"], (rank, result)
        # The embedding / LM head is split on dim 0: no rank reads one of them whole.
        assert result["largest_read"] <= result["largest_full_tensor"] // 2, (rank, result)
        if case.startswith("chunked"):
            assert result["largest_read"] <= 4096, (rank, result)


def test_a_checkpoint_missing_a_parameter_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from hybridflow.backends.fsdp.sharded_load import build_on_meta
    from hybridflow.models import write_tiny_model

    directory = write_tiny_model(tmp_path / "m", "qwen2", seed=0)
    state = load_file(directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.mlp.up_proj.weight'\]"):
        build_on_meta(directory, kind="causal-lm", dtype=torch.float32, attn_implementation="sdpa")
