"""Reuse: what ``acquire`` hands a request, and the reads it waits on.

A resumable generation resumes its durable checkpoint. Otherwise the longest
usable prefix serves: RAM first, disk only when strictly longer and, where the
hardware's pace is known, faster to read than to prefill (:mod:`~kvstate.core.pace`); trimmable
entries serve any shorter prefix, others only their exact length; one prompt
token is always left to compute; namespaces never mix; on a tie a session's own
state wins. A read from disk parks the acquire (:class:`~kvstate.core.replies.Pending`,
a :class:`~kvstate.core.state.Waiting` record) until its completion arrives.
"""

from __future__ import annotations

import attrs

from kvstate.core import admission, events as ev
from kvstate.core.checkpoints import reject_checkpoint, resumable, resume_agrees, resume_key
from kvstate.core.blocks import path_key
from kvstate.core.checks import ensure_open, keeps, size_text
from kvstate.core.draft import Draft, Step, without
from kvstate.core.pace import read_measured, read_pays
from kvstate.core.errors import NotAdmitted, RequestAlreadyAcquired
from kvstate.core.tokens import common_prefix, starts_with
from kvstate.core.replies import Acquired, Admission, ObjectFound, ObjectMissing, Pending, Source
from kvstate.core.request import Request
from kvstate.core.state import IN_RAM, Entry, Lease, ServiceState, Waiting, check_namespace, request_check
from kvstate.core.requests import admit_lease
from kvstate.core.tiers import chain_of, read_error, reject, saved_name, touch, touch_all, unpin
from kvstate.effects import completions as done
from kvstate.effects import effects as fx


def usable_length(entry: Entry, prompt: tuple[int, ...]) -> int:
    """Prompt tokens ``entry`` can serve (the reuse rules, for one entry)."""
    limit = len(prompt) - 1
    if entry.trimmable:
        return min(common_prefix(entry.packed, prompt), limit)
    return entry.length if entry.length <= limit and starts_with(prompt, entry.packed) else 0


def acquire(state: ServiceState, e: ev.Acquire) -> Step:
    ensure_open(state, "acquire")
    request = request_check(e.request)
    namespace = check_namespace(e.namespace)
    lease = state.leases.get(e.lease) or Lease(request)
    if lease.acquired or lease.pending_handle is not None:
        raise RequestAlreadyAcquired("this request already holds its state; release it before acquiring again")
    key = resume_key(state, request, namespace)
    d = Draft(state)
    if not lease.admitted:
        lease = _admitted_implicitly(d, lease.expecting(admission.expected_reuse(state, namespace, request.prompt)),
                                     e.or_wait)
        if lease is None:
            return Step(state, (), Admission.WAIT)
    d.lease_set(e.lease, lease.acquiring_in(namespace, key))
    if resumable(state, key):
        d.out.append(fx.ResumeCheckpoint(key, e.handle))
        reply = wait_for(d, e.lease, e.handle, None)
    else:
        reply = plan_acquire(d, e.lease, e.handle)
    return d.step(reply)


def _admitted_implicitly(d: Draft, lease: Lease, or_wait: bool) -> Lease | None:
    """An acquire without ``admit`` admits the request as ``admit`` would (:func:`admit_lease`), or
    waits (None, with ``or_wait``) or refuses: the KV budget is never bypassed."""
    admitted = admit_lease(d, lease)
    if admitted is None and not or_wait:
        need = admission.own_bytes(d, lease.request)
        raise NotAdmitted(f"acquire of a request never admitted, and the KV budget has no room for its "
                          f"{size_text(need)} now; call admit() first and wait while it returns False")
    return admitted


def wait_for(d: Draft, lease_id: int | None, handle: int, tokens: int | None) -> Pending:
    """Park an acquire (or an object get: ``lease_id`` None) until the read into ``handle`` completes."""
    if lease_id is not None:
        d.lease_set(lease_id, d.leases[lease_id].waiting_on(handle))
    d.acquiring = d.acquiring.set(handle, Waiting(lease_id, tokens))
    return Pending(handle)


