"""The service's own lifecycle: the scan at start, flush, close, and the clock and boundaries.

A flush writes every RAM-only entry that fits beside what is saved and answers
once the writes in flight settle (a ``Sync``); close flushes, then drops every
RAM copy and lease. The scan at start turns what saved state holds into
disk-only entries and checkpoint records; what does not fit the disk budget is
evicted by the disk's policy in the order the files were last used, and counted.
"""

from __future__ import annotations

from kvstate.core import block_events, events as ev
from kvstate.core.blocks import block_key, block_tag, namespace_key
from kvstate.core.checkpoints import expire_untouched, found_at_scan
from kvstate.core.checks import ensure_open, non_negative_int
from kvstate.core.draft import Draft, Step
from kvstate.core.errors import InvalidRequest
from kvstate.core.pins import expire
from kvstate.core.replies import FlushResult, HeldBlocks, HeldEntry, RamHeld, ScanResult
from kvstate.core.requests import decide_publish
from kvstate.core.report import report
from kvstate.core.state import (
    EMPTY, IN_RAM, OBJECTS, Entry, Phase, Residence, ServiceState, check_namespace, content_tag,
)
from kvstate.core.tiers import (
    add_entry, boundary as give_back_one, drop_ram, insert_disk, make_disk_room, offer_what_the_remote_lacks,
    over_limits, ram_prefixes, start_spill, tick as clock_tick,
)
from kvstate.core.tokens import packed
from kvstate.effects import completions as done
from kvstate.effects import effects as fx

R = Residence


def enter_saved_blocks(d: Draft, saved: tuple[done.SavedBlock, ...]) -> int:
    """Saved blocks (a scan's, or fetched from the shared tier) enter the disk tier in the order they
    were last used, each after the block it extends (entered with it, or already held); a block whose
    parent is not held (or went to make room) serves nothing and is deleted, as is one whose name does
    not hash to its key. The bytes found."""
    waiting: dict[tuple[str, bytes], list[done.SavedBlock]] = {}
    entered: dict[tuple[str, bytes], int] = {}
    found = 0

    def enter(block: done.SavedBlock, parent: Entry | None) -> None:
        nonlocal found
        name = block.name
        found += block.file_bytes
        snapshot = isinstance(name, fx.SnapshotName)
        path = packed(name.tokens) if snapshot else (parent.packed if parent is not None else b"") + packed(name.tokens)
        if (not snapshot and (name.namespace, name.key) in d.blocks) or (
                snapshot and d.disk.index.exact(name.namespace, path) is not None):
            return
        tag = content_tag(name.namespace, path) if snapshot else block_tag(name.key)
        d.disk.policy = d.disk.strategy.arriving(d.disk.policy, tag)
        if not make_disk_room(d, block.file_bytes):
            d.out.append(fx.DeleteFile(name))
            d.count("disk_evictions")
            return
        entry = Entry(d.new_entry_id(), name.namespace, path, block.nbytes, not snapshot and block.trimmable, R.DISK,
                      d.now, None, False, tag, file_bytes=block.file_bytes,
                      parent=parent.id if parent is not None else None,
                      start=len(name.tokens) if snapshot else name.start, block=None if snapshot else name.key)
        add_entry(d, entry)
        d.disk.bytes += entry.file_bytes
        insert_disk(d, entry)
        if snapshot:
            return
        entered[name.namespace, name.key] = entry.id
        for child in waiting.pop((name.namespace, name.key), ()):
            parent_now = d.entries.get(entry.id)
            if parent_now is not None and _extends(child.name, parent_now):
                enter(child, parent_now)
            else:
                orphan(child)

    def orphan(block: done.SavedBlock) -> None:
        nonlocal found
        found += block.file_bytes
        d.out.append(fx.DeleteFile(block.name))
        d.count("disk_evictions")

    for block in sorted(saved, key=lambda b: b.used_at):
        name = block.name
        check_namespace(name.namespace)
        snapshot = isinstance(name, fx.SnapshotName)
        first = not snapshot and name.parent == namespace_key(name.namespace)
        parent_id = entered.get((name.namespace, name.parent)) or d.blocks.get((name.namespace, name.parent))
        parent = d.entries.get(parent_id) if not first and parent_id is not None else None
        if not snapshot and (block_key(name.parent, packed(name.tokens)) != name.key or (first and name.start != 0)):
            orphan(block)
        elif first or parent is not None:
            if parent is None or _extends(name, parent):
                enter(block, parent)
            else:
                orphan(block)
        elif (name.namespace, name.parent) in entered:  # entered, then evicted to make room
            orphan(block)
        else:
            waiting.setdefault((name.namespace, name.parent), []).append(block)
    for children in waiting.values():
        for block in children:
            orphan(block)
    return found


