"""The service's state: one immutable value the transitions replace, never mutate.

Entries are kept prefixes. Each has one residence, and moves between
residences only along :data:`LIFECYCLE`, a table the tests walk
exhaustively: RAM -> spilling -> RAM and disk -> disk only -> prefetching ->
RAM and disk, with the failure moves back. Leases are the live requests;
checkpoint records the generation checkpoints the service knows of.

Big maps are ``immutables.Map`` (a C HAMT): they are updated on every call,
where pyrsistent's pure-Python pmap costs 5-20x more, measured on this project's machines.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import attrs
import immutables
import xxhash

from kvstate.core.errors import InvalidConfig, InvalidNamespace, InvalidRequest
from kvstate.core.idle import IdleOrder
from kvstate.core.policies import EvictionPolicy, policy
from kvstate.core.policies.lru import LRU
from kvstate.core.prefix_index import PrefixIndex
from kvstate.core.request import Request
from kvstate.core.retention import Retention
from kvstate.core.tokens import WIDTH, PackedIds, packed
from kvstate.models.spec import ModelSpec

GiB = 1024 ** 3


class Residence(enum.Enum):
    """Where a kept prefix's state is."""

    #: In RAM only: lost on a crash.
    RAM = "ram"
    #: In RAM, with a write to disk in flight: pinned until it completes.
    SPILLING = "spilling"
    #: In RAM and durable on disk.
    BOTH = "both"
    #: Durable on disk only.
    DISK = "disk"
    #: On disk, being read into RAM ahead of a request: pinned until it completes.
    PREFETCHING = "prefetching"


class Move(enum.Enum):
    """What can happen to an entry."""

    SPILL = "spill"                  #: a write to disk starts
    WRITTEN = "written"              #: the write is durable
    WRITE_FAILED = "write-failed"    #: the write failed
    DROP_RAM = "drop-ram"            #: the RAM copy goes (evicted, demoted, closed)
    DROP_DISK = "drop-disk"          #: the disk copy goes (evicted from disk, or rejected as corrupt)
    PREFETCH = "prefetch"            #: a read into RAM starts
    READ = "read"                    #: the read into RAM is done
    READ_FAILED = "read-failed"      #: the read failed: the file is rejected
    READ_ERROR = "read-error"        #: the read hit an I/O error: the file stays, on disk only
    ADOPT = "adopt"                  #: a request published the same tokens again: RAM copy regained
    UNREAD = "unread"                #: a read ahead not taken up (one before it failed, or what it
                                     #: extends left RAM): on disk only, as before


R = Residence
#: ``(residence, move) -> residence``, None meaning the entry is gone. A pair not here is a bug.
LIFECYCLE: dict[tuple[Residence, Move], Residence | None] = {
    (R.RAM, Move.SPILL): R.SPILLING,
    (R.RAM, Move.DROP_RAM): None,
    (R.SPILLING, Move.WRITTEN): R.BOTH,
    (R.SPILLING, Move.WRITE_FAILED): R.RAM,
    (R.BOTH, Move.DROP_RAM): R.DISK,
    (R.BOTH, Move.DROP_DISK): R.RAM,
    (R.DISK, Move.DROP_DISK): None,
    (R.DISK, Move.PREFETCH): R.PREFETCHING,
    (R.DISK, Move.ADOPT): R.BOTH,
    (R.PREFETCHING, Move.READ): R.BOTH,
    (R.PREFETCHING, Move.READ_FAILED): None,
    (R.PREFETCHING, Move.READ_ERROR): R.DISK,
    (R.PREFETCHING, Move.UNREAD): R.DISK,
}

#: The rules of which chunk snapshots are kept (``ServiceConfig.snapshot_admission``).
SNAPSHOT_ADMISSIONS = ("reuse", "bytes")

IN_RAM = frozenset({R.RAM, R.SPILLING, R.BOTH})
ON_DISK = frozenset({R.BOTH, R.DISK, R.PREFETCHING})


class IllegalMove(AssertionError):
    """A transition tried a move the lifecycle table does not allow (a bug in the core)."""


def moved(residence: Residence, move: Move) -> Residence | None:
    """The residence after ``move``, or :class:`IllegalMove`."""
    try:
        return LIFECYCLE[(residence, move)]
    except KeyError:
        raise IllegalMove(f"entry in {residence.value} cannot {move.value}") from None


