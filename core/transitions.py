"""Every decision of the service: ``step(state, event) -> Step(state, effects, reply)``.

Theory of operation. Admission, reuse, keeping, eviction, spilling,
restoring, prefetching, demotion, checkpoints and flushing are all decided
here and nowhere else. A handler reads the immutable state and an event and
returns the next state, the effects an interpreter must carry out, and the
reply for the caller. Nothing here does I/O, reads a clock, draws a random
number or imports mlx; time arrives in :class:`~kvstate.core.events.Tick`,
outcomes of effects in completion events. A handler that raises leaves the
caller's state as it was (nothing was mutated), so every error is clean.

Rules kept here (DESIGN.md): admitted projected bytes never exceed the
budget; RAM entries always fit their capacity; nothing pinned (a write or read
in flight) is evicted from either tier; reuse takes the longest usable prefix
(trimmable entries serve any shorter prefix, others only their exact length,
one prompt token always left to compute), RAM before disk on ties;
namespaces never mix.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from kvstate.core import events as ev
from kvstate.core.errors import (
    CheckpointNotAllowed, ContextLimitExceeded, InvalidRequest, OverBudget, RequestAlreadyAcquired,
    RequestKeepsNoState, ServiceClosed, TokensDoNotMatchCaches,
)
from kvstate.core.prefix_index import common_prefix
from kvstate.core.replies import (
    Acquired, Admission, FlushResult, GaveBack, Kept, NotKept, NotKeptReason, ObjectFound, ObjectMissing, Source,
)
from kvstate.core.report import report
from kvstate.core.request import Request
from kvstate.core.state import (
    EMPTY, IN_RAM, OBJECTS, Entry, Lease, Move, Phase, Residence, ServiceState, CheckpointRecord, check_namespace,
    content_tag, moved, object_tokens, request_check,
)
from kvstate.effects import completions as done
from kvstate.effects import effects as fx

R = Residence


@attrs.frozen
class Step:
    """The outcome of one transition."""

    state: ServiceState
    effects: tuple[fx.Effect, ...] = ()
    reply: Any = None


# ---------------------------------------------------------------- projection


def projected_bytes(state: ServiceState, request: Request) -> int:
    """Bytes ``request``'s caches will hold at prompt + max_tokens (admission's projection)."""
    return state.config.model.bytes_for(len(request.prompt) + request.max_tokens)


def _check_context(state: ServiceState, request: Request) -> None:
    limit = state.config.model.context_limit
    wanted = len(request.prompt) + request.max_tokens
    if limit is not None and wanted > limit:
        raise ContextLimitExceeded(
            f"prompt {len(request.prompt)} + max_tokens {request.max_tokens} = {wanted} tokens exceeds "
            f"{state.config.model.name}'s context limit of {limit}; shorten the prompt or lower max_tokens")


def _check_budget(state: ServiceState, request: Request, need: int) -> None:
    budget = state.config.kv_budget_bytes
    if budget is not None and need > budget:
        raise OverBudget(
            f"request needs {_size(need)} of KV (prompt {len(request.prompt)} + max_tokens "
            f"{request.max_tokens} on {state.config.model.name}), over the whole KV budget of "
            f"{_size(budget)} on its own; lower max_tokens or raise the budget")


def _size(nbytes: int) -> str:
    """Bytes for a message: exact below a KiB, else three significant digits in binary units."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.3g} {unit}"


def _open(state: ServiceState, what: str) -> None:
    if state.phase is not Phase.OPEN:
        raise ServiceClosed(f"{what} after close(); build a new service")


def keeps(state: ServiceState, request: Request) -> bool:
    """Whether state ``request`` publishes may be kept."""
    return request.reuses_prefix and state.config.ram_capacity_bytes > 0


# ---------------------------------------------------------------- entries and tiers


def _without(mapping: Any, key: Any) -> Any:
    """``mapping`` without ``key``, if it has it."""
    return mapping.delete(key) if key in mapping else mapping


def _set_entry(state: ServiceState, entry: Entry) -> ServiceState:
    return attrs.evolve(state, entries=state.entries.set(entry.id, entry))


def _ram_candidate(state: ServiceState, protected_too: bool) -> Callable[[int], bool]:
    entries = state.entries

    def evictable(key: int) -> bool:
        entry = entries.get(key)
        return (entry is not None and entry.residence in (R.RAM, R.BOTH)
                and (protected_too or not entry.protected))
    return evictable


def _drop_ram(state: ServiceState, entry: Entry, out: list) -> ServiceState:
    """Release ``entry``'s RAM copy: gone if it had no disk copy, disk-only otherwise."""
    after = moved(entry.residence, Move.DROP_RAM)
    out.append(fx.DropEntry(entry.id))
    state = attrs.evolve(state, ram=state.ram.remove(entry.namespace, entry.tokens),
                         ram_bytes=state.ram_bytes - entry.nbytes,
                         ram_policy=state.strategy.removed(state.ram_policy, entry.id))
    if after is None:
        return attrs.evolve(state, entries=state.entries.delete(entry.id))
    return _set_entry(state, attrs.evolve(entry, residence=after, demote=False))


def _drop_disk(state: ServiceState, entry: Entry, out: list, delete: bool) -> ServiceState:
    """Forget ``entry``'s disk copy (deleting its file when ``delete``): RAM-only if it had one."""
    after = moved(entry.residence, Move.DROP_DISK if entry.residence is not R.PREFETCHING else Move.READ_FAILED)
    if delete:
        out.append(fx.DeleteFile(fx.DiskKey(entry.namespace, entry.tokens)))
    state = attrs.evolve(state, disk=state.disk.remove(entry.namespace, entry.tokens),
                         disk_bytes=state.disk_bytes - entry.file_bytes,
                         disk_policy=state.disk_strategy.removed(state.disk_policy, entry.id))
    if after is None:
        return attrs.evolve(state, entries=state.entries.delete(entry.id))
    return _set_entry(state, attrs.evolve(entry, residence=after))