def _choose(d: Draft, namespace: str, prompt: tuple[int, ...], from_disk: bool,
            own: Entry | None) -> tuple[int, int | None, int, int | None]:
    """``(ram_len, ram_entry, disk_len, disk_entry)``: the longest usable prefix in RAM, and on disk
    where it is strictly longer and reading it beats prefilling what it adds (else a disk length of 0);
    ``own``, a session's own entry, serves on a tie."""
    ram_len, ram_entry = d.ram.index.longest(namespace, prompt)
    disk_len, disk_entry = (d.disk.index.longest(namespace, prompt) if d.config.has_disk and from_disk
                            else (0, None))
    best = max(ram_len, disk_len)
    while own is not None and own.is_block and best and own.start >= best:
        own = d.entries.get(own.parent) if own.parent is not None else None  # the block that ends the reuse
    if own is not None and usable_length(own, prompt) >= best:
        # Affinity: on a tie the session's own state serves it (RAM copy if it has one).
        if own.residence in IN_RAM:
            ram_len, ram_entry, disk_len = best, own.id, 0
        else:
            disk_len, disk_entry, ram_len = best, own.id, 0
    if disk_len > ram_len and not read_pays(d.pace, _read_bytes(d, d.entries[disk_entry], disk_len),
                                            disk_len - ram_len):
        d.count("restores_passed_up")  # prefilling what the file adds is faster here than reading it
        disk_len = 0
    return ram_len, ram_entry, disk_len, disk_entry


def _read_bytes(d: Draft, entry: Entry, length: int) -> int:
    """The bytes read from disk to serve ``length`` tokens through saved ``entry``: its file, or, for a
    block, the files of the blocks of its chain RAM does not hold."""
    if not entry.chained:
        return entry.file_bytes
    return sum(block.file_bytes for block in chain_of(d, entry, length) if block.residence not in IN_RAM)


def _pin(d: Draft, entry_id: int) -> None:
    d.reading = d.reading.set(entry_id, d.reading.get(entry_id, 0) + 1)


def _restore(d: Draft, entry_id: int, length: int, handle: int) -> None:
    """Read saved ``entry_id`` into ``handle``, trimmed to ``length``; a block's chain is assembled from
    the blocks RAM holds and the files of those it does not (each file pinned until the read is over)."""
    entry = d.entries[entry_id]
    if not entry.chained:
        d.out.append(fx.RestoreEntry(entry.id, fx.DiskKey(entry.namespace, entry.tokens), length, handle))
        _pin(d, entry.id)
        return
    saved = []
    chain = chain_of(d, entry, length)
    for block in chain:
        if block.residence in IN_RAM:
            saved.append(None)
        else:
            saved.append(saved_name(d, block))
            _pin(d, block.id)
    # The last block first, as a RAM hit touches them.
    touch_all(d, [block for block in reversed(chain) if block.residence in IN_RAM])
    d.out.append(fx.AssembleBlocks(handle, length, tuple(block.id for block in chain), tuple(saved)))


def _serve_from_ram(d: Draft, entry: Entry, length: int, handle: int) -> None:
    """Hand the first ``length`` tokens RAM ``entry`` serves to ``handle``: a copy, or, for a block, its
    chain assembled; every block used is touched."""
    if not entry.chained:
        d.out.append(fx.CloneEntry(entry.id, length, handle))
        touch(d, entry)
        return
    chain = chain_of(d, entry, length)
    d.out.append(fx.AssembleBlocks(handle, length, tuple([block.id for block in chain])))
    touch_all(d, chain[::-1])  # the last block first: a chain's start is its most recently used


def plan_acquire(d: Draft, lease_id: int, handle: int, from_disk: bool = True) -> Acquired | Pending:
    """The longest usable prefix (RAM first, disk if strictly longer; RAM only without ``from_disk``),
    else fresh caches."""
    lease = d.leases[lease_id]
    request, namespace = lease.request, lease.namespace
    if not keeps(d, request):
        d.out.append(fx.MakeFresh(handle))
        return finish_acquire(d, lease_id, handle, Served(0, Source.FRESH, counted=False))
    own = _session_entry(d, request, namespace)
    if own is not None and not from_disk and own.residence not in IN_RAM:
        own = None
    ram_len, ram_entry, disk_len, disk_entry = _choose(d, namespace, request.prompt, from_disk, own)
    if disk_len > ram_len:
        _restore(d, disk_entry, disk_len, handle)
        return wait_for(d, lease_id, handle, disk_len)
    if ram_len > 0:
        entry = d.entries[ram_entry]
        _serve_from_ram(d, entry, ram_len, handle)
        return finish_acquire(d, lease_id, handle, Served(ram_len, Source.RAM, entry.id))
    d.out.append(fx.MakeFresh(handle))
    return finish_acquire(d, lease_id, handle, Served(0, Source.FRESH))


