"""The inputs of ``step``: one event per call of the scheduler port, the clock, and the scan.

Completion events of effects, the scan's among them, are in :mod:`kvstate.effects.completions`.
Leases and handles are ints the facade assigns: a lease names a live request,
a handle names caches in transit to or from the interpreter.
"""

from __future__ import annotations

import attrs

from kvstate.core.request import Request


class Event:
    """Base of every port event."""

    __slots__ = ()


@attrs.frozen
class Admit(Event):
    """Admit ``request`` under the KV budget as ``lease``; with its ``namespace``, charged as starting
    from what that namespace holds for its prompt now (in a padded batch, reuse moves the charge)."""

    lease: int
    request: Request
    namespace: str | None = None


@attrs.frozen
class BatchMeasured(Event):
    """The running requests' caches hold ``nbytes`` now (a batch's real bytes, padding included)."""

    nbytes: int


@attrs.frozen
class PrefillMeasured(Event):
    """The serving loop prefilled ``tokens`` prompt tokens in ``seconds`` (its pace: :mod:`~kvstate.core.pace`)."""

    tokens: int
    seconds: float


@attrs.frozen
class Fits(Event):
    """Would ``request`` be admitted now?"""

    request: Request


@attrs.frozen
class Acquire(Event):
    """Give ``lease`` its state in ``namespace``, into caches ``handle``. A lease not yet admitted
    is admitted first; with ``or_wait``, a budget with no room for it now replies
    :attr:`~kvstate.core.replies.Admission.WAIT` and changes nothing (else it is an error)."""

    lease: int
    request: Request
    namespace: str
    handle: int
    or_wait: bool = False


@attrs.frozen
class Keeps(Event):
    """Would state ``request`` publishes be kept?"""

    request: Request


@attrs.frozen
class Publish(Event):
    """Offer caches ``handle`` covering ``tokens`` for reuse; the interpreter measured them."""

    request: Request
    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    handle: int
    covered: int
    nbytes: int
    trimmable: bool
    #: The bytes the file saving this state would take (0 without a disk tier).
    file_bytes: int
    #: Where the config keeps state in blocks and these caches can be cut: each block's ``(nbytes,
    #: file_bytes)``, in the order of :func:`~kvstate.core.blocks.spans` (empty: kept whole).
    blocks: tuple[tuple[int, int], ...] = ()
    #: Where some layers cannot be cut: the ``(nbytes, file_bytes)`` of their state at the end, kept as
    #: a snapshot on the chain of the other layers' blocks (None: every layer is cut, or kept whole).
    snapshot: tuple[int, int] | None = None
    #: A snapshot offered mid-prefill (not at the end of a prompt or a segment): kept as any state at the
    #: last chunk before a branch point, else only where worth its bytes and in free RAM
    #: (:func:`~kvstate.core.tiers.at_a_branch_point`).
    chunk: bool = False
    #: For a chunk: the prompt's tokens after it, up to where the caller takes its next snapshot (or the
    #: prompt's end). A held prefix that goes past them makes a later chunk the last before the branch
    #: point, so this one is a guess. Empty: not known (any chunk a held prefix goes past is kept).
    next_chunk: tuple[int, ...] | bytes = attrs.field(default=(), repr=lambda t: f"<{len(t)} tokens>")


@attrs.frozen
class Checkpoint(Event):
    """Save caches ``handle`` (covering ``tokens``: prompt plus generated) as a resumable point."""

    lease: int
    handle: int
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    covered: int
    generated_tokens: int
    pending_token: int | None
    nbytes: int
    #: The bytes the checkpoint file would take.
    file_bytes: int
    #: The caller's note, recorded in the file's meta and kept in the service's record of the key.
    note: str = ""


@attrs.frozen
class Release(Event):
    """``lease`` is done; ``completed`` says whether its generation finished."""

    lease: int
    completed: bool


@attrs.frozen
class Boundary(Event):
    """An execution boundary. RAM entries are given back while ``pressure`` (the caller's own verdict:
    live memory is over what optional state may use), while kept state holds more than ``max_bytes``
    or ``max_entries`` RAM entries (None: no such limit), or, with ``ram_within_kv_budget`` in the
    config, more than the KV budget leaves beside the running requests."""

    pressure: bool = False
    max_bytes: int | None = None
    max_entries: int | None = None


@attrs.frozen
class Tick(Event):
    """The clock reads ``now`` (seconds, any fixed origin)."""

    now: float


