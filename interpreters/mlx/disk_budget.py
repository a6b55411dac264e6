"""One byte budget for a saved-state root, shared by every store under it.

Several models (one directory each) and several processes may save under the
same root. Each live store holds a shared ``flock`` on its directory's
``.live`` file; a directory whose lock can be taken exclusively has no live
store and is idle. ``reclaim`` runs under the root's own lock file: while the
root holds more than its budget, it deletes the oldest saved files of idle
directories (never a live one's). A store attaches when its service starts and
reclaims again when it closes, so what it leaves behind counts and may go.

Live stores delete their own evicted files without the root lock, so any file
or directory listed here may be gone by the time it is looked at: a file that
vanished counts nothing and is skipped, never an error.
"""

from __future__ import annotations

import fcntl
import os
from stat import S_ISREG
from pathlib import Path

from kvstate.interpreters.mlx.disk_store import SUFFIX
from kvstate.interpreters.mlx.file_io import private_directory

LIVE = ".live"
ROOT_LOCK = ".budget.lock"


def _listing(directory: Path) -> list[os.DirEntry]:
    """The entries of ``directory``; none when it is gone or unreadable."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def _saved_files(directory: Path) -> list[tuple[float, int, Path]]:
    """``(mtime, size, path)`` of each saved file in ``directory`` still there when looked at."""
    found = []
    for entry in _listing(directory):
        if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:  # deleted by a live store since the listing
            continue
        if S_ISREG(stat.st_mode):  # a plain file, not a link (not followed) or a directory
            found.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    return found


def _directories(root: Path) -> list[Path]:
    directories = []
    for entry in _listing(root):
        try:
            if entry.is_dir(follow_symlinks=False):
                directories.append(Path(entry.path))
        except OSError:
            continue
    return directories


def directory_bytes(directory: Path) -> int:
    """The bytes the saved files in ``directory`` take, as the file system counts their sizes."""
    return sum(size for _, size, _ in _saved_files(directory))


class RootBudget:
    """The byte budget of a saved-state root."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the root budget must be a non-negative int of bytes, got {max_bytes!r}")
        self.root = Path(root)
        private_directory(self.root)
        self.max_bytes = max_bytes
        self._held: dict[Path, int] = {}

    def attach(self, directory: Path) -> None:
        """Mark ``directory`` live (a shared lock held until :meth:`detach`)."""
        private_directory(directory)
        descriptor = os.open(directory / LIVE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH)
        except BaseException:
            os.close(descriptor)
            raise
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
            descriptor = os.open(directory / LIVE, os.O_RDWR | os.O_CREAT, 0o600)
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
        return sum(directory_bytes(d) for d in _directories(self.root))

    def reclaim(self) -> int:
        """Delete the oldest files of idle directories until the root fits; the bytes freed."""
        lock = os.open(self.root / ROOT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        freed = 0
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            directories = _directories(self.root)
            used = sum(directory_bytes(d) for d in directories)
            if used <= self.max_bytes:
                return 0
            candidates = sorted(found for d in directories if self._idle(d) for found in _saved_files(d))
            for _, size, path in candidates:
                if used - freed <= self.max_bytes:
                    break
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass  # gone meanwhile: its bytes are free all the same
                except OSError:
                    continue  # cannot be deleted (read-only): it still counts
                freed += size
            return freed
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
