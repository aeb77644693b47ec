"""The batch container: row operations keep tensors, non-tensors and meta in step; transport is exact."""

import pickle

import numpy as np
import pytest
import torch

from hybridflow.controller.batch import Batch, BatchError

pytestmark = pytest.mark.unit


def make(rows: int = 6) -> Batch:
    return Batch.from_dict(
        {
            "ids": torch.arange(rows * 3).reshape(rows, 3),
            "logp": torch.linspace(0, 1, rows * 2, dtype=torch.bfloat16).reshape(rows, 2),
            "prompt": [f"p{i}" for i in range(rows)],
        },
        meta={"temperature": 0.7},
    )


def test_from_dict_sorts_fields_and_counts_rows() -> None:
    b = make()
    assert len(b) == 6
    assert set(b.tensors) == {"ids", "logp"}
    assert b.non_tensors["prompt"].dtype == object
    assert b.meta == {"temperature": 0.7}


def test_inconsistent_batch_sizes_are_rejected_with_names() -> None:
    with pytest.raises(BatchError, match=r"ids=4, mask=3"):
        Batch({"ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})


def test_scalar_field_is_rejected() -> None:
    with pytest.raises(BatchError, match="scalar"):
        Batch({"x": torch.tensor(1.0)})


def test_list_of_equal_length_lists_stays_one_dimensional() -> None:
    b = Batch.from_dict({"messages": [["a", "b"], ["c", "d"], ["e", "f"]]})
    assert b.non_tensors["messages"].shape == (3,)
    assert b.non_tensors["messages"][1] == ["c", "d"]


def test_select_and_pop() -> None:
    b = make()
    assert b.select(["ids"]).keys == ["ids"]
    taken, rest = b.pop(["prompt"])
    assert taken.keys == ["prompt"] and set(rest.keys) == {"ids", "logp"}
    with pytest.raises(BatchError, match="cannot select"):
        b.select(["nope"])


def test_split_concat_round_trip_and_uneven_split_error() -> None:
    b = make(6)
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert Batch.concat(parts).equals(b)
    with pytest.raises(BatchError, match="6 rows cannot be split into 4"):
        b.split(4)


def test_pad_and_unpad_repeat_real_rows() -> None:
    b = make(5)
    padded, pad = b.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert torch.equal(padded["ids"][5:], b["ids"][:3])
    assert padded.unpad(pad).equals(b)
    with pytest.raises(BatchError, match="empty"):
        b.rows(slice(0, 0)).pad_to_multiple(4)


def test_repeat_interleaved_and_tiled() -> None:
    b = Batch.from_dict({"x": torch.tensor([1, 2])})
    assert b.repeat(2)["x"].tolist() == [1, 1, 2, 2]
    assert b.repeat(2, interleave=False)["x"].tolist() == [1, 2, 1, 2]


def test_reorder_is_a_permutation() -> None:
    b = make(4)
    r = b.reorder([3, 1, 0, 2])
    assert r["prompt"].tolist() == ["p3", "p1", "p0", "p2"]
    assert torch.equal(r["ids"][0], b["ids"][3])
    with pytest.raises(BatchError, match="permutation"):
        b.reorder([0, 0, 1, 2])


def test_union_merges_and_detects_conflicts() -> None:
    b = make(3)
    extra = Batch.from_dict({"reward": torch.ones(3)}, meta={"step": 1})
    u = b.union(extra)
    assert set(u.keys) == {"ids", "logp", "prompt", "reward"}
    assert u.meta == {"temperature": 0.7, "step": 1}
    conflicting = Batch.from_dict({"ids": torch.zeros(3, 3, dtype=torch.long)})
    with pytest.raises(BatchError, match="'ids' differs"):
        b.union(conflicting)


def test_concat_needs_same_fields() -> None:
    with pytest.raises(BatchError, match="cannot concatenate"):
        Batch.concat([make(2), make(2).select(["ids"])])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 3),
        torch.randn(4, 3).to(torch.bfloat16),
        torch.randint(0, 10, (4, 5)),
        torch.rand(4, 2) > 0.5,
        torch.randn(4, 6)[:, ::2],  # non-contiguous
        torch.zeros(0, 3),
    ],
    ids=["f32", "bf16", "int64", "bool", "strided", "empty"],
)
def test_pickle_round_trip_is_exact(tensor: torch.Tensor) -> None:
    rows = tensor.shape[0]
    b = Batch.from_dict({"t": tensor, "s": [str(i) for i in range(rows)]}, meta={"k": [1, 2]})
    back = pickle.loads(pickle.dumps(b, protocol=5))
    assert back.equals(b)
    assert back["t"].dtype == tensor.dtype


def test_transport_moves_tensor_bytes_out_of_band() -> None:
    """With pickle 5 the tensor payload leaves as buffers (what Ray's object store consumes)."""
    b = Batch.from_dict({"t": torch.randn(256, 1024)})
    buffers: list[pickle.PickleBuffer] = []
    inline = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(buf).nbytes for buf in buffers) == 256 * 1024 * 4
    assert len(inline) < 4096
    back = pickle.loads(inline, buffers=buffers)
    assert back.equals(b)
    back["t"].add_(1)  # received tensors are writable copies, never views of shared buffers
    assert not back.equals(b)


def test_nbytes_counts_tensors_and_numeric_arrays() -> None:
    b = Batch.from_dict({"a": torch.zeros(2, 4), "b": np.zeros(2, dtype=np.int32), "c": ["x", "y"]})
    assert b.nbytes == 2 * 4 * 4 + 2 * 4


def test_single_reader_batches_arrive_as_views_and_others_as_copies() -> None:
    b = Batch.from_dict({"t": torch.arange(1024.0)})
    for marked, shares_buffer in ((b.single_reader(), True), (b, False)):
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(marked, protocol=5, buffer_callback=buffers.append)
        back = pickle.loads(data, buffers=buffers)
        source = np.frombuffer(buffers[0].raw(), dtype=np.uint8)
        assert np.shares_memory(back["t"].numpy().view(np.uint8), source) is shares_buffer
        assert back.equals(b)
