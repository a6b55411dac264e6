"""Generation checkpoints: resumable points of replayable generations, written to disk and resumed.

A checkpoint write is queued like a spill (the write queue bounds it) and its
file is charged to the disk tier from the start; a newer file replaces the
older one under the same key, so both are charged while the new one is written.
A resume must agree with the request (prompt, counts, key), or the checkpoint
is deleted and the acquire falls back to reuse. Everything about checkpoints is
decided here: their key, whether an acquire resumes, the meta a file records,
the records a scan finds, and their deletion when a generation completes; the
acquire that waits on a resume (:mod:`~kvstate.core.reuse`) asks these.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from kvstate.core import events as ev
from kvstate.core.checks import check_sizes, ensure_open
from kvstate.core.draft import Draft, Step
from kvstate.core.errors import CheckpointNotAllowed, InvalidRequest, TokensDoNotMatchCaches
from kvstate.core.request import Request
from kvstate.core.state import CheckpointRecord, Lease, ServiceState, check_namespace
from kvstate.core.tiers import make_disk_room
from kvstate.effects import completions as done
from kvstate.effects import effects as fx


def checkpoint_key(state: ServiceState | Draft, namespace: str, key: str) -> str:
    """A generation's checkpoint key: its namespace and the service identity are part of it."""
    return f"{namespace}\x1f{state.config.identity}\x1f{key}"


def resume_key(state: ServiceState | Draft, request: Request, namespace: str) -> str | None:
    """The checkpoint key an acquire of ``request`` resumes from, where the service keeps checkpoints
    and the request is a replayable generation; else None."""
    if request.continuation is None or not state.config.checkpoints:
        return None
    return checkpoint_key(state, namespace, request.continuation.key)


def resumable(state: ServiceState | Draft, key: str | None) -> bool:
    """Whether a durable checkpoint of ``key`` is there to resume."""
    record = state.checkpoints.get(key) if key is not None else None
    return record is not None and record.durable_tokens > 0


def resume_agrees(lease: Lease, meta: fx.CheckpointMeta, tokens: tuple[int, ...]) -> bool:
    """Whether a checkpoint read back agrees with the request resuming it (prompt, counts, key)."""
    request = lease.request
    return (meta.prompt_tokens == len(request.prompt) and meta.generated_tokens >= 0
            and len(tokens) == meta.prompt_tokens + meta.generated_tokens
            and tokens[:len(request.prompt)] == request.prompt and meta.key == lease.checkpoint_key)


def reject_checkpoint(d: Draft, key: str) -> None:
    """A checkpoint that could not be resumed: its files are deleted, it is forgotten and counted."""
    if key in d.checkpoints:
        d.out.append(fx.DeleteCheckpoint(key))
        forget_checkpoint(d, key)
    d.count("rejected_files")


def forget_completed(d: Draft, lease: Lease, completed: bool) -> None:
    """A released generation that completed leaves no checkpoint: its files are deleted."""
    key = lease.checkpoint_key
    if completed and key is not None and key in d.checkpoints:
        d.out.append(fx.DeleteCheckpoint(key))
        forget_checkpoint(d, key)


def found_at_scan(d: Draft, saved: Iterable[done.SavedCheckpoint], capacity: int) -> tuple[int, int]:
    """Checkpoints a scan found, the most recent first, become records while the disk budget holds them
    (they hold generations in progress, so they are placed before prefixes); the rest are deleted and
    counted. The number deleted and their bytes."""
    deleted = deleted_bytes = 0
    for found in sorted(saved, key=lambda c: c.used_at, reverse=True):
        if found.meta.key in d.checkpoints:
            continue
        if d.disk.bytes + found.file_bytes > capacity:
            d.out.append(fx.DeleteCheckpoint(found.meta.key))
            d.count("disk_evictions")
            deleted, deleted_bytes = deleted + 1, deleted_bytes + found.file_bytes
            continue
        d.checkpoints = d.checkpoints.set(found.meta.key, CheckpointRecord(
            found.meta.namespace, durable_tokens=found.tokens, file_bytes=found.file_bytes, note=found.meta.note))
        d.disk.bytes += found.file_bytes
    return deleted, deleted_bytes


def plan_checkpoint(state: ServiceState, e: ev.PlanCheckpoint) -> Step:
    """The meta a checkpoint of acquired lease ``e.lease`` would record (for the interpreter to measure
    its file before the checkpoint is offered), or None where the core would refuse the checkpoint."""
    lease = state.leases.get(e.lease)
    if lease is None or lease.checkpoint_key is None or not isinstance(e.generated_tokens, int):
        return Step(state, (), None)
    return Step(state, (), checkpoint_meta(lease, e.generated_tokens, e.pending_token, e.note))


