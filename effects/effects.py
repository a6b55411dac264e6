"""Effects: what the core asks an interpreter to do.

The core holds ids, token counts and bytes; tensors and files belong to the
interpreter. ``handle`` names caches in transit between the caller and the
interpreter (staged by ``publish``, handed out by ``acquire``); ``entry`` names
a kept prefix; a :class:`DiskKey` names saved state by what it covers.
Effects marked *completes* answer with a completion event (done or failed).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class DiskKey:
    """Saved state's name: the namespace and the exact tokens it covers."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")


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
    """Write RAM ``entry`` to saved state under ``key`` (``nbytes`` in RAM, a file of ``file_bytes``);
    completes, possibly later."""

    entry: int
    key: DiskKey
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
class DeleteFile(Effect):
    """Delete the saved state under ``key`` (evicted from the disk tier)."""

    key: DiskKey


@attrs.frozen
class NotifyKept(Effect):
    """Tell observers that a prefix covering ``key.tokens`` in ``key.namespace`` is kept."""

    key: DiskKey


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
