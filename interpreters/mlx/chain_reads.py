"""A chain of blocks read straight into each layer's joined arrays: one read of every byte, no join.

Reading a chain one block file at a time costs a load per file and then a join that copies every byte
again, as mlx-lm's caches hold one array a layer (``bench/README.md``, "State in blocks"). Here the
chain is handed to MLX's safetensors loader as one file whose tensors are the joined arrays
(:class:`ChainFile`): MLX allocates each array once, and each block's span of it is read from that
block's file into its place (one scattered read: a piece a row of the position axis) and hashed
there, while still in cache, against the hash its file's header recorded. Blocks already in RAM are
copied into their place. Reads and hashes of a tensor's blocks run on a few threads.

Every array of a block has its positions on axis -2 (:mod:`~kvstate.interpreters.mlx.blocks`), so the
joined array of a tensor is its blocks' arrays side by side on that axis.
"""

from __future__ import annotations

import io
import json
import os
import struct
from typing import Any, BinaryIO

import attrs
import mlx.core as mx
import numpy as np

from kvstate.effects.completions import FailureReason
from kvstate.interpreters.mlx import content_hash, file_io, framing
from kvstate.interpreters.mlx.file_io import RejectedFile
from kvstate.interpreters.mlx.framing import DTYPE_BYTES, SAFETENSORS_DTYPE


@attrs.frozen
class SavedPart:
    """A block to read from its open ``file`` (``name`` in messages), whose header has been checked:
    its tensor table, where its data starts, the hash it recorded for each tensor, and the positions it
    covers."""

    file: BinaryIO
    name: str
    tensors: dict[str, Any]
    data_start: int
    hashes: dict[str, str]
    positions: int


@attrs.frozen
class HeldPart:
    """A block already in RAM: its evaluated arrays by tensor name (``"layer.array"``)."""

    arrays: dict[str, mx.array]
    positions: int


class PartRejected(Exception):
    """Block ``index`` of a chain cannot be restored; ``rejected`` says why."""

    def __init__(self, index: int, rejected: RejectedFile):
        super().__init__(f"block {index} of the chain: {rejected}")
        self.index, self.rejected = index, rejected


def _described(part: SavedPart | HeldPart) -> dict[str, tuple[str, list[int]]]:
    if isinstance(part, HeldPart):
        return {name: (SAFETENSORS_DTYPE[a.dtype], list(a.shape)) for name, a in part.arrays.items()}
    return {name: (info["dtype"], list(info["shape"])) for name, info in part.tensors.items()}


def joined_table(parts: list[SavedPart | HeldPart]) -> dict[str, tuple[str, list[int]]]:
    """Each tensor of the joined chain: its dtype and shape (the blocks' positions summed on axis -2).

    :class:`PartRejected` (corrupt) for a saved block whose tensors do not line up with the chain's
    (other names, dtypes or shapes, or other positions than its name covers)."""
    table: dict[str, tuple[str, list[int]]] = {}
    for index, part in enumerate(parts):
        described = _described(part)
        fits = all(len(shape) >= 2 and shape[-2] == part.positions for _, shape in described.values())
        if table:
            fits = fits and set(described) == set(table) and all(
                dtype == table[name][0] and shape[:-2] == table[name][1][:-2] and shape[-1] == table[name][1][-1]
                for name, (dtype, shape) in described.items())
        if not fits:
            label = part.name if isinstance(part, SavedPart) else f"block {index}, held in RAM"
            raise PartRejected(index, RejectedFile(FailureReason.CORRUPT, f"{label}: its tensors do not line up "
                                                                          f"with the chain's"))
        for name, (dtype, shape) in described.items():
            joined = table[name][1][-2] if name in table else 0
            table[name] = (dtype, [*shape[:-2], joined + shape[-2], shape[-1]])
    return table