def _make_ram_room(state: ServiceState, need: int, out: list) -> ServiceState | None:
    """Evict until ``need`` more bytes fit in RAM; None (and no effects) when pinned entries forbid it."""
    capacity = state.config.ram_capacity_bytes
    if need > capacity:
        return None
    local: list = []
    protected_too = False
    while state.ram_bytes + need > capacity:
        policy_state, victim = state.strategy.evict(state.ram_policy, _ram_candidate(state, protected_too))
        if victim is None:
            if protected_too:
                return None
            protected_too = True
            continue
        state = attrs.evolve(state, ram_policy=policy_state)
        state = _drop_ram(state, state.entries[victim], local)
        state = attrs.evolve(state, counters=attrs.evolve(state.counters, evictions=state.counters.evictions + 1))
    out.extend(local)
    return state


def _make_disk_room(state: ServiceState, need: int, out: list) -> ServiceState | None:
    """Evict saved state until ``need`` more bytes fit on disk; None when pinned files forbid it."""
    capacity = state.config.disk_capacity_bytes or 0
    if need > capacity:
        return None
    local: list = []
    while state.disk_bytes + need > capacity:
        entries, reading = state.entries, state.reading

        def evictable(key: int) -> bool:
            entry = entries.get(key)
            return entry is not None and entry.residence in (R.BOTH, R.DISK) and key not in reading
        policy_state, victim = state.disk_strategy.evict(state.disk_policy, evictable)
        if victim is None:
            return None
        state = attrs.evolve(state, disk_policy=policy_state)
        state = _drop_disk(state, state.entries[victim], local, delete=True)
        state = attrs.evolve(state, counters=attrs.evolve(
            state.counters, disk_evictions=state.counters.disk_evictions + 1))
    out.extend(local)
    return state


def _count(state: ServiceState, **increments: int) -> ServiceState:
    c = state.counters
    return attrs.evolve(state, counters=attrs.evolve(c, **{k: getattr(c, k) + v for k, v in increments.items()}))


def _start_spill(state: ServiceState, entry: Entry, out: list, demote: bool = False,
                 bounded: bool = True, evict: bool = True) -> ServiceState:
    """Start writing RAM-only ``entry`` to disk, making disk room (evicting saved state only when
    ``evict``); a full queue or disk drops the write."""
    if bounded and state.pending_write_bytes + entry.nbytes > state.config.write_queue_bytes:
        return _count(state, dropped_writes=1)
    if not evict and state.disk_bytes + entry.file_bytes > (state.config.disk_capacity_bytes or 0):
        return _count(state, dropped_writes=1)
    local: list = []
    room = _make_disk_room(state, entry.file_bytes, local)
    if room is None:
        return _count(state, dropped_writes=1)
    out.extend(local)
    entry = room.entries[entry.id]
    state = attrs.evolve(room, disk_bytes=room.disk_bytes + entry.file_bytes,
                         pending_writes=room.pending_writes + 1,
                         pending_write_bytes=room.pending_write_bytes + entry.nbytes)
    out.append(fx.SpillEntry(entry.id, fx.DiskKey(entry.namespace, entry.tokens), entry.nbytes, entry.trimmable,
                             entry.file_bytes))
    return _set_entry(state, attrs.evolve(entry, residence=moved(entry.residence, Move.SPILL), demote=demote))


def _touch(state: ServiceState, entry: Entry, disk: bool = False) -> ServiceState:
    state = _set_entry(state, attrs.evolve(entry, last_used=state.now))
    if disk:
        return attrs.evolve(state, disk_policy=state.disk_strategy.accessed(state.disk_policy, entry.id))
    return attrs.evolve(state, ram_policy=state.strategy.accessed(state.ram_policy, entry.id))


def _insert_ram(state: ServiceState, entry: Entry) -> ServiceState:
    """Index ``entry`` (already set in RAM residence) and tell the policy."""
    return attrs.evolve(
        state, ram=state.ram.insert(entry.namespace, entry.tokens, entry.id, entry.trimmable),
        ram_policy=state.strategy.inserted(state.ram_policy, entry.id, entry.nbytes, len(entry.tokens), entry.tag))


def _insert_disk(state: ServiceState, entry: Entry) -> ServiceState:
    return attrs.evolve(
        state, disk=state.disk.insert(entry.namespace, entry.tokens, entry.id, entry.trimmable),
        disk_policy=state.disk_strategy.inserted(state.disk_policy, entry.id, entry.file_bytes,
                                                 len(entry.tokens), entry.tag))


# ---------------------------------------------------------------- admission


def _admit(state: ServiceState, e: ev.Admit) -> Step:
    _open(state, "admit")
    request = request_check(e.request)
    _check_context(state, request)
    need = projected_bytes(state, request)
    _check_budget(state, request, need)
    lease = state.leases.get(e.lease)
    if lease is not None and lease.admitted:
        return Step(state, (), Admission.ADMITTED)
    budget = state.config.kv_budget_bytes
    if budget is not None and state.projected_bytes + need > budget:
        return Step(state, (), Admission.WAIT)
    lease = attrs.evolve(lease or Lease(request), admitted=True, admitted_bytes=need)
    return Step(attrs.evolve(state, leases=state.leases.set(e.lease, lease),
                             projected_bytes=state.projected_bytes + need), (), Admission.ADMITTED)


