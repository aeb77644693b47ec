"""Reading rows (and row-chunked columns) of safetensors tensors without mapping the files.

Why not ``safe_open(...).get_slice``: it memory-maps the file, and every page a read touches
stays resident in the process for as long as the file is open, which doubles a loader's host
peak (the shard it builds, plus the file pages it came from). The format is simple enough to
read directly (safetensors' ``README``): an 8-byte little-endian header length, a JSON header
mapping each name to ``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the
header), then the row-major data. Rows ``[start, stop)`` of dim 0 are therefore one contiguous
byte range, read into a fresh buffer with ``readinto``; columns are cut from row chunks of at
most :data:`READ_CHUNK_BYTES`. Nothing stays resident once the caller drops the tensor.

Callers: the FSDP backend's sharded load (each rank's ``Shard(0)`` rows) and the Megatron
backend's (each TP rank's rows, or columns of the row-parallel weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["READ_CHUNK_BYTES", "SafetensorsRows"]

READ_CHUNK_BYTES = 64 << 20
"""The most checkpoint bytes held on the host at once while loading (one read's buffer)."""

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsRows:
    """The tensors of one directory's ``*.safetensors`` files, read by rows with positioned reads.

    Names, dtypes and shapes come from the files' headers at construction (no data is read);
    see the module docstring for the format and why no memory map.
    """

    def __init__(self, directory: Path) -> None:
        self._entries: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        for shard in sorted(Path(directory).glob("*.safetensors")):
            with shard.open("rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(
                        f"{shard}: {name} has dtype {entry['dtype']}, which the loader does not read"
                    )
                begin = 8 + length + int(entry["data_offsets"][0])
                self._entries[name] = (shard, begin, dtype, tuple(int(d) for d in entry["shape"]))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][3]

    def element_size(self, name: str) -> int:
        return torch.empty((), dtype=self._entries[name][2]).element_size()

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (the whole tensor when it has no dim 0)."""
        shard, begin, dtype, shape = self._entries[name]
        row_elements = 1
        for size in shape[1:]:
            row_elements *= size
        element_bytes = self.element_size(name)
        if not shape:
            start, stop, row_elements = 0, 1, 1
        count = (stop - start) * row_elements * element_bytes
        buffer = torch.empty(count, dtype=torch.uint8)
        with shard.open("rb", buffering=0) as f:
            f.seek(begin + start * row_elements * element_bytes)
            view = memoryview(buffer.numpy().data)
            done = 0
            while done < count:
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{shard}: {name} ends before its data_offsets say")
                done += got
        tensor = buffer.view(dtype)
        return tensor.reshape(shape) if not shape else tensor.reshape(stop - start, *shape[1:])

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (for small ones: norms, biases, heads)."""
        shape = self.shape(name)
        return self.read_rows(name, 0, shape[0]) if shape else self.read_rows(name, 0, 1)

    def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` of dim 1 of the 2-D tensor ``name``, from row chunks.

        Each chunk of rows holds at most :data:`READ_CHUNK_BYTES` of the file; only its columns
        are kept, so the host holds the result plus one chunk.
        """
        shape = self.shape(name)
        if len(shape) != 2:
            raise ValueError(f"read_columns: {name} has shape {shape}; columns are read from 2-D tensors")
        rows = shape[0]
        step = max(1, READ_CHUNK_BYTES // max(1, shape[1] * self.element_size(name)))
        out = torch.empty((rows, stop - start), dtype=self._entries[name][2])
        for first in range(0, rows, step):
            last = min(rows, first + step)
            out[first:last] = self.read_rows(name, first, last)[:, start:stop]
        return out
