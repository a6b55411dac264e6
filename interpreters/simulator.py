"""The simulator: carries out every effect in memory, on a virtual clock, with faults on demand.

Content is the token list a state covers (:class:`SimCaches`), bytes come from
the model's projection, disk is a dictionary of :class:`SimFile` that outlives
a service (pass the same :class:`SimDisk` to the next one to restart after a
crash). A cost model turns prefill tokens and bytes read and written into
estimated seconds. Faults: fail the k-th write, crash before the k-th effect,
corrupt or swap a saved file; writes and reads ahead may complete later (``deferred_writes``,
``deferred_reads``), so pinning and durability are exercised as with a real background writer.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

import attrs

from kvstate.core.blocks import saved_chains
from kvstate.core.errors import InvalidRequest, KvStateError
from kvstate.core.state import ServiceConfig
from kvstate.core.tokens import WIDTH, PackedIds, packed
from kvstate.effects.completions import SavedBlock, SavedCheckpoint, SavedRecord, Scanned
from kvstate.interpreters.base import BlockSizes, CacheFacts, HeldState, InterpreterError, fetch_in_order
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from kvstate.models.catalogue import model_spec
from kvstate.models.spec import LayerKind, ModelSpec

Reason = done.FailureReason
#: Layer kinds whose state at a position is a span of arrays, so caches of them can be cut into blocks.
CUTTABLE = frozenset({LayerKind.FULL_ATTENTION, LayerKind.LATENT_ATTENTION})


class SimulatedCrash(KvStateError):
    """The fault plan crashed the service here; what the simulated disk holds survives."""


class SimCaches(PackedIds):
    """Simulated caches: the tokens they cover are their content; bytes follow from the model.

    The content is held packed (:mod:`kvstate.core.tokens`), as the service's entries hold their
    ids: a simulator holding thousands of caches keeps no tuples of ids for the cyclic collector
    to scan. ``tokens`` unpacks them.
    """

    __slots__ = ("packed", "model")

    def __init__(self, tokens: Iterable[int] | bytes, model: ModelSpec):
        self.packed = tokens if type(tokens) is bytes else packed(tokens if isinstance(tokens, tuple) else tuple(tokens))
        self.model = model

    def __repr__(self) -> str:
        return f"SimCaches(<{self.length} tokens>)"

    @property
    def nbytes(self) -> int:
        return self.model.bytes_for(self.length)

    @property
    def trimmable(self) -> bool:
        return self.model.trimmable_at(self.length)

    def extended(self, tokens: Iterable[int]) -> "SimCaches":
        """These caches after the model ran over ``tokens`` (prefill or decode)."""
        return SimCaches(self.packed + packed(tuple(tokens)), self.model)

    def trimmed(self, length: int) -> "SimCaches":
        if length != self.length and not self.trimmable:
            raise InterpreterError(f"non-trimmable caches of {self.length} tokens cannot serve {length}")
        return SimCaches(self.packed[:length * WIDTH], self.model)


@attrs.frozen(eq=False)
class SimObject:
    """A simulated tensor object: any payload, with the bytes it stands for."""

    payload: object
    nbytes: int

    def trimmed(self, length: int) -> "SimObject":
        return self


@attrs.frozen
class FileModel:
    """The bytes a simulated saved file takes: its state's bytes plus a header of ``header_bytes`` and
    ``header_bytes_per_token`` for each token it covers (a real header lists them)."""

    header_bytes: int = 0
    header_bytes_per_token: int = 0

    def file_bytes(self, nbytes: int, tokens: int) -> int:
        return nbytes + self.header_bytes + self.header_bytes_per_token * tokens


@attrs.frozen
class CostModel:
    """Estimated seconds: prefill throughput and disk bandwidths."""

    prefill_tokens_per_second: float = 4000.0
    restore_bytes_per_second: float = 3e9
    write_bytes_per_second: float = 1.5e9
    remote_bytes_per_second: float = 1e9


@attrs.define
class SimFile:
    """One saved state on the simulated disk."""

    identity: str
    namespace: str
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    nbytes: int
    trimmable: bool
    content: tuple[int, ...] = attrs.field(repr=False)
    corrupt: bool = False
    payload: SimObject | None = attrs.field(default=None, repr=False)
    file_bytes: int = 0
    #: When the file was last written or read back, in the disk's order of uses (a real file's own time).
    used_at: float = 0.0


@attrs.frozen
class SimCheckpoint:
    """One generation checkpoint on the simulated disk."""

    meta: fx.CheckpointMeta
    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    identity: str
    file_bytes: int
    #: When it was written, in the disk's order of uses.
    used_at: float = 0.0


@attrs.define
class SimDisk:
    """The simulated disk: saved prefixes, checkpoints, and files moved aside as rejected."""

    files: dict[fx.DiskKey, SimFile] = attrs.Factory(dict)
    checkpoints: dict[str, SimCheckpoint] = attrs.Factory(dict)
    rejected: list[tuple[fx.DiskKey | str, Reason]] = attrs.Factory(list)
    #: The bytes of the files moved aside (the simulated disk keeps every one).
    rejected_bytes: int = 0
    #: Writes and reads so far: the disk's own clock, which outlives every service on it, as file times do.
    uses: int = 0

    def stamp(self) -> int:
        """The time of a write or read now: later than every earlier one on this disk."""
        self.uses += 1
        return self.uses

    def used_bytes(self) -> int:
        """The bytes every file on it takes (prefixes, objects and checkpoints), rejected ones aside."""
        return (sum(f.file_bytes for f in self.files.values())
                + sum(c.file_bytes for c in self.checkpoints.values()))

    def corrupt(self, key: fx.DiskKey) -> None:
        """Flip bits in a saved file: its next read fails its content hash."""
        self.files[key].corrupt = True


@attrs.define
class SimRemote:
    """The simulated shared tier: an object store the simulators of a fleet share, its objects saved
    blocks by model identity and name (a copy of the file a server wrote first). ``down`` makes every
    call fail, as a store that went away."""

    objects: dict[tuple[str, fx.BlockName], SimFile] = attrs.Factory(dict)
    down: bool = False
    #: Calls made (fetches of an object, and offers), failed or not.
    calls: int = 0

    def children(self, identity: str, namespace: str, parent: bytes) -> list[tuple[int, bytes]]:
        """``(tokens, key)`` of every object after block ``parent``, longest first (as a listing finds)."""
        return sorted(((len(name.tokens), name.key) for who, name in self.objects
                       if who == identity and name.namespace == namespace and name.parent == parent), reverse=True)

    def corrupt(self, identity: str, name: fx.BlockName) -> None:
        """Flip bits in a stored object: a server that fetches it finds it fails its content hash."""
        self.objects[identity, name].corrupt = True


@attrs.define
class FaultPlan:
    """Faults to inject: write numbers (1-based, spills and checkpoints) that fail, read numbers that hit
    an I/O error, and a crash point."""

    fail_writes: set[int] = attrs.Factory(set)
    fail_reason: Reason = Reason.NO_SPACE
    #: Read numbers (1-based, restores and prefetches) that hit an I/O error; the file is left as it is.
    fail_reads: set[int] = attrs.Factory(set)
    crash_before_effect: int | None = None


@attrs.define
class SimStats:
    """What the simulator carried out and the seconds the cost model estimates for it."""

    effects: int = 0
    writes: int = 0
    reads: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    restore_seconds: float = 0.0
    write_seconds: float = 0.0


class SimulatorInterpreter(HeldState):
    """Carries out effects in memory; the service facade drives it."""

    name = "the simulator"

    def __init__(self, model: ModelSpec, *, identity: str = "sim", cost: CostModel | None = None,
                 disk: SimDisk | None = None, faults: FaultPlan | None = None, deferred_writes: bool = False,
                 deferred_reads: bool = False, files: FileModel | None = None, remote: SimRemote | None = None):
        self.model = model
        self.files = files or FileModel()
        self.identity = identity
        self.cost = cost or CostModel()
        self.disk = disk if disk is not None else SimDisk()
        self.remote = remote
        self.faults = faults or FaultPlan()
        self.deferred_writes = deferred_writes
        #: Reads ahead of a chain's blocks (``PrefetchBlocks``) and fetches from the shared tier complete
        #: at ``poll``, as a background reader's would, not when performed.
        self.deferred_reads = deferred_reads
        self._reads: deque[fx.PrefetchBlocks | fx.FetchRemote] = deque()
        self.stats = SimStats()
        self.now = 0.0
        super().__init__()
        self._pending: deque[tuple[fx.Effect, SimCaches]] = deque()
        #: The bytes a position takes in the layers blocks hold, and whether those are all the layers.
        self._cut_per_token: int | None = None
        self._all_cut = False

    # ------------------------------------------------------------ the facade's side

    def fresh(self) -> SimCaches:
        """Empty caches of the model."""
        return SimCaches((), self.model)

    def stage(self, handle: int, caches: object) -> CacheFacts:
        """Hold caches a caller hands in under ``handle`` and measure them."""
        if not isinstance(caches, SimCaches) or caches.model != self.model:
            raise InvalidRequest(f"the simulator takes SimCaches of {self.model.name}, got {type(caches).__name__}")
        self._handles[handle] = caches
        return CacheFacts(caches.length, caches.nbytes, caches.trimmable)

    def file_bytes(self, handle: int, key: fx.DiskKey, facts: CacheFacts) -> int:
        """The bytes the file of the state staged under ``handle`` would take."""
        return self.files.file_bytes(facts.nbytes, len(key.tokens))

    def checkpoint_file_bytes(self, handle: int, meta: fx.CheckpointMeta, tokens: tuple[int, ...]) -> int:
        return self.files.file_bytes(self._handles[handle].nbytes, len(tokens))

    def block_bytes(self, handle: int, namespace: str, tokens: tuple[int, ...],
                    spans: tuple[tuple[int, int], ...]) -> BlockSizes | None:
        """Each block's ``(nbytes, file_bytes)`` for the layers whose state is a span of positions
        (attention), and, where other layers are there, a snapshot's of their state at the end; None
        where no layer can be cut (kept whole)."""
        if self._cut_per_token is None:
            cut = [layer for layer in self.model.layers if layer.kind in CUTTABLE]
            # Attention layers hold the same bytes for every position: a block's are its length's.
            self._cut_per_token = sum(layer.bytes_for(self.model.position_tokens, self.model.kv) for layer in cut)
            self._all_cut = len(cut) == len(self.model.layers)
        per_token = self._cut_per_token
        if not per_token:
            return None
        blocks = tuple((per_token * (stop - start), self.files.file_bytes(per_token * (stop - start), stop - start))
                       for start, stop in spans)
        if self._all_cut:
            return BlockSizes(blocks)
        rest = self.model.bytes_for(len(tokens)) - per_token * len(tokens)
        return BlockSizes(tuple(blocks), (rest, self.files.file_bytes(rest, len(tokens))))

    def stage_object(self, handle: int, value: object) -> int:
        """Hold a tensor object under ``handle``; its bytes."""
        if not isinstance(value, SimObject) or not isinstance(value.nbytes, int) or value.nbytes < 0:
            raise InvalidRequest(f"the simulator keeps SimObject values, got {type(value).__name__}")
        self._handles[handle] = value
        return value.nbytes

    def take_object(self, handle: int) -> SimObject:
        return self._handles.pop(handle)

    def rejected_held(self) -> tuple[int, int]:
        return len(self.disk.rejected), self.disk.rejected_bytes

    def saved_prefixes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(namespace, tokens)`` of every saved prefix of this identity."""
        prefixes = [(f.namespace, f.tokens) for key, f in self.disk.files.items()
                    if f.identity == self.identity and f.payload is None and isinstance(key, fx.DiskKey)]
        files = self.disk.files
        chains = saved_chains(key for key, f in files.items() if isinstance(key, fx.BlockName) and f.trimmable)
        snapshots = [(key.namespace, key.tokens) for key in files if isinstance(key, fx.SnapshotName)]
        return prefixes + chains + snapshots

    def scan(self) -> Scanned:
        """What the disk holds for this identity; foreign and corrupt files are moved aside."""
        records, blocks, rejected = [], [], 0
        for key, file in list(self.disk.files.items()):
            if file.identity != self.identity or file.corrupt:
                self._move_aside(key, Reason.IDENTITY_MISMATCH if file.identity != self.identity else Reason.CORRUPT)
                rejected += 1
                continue
            if isinstance(key, (fx.BlockName, fx.SnapshotName)):
                blocks.append(SavedBlock(key, file.nbytes, file.file_bytes, file.used_at, file.trimmable))
                continue
            records.append(SavedRecord(file.namespace, file.tokens, file.nbytes, file.trimmable, file.file_bytes,
                                       file.used_at))
        checkpoints = tuple(SavedCheckpoint(c.meta, len(c.tokens), c.file_bytes, c.used_at)
                            for c in self.disk.checkpoints.values() if c.identity == self.identity)
        return Scanned(tuple(records), checkpoints, rejected, tuple(blocks))

    def perform(self, effect: fx.Effect) -> list:
        """Carry out ``effect``; the completion events it produced (none for the quiet ones)."""
        self.stats.effects += 1
        crash = self.faults.crash_before_effect
        if crash is not None and self.stats.effects >= crash:
            self._pending.clear()  # writes in flight are lost, and reads ahead
            self._reads.clear()
            raise SimulatedCrash(f"crashed before effect {self.stats.effects}: {effect!r}")
        return super().perform(effect)

    def poll(self, limit: int | None = None) -> list:
        """Complete the deferred reads ahead, then up to ``limit`` deferred writes (all by default),
        oldest first."""
        out: list = []
        out.extend(self.complete_reads())
        while self._pending and (limit is None or len(out) < limit):
            effect, caches = self._pending.popleft()
            out.append(self._complete_write(effect, caches))
        return out

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------ the scheduler's side

    def prefill(self, caches: SimCaches, tokens: Iterable[int]) -> SimCaches:
        """Run the simulated model over ``tokens``: extended caches, time charged to the clock."""
        tokens = tuple(tokens)
        seconds = len(tokens) / self.cost.prefill_tokens_per_second
        self.stats.prefill_tokens += len(tokens)
        self.stats.prefill_seconds += seconds
        self.now += seconds
        return caches.extended(tokens)

    def ram_content(self, entry: int) -> SimCaches:
        """The caches kept as RAM ``entry`` (for checks)."""
        return self._ram[entry]

    # ------------------------------------------------------------ performers

    def _make_fresh(self, e: fx.MakeFresh) -> list:
        self._handles[e.handle] = self.fresh()
        return []

    def _clone_entry(self, e: fx.CloneEntry) -> list:
        self._handles[e.handle] = self._ram[e.entry].trimmed(e.tokens)
        return []

    def _adopt_published(self, e: fx.AdoptPublished) -> list:
        self._ram[e.entry] = self._handles.pop(e.handle)
        return []

    def _keep_blocks(self, e: fx.KeepBlocks) -> list:
        data = self._handles[e.handle].packed
        for span in e.spans:
            self._ram[span.entry] = SimCaches(data[span.start * WIDTH:span.stop * WIDTH], self.model)
        return []

    def _keep_snapshot(self, e: fx.KeepSnapshot) -> list:
        """A snapshot's content is every token it is the state after (what a recurrent state sums up)."""
        self._ram[e.entry] = SimCaches(self._handles[e.handle].packed, self.model)
        self._snapshots.add(e.entry)
        return []

    def _assemble_blocks(self, e: fx.AssembleBlocks) -> list:
        """The blocks' tokens joined, trimmed: RAM ones as kept, the others read from their files."""
        content, read, seconds, snapshot = [], [], 0.0, None
        for entry, saved in e.parts():
            if saved is None:
                content.append(self._ram[entry].packed)
                continue
            file = self._read(saved)
            if isinstance(file, Reason):
                pinned = tuple(entry for entry, saved in e.parts() if saved is not None)
                return [done.RestoreFailed(entry, e.handle, file, pinned)]
            content.append(packed(file.content))
            read.append(entry)
            seconds += self._read_seconds(file)
        if self._is_snapshot(e.blocks[-1], e.saved[-1] if e.saved else None):  # a snapshot is always last
            snapshot = content.pop()
        joined = b"".join(content)[:e.tokens * WIDTH]
        if snapshot is not None and snapshot != joined:
            raise InterpreterError(f"a snapshot of {len(snapshot) // WIDTH} tokens on blocks that hold others")
        self._handles[e.handle] = SimCaches(joined, self.model)
        if not read:
            return []
        return [done.RestoreDone(read[-1], e.handle, seconds, tuple(read))]

    def _spill_entry(self, e: fx.SpillEntry) -> list:
        return self._write(e)

    def _write_checkpoint(self, e: fx.WriteCheckpoint) -> list:
        return self._write(e)

    def _write(self, e: fx.SpillEntry | fx.WriteCheckpoint) -> list:
        caches = self._ram[e.entry] if isinstance(e, fx.SpillEntry) else self._handles.pop(e.handle)
        if self.deferred_writes:
            self._pending.append((e, caches))
            return []
        return [self._complete_write(e, caches)]

    def _complete_write(self, e: fx.SpillEntry | fx.WriteCheckpoint, caches: SimCaches):
        self.stats.writes += 1
        if self.stats.writes in self.faults.fail_writes:
            reason = self.faults.fail_reason
            return (done.SpillFailed(e.entry, reason) if isinstance(e, fx.SpillEntry)
                    else done.CheckpointFailed(e.meta.key, reason))
        self.stats.bytes_written += e.file_bytes
        self.stats.write_seconds += e.file_bytes / self.cost.write_bytes_per_second
        if isinstance(e, fx.SpillEntry):
            is_object = isinstance(caches, SimObject)
            self.disk.files[e.key] = SimFile(self.identity, e.key.namespace, e.key.tokens, e.nbytes, e.trimmable,
                                             e.key.tokens if is_object else caches.tokens,
                                             payload=caches if is_object else None, file_bytes=e.file_bytes,
                                             used_at=self.disk.stamp())
            return done.SpillDone(e.entry)
        self.disk.checkpoints[e.meta.key] = SimCheckpoint(e.meta, caches.tokens, self.identity, e.file_bytes,
                                                          self.disk.stamp())
        return done.CheckpointWritten(e.meta.key, len(caches.tokens), e.file_bytes)

    def _read(self, key: fx.DiskKey) -> SimFile | Reason:
        file = self.disk.files.get(key)
        if file is None:
            return Reason.MISSING
        self.stats.reads += 1
        if self.stats.reads in self.faults.fail_reads:
            return Reason.IO_ERROR
        if file.identity != self.identity or file.corrupt:
            reason = Reason.IDENTITY_MISMATCH if file.identity != self.identity else Reason.CORRUPT
            self._move_aside(key, reason)
            return reason
        self.stats.bytes_read += file.file_bytes
        self.stats.restore_seconds += self._read_seconds(file)
        file.used_at = self.disk.stamp()
        return file

    def _read_seconds(self, file: SimFile) -> float:
        """What reading ``file`` back takes, by the cost model (the seconds a read reports)."""
        return file.file_bytes / self.cost.restore_bytes_per_second

    def _move_aside(self, key: fx.DiskKey, reason: Reason) -> None:
        file = self.disk.files.pop(key, None)
        self.disk.rejected.append((key, reason))
        self.disk.rejected_bytes += file.file_bytes if file is not None else 0

    def _restore_entry(self, e: fx.RestoreEntry) -> list:
        file = self._read(e.key)
        if isinstance(file, Reason):
            return [done.RestoreFailed(e.entry, e.handle, file)]
        self._handles[e.handle] = file.payload or SimCaches(file.content, self.model).trimmed(e.tokens)
        return [done.RestoreDone(e.entry, e.handle, self._read_seconds(file))]

    def _prefetch_entry(self, e: fx.PrefetchEntry) -> list:
        file = self._read(e.key)
        if isinstance(file, Reason):
            return [done.PrefetchFailed(e.entry, file)]
        self._ram[e.entry] = file.payload or SimCaches(file.content, self.model)
        return [done.PrefetchDone(e.entry, self._read_seconds(file))]

    def complete_reads(self) -> list:
        """Complete the deferred reads ahead, oldest first."""
        out: list = []
        while self._reads:
            read = self._reads.popleft()
            out.extend(self._fetched(read) if isinstance(read, fx.FetchRemote) else self._read_ahead(read))
        return out

    def _prefetch_blocks(self, e: fx.PrefetchBlocks) -> list:
        if self.deferred_reads:
            self._reads.append(e)
            return []
        return self._read_ahead(e)

    def _read_ahead(self, e: fx.PrefetchBlocks) -> list:
        """The chain's saved parts read into RAM in order, up to the first that fails: a block holds its
        own tokens, a snapshot every token it is the state after."""
        read, seconds = [], 0.0
        for at, part in enumerate(e.parts):
            file = self._read(part.saved)
            if isinstance(file, Reason):
                return [done.BlocksPrefetched(tuple(read), seconds, part.entry, file,
                                              tuple(p.entry for p in e.parts[at + 1:]))]
            self._ahead[part.entry] = (SimCaches(packed(file.content), self.model),
                                       isinstance(part.saved, fx.SnapshotName))
            read.append(part.entry)
            seconds += self._read_seconds(file)
        return [done.BlocksPrefetched(tuple(read), seconds)]

    def _fetch_remote(self, e: fx.FetchRemote) -> list:
        """Copy the chain's objects to the disk, in order, up to the first the store cannot give or that
        fails its hash (not kept); where it lacks one (or has them all), then the longest partial block
        after the last one copied that the prompt goes on with. The store down fails the fetch. With
        ``deferred_reads``, it completes at ``poll``, as a background fetch would."""
        if self.remote is None:
            raise InterpreterError("a shared-tier effect reached a simulator without a remote")
        if self.deferred_reads:
            self._reads.append(e)
            return []
        return self._fetched(e)

    def _fetched(self, e: fx.FetchRemote) -> list:
        blocks, trouble = [], {"rejected": False, "failed": False}

        def kept(name: fx.BlockName) -> bool | None:
            self.remote.calls += 1
            if self.remote.down:
                trouble["failed"] = True
                return None
            stored = self.remote.objects.get((self.identity, name))
            if stored is None:
                return False
            if stored.corrupt:
                trouble["rejected"] = True
                return None
            file = attrs.evolve(stored, used_at=self.disk.stamp())
            self.disk.files[name] = file
            blocks.append(SavedBlock(name, file.nbytes, file.file_bytes, file.used_at, file.trimmable))
            return True

        def children(parent: bytes) -> list[tuple[int, bytes]] | None:
            if self.remote.down:
                trouble["failed"] = True
                return None
            return self.remote.children(self.identity, e.namespace, parent)

        fetch_in_order(e, kept, children)
        nbytes = sum(block.file_bytes for block in blocks)
        seconds = nbytes / self.cost.remote_bytes_per_second if nbytes else None
        tail = None if e.names else (e.namespace, e.after)
        return [done.RemoteFetched(e.names, tuple(blocks), nbytes, seconds, trouble["rejected"], trouble["failed"],
                                   tail)]

    def _offer_remote(self, e: fx.OfferRemote) -> list:
        if self.remote is None:
            raise InterpreterError("a shared-tier effect reached a simulator without a remote")
        file = self.disk.files.get(e.name)
        if file is None:
            return []
        self.remote.calls += 1
        if self.remote.down:
            return [done.RemoteOffered(e.name, None)]
        if (self.identity, e.name) in self.remote.objects:
            return [done.RemoteOffered(e.name, False)]
        self.remote.objects[self.identity, e.name] = attrs.evolve(file)
        return [done.RemoteOffered(e.name, True)]

    def _delete_file(self, e: fx.DeleteFile) -> list:
        self.disk.files.pop(e.key, None)
        return []

    def _delete_checkpoint(self, e: fx.DeleteCheckpoint) -> list:
        self._pending = deque((p, c) for p, c in self._pending
                              if not (isinstance(p, fx.WriteCheckpoint) and p.meta.key == e.key))
        self.disk.checkpoints.pop(e.key, None)
        return []

    def _resume_checkpoint(self, e: fx.ResumeCheckpoint) -> list:
        saved = self.disk.checkpoints.get(e.key)
        if saved is None or saved.identity != self.identity:
            return [done.ResumeFailed(e.key, e.handle, Reason.MISSING)]
        self._handles[e.handle] = SimCaches(saved.tokens, self.model)
        return [done.CheckpointResumed(e.handle, saved.meta, tuple(saved.tokens))]

    def _sync(self, e: fx.Sync) -> list:
        return self.poll() + [done.Synced(e.pressure)]

    def close(self) -> None:
        """Nothing to release: the simulated disk outlives the service on purpose (a restart reads it)."""