class Phase(enum.Enum):
    """The service's own lifecycle."""

    OPEN = "open"          #: serving
    CLOSING = "closing"    #: close() is flushing
    CLOSED = "closed"      #: cleared; only report and close answer


@attrs.frozen
class ServiceConfig:
    """What the service is built with: the model, its tiers and its policies.

    ``ram_capacity_bytes`` bounds kept prefixes in RAM; ``kv_budget_bytes``
    bounds the projected bytes of admitted requests (None: unlimited);
    ``batch_padding_step`` says admitted requests run in one batch padded to
    its longest row, grown that many tokens at a time (None: one cache each;
    see :mod:`~kvstate.core.admission`).
    ``disk_capacity_bytes`` enables the disk tier (None: none). ``retention``
    marks entries that are evicted only after every other (True: protected),
    for example system-prompt prefixes. ``demote_idle_after`` (seconds) moves
    entries idle that long to disk on a clock tick.

    What the disk tier writes, for its wear: with ``write_behind`` a kept entry
    is written as soon as it is kept, or, with ``write_idle_after`` (seconds),
    only once it has sat idle in RAM that long (on a clock tick), so state that
    is superseded, dropped or evicted sooner is never written.
    ``write_bytes_per_hour`` caps what spills write: a bucket of one hour's bytes,
    refilled at that rate by the clock; a spill it has no room for is not
    made (``spills_over_rate``). ``flush`` and ``close`` write regardless and are
    charged. Checkpoints are not capped.
    """

    model: ModelSpec
    ram_capacity_bytes: int
    kv_budget_bytes: int | None = None
    batch_padding_step: int | None = None
    disk_capacity_bytes: int | None = None
    policy: str = "lru"
    write_behind: bool = True
    write_queue_bytes: int = 2 * GiB
    demote_idle_after: float | None = None
    write_idle_after: float | None = None
    write_bytes_per_hour: int | None = None
    checkpoint_every_tokens: int | None = None
    #: A checkpoint whose generation is not running and that nothing has written or resumed for this
    #: many seconds is deleted at a clock tick (its client never came back); None: kept until its
    #: generation completes (or a scan finds the disk budget too small for it).
    checkpoint_keep_s: float | None = None
    identity: str = ""
    retention: Retention | None = None
    #: Whether kept RAM state is held, at every boundary, to what the KV budget leaves beside the
    #: running requests (their projection, or their measure where larger): one budget for both.
    ram_within_kv_budget: bool = False
    #: Tokens per block where published KV is kept in blocks (:mod:`~kvstate.core.blocks`): each block
    #: held once in RAM and written once to disk, shared by every prefix that contains it. None: each
    #: published prefix is kept whole. State that cannot be cut back is always kept whole.
    block_tokens: int | None = None
    #: Whether the tokens past a prefix's last full block are kept, as a partial block (a longer
    #: chain's full block supersedes it), or dropped, to be recomputed by the next request.
    partial_blocks: bool = True
    #: Which chunk snapshots (offered mid-prefill, for state that cannot be cut back) are kept:
    #: ``"reuse"``, one a held prefix goes past (a branch point is there or beyond) as any snapshot,
    #: any other (a guess) only where worth its bytes and in free RAM; ``"bytes"``, every one worth its
    #: bytes, offered to the policy (:func:`~kvstate.core.tiers.snapshot_worth_keeping`).
    snapshot_admission: str = "reuse"
    #: Whether a shared tier (an object store the servers of a fleet share) holds blocks beyond this
    #: server's disk, which caches what it fetches from there (:mod:`~kvstate.core.remote`). Needs
    #: blocks and a disk tier.
    remote_tier: bool = False
    #: Whether transitions tell observers which full blocks each tier holds as it changes (effects
    #: ``BlockStored`` and ``BlockRemoved``: :mod:`~kvstate.core.block_events`). Needs blocks.
    block_events: bool = False
    #: The share of ``ram_capacity_bytes`` pinned state may hold (:mod:`~kvstate.core.pins`), and the
    #: longest a request may pin its prefix for (warm prompts, pinned by the operator, have no end).
    pin_share: float = 0.5
    max_pin_seconds: float = 3600.0
    #: Whether a rule acts on entries gone idle (demotion, or idle writes), so the state keeps entries
    #: in order of last use (:mod:`~kvstate.core.idle`); worked out once, since every use asks.
    idle_rules: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        def size(name: str, value: Any, optional: bool) -> None:
            if value is None and optional:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidConfig(f"{name} must be a non-negative int of bytes, got {value!r}")
        size("ram_capacity_bytes", self.ram_capacity_bytes, False)
        size("kv_budget_bytes", self.kv_budget_bytes, True)
        size("disk_capacity_bytes", self.disk_capacity_bytes, True)
        size("write_queue_bytes", self.write_queue_bytes, False)
        try:
            policy(self.policy)
        except KeyError as error:
            raise InvalidConfig(str(error)) from None
        for name in ("demote_idle_after", "write_idle_after", "checkpoint_keep_s"):
            seconds = getattr(self, name)
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                        or not 0 < seconds < float("inf")):
                raise InvalidConfig(f"{name} must be positive seconds or None, got {seconds!r}")
        size("write_bytes_per_hour", self.write_bytes_per_hour, True)
        if self.write_bytes_per_hour == 0:
            raise InvalidConfig("write_bytes_per_hour must be at least 1 byte, or None for no cap; "
                                "to write nothing, build the service without a disk tier")
        if self.batch_padding_step is not None and (
                not isinstance(self.batch_padding_step, int) or isinstance(self.batch_padding_step, bool)
                or self.batch_padding_step < 1):
            raise InvalidConfig(f"batch_padding_step must be a positive int of tokens or None, "
                                f"got {self.batch_padding_step!r}")
        if self.checkpoint_every_tokens is not None and (
                not isinstance(self.checkpoint_every_tokens, int) or self.checkpoint_every_tokens < 1):
            raise InvalidConfig(f"checkpoint_every_tokens must be a positive int or None, "
                                f"got {self.checkpoint_every_tokens!r}")
        if self.block_tokens is not None and (not isinstance(self.block_tokens, int) or isinstance(
                self.block_tokens, bool) or self.block_tokens < 1):
            raise InvalidConfig(f"block_tokens must be a positive int of tokens or None, got {self.block_tokens!r}")
        if self.snapshot_admission not in SNAPSHOT_ADMISSIONS:
            raise InvalidConfig(f"snapshot_admission must be one of {', '.join(SNAPSHOT_ADMISSIONS)}, "
                                f"got {self.snapshot_admission!r}")
        if not isinstance(self.remote_tier, bool):
            raise InvalidConfig(f"remote_tier must be True or False, got {self.remote_tier!r}")
        if self.remote_tier and (self.block_tokens is None or not self.has_disk):
            raise InvalidConfig("remote_tier needs state kept in blocks (block_tokens) and a disk tier "
                                "(disk_capacity_bytes): the disk keeps what is fetched from the shared tier")
        if not isinstance(self.block_events, bool):
            raise InvalidConfig(f"block_events must be True or False, got {self.block_events!r}")
        if self.block_events and self.block_tokens is None:
            raise InvalidConfig("block_events needs state kept in blocks (block_tokens): whole prefixes are not "
                                "blocks a router can read")
        if isinstance(self.pin_share, bool) or not isinstance(self.pin_share, (int, float)) or not (
                0 <= self.pin_share <= 1):
            raise InvalidConfig(f"pin_share must be a share of the RAM capacity from 0 to 1, got {self.pin_share!r}")
        if isinstance(self.max_pin_seconds, bool) or not isinstance(self.max_pin_seconds, (int, float)) or not (
                0 <= self.max_pin_seconds < float("inf")):
            raise InvalidConfig(f"max_pin_seconds must be finite seconds, 0 or more, got {self.max_pin_seconds!r}")
        object.__setattr__(self, "idle_rules", self.has_disk and (
            self.demote_idle_after is not None or (self.write_behind and self.write_idle_after is not None)))

    @property
    def has_disk(self) -> bool:
        return self.disk_capacity_bytes is not None

    @property
    def checkpoints(self) -> bool:
        return self.has_disk and self.checkpoint_every_tokens is not None


