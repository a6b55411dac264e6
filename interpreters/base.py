"""The one interpreter contract: what the facade calls, and which method performs each effect.

The core names caches and kept entries by ints; an interpreter owns the objects
behind them. :class:`Interpreter` is what the facade needs of one.
:data:`PERFORMERS` maps every effect to the method that carries it out, the
same for every interpreter, so a new effect is one line here and one method
in each interpreter (a test checks that none is missing). :class:`HeldState`
holds what every interpreter holds alike: caches in transit (handles), kept
RAM entries, observers, and the performers that only move them around.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import attrs

from kvstate.core.blocks import block_key
from kvstate.core.errors import KvStateError
from kvstate.core.tokens import packed
from kvstate.effects import effects as fx
from kvstate.effects.completions import Scanned
from kvstate.interpreters.observers import Observers


@attrs.frozen
class CacheFacts:
    """What an interpreter measures of caches a caller hands in (``covered`` None: the caches cannot tell)."""

    covered: int | None
    nbytes: int
    trimmable: bool


@attrs.frozen
class BlockSizes:
    """What state in blocks takes, as an interpreter measures it: each block's ``(nbytes, file_bytes)``
    (of the layers that can be cut), and, where some layers cannot be cut, their state's at the end
    (kept as a snapshot; None where every layer is cut)."""

    blocks: tuple[tuple[int, int], ...]
    snapshot: tuple[int, int] | None = None


class InterpreterError(KvStateError, AssertionError):
    """An effect the interpreter cannot carry out: the core asked for something impossible (a bug)."""


#: Each effect, and the name of the interpreter method that performs it (returning its completions).
PERFORMERS: dict[type, str] = {
    fx.MakeFresh: "_make_fresh",
    fx.CloneEntry: "_clone_entry",
    fx.AdoptPublished: "_adopt_published",
    fx.KeepBlocks: "_keep_blocks",
    fx.KeepSnapshot: "_keep_snapshot",
    fx.AssembleBlocks: "_assemble_blocks",
    fx.DropPublished: "_drop_published",
    fx.DropEntry: "_drop_entry",
    fx.SpillEntry: "_spill_entry",
    fx.RestoreEntry: "_restore_entry",
    fx.PrefetchEntry: "_prefetch_entry",
    fx.PrefetchBlocks: "_prefetch_blocks",
    fx.SettleReadAhead: "_settle_read_ahead",
    fx.DeleteFile: "_delete_file",
    fx.NotifyKept: "_notify_kept",
    fx.FetchRemote: "_fetch_remote",
    fx.OfferRemote: "_offer_remote",
    fx.BlockStored: "_tell_block_observers",
    fx.BlockRemoved: "_tell_block_observers",
    fx.WriteCheckpoint: "_write_checkpoint",
    fx.DeleteCheckpoint: "_delete_checkpoint",
    fx.ResumeCheckpoint: "_resume_checkpoint",
    fx.Sync: "_sync",
}


@runtime_checkable
class Interpreter(Protocol):
    """What the service facade needs of an interpreter."""

    observers: Observers
    block_observers: list[Callable[[fx.BlockStored | fx.BlockRemoved], None]]

    @property
    def now(self) -> float:
        """The interpreter's clock, in seconds (the facade feeds it to the core as a tick)."""

    def fresh(self) -> Any:
        """The model's empty caches."""

    def stage(self, handle: int, caches: object) -> CacheFacts:
        """Hold caches a caller hands in under ``handle`` and measure them."""

    def stage_object(self, handle: int, value: object) -> int:
        """Hold a tensor object under ``handle``; its bytes."""

    def file_bytes(self, handle: int, key: fx.DiskKey, facts: CacheFacts) -> int:
        """The bytes the file of the state staged under ``handle`` would take."""

    def checkpoint_file_bytes(self, handle: int, meta: fx.CheckpointMeta, tokens: tuple[int, ...]) -> int:
        """The bytes the checkpoint file of the caches staged under ``handle`` would take."""

    def block_bytes(self, handle: int, namespace: str, tokens: tuple[int, ...],
                    spans: tuple[tuple[int, int], ...]) -> BlockSizes | None:
        """Where the caches staged under ``handle`` (covering ``tokens``) can be kept in blocks at
        ``spans``: each block's bytes in RAM and its file's bytes (0 without a disk tier), and the
        snapshot's where some layers cannot be cut; None where no layer can be cut (kept whole)."""

    def take(self, handle: int) -> Any:
        """Hand the caches under ``handle`` to the caller."""

    def take_object(self, handle: int) -> Any:
        """Hand the object under ``handle`` to the caller."""

    def unstage(self, handle: int) -> object:
        """Give back caches staged under ``handle`` (the call that staged them failed)."""

    def scan(self) -> Scanned:
        """What saved state holds at start."""

    def rejected_held(self) -> tuple[int, int]:
        """Rejected files kept aside for inspection, and their bytes."""

    def saved_prefixes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(namespace, tokens)`` of every saved prefix, read without changing anything."""

    def perform(self, effect: fx.Effect) -> list:
        """Carry out ``effect``; the completion events it produced now."""

    def poll(self) -> list:
        """Completions of background work finished since the last poll."""

    def close(self) -> None:
        """The service closed: release what the interpreter holds. Idempotent."""


class HeldState:
    """Handles and RAM entries, the performers that only move them around, and the dispatch."""

    #: A name for messages ("the simulator", "the MLX interpreter").
    name = "the interpreter"

    def __init__(self) -> None:
        self._ram: dict[int, Any] = {}
        self._handles: dict[int, Any] = {}
        #: RAM entries that are snapshots (the state of the layers blocks do not hold), not blocks.
        self._snapshots: set[int] = set()
        #: State read ahead, by entry, with whether it is a snapshot: RAM state once settled.
        self._ahead: dict[int, tuple[Any, bool]] = {}
        #: Called with ``(tokens, namespace)`` of each prefix kept (``NotifyKept``).
        self.observers = Observers("kept prefixes")
        #: Called with each ``BlockStored`` and ``BlockRemoved`` the core emits (``block_events`` on).
        self.block_observers: list[Callable[[fx.BlockStored | fx.BlockRemoved], None]] = []
        self._performers: dict[type, Callable[[Any], list]] = {
            effect: getattr(self, method) for effect, method in PERFORMERS.items()}

    def perform(self, effect: fx.Effect) -> list:
        """Carry out ``effect``; the completion events it produced now."""
        performer = self._performers.get(type(effect))
        if performer is None:
            raise InterpreterError(f"{self.name} has no performer for {type(effect).__name__}")
        return performer(effect)

    def unstage(self, handle: int) -> object:
        """Give back caches staged under ``handle`` (the call that staged them failed)."""
        return self._handles.pop(handle, None)

    def take(self, handle: int) -> Any:
        """Hand the caches under ``handle`` to the caller."""
        return self._handles.pop(handle)

    def ram_entries(self) -> set[int]:
        """The entries whose state it holds in RAM (for checks: exactly the core's RAM entries)."""
        return set(self._ram)

    def ahead_entries(self) -> set[int]:
        """The entries whose state was read ahead and not settled yet (for checks)."""
        return set(self._ahead)

    def _settle_read_ahead(self, e: fx.SettleReadAhead) -> list:
        for entry in e.taken:
            held, snapshot = self._ahead.pop(entry)
            self._ram[entry] = held
            if snapshot:
                self._snapshots.add(entry)
        for entry in e.dropped:
            self._ahead.pop(entry, None)
        return []

    def _drop_published(self, e: fx.DropPublished) -> list:
        self._handles.pop(e.handle, None)
        return []

    def _drop_entry(self, e: fx.DropEntry) -> list:
        if self._ram.pop(e.entry, None) is None:
            raise InterpreterError(f"drop of entry {e.entry}, which holds nothing in RAM")
        self._snapshots.discard(e.entry)
        return []

    def _is_snapshot(self, entry: int, saved: fx.BlockName | fx.SnapshotName | None) -> bool:
        """Whether part ``entry`` of an assembly (read from ``saved`` if named) is a snapshot (the last
        one of its chain, if any)."""
        return entry in self._snapshots if saved is None else isinstance(saved, fx.SnapshotName)

    def _notify_kept(self, e: fx.NotifyKept) -> list:
        self.observers.tell(e.key.tokens, e.key.namespace)
        return []

    def _tell_block_observers(self, e: fx.BlockStored | fx.BlockRemoved) -> list:
        for observe in self.block_observers:
            observe(e)
        return []


def fetch_in_order(e: fx.FetchRemote, kept: Callable[[fx.BlockName], bool | None],
                   children: Callable[[bytes], list[tuple[int, bytes]]]) -> None:
    """How every interpreter carries out a ``FetchRemote``: ``kept(name)`` each block of the chain in
    order (True: fetched and kept; False: the store lacks it; None: stop, it failed its checks or the
    store or disk failed), up to the first that is not kept; then, where the store lacked one (or had
    them all), the longest partial block after the last one kept that the prompt goes on with, among
    ``children(parent)`` (``(tokens, key)`` of the blocks the store holds after ``parent``; None: the
    store failed)."""
    parent, position, outcome = e.after, e.start, False
    for name in e.names:
        outcome = kept(name)
        if not outcome:
            break
        parent, position = name.key, position + len(name.tokens)
    else:
        outcome = False  # every block kept: the partial one after them, if any
    if outcome is not False:
        return
    size = len(e.names[0].tokens) if e.names else None
    window = e.prompt[position:position + size - 1] if size else e.prompt[position:]
    if not window:
        return
    listed = children(parent)
    for length, key in listed or ():
        if 0 < length <= len(window) and block_key(parent, packed(window[:length])) == key:
            kept(fx.BlockName(e.namespace, key, parent, position, tuple(window[:length])))
            return
