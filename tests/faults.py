"""Faults below the file API, each at a chosen rate: a reusable fixture for the MLX disk store.

:class:`DiskFaults` stands between the store and the device through the store's two storage seams:
its writes (``write_file``, the store's argument) and its reads of saved bytes
(``file_io.read_into`` and, for blocks read into their place in a chain, ``file_io.read_pieces``, which
:meth:`DiskFaults.installed` patches). Each call draws, from its own
seeded generator, whether one of the enabled faults strikes:

- on a read: ``eio_on_read`` (the read raises EIO), ``short_read`` (half the bytes come back),
  ``flipped_bytes`` (the bytes come back with one bit flipped, as from a disk that lies);
- on a write: ``enospc_on_write`` (nothing written, ENOSPC), ``eio_on_write`` (half written, then
  EIO), ``eio_on_fsync`` (all written, the fsync fails).

``injected`` counts what struck, so a test can tell a run that met faults from one that did not.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import random
from pathlib import Path

from kvstate.interpreters.mlx import file_io

READ_FAULTS = ("eio_on_read", "short_read", "flipped_bytes")
WRITE_FAULTS = ("enospc_on_write", "eio_on_write", "eio_on_fsync")


class DiskFaults:
    """Reads and writes of the disk store that fail at ``rate`` (0 to 1), drawn from ``seed``."""

    def __init__(self, rate: float, seed: int = 0, kinds: tuple[str, ...] = READ_FAULTS + WRITE_FAULTS):
        unknown = set(kinds) - set(READ_FAULTS + WRITE_FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {READ_FAULTS + WRITE_FAULTS}")
        self.rate, self.kinds = rate, tuple(kinds)
        self.random = random.Random(seed)
        self.injected: collections.Counter = collections.Counter()

    def _strikes(self, among: tuple[str, ...]) -> str | None:
        """The fault that strikes this call, if one does (at most one per call)."""
        enabled = [kind for kind in among if kind in self.kinds]
        if not enabled or self.random.random() >= self.rate:
            return None
        kind = self.random.choice(enabled)
        self.injected[kind] += 1
        return kind

    # ------------------------------------------------------------ reads

    @contextlib.contextmanager
    def installed(self):
        """The store's reads go through these faults while the block runs."""
        real, real_pieces, by_path = file_io.read_into, file_io.read_pieces, file_io.READ_BY_PATH
        file_io.READ_BY_PATH = False  # MLX's loader reads through the seam too, not by the file's path

        def read_into(file, view: memoryview) -> int:
            fault = self._strikes(READ_FAULTS)
            if fault == "eio_on_read":
                raise OSError(errno.EIO, "Input/output error (injected)")
            if fault == "short_read":
                return real(file, view[:len(view) // 2])
            count = real(file, view)
            if fault == "flipped_bytes" and count:
                at = self.random.randrange(count)
                view[at] = view[at] ^ (1 << self.random.randrange(8))
            return count

        def read_pieces(file, views: list, offset: int) -> int:
            fault = self._strikes(READ_FAULTS)
            if fault == "eio_on_read":
                raise OSError(errno.EIO, "Input/output error (injected)")
            if fault == "short_read":
                half = views[:len(views) // 2] if len(views) > 1 else [views[0][:len(views[0]) // 2]]
                return real_pieces(file, half, offset)
            count = real_pieces(file, views, offset)
            if fault == "flipped_bytes" and count:
                piece = self.random.choice([view for view in views if len(view)])
                at = self.random.randrange(len(piece))
                piece[at] = piece[at] ^ (1 << self.random.randrange(8))
            return count

        file_io.read_into, file_io.read_pieces = read_into, read_pieces
        try:
            yield self
        finally:
            file_io.read_into, file_io.read_pieces, file_io.READ_BY_PATH = real, real_pieces, by_path

    # ------------------------------------------------------------ writes

    def write_file(self, path: Path, chunks: list) -> None:
        """The store's ``write_file``: :func:`file_io.write_durably` with write faults."""
        fault = self._strikes(WRITE_FAULTS)
        if fault is None:
            return file_io.write_durably(path, chunks)
        if fault == "enospc_on_write":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            for n, chunk in enumerate(chunks):
                if fault == "eio_on_write" and n >= len(chunks) // 2:
                    out.flush()
                    raise OSError(errno.EIO, "Input/output error (injected)")
                out.write(memoryview(chunk))
            out.flush()
        raise OSError(errno.EIO, "Input/output error on fsync (injected)")  # eio_on_fsync: all written