def checkpoint_meta(lease: Lease, generated_tokens: int, pending_token: int | None, note: str = ""
                    ) -> fx.CheckpointMeta:
    """What the checkpoint file of acquired ``lease`` records beside its caches."""
    continuation = lease.request.continuation
    return fx.CheckpointMeta(lease.checkpoint_key, lease.namespace, len(lease.request.prompt), generated_tokens,
                             pending_token, continuation.seed, continuation.seed_was_explicit, note)


def expire_untouched(d: Draft) -> None:
    """Checkpoints of generations not running, that nothing wrote or resumed for ``checkpoint_keep_s``
    seconds, are deleted and counted (at a clock tick): a client that never retried leaves no file for
    ever. A write still in flight keeps its checkpoint until it settles."""
    keep = d.config.checkpoint_keep_s
    if keep is None or not d.checkpoints:
        return
    running = {lease.checkpoint_key for lease in d.leases.values() if lease.checkpoint_key is not None}
    for key, record in list(d.checkpoints.items()):
        if record.touched_at is None:  # touched since the last tick: dated now
            d.checkpoints = d.checkpoints.set(key, attrs.evolve(record, touched_at=d.now))
        elif key not in running and record.pending == 0 and d.now - record.touched_at >= keep:
            d.out.append(fx.DeleteCheckpoint(key))
            forget_checkpoint(d, key)
            d.count("checkpoints_expired")


def kept_note(state: ServiceState, e: ev.CheckpointNote) -> Step:
    """The note of the checkpoint kept under ``e.key`` in ``e.namespace``, or None."""
    record = state.checkpoints.get(checkpoint_key(state, check_namespace(e.namespace), e.key))
    return Step(state, (), record.note if record is not None else None)


def checkpoint(state: ServiceState, e: ev.Checkpoint) -> Step:
    ensure_open(state, "checkpoint")
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
    check_sizes(e.nbytes, e.file_bytes)
    if not isinstance(e.note, str):
        raise InvalidRequest(f"a checkpoint's note must be a string, got {type(e.note).__name__}")
    d = Draft(state)
    # The new file sits beside the old until it replaces it.
    if d.writes.bytes + e.nbytes > d.config.write_queue_bytes or not make_disk_room(d, e.file_bytes):
        d = Draft(state)
        d.count("dropped_writes")
        d.out.append(fx.DropPublished(e.handle))
        return d.step(False)
    key = lease.checkpoint_key
    record = state.checkpoints.get(key) or CheckpointRecord(lease.namespace)
    d.checkpoints = d.checkpoints.set(key, attrs.evolve(
        record, pending=record.pending + 1, pending_bytes=record.pending_bytes + e.nbytes,
        pending_file_bytes=record.pending_file_bytes + e.file_bytes, note=e.note, touched_at=None))
    d.writes_add(1, e.nbytes)
    d.disk.bytes += e.file_bytes
    meta = checkpoint_meta(lease, e.generated_tokens, e.pending_token, e.note)
    d.out.append(fx.WriteCheckpoint(e.handle, meta, e.tokens, e.nbytes, e.file_bytes))
    return d.step(True)


def _settled(d: Draft, key: str, written: tuple[int, int] | None) -> None:
    """A checkpoint write of ``key`` finished (``written``: its tokens durable in a file of that many
    bytes, which replaced the one before) or failed (None)."""
    record = d.checkpoints.get(key)
    if record is None or record.pending == 0:
        return
    share = record.pending_bytes // record.pending
    reserved = record.pending_file_bytes // record.pending
    d.disk.bytes -= reserved
    durable_tokens, file_bytes = record.durable_tokens, record.file_bytes
    if written is not None:
        tokens, file_bytes = written
        d.disk.bytes += file_bytes - record.file_bytes
        durable_tokens = max(durable_tokens, tokens)
    d.checkpoints = d.checkpoints.set(key, attrs.evolve(
        record, pending=record.pending - 1, pending_bytes=record.pending_bytes - share,
        pending_file_bytes=record.pending_file_bytes - reserved, durable_tokens=durable_tokens,
        file_bytes=file_bytes))
    d.writes_add(-1, -share)


def forget_checkpoint(d: Draft, key: str) -> None:
    """Drop the record of ``key`` (its files are being deleted): its writes and bytes go with it."""
    record = d.checkpoints[key]
    d.checkpoints = d.checkpoints.delete(key)
    d.writes_add(-record.pending, -record.pending_bytes)
    d.disk.bytes -= record.file_bytes + record.pending_file_bytes


def checkpoint_written(state: ServiceState, e: done.CheckpointWritten) -> Step:
    d = Draft(state)
    _settled(d, e.key, (e.tokens, e.file_bytes))
    d.count("checkpoints_written")
    d.count("bytes_written", e.file_bytes)
    return d.step(None)


def checkpoint_failed(state: ServiceState, e: done.CheckpointFailed) -> Step:
    d = Draft(state)
    _settled(d, e.key, None)
    d.count("failed_writes")
    return d.step(None)