def _fits(state: ServiceState, e: ev.Fits) -> Step:
    request = request_check(e.request)
    limit = state.config.model.context_limit
    if state.phase is not Phase.OPEN or (limit is not None and len(request.prompt) + request.max_tokens > limit):
        return Step(state, (), False)
    budget = state.config.kv_budget_bytes
    return Step(state, (), budget is None or state.projected_bytes + projected_bytes(state, request) <= budget)


def _keeps(state: ServiceState, e: ev.Keeps) -> Step:
    return Step(state, (), keeps(state, request_check(e.request)))


# ---------------------------------------------------------------- acquire


def checkpoint_key(state: ServiceState, namespace: str, key: str) -> str:
    """A generation's checkpoint key: its namespace and the service identity are part of it."""
    return f"{namespace}\x1f{state.config.identity}\x1f{key}"


def _acquire(state: ServiceState, e: ev.Acquire) -> Step:
    _open(state, "acquire")
    request = request_check(e.request)
    namespace = check_namespace(e.namespace)
    lease = state.leases.get(e.lease) or Lease(request)
    if lease.acquired or lease.pending_handle is not None:
        raise RequestAlreadyAcquired("this request already holds its state; release it before acquiring again")
    key = None
    if request.continuation is not None and state.config.checkpoints:
        key = checkpoint_key(state, namespace, request.continuation.key)
    lease = attrs.evolve(lease, namespace=namespace, checkpoint_key=key)
    state = attrs.evolve(state, leases=state.leases.set(e.lease, lease))
    record = state.checkpoints.get(key) if key is not None else None
    if record is not None and record.durable_tokens > 0:
        return _wait_for(state, e.lease, e.handle, 0, [fx.ResumeCheckpoint(key, e.handle)])
    return _plan_acquire(state, e.lease, e.handle, [])


def _wait_for(state: ServiceState, lease_id: int, handle: int, tokens: int, out: list) -> Step:
    """Park an acquire until the read into ``handle`` (of ``tokens`` reusable tokens) completes."""
    lease = attrs.evolve(state.leases[lease_id], pending_handle=handle)
    state = attrs.evolve(state, leases=state.leases.set(lease_id, lease),
                         acquiring=state.acquiring.set(handle, (lease_id, tokens)))
    return Step(state, tuple(out), None)


def _plan_acquire(state: ServiceState, lease_id: int, handle: int, out: list) -> Step:
    """The longest usable prefix (RAM first, disk if strictly longer), else fresh caches."""
    lease = state.leases[lease_id]
    request, namespace = lease.request, lease.namespace
    if not keeps(state, request):
        out.append(fx.MakeFresh(handle))
        return _finish_acquire(state, lease_id, handle, 0, Source.FRESH, None, out, count=False)
    ram_len, ram_entry = state.ram.longest(namespace, request.prompt)
    disk_len, disk_entry = (state.disk.longest(namespace, request.prompt) if state.config.has_disk else (0, None))
    best = max(ram_len, disk_len)
    own = _session_entry(state, request, namespace)
    if own is not None and best > 0 and usable_length(own, request.prompt) >= best:
        # Affinity: on a tie the session's own state serves it (RAM copy if it has one).
        if own.residence in IN_RAM:
            ram_len, ram_entry, disk_len = best, own.id, 0
        else:
            disk_len, disk_entry, ram_len = best, own.id, 0
    if disk_len > ram_len:
        entry = state.entries[disk_entry]
        out.append(fx.RestoreEntry(entry.id, fx.DiskKey(entry.namespace, entry.tokens), disk_len, handle))
        state = attrs.evolve(state, reading=state.reading.set(entry.id, state.reading.get(entry.id, 0) + 1))
        return _wait_for(state, lease_id, handle, disk_len, out)
    if ram_len > 0:
        entry = state.entries[ram_entry]
        out.append(fx.CloneEntry(entry.id, ram_len, handle))
        return _finish_acquire(_touch(state, entry), lease_id, handle, ram_len, Source.RAM, entry.id, out)
    out.append(fx.MakeFresh(handle))
    return _finish_acquire(state, lease_id, handle, 0, Source.FRESH, None, out)


def usable_length(entry: Entry, prompt: tuple[int, ...]) -> int:
    """Prompt tokens ``entry`` can serve (the reuse rules, for one entry)."""
    limit = len(prompt) - 1
    if entry.trimmable:
        return min(common_prefix(entry.tokens, prompt, 0), limit)
    n = len(entry.tokens)
    return n if n <= limit and prompt[:n] == entry.tokens else 0


def _session_entry(state: ServiceState, request: Request, namespace: str) -> Entry | None:
    """The entry ``request``'s session last kept, if it is still held in ``namespace``."""
    if request.session_id is None:
        return None
    kept = state.sessions.get(request.session_id)
    if kept is None or kept[0] != namespace:
        return None
    entry_id = state.ram.exact(*kept)
    if entry_id is None and state.config.has_disk:
        entry_id = state.disk.exact(*kept)
    return state.entries.get(entry_id) if entry_id is not None else None


def _finish_acquire(state: ServiceState, lease_id: int, handle: int, reused: int, source: Source,
                    entry: int | None, out: list, count: bool = True, resumed: Any = None,
                    resumed_tokens: tuple[int, ...] = ()) -> Step:
    lease = state.leases[lease_id]
    state = attrs.evolve(state, leases=state.leases.set(lease_id, attrs.evolve(lease, acquired=True,
                                                                              pending_handle=None)),
                         acquiring=_without(state.acquiring, handle))
    if count:
        hit = reused > 0
        state = _count(state, hits=int(hit), misses=int(not hit), prefill_tokens_saved=reused)
        session = lease.request.session_id
        if session is not None and session in state.sessions and source is not Source.CHECKPOINT:
            source_entry = state.entries.get(entry) if entry is not None else None
            own = source_entry is not None and state.sessions[session] == (source_entry.namespace,
                                                                           source_entry.tokens)
            state = _count(state, session_hits=int(own), session_misses=int(not own))
    return Step(state, tuple(out), Acquired(lease_id, handle, reused, source, resumed, resumed_tokens))