@attrs.frozen(slots=False)
class Entry(PackedIds):
    """One kept prefix, or one block of one (:mod:`~kvstate.core.blocks`): what it covers from the
    namespace's start (its ids packed; ``tokens`` and ``length`` read them), its bytes, and where it is.

    A block holds only the state of its own tokens, from ``start``; the blocks before it are its
    ``parent``'s chain, so serving it means assembling that chain. A whole prefix has no parent and
    starts at 0.

    Its fields live in its instance dict, not in slots, so the commonest changes (a use, a count of
    the blocks extending it) copy one dict instead of calling the 20-field constructor: where idle
    rules run, a hit on a chain of n blocks restamps n entries."""

    id: int
    namespace: str
    #: Token ids from the namespace's start, packed (:mod:`kvstate.core.tokens`), of which it covers the
    #: first ``ends`` (all where None): the blocks one publish makes share its prompt's bytes, so a chain
    #: of n blocks holds its ids once, not n times over (``packed`` cuts its own when asked). Only
    #: packed: a kept tuple of ids is one more object for the cyclic collector to scan id by id.
    source: bytes = attrs.field(repr=lambda p: f"<{len(p) // WIDTH} tokens>")
    nbytes: int
    trimmable: bool
    residence: Residence
    #: When it was kept, and after that its last use where a rule reads it (``config.idle_rules``):
    #: elsewhere no decision does, and a hit on a chain would rewrite every block's entry for nothing.
    last_used: float
    session: str | None
    protected: bool
    tag: int
    #: The bytes its saved file takes on disk (header included), as the interpreter measured it: what
    #: the disk tier charges while a write is in flight or a copy is on disk. ``nbytes`` is what RAM
    #: charges.
    file_bytes: int
    #: Drop the RAM copy once the write in flight is durable (idle demotion, pressure). Every spill
    #: sets it; it is read only while the entry is spilling.
    demote: bool = False
    #: Reads of its file that hit an I/O error in a row (an I/O error is not evidence of a bad file).
    read_errors: int = 0
    #: A block's parent entry (None: the namespace's first block, or a whole prefix), the position its
    #: own state starts at, and its chain key (None: a whole prefix).
    parent: int | None = None
    start: int = 0
    block: bytes | None = None
    #: How many held blocks extend it: in all, in the RAM index, in the disk index. A tier lets a block
    #: go only once none it holds extends it, and a block goes altogether only once none does (leaf first).
    children: int = 0
    ram_children: int = 0
    disk_children: int = 0
    #: How many of ``source``'s tokens it covers (None: all of them).
    ends: int | None = None

    @property
    def packed(self) -> bytes:
        """Its token ids, packed: what the prefix index and comparisons read."""
        return self.source if self.ends is None else self.source[:self.ends * WIDTH]

    @property
    def length(self) -> int:
        """How many tokens it covers."""
        return len(self.source) // WIDTH if self.ends is None else self.ends

    @property
    def is_block(self) -> bool:
        return self.block is not None

    @property
    def is_snapshot(self) -> bool:
        """A snapshot: the state of the layers that cannot be cut (recurrent, sliding windows) at the
        end of its ``parent``'s chain of blocks, which hold the other layers' state. Serves its exact
        length, with that chain."""
        return self.block is None and self.parent is not None

    @property
    def chained(self) -> bool:
        """Whether serving it means assembling a chain of blocks (a block, or a snapshot)."""
        return self.parent is not None or self.block is not None

    @property
    def indexed(self) -> bool:
        """Whether the prefix index holds it: everything but a block that cannot serve alone (one of a
        model whose other layers cannot be cut: only a snapshot at its end serves it)."""
        return self.trimmable or self.block is None

    def counted(self, children: int, ram_children: int, disk_children: int) -> "Entry":
        """With these counts of the held blocks that extend it."""
        return self._with({"children": children, "ram_children": ram_children, "disk_children": disk_children})

    def used(self, now: float, read_errors: int) -> "Entry":
        """Used at ``now`` (a hit), with ``read_errors`` failed reads in a row."""
        return self._with({"last_used": now, "read_errors": read_errors})

    def next_block(self, entry_id: int, nbytes: int, file_bytes: int, tag: int, start: int, ends: int | None,
                   block: bytes, extended: int) -> "Entry":
        """The block made after this one by the same publish (the rest of its fields shared): entry
        ``entry_id``, on this one, holding ``block``'s state from ``start``, extended in RAM by
        ``extended`` (0 or 1) blocks of that publish."""
        return self._with({"id": entry_id, "nbytes": nbytes, "file_bytes": file_bytes, "tag": tag, "parent": self.id,
                           "start": start, "ends": ends, "block": block, "children": extended,
                           "ram_children": extended})

    def _with(self, changes: dict) -> "Entry":
        """This entry with ``changes`` to its fields: its dict copied, nothing else checked (the
        fields changed here are the ones no check is about)."""
        fields = self.__dict__.copy()
        fields.update(changes)
        entry = object.__new__(Entry)
        object.__setattr__(entry, "__dict__", fields)
        return entry


