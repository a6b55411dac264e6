"""The MLX interpreter: carries the core's effects out on real mlx-lm caches and real files.

RAM entries are lists of mlx-lm cache objects, one per layer, exactly as the
model's ``make_cache()`` builds them; what ``acquire`` hands out is a copy
that shares no array with what is kept, so it goes straight into
``generate_step`` / ``stream_generate`` / ``BatchGenerator``. Saved state goes
through a :class:`~kvstate.interpreters.mlx.disk_store.DiskStore`; writes are
encoded on the caller's thread and committed by a background writer
(write-behind) whose completions the facade collects at ``boundary()`` and
``flush()``. Reads (restore, prefetch, resume) run on the caller's thread.
"""

from __future__ import annotations

import functools
import hashlib
import math
import queue
import threading
import time
from typing import Any, Callable

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstate.core.blocks import block_names
from kvstate.core.errors import InvalidRequest
from kvstate.core.state import InvalidConfig, ServiceConfig
from kvstate.effects.completions import Scanned
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from kvstate.interpreters.mlx import block_views
from kvstate.interpreters.mlx import blocks as mlx_blocks
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.mlx.chain_reads import PartRejected
from kvstate.interpreters.mlx.disk_store import LOADERS, DiskStore, RejectedFile, StoreIdentity, WriteFailed
from kvstate.interpreters.mlx.weights_identity import weights_fingerprint
from kvstate.models.mlx_adapter import model_fingerprint, spec_from_model, tokenizer_hash
from kvstate.models.spec import ModelSpec
from kvstate.interpreters.base import BlockSizes, CacheFacts, HeldState, InterpreterError


class _Worker:
    """A background thread running jobs in order (committing encoded files, or reading files ahead);
    what each returns waits in a list for ``poll``."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: list = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # stop()
                self._jobs.task_done()
                return
            try:
                completion = job()
                if completion is not None:
                    with self._lock:
                        self._done.append(completion)
            except Exception as error:  # noqa: BLE001 - the thread lives on; the caller hears of it at poll
                with self._lock:
                    self._errors.append(error)
            finally:
                self._jobs.task_done()

    def poll(self) -> list:
        """The completions so far; :class:`InterpreterError` once for a queued job that raised."""
        with self._lock:
            if self._errors:  # the completions stay for the next poll
                error, self._errors = self._errors[0], self._errors[1:]
                raise InterpreterError(f"a background disk job failed: {error!r}") from error
            out, self._done = self._done, []
        return out

    def drain(self) -> list:
        self._jobs.join()
        return self.poll()

    def stop(self) -> None:
        """Finish what is queued, then end the thread."""
        self._jobs.join()
        self._jobs.put(None)
        self._thread.join()


@attrs.frozen(eq=False)
class _PartsRead:
    """What a read ahead of a chain's parts found: the parts read and verified (their arrays filled in
    place), in order, and the part that failed, with why (None: none did)."""

    effect: fx.PrefetchBlocks
    thread: int  # the thread that asked for it: the one that takes it
    parts: list
    failed: int | None
    reason: done.FailureReason | None
    seconds: float


def _fill_parts(store: DiskStore, effect: fx.PrefetchBlocks, thread: int, planned: list, failed: int | None,
                reason: done.FailureReason | None, planning: float) -> _PartsRead:
    """Read the planned parts of ``effect`` into their arrays, in order, each verified, up to the first
    that fails (no MLX call: this runs on the reader thread); ``failed`` is a part whose plan failed."""
    started = time.perf_counter()
    reads = dict(planned)
    filled, stopped, why = _until_failure([part for part, _ in planned], lambda part: store.fill(reads[part]))
    if stopped is not None:
        failed, reason = stopped, why
    parts = [(part, reads[part]) for part, _ in filled]
    return _PartsRead(effect, thread, parts, failed, reason, planning + time.perf_counter() - started)


def _until_failure(parts: list, step: Callable[[fx.BlockPart], Any]
                   ) -> tuple[list, int | None, done.FailureReason | None]:
    """``(part, step(part))`` for a chain's ``parts`` in order, up to the first whose step fails, and
    that part's entry and why (None, None: none failed)."""
    out = []
    for part in parts:
        try:
            out.append((part, step(part)))
        except RejectedFile as rejected:
            return out, part.entry, rejected.reason
        except Exception:  # noqa: BLE001 - not the store's own rejection: a failed read, the file left as it is
            return out, part.entry, done.FailureReason.IO_ERROR
    return out, None, None