def _restore_done(state: ServiceState, e: done.RestoreDone) -> Step:
    state = _unpin(state, e.entry)
    waiting = state.acquiring.get(e.handle)
    if waiting is None:
        return Step(state, (fx.DropPublished(e.handle),), None)
    lease_id, length = waiting
    if lease_id is None:  # an object read from disk
        entry = state.entries.get(e.entry)
        state = attrs.evolve(state, acquiring=_without(state.acquiring, e.handle))
        state = _count(_touch(state, entry, disk=True) if entry else state, object_hits=1, object_restores=1)
        return Step(state, (), ObjectFound(e.handle, Source.DISK))
    entry = state.entries.get(e.entry)
    if entry is not None:
        state = _touch(state, entry, disk=True)
    state = _count(state, restores=1)
    return _finish_acquire(state, lease_id, e.handle, length, Source.DISK, e.entry, [])


def _unpin(state: ServiceState, entry_id: int) -> ServiceState:
    count = state.reading.get(entry_id, 0)
    reading = state.reading.set(entry_id, count - 1) if count > 1 else _without(state.reading, entry_id)
    return attrs.evolve(state, reading=reading)


def _reject(state: ServiceState, entry_id: int, out: list) -> ServiceState:
    """A saved file failed to read: forget it (the interpreter moved it aside) and count it."""
    entry = state.entries.get(entry_id)
    state = _count(state, rejected_files=1)
    if entry is None or entry.residence not in (R.BOTH, R.DISK, R.PREFETCHING):
        return state
    if entry.residence is R.PREFETCHING:
        state = attrs.evolve(state, ram_bytes=state.ram_bytes - entry.nbytes)
    return _drop_disk(state, entry, out, delete=False)


def _restore_failed(state: ServiceState, e: done.RestoreFailed) -> Step:
    state = _unpin(state, e.entry)
    out: list = []
    state = _reject(state, e.entry, out)
    waiting = state.acquiring.get(e.handle)
    if waiting is None:
        return Step(state, tuple(out), None)
    lease_id = waiting[0]
    state = attrs.evolve(state, acquiring=_without(state.acquiring, e.handle))
    if lease_id is None:  # an object whose file was rejected: a miss
        return Step(_count(state, object_misses=1), tuple(out), ObjectMissing())
    return _plan_acquire(state, lease_id, e.handle, out)


def _checkpoint_resumed(state: ServiceState, e: done.CheckpointResumed) -> Step:
    waiting = state.acquiring.get(e.handle)
    if waiting is None:
        return Step(state, (fx.DropPublished(e.handle),), None)
    lease_id = waiting[0]
    request = state.leases[lease_id].request
    meta = e.meta
    consistent = (meta.prompt_tokens == len(request.prompt) and meta.generated_tokens >= 0
                  and len(e.tokens) == meta.prompt_tokens + meta.generated_tokens
                  and e.tokens[:len(request.prompt)] == request.prompt
                  and meta.key == state.leases[lease_id].checkpoint_key)
    if not consistent:
        return _resume_failed(state, done.ResumeFailed(meta.key, e.handle, done.FailureReason.INCONSISTENT),
                              drop_handle=True)
    state = _count(state, resumes=1)
    return _finish_acquire(state, lease_id, e.handle, len(request.prompt), Source.CHECKPOINT, None, [],
                           resumed=meta, resumed_tokens=e.tokens)


def _resume_failed(state: ServiceState, e: done.ResumeFailed, drop_handle: bool = False) -> Step:
    out: list = [fx.DropPublished(e.handle)] if drop_handle else []
    waiting = state.acquiring.get(e.handle)
    lease_id = waiting[0] if waiting is not None else None
    key = state.leases[lease_id].checkpoint_key if lease_id is not None else e.key
    if key in state.checkpoints:
        out.append(fx.DeleteCheckpoint(key))
        state = _forget_checkpoint(state, key)
    state = _count(state, rejected_files=1)
    if lease_id is None:
        return Step(state, tuple(out), None)
    state = attrs.evolve(state, acquiring=_without(state.acquiring, e.handle))
    return _plan_acquire(state, lease_id, e.handle, out)


# ---------------------------------------------------------------- publish and keep


def _publish(state: ServiceState, e: ev.Publish) -> Step:
    _open(state, "publish")
    request = request_check(e.request)
    namespace = check_namespace(e.namespace)
    if not keeps(state, request):
        why = ("its prefix has no identity (reuses_prefix=False)" if not request.reuses_prefix
               else "the service keeps no prefixes (RAM capacity 0)")
        raise RequestKeepsNoState(f"this service keeps no state for the request: {why}; check keeps() first")
    if e.covered != len(e.tokens):
        raise TokensDoNotMatchCaches(f"published {len(e.tokens)} tokens with caches covering {e.covered}; "
                                     f"publish exactly the tokens the caches hold")
    _check_sizes(e.nbytes, e.file_bytes)
    protected = bool(state.config.retention(namespace, e.tokens, request)) if state.config.retention else False
    return _keep(state, namespace, e.tokens, e.handle, e.nbytes, e.file_bytes, e.trimmable, request.session_id,
                 protected, notify=True)


def _check_sizes(nbytes: object, file_bytes: object) -> None:
    for what, value in (("caches", nbytes), ("their file", file_bytes)):
        if not isinstance(value, int) or value < 0:
            raise InvalidRequest(f"{what} report {value!r} bytes")


