"""Generation checkpoints: resumable points of replayable generations, written to disk and resumed.

A checkpoint write is queued like a spill (the write queue bounds it) and its
file is charged to the disk tier from the start; a newer file replaces the
older one under the same key, so both are charged while the new one is written.
A resume must agree with the request (prompt, counts, key), or the checkpoint
is deleted and the acquire falls back to reuse.
"""

from __future__ import annotations

import attrs

from kvstate.core import events as ev
from kvstate.core.checks import check_sizes, ensure_open
from kvstate.core.draft import Draft, Step, without
from kvstate.core.errors import CheckpointNotAllowed, TokensDoNotMatchCaches
from kvstate.core.replies import Source
from kvstate.core.reuse import finish_acquire, plan_acquire
from kvstate.core.state import CheckpointRecord, Lease, ServiceState
from kvstate.core.tiers import make_disk_room
from kvstate.effects import completions as done
from kvstate.effects import effects as fx


def checkpoint_meta(lease: Lease, generated_tokens: int, pending_token: int | None) -> fx.CheckpointMeta:
    """What the checkpoint file of acquired ``lease`` records beside its caches."""
    continuation = lease.request.continuation
    return fx.CheckpointMeta(lease.checkpoint_key, lease.namespace, len(lease.request.prompt), generated_tokens,
                             pending_token, continuation.seed, continuation.seed_was_explicit)


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
        pending_file_bytes=record.pending_file_bytes + e.file_bytes))
    d.writes_add(1, e.nbytes)
    d.disk.bytes += e.file_bytes
    meta = checkpoint_meta(lease, e.generated_tokens, e.pending_token)
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


def checkpoint_resumed(state: ServiceState, e: done.CheckpointResumed) -> Step:
    waiting = state.acquiring.get(e.handle)
    if waiting is None:
        return Step(state, (fx.DropPublished(e.handle),), None)
    lease = state.leases[waiting.lease]
    request, meta = lease.request, e.meta
    consistent = (meta.prompt_tokens == len(request.prompt) and meta.generated_tokens >= 0
                  and len(e.tokens) == meta.prompt_tokens + meta.generated_tokens
                  and e.tokens[:len(request.prompt)] == request.prompt
                  and meta.key == lease.checkpoint_key)
    if not consistent:  # the file says other than its name: rejected, and the acquire goes on without it
        return _resume_rejected(state, meta.key, e.handle, drop_handle=True)
    d = Draft(state)
    d.count("resumes")
    reply = finish_acquire(d, waiting.lease, e.handle, len(request.prompt), Source.CHECKPOINT, None,
                           resumed=meta, resumed_tokens=e.tokens)
    return d.step(reply)


def resume_failed(state: ServiceState, e: done.ResumeFailed) -> Step:
    return _resume_rejected(state, e.key, e.handle, drop_handle=False)


def _resume_rejected(state: ServiceState, key: str, handle: int, drop_handle: bool) -> Step:
    """A checkpoint that could not be resumed is forgotten (its file deleted) and counted; the acquire
    that waited on it plans again without it (``drop_handle``: its caches were read and are let go)."""
    waiting = state.acquiring.get(handle)
    lease_id = waiting.lease if waiting is not None else None
    key = state.leases[lease_id].checkpoint_key if lease_id is not None else key
    d = Draft(state)
    if drop_handle:
        d.out.append(fx.DropPublished(handle))
    if key in d.checkpoints:
        d.out.append(fx.DeleteCheckpoint(key))
        forget_checkpoint(d, key)
    d.count("rejected_files")
    if lease_id is None:
        return d.step(None)
    d.acquiring = without(d.acquiring, handle)
    reply = plan_acquire(d, lease_id, handle)
    return d.step(reply)