@attrs.frozen
class Lease:
    """A live request: its projected bytes, and where its ``acquire`` stands."""

    request: Request
    admitted_bytes: int = 0
    admitted: bool = False
    acquired: bool = False
    namespace: str | None = None
    #: The caches handle an acquire waits on (a restore or resume in flight).
    pending_handle: int | None = None
    #: The generation checkpoint key (namespace + identity + continuation key).
    checkpoint_key: str | None = None
    #: The prompt tokens its caches start from: what it would reuse when admitted, what it reused
    #: once acquired (a padded batch aligns its rows on the longest reuse).
    reused: int = 0

    # The changes a lease goes through, each built directly (``attrs.evolve`` walks every field).

    def admitted_with(self, nbytes: int) -> "Lease":
        """Admitted, holding ``nbytes`` of the KV budget."""
        return Lease(self.request, nbytes, True, self.acquired, self.namespace, self.pending_handle,
                     self.checkpoint_key, self.reused)

    def expecting(self, reused: int) -> "Lease":
        """Expected to start from ``reused`` tokens of its prompt."""
        return Lease(self.request, self.admitted_bytes, self.admitted, self.acquired, self.namespace,
                     self.pending_handle, self.checkpoint_key, reused)

    def acquiring_in(self, namespace: str, checkpoint_key: str | None) -> "Lease":
        """Its acquire looks in ``namespace`` (and resumes from ``checkpoint_key``, if any)."""
        return Lease(self.request, self.admitted_bytes, self.admitted, self.acquired, namespace,
                     self.pending_handle, checkpoint_key, self.reused)

    def waiting_on(self, handle: int) -> "Lease":
        """Its acquire waits for the read into ``handle``."""
        return Lease(self.request, self.admitted_bytes, self.admitted, self.acquired, self.namespace, handle,
                     self.checkpoint_key, self.reused)

    def holding(self, reused: int) -> "Lease":
        """Its acquire is answered: it holds its state, ``reused`` tokens of it kept state."""
        return Lease(self.request, self.admitted_bytes, self.admitted, True, self.namespace, None,
                     self.checkpoint_key, reused)