def _keep(state: ServiceState, namespace: str, tokens: tuple[int, ...], handle: int, nbytes: int,
          file_bytes: int, trimmable: bool, session: str | None, protected: bool, notify: bool) -> Step:
    """Keep the state staged under ``handle`` as an entry (making room by policy), or drop it."""
    existing = state.ram.exact(namespace, tokens)
    if existing is not None:
        state = _count(_touch(state, state.entries[existing]), duplicates=1)
        if session is not None:
            state = attrs.evolve(state, sessions=state.sessions.set(session, (namespace, tokens)))
        return Step(state, (fx.DropPublished(handle),), Kept(existing, duplicate=True))
    out: list = []
    room = _make_ram_room(state, nbytes, out)
    if room is None:
        reason = NotKeptReason.TOO_LARGE if nbytes > state.config.ram_capacity_bytes else NotKeptReason.NO_ROOM
        return Step(_count(state, not_kept=1), (fx.DropPublished(handle),), NotKept(reason))
    state = room
    saved = state.disk.exact(namespace, tokens) if state.config.has_disk else None
    if saved is not None and state.entries[saved].residence is R.PREFETCHING:
        out.append(fx.DropPublished(handle))
        return Step(_count(state, duplicates=1), tuple(out), Kept(saved, duplicate=True))
    if saved is not None:
        entry = state.entries[saved]
        entry = attrs.evolve(entry, residence=moved(entry.residence, Move.ADOPT), last_used=state.now)
        state = _insert_ram(_set_entry(state, entry), entry)
        state = attrs.evolve(state, ram_bytes=state.ram_bytes + entry.nbytes)
        out.append(fx.AdoptPublished(handle, entry.id))
    else:
        entry = Entry(state.next_entry, namespace, tokens, nbytes, trimmable, R.RAM, state.now,
                      session, protected, content_tag(namespace, tokens), file_bytes=file_bytes)
        state = attrs.evolve(_set_entry(state, entry), next_entry=entry.id + 1, ram_bytes=state.ram_bytes + nbytes)
        state = _insert_ram(state, entry)
        out.append(fx.AdoptPublished(handle, entry.id))
        if state.config.has_disk and state.config.write_behind:
            state = _start_spill(state, entry, out)
    if session is not None:
        state = attrs.evolve(state, sessions=state.sessions.set(session, (namespace, tokens)))
    if notify:
        out.append(fx.NotifyKept(fx.DiskKey(namespace, tokens)))
    return Step(_count(state, kept=1), tuple(out), Kept(entry.id))


def _spill_done(state: ServiceState, e: done.SpillDone) -> Step:
    entry = state.entries.get(e.entry)
    if entry is None or entry.residence is not R.SPILLING:
        return Step(state, (), None)
    state = attrs.evolve(state, pending_writes=state.pending_writes - 1,
                         pending_write_bytes=state.pending_write_bytes - entry.nbytes)
    written = attrs.evolve(entry, residence=moved(entry.residence, Move.WRITTEN))
    state = _count(_insert_disk(_set_entry(state, written), written), spills=1)
    out: list = []
    if entry.demote:
        state = _count(_drop_ram(state, written, out), demotions=1)
    return Step(state, tuple(out), None)


def _spill_failed(state: ServiceState, e: done.SpillFailed) -> Step:
    entry = state.entries.get(e.entry)
    if entry is None or entry.residence is not R.SPILLING:
        return Step(state, (), None)
    state = attrs.evolve(state, pending_writes=state.pending_writes - 1,
                         pending_write_bytes=state.pending_write_bytes - entry.nbytes,
                         disk_bytes=state.disk_bytes - entry.file_bytes)
    failed = attrs.evolve(entry, residence=moved(entry.residence, Move.WRITE_FAILED), demote=False)
    return Step(_count(_set_entry(state, failed), failed_writes=1), (), None)


# ---------------------------------------------------------------- tensor objects


def _object_get(state: ServiceState, e: ev.ObjectGet) -> Step:
    """An exact-key object: a copy from RAM, else a read from disk, else a miss."""
    _open(state, "objects.get")
    tokens = object_tokens(e.key)
    entry_id = state.ram.exact(OBJECTS, tokens)
    if entry_id is not None:
        entry = state.entries[entry_id]
        state = _count(_touch(state, entry), object_hits=1)
        return Step(state, (fx.CloneEntry(entry_id, len(tokens), e.handle),), ObjectFound(e.handle, Source.RAM))
    entry_id = state.disk.exact(OBJECTS, tokens) if state.config.has_disk else None
    if entry_id is not None:
        entry = state.entries[entry_id]
        state = attrs.evolve(state, reading=state.reading.set(entry_id, state.reading.get(entry_id, 0) + 1),
                             acquiring=state.acquiring.set(e.handle, (None, len(tokens))))
        return Step(state, (fx.RestoreEntry(entry_id, fx.DiskKey(OBJECTS, tokens), len(tokens), e.handle),), None)
    return Step(_count(state, object_misses=1), (), ObjectMissing())


def _object_put(state: ServiceState, e: ev.ObjectPut) -> Step:
    """Keep an object under the prefixes' RAM budget and policy, spilled like them."""
    _open(state, "objects.put")
    tokens = object_tokens(e.key)
    _check_sizes(e.nbytes, e.file_bytes)
    if state.config.ram_capacity_bytes == 0:
        return Step(_count(state, not_kept=1), (fx.DropPublished(e.handle),), NotKept(NotKeptReason.TOO_LARGE))
    return _keep(state, OBJECTS, tokens, e.handle, e.nbytes, e.file_bytes, False, None, protected=False,
                 notify=False)