class ChainFile(io.RawIOBase):
    """The chain as MLX's safetensors loader reads a file: a header naming the joined tensors, then
    each tensor's bytes, filled from the blocks when the loader reads it (it reads a tensor whole,
    into the array's own memory). The first block that fails is kept in ``failure`` (the loader
    only says that a read failed)."""

    def __init__(self, parts: list[SavedPart | HeldPart], verify: bool):
        super().__init__()
        self.parts, self.verify = parts, verify
        self.failure: PartRejected | None = None
        self.table = joined_table(parts)
        layout, offset = {}, 0
        for name, (dtype, shape) in self.table.items():
            size = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
            layout[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(layout, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._head = struct.pack("<Q", len(encoded)) + encoded
        self._size = len(self._head) + offset
        self._tensor_at = {len(self._head) + info["data_offsets"][0]: name for name, info in layout.items()}
        self._starts = np.cumsum([0] + [part.positions for part in parts]).tolist()
        # The bytes of blocks held in RAM, taken here on the caller's thread (MLX work stays off the workers).
        self._held = {index: dict(zip(part.arrays, framing.bytes_of(list(part.arrays.values()))))
                      for index, part in enumerate(parts) if isinstance(part, HeldPart)}
        self._position = 0

    def readinto(self, view) -> int:
        target = memoryview(view).cast("B")
        if self._position < len(self._head):
            count = min(len(target), len(self._head) - self._position)
            target[:count] = self._head[self._position:self._position + count]
            self._position += count
            return count
        name = self._tensor_at.get(self._position)
        if name is None or len(target) != self._tensor_bytes(name):
            self.failure = self.failure or PartRejected(0, RejectedFile(
                FailureReason.IO_ERROR, f"the loader read {len(target)} bytes at {self._position}, not one tensor"))
            raise OSError("a read of a chain that is not one whole tensor")
        try:
            self._fill(name, target)
        except PartRejected as failure:
            self.failure = self.failure or failure
            raise OSError(str(failure)) from None
        self._position += len(target)
        return len(target)

    def _tensor_bytes(self, name: str) -> int:
        dtype, shape = self.table[name]
        return int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]

    def _fill(self, name: str, target: memoryview) -> None:
        """The joined tensor ``name``: each block's span read (or copied) into its place, on a few threads."""
        dtype, shape = self.table[name]
        row = shape[-1] * DTYPE_BYTES[dtype]
        rows = np.frombuffer(target, dtype=np.uint8).reshape(int(np.prod(shape[:-2], dtype=np.int64)), shape[-2] * row)
        groups = np.array_split(np.arange(len(self.parts)), min(framing.WORKER_COUNT, len(self.parts)))
        # Consecutive blocks a thread; the map raises the first group's failure, if any.
        list(framing.workers().map(lambda indices: [self._fill_part(int(i), name, rows, row) for i in indices],
                                   groups))

    def _fill_part(self, index: int, name: str, rows: np.ndarray, row: int) -> None:
        part = self.parts[index]
        start, width = self._starts[index] * row, part.positions * row
        if isinstance(part, HeldPart):
            rows[:, start:start + width] = self._held[index][name].reshape(len(rows), width)
            return
        pieces = [rows[k, start:start + width] for k in range(len(rows))]
        want = width * len(rows)
        try:
            got = file_io.read_pieces(part.file, pieces, part.data_start + part.tensors[name]["data_offsets"][0])
        except (OSError, ValueError) as error:
            raise PartRejected(index, RejectedFile(FailureReason.IO_ERROR, f"{part.name}: {error}")) from None
        if got != want:
            raise PartRejected(index, RejectedFile(FailureReason.IO_ERROR, f"{part.name}: a read of {want} bytes "
                                                                           f"got {got}"))
        if self.verify:
            hasher = content_hash.hasher()
            for piece in pieces:
                hasher.update(piece)
            if hasher.hexdigest() != part.hashes.get(name):
                raise PartRejected(index, RejectedFile(FailureReason.CORRUPT, f"{part.name}: tensor {name!r} "
                                                                              f"fails its hash"))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def read_chain(parts: list[SavedPart | HeldPart], verify: bool = True) -> dict[str, mx.array]:
    """The joined arrays of the chain ``parts``, first position first, in host memory; each saved
    block verified where it lies unless not ``verify``. :class:`PartRejected` names the first block
    that could not be read or failed its hash (nothing is returned then)."""
    chain = ChainFile(parts, verify)
    try:
        arrays = mx.load(chain, format="safetensors", stream=mx.cpu)
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError, OSError) as error:
        if chain.failure is not None:
            raise chain.failure from None
        first = next((i for i, part in enumerate(parts) if isinstance(part, SavedPart)), 0)
        raise PartRejected(first, RejectedFile(FailureReason.IO_ERROR, f"the chain's load failed: {error}")) from None
    return arrays