@attrs.frozen
class CheckpointRecord:
    """What the service knows of one generation's checkpoints."""

    namespace: str
    durable_tokens: int = 0
    pending: int = 0
    pending_bytes: int = 0
    #: The bytes the durable checkpoint file takes, and those reserved on disk by the writes in flight.
    file_bytes: int = 0
    pending_file_bytes: int = 0
    #: The caller's note of the latest checkpoint offered (or found at the scan) under the key.
    note: str = ""
    #: The service's clock at the first tick after a checkpoint was last offered, resumed or found under
    #: the key (None: not ticked since; the clock's origin is the interpreter's, so a touch is dated by
    #: the tick that follows it).
    touched_at: float | None = None


class Counters(NamedTuple):
    """Monotonic counts the report shows. (A named tuple: a transition that counts copies all of
    them, and :meth:`plus` does that as one list copy.)"""

    hits: int = 0
    misses: int = 0
    session_hits: int = 0
    session_misses: int = 0
    kept: int = 0
    duplicates: int = 0
    not_kept: int = 0
    evictions: int = 0
    superseded: int = 0
    demotions: int = 0
    spills: int = 0
    restores: int = 0
    prefetches: int = 0
    disk_evictions: int = 0
    rejected_files: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    checkpoints_written: int = 0
    resumes: int = 0
    checkpoints_expired: int = 0
    prefill_tokens_saved: int = 0
    object_hits: int = 0
    object_misses: int = 0
    object_restores: int = 0
    #: Bytes of the files written (spills and checkpoints) and read back (restores and prefetches).
    bytes_written: int = 0
    bytes_read: int = 0
    #: Reads of saved files that hit an I/O error (the file kept unless it keeps failing).
    read_errors: int = 0
    #: Disk hits passed up for a prefill, and spills not made, because reading back is slower than
    #: prefilling the same tokens on this hardware (:mod:`~kvstate.core.pace`).
    restores_passed_up: int = 0
    spills_passed_up: int = 0
    spills_over_rate: int = 0
    #: Chunk snapshots not kept: they would hold more bytes than the attention state of the tokens they
    #: save over the snapshot before them (:func:`~kvstate.core.tiers.snapshot_worth_keeping`).
    snapshots_passed_up: int = 0
    #: Prefixes pinned (:mod:`~kvstate.core.pins`), and pins asked of a prefix RAM did not hold.
    pins: int = 0
    pins_missed: int = 0
    #: The shared tier (:mod:`~kvstate.core.remote`): fetches started, blocks read from it (verified and
    #: kept on disk) and their bytes, objects rejected, calls that failed, lookups whose read would not
    #: beat a prefill, blocks this server wrote there, and offers another server had written first.
    remote_fetches: int = 0
    remote_blocks_read: int = 0
    remote_bytes_read: int = 0
    remote_rejected: int = 0
    remote_failures: int = 0
    remote_passed_up: int = 0
    remote_writes: int = 0
    remote_already_held: int = 0

    def plus(self, counts: dict[str, int]) -> "Counters":
        """These counters with ``counts`` (name -> increment) added."""
        values = list(self)
        for name, by in counts.items():
            values[_COUNTER_AT[name]] += by
        return Counters._make(values)