class MlxInterpreter(HeldState):
    """Carries out effects on mlx-lm caches for ``model``, with an optional disk store."""

    name = "the MLX interpreter"

    def __init__(self, model: Any, *, store: DiskStore | None = None, background_writes: bool = True,
                 clock: Callable[[], float] = time.monotonic, remote: Any = None):
        self.model = model
        self.store = store
        #: The shared tier (:class:`~kvstate.interpreters.fleet.remote_store.RemoteStore`), or None.
        self.remote = remote
        self._clock = clock
        super().__init__()
        background = background_writes and store is not None
        self._writer = _Worker("kvstate-writer") if background else None
        #: Reads ahead of blocks (``PrefetchBlocks``): files read into place and verified here, off the
        #: caller's thread; their arrays are allocated, and their tensors made, on the thread that asked
        #: (:meth:`poll`), where MLX runs.
        self._reader = _Worker("kvstate-reader") if background else None
        self._landed: list[_PartsRead] = []  # reads ahead done, not yet taken by the thread that asked
        #: Fetches from and offers to the shared tier, in order, off every caller's thread.
        self._remote_worker = _Worker("kvstate-remote") if background and remote is not None else None
        #: The place on its chain of every RAM block kept from staged caches.
        self._links: dict[int, block_views.Link] = {}

    @property
    def now(self) -> float:
        return self._clock()

    # ------------------------------------------------------------ the facade's side

    def fresh(self) -> list:
        """The model's empty caches."""
        return make_prompt_cache(self.model)

    def stage(self, handle: int, caches: object) -> CacheFacts:
        if not isinstance(caches, (list, tuple)) or not caches:
            raise InvalidRequest(f"caches must be the model's list of mlx-lm cache objects, got "
                                 f"{type(caches).__name__}")
        caches = list(caches)
        facts = CacheFacts(mlx_caches.covered(caches), mlx_caches.live_bytes(caches), mlx_caches.trimmable(caches))
        self._handles[handle] = caches
        return facts

    def file_bytes(self, handle: int, key: fx.DiskKey, facts: CacheFacts) -> int:
        """The bytes the file of the caches staged under ``handle`` would take (0 without a disk store)."""
        if self.store is None:
            return 0
        return self.store.prefix_file_bytes(key, self._handles[handle], facts.trimmable, facts.nbytes)

    def checkpoint_file_bytes(self, handle: int, meta: fx.CheckpointMeta, tokens: tuple[int, ...]) -> int:
        """The bytes the checkpoint file of the caches staged under ``handle`` would take."""
        if self.store is None:
            return 0
        return self.store.checkpoint_file_bytes(meta, tokens, self._handles[handle])

    def block_bytes(self, handle: int, namespace: str, tokens: tuple[int, ...],
                    spans: tuple[tuple[int, int], ...]) -> BlockSizes | None:
        """Each block's bytes in RAM and on disk, where every layer of the staged caches can be cut
        (plain or quantised KV); None otherwise. Measured from the caches' shapes: nothing is cut."""
        caches = self._handles[handle]
        if not mlx_blocks.partly_blockable(caches) or not spans:
            return None
        block_tokens = spans[0][1] - spans[0][0]
        names = block_names(namespace, tokens, block_tokens) if self.store is not None else None
        classes = [type(cache).__name__ for cache in caches]
        out, measured = [], {}
        for i, (start, stop) in enumerate(spans):
            block = measured.get(stop - start)  # blocks of one length hold arrays of the same shapes
            if block is None:
                block = measured[stop - start] = mlx_blocks.measured(caches, stop - start)
            nbytes = sum(a.nbytes for layer in block for a in layer.values())
            file_bytes = self.store.block_file_bytes(names[i], block, classes) if names is not None else 0
            out.append((nbytes, file_bytes))
        if mlx_blocks.blockable(caches):
            return BlockSizes(tuple(out))
        snapshot = [None if mlx_blocks.cuttable(cache) else cache for cache in caches]  # measured, not copied
        nbytes = mlx_caches.live_bytes([cache for cache in snapshot if cache is not None])
        file_bytes = 0
        if names is not None:
            file_bytes = self.store.snapshot_file_bytes(fx.SnapshotName(namespace, tokens, names[-1].key), snapshot)
        return BlockSizes(tuple(out), (nbytes, file_bytes))

    def stage_object(self, handle: int, value: object) -> int:
        """Hold a tensor object (``value``, a dict of arrays) under ``handle``; its bytes."""
        payload = [mlx_caches.TensorObject(value)]
        self._handles[handle] = payload
        return mlx_caches.live_bytes(payload)

    def take_object(self, handle: int) -> dict:
        return self._handles.pop(handle)[0].arrays

    def saved_prefixes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [] if self.store is None else self.store.saved_prefixes()

    def rejected_held(self) -> tuple[int, int]:
        return (0, 0) if self.store is None else self.store.rejected_held

    def scan(self) -> Scanned:
        if self.store is None:
            return Scanned()
        records, checkpoints, rejected, blocks = self.store.scan_all()
        return Scanned(tuple(records), tuple(checkpoints), rejected, tuple(blocks))

    def poll(self) -> list:
        """Completions of writes (and fetches from the shared tier) finished since the last poll."""
        out = self._writer.poll() if self._writer is not None else []
        if self._remote_worker is not None:
            out.extend(self._remote_worker.poll())
        if self._reader is not None:
            # A read ahead is taken (its arrays built) only on the thread that asked for it: MLX work
            # of one thread must not run on another's (a scrape's poll leaves it for a later one).
            self._landed.extend(self._reader.poll())
            here, waiting = threading.get_ident(), []
            for read in self._landed:
                if read.thread == here:
                    out.extend(self._take_read(read))
                else:
                    waiting.append(read)
            self._landed = waiting
        return out

    def drain_reads(self) -> list:
        """Wait for the reads ahead in flight, and take them: their completions (for a caller that must
        see them landed before it goes on)."""
        if self._reader is None:
            return []
        landed, self._landed = self._landed + self._reader.drain(), []
        return [completion for read in landed for completion in self._take_read(read)]

    def close(self) -> None:
        """The service closed: stop the writer (its queue was drained by the close's flush) and release
        the store's hold on the saved-state root. Idempotent."""
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        if self._remote_worker is not None:
            self._remote_worker.stop()
            self._remote_worker = None
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        if self.store is not None:
            self.store.close()

    def ram_caches(self, entry: int) -> list:
        """The caches kept as RAM ``entry`` (for checks)."""
        held = self._ram[entry]
        return held if entry in self._snapshots else block_views.block_of(held)

    def ram_backings(self) -> list[block_views.Backing]:
        """The arrays RAM blocks are views of (for checks)."""
        backings = {id(h.backing): h.backing for h in self._ram.values() if isinstance(h, block_views.View)}
        return list(backings.values())

    # ------------------------------------------------------------ performers

    def _store(self) -> DiskStore:
        if self.store is None:
            raise InterpreterError("a disk effect reached an interpreter without a disk store")
        return self.store

    def _write(self, commit: Callable[[], None], succeeded: Any, failed: Callable[[Any], Any]) -> list:
        def job():
            try:
                commit()
            except WriteFailed as error:
                return failed(error.reason)
            except Exception:  # noqa: BLE001 - any write that did not complete is a failed write, counted
                return failed(done.FailureReason.IO_ERROR)
            return succeeded
        if self._writer is not None:
            self._writer.submit(job)
            return []
        return [job()]

    def _ordered(self, action: Callable[[], None]) -> None:
        """Run ``action`` after every write queued before it (deletes must not overtake writes)."""
        if self._writer is not None:
            self._writer.submit(lambda: action())
        else:
            action()

    def _make_fresh(self, e: fx.MakeFresh) -> list:
        self._handles[e.handle] = self.fresh()
        return []

    def _clone_entry(self, e: fx.CloneEntry) -> list:
        self._handles[e.handle] = mlx_caches.clone(self._ram[e.entry], e.tokens)
        return []

    def _adopt_published(self, e: fx.AdoptPublished) -> list:
        caches = self._handles.pop(e.handle)
        # Kept state is scheduled now, on the caller's stream, not left to some later thread; without a
        # wait, so a publish does not stall the caller's pipeline (a generation loop's next step).
        mx.async_eval(mlx_caches.arrays_of(caches))
        self._ram[e.entry] = caches
        return []

    def _keep_blocks(self, e: fx.KeepBlocks) -> list:
        """Keep the publish's blocks: each run of consecutive ones as views of one array a layer
        (:mod:`~kvstate.interpreters.mlx.block_views`), scheduled now, on the caller's stream, without
        a wait (a publish does not stall a generation loop's next step)."""
        if e.handle not in self._handles:
            raise InterpreterError(f"blocks kept from handle {e.handle}, which stages nothing")
        runs: list[list[tuple[int, block_views.Link]]] = []
        for span in e.spans:
            link = block_views.Link(span.start, span.stop, span.parent)
            self._links[span.entry] = link
            if runs and runs[-1][-1][0] == span.parent and runs[-1][-1][1].stop == span.start:
                runs[-1].append((span.entry, link))
            else:
                runs.append([(span.entry, link)])
        for run in runs:
            self._ram.update(block_views.keep(self._handles[e.handle], run, self._ram, self._links))
        return []

    def _drop_entry(self, e: fx.DropEntry) -> list:
        held = self._ram.get(e.entry)
        out = super()._drop_entry(e)
        self._links.pop(e.entry, None)
        if isinstance(held, block_views.View):
            self._ram.update(block_views.without(held))
        return out

    def _keep_snapshot(self, e: fx.KeepSnapshot) -> list:
        snapshot = mlx_blocks.snapshot_of(self._handles[e.handle])
        mx.async_eval(mlx_caches.arrays_of([cache for cache in snapshot if cache is not None]))
        self._ram[e.entry] = snapshot
        self._snapshots.add(e.entry)
        return []

    def _assemble_blocks(self, e: fx.AssembleBlocks) -> list:
        """The chain's caches: the blocks RAM lacks read straight into the joined layers and verified
        there (:meth:`DiskStore.read_chain`), the RAM blocks copied in, the whole trimmed; the layers
        that cannot be cut from the snapshot that ends the chain, if one does."""
        started = time.perf_counter()
        chain, entries, snapshot = [], [], None
        saved = tuple(entry for entry, name in e.parts() if name is not None)
        for entry, name in e.parts():
            if self._is_snapshot(entry, name):
                snapshot = fx.BlockPart(entry, name)
                continue
            chain.append(self._ram[entry] if name is None else name)
            entries.append(entry)
        viewed = block_views.one_view(chain) if chain else None
        if viewed is not None:  # consecutive views of one array: handed out as one view, no copy
            assemble = functools.partial(mlx_blocks.assemble_joined, viewed)
        elif any(isinstance(block, fx.BlockName) for block in chain):
            chain = [block if isinstance(block, fx.BlockName) else block_views.block_of(block) for block in chain]
            try:
                joined = self._store().read_chain(chain)
            except PartRejected as failure:
                return [done.RestoreFailed(entries[failure.index], e.handle, failure.rejected.reason, saved)]
            except Exception:  # noqa: BLE001 - not the store's own rejection: a failed read, the files left as they are
                first = next(entry for entry, block in zip(entries, chain) if isinstance(block, fx.BlockName))
                return [done.RestoreFailed(first, e.handle, done.FailureReason.IO_ERROR, saved)]
            assemble = functools.partial(mlx_blocks.assemble_joined, joined)
        else:
            assemble = functools.partial(mlx_blocks.assemble, [block_views.block_of(block) for block in chain])
        held = None
        if snapshot is not None:
            held = self._ram[snapshot.entry] if snapshot.saved is None else self._read_saved(snapshot.saved)
            if isinstance(held, done.FailureReason):
                return [done.RestoreFailed(snapshot.entry, e.handle, held, saved)]
        self._handles[e.handle] = assemble(self.fresh(), held, e.tokens)
        if not saved:
            return []
        return [done.RestoreDone(saved[-1], e.handle, time.perf_counter() - started, saved)]

    def _read_saved(self, name: fx.SnapshotName) -> list | done.FailureReason:
        """A snapshot's content read back and verified, or why not."""
        try:
            return self._store().read_snapshot(name)
        except RejectedFile as rejected:
            return rejected.reason
        except Exception:  # noqa: BLE001 - not the store's own rejection: a failed read, the file left as it is
            return done.FailureReason.IO_ERROR

    def _spill_entry(self, e: fx.SpillEntry) -> list:
        store = self._store()
        if isinstance(e.key, fx.BlockName):
            classes = [type(cache).__name__ for cache in self.fresh()]
            encoded = store.encode_block(e.key, block_views.block_of(self._ram[e.entry]), classes)
        elif isinstance(e.key, fx.SnapshotName):
            encoded = store.encode_snapshot(e.key, self._ram[e.entry])
        else:
            encoded = store.encode_prefix(e.key, self._ram[e.entry], e.trimmable, e.nbytes)
        if encoded.file_bytes != e.file_bytes:  # the caches changed since they were measured: not written
            return [done.SpillFailed(e.entry, done.FailureReason.NO_SPACE)]
        return self._write(lambda: store.commit(encoded), done.SpillDone(e.entry),
                           lambda reason: done.SpillFailed(e.entry, reason))

    def _read(self, key: fx.DiskKey) -> list | done.FailureReason:
        """The saved caches of ``key``, or why not. Every failure is a failed read the core hears of
        (so the entry is unpinned and forgotten), never an exception out of the performer."""
        store = self._store()
        try:
            return store.read_prefix(key)
        except RejectedFile as rejected:
            return rejected.reason
        except Exception:  # noqa: BLE001 - not the store's own rejection: a failed read, the file left as it is
            return done.FailureReason.IO_ERROR

    def _restore_entry(self, e: fx.RestoreEntry) -> list:
        started = time.perf_counter()
        caches = self._read(e.key)
        if isinstance(caches, done.FailureReason):
            return [done.RestoreFailed(e.entry, e.handle, caches)]
        if e.tokens != len(e.key.tokens):
            caches = mlx_caches.clone(caches, e.tokens)
        self._handles[e.handle] = caches
        return [done.RestoreDone(e.entry, e.handle, time.perf_counter() - started)]

    def _prefetch_entry(self, e: fx.PrefetchEntry) -> list:
        started = time.perf_counter()
        caches = self._read(e.key)
        if isinstance(caches, done.FailureReason):
            return [done.PrefetchFailed(e.entry, caches)]
        self._ram[e.entry] = caches
        return [done.PrefetchDone(e.entry, time.perf_counter() - started)]

    def _prefetch_blocks(self, e: fx.PrefetchBlocks) -> list:
        """Read the chain's saved parts ahead: each file's header checked and its arrays allocated here,
        then its bytes read into them and verified on the reader thread where there is one (the
        completion comes at a later :meth:`poll`), else now."""
        store, started = self._store(), time.perf_counter()
        planned, failed, reason = _until_failure(list(e.parts), lambda part: store.plan_read_ahead(part.saved))
        job = functools.partial(_fill_parts, store, e, threading.get_ident(), planned, failed, reason,
                                time.perf_counter() - started)
        if self._reader is not None:
            self._reader.submit(job)
            return []
        return self._take_read(job())

    def _take_read(self, read: "_PartsRead") -> list:
        """The parts a read ahead verified, their content made here from the arrays it filled, in
        order, up to the first that failed (or fails to build), held until the core settles them; the
        completion that says so."""
        store, taken = self._store(), []
        failed, reason = read.failed, read.reason
        for part, filled in read.parts:
            try:
                held = store.built(filled)
            except RejectedFile as rejected:
                failed, reason = part.entry, rejected.reason
                break
            snapshot = isinstance(part.saved, fx.SnapshotName)
            # Evaluated now, on this thread's stream (the one that asked for the read): where there is a
            # device, the arrays' move there.
            mx.eval(mlx_caches.arrays_of([c for c in held if c is not None]) if snapshot
                    else [array for layer in held for array in layer.values()])
            self._ahead[part.entry] = (held, snapshot)
            taken.append(part.entry)
        entries = [part.entry for part in read.effect.parts]
        unread = tuple(entries[entries.index(failed) + 1:]) if failed is not None else ()
        return [done.BlocksPrefetched(tuple(taken), read.seconds, failed, reason, unread)]

    def _delete_file(self, e: fx.DeleteFile) -> list:
        store = self._store()
        self._ordered(lambda: store.delete_prefix(e.key))
        return []

    def _write_checkpoint(self, e: fx.WriteCheckpoint) -> list:
        store = self._store()
        encoded = store.encode_checkpoint(e.meta, e.tokens, self._handles.pop(e.handle))
        if encoded.file_bytes != e.file_bytes:
            return [done.CheckpointFailed(e.meta.key, done.FailureReason.NO_SPACE)]
        return self._write(lambda: store.commit(encoded),
                           done.CheckpointWritten(e.meta.key, len(e.tokens), encoded.file_bytes),
                           lambda reason: done.CheckpointFailed(e.meta.key, reason))

    def _delete_checkpoint(self, e: fx.DeleteCheckpoint) -> list:
        store = self._store()
        self._ordered(lambda: store.delete_checkpoint(e.key))
        return []

    def _resume_checkpoint(self, e: fx.ResumeCheckpoint) -> list:
        try:
            meta, tokens, caches = self._store().read_checkpoint(e.key)
        except RejectedFile as rejected:
            return [done.ResumeFailed(e.key, e.handle, rejected.reason)]
        except Exception:  # noqa: BLE001 - the resume fails; the core deletes the checkpoint
            return [done.ResumeFailed(e.key, e.handle, done.FailureReason.IO_ERROR)]
        self._handles[e.handle] = caches
        return [done.CheckpointResumed(e.handle, meta, tuple(tokens))]

    def _sync(self, e: fx.Sync) -> list:
        finished = self._writer.drain() if self._writer is not None else []
        if self._remote_worker is not None and not e.pressure:  # a flush, a close: offers land too
            finished += self._remote_worker.drain()
        return finished + [done.Synced(e.pressure)]

    def _fetch_remote(self, e: fx.FetchRemote) -> list:
        from kvstate.interpreters.fleet.remote_store import fetch_chain
        return self._remotely(lambda: fetch_chain(self._shared(), self._store(), e))

    def _offer_remote(self, e: fx.OfferRemote) -> list:
        from kvstate.interpreters.fleet.remote_store import offer_block
        return self._remotely(lambda: offer_block(self._shared(), self._store(), e.name))

    def _shared(self) -> Any:
        if self.remote is None:
            raise InterpreterError("a shared-tier effect reached an interpreter without a remote store")
        return self.remote

    def _remotely(self, job: Callable[[], Any]) -> list:
        """Run a shared tier's ``job`` on its worker (its completion lands at a poll), or here."""
        if self._remote_worker is not None:
            self._remote_worker.submit(job)
            return []
        completion = job()
        return [completion] if completion is not None else []