# ---------------------------------------------------------------- checkpoints


def _checkpoint(state: ServiceState, e: ev.Checkpoint) -> Step:
    _open(state, "checkpoint")
    lease = state.leases.get(e.lease)
    if lease is None or lease.request.continuation is None:
        raise CheckpointNotAllowed("checkpoint() needs an acquired request with a continuation (a replayable "
                                   "generation)")
    if not state.config.checkpoints:
        raise CheckpointNotAllowed("this service keeps no generation checkpoints: build it with a disk tier "
                                   "and checkpoint_every_tokens")
    if not lease.acquired:  # an admitted lease has no checkpoint key before acquire() sets one
        raise CheckpointNotAllowed("checkpoint() before acquire(): acquire the request's state first")
    prompt = lease.request.prompt
    if e.generated_tokens < 0 or len(e.tokens) != len(prompt) + e.generated_tokens or e.covered != len(e.tokens) \
            or e.tokens[:len(prompt)] != prompt:
        raise TokensDoNotMatchCaches(
            f"checkpoint tokens ({len(e.tokens)}) must be the prompt ({len(prompt)}) plus the "
            f"{e.generated_tokens} generated tokens, and the caches must cover them (they cover {e.covered})")
    _check_sizes(e.nbytes, e.file_bytes)
    key = lease.checkpoint_key
    record = state.checkpoints.get(key) or CheckpointRecord(lease.namespace)
    if state.pending_write_bytes + e.nbytes > state.config.write_queue_bytes:
        return Step(_count(state, dropped_writes=1), (fx.DropPublished(e.handle),), False)
    out: list = []
    room = _make_disk_room(state, e.file_bytes, out)  # the new file sits beside the old until it replaces it
    if room is None:
        return Step(_count(state, dropped_writes=1), (fx.DropPublished(e.handle),), False)
    meta = checkpoint_meta(lease, e.generated_tokens, e.pending_token)
    record = attrs.evolve(record, pending=record.pending + 1, pending_bytes=record.pending_bytes + e.nbytes,
                          pending_file_bytes=record.pending_file_bytes + e.file_bytes)
    state = attrs.evolve(room, checkpoints=room.checkpoints.set(key, record),
                         pending_writes=room.pending_writes + 1,
                         pending_write_bytes=room.pending_write_bytes + e.nbytes,
                         disk_bytes=room.disk_bytes + e.file_bytes)
    out.append(fx.WriteCheckpoint(e.handle, meta, e.tokens, e.nbytes, e.file_bytes))
    return Step(state, tuple(out), True)


def checkpoint_meta(lease: Lease, generated_tokens: int, pending_token: int | None) -> fx.CheckpointMeta:
    """What the checkpoint file of acquired ``lease`` records beside its caches."""
    continuation = lease.request.continuation
    return fx.CheckpointMeta(lease.checkpoint_key, lease.namespace, len(lease.request.prompt), generated_tokens,
                             pending_token, continuation.seed, continuation.seed_was_explicit)


def _checkpoint_settled(state: ServiceState, key: str, tokens: int | None, file_bytes: int = 0) -> ServiceState:
    """A checkpoint write of ``key`` finished (``tokens`` durable in a file of ``file_bytes``, which
    replaced the one before) or failed (None)."""
    record = state.checkpoints.get(key)
    if record is None or record.pending == 0:
        return state
    share = record.pending_bytes // record.pending
    reserved = record.pending_file_bytes // record.pending
    disk_bytes = state.disk_bytes - reserved
    if tokens is not None:
        disk_bytes += file_bytes - record.file_bytes
    record = attrs.evolve(record, pending=record.pending - 1, pending_bytes=record.pending_bytes - share,
                          pending_file_bytes=record.pending_file_bytes - reserved,
                          durable_tokens=max(record.durable_tokens, tokens or 0),
                          file_bytes=file_bytes if tokens is not None else record.file_bytes)
    return attrs.evolve(state, checkpoints=state.checkpoints.set(key, record),
                        pending_writes=state.pending_writes - 1,
                        pending_write_bytes=state.pending_write_bytes - share, disk_bytes=disk_bytes)


def _forget_checkpoint(state: ServiceState, key: str) -> ServiceState:
    """Drop the record of ``key`` (its files are being deleted): its writes and bytes go with it."""
    record = state.checkpoints[key]
    return attrs.evolve(state, checkpoints=state.checkpoints.delete(key),
                        pending_writes=state.pending_writes - record.pending,
                        pending_write_bytes=state.pending_write_bytes - record.pending_bytes,
                        disk_bytes=state.disk_bytes - record.file_bytes - record.pending_file_bytes)


def _checkpoint_written(state: ServiceState, e: done.CheckpointWritten) -> Step:
    return Step(_count(_checkpoint_settled(state, e.key, e.tokens, e.file_bytes), checkpoints_written=1), (), None)


def _checkpoint_failed(state: ServiceState, e: done.CheckpointFailed) -> Step:
    return Step(_count(_checkpoint_settled(state, e.key, None), failed_writes=1), (), None)


# ---------------------------------------------------------------- release, boundary, clock


def _release(state: ServiceState, e: ev.Release) -> Step:
    lease = state.leases.get(e.lease)
    if lease is None:
        return Step(state, (), None)  # a second release is a no-op
    if not isinstance(e.completed, bool):
        raise InvalidRequest(f"completed must be True or False, got {e.completed!r}")
    state = attrs.evolve(state, leases=state.leases.delete(e.lease),
                         projected_bytes=state.projected_bytes - lease.admitted_bytes,
                         acquiring=(_without(state.acquiring, lease.pending_handle)
                                    if lease.pending_handle is not None else state.acquiring))
    out: list = []
    key = lease.checkpoint_key
    if e.completed and key is not None and key in state.checkpoints:
        out.append(fx.DeleteCheckpoint(key))
        state = _forget_checkpoint(state, key)
    return Step(state, tuple(out), None)