def _extends(name: fx.BlockName | fx.SnapshotName, parent: Entry) -> bool:
    """Whether the saved block or snapshot ``name`` follows block ``parent``: a block starts where it
    ends; a snapshot is the state at its end, after its tokens."""
    if isinstance(name, fx.SnapshotName):
        return len(name.tokens) == parent.length and packed(name.tokens[:parent.length]) == parent.packed
    return name.start == parent.length


def flush_result(state: ServiceState | Draft) -> FlushResult:
    ram_only = sum(1 for entry in state.entries.values() if entry.residence in (R.RAM, R.SPILLING))
    checkpoints_pending = any(r.pending for r in state.checkpoints.values())
    durable = ram_only == 0 and state.writes.count == 0 and not checkpoints_pending
    return FlushResult(durable, state.writes.count, state.writes.bytes, ram_only)


def _spill_all(d: Draft) -> None:
    """Write every RAM-only entry that fits beside what is saved. A flush never trades a durable file
    for another: that would undo what an earlier flush reported durable, and wear the disk for nothing."""
    for entry in list(d.entries.values()):
        current = d.entries.get(entry.id)
        if current is not None and current.residence is R.RAM:
            start_spill(d, current, bounded=False, evict=False)


def flush(state: ServiceState, e: ev.Flush) -> Step:
    ensure_open(state, "flush")
    if not state.config.has_disk:
        return Step(state, (), flush_result(state))
    d = Draft(state)
    _spill_all(d)
    offer_what_the_remote_lacks(d)
    d.out.append(fx.Sync())
    return d.step(None)


def close(state: ServiceState, e: ev.Close) -> Step:
    if state.phase is Phase.CLOSED:
        return Step(state, (), state.close_result)
    if state.phase is Phase.CLOSING:
        return Step(state, (), None)
    d = Draft(state)
    d.phase = Phase.CLOSING
    if not state.config.has_disk:
        return _clear(d)
    _spill_all(d)
    offer_what_the_remote_lacks(d)
    d.out.append(fx.Sync())
    return d.step(None)


def _clear(d: Draft) -> Step:
    """The end of close(): the flush's verdict stands; RAM copies and leases go, saved state stays."""
    result = flush_result(d)
    for entry in list(d.entries.values()):
        current = d.entries.get(entry.id)
        if current is not None and current.residence in (R.RAM, R.BOTH):
            drop_ram(d, current)
    d.leases, d.projected_bytes, d.measured_bytes, d.sessions = EMPTY, 0, 0, EMPTY
    d.phase, d.close_result, d.deferred = Phase.CLOSED, result, None
    return d.step(result)


def synced(state: ServiceState, e: done.Synced) -> Step:
    """The writes in flight settled: close goes on, a publish waiting on them is decided, a flush answers
    (memory pressure's wait answers nothing: the boundary that asked for it already has)."""
    if e.pressure:
        return Step(state, (), None)
    if state.phase is Phase.CLOSING:
        return _clear(Draft(state))
    if state.deferred is not None:
        d = Draft(state)
        d.deferred = None
        return decide_publish(d.build(), state.deferred, may_wait=False)
    return Step(state, (), flush_result(state))


