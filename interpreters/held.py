"""What every interpreter holds for the core: caches in transit (handles) and kept RAM entries.

The core names both by ints; the interpreter owns the objects. Staging, handing out and dropping
are the same whatever the caches are (simulated token lists or mlx-lm caches), so both interpreters
share them here; observers of kept prefixes too.
"""

from __future__ import annotations

from typing import Any, Callable

from kvstate.core.errors import KvStateError
from kvstate.effects import effects as fx


class InterpreterError(KvStateError, AssertionError):
    """An effect the interpreter cannot carry out: the core asked for something impossible (a bug)."""


class HeldState:
    """Handles and RAM entries, and the performers that only move them around."""

    def __init__(self) -> None:
        self._ram: dict[int, Any] = {}
        self._handles: dict[int, Any] = {}
        self.observers: list[Callable[[tuple[int, ...], str], None]] = []

    def unstage(self, handle: int) -> object:
        """Give back caches staged under ``handle`` (the call that staged them failed)."""
        return self._handles.pop(handle, None)

    def take(self, handle: int) -> Any:
        """Hand the caches under ``handle`` to the caller."""
        return self._handles.pop(handle)

    def _drop_published(self, e: fx.DropPublished) -> list:
        self._handles.pop(e.handle, None)
        return []

    def _drop_entry(self, e: fx.DropEntry) -> list:
        if self._ram.pop(e.entry, None) is None:
            raise InterpreterError(f"drop of entry {e.entry}, which holds nothing in RAM")
        return []

    def _notify_kept(self, e: fx.NotifyKept) -> list:
        for observe in self.observers:
            observe(e.key.tokens, e.key.namespace)
        return []
