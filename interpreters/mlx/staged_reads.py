"""A chain of saved blocks read onto a CUDA device through one reused, pinned host buffer.

On a CUDA build MLX's host arrays are managed memory whose pages are set up at first touch, so a
chain read straight into them (:mod:`~kvstate.interpreters.mlx.chain_reads`) pays for fresh memory on
every restore, then a migration to the device (bench/README.md, "Which step of a restore cannot reach
the raw read's pace on the GPU host"). Here the chain is read the same way (each block's span of a
tensor into its place in the joined tensor, hashed there while in cache), but into a host buffer
pinned once and reused; the driver copies it, at the bus's pace, into a window of device memory kept
for the purpose (managed memory resident on the device, whose address the host may hand the driver),
and each tensor is copied out of the window on the device, some tensors of at most
:data:`WINDOW_BYTES` together at a time. The spans of blocks already in RAM are written over it there.

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

from kvstate.interpreters.mlx import chain_reads, device_memory
from kvstate.interpreters.mlx.chain_reads import HeldPart, SavedPart
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
    other than :class:`~kvstate.interpreters.mlx.chain_reads.PartRejected`): reads go the host's way
    from now on (a driver that refuses once refuses again)."""
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
    each saved block verified in the staging buffer unless not ``verify``.
    :class:`~kvstate.interpreters.mlx.chain_reads.PartRejected` names the first block that could not be
    read or failed its hash (nothing is returned then).

    The staging holds each tensor as its joined array lies (every block's span read into its place,
    as :func:`~kvstate.interpreters.mlx.chain_reads.read_chain` reads into host memory), some tensors a
    window, so each becomes one array on the device in one copy; the spans of blocks held in RAM are
    written over it there."""
    table = chain_reads.joined_table(parts)
    starts = np.cumsum([0] + [part.positions for part in parts]).tolist()  # where each block's span starts
    held = [(index, part) for index, part in enumerate(parts) if isinstance(part, HeldPart)]
    windows: list[list[str]] = []  # tensors, in table order, of at most WINDOW_BYTES together (or one tensor)
    size = WINDOW_BYTES
    for name, described in table.items():
        nbytes = _nbytes(described)
        if size + nbytes > WINDOW_BYTES:
            windows.append([])
            size = 0
        windows[-1].append(name)
        size += nbytes
    tasks = [task for task in chain_reads.read_tasks(parts, table) if isinstance(parts[task[0]], SavedPart)]
    arrays: dict[str, mx.array] = {}
    with staging.lock:
        for names in windows:
            places, at = {}, 0
            for name in names:
                places[name] = at
                at += _nbytes(table[name])
            host, window = staging.host(at), set(names)
            # Each of the window's tensors in the host buffer as its joined array lies.
            rows = {name: chain_reads.as_rows(host[places[name]:places[name] + _nbytes(table[name])], table[name])
                    for name in names}
            in_window = [(index, [name for name in task if name in window]) for index, task in tasks]
            chain_reads.fill_spans(parts, table, rows, [task for task in in_window if task[1]], verify)
            staging.window(at)
            device = staging.copy_in(host[:at])
            for name in names:
                dtype, shape = table[name]
                staged = mx.view(device[places[name]:places[name] + _nbytes(table[name])], MX_DTYPE[dtype])
                joined = mx.array(staged.reshape(shape))  # a copy: the window is written again by the next
                for index, part in held:
                    joined[..., starts[index]:starts[index + 1], :] = part.arrays[name]
                arrays[name] = joined
            mx.eval([arrays[name] for name in names])  # out of the window before the next read overwrites it
    return arrays


def _nbytes(described: tuple[str, list[int]]) -> int:
    dtype, shape = described
    return math.prod(shape) * DTYPE_BYTES[dtype]
