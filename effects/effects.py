"""Effects: what the core asks an interpreter to do.

The core holds ids, token counts and bytes; tensors and files belong to the
interpreter. ``handle`` names caches in transit between the caller and the
interpreter (staged by ``publish``, handed out by ``acquire``); ``entry`` names
a kept prefix; a :class:`DiskKey` names saved state by what it covers.
Effects marked *completes* answer with a completion event (done or failed).
"""

from __future__ import annotations

import itertools
from typing import Iterator, NamedTuple

import attrs


@attrs.frozen
class DiskKey:
    """Saved state's name: the namespace and the exact tokens it covers."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")


@attrs.frozen
class BlockName:
    """A block's name (:mod:`kvstate.core.blocks`): its namespace, its chain key, its parent's key (the
    namespace's key for a first block), the position it starts at and its own tokens. The key is the
    hash of the parent's key and the tokens, so a reader checks the name against what it read."""

    namespace: str
    key: bytes = attrs.field(repr=lambda k: k.hex()[:12])
    parent: bytes = attrs.field(repr=lambda k: k.hex()[:12])
    start: int
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")


@attrs.frozen
class SnapshotName:
    """A snapshot's name: its namespace, the tokens it is the state after, and the chain key of the
    block its chain ends in (the block holding the other layers' state up to its end)."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    parent: bytes = attrs.field(repr=lambda k: k.hex()[:12])


@attrs.frozen
class CheckpointMeta:
    """What a generation checkpoint records beside its caches."""

    key: str
    namespace: str
    prompt_tokens: int
    generated_tokens: int
    pending_token: int | None
    seed: int
    seed_was_explicit: bool
    #: What the caller records beside the checkpoint, as given (kvstate reads nothing in it): a server
    #: keeps there what its retry needs, its request's fingerprint and what it sent before.
    note: str = ""


class Effect:
    """Base of every effect."""

    __slots__ = ()


@attrs.frozen
class MakeFresh(Effect):
    """Build empty caches for the model into ``handle``."""

    handle: int


@attrs.frozen
class CloneEntry(Effect):
    """Copy kept RAM ``entry`` trimmed to its first ``tokens`` tokens into ``handle``."""

    entry: int
    tokens: int
    handle: int


@attrs.frozen
class AdoptPublished(Effect):
    """The caches staged under ``handle`` become kept RAM ``entry``."""

    handle: int
    entry: int


class KeptSpan(NamedTuple):
    """Positions ``start`` to ``stop`` of staged caches, kept as RAM block ``entry``; ``parent`` is the
    block before it on its chain (None at the chain's start)."""

    entry: int
    start: int
    stop: int
    parent: int | None


@attrs.frozen
class KeepBlocks(Effect):
    """Spans of the caches staged under ``handle`` become kept RAM blocks, first position first (the
    staged caches stay staged: a ``DropPublished`` lets them go). One effect for a publish's blocks:
    the staged caches hold each block's parent's positions too, so an interpreter may keep
    consecutive blocks as views of one array, and it comes after the drops of what the chain
    supersedes, so the interpreter cutting it knows what stays."""

    handle: int
    spans: tuple[KeptSpan, ...]


@attrs.frozen
class KeepSnapshot(Effect):
    """The state of the layers that cannot be cut, in the caches staged under ``handle`` (at their
    end), becomes kept RAM snapshot ``entry`` (the staged caches stay staged)."""

    handle: int
    entry: int


@attrs.frozen
class BlockPart:
    """One part of an assembly: RAM ``entry``, or, where ``saved`` names it, read from its file. A
    snapshot is the last part of its chain."""

    entry: int
    saved: BlockName | SnapshotName | None = None


@attrs.frozen
class AssembleBlocks(Effect):
    """Caches of the consecutive ``blocks`` (entry ids, first position first), trimmed to their first
    ``tokens`` tokens, into ``handle``; where the last part is a snapshot, the layers that cannot be cut
    are its (its length is ``tokens``). ``saved`` names, block by block, the file each part is read
    from (None: RAM holds it); empty where RAM holds every part, a hit's commonest case, so a hit
    carries its chain as plain ids. Completes where a part is read from disk (``RestoreDone`` naming
    the last block, or ``RestoreFailed`` naming the block that failed); otherwise answers nothing, as
    a clone."""

    handle: int
    tokens: int
    blocks: tuple[int, ...]
    saved: tuple[BlockName | SnapshotName | None, ...] = ()

    @property
    def reads(self) -> bool:
        return any(name is not None for name in self.saved)

    def parts(self) -> Iterator[tuple[int, BlockName | SnapshotName | None]]:
        """``(entry, saved)`` of each part, first position first (``saved`` None: from RAM); a name
        for each block where any is named (``ValueError`` on reaching a mismatch)."""
        if not self.saved:
            return zip(self.blocks, itertools.repeat(None))
        return zip(self.blocks, self.saved, strict=True)


@attrs.frozen
class DropPublished(Effect):
    """The caches staged under ``handle`` are not kept: release them."""

    handle: int


@attrs.frozen
class DropEntry(Effect):
    """Release the RAM copy of ``entry`` (a saved copy, if any, stays)."""

    entry: int


@attrs.frozen
class SpillEntry(Effect):
    """Write RAM ``entry`` to saved state under ``key`` (a whole prefix's, or a block's name; ``nbytes``
    in RAM, a file of ``file_bytes``); completes, possibly later."""

    entry: int
    key: DiskKey | BlockName | SnapshotName
    nbytes: int
    trimmable: bool
    file_bytes: int


@attrs.frozen
class RestoreEntry(Effect):
    """Read saved ``key`` trimmed to ``tokens`` tokens into ``handle``; completes."""

    entry: int
    key: DiskKey
    tokens: int
    handle: int


@attrs.frozen
class PrefetchEntry(Effect):
    """Read saved ``key`` into RAM as ``entry`` ahead of a request; completes."""

    entry: int
    key: DiskKey


@attrs.frozen
class PrefetchBlocks(Effect):
    """Read the saved ``parts`` of one chain (each named by ``saved``; first position first, a
    snapshot last) ahead of a request, stopping at the first that fails; completes once
    (``BlocksPrefetched``), and what was read becomes RAM state only once settled (``SettleReadAhead``)."""

    parts: tuple[BlockPart, ...]


@attrs.frozen
class SettleReadAhead(Effect):
    """What a read ahead (``PrefetchBlocks``) brought: the ``taken`` entries' state becomes theirs in RAM,
    the ``dropped`` ones' is let go (their blocks went elsewhere while they were read)."""

    taken: tuple[int, ...]
    dropped: tuple[int, ...]


@attrs.frozen
class DeleteFile(Effect):
    """Delete the saved state under ``key`` (evicted from the disk tier): a prefix's or a block's."""

    key: DiskKey | BlockName | SnapshotName


@attrs.frozen
class NotifyKept(Effect):
    """Tell observers that a prefix covering ``key.tokens`` in ``key.namespace`` is kept."""

    key: DiskKey


@attrs.frozen
class FetchRemote(Effect):
    """Read the blocks ``names`` (one chain of ``namespace``, first position first, the first after
    block ``after`` at position ``start``) from the shared tier, stopping at the first it cannot give
    or that fails its checks; where it lacks one (or has them all), then the longest partial block it
    holds after the last one read whose tokens ``prompt`` (the request's) goes on with (one that
    covers it all serves it cut back, as any trimmable state). Each verified block is kept on disk as
    a saved block; completes (``RemoteFetched``), possibly later."""

    names: tuple[BlockName, ...]
    namespace: str
    prompt: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    after: bytes = attrs.field(repr=lambda k: k.hex()[:12])
    start: int


@attrs.frozen
class OfferRemote(Effect):
    """Write saved block ``name`` (its file) to the shared tier unless it is there; completes
    (``RemoteOffered``), possibly later."""

    name: BlockName


@attrs.frozen
class BlockStored(Effect):
    """Tell block observers that tier ``medium`` (``"ram"`` or ``"disk"``) now holds the full block
    ``name`` (what a fleet's router reads: :mod:`~kvstate.core.block_events`)."""

    name: BlockName
    medium: str


@attrs.frozen
class BlockRemoved(Effect):
    """Tell block observers that tier ``medium`` no longer holds the full block keyed ``key`` in
    ``namespace``."""

    namespace: str
    key: bytes = attrs.field(repr=lambda k: k.hex()[:12])
    medium: str


@attrs.frozen
class WriteCheckpoint(Effect):
    """Write the caches staged under ``handle`` as generation checkpoint ``meta``; completes."""

    handle: int
    meta: CheckpointMeta
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    nbytes: int
    file_bytes: int


@attrs.frozen
class DeleteCheckpoint(Effect):
    """Delete every checkpoint of generation ``key``."""

    key: str


@attrs.frozen
class ResumeCheckpoint(Effect):
    """Read generation checkpoint ``key`` into ``handle``; completes."""

    key: str
    handle: int


@attrs.frozen
class Sync(Effect):
    """Wait until every write started so far has completed or failed; completes with :class:`Synced`
    (``pressure``: the wait is memory pressure's, whose spills hold RAM until they land)."""

    pressure: bool = False