_COUNTER_AT = {name: at for at, name in enumerate(Counters._fields)}


EMPTY: immutables.Map = immutables.Map()


@attrs.frozen
class Tier:
    """One tier of kept state (RAM or disk): the index of what it holds, the bytes it charges against
    its capacity, and its eviction policy with that policy's state."""

    index: PrefixIndex
    bytes: int
    capacity: int
    strategy: EvictionPolicy
    policy: Any

    @classmethod
    def empty(cls, capacity: int, strategy: EvictionPolicy) -> "Tier":
        return cls(PrefixIndex(), 0, capacity, strategy, strategy.empty(capacity))


@attrs.frozen
class Writes:
    """Writes to disk in flight (spills and checkpoints) and the RAM bytes they hold in the queue; and
    the write-rate bucket: bytes spent of it, net of its refill up to the clock reading ``rate_at``."""

    count: int = 0
    bytes: int = 0
    rate_spent: float = 0.0
    rate_at: float = 0.0


@attrs.frozen
class Pace:
    """What reads of saved state and prefills took, as decayed sums of seconds and of what they moved
    (bytes read, tokens prefilled); :mod:`~kvstate.core.pace` learns and uses them."""

    read_seconds: float = 0.0
    read_bytes: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens: float = 0.0
    remote_seconds: float = 0.0
    remote_bytes: float = 0.0

    @property
    def remote_s_per_byte(self) -> float | None:
        """Seconds to fetch one byte from the shared tier and keep it on disk (None: none measured yet)."""
        return self.remote_seconds / self.remote_bytes if self.remote_bytes else None

    @property
    def read_s_per_byte(self) -> float | None:
        """Seconds to read back one byte (None: no read measured yet)."""
        return self.read_seconds / self.read_bytes if self.read_bytes else None

    @property
    def prefill_s_per_token(self) -> float | None:
        """Seconds to prefill one token (None: no prefill measured yet)."""
        return self.prefill_seconds / self.prefill_tokens if self.prefill_tokens else None


@attrs.frozen
class Waiting:
    """An acquire (``lease``), a lookup (``lookup``: its namespace and prompt, no lease) or an object
    get (neither) parked on a read of ``tokens`` tokens (None for a checkpoint resume: its reply counts
    the prompt it resumes)."""

    lease: int | None
    tokens: int | None
    lookup: tuple[str, tuple[int, ...]] | None = None