def _give_back(state: ServiceState, entry: Entry, out: list) -> ServiceState:
    """Release ``entry``'s RAM, spilling it first when it has no durable copy and a disk tier exists."""
    if entry.residence is R.RAM and state.config.has_disk:
        spilled = _start_spill(state, entry, out, demote=True)
        if spilled.entries[entry.id].residence is R.SPILLING:
            return spilled
        state = spilled
    return _count(_drop_ram(state, state.entries[entry.id], out), demotions=1)


def _boundary(state: ServiceState, e: ev.Boundary) -> Step:
    """Under pressure give back one entry (the policy's victim); the facade repeats while pressure lasts."""
    if not e.pressure or state.phase is not Phase.OPEN:
        return Step(state, (), GaveBack(0, 0))
    # The policy names the victim; its own bookkeeping follows the entry's fate in _give_back
    # (an entry that starts spilling stays known to the policy, pinned until its write settles).
    _, victim = state.strategy.evict(state.ram_policy, _ram_candidate(state, False))
    if victim is None:  # protected entries go last
        _, victim = state.strategy.evict(state.ram_policy, _ram_candidate(state, True))
    if victim is None:
        return Step(state, (), GaveBack(0, 0))
    entry = state.entries[victim]
    out: list = []
    state = _give_back(state, entry, out)
    return Step(state, tuple(out), GaveBack(1, entry.nbytes))


def optional_bytes(state: ServiceState) -> int:
    """Memory optional state holds, as memory pressure sees it: kept RAM entries (less those already
    being given back: their RAM copy goes once their write is durable), plus checkpoint writes queued.
    A spill in flight is the RAM entry's own memory, so it is not counted twice."""
    releasing = sum(e.nbytes for e in state.entries.values() if e.demote and e.residence is R.SPILLING)
    checkpoints = sum(record.pending_bytes for record in state.checkpoints.values())
    return state.ram_bytes - releasing + checkpoints


def _tick(state: ServiceState, e: ev.Tick) -> Step:
    if not isinstance(e.now, (int, float)):
        raise InvalidRequest(f"tick needs a number of seconds, got {e.now!r}")
    state = attrs.evolve(state, now=max(state.now, float(e.now)))
    after = state.config.demote_idle_after
    if after is None or not state.config.has_disk or state.phase is not Phase.OPEN:
        return Step(state, (), None)
    out: list = []
    for entry in list(state.entries.values()):
        if entry.last_used > state.now - after:
            continue
        current = state.entries[entry.id]
        if current.residence is R.SPILLING:
            state = _set_entry(state, attrs.evolve(current, demote=True))
        elif current.residence in (R.RAM, R.BOTH):
            state = _give_back(state, current, out)
    return Step(state, tuple(out), None)


# ---------------------------------------------------------------- prefetch and lookups


def _prefetch(state: ServiceState, e: ev.Prefetch) -> Step:
    _open(state, "prefetch")
    namespace = check_namespace(e.namespace)
    if not state.config.has_disk or state.config.ram_capacity_bytes == 0:
        return Step(state, (), False)
    disk_len, disk_entry = state.disk.longest(namespace, e.prompt)
    ram_len, _ = state.ram.longest(namespace, e.prompt)
    if disk_len <= ram_len:
        return Step(state, (), False)
    entry = state.entries[disk_entry]
    if entry.residence is not R.DISK or disk_entry in state.reading:
        return Step(state, (), False)
    out: list = []
    room = _make_ram_room(state, entry.nbytes, out)
    if room is None:
        return Step(state, (), False)
    entry = attrs.evolve(room.entries[entry.id], residence=moved(R.DISK, Move.PREFETCH))
    state = attrs.evolve(_set_entry(room, entry), ram_bytes=room.ram_bytes + entry.nbytes)
    out.append(fx.PrefetchEntry(entry.id, fx.DiskKey(entry.namespace, entry.tokens)))
    return Step(state, tuple(out), True)


def _prefetch_done(state: ServiceState, e: done.PrefetchDone) -> Step:
    entry = state.entries.get(e.entry)
    if entry is None or entry.residence is not R.PREFETCHING:
        return Step(state, (), None)
    entry = attrs.evolve(entry, residence=moved(entry.residence, Move.READ), last_used=state.now)
    return Step(_count(_insert_ram(_set_entry(state, entry), entry), prefetches=1), (), None)


def _prefetch_failed(state: ServiceState, e: done.PrefetchFailed) -> Step:
    out: list = []
    return Step(_reject(state, e.entry, out), tuple(out), None)


def _peek(state: ServiceState, e: ev.PeekPrefixLen) -> Step:
    namespace = check_namespace(e.namespace)
    return Step(state, (), state.ram.longest(namespace, e.prompt)[0])


def _close_session(state: ServiceState, e: ev.CloseSession) -> Step:
    if not isinstance(e.session_id, str):
        raise InvalidRequest(f"session id must be a string, got {e.session_id!r}")
    return Step(attrs.evolve(state, sessions=_without(state.sessions, e.session_id)), (), None)


def _report(state: ServiceState, e: ev.ReportQuery) -> Step:
    return Step(state, (), report(state))


# ---------------------------------------------------------------- flush, close, start


def _flush_result(state: ServiceState) -> FlushResult:
    ram_only = sum(1 for entry in state.entries.values() if entry.residence in (R.RAM, R.SPILLING))
    checkpoints_pending = any(r.pending for r in state.checkpoints.values())
    durable = ram_only == 0 and state.pending_writes == 0 and not checkpoints_pending
    return FlushResult(durable, state.pending_writes, state.pending_write_bytes, ram_only)