def mlx_parts(model: Any, *, ram_bytes: int, kv_budget_bytes: int | None = None, disk_dir: str | None = None,
              disk_bytes: int | None = None, name: str = "model", config: dict | None = None, tokenizer: Any = None,
              spec: ModelSpec | None = None, verify: bool = True, background_writes: bool = True,
              policy: str = "lru", root_budget: Any = None, write_file: Callable | None = None,
              weights_dir: str | None = None, disk_loader: str | None = None, remote: Any = None,
              remote_endpoint: str | None = None, remote_timeout_s: float = 5.0,
              **options: Any) -> tuple[ServiceConfig, "MlxInterpreter"]:
    """The config and the MLX interpreter of a service for a loaded mlx-lm ``model``
    (``KvCacheService.for_mlx`` builds the service from them).

    The geometry is read off the model (or given as ``spec``); the identity
    every saved file carries is the model fingerprint (weights and
    ``config``), the tokenizer hash and the geometry. ``disk_dir`` with
    ``disk_bytes`` enables the disk tier; ``verify`` checks content hashes
    on every restore. ``root_budget`` (a
    :class:`~kvstate.interpreters.mlx.disk_budget.RootBudget` over ``disk_dir``)
    shares one byte budget among every store under that root: idle
    directories are evicted to fit when this service starts and closes.
    ``weights_dir``, the directory the model was loaded from (no adapter on
    top), gives the identity from its weight files, hashed once and
    remembered (:mod:`~kvstate.interpreters.mlx.weights_identity`), instead of
    hashing every loaded weight at every start. ``disk_loader`` says how
    restores read a file (``"buffer"``: into a reused host buffer, then copied;
    ``"mlx"``: MLX's own safetensors loader; None: by device, see
    :func:`~kvstate.interpreters.mlx.disk_store.default_loader`). ``remote``,
    ``s3://BUCKET[/PREFIX]`` (at ``remote_endpoint``, an S3-compatible
    store's URL; None: AWS's) or a built
    :class:`~kvstate.interpreters.fleet.remote_store.RemoteStore`, adds the
    tier a fleet shares (:mod:`~kvstate.core.remote`; needs the disk tier);
    ``remote_timeout_s`` bounds each call to a store given by its URL (a
    block is one call: give a slow link the time its largest block takes).
    """
    if isinstance(remote_timeout_s, bool) or not isinstance(remote_timeout_s, (int, float)) or not (
            0 < remote_timeout_s < math.inf):
        raise InvalidConfig(f"remote_timeout_s must be a positive number of seconds, got {remote_timeout_s!r}")
    spec = spec or spec_from_model(model, name)
    fingerprint = weights_fingerprint(weights_dir) if weights_dir is not None else model_fingerprint(model, config)
    config_fingerprint = hashlib.blake2b(f"{fingerprint}:{spec!r}".encode(), digest_size=12).hexdigest()
    identity = StoreIdentity(fingerprint, tokenizer_hash(tokenizer), config_fingerprint)
    store = None
    if disk_dir is not None:
        if disk_bytes is None:
            raise InvalidConfig("disk_dir needs disk_bytes: the byte budget of the disk tier")
        if disk_loader is not None and disk_loader not in LOADERS:
            raise InvalidConfig(f"disk_loader must be one of {LOADERS} or None (chosen by device), "
                                f"got {disk_loader!r}")
        store = DiskStore(disk_dir, identity, verify=verify, budget=root_budget, write_file=write_file,
                          loader=disk_loader)
    elif disk_bytes is not None:
        raise InvalidConfig("disk_bytes needs disk_dir: where saved state lives")
    try:
        if remote is not None:
            options["remote_tier"] = True
            if isinstance(remote, str):
                from kvstate.interpreters.fleet.remote_store import RemoteStore
                remote = RemoteStore(remote, identity.encoded(), endpoint_url=remote_endpoint, clock=time.monotonic,
                                     timeout_s=float(remote_timeout_s))
        service_config = ServiceConfig(model=spec, ram_capacity_bytes=ram_bytes, kv_budget_bytes=kv_budget_bytes,
                                       disk_capacity_bytes=disk_bytes, policy=policy, identity=identity.encoded(),
                                       **options)
        if store is not None:
            store.claim_writer()
        return service_config, MlxInterpreter(model, store=store, background_writes=background_writes,
                                              remote=remote)
    except BaseException:
        if store is not None:
            store.close()  # a start that failed holds nothing: not the directory, not the root's lock
        raise
