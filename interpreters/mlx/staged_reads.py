"""A chain of saved blocks read onto a CUDA device through one reused, pinned host buffer.

On a CUDA build MLX's host arrays are managed memory whose pages are set up at first touch, so a
chain read straight into them (:mod:`~kvstate.interpreters.mlx.chain_reads`) pays for fresh memory on
every restore, then a migration to the device (bench/README.md, "Which step of a restore cannot reach
the raw read's pace on the GPU host"). Here each saved block's tensors are read as they lie in its
file (one contiguous read a tensor, no scatter) into a host buffer pinned once and reused, and hashed
there while in cache; the buffer is copied to the device by the driver at the bus's pace, a window at a
time, and the layers are joined on the device, where fresh memory costs little. Blocks already in RAM
join as they are.

The steps are the same with :class:`HostStaging` (a reused plain buffer, copied into an MLX array), the
staging a machine without CUDA has: what the tests run there.
"""

from __future__ import annotations

import math
import mmap
import threading

import mlx.core as mx
import numpy as np

from kvstate.interpreters.mlx import chain_reads, device_memory, framing
from kvstate.interpreters.mlx.chain_reads import HeldPart, PartRejected, SavedPart
from kvstate.interpreters.mlx.framing import DTYPE_BYTES, MX_DTYPE

#: The most host bytes a read stages before copying them to the device (a chain larger than this is read
#: a window at a time); the pinned buffer is never larger, unless one task of a read is.
WINDOW_BYTES = 512 << 20


class HostStaging:
    """A reused host buffer whose bytes reach MLX as a copy (``mx.array``): the staging of a machine
    without CUDA. One read at a time uses it (:attr:`lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buffer = np.empty(0, dtype=np.uint8)

    def host(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes``, reused from the last read where it is large enough."""
        if len(self._buffer) < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer

    def device(self, nbytes: int) -> mx.array:
        """Memory for ``nbytes`` staged bytes where the model runs; written by :meth:`copy_in`."""
        return mx.zeros((nbytes,), dtype=mx.uint8)

    def copy_in(self, device: mx.array, at: int, host: np.ndarray) -> mx.array:
        """``device`` with ``host``'s bytes from byte ``at``."""
        device[at:at + len(host)] = mx.array(host)
        return device