def _spill_all(state: ServiceState, out: list) -> ServiceState:
    """Write every RAM-only entry that fits beside what is saved. A flush never trades a durable file
    for another: that would undo what an earlier flush reported durable, and wear the disk for nothing."""
    for entry in list(state.entries.values()):
        current = state.entries.get(entry.id)
        if current is not None and current.residence is R.RAM:
            state = _start_spill(state, current, out, bounded=False, evict=False)
    return state


def _settle(state: ServiceState, e: ev.Settle) -> Step:
    if state.pending_writes == 0:
        return Step(state, (), _flush_result(state))
    return Step(state, (fx.Sync(),), None)


def _flush(state: ServiceState, e: ev.Flush) -> Step:
    _open(state, "flush")
    if not state.config.has_disk:
        return Step(state, (), _flush_result(state))
    out: list = []
    state = _spill_all(state, out)
    out.append(fx.Sync())
    return Step(state, tuple(out), None)


def _close(state: ServiceState, e: ev.Close) -> Step:
    if state.phase is Phase.CLOSED:
        return Step(state, (), state.close_result)
    if state.phase is Phase.CLOSING:
        return Step(state, (), None)
    state = attrs.evolve(state, phase=Phase.CLOSING)
    if not state.config.has_disk:
        return _clear(state)
    out: list = []
    state = _spill_all(state, out)
    out.append(fx.Sync())
    return Step(state, tuple(out), None)


def _clear(state: ServiceState) -> Step:
    """The end of close(): the flush's verdict stands; RAM copies and leases go, saved state stays."""
    result = _flush_result(state)
    out: list = []
    for entry in list(state.entries.values()):
        current = state.entries[entry.id]
        if current.residence in (R.RAM, R.BOTH):
            state = _drop_ram(state, current, out)
    state = attrs.evolve(state, leases=EMPTY, projected_bytes=0, sessions=EMPTY,
                         phase=Phase.CLOSED, close_result=result)
    return Step(state, tuple(out), result)


def _synced(state: ServiceState, e: done.Synced) -> Step:
    if state.phase is Phase.CLOSING:
        return _clear(state)
    return Step(state, (), _flush_result(state))


def _scanned(state: ServiceState, e: ev.Scanned) -> Step:
    """Saved state found at start becomes disk-only entries (what does not fit the disk budget is deleted)."""
    out: list = []
    capacity = state.config.disk_capacity_bytes
    if capacity is None:
        return Step(state, (), None)
    # Checkpoints first: they hold generations in progress. What does not fit the budget is deleted.
    for saved in e.checkpoints:
        if saved.meta.key in state.checkpoints:
            continue
        if state.disk_bytes + saved.file_bytes > capacity:
            out.append(fx.DeleteCheckpoint(saved.meta.key))
            continue
        record = CheckpointRecord(saved.meta.namespace, durable_tokens=saved.tokens, file_bytes=saved.file_bytes)
        state = attrs.evolve(state, checkpoints=state.checkpoints.set(saved.meta.key, record),
                             disk_bytes=state.disk_bytes + saved.file_bytes)
    for record in e.records:
        namespace = record.namespace if record.namespace == OBJECTS else check_namespace(record.namespace)
        if state.disk.exact(namespace, record.tokens) is not None:
            continue
        if state.disk_bytes + record.file_bytes > capacity:
            out.append(fx.DeleteFile(fx.DiskKey(namespace, record.tokens)))
            continue
        entry = Entry(state.next_entry, namespace, record.tokens, record.nbytes, record.trimmable, R.DISK,
                      state.now, None, False, content_tag(namespace, record.tokens), file_bytes=record.file_bytes)
        state = attrs.evolve(_set_entry(state, entry), next_entry=entry.id + 1,
                             disk_bytes=state.disk_bytes + entry.file_bytes)
        state = _insert_disk(state, entry)
    state = _count(state, rejected_files=e.rejected)
    return Step(state, tuple(out), None)


_HANDLERS: dict[type, Callable[[ServiceState, Any], Step]] = {
    ev.Admit: _admit,
    ev.Fits: _fits,
    ev.Acquire: _acquire,
    ev.Keeps: _keeps,
    ev.Publish: _publish,
    ev.Checkpoint: _checkpoint,
    ev.Release: _release,
    ev.Boundary: _boundary,
    ev.Tick: _tick,
    ev.Prefetch: _prefetch,
    ev.PeekPrefixLen: _peek,
    ev.CloseSession: _close_session,
    ev.ReportQuery: _report,
    ev.ObjectGet: _object_get,
    ev.ObjectPut: _object_put,
    ev.Flush: _flush,
    ev.Settle: _settle,
    ev.Close: _close,
    ev.Scanned: _scanned,
    done.SpillDone: _spill_done,
    done.SpillFailed: _spill_failed,
    done.RestoreDone: _restore_done,
    done.RestoreFailed: _restore_failed,
    done.PrefetchDone: _prefetch_done,
    done.PrefetchFailed: _prefetch_failed,
    done.CheckpointWritten: _checkpoint_written,
    done.CheckpointFailed: _checkpoint_failed,
    done.CheckpointResumed: _checkpoint_resumed,
    done.ResumeFailed: _resume_failed,
    done.Synced: _synced,
}


class UnknownEvent(TypeError):
    """``step`` was given something that is not an event or completion it knows."""


def step(state: ServiceState, event: object) -> Step:
    """The one transition: ``state`` and ``event`` in, next state, effects and reply out."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise UnknownEvent(f"no transition for {type(event).__name__}: {event!r}")
    return handler(state, event)
