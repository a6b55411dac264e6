"""Raw file I/O under the disk store: the read seam, durable writes, owner-only directories, and how a
restore reads a file.

Every read of a saved file's bytes goes through :func:`read_into` (or, for MLX's own loader, through
the open file's own path or :class:`SeamReader`, which calls it), or, for a block read into its place
in a chain's arrays, :func:`read_pieces`: the seams the fault tests patch.
Writes go through :func:`write_durably` (the store's default ``write_file``). A file that cannot be
trusted is :class:`RejectedFile`, a write that did not land :class:`WriteFailed`, each with the
reason the core hears.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kvstate.core.errors import StorageError
from kvstate.effects.completions import FailureReason
from kvstate.interpreters.mlx.device_memory import on_cuda


class RejectedFile(StorageError):
    """A saved file that cannot be restored; it was moved aside."""

    def __init__(self, reason: FailureReason, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class WriteFailed(StorageError):
    """A write that did not become durable (nothing under the real name changed)."""

    def __init__(self, reason: FailureReason, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


def read_into(file: BinaryIO, view: memoryview) -> int:
    """Read ``file`` into ``view`` until it is full or the file ends; the bytes read (fewer: a short read)."""
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            break
        done += count
    return done


def read_pieces(file: BinaryIO, views: list[memoryview], offset: int) -> int:
    """Read ``file`` from ``offset`` into ``views`` one after another (a scattered read: each view is
    one piece of the bytes that follow), until they are full or the file ends; the bytes read."""
    fd = file.fileno()
    got = os.preadv(fd, views, offset) if hasattr(os, "preadv") else 0
    at = 0
    for view in views:  # what one scattered read left (a short read, or no preadv here), piece by piece
        have = min(max(got - at, 0), len(view))
        while have < len(view):
            count = _pread_into(fd, view[have:], offset + at + have)
            if not count:
                return at + have
            have += count
        at += len(view)
    return at


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    memoryview(view).cast("B")[:len(data)] = data
    return len(data)


#: Whether MLX's loader may read a file by its open descriptor's own path (``/proc/self/fd/N`` names
#: the very file that was opened, even once it is renamed or deleted). Linux only: elsewhere such
#: paths share the descriptor's offset, or do not exist. The fault fixture turns it off, since faults
#: below the file API reach MLX's reads only through :class:`SeamReader`.
READ_BY_PATH = sys.platform.startswith("linux")


def open_file_path(file: BinaryIO) -> str | None:
    """A path that opens ``file`` itself again, for MLX's own reader; None where there is none."""
    if not READ_BY_PATH:
        return None
    path = f"/proc/self/fd/{file.fileno()}"
    return path if os.path.exists(path) else None


class SeamReader(io.RawIOBase):
    """The open file as MLX's safetensors loader reads it: every read goes through :func:`read_into`
    (the storage seam the fault fixture patches), and the first that fails or comes back short is
    kept as the :class:`RejectedFile` the restore raises (the loader only says that it failed)."""

    def __init__(self, file: BinaryIO, name: str):
        super().__init__()
        self._file, self._name = file, name
        self.failure: RejectedFile | None = None

    def readinto(self, view) -> int:
        try:
            got = read_into(self._file, memoryview(view).cast("B"))
        except (OSError, ValueError) as error:
            self.failure = self.failure or RejectedFile(FailureReason.IO_ERROR, f"{self._name}: {error}")
            raise
        if got < len(view) and self.failure is None:
            self.failure = RejectedFile(FailureReason.IO_ERROR, f"{self._name}: a read of {len(view)} bytes "
                                                                f"got {got}")
        return got

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


#: How restores read a file: into a host buffer the store reuses, then copied into MLX arrays
#: (``"buffer"``), or by MLX's own safetensors loader straight into the arrays (``"mlx"``).
LOADERS = ("buffer", "mlx")


def default_loader() -> str:
    """``"mlx"`` where MLX reads a file by its path (Linux) or the default device is a CUDA GPU, else
    ``"buffer"``: there MLX's own reader restores sooner than the reused buffer (bench/README.md has
    the figures, CPU and GPU)."""
    return "mlx" if READ_BY_PATH or on_cuda() else "buffer"


class ReadBuffers:
    """Host buffers that restores read files into, reused: a fresh buffer per read pays the page faults
    of memory never touched (as much again as the read, measured), and MLX copies the tensors out of
    it anyway. One buffer is kept, up to ``keep_bytes``; a read while it is in use, or a larger one,
    gets a buffer of its own."""

    def __init__(self, keep_bytes: int = 1 << 30):
        self.keep_bytes = keep_bytes
        self._kept: np.ndarray | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, size: int):
        if size > self.keep_bytes or not self._lock.acquire(blocking=False):
            yield np.empty(size, dtype=np.uint8)
            return
        try:
            if self._kept is None or len(self._kept) < size:
                self._kept = np.empty(size, dtype=np.uint8)
            yield self._kept[:size]
        finally:
            self._lock.release()


def write_durably(path: Path, chunks: list) -> None:
    """Write ``chunks`` to a new file at ``path`` and fsync it."""
    # Owner-only: saved KV state reveals the prompts it was computed from.
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        for chunk in chunks:
            out.write(memoryview(chunk))
        out.flush()
        os.fsync(out.fileno())


def private_directory(path: Path) -> None:
    """Make ``path`` (and its missing parents) owner-only (0700): saved KV state reveals the prompts it
    was computed from. A directory that already exists keeps its mode: an operator's choice stands."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile by another store


def remove_quietly(path: Path) -> None:
    """Delete ``path`` if it is there; where it cannot be deleted (a read-only file system) it stays:
    what the service no longer claims is never read, so a leftover file costs only its bytes."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def writer_alive(temp_name: str) -> bool:
    """Whether the process that names itself in a temp file (``.NAME.tmp-PID-THREAD``) is still running."""
    try:
        pid = int(temp_name.rsplit(".tmp-", 1)[1].split("-", 1)[0])
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # alive, another user's
    return True
