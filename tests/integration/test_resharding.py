"""3D-HybridEngine resharding on 8 gloo ranks: exact shards, measured bytes, and generation parity.

One spawned 8-rank job (no Ray, no torchrun) runs every case in order and writes each rank's
outcomes to a JSON file; each test below asserts one case. The parent process builds the tiny
model once and saves its state dict; the ranks load it (bit-identical full parameters
everywhere, as building from the same seed would give) and never import transformers, which
would cost each of the 8 processes seconds on two cores. The HF reference generation runs in
the parent.

Per case, each rank cuts its training shard out of the full parameters, runs the transition,
and checks, before any assertion that could desynchronise the ranks:

* every generation tensor equals, bit for bit, the slice of the full parameter its generation
  layout requires, and the rank holds exactly its stage's parameters;
* the bytes it received and the memory it measured equal the plan's figures (which the unit
  tests compare with Table 2);
* for HybridFlow, its training memory *is* part of its generation weights (in place);
* ``to_training`` frees everything but the training shard, and the released shard refuses use.

In the generation cases, the tensor-parallel engine then decodes from the resharded weights;
the parent compares the tokens with HF ``generate``.
"""

from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engines.base import EngineStateError, SamplingParams
from hybridflow.mesh import DeviceMesh
from hybridflow.resharding import DESIGNS, DecoderSpec, Design, ReshardingError, build_plan, decoder_layout
from hybridflow.resharding.transfer import Resharder, SubgroupCache, TrainingShard
from spawned_ranks import free_port, run_spawned_ranks

pytestmark = pytest.mark.integration

WORLD_SIZE = 8
JOB_DEADLINE_SECONDS = 240
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
SEED = 3

Case = tuple[Design, int, int, int, int]  # design, p, t, p_g, t_g


def _grid() -> list[Case]:
    cases: list[Case] = []
    for p in (1, 2):
        for t in (1, 2, 4, 8):
            if p * t > WORLD_SIZE:
                continue
            for p_g in (g for g in (1, 2) if p % g == 0):
                for t_g in (g for g in (1, 2, 4, 8) if t % g == 0):
                    cases.append(("hybridflow", p, t, p_g, t_g))
    return cases


BASELINE_LAYOUTS = [(1, 4, 1, 2), (2, 4, 1, 2), (2, 2, 2, 1)]
CASES: list[Case] = _grid() + [
    (design, *layout) for layout in BASELINE_LAYOUTS for design in DESIGNS if design != "hybridflow"
]
GENERATION_CASES: list[Case] = [
    ("hybridflow", 1, 4, 1, 2),  # the DESIGN.md example: TP 2 from training TP 4
    ("hybridflow", 2, 4, 2, 2),  # pipeline-parallel generation
    ("hybridflow", 2, 2, 1, 1),  # degenerate: every rank gathers the whole model
    ("hybridflow", 1, 8, 1, 8),  # TP 8, no exchange at all
    ("vanilla", 2, 4, 1, 2),
]
PROMPTS = [[256, 257, 72, 105], [257, 7, 8, 9, 10, 11, 12, 13], [3, 1, 4, 1, 5]]
NEW_TOKENS = 8
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=7)
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)


def case_id(case: Case) -> str:
    design, p, t, p_g, t_g = case
    return f"{design}-p{p}t{t}-to-p{p_g}t{t_g}"