@attrs.frozen
class Pin(Event):
    """Hold the RAM state serving the longest held prefix of ``tokens`` in ``namespace`` out of every
    rule's reach for ``seconds`` (None: until close); :mod:`~kvstate.core.pins`."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    seconds: float | None


@attrs.frozen
class PinFits(Event):
    """Would a pin of ``nbytes`` of state for ``seconds`` be refused now? The reply is why (None: no)."""

    nbytes: int
    seconds: float | None


@attrs.frozen
class Prefetch(Event):
    """Start reading the saved prefix of ``prompt`` in ``namespace`` into RAM."""

    prompt: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    namespace: str


@attrs.frozen
class PeekPrefixLen(Event):
    """How many tokens of ``prompt`` RAM could serve now; changes nothing."""

    prompt: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    namespace: str


@attrs.frozen
class RemoteLookup(Event):
    """A request for ``prompt`` in ``namespace`` arrived: fetch the blocks of it this server lacks from
    the shared tier, where that pays (:mod:`~kvstate.core.remote`); the reply says whether a fetch of
    them is in flight (``ReadingAhead`` says when it has landed)."""

    prompt: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    namespace: str


@attrs.frozen
class ReadingAhead(Event):
    """Whether blocks that would serve ``prompt`` are being read ahead into RAM now; changes nothing."""

    prompt: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    namespace: str


@attrs.frozen
class CloseSession(Event):
    """Forget ``session_id``'s affinity; its state stays reusable."""

    session_id: str


@attrs.frozen
class ObjectGet(Event):
    """Hand out the tensor object kept under ``key`` into ``handle``, if any."""

    key: str
    handle: int


@attrs.frozen
class ObjectPut(Event):
    """Offer the tensor object staged under ``handle`` (``nbytes``) for keeping under ``key``."""

    key: str
    handle: int
    nbytes: int
    #: The bytes the file saving this object would take (0 without a disk tier).
    file_bytes: int


@attrs.frozen
class Lookup(Event):
    """The longest reusable prefix of ``prompt`` in ``namespace`` (RAM, else disk where it is longer and
    pays), into caches ``handle``, for a caller that holds no lease: a server's lookup of the state a
    request it runs on its own starts from. Counted as a hit or a miss; nothing to release."""

    prompt: tuple[int, ...]
    namespace: str
    handle: int


@attrs.frozen
class PlanCheckpoint(Event):
    """What a checkpoint of acquired ``lease`` after ``generated_tokens`` (``pending_token`` sampled, not
    yet fed) would record: its meta, for the interpreter to measure the file before it is offered."""

    lease: int
    generated_tokens: int
    pending_token: int | None = None
    note: str = ""


@attrs.frozen
class CheckpointNote(Event):
    """The note of the checkpoint kept under continuation ``key`` in ``namespace`` (None: none is kept);
    changes nothing. A server asks before it serves a retry, to refuse one whose request differs."""

    namespace: str
    key: str


@attrs.frozen
class FitMaxTokens(Event):
    """Can a request of ``prompt_tokens`` ever run, and with what max_tokens? ``requested``: the
    ``max_tokens`` is the client's own (it stands or is refused), else a default (lowered to what fits)."""

    prompt_tokens: int
    max_tokens: int
    requested: bool


@attrs.frozen
class SharedWait(Event):
    """Would waiting for the rows ``computing`` (requests in prefill, in ``namespace``) let ``prompt``
    reuse at least ``min_gain`` more tokens than RAM serves it now? (:mod:`~kvstate.core.sharing`)"""

    prompt: tuple[int, ...]
    namespace: str
    computing: tuple = ()
    min_gain: int = 1


@attrs.frozen
class RamQuery(Event):
    """What RAM holds now: its entries and bytes, and with ``each``, every entry's namespace, tokens
    and bytes (a pass over every entry)."""

    each: bool = False


@attrs.frozen
class HeldBlocksQuery(Event):
    """Which full blocks each tier holds now, as the ``BlockStored`` effects that would have told it
    (for an observer of block events that starts watching: a pass over every entry)."""


@attrs.frozen
class ReportQuery(Event):
    """The counters, with what the interpreter holds aside that the core does not track: rejected
    files it keeps for inspection (outside every budget) and their bytes."""

    rejected_held_files: int = 0
    rejected_held_bytes: int = 0


@attrs.frozen
class Flush(Event):
    """Make kept state durable and say whether it is."""


@attrs.frozen
class Close(Event):
    """Flush, then clear RAM state; idempotent."""