def lookup(state: ServiceState, e: ev.Lookup) -> Step:
    """A reusable prefix for a caller that holds no lease (:class:`~kvstate.core.events.Lookup`)."""
    ensure_open(state, "lookup")
    namespace = check_namespace(e.namespace)
    d = Draft(state)
    return d.step(_look_up(d, namespace, e.prompt, e.handle, from_disk=True))


def _look_up(d: Draft, namespace: str, prompt: tuple[int, ...], handle: int, from_disk: bool) -> Acquired | Pending:
    if d.ram.capacity == 0:
        d.out.append(fx.MakeFresh(handle))  # a service that keeps nothing serves nothing: not a miss
        return Acquired(None, handle, 0, Source.FRESH)
    ram_len, ram_entry, disk_len, disk_entry = _choose(d, namespace, prompt, from_disk, None)
    if disk_len > ram_len:
        _restore(d, disk_entry, disk_len, handle)
        d.acquiring = d.acquiring.set(handle, Waiting(None, disk_len, lookup=(namespace, prompt)))
        return Pending(handle)
    if ram_len > 0:
        _serve_from_ram(d, d.entries[ram_entry], ram_len, handle)
    else:
        d.out.append(fx.MakeFresh(handle))
    return _looked_up(d, handle, ram_len, Source.RAM if ram_len else Source.FRESH)


def _looked_up(d: Draft, handle: int, reused: int, source: Source) -> Acquired:
    """A lookup is answered: counted as a hit or a miss (it has no session)."""
    d.acquiring = without(d.acquiring, handle)
    d.count("hits" if reused > 0 else "misses")
    d.count("prefill_tokens_saved", reused)
    return Acquired(None, handle, reused, source)


def _session_entry(d: Draft, request: Request, namespace: str) -> Entry | None:
    """The entry ``request``'s session last kept, if it is still held in ``namespace``."""
    if request.session_id is None:
        return None
    kept = d.sessions.get(request.session_id)
    if kept is None or kept[0] != namespace:
        return None
    entry_id = d.ram.index.exact(*kept)
    if entry_id is None and d.config.has_disk:
        entry_id = d.disk.index.exact(*kept)
    if entry_id is None and d.config.block_tokens is not None:  # a block a longer chain extends since
        entry_id = d.blocks.get((kept[0], path_key(kept[0], kept[1], d.config.block_tokens)))
    return d.entries.get(entry_id) if entry_id is not None else None


@attrs.frozen
class Served:
    """What an acquire is served: ``reused`` prompt tokens from ``source`` (the ``entry`` that served
    them, if any), counted as a hit or a miss unless not ``counted``; a resumed generation's meta and
    tokens."""

    reused: int
    source: Source
    entry: int | None = None
    counted: bool = True
    resumed: fx.CheckpointMeta | None = None
    resumed_tokens: tuple[int, ...] = ()


def finish_acquire(d: Draft, lease_id: int, handle: int, served: Served) -> Acquired:
    """The lease holds its state now: counted as a hit or a miss (and a session hit or miss)."""
    lease = d.leases[lease_id]
    d.lease_set(lease_id, lease.holding(served.reused))
    if lease.admitted and served.reused != lease.reused:  # a padded batch's charge goes by the real reuse
        d.projected_bytes = admission.charge_now(d, d.leases.values())
    d.acquiring = without(d.acquiring, handle)
    if served.counted:
        d.count("hits" if served.reused > 0 else "misses")
        d.count("prefill_tokens_saved", served.reused)
        session = lease.request.session_id
        if session is not None and session in d.sessions and served.source is not Source.CHECKPOINT:
            source_entry = d.entries.get(served.entry) if served.entry is not None else None
            own = source_entry is not None and d.sessions[session] == (source_entry.namespace, source_entry.packed)
            d.count("session_hits" if own else "session_misses")
    return Acquired(lease_id, handle, served.reused, served.source, served.resumed, served.resumed_tokens)


