"""What the disk tier could not do, said in the server's log once, with sizes, not only counted.

A full or read-only disk, the write cap, a budget with no room and files rejected at a restore
otherwise show only as counters on ``/metrics``. :class:`DiskNotices` reads the service's report
after each fetch and insert and logs the first time each kind of trouble happens (later ones are
counted only), saying what happened, what it costs, and which counter follows it. At start,
:func:`start_notices` says what the flags themselves promise badly: a ``--disk-bytes`` larger than
the file system can give, or smaller than one block of the model's state.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kvstate.core.checks import size_text

#: The share of a file system's free space the disk tier takes where ``--disk-bytes`` is not given.
DEFAULT_FREE_SHARE = 0.5


def bytes_under(directory: Path) -> int:
    """The bytes of the files under ``directory`` (those a restarted tier would count again)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def available_bytes(directory: Path) -> int:
    """What the disk tier under ``directory`` could hold: the file system's free bytes, plus the saved
    files already there (they are counted in the budget already)."""
    return shutil.disk_usage(directory).free + bytes_under(directory)


def default_disk_bytes(directory: Path) -> int:
    """``--disk-bytes`` where only ``--disk-dir`` is given: a share of what the file system can give."""
    return int(DEFAULT_FREE_SHARE * available_bytes(directory))


def start_notices(directory: Path, disk_bytes: int, block_bytes: int | None) -> list[str]:
    """What the disk tier's flags promise badly, one line each (nothing: they are fine): a budget the
    file system cannot give, or one too small for a single block of the model's state."""
    notices = []
    available = available_bytes(directory)
    if disk_bytes > available:
        notices.append(f"--disk-bytes {size_text(disk_bytes)} is more than the file system of --disk-dir can give "
                       f"({size_text(available)} free, with the saved files already there): writes will fail "
                       f"once it fills (kvstate_failed_writes_total); give at most that")
    if block_bytes is not None and disk_bytes < block_bytes:
        notices.append(f"--disk-bytes {size_text(disk_bytes)} holds less than one block of this model's state "
                       f"({size_text(block_bytes)}): nothing will be written to disk")
    return notices


class DiskNotices:
    """Logs the first failed write, dropped write, write over the cap and rejected file, with sizes.

    The counters are read at each check (cheap: ``counts``); the report, for the sizes, only when
    something is said."""

    #: Each report counter watched, and what its first increase means.
    WATCHED = ("failed_writes", "dropped_writes", "spills_over_rate", "rejected_files", "remote_rejected")

    def __init__(self, service: Any, directory: Path, disk_bytes: int, write_cap: int | None):
        self.service = service
        self.directory = directory
        self.disk_bytes = disk_bytes
        self.write_cap = write_cap
        counts = service.counts()
        self._seen = {name: getattr(counts, name) for name in self.WATCHED}
        self._said: set[str] = set()
        self.said: list[str] = []

    def check(self) -> None:
        """Read the report; say each kind of trouble the first time its counter grows."""
        if len(self._said) == len(self.WATCHED):
            return
        counts = self.service.counts()
        for name in self.WATCHED:
            value = getattr(counts, name)
            if value > self._seen[name] and name not in self._said:
                self._said.add(name)
                line = f"{getattr(self, f'_{name}')(self.service.report())}; later ones are counted in kvstate_{name}_total"
                self.said.append(line)
                logging.warning("kvstate: %s", line)
            self._seen[name] = value

    def _failed_writes(self, report: Any) -> str:
        try:
            free = shutil.disk_usage(self.directory).free
            writable = os.access(self.directory, os.W_OK)
        except OSError as error:
            return f"a write to the disk tier failed, and --disk-dir {self.directory} cannot be read ({error.strerror})"
        why = (f"--disk-dir {self.directory} is not writable" if not writable else
               f"the file system has {size_text(free)} free" if free < (1 << 30) else "an I/O error")
        return f"a write to the disk tier failed ({why}): the state stays in RAM, not durable"

    def _dropped_writes(self, report: Any) -> str:
        return (f"a spill or checkpoint was not written: no room in the write queue or in --disk-bytes "
                f"{size_text(self.disk_bytes)} ({size_text(report.disk_bytes)} held) that eviction could make")

    def _spills_over_rate(self, report: Any) -> str:
        cap = size_text(self.write_cap) if self.write_cap is not None else "the cap"
        return f"a spill was not written: --disk-write-bytes-per-hour {cap} is spent for now"

    def _remote_rejected(self, report: Any) -> str:
        return ("an object of the shared tier failed its checks (damaged, or not the block its name says) and was "
                "rejected: nothing of it was kept or restored, and the request computed what it lacked")

    def _rejected_files(self, report: Any) -> str:
        return (f"{report.rejected_files} saved files were rejected (damaged, or of another model) and moved aside "
                f"({report.rejected_held_files} held, {size_text(report.rejected_held_bytes)}); nothing of them was "
                f"restored")
