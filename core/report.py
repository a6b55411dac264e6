"""The service's report: one frozen record of what it holds and what it did."""

from __future__ import annotations

import attrs

from kvstate.core.pins import pinned_bytes
from kvstate.core.state import IN_RAM, ON_DISK, ServiceState


@attrs.frozen
class Report:
    """Counters and sizes, as ``KvCacheService.report()`` returns them."""

    #: Kept prefixes in RAM, their bytes, and the RAM capacity.
    entries: int
    bytes: int
    capacity_bytes: int
    #: Acquires that reused a prefix (RAM or disk) and those that did not.
    hits: int
    misses: int
    #: Acquires of a session that has kept state: reused its own, or not.
    session_hits: int
    session_misses: int
    #: Prompt tokens that acquires did not have to compute.
    prefill_tokens_saved: int
    #: Tensor objects (encoder outputs): gets served from RAM or disk, gets that found nothing, reads from disk.
    object_hits: int
    object_misses: int
    object_restores: int
    kept: int
    duplicates: int
    not_kept: int
    evictions: int
    #: RAM copies of trimmable prefixes dropped because a longer kept entry serves them.
    superseded: int
    demotions: int
    #: Saved prefixes and objects on disk, and the bytes their files take (0 and None capacity without
    #: a disk tier). ``disk_bytes`` is what the disk tier charges against its capacity: every saved
    #: file, checkpoints included, and the files of writes in flight.
    saved_entries: int
    saved_bytes: int
    saved_capacity_bytes: int | None
    disk_bytes: int
    spills: int
    restores: int
    #: Bytes of the files written to the disk tier (spills, checkpoints) and read back from it
    #: (restores, prefetches): the disk's wear, and what it paid back.
    bytes_written: int
    bytes_read: int
    #: Reads of saved files that hit an I/O error: the file stays (the request falls back) unless
    #: its reads fail ``MAX_READ_ERRORS`` times in a row.
    read_errors: int
    #: Disk hits passed up for a prefill, and spills not made, because reading state back is slower
    #: than prefilling it here; the paces behind that rule (None until measured).
    restores_passed_up: int
    spills_passed_up: int
    #: Spills not made because the write-rate cap (``write_bytes_per_hour``) had no room for them.
    spills_over_rate: int
    #: Chunk snapshots not kept: not worth their bytes over the snapshot before them.
    snapshots_passed_up: int
    read_bytes_per_s: float | None
    prefill_tokens_per_s: float | None
    prefetches: int
    disk_evictions: int
    rejected_files: int
    #: Rejected files kept aside for inspection (``rejected/``, bounded, outside every budget) and
    #: the bytes they take, as the interpreter counts them.
    rejected_held_files: int
    rejected_held_bytes: int
    #: Writes in flight, writes not started because the queue was full, and writes that failed.
    pending_writes: int
    pending_write_bytes: int
    dropped_writes: int
    failed_writes: int
    #: Generation checkpoints known, the bytes their durable files take, written, and resumed.
    checkpoints: int
    checkpoint_bytes: int
    checkpoints_written: int
    resumes: int
    #: Checkpoints deleted because nothing resumed them within ``checkpoint_keep_s``.
    checkpoints_expired: int
    #: Prefixes pinned, pins asked of a prefix RAM did not hold, and the RAM entries pinned now and
    #: their bytes (:mod:`~kvstate.core.pins`).
    pins: int
    pins_missed: int
    pinned_entries: int
    pinned_bytes: int
    #: Live requests, the projected bytes of the admitted ones against the budget, and what their
    #: caches were last measured holding (0 where nothing measures them).
    live_requests: int
    projected_bytes: int
    measured_bytes: int
    budget_bytes: int | None
    #: The shared tier (:mod:`~kvstate.core.remote`): fetches started, blocks read from it and their
    #: bytes, objects rejected, calls that failed, lookups passed up for a prefill, blocks written there
    #: and offers another server had written first; its measured pace (None until measured).
    remote_fetches: int = 0
    remote_blocks_read: int = 0
    remote_bytes_read: int = 0
    remote_rejected: int = 0
    remote_failures: int = 0
    remote_passed_up: int = 0
    remote_writes: int = 0
    remote_already_held: int = 0
    remote_bytes_per_s: float | None = None


def report(state: ServiceState, rejected_held_files: int, rejected_held_bytes: int) -> Report:
    """The report of ``state``, with the interpreter's count of rejected files held aside."""
    c, config = state.counters, state.config
    in_ram = ram_bytes = saved = saved_bytes = 0
    for entry in state.entries.values():
        if entry.residence in IN_RAM:
            in_ram += 1
            ram_bytes += entry.nbytes
        if entry.residence in ON_DISK:
            saved += 1
            saved_bytes += entry.file_bytes
    pinned_entries, pinned = pinned_bytes(state)
    return Report(
        entries=in_ram, bytes=ram_bytes, capacity_bytes=config.ram_capacity_bytes,
        hits=c.hits, misses=c.misses, session_hits=c.session_hits, session_misses=c.session_misses,
        prefill_tokens_saved=c.prefill_tokens_saved, object_hits=c.object_hits, object_misses=c.object_misses,
        object_restores=c.object_restores, kept=c.kept, duplicates=c.duplicates, not_kept=c.not_kept,
        evictions=c.evictions, superseded=c.superseded, demotions=c.demotions,
        saved_entries=saved, saved_bytes=saved_bytes, saved_capacity_bytes=config.disk_capacity_bytes,
        disk_bytes=state.disk.bytes,
        spills=c.spills, restores=c.restores, bytes_written=c.bytes_written, bytes_read=c.bytes_read,
        read_errors=c.read_errors, restores_passed_up=c.restores_passed_up, spills_passed_up=c.spills_passed_up,
        spills_over_rate=c.spills_over_rate, snapshots_passed_up=c.snapshots_passed_up,
        read_bytes_per_s=_per_second(state.pace.read_s_per_byte),
        prefill_tokens_per_s=_per_second(state.pace.prefill_s_per_token), prefetches=c.prefetches, disk_evictions=c.disk_evictions,
        rejected_files=c.rejected_files, rejected_held_files=rejected_held_files,
        rejected_held_bytes=rejected_held_bytes,
        pending_writes=state.writes.count, pending_write_bytes=state.writes.bytes,
        dropped_writes=c.dropped_writes, failed_writes=c.failed_writes,
        checkpoints=len(state.checkpoints), checkpoint_bytes=sum(r.file_bytes for r in state.checkpoints.values()),
        checkpoints_written=c.checkpoints_written, resumes=c.resumes, checkpoints_expired=c.checkpoints_expired,
        pins=c.pins, pins_missed=c.pins_missed, pinned_entries=pinned_entries, pinned_bytes=pinned,
        live_requests=len(state.leases), projected_bytes=state.projected_bytes,
        measured_bytes=state.measured_bytes, budget_bytes=config.kv_budget_bytes,
        remote_fetches=c.remote_fetches, remote_blocks_read=c.remote_blocks_read,
        remote_bytes_read=c.remote_bytes_read, remote_rejected=c.remote_rejected, remote_failures=c.remote_failures,
        remote_passed_up=c.remote_passed_up, remote_writes=c.remote_writes,
        remote_already_held=c.remote_already_held, remote_bytes_per_s=_per_second(state.pace.remote_s_per_byte))


def _per_second(seconds_per_unit: float | None) -> float | None:
    if seconds_per_unit is None:
        return None
    return float("inf") if seconds_per_unit == 0 else 1.0 / seconds_per_unit