def restore_done(state: ServiceState, e: done.RestoreDone) -> Step:
    d = Draft(state)
    read = []
    for entry_id in e.read:
        unpin(d, entry_id)
        if entry_id in d.entries:
            read.append(d.entries[entry_id])
    if read:
        read_bytes = sum(block.file_bytes for block in read)
        d.count("bytes_read", read_bytes)
        read_measured(d, read_bytes, e.seconds)
    waiting = d.acquiring.get(e.handle)
    if waiting is None:
        d.out.append(fx.DropPublished(e.handle))
        return d.step(None)
    for block in reversed(read):  # what was read was used: a chain's last block first
        touch(d, d.entries[block.id], disk=True)
    if waiting.lookup is not None:
        d.count("restores")
        return d.step(_looked_up(d, e.handle, waiting.tokens, Source.DISK))
    if waiting.lease is None:  # an object read from disk
        d.acquiring = without(d.acquiring, e.handle)
        d.count("object_hits")
        d.count("object_restores")
        return d.step(ObjectFound(e.handle, Source.DISK))
    d.count("restores")
    reply = finish_acquire(d, waiting.lease, e.handle, Served(waiting.tokens, Source.DISK, e.entry))
    return d.step(reply)


def restore_failed(state: ServiceState, e: done.RestoreFailed) -> Step:
    d = Draft(state)
    for entry_id in e.read:
        unpin(d, entry_id)
    io_error = e.reason is done.FailureReason.IO_ERROR
    if io_error:
        read_error(d, e.entry)
    else:
        reject(d, e.entry)
    waiting = d.acquiring.get(e.handle)
    if waiting is None:
        return d.step(None)
    d.acquiring = without(d.acquiring, e.handle)
    if waiting.lookup is not None:  # planned again without the file, as an acquire's fallback is
        namespace, prompt = waiting.lookup
        return d.step(_look_up(d, namespace, prompt, e.handle, from_disk=not io_error))
    if waiting.lease is None:  # an object whose file was rejected: a miss
        d.count("object_misses")
        return d.step(ObjectMissing())
    # After an I/O error the disk is not read again for this request: RAM or fresh serves it.
    reply = plan_acquire(d, waiting.lease, e.handle, from_disk=not io_error)
    return d.step(reply)


def checkpoint_resumed(state: ServiceState, e: done.CheckpointResumed) -> Step:
    """A checkpoint read back: the acquire waiting on it resumes, where it agrees with the request."""
    waiting = state.acquiring.get(e.handle)
    if waiting is None:
        return Step(state, (fx.DropPublished(e.handle),), None)
    lease = state.leases[waiting.lease]
    if not resume_agrees(lease, e.meta, e.tokens):  # the file says other than its name: rejected
        return _resume_rejected(state, e.meta.key, e.handle, drop_handle=True)
    d = Draft(state)
    d.count("resumes")
    d.checkpoints = d.checkpoints.set(e.meta.key, attrs.evolve(d.checkpoints[e.meta.key], touched_at=None))
    served = Served(len(lease.request.prompt), Source.CHECKPOINT, counted=True, resumed=e.meta,
                    resumed_tokens=e.tokens)
    return d.step(finish_acquire(d, waiting.lease, e.handle, served))


def resume_failed(state: ServiceState, e: done.ResumeFailed) -> Step:
    return _resume_rejected(state, e.key, e.handle, drop_handle=False)


def _resume_rejected(state: ServiceState, key: str, handle: int, drop_handle: bool) -> Step:
    """A checkpoint that could not be resumed is rejected (:func:`reject_checkpoint`); the acquire that
    waited on it plans again without it (``drop_handle``: its caches were read and are let go)."""
    waiting = state.acquiring.get(handle)
    lease_id = waiting.lease if waiting is not None else None
    d = Draft(state)
    if drop_handle:
        d.out.append(fx.DropPublished(handle))
    reject_checkpoint(d, state.leases[lease_id].checkpoint_key if lease_id is not None else key)
    if lease_id is None:
        return d.step(None)
    d.acquiring = without(d.acquiring, handle)
    return d.step(plan_acquire(d, lease_id, handle))


def peek(state: ServiceState, e: ev.PeekPrefixLen) -> Step:
    namespace = check_namespace(e.namespace)
    return Step(state, (), state.ram.index.longest(namespace, e.prompt)[0])