def run_case(
    case: Case,
    rank: int,
    spec: DecoderSpec,
    full: dict[str, torch.Tensor],
    groups: SubgroupCache,
    eos_ids: list[int],
    pad_id: int,
) -> dict[str, Any]:
    """One transition (and, for generation cases, decoding) on this rank; returns what the parent checks."""
    from hybridflow.engines.tp_engine import TensorParallelRolloutEngine

    design, p, t, p_g, t_g = case
    layout = decoder_layout(spec)
    train = DeviceMesh.training(WORLD_SIZE, pp=p, tp=t)
    plan = build_plan(design, layout, train, pp=p_g, tp=t_g)
    resharder = Resharder(plan, rank, groups)
    shard = TrainingShard.from_full(plan.rank(rank).training, full)
    generation, stats = resharder.to_generation(shard)
    held_in_generation = {
        piece.untyped_storage().data_ptr() for name in generation.names() for piece in generation.blocks(name)
    }
    training_pointers = {
        shard.buffer(kind).untyped_storage().data_ptr() for kind in ("partitioned", "replicated")
    }
    exact = {
        name: torch.equal(generation.tensor(name), full[name][generation.slice(name).index()])
        for name in generation.names()
    }
    result: dict[str, Any] = {}
    engine = None
    if case in GENERATION_CASES:
        engine = TensorParallelRolloutEngine(
            spec, generation, plan.generation_mesh, rank, groups, eos_token_ids=eos_ids, pad_token_id=pad_id
        )
        result["greedy"] = engine.generate(PROMPTS, GREEDY).response_token_ids
        result["sampled"] = engine.generate(PROMPTS, SAMPLED).response_token_ids
        if case == GENERATION_CASES[0]:
            result["lifecycle"] = engine_lifecycle(engine, full)
    back = resharder.to_training(generation, shard)
    own_tensors = bucketed = None
    if design == "hybridflow":
        own_tensors = transition_from_own_tensors(resharder, plan, rank, full)
        bucketed = {str(dtype): buckets(resharder, plan, rank, full, dtype) for dtype in BUCKET_DTYPES}
    if engine is not None:
        try:
            engine.generate(PROMPTS, GREEDY)
        except EngineStateError as error:
            assert "released" in str(error)
        else:
            raise AssertionError("the engine generated from a released shard")

    # -- assertions (every collective of this case is done) --------------------------------
    mesh = plan.generation_mesh
    c = mesh.coord(rank)
    expected_names = (
        [param.name for param in layout]
        if design == "allgather"
        else [param.name for param in layout.stage_params(mesh.pp_size, c.pp)]
    )
    assert sorted(generation.names()) == sorted(expected_names)
    for name in expected_names:
        want = layout.param(name).block(
            1 if design == "allgather" else mesh.tp_size, 0 if design == "allgather" else c.tp
        )
        assert generation.slice(name) == want, (name, generation.slice(name), want)
    wrong = [name for name, same in exact.items() if not same]
    assert not wrong, f"generation tensors differ from the full parameters' slices: {wrong[:3]}"
    assert stats.received == plan.bytes_received(rank), (stats.received, plan.bytes_received(rank))
    # The traffic meter counted what was handed to torch.distributed: the plan's messages exactly.
    itemsize = layout.itemsize
    assert stats.wire_received == stats.received.total
    assert stats.wire_sent == sum(m.numel for m in plan.rank(rank).sends) * itemsize
    assert stats.peak_memory is not None and stats.peak_memory >= 0
    reused = plan.training_bytes(rank).total if design == "hybridflow" else 0
    assert stats.reused == reused, (stats.reused, reused)
    assert stats.peak == plan.peak_bytes(rank), (stats.peak, plan.peak_bytes(rank))
    assert stats.peak_total == plan.peak_total_bytes(rank)
    assert stats.held == plan.held_bytes(rank), (stats.held, plan.held_bytes(rank))
    assert stats.redundant == plan.redundant_bytes(rank)
    if design == "hybridflow":
        live = {ptr for ptr in training_pointers if ptr}
        assert live <= held_in_generation, "the training buffers are not part of the generation weights"
        assert stats.redundant.total == 0
    else:
        assert not training_pointers & held_in_generation, "a baseline reused its training buffers"
    # After load_weights the engine reads its own copies only, so all of them are freed.
    freed = plan.generation_bytes(rank) if "lifecycle" in result else stats.held - shard.nbytes()
    assert back.freed == freed, (back.freed, freed)
    assert back.held == shard.nbytes()
    assert generation.released
    try:
        generation.blocks(expected_names[0])
    except ReshardingError:
        pass
    else:
        raise AssertionError("a released generation shard still hands out weights")
    if "lifecycle" in result:
        assert result["lifecycle"] == {"asleep_refused": True, "same_after_reload": True}, result["lifecycle"]
    if own_tensors is not None and bucketed is not None:
        check_own_tensors(own_tensors, stats, plan, rank)
        check_buckets(bucketed, plan, rank)
    result["seconds"] = stats.seconds
    return result


BUCKET_BYTES = 48 * 1024  # below the embedding's generation slice at t_g 1 (384 x 256 x 4 bytes)
BUCKET_DTYPES = (torch.float32, torch.bfloat16)