class PinnedStaging(HostStaging):
    """A host buffer page-locked once (and again only when it grows), copied into device memory by the
    CUDA driver (``cuMemcpyHtoD``), at the bus's pace and with no page faults on either side."""

    def __init__(self, driver) -> None:
        super().__init__()
        self._driver, self._mapped, self._pinned = driver, None, None

    def host(self, nbytes: int) -> np.ndarray:
        if len(self._buffer) < nbytes:
            self._release()
            size = -(-nbytes // (64 << 20)) * (64 << 20)  # grown in steps of 64 MiB, page-aligned (mmap)
            self._mapped = mmap.mmap(-1, size)
            self._buffer = np.frombuffer(self._mapped, dtype=np.uint8)
            self._driver.pin(self._buffer.ctypes.data, size)
            self._pinned = self._buffer.ctypes.data
        return self._buffer

    def device(self, nbytes: int) -> mx.array:
        device = mx.zeros((nbytes,), dtype=mx.uint8)  # written by a kernel: its pages are on the device
        mx.eval(device)
        return device

    def copy_in(self, device: mx.array, at: int, host: np.ndarray) -> mx.array:
        target = np.frombuffer(memoryview(device), dtype=np.uint8).ctypes.data
        self._driver.copy_in(target + at, host.ctypes.data, len(host))
        return device

    def _release(self) -> None:
        """Unpin and unmap the buffer (a pinned range must be unpinned before its memory goes)."""
        if self._pinned is not None:
            self._driver.unpin(self._pinned)
            self._pinned = None
        self._buffer = np.empty(0, dtype=np.uint8)
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None


_staging: PinnedStaging | None = None
_staging_lock = threading.Lock()
_refused = False


def cuda_staging() -> PinnedStaging | None:
    """The process's pinned staging on MLX's CUDA device, or None where there is none (no CUDA device,
    a driver that cannot be reached, or one that refused a pin or a copy: :func:`refused`)."""
    global _staging
    driver = device_memory.driver()
    if driver is None or _refused:
        return None
    with _staging_lock:
        if _staging is None:
            staging = PinnedStaging(driver)
            if not _copies_faithfully(staging):
                refused()
                return None
            _staging = staging
    return _staging


def _copies_faithfully(staging: HostStaging) -> bool:
    """Whether bytes staged and copied in arrive where the device's arrays read them: checked once,
    with a known pattern, before any restore trusts the copy (a copy that lands elsewhere would
    serve caches no hash has seen)."""
    pattern = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    try:
        with staging.lock:
            host = staging.host(len(pattern))
            host[:len(pattern)] = pattern
            device = staging.copy_in(staging.device(len(pattern) + 8), 8, host[:len(pattern)])
            return bool(mx.array_equal(device[8:], mx.array(pattern)).item())
    except (OSError, RuntimeError, TypeError, ValueError):
        return False


def refused() -> None:
    """The driver or MLX refused a pin, a copy or the device's memory (an error out of :func:`read_chain`
    other than :class:`PartRejected`): reads go the host's way from now on (a driver that refuses once
    refuses again)."""
    global _refused
    _refused = True


def read_chain(parts: list[SavedPart | HeldPart], staging: HostStaging, verify: bool = True) -> dict[str, mx.array]:
    """The joined arrays of the chain ``parts``, first position first, where ``staging`` puts them;
    each saved block verified in the staging buffer unless not ``verify``. :class:`PartRejected` names
    the first block that could not be read or failed its hash (nothing is returned then)."""
    table = chain_reads.joined_table(parts)
    tasks = [task for task in chain_reads.read_tasks(parts, table) if isinstance(parts[task[0]], SavedPart)]
    # Each saved tensor's place in the staged bytes: task after task, a task's tensors one after another.
    places: dict[tuple[int, str], tuple[int, int]] = {}
    windows, total, window_start = [], 0, 0
    for index, names in tasks:
        size = sum(_nbytes(table[name], parts[index].positions) for name in names)
        if total + size - window_start > WINDOW_BYTES and total > window_start:
            windows.append((window_start, total))
            window_start = total
        for name in names:
            places[index, name] = (total, _nbytes(table[name], parts[index].positions))
            total += places[index, name][1]
    if total > window_start:
        windows.append((window_start, total))
    with staging.lock:
        device = staging.device(total) if total else None
        host = staging.host(max((stop - start for start, stop in windows), default=0))
        done = 0
        for start, stop in windows:
            window = [task for task in tasks if start <= places[task[0], task[1][0]][0] < stop]

            def fill(task: tuple[int, list[str]], start=start) -> PartRejected | None:
                index, names = task
                part = parts[index]
                for name in names:
                    at, size = places[index, name]
                    failure = chain_reads.read_span(part, name, [host[at - start:at - start + size]], verify)
                    if failure is not None:
                        return PartRejected(index, failure)
                return None
            failures = [f for f in framing.workers().map(fill, window) if f is not None]
            if failures:
                raise failures[0]  # the first block that failed, in chain order
            device = staging.copy_in(device, start, host[:stop - start])
            done = stop
        assert done == total
        arrays = {name: _joined(parts, places, device, name, dtype, shape) for name, (dtype, shape) in table.items()}
        mx.eval(list(arrays.values()))
    return arrays


def _nbytes(described: tuple[str, list[int]], positions: int) -> int:
    dtype, shape = described
    return math.prod(shape[:-2]) * positions * shape[-1] * DTYPE_BYTES[dtype]


def _joined(parts: list[SavedPart | HeldPart], places: dict[tuple[int, str], tuple[int, int]],
            device: mx.array | None, name: str, dtype: str, shape: list[int]) -> mx.array:
    """Tensor ``name`` of the chain: its blocks side by side on the position axis, each a saved block's
    staged bytes or a RAM block's array."""
    pieces = []
    for index, part in enumerate(parts):
        if isinstance(part, HeldPart):
            pieces.append(part.arrays[name])
            continue
        at, size = places[index, name]
        staged = mx.view(device[at:at + size], MX_DTYPE[dtype])
        pieces.append(staged.reshape(*shape[:-2], part.positions, shape[-1]))
    return mx.concatenate(pieces, axis=-2) if len(pieces) > 1 else mx.contiguous(pieces[0])