def boundary(state: ServiceState, e: ev.Boundary) -> Step:
    """One entry given back (or a wait for the spills giving entries back) while the caller's pressure
    or the boundary's limits say kept state holds too much; nothing otherwise."""
    max_bytes = None if e.max_bytes is None else non_negative_int(e.max_bytes, "a boundary's max_bytes")
    max_entries = None if e.max_entries is None else non_negative_int(e.max_entries, "a boundary's max_entries")
    d = Draft(state)
    reply = give_back_one(d, e.pressure or over_limits(state, max_bytes, max_entries))
    return d.step(reply)


def tick(state: ServiceState, e: ev.Tick) -> Step:
    if not isinstance(e.now, (int, float)):
        raise InvalidRequest(f"tick needs a number of seconds, got {e.now!r}")
    d = Draft(state)
    clock_tick(d, e.now)
    expire(d)
    expire_untouched(d)
    return d.step(None)


def ram_query(state: ServiceState, e: ev.RamQuery) -> Step:
    each = ()
    if e.each:
        each = tuple(HeldEntry(entry.namespace, entry.tokens, entry.nbytes) for entry in state.entries.values()
                     if entry.residence in IN_RAM and entry.namespace != OBJECTS)
    return Step(state, (), RamHeld(ram_prefixes(state), state.ram.bytes, each))


def held_blocks_query(state: ServiceState, e: ev.HeldBlocksQuery) -> Step:
    return Step(state, (), HeldBlocks(block_events.held(state)))


def report_query(state: ServiceState, e: ev.ReportQuery) -> Step:
    return Step(state, (), report(state, e.rejected_held_files, e.rejected_held_bytes))


def scanned(state: ServiceState, e: done.Scanned) -> Step:
    """Saved state found at start becomes disk-only entries and checkpoint records.

    Checkpoints are kept first (they hold generations in progress), the most recent first. Prefixes
    enter the disk tier in the order they were last used (each file's own time), so its policy sees
    them as they were used; where the budget cannot hold them all, the policy's victims make room,
    as for any write: with LRU the least recently used files go. Every file deleted is counted
    (``disk_evictions``) and the reply says what was kept and deleted, with bytes.
    """
    capacity = state.config.disk_capacity_bytes
    if capacity is None:
        return Step(state, (), ScanResult(rejected=e.rejected))
    d = Draft(state)
    deleted, deleted_bytes = found_at_scan(d, e.checkpoints, capacity)
    checkpoint_bytes = d.disk.bytes
    found_bytes = 0
    for record in sorted(e.records, key=lambda r: r.used_at):
        namespace = record.namespace if record.namespace == OBJECTS else check_namespace(record.namespace)
        if d.disk.index.exact(namespace, record.tokens) is not None:
            continue
        found_bytes += record.file_bytes
        data = packed(record.tokens)
        tag = content_tag(namespace, data)
        d.disk.policy = d.disk.strategy.arriving(d.disk.policy, tag)
        if not make_disk_room(d, record.file_bytes):  # larger than the whole budget: nothing makes room
            d.out.append(fx.DeleteFile(fx.DiskKey(namespace, record.tokens)))
            d.count("disk_evictions")
            continue
        entry = Entry(d.new_entry_id(), namespace, data, record.nbytes, record.trimmable, R.DISK, d.now, None,
                      False, tag, file_bytes=record.file_bytes)
        d.set_entry(entry)
        d.disk.bytes += entry.file_bytes
        insert_disk(d, entry)
    found_bytes += enter_saved_blocks(d, e.blocks)
    evicted = [effect for effect in d.out if isinstance(effect, fx.DeleteFile)]
    deleted += len(evicted)
    deleted_bytes += checkpoint_bytes + found_bytes - d.disk.bytes
    d.count("rejected_files", e.rejected)
    kept = len(d.checkpoints) + sum(1 for entry in d.entries.values() if entry.residence is R.DISK)
    result = ScanResult(kept, d.disk.bytes, deleted, deleted_bytes, e.rejected, capacity)
    return d.step(result)
