"""A chain of saved blocks read onto a CUDA device through one reused, pinned host buffer.

On a CUDA build MLX's host arrays are managed memory whose pages are set up at first touch, so a
chain read straight into them (:mod:`~kvstate.interpreters.mlx.chain_reads`) pays for fresh memory on
every restore, then a migration to the device (bench/README.md, "Which step of a restore cannot reach
the raw read's pace on the GPU host"). Here each saved block's tensors are read as they lie in its
file (one contiguous read a tensor, no scatter) into a host buffer pinned once and reused, and hashed
there while in cache; the driver copies it, at the bus's pace, into a window of device memory kept for
the purpose (managed memory resident on the device, whose address the host may hand the driver), and
the layers are joined on the device from there, a window of at most :data:`WINDOW_BYTES` at a time.
Blocks already in RAM join as they are.

The device's window is kept because MLX hands out a device array's address only by first moving the
array into managed memory (a copy of every byte, at a fraction of the bus's pace): a fresh one each
restore would cost that each time.

The steps are the same with :class:`HostStaging` (a reused host buffer copied in place into a reused
MLX array), the staging a machine without CUDA has: what the tests run there.
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

#: The most bytes a read stages at once (a chain larger than this is read a window at a time): the size
#: of the pinned host buffer and of the device's window, unless one task of a read is larger.
WINDOW_BYTES = 256 << 20


class HostStaging:
    """A reused host buffer and a reused MLX array (the window) it is copied into in place: the staging
    of a machine without CUDA. One read at a time uses it (:attr:`lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buffer = np.empty(0, dtype=np.uint8)
        self._window: mx.array | None = None

    def host(self, nbytes: int) -> np.ndarray:
        """A host buffer of at least ``nbytes``, reused from the last read where it is large enough."""
        if len(self._buffer) < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer

    def window(self, nbytes: int) -> mx.array:
        """Memory for ``nbytes`` staged bytes where the model runs (at least that many), reused from the
        last read where it is large enough; written by :meth:`copy_in`."""
        if self._window is None or self._window.size < nbytes:
            self._window = self._new_window(nbytes)
        return self._window

    def _new_window(self, nbytes: int) -> mx.array:
        window = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(window)
        return window

    def close(self) -> None:
        """Give back the host buffer and the window."""
        with self.lock:
            self._buffer, self._window = np.empty(0, dtype=np.uint8), None

    def copy_in(self, host: np.ndarray) -> mx.array:
        """The window, holding ``host``'s bytes from its start: written in place, as the driver writes
        the device's (what was made from the window before must have been copied out of it)."""
        np.asarray(self._window)[:len(host)] = host
        return self._window


class PinnedStaging(HostStaging):
    """A host buffer page-locked once (and again only when it grows), copied by the CUDA driver
    (``cuMemcpyHtoD``) into a window of managed memory kept on the device: at the bus's pace, with no
    page faults on either side."""

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

    def _new_window(self, nbytes: int) -> mx.array:
        self._window = None  # the old window's memory goes back to MLX first
        window = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(window)
        self._address = np.frombuffer(memoryview(window), dtype=np.uint8).ctypes.data  # moves it to managed memory
        device_memory.move_to_device([window])  # and its pages back onto the device, where they stay
        return window

    def copy_in(self, host: np.ndarray) -> mx.array:
        self._driver.copy_in(self._address, host.ctypes.data, len(host))
        return self._window

    def close(self) -> None:
        with self.lock:
            self._release()
            self._window = None

    def _release(self) -> None:
        """Unpin and unmap the host buffer (a pinned range must be unpinned before its memory goes)."""
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
                _refuse(staging)
                return None
            _staging = staging
    return _staging


def _copies_faithfully(staging: HostStaging) -> bool:
    """Whether bytes staged and copied in arrive where the device's arrays read them: checked once,
    with a known pattern, before any restore trusts the copy (a copy that lands elsewhere would
    serve caches no hash has seen). The buffers are made at their full size here, so a restore that
    stages no more than a window meets them ready: pinned, and on the device."""
    pattern = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    try:
        with staging.lock:
            host = staging.host(max(WINDOW_BYTES, len(pattern)))
            host[:len(pattern)] = pattern
            staging.window(max(WINDOW_BYTES, len(pattern)))
            window = staging.copy_in(host[:len(pattern)])
            return bool(mx.array_equal(window[:len(pattern)], mx.array(pattern)).item())
    except (OSError, RuntimeError, TypeError, ValueError):
        return False


def refused() -> None:
    """The driver or MLX refused a pin, a copy or the device's memory (an error out of :func:`read_chain`
    other than :class:`PartRejected`): reads go the host's way from now on (a driver that refuses once
    refuses again)."""
    _refuse(_staging)


def _refuse(staging: HostStaging | None) -> None:
    global _refused, _staging
    _refused, _staging = True, None
    if staging is not None:
        try:
            staging.close()
        except OSError:  # a driver that refused a copy may refuse the unpin too: the memory stays as it is
            pass


def read_chain(parts: list[SavedPart | HeldPart], staging: HostStaging, verify: bool = True) -> dict[str, mx.array]:
    """The joined arrays of the chain ``parts``, first position first, where ``staging`` puts them;
    each saved block verified in the staging buffer unless not ``verify``. :class:`PartRejected` names
    the first block that could not be read or failed its hash (nothing is returned then)."""
    table = chain_reads.joined_table(parts)
    tasks = [task for task in chain_reads.read_tasks(parts, table) if isinstance(parts[task[0]], SavedPart)]
    windows: list[list[tuple[int, list[str]]]] = []  # consecutive tasks of at most WINDOW_BYTES (or one task)
    size = WINDOW_BYTES
    for index, names in tasks:
        task_bytes = sum(_nbytes(table[name], parts[index].positions) for name in names)
        if size + task_bytes > WINDOW_BYTES:
            windows.append([])
            size = 0
        windows[-1].append((index, names))
        size += task_bytes
    # Each tensor's pieces in chain order: runs of consecutive saved blocks joined on the device, a window
    # at a time, and the RAM blocks' arrays; joined once more where there is more than one.
    pieces: dict[str, list[tuple[int, mx.array]]] = {name: [] for name in table}
    for index, part in enumerate(parts):
        if isinstance(part, HeldPart):
            for name in table:
                pieces[name].append((index, part.arrays[name]))
    with staging.lock:
        for window in windows:
            places: dict[tuple[int, str], tuple[int, int]] = {}
            at = 0
            for index, names in window:
                for name in names:
                    places[index, name] = (at, _nbytes(table[name], parts[index].positions))
                    at += places[index, name][1]
            host = staging.host(at)
            staging.window(at)

            def fill(task: tuple[int, list[str]]) -> PartRejected | None:
                index, names = task
                for name in names:
                    start, length = places[index, name]
                    failure = chain_reads.read_span(parts[index], name, [host[start:start + length]], verify)
                    if failure is not None:
                        return PartRejected(index, failure)
                return None
            failures = [f for f in framing.workers().map(fill, window) if f is not None]
            if failures:
                raise failures[0]  # the first block that failed, in chain order
            runs = _runs(parts, places, staging.copy_in(host[:at]), table)
            mx.eval([array for _, _, array in runs])  # out of the window before the next read overwrites it
            for index, name, array in runs:
                pieces[name].append((index, array))
    arrays = {}
    for name, held in pieces.items():
        ordered = [array for _, array in sorted(held, key=lambda item: item[0])]
        arrays[name] = ordered[0] if len(ordered) == 1 else mx.concatenate(ordered, axis=-2)
    mx.eval(list(arrays.values()))
    return arrays


def _nbytes(described: tuple[str, list[int]], positions: int) -> int:
    dtype, shape = described
    return math.prod(shape[:-2]) * positions * shape[-1] * DTYPE_BYTES[dtype]


def _runs(parts: list[SavedPart | HeldPart], places: dict[tuple[int, str], tuple[int, int]], window: mx.array,
          table: dict[str, tuple[str, list[int]]]) -> list[tuple[int, str, mx.array]]:
    """The staged tensors of a window, as ``(first block, name, array)``: each tensor's pieces of
    consecutive blocks joined side by side on the position axis, copied out of the window."""
    by_name: dict[str, list[int]] = {}
    for index, name in places:
        by_name.setdefault(name, []).append(index)
    runs = []
    for name, indices in by_name.items():
        dtype, shape = table[name]
        indices.sort()
        run: list[mx.array] = []
        for k, index in enumerate(indices):
            at, size = places[index, name]
            staged = mx.view(window[at:at + size], MX_DTYPE[dtype])
            run.append(staged.reshape(*shape[:-2], parts[index].positions, shape[-1]))
            if k + 1 == len(indices) or indices[k + 1] != index + 1:  # the run ends here
                first = index - len(run) + 1
                runs.append((first, name, mx.concatenate(run, axis=-2) if len(run) > 1 else mx.array(run[0])))
                run = []
    return runs