@attrs.frozen(slots=False)
class ServiceState:
    """Everything the service decides from, as one value.

    Its fields live in an instance dict, not slots, so that a transition copies them all in one
    dict copy, and builds the next state from one (:class:`~kvstate.core.draft.Draft`).
    """

    config: ServiceConfig
    ram: Tier                               # RAM entries plus reads into RAM in flight
    disk: Tier                              # saved files (prefixes, checkpoints) plus writes in flight
    entries: immutables.Map = EMPTY         # entry id -> Entry
    leases: immutables.Map = EMPTY          # lease id -> Lease
    projected_bytes: int = 0
    #: What the running caches were last measured holding (BatchMeasured), less what released since.
    measured_bytes: int = 0
    writes: Writes = Writes()
    reading: immutables.Map = EMPTY         # entry id -> restores in flight (pins its file)
    acquiring: immutables.Map = EMPTY       # handle -> Waiting, for acquires waiting on a read
    checkpoints: immutables.Map = EMPTY     # checkpoint key -> CheckpointRecord
    sessions: immutables.Map = EMPTY        # session id -> (namespace, packed ids) it last kept
    blocks: immutables.Map = EMPTY          # (namespace, chain key) -> block entry id
    pinned_until: immutables.Map = EMPTY    # entry id -> when its pin runs out (inf: never), :mod:`pins`
    idle: IdleOrder = IdleOrder()           # entries in order of last use, where idle_rules
    counters: Counters = Counters()
    next_entry: int = 1
    now: float = 0.0
    pace: Pace = Pace()
    phase: Phase = Phase.OPEN
    #: (namespace, chain key) of the blocks being fetched from the shared tier (:mod:`~kvstate.core.remote`).
    remote_reading: frozenset = frozenset()
    #: (namespace, chain key) of each block this server learnt the shared tier holds (it wrote it, found
    #: it there, or fetched it): what a clean stop need not offer again; with block events, -> its
    #: name (what they tell of that tier), else None.
    remote_held: immutables.Map = EMPTY
    #: close()'s verdict once closed; or a publish parked until the writes in flight settle.
    close_result: Any = None
    deferred: Any = None


def initial_state(config: ServiceConfig) -> ServiceState:
    """The state of a service that holds nothing yet."""
    return ServiceState(config=config, ram=Tier.empty(config.ram_capacity_bytes, policy(config.policy)),
                        disk=Tier.empty(config.disk_capacity_bytes or 0, LRU()))


def check_namespace(namespace: object) -> str:
    """A namespace is a non-empty string without path separators or NUL (it names directories)."""
    if not isinstance(namespace, str) or not namespace:
        raise InvalidNamespace(f"namespace must be a non-empty string, got {namespace!r}")
    if "/" in namespace or "\\" in namespace or "\x00" in namespace or namespace in (".", ".."):
        raise InvalidNamespace(f"namespace {namespace!r} holds a path separator, NUL or is a dot name; "
                               f"use letters, digits, '-', '_', ':' or '.' inside a name")
    return namespace


#: The namespace tensor objects live in. It holds a NUL, which no caller's namespace may, so objects
#: and prefixes never meet; an object's "tokens" are the UTF-8 bytes of its key.
OBJECTS = "\x00objects"


def object_tokens(key: str) -> tuple[int, ...]:
    """The exact-match key of a tensor object, as the token tuple the indexes hold."""
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"an object key must be a non-empty string, got {key!r}")
    return tuple(key.encode())


def content_tag(namespace: str, tokens: tuple[int, ...] | bytes | memoryview) -> int:
    """A content identity for ghost lists: xxh3-64 of the packed ids, seeded by the namespace, so it is
    the same in every process (Python's own str and bytes hashes are not). Packed ids may come as a
    view of a longer prompt's bytes (nothing copied)."""
    data = tokens if type(tokens) is memoryview else packed(tokens)
    return xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(namespace.encode()))


def request_check(request: object) -> Request:
    if not isinstance(request, Request):
        raise InvalidRequest(f"expected a kvstate.Request, got {type(request).__name__}")
    return request