def simulated_parts(model: str | ModelSpec = "llama-3.1-8b", *, ram_bytes: int, kv_budget_bytes: int | None = None,
                    disk_bytes: int | None = None, policy: str = "lru", interpreter_options: dict | None = None,
                    **options: Any) -> tuple[ServiceConfig, "SimulatorInterpreter"]:
    """The config and the simulator of a service for a catalogue model (or a :class:`ModelSpec`)
    (``KvCacheService.simulated`` builds the service from them).

    ``ram_bytes`` bounds kept prefixes, ``kv_budget_bytes`` admitted requests,
    ``disk_bytes`` the simulated disk tier (None: none). Further ``options``
    are :class:`~kvstate.core.state.ServiceConfig` fields; ``interpreter_options``
    go to :class:`SimulatorInterpreter` (``disk``, ``faults``, ``cost``,
    ``deferred_writes``, ``deferred_reads``, ``identity``, ``files``, ``remote``:
    a :class:`SimRemote` shared by a fleet, which turns ``remote_tier`` on).
    """
    spec = model_spec(model) if isinstance(model, str) else model
    interpreter_options = dict(interpreter_options or {})
    identity = options.get("identity") or interpreter_options.get("identity") or f"sim:{spec.name}"
    options.setdefault("identity", identity)
    interpreter_options.setdefault("identity", identity)
    if interpreter_options.get("remote") is not None:
        options.setdefault("remote_tier", True)
    config = ServiceConfig(model=spec, ram_capacity_bytes=ram_bytes, kv_budget_bytes=kv_budget_bytes,
                           disk_capacity_bytes=disk_bytes, policy=policy, **options)
    return config, SimulatorInterpreter(spec, **interpreter_options)