def transition_from_own_tensors(
    resharder: Resharder, plan: Any, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The same transition from a shard of separate per-block tensors (as a trainer's parameters are)."""
    blocks = plan.rank(rank).training
    tensors = {b.name: full[b.name][b.index()].contiguous().clone() for b in blocks}
    shard = TrainingShard.of_tensors(blocks, tensors)
    generation, stats = resharder.to_generation(shard)
    pointers = {t.untyped_storage().data_ptr() for t in tensors.values()}
    in_place = sum(
        piece.nbytes
        for name in generation.names()
        for piece in generation.blocks(name)
        if piece.untyped_storage().data_ptr() in pointers
    )
    exact = all(
        torch.equal(generation.tensor(n), full[n][generation.slice(n).index()]) for n in generation.names()
    )
    back = resharder.to_training(generation, shard)
    return {"stats": stats, "in_place": in_place, "exact": exact, "back": back, "nbytes": shard.nbytes()}


def check_own_tensors(outcome: dict[str, Any], flat: Any, plan: Any, rank: int) -> None:
    """A shard of the trainer's own tensors moves and accounts exactly as a flat one, reading them in place."""
    stats = outcome["stats"]
    assert outcome["exact"]
    assert outcome["in_place"] == plan.training_bytes(rank).total == stats.reused
    for figure in ("received", "peak", "peak_total", "held", "redundant", "wire_received", "wire_sent"):
        assert getattr(stats, figure) == getattr(flat, figure), figure
    assert outcome["back"].freed == stats.held - outcome["nbytes"]


def buckets(
    resharder: Resharder, plan: Any, rank: int, full: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, Any]:
    """``generation_buckets`` into memory the consumer holds already (as vLLM does); what it moved and made."""
    from hybridflow.resharding.transfer import BucketRecord

    blocks = plan.rank(rank).training
    tensors = {b.name: full[b.name][b.index()].contiguous().clone() for b in blocks}
    shard = TrainingShard.of_tensors(blocks, tensors)
    pointers = {t.untyped_storage().data_ptr() for t in tensors.values()}
    engine = {want.name: torch.empty(want.shape, dtype=dtype) for want, _ in plan.rank(rank).generation}
    record, before = BucketRecord(), resharder.meter.total
    in_place = bucket_names = 0
    for bucket in resharder.generation_buckets(shard, bucket_bytes=BUCKET_BYTES, dtype=dtype, record=record):
        bucket_names += len(bucket.names())
        for name in bucket.names():
            engine[name].copy_(bucket.tensor(name))
            in_place += sum(
                p.nbytes for p in bucket.blocks(name) if p.untyped_storage().data_ptr() in pointers
            )
    wire = resharder.meter.total - before
    exact = all(
        torch.equal(engine[want.name], full[want.name][want.index()].to(dtype))
        for want, _ in plan.rank(rank).generation
    )
    return {
        "record": record,
        "wire": wire,
        "exact": exact,
        "in_place": in_place,
        "names": bucket_names,
        "largest_param": max(want.numel for want, _ in plan.rank(rank).generation) * dtype.itemsize,
    }


def check_buckets(outcomes: dict[str, dict[str, Any]], plan: Any, rank: int) -> None:
    """Bucketed: exact in either dtype, the plan's bytes (half in bf16), own blocks as they are, bounded buckets."""
    fp32, bf16 = outcomes[str(torch.float32)], outcomes[str(torch.bfloat16)]
    training = plan.training_bytes(rank).total
    received = plan.bytes_received(rank).total
    generation_bytes = plan.generation_bytes(rank).total
    for outcome in (fp32, bf16):
        assert outcome["exact"]
        assert outcome["names"] == len(plan.rank(rank).generation)
        record = outcome["record"]
        assert record.largest_bucket_bytes <= max(BUCKET_BYTES, outcome["largest_param"])
    assert fp32["wire"].received == received and 2 * bf16["wire"].received == received
    assert fp32["wire"].sent == sum(m.numel for m in plan.rank(rank).sends) * plan.layout.itemsize
    assert fp32["record"].cast_bytes == 0 and fp32["in_place"] == training == fp32["record"].own_bytes
    assert 2 * bf16["record"].cast_bytes == training and bf16["in_place"] == 0
    if received:
        assert fp32["record"].largest_bucket_bytes > 0
    assert fp32["record"].buckets >= -(-generation_bytes // max(BUCKET_BYTES, fp32["largest_param"]))


def engine_lifecycle(engine: Any, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Sleep refuses generation, wake_up restores it, load_weights copies without touching resharded memory.

    Collective: every rank of the world runs it with the same engine state.
    """
    engine.sleep()
    try:
        engine.generate(PROMPTS, GREEDY)
        asleep_refused = False
    except EngineStateError:
        asleep_refused = True
    engine.wake_up()
    before = engine.generate(PROMPTS, GREEDY).response_token_ids
    engine.load_weights(full.items())  # the same values, now engine-owned copies
    after = engine.generate(PROMPTS, GREEDY).response_token_ids
    return {"asleep_refused": asleep_refused, "same_after_reload": before == after}


def run_job(rank: int, port: int, work_dir: str) -> None:
    """One rank: every case in order; ``rank<r>.json`` maps case ids to outcomes."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=COLLECTIVE_TIMEOUT,
    )
    work = Path(work_dir)
    meta = json.loads((work / "model.json").read_text())
    spec = DecoderSpec(**meta["spec"])
    full = torch.load(work / "model.pt")
    groups = SubgroupCache()
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        for case in CASES:
            try:
                outcomes[case_id(case)] = {
                    "error": None,
                    **run_case(case, rank, spec, full, groups, meta["eos"], meta["pad"]),
                }
            except Exception:
                outcomes[case_id(case)] = {"error": traceback.format_exc()}
    finally:
        (work / f"rank{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny() -> Any:
    from hybridflow.models import build_tiny_model

    # head_dim 32 and 8 KV heads: TP up to 8 splits whole heads; 4 layers split into 2 stages.
    return build_tiny_model(
        "qwen2", 384, hidden=256, layers=4, heads=8, kv_heads=8, intermediate=512, seed=SEED
    )


@pytest.fixture(scope="module")
def outcomes(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    """Runs the 8-rank job once; ``{case id: {rank: outcome}}``."""
    root = tmp_path_factory.mktemp("resharding-8ranks")
    torch.save({name: tensor.contiguous() for name, tensor in tiny.state_dict().items()}, root / "model.pt")
    spec = DecoderSpec.from_hf_config(tiny.config)
    eos = list(tiny.generation_config.eos_token_id)
    (root / "model.json").write_text(
        json.dumps({"spec": spec.__dict__, "eos": eos, "pad": tiny.generation_config.pad_token_id})
    )
    results: dict[str, dict[int, dict[str, Any]]] = run_spawned_ranks(
        run_job,
        (str(root),),
        world_size=WORLD_SIZE,
        work_dir=root,
        deadline_seconds=JOB_DEADLINE_SECONDS,
        expected=[case_id(case) for case in CASES],
        what="the 8-rank resharding job",
    )
    return results


def _passed(outcomes: dict[str, dict[int, dict[str, Any]]], case: Case) -> dict[int, dict[str, Any]]:
    per_rank = outcomes[case_id(case)]
    assert sorted(per_rank) == list(range(WORLD_SIZE)), f"{case_id(case)} did not run on every rank"
    failures = {rank: o["error"] for rank, o in per_rank.items() if o["error"] is not None}
    assert not failures, "\n".join(f"--- rank {rank}\n{trace}" for rank, trace in failures.items())
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_transition_gives_every_rank_its_exact_generation_shard(
    outcomes: dict[str, dict[int, dict[str, Any]]], case: Case
) -> None:
    _passed(outcomes, case)


def _hf_greedy(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    from hybridflow.models import PAD_TOKEN_ID

    eos_ids = list(model.generation_config.eos_token_id)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=PAD_TOKEN_ID,
    )
    rows = []
    for tokens in generated[:, width:].tolist():
        stop = next((i for i, token in enumerate(tokens) if token in eos_ids), len(tokens) - 1)
        rows.append(tokens[: stop + 1])
    return rows


@pytest.fixture(scope="module")
def hf_greedy(tiny: Any) -> list[list[int]]:
    return _hf_greedy(tiny, PROMPTS)


@pytest.fixture(scope="module")
def torch_engine_sampled(tiny: Any) -> list[list[int]]:
    from hybridflow.engines.torch_engine import TorchRolloutEngine

    return TorchRolloutEngine(tiny).generate(PROMPTS, SAMPLED).response_token_ids


@pytest.mark.parametrize("case", GENERATION_CASES, ids=case_id)
def test_greedy_generation_after_resharding_equals_hf_generate(
    outcomes: dict[str, dict[int, dict[str, Any]]], hf_greedy: list[list[int]], case: Case
) -> None:
    for rank, outcome in _passed(outcomes, case).items():
        assert outcome["greedy"] == hf_greedy, f"rank {rank}"


@pytest.mark.parametrize("case", GENERATION_CASES, ids=case_id)
def test_sampled_generation_after_resharding_equals_the_torch_engine(
    outcomes: dict[str, dict[int, dict[str, Any]]], torch_engine_sampled: list[list[int]], case: Case
) -> None:
    """Same seed, same weights: the TP engine draws what the single-process engine draws, on every rank."""
    for rank, outcome in _passed(outcomes, case).items():
        assert outcome["sampled"] == torch_engine_sampled, f"rank {rank}"


# --------------------------------------------------------------------------- NCCL


def run_nccl(rank: int, world: int, port: int, work_dir: str) -> None:
    """NCCL on the GPUs there are: training TP = world, generation TP 1 (HybridFlow), exact and measured."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    work = Path(work_dir)
    outcome: dict[str, Any] = {"error": None}
    try:
        meta = json.loads((work / "model.json").read_text())
        spec = DecoderSpec(**meta["spec"])
        full = {name: tensor.cuda() for name, tensor in torch.load(work / "model.pt").items()}
        groups = SubgroupCache()
        layout = decoder_layout(spec)
        plan = build_plan("hybridflow", layout, DeviceMesh.training(world, pp=1, tp=world), pp=1, tp=1)
        resharder = Resharder(plan, rank, groups)
        shard = TrainingShard.from_full(plan.rank(rank).training, full)
        generation, stats = resharder.to_generation(shard)
        outcome["cuda_peak_delta"] = stats.peak_memory  # PeakMemory on CUDA: max_memory_allocated - before
        outcome["plan_received"] = plan.bytes_received(rank).total
        outcome["received"] = stats.bytes_received
        outcome["exact"] = all(
            torch.equal(generation.tensor(n), full[n][generation.slice(n).index()])
            for n in generation.names()
        )
        from hybridflow.engines.tp_engine import TensorParallelRolloutEngine

        engine = TensorParallelRolloutEngine(
            spec,
            generation,
            plan.generation_mesh,
            rank,
            groups,
            eos_token_ids=meta["eos"],
            pad_token_id=meta["pad"],
        )
        outcome["greedy"] = engine.generate(PROMPTS, GREEDY).response_token_ids
        resharder.to_training(generation, shard)
    except Exception:
        outcome["error"] = traceback.format_exc()
    finally:
        (work / f"nccl{rank}.json").write_text(json.dumps(outcome))
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_nccl_transition_on_the_available_gpus(tiny: Any, hf_greedy: list[list[int]], tmp_path: Path) -> None:
    world = torch.cuda.device_count()
    torch.save(
        {name: tensor.contiguous() for name, tensor in tiny.state_dict().items()}, tmp_path / "model.pt"
    )
    spec = DecoderSpec.from_hf_config(tiny.config)
    (tmp_path / "model.json").write_text(
        json.dumps(
            {
                "spec": spec.__dict__,
                "eos": list(tiny.generation_config.eos_token_id),
                "pad": tiny.generation_config.pad_token_id,
            }
        )
    )
    mp.start_processes(run_nccl, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="spawn")
    for rank in range(world):
        outcome = json.loads((tmp_path / f"nccl{rank}.json").read_text())
        assert outcome["error"] is None, outcome["error"]
        assert outcome["exact"]
        assert outcome["received"] == outcome["plan_received"]
        # The exchange allocates the received buffers and nothing else of parameter size.
        assert outcome["cuda_peak_delta"] <= outcome["plan_received"] + 16 * 1024 * 1024
        assert outcome["greedy"] == hf_greedy


def run_nccl_buckets(rank: int, world: int, port: int, work_dir: str) -> None:
    """NCCL, training TP = world -> t_g 1, bucket by bucket in bf16 into engine-held memory."""
    from hybridflow.resharding import hybridflow_plan
    from hybridflow.resharding.meter import PeakMemory, TrafficMeter
    from hybridflow.resharding.transfer import BucketRecord

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    work = Path(work_dir)
    outcome: dict[str, Any] = {"error": None}
    try:
        meta = json.loads((work / "model.json").read_text())
        layout = decoder_layout(DecoderSpec(**meta["spec"]))
        full = {name: tensor.to(device) for name, tensor in torch.load(work / "model.pt").items()}
        train = DeviceMesh.training(world, pp=1, tp=world)
        plan = hybridflow_plan(layout, train, DeviceMesh.generation(train, pp=1, tp=1))
        meter = TrafficMeter()
        resharder = Resharder(plan, rank, SubgroupCache(), meter)
        blocks = plan.rank(rank).training
        shard = TrainingShard.of_tensors(
            blocks, {b.name: full[b.name][b.index()].contiguous() for b in blocks}
        )
        engine = {
            want.name: torch.zeros(want.shape, dtype=torch.bfloat16, device=device)
            for want, _ in plan.rank(rank).generation
        }
        for _ in resharder.generation_buckets(shard, bucket_bytes=NCCL_BUCKET_BYTES, dtype=torch.bfloat16):
            pass  # warm-up: NCCL sets its communicators up on first use
        record, before = BucketRecord(), meter.total
        with PeakMemory(device) as probe:
            for bucket in resharder.generation_buckets(
                shard, bucket_bytes=NCCL_BUCKET_BYTES, dtype=torch.bfloat16, record=record
            ):
                for name in bucket.names():
                    want, offset = bucket.slice(name), 0
                    along = want.dim if want.dim is not None else 0
                    for piece in bucket.blocks(name):
                        engine[name].narrow(along, offset, piece.shape[along]).copy_(piece)
                        offset += piece.shape[along]
        outcome.update(
            {
                "exact": all(
                    torch.equal(engine[want.name], full[want.name][want.index()].to(torch.bfloat16))
                    for want, _ in plan.rank(rank).generation
                ),
                "received": (meter.total - before).received,
                "plan_received_fp32": plan.bytes_received(rank).total,
                "training_fp32": plan.training_bytes(rank).total,
                "cast": record.cast_bytes,
                "largest_bucket": record.largest_bucket_bytes,
                "largest_param_bf16": max(want.numel for want, _ in plan.rank(rank).generation) * 2,
                "cuda_peak_delta": probe.bytes,
            }
        )
    except Exception:
        outcome["error"] = traceback.format_exc()
    finally:
        (work / f"nccl-buckets{rank}.json").write_text(json.dumps(outcome))
        dist.destroy_process_group()


NCCL_BUCKET_BYTES = 256 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs CUDA (NCCL) and at least 2 GPUs: with one nothing crosses the wire",
)
def test_nccl_bucketed_bf16_transfer_moves_the_plans_bytes_in_bounded_buckets(
    tiny: Any, tmp_path: Path
) -> None:
    world = 2 if torch.cuda.device_count() < 4 else 4
    torch.save(
        {name: tensor.contiguous() for name, tensor in tiny.state_dict().items()}, tmp_path / "model.pt"
    )
    spec = DecoderSpec.from_hf_config(tiny.config)
    (tmp_path / "model.json").write_text(json.dumps({"spec": spec.__dict__}))
    mp.start_processes(
        run_nccl_buckets, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="spawn"
    )
    for rank in range(world):
        outcome = json.loads((tmp_path / f"nccl-buckets{rank}.json").read_text())
        assert outcome["error"] is None, outcome["error"]
        assert outcome["exact"]
        # bf16 on the wire: half the plan's fp32 bytes; every own byte cast once, before sending.
        assert 2 * outcome["received"] == outcome["plan_received_fp32"] > 0
        assert 2 * outcome["cast"] == outcome["training_fp32"]
        bound = max(NCCL_BUCKET_BYTES, outcome["largest_param_bf16"])
        assert 0 < outcome["largest_bucket"] <= bound
        # On CUDA the allocator's peak over the whole transfer is one bucket's buffers (plus
        # NCCL's and the allocator's rounding), not the generation shard.
        assert outcome["cuda_peak_delta"] <= bound + (1 << 20)
