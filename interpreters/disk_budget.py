"""One byte budget for a saved-state root, shared by every store under it.

Several models (one directory each) and several processes may save under the
same root. Each live store holds a shared ``flock`` on its directory's
``.live`` file; a directory whose lock can be taken exclusively has no live
store and is idle. ``reclaim`` runs under the root's own lock file: while the
root holds more than its budget, it deletes the oldest saved files of idle
directories (never a live one's). A store attaches when its service starts and
reclaims again when it closes, so what it leaves behind counts and may go.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvstate.interpreters.disk_store import SUFFIX

LIVE = ".live"
ROOT_LOCK = ".budget.lock"


def _saved_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_file() and p.name.endswith(SUFFIX) and not p.name.startswith(".")]


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in _saved_files(directory))


class RootBudget:
    """The byte budget of a saved-state root."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the root budget must be a non-negative int of bytes, got {max_bytes!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._held: dict[Path, int] = {}

    def attach(self, directory: Path) -> None:
        """Mark ``directory`` live (a shared lock held until :meth:`detach`)."""
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(directory / LIVE, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        self._held[directory] = descriptor

    def detach(self, directory: Path) -> None:
        descriptor = self._held.pop(directory, None)
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)

    def _idle(self, directory: Path) -> bool:
        if directory in self._held:
            return False
        try:
            descriptor = os.open(directory / LIVE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(descriptor)  # closing drops the probe's lock
        return True

    def used_bytes(self) -> int:
        return sum(directory_bytes(d) for d in self.root.iterdir() if d.is_dir())

    def reclaim(self) -> int:
        """Delete the oldest files of idle directories until the root fits; the bytes freed."""
        lock = os.open(self.root / ROOT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        freed = 0
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            directories = [d for d in self.root.iterdir() if d.is_dir()]
            used = sum(directory_bytes(d) for d in directories)
            if used <= self.max_bytes:
                return 0
            candidates = sorted((p.stat().st_mtime, p) for d in directories if self._idle(d)
                                for p in _saved_files(d))
            for _, path in candidates:
                if used - freed <= self.max_bytes:
                    break
                size = path.stat().st_size
                path.unlink(missing_ok=True)
                freed += size
            return freed
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
