"""What ``step`` answers: small values, one per kind of call."""

from __future__ import annotations

import enum

import attrs

from kvstate.effects.effects import CheckpointMeta


class Admission(enum.Enum):
    """The answer to ``admit``."""

    #: Admitted: the request holds its projected bytes until release.
    ADMITTED = "admitted"
    #: Not now: admitted requests hold too much of the budget; try again after a release.
    WAIT = "wait"


class Source(enum.Enum):
    """Where an acquired state came from."""

    FRESH = "fresh"            #: new empty caches (a miss)
    RAM = "ram"                #: a kept prefix in RAM
    DISK = "disk"              #: saved state read from disk
    CHECKPOINT = "checkpoint"  #: a resumed generation


@attrs.frozen
class Acquired:
    """``acquire``'s decision: the caches in ``handle`` cover ``reused_tokens`` prompt tokens."""

    lease: int | None
    handle: int
    reused_tokens: int
    source: Source
    resumed: CheckpointMeta | None = None
    #: A resumed generation's tokens: the prompt, then what was generated before the checkpoint.
    resumed_tokens: tuple[int, ...] = ()


class NotKeptReason(enum.Enum):
    """Why published state was not kept."""

    TOO_LARGE = "too-large"   #: larger than the whole RAM capacity
    NO_ROOM = "no-room"       #: every entry that could make room is pinned
    NO_FULL_BLOCK = "no-full-block"  #: kept in blocks without partial ones, and shorter than one block
    NOT_WORTH_ITS_BYTES = "not-worth-its-bytes"  #: a chunk snapshot that saves too little for its bytes
    READ_IN_FLIGHT = "read-in-flight"  #: blocks of its chain are being read ahead into RAM
    #: a chunk snapshot no held prefix goes past (a guess at a branch point), with no free RAM for it
    NO_FREE_ROOM_FOR_A_GUESS = "no-free-room-for-a-guess"


@attrs.frozen
class Kept:
    """Published state is kept as ``entry`` (``duplicate``: the same tokens were already kept)."""

    entry: int
    duplicate: bool = False


@attrs.frozen
class NotKept:
    """Published state was dropped, and why."""

    reason: NotKeptReason


@attrs.frozen
class FlushResult:
    """Whether every kept prefix and checkpoint is durable, and what is still pending."""

    durable: bool
    pending_writes: int
    pending_write_bytes: int
    ram_only_entries: int


@attrs.frozen
class ScanResult:
    """What the scan at start did with saved state: files kept as disk entries (prefixes and
    checkpoints), files deleted because the disk budget could not hold them (the least recently used
    first), and files rejected (moved aside), each with their bytes."""

    kept: int = 0
    kept_bytes: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    rejected: int = 0
    #: The disk budget the scan fitted saved state into (None: no disk tier).
    capacity_bytes: int | None = None


@attrs.frozen
class GaveBack:
    """``boundary`` under pressure: bytes released (or being spilled to be released); ``waited``: no
    entry could be given back, and the boundary waits for the spills in flight, whose RAM copies go
    once they land."""

    entries: int
    nbytes: int
    waited: bool = False


@attrs.frozen
class MaxTokensFit:
    """Whether a request can ever run: the max_tokens to run it with (a default lowered to what fits),
    or ``refusal``, which says why not and which number came from where."""

    max_tokens: int
    refusal: str | None = None


@attrs.frozen
class Pinned:
    """What a pin holds: the tokens of the prefix pinned (0: RAM held none of it), the bytes of the RAM
    entries serving it, and when the pin runs out on the service's clock (inf: at close)."""

    tokens: int
    nbytes: int
    until: float


@attrs.frozen
class HeldEntry:
    """One prefix RAM holds: its namespace, the tokens it covers, its bytes."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    nbytes: int


@attrs.frozen
class RamHeld:
    """``RamQuery``'s answer: RAM's entries and bytes (what its tier charges), and each entry where asked."""

    entries: int
    nbytes: int
    each: tuple[HeldEntry, ...] = ()


@attrs.frozen
class HeldBlocks:
    """``HeldBlocksQuery``'s answer: each full block a tier holds, RAM's then the disk's, parents first."""

    blocks: tuple


@attrs.frozen
class ObjectFound:
    """``objects.get``: the object is in ``handle``, from RAM or disk."""

    handle: int
    source: Source


@attrs.frozen
class ObjectMissing:
    """``objects.get``: nothing is kept under the key."""


@attrs.frozen
class Pending:
    """The call waits on effects in flight: a read into ``handle`` (an acquire, an object get), or
    writes settling (a publish under backpressure). Its answer comes with their completion."""

    handle: int | None = None
