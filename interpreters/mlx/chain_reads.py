"""A chain of blocks read straight into each layer's joined arrays: one read of every byte, no join.

Reading a chain one block file at a time costs a load per file and then a join that copies every byte
again, as mlx-lm's caches hold one array a layer (``bench/README.md``, "State in blocks"). Here each
joined array is allocated once, in host memory, and every block's span of it is read from that
block's file straight into its place (one scattered read a tensor: a piece a row of the position
axis) and hashed there, while still in cache, against the hash its file's header recorded. Blocks
already in RAM are copied into their place. Blocks are read on a few threads, in tasks of a block's
tensors of some megabytes: few Python calls for many bytes (the reads let go of the GIL), and
threads evenly busy on a short chain.

Every array of a block has its positions on axis -2 (:mod:`~kvstate.interpreters.mlx.blocks`), so the
joined array of a tensor is its blocks' arrays side by side on that axis.
"""

from __future__ import annotations

import io
import json
import math
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


def read_chain(parts: list[SavedPart | HeldPart], verify: bool = True) -> dict[str, mx.array]:
    """The joined arrays of the chain ``parts``, first position first, in host memory; each saved
    block verified where it lies unless not ``verify``. :class:`PartRejected` names the first block
    that could not be read or failed its hash (nothing is returned then)."""
    table = joined_table(parts)
    arrays = unfilled_arrays(table)
    # Each array's bytes as rows of the position axis, written in place (the arrays are this read's alone).
    rows = {name: as_rows(np.asarray(mx.view(arrays[name], mx.uint8)) if arrays[name].size
                          else np.empty(0, np.uint8), table[name]) for name in table}
    held = {index: dict(zip(part.arrays, framing.bytes_of(list(part.arrays.values()))))
            for index, part in enumerate(parts) if isinstance(part, HeldPart)}  # MLX work stays on this thread
    fill_spans(parts, table, rows, read_tasks(parts, table), verify, held)
    return arrays


def as_rows(flat: np.ndarray, described: tuple[str, list[int]]) -> np.ndarray:
    """A joined tensor's bytes ``flat`` (of ``described``'s dtype and shape) as rows of its position axis:
    each block's span of it is a column range."""
    dtype, shape = described
    return flat.reshape(math.prod(shape[:-2]), shape[-2] * shape[-1] * DTYPE_BYTES[dtype])


def fill_spans(parts: list[SavedPart | HeldPart], table: dict[str, tuple[str, list[int]]], rows: dict[str, np.ndarray],
               tasks: list[tuple[int, list[str]]], verify: bool, held: dict[int, dict[str, np.ndarray]] | None = None
               ) -> None:
    """Each task's spans (a block, some of its tensors) written into its place in ``rows`` (each joined
    tensor's bytes as rows of the position axis), on a few threads: a saved block's read from its file
    and verified there unless not ``verify``, a RAM block's copied from its bytes in ``held``.
    :class:`PartRejected` names the first block, in chain order, that could not be read or failed."""
    starts = np.cumsum([0] + [part.positions for part in parts]).tolist()

    def fill(task: tuple[int, list[str]]) -> PartRejected | None:
        index, names = task
        part = parts[index]
        for name in names:
            dtype, shape = table[name]
            row = shape[-1] * DTYPE_BYTES[dtype]
            start, width = starts[index] * row, part.positions * row
            target = rows[name]
            if isinstance(part, HeldPart):
                target[:, start:start + width] = held[index][name].reshape(len(target), width)
                continue
            failure = read_span(part, name, [target[k, start:start + width] for k in range(len(target))], verify)
            if failure is not None:
                return PartRejected(index, failure)
        return None
    failures = [f for f in framing.workers().map(fill, tasks) if f is not None]
    if failures:
        raise failures[0]  # the first block that failed, in chain order


#: About the bytes one task of a chain read reads: tasks of a block's tensors this size keep the
#: threads evenly busy on a short chain, and few enough Python calls a byte on a long one.
TASK_BYTES = 8 << 20


def read_tasks(parts: list[SavedPart | HeldPart], table: dict[str, tuple[str, list[int]]]) -> list[tuple[int, list[str]]]:
    """The chain read's tasks, in chain order: each a block and some of its tensors, of about
    ``TASK_BYTES`` together."""
    tasks = []
    for index, part in enumerate(parts):
        names, size = [], 0
        for name, (dtype, shape) in table.items():
            names.append(name)
            size += math.prod(shape[:-2]) * part.positions * shape[-1] * DTYPE_BYTES[dtype]
            if size >= TASK_BYTES:
                tasks.append((index, names))
                names, size = [], 0
        if names:
            tasks.append((index, names))
    return tasks


class _Unfilled(io.RawIOBase):
    """A safetensors file of ``table``'s tensors whose data reads fill nothing: loaded by MLX, arrays
    allocated and never written (MLX has no allocation without a fill of its own, and a gigabyte's
    fill costs a third of its read)."""

    def __init__(self, table: dict[str, tuple[str, list[int]]]):
        super().__init__()
        layout, offset = {}, 0
        for name, (dtype, shape) in table.items():
            size = math.prod(shape) * DTYPE_BYTES[dtype]
            layout[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(layout, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._head = struct.pack("<Q", len(encoded)) + encoded
        self._size, self._position = len(self._head) + offset, 0

    def readinto(self, view) -> int:
        target = memoryview(view).cast("B")
        if self._position < len(self._head):  # the header is read for real
            count = min(len(target), len(self._head) - self._position)
            target[:count] = self._head[self._position:self._position + count]
        else:
            count = min(len(target), self._size - self._position)
        self._position += count
        return count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._position = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence] + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def unfilled_arrays(table: dict[str, tuple[str, list[int]]]) -> dict[str, mx.array]:
    """Evaluated arrays of ``table``'s dtypes and shapes in host memory, their bytes not yet written."""
    if not table:
        return {}
    arrays = mx.load(_Unfilled(table), format="safetensors", stream=mx.cpu)
    mx.eval(list(arrays.values()))
    return arrays


def read_span(part: SavedPart, name: str, pieces: list[np.ndarray], verify: bool) -> RejectedFile | None:
    """Tensor ``name`` of the saved block ``part`` read into ``pieces`` (its rows in the joined array)
    and checked against its recorded hash; why not, if it could not be."""
    want = sum(len(piece) for piece in pieces)
    try:
        got = file_io.read_pieces(part.file, pieces, part.data_start + part.tensors[name]["data_offsets"][0])
    except (OSError, ValueError) as error:
        return RejectedFile(FailureReason.IO_ERROR, f"{part.name}: {error}")
    if got != want:
        return RejectedFile(FailureReason.IO_ERROR, f"{part.name}: a read of {want} bytes got {got}")
    if verify:
        hasher = content_hash.hasher()
        for piece in pieces:
            hasher.update(piece)
        if hasher.hexdigest() != part.hashes.get(name):
            return RejectedFile(FailureReason.CORRUPT, f"{part.name}: tensor {name!r} fails its hash")
    return None
