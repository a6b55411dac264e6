"""Completion events: how an effect went, fed back into the core."""

from __future__ import annotations

import enum

import attrs

from kvstate.effects.effects import BlockName, CheckpointMeta, SnapshotName


class FailureReason(enum.Enum):
    """Why storage could not do what an effect asked."""

    #: The file is not there (deleted, never durable).
    MISSING = "missing"
    #: Truncated, a bad header, or a content hash that does not match.
    CORRUPT = "corrupt"
    #: Saved for another model, tokenizer, config or format version.
    IDENTITY_MISMATCH = "identity-mismatch"
    #: The device is full or the budget has no room.
    NO_SPACE = "no-space"
    #: Any other I/O failure.
    IO_ERROR = "io-error"
    #: Checkpoint metadata that does not agree with the request.
    INCONSISTENT = "inconsistent"


class Completion:
    """Base of every completion event."""

    __slots__ = ()


@attrs.frozen
class SpillDone(Completion):
    """``entry`` is durable on disk."""

    entry: int


@attrs.frozen
class SpillFailed(Completion):
    """Writing ``entry`` failed; its RAM copy is all there is."""

    entry: int
    reason: FailureReason


@attrs.frozen
class RestoreDone(Completion):
    """Saved ``entry`` was read into ``handle``, in ``seconds`` (None: the interpreter does not time reads).
    An assembly of blocks names every block it read in ``blocks`` (``entry``, the last, among them)."""

    entry: int
    handle: int
    seconds: float | None = None
    blocks: tuple[int, ...] = ()

    @property
    def read(self) -> tuple[int, ...]:
        """Every entry whose file was read (and pinned for it)."""
        return self.blocks or (self.entry,)


@attrs.frozen
class RestoreFailed(Completion):
    """Saved ``entry`` could not be read into ``handle`` (and is rejected). An assembly of blocks names
    every block it was to read in ``blocks`` (each pinned for it; ``entry``, the one that failed,
    among them)."""

    entry: int
    handle: int
    reason: FailureReason
    blocks: tuple[int, ...] = ()

    @property
    def read(self) -> tuple[int, ...]:
        """Every entry whose file was to be read (and pinned for it)."""
        return self.blocks or (self.entry,)


@attrs.frozen
class PrefetchDone(Completion):
    """Saved ``entry`` is now in RAM too, read in ``seconds`` (None: not timed)."""

    entry: int
    seconds: float | None = None


@attrs.frozen
class PrefetchFailed(Completion):
    """Saved ``entry`` could not be read ahead (and is rejected)."""

    entry: int
    reason: FailureReason


@attrs.frozen
class BlocksPrefetched(Completion):
    """The entries ``read`` (the first parts of a ``PrefetchBlocks``, in order) were read and verified,
    in ``seconds``, and wait to be settled (``SettleReadAhead``); where ``failed`` names the part that could not be read
    (``reason``), the parts after it (``unread``) were not read either."""

    read: tuple[int, ...]
    seconds: float | None = None
    failed: int | None = None
    reason: FailureReason | None = None
    #: The parts after the one that failed, not read.
    unread: tuple[int, ...] = ()


@attrs.frozen
class CheckpointWritten(Completion):
    """The checkpoint of ``key`` covering ``tokens`` tokens is durable, in a file of ``file_bytes``."""

    key: str
    tokens: int
    file_bytes: int


@attrs.frozen
class CheckpointFailed(Completion):
    """Writing the checkpoint of ``key`` failed."""

    key: str
    reason: FailureReason


@attrs.frozen
class CheckpointResumed(Completion):
    """Checkpoint ``meta`` was read into ``handle``; its caches cover ``tokens`` (prompt plus generated)."""

    handle: int
    meta: CheckpointMeta
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")


@attrs.frozen
class ResumeFailed(Completion):
    """Checkpoint ``key`` could not be read into ``handle``."""

    key: str
    handle: int
    reason: FailureReason


@attrs.frozen
class Synced(Completion):
    """Every write started before the :class:`~kvstate.effects.Sync` has completed or failed
    (``pressure`` echoes the Sync's)."""

    pressure: bool = False


@attrs.frozen
class SavedRecord:
    """One prefix saved state holds, as a scan of its headers found it."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    #: The bytes its state takes in RAM once restored, and the bytes its file takes on disk.
    nbytes: int
    trimmable: bool
    file_bytes: int
    #: When the file was last written or read back (its own time, seconds since any fixed origin):
    #: the scan keeps the most recently used where the disk budget cannot hold them all.
    used_at: float = 0.0


@attrs.frozen
class SavedBlock:
    """One block, or snapshot, saved state holds (named by a :class:`~kvstate.effects.effects.BlockName`
    or a :class:`~kvstate.effects.effects.SnapshotName`), as a scan of its header found it: its bytes
    in RAM and on disk, and its file's own time."""

    name: BlockName | SnapshotName
    nbytes: int
    file_bytes: int
    used_at: float = 0.0
    #: Whether a block's state can serve any shorter prefix alone (plain KV), or only with a snapshot at
    #: its chain's end (a model whose other layers cannot be cut).
    trimmable: bool = True


@attrs.frozen
class SavedCheckpoint:
    """One durable generation checkpoint, as a scan of its header found it."""

    meta: CheckpointMeta
    tokens: int
    file_bytes: int
    #: When the checkpoint was written (its file's own time).
    used_at: float = 0.0


@attrs.frozen
class Scanned(Completion):
    """At start: what saved state already holds (prefixes and durable checkpoints)."""

    records: tuple[SavedRecord, ...] = ()
    checkpoints: tuple[SavedCheckpoint, ...] = ()
    #: Files the scan rejected (foreign, corrupt) and moved aside.
    rejected: int = 0
    #: Saved blocks (state kept in blocks), each with its chain's name.
    blocks: tuple[SavedBlock, ...] = ()


@attrs.frozen
class RemoteFetched(Completion):
    """A ``FetchRemote`` of ``asked`` ended: ``blocks``, its first blocks, were read from the shared tier,
    verified and kept on disk (``nbytes`` read in ``seconds``: None where not timed); then, where it
    stopped early, the next object was ``rejected`` (it failed its checks: nothing of it kept) or the
    tier ``failed`` (down, slow, an error), else the tier lacked it."""

    asked: tuple[BlockName, ...]
    blocks: tuple[SavedBlock, ...] = ()
    nbytes: int = 0
    seconds: float | None = None
    rejected: bool = False
    failed: bool = False
    #: Where the fetch asked for a partial block alone (no ``asked``): its namespace and ``after``.
    tail: tuple[str, bytes] | None = None


@attrs.frozen
class RemoteOffered(Completion):
    """An ``OfferRemote`` of ``name`` ended: True, written; False, the tier had it (another server's
    write stands); None, not written (the tier failed, or the file was gone)."""

    name: BlockName
    written: bool | None
