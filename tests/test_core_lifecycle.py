"""The service's own lifecycle: the scan at start, flush, close, and what RAM holds (``core/lifecycle.py``). Each
scenario drives ``step`` by hand (``tests/core_driver.py``) and checks the exact counters, effects, replies
and pins that follow."""

import pytest

from kvstate.core import events as ev
from kvstate.core.replies import FlushResult, HeldEntry, Pending, RamHeld, ScanResult
from kvstate.core.request import Continuation, Request
from kvstate.core.policies import POLICIES
from kvstate.core.state import OBJECTS
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import Core, R, checkpointing, tiered, on_disk_only


def test_ram_query_answers_entries_and_bytes_and_each_entry_where_asked():
    core = tiered()
    core.keep((1, 2, 3), namespace="a")
    core.keep((7, 8), nbytes=5, namespace="b")
    assert core(ev.RamQuery()) == RamHeld(2, 15)
    assert set(core(ev.RamQuery(each=True)).each) == {HeldEntry("a", (1, 2, 3), 10), HeldEntry("b", (7, 8), 5)}
    core(ev.ObjectPut("img", 90, 4, 4))                              # an object in RAM: not a prefix
    on_disk_only(core, (20, 21, 22))                                 # a prefix on disk only: not in RAM
    assert {held.tokens for held in core(ev.RamQuery(each=True)).each} == {(1, 2, 3), (7, 8)}


def test_a_scan_without_a_disk_tier_keeps_and_deletes_nothing_and_counts_what_it_rejected():
    core = Core()
    result = core(done.Scanned((done.SavedRecord("n", (1, 2), 20, True, 20, used_at=2.0),), rejected=3))
    assert (result.kept, result.kept_bytes, result.deleted, result.deleted_bytes) == (0, 0, 0, 0)
    assert result.rejected == 3 and core.effects == () and not core.state.entries


def test_a_scan_finds_objects_and_prefixes_and_deletes_what_does_not_fit():
    core = tiered(disk_capacity_bytes=30)
    records = (done.SavedRecord(OBJECTS, tuple(b"w"), 10, False, 10, used_at=3.0),
               done.SavedRecord("n", (1, 2), 20, True, 20, used_at=2.0),
               done.SavedRecord("n", (3, 4), 1, True, 1, used_at=1.0))
    result = core(done.Scanned(records))
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (3, 4)))]  # the least recently used
    assert core.state.disk.bytes == 30 and len(core.state.entries) == 2
    assert result == ScanResult(kept=2, kept_bytes=30, deleted=1, deleted_bytes=1, rejected=0, capacity_bytes=30)
    assert core.counts()["disk_evictions"] == 1
    assert core(ev.ObjectGet("w", 5)) == Pending(5) and core.of(fx.RestoreEntry)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_scan_over_a_smaller_disk_budget_keeps_the_most_recently_used_files_and_counts_every_deletion(policy):
    # Files listed in name order (a hash: any order), each used at its own time: the newest that fit stay.
    used_at = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 0.0]
    records = tuple(done.SavedRecord("n", (i, i + 1), 10, True, 10, used_at=t) for i, t in enumerate(used_at))
    core = tiered(disk_capacity_bytes=35, policy=policy)
    result = core(done.Scanned(records, rejected=2))
    newest = sorted(range(10), key=lambda i: used_at[i])[-3:]
    kept = {core.state.entries[e].tokens for e in core.state.entries}
    assert kept == {(i, i + 1) for i in newest}
    deleted = {effect.key.tokens for effect in core.of(fx.DeleteFile)}
    assert deleted == {(i, i + 1) for i in range(10)} - kept
    assert core.counts()["disk_evictions"] == 7 and core.counts()["rejected_files"] == 2
    assert result == ScanResult(kept=3, kept_bytes=30, deleted=7, deleted_bytes=70, rejected=2, capacity_bytes=35)


def test_a_scan_deletes_a_file_larger_than_the_whole_disk_budget_and_counts_it():
    core = tiered(disk_capacity_bytes=15)
    result = core(done.Scanned((done.SavedRecord("n", (1, 2), 10, True, 10, used_at=1.0),
                                done.SavedRecord("n", (3, 4), 20, True, 20, used_at=2.0))))
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (3, 4)))]
    assert result.deleted == 1 and result.deleted_bytes == 20 and result.kept == 1
    assert core.counts()["disk_evictions"] == 1


def test_a_scan_keeps_the_newest_checkpoints_that_exactly_fill_the_disk_and_deletes_the_next():
    core = tiered(disk_capacity_bytes=60)
    metas = [fx.CheckpointMeta(f"n\x1f\x1fk{i}", "n", 2, 1, None, i, False) for i in range(3)]
    result = core(done.Scanned(checkpoints=tuple(done.SavedCheckpoint(meta, 3, 30, used_at=float(i))
                                                 for i, meta in enumerate(metas))))
    assert set(core.state.checkpoints) == {metas[1].key, metas[2].key} and core.state.disk.bytes == 60
    assert core.effects == (fx.DeleteCheckpoint(metas[0].key),)
    assert result.deleted == 1 and result.deleted_bytes == 30 and core.counts()["disk_evictions"] == 1


def test_a_scan_that_found_nothing_rejected_nothing():
    core = tiered()
    core(done.Scanned())
    assert core.counts() == {}


def test_saved_entries_found_by_a_scan_are_not_protected():
    core = tiered(ram_capacity_bytes=20, retention=lambda namespace, tokens, request: True)
    core(done.Scanned((done.SavedRecord("n", (1, 2, 3), 10, True, 10),)))
    found = next(iter(core.state.entries))
    kept = core.keep((5, 6, 7), nbytes=10).entry   # protected by the retention rule
    core.settle_writes()
    core(ev.Prefetch((1, 2, 3, 4), "n"))
    core(done.PrefetchDone(found))                 # now the most recently used
    core.keep((8, 9), nbytes=10)                   # RAM is full: the found entry, unprotected, leaves RAM first
    assert core.residence(found) is R.DISK and core.residence(kept) is R.BOTH


def test_a_checkpoint_found_by_a_scan_with_one_durable_token_is_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    key = "n\x1f\x1fk"
    meta = fx.CheckpointMeta(key, "n", 1, 0, None, 1, False)
    core(done.Scanned(checkpoints=(done.SavedCheckpoint(meta, 1, 6),)))
    _, handle, _ = core.acquire((1,), continuation=continuation)
    assert core.of(fx.ResumeCheckpoint) == [fx.ResumeCheckpoint(key, handle)]


def test_flush_writes_every_ram_only_entry_whatever_the_write_queue_holds():
    core = tiered(write_behind=False, write_queue_bytes=10)
    core.keep((1, 2), nbytes=30)
    core.keep((3, 4), nbytes=30)
    core(ev.Flush())
    assert len(core.of(fx.SpillEntry)) == 2 and core.of(fx.Sync)
    core.settle_writes()
    assert core(done.Synced()).durable


def test_a_flush_writes_an_entry_that_exactly_fills_the_disk():
    core = tiered(write_behind=False, disk_capacity_bytes=30)
    core.keep((1, 2), nbytes=30)
    core(ev.Flush())
    assert len(core.of(fx.SpillEntry)) == 1 and "dropped_writes" not in core.counts()


def test_the_disk_tier_charges_what_a_file_takes_and_ram_what_the_state_takes():
    core = tiered(disk_capacity_bytes=40)
    first = core.keep((1, 2), nbytes=10, file_bytes=18).entry     # a header of 8 bytes
    assert core.of(fx.SpillEntry) == [fx.SpillEntry(first, fx.DiskKey("n", (1, 2)), 10, True, 18)]
    assert (core.state.ram.bytes, core.state.disk.bytes, core.state.writes.bytes) == (10, 18, 10)
    core.settle_writes()
    core.keep((3, 4), nbytes=10, file_bytes=18)
    core.settle_writes()
    assert core(ev.ReportQuery()).saved_bytes == core.state.disk.bytes == 36
    core.keep((5, 6), nbytes=10, file_bytes=18)                   # 54 > 40: the oldest file goes
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (1, 2)))]
    assert core.state.disk.bytes == 36 and core.counts()["disk_evictions"] == 1
    assert core.residence(first) is R.RAM and core.state.ram.bytes == 30


def test_a_flush_never_evicts_a_durable_file_to_write_another():
    core = tiered(disk_capacity_bytes=40, write_behind=False)
    core.keep((1, 2), nbytes=10, file_bytes=20)
    core(ev.Flush())
    core.settle_writes()
    core(done.Synced())
    core.keep((3, 4), nbytes=10, file_bytes=25)                   # 20 + 25 > 40
    core(ev.Flush())
    assert core.of(fx.SpillEntry) == [] and core.of(fx.DeleteFile) == []
    assert core(done.Synced()) == FlushResult(False, 0, 0, 1)     # said so: one entry is RAM only
    assert core.counts()["dropped_writes"] == 1 and core.state.disk.bytes == 20


def test_checkpoint_files_are_charged_to_the_disk_tier_and_replace_each_other():
    core = tiered(disk_capacity_bytes=100, checkpoint_every_tokens=1)
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("g", 1))
    assert core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 30)) is True
    assert core.state.disk.bytes == 30                            # reserved while it is written
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    core(done.CheckpointWritten(key, 3, 30))
    assert core.state.disk.bytes == 30 and core(ev.ReportQuery()).checkpoint_bytes == 30
    core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 5, 35))
    assert core.state.disk.bytes == 65                            # old and new side by side
    core(done.CheckpointWritten(key, 4, 35))
    assert core.state.disk.bytes == 35                            # the new file replaced the old
    assert core(ev.Checkpoint(lease, 11, (1, 2, 3, 4, 5), 5, 3, None, 5, 70)) is False  # 35 + 70 > 100
    core(ev.Release(lease, completed=True))
    assert core.state.disk.bytes == 0 and core.of(fx.DeleteCheckpoint)


def test_a_longer_trimmable_entry_supersedes_the_shorter_ones_it_serves_in_ram():
    core = tiered()
    short = core.keep((1, 2), nbytes=10).entry
    core.settle_writes()                                          # on disk too
    exact = core.keep((1, 2, 3), nbytes=10, trimmable=False).entry  # serves only its own length
    other = core.keep((1, 2, 3, 4), nbytes=10, namespace="m").entry  # another namespace
    longer = core.keep((1, 2, 3, 4), nbytes=20).entry
    assert core.of(fx.DropEntry) == [fx.DropEntry(short)] and core.counts()["superseded"] == 1
    assert core.residence(short) is R.DISK                        # the saved copy stays
    assert {core.residence(e) for e in (exact, other, longer)} == {R.SPILLING}
    assert core(ev.Acquire(9, Request((1, 2, 9), 4), "n", 99)).reused_tokens == 2  # served by the longer


def test_a_partial_block_superseded_while_its_write_is_in_flight_goes_whether_the_write_lands_or_fails():
    """A longer chain comes to serve a partial block that is being written: its RAM copy goes once the
    write lands, and where the write fails it goes all the same (else RAM would hold its tokens twice)."""
    for outcome in ("lands", "fails"):
        core = tiered(block_tokens=2)
        short = (1, 2, 3)
        core(ev.Publish(Request(short, 1), "n", short, 998, 3, 15, True, 15, blocks=((10, 10), (5, 5))))
        partial = core.of(fx.SpillEntry)[-1].entry  # the block of token 3, written behind
        tokens = (1, 2, 3, 4)
        core(ev.Publish(Request(tokens, 1), "n", tokens, 999, 4, 20, True, 20, blocks=((10, 10), (10, 10))))
        assert core.residence(partial) is R.SPILLING and core.counts()["superseded"] == 1
        if outcome == "lands":
            core(done.SpillDone(partial))
            assert core.residence(partial) is R.DISK  # its saved copy stays, its RAM copy went
        else:
            core(done.SpillFailed(partial, done.FailureReason.IO_ERROR))
            assert core.residence(partial) is None and fx.DropEntry(partial) in core.of(fx.DropEntry)
        assert [e.tokens for e in core.state.entries.values() if e.residence in (R.RAM, R.BOTH, R.SPILLING)
                and e.start == 2] == [tokens]


def test_a_scan_enters_a_saved_snapshot_at_its_chains_end_and_deletes_one_that_is_not():
    from kvstate.core.blocks import block_names
    core = tiered(block_tokens=2)
    first, second = block_names("n", (1, 2, 3, 4), 2)
    at_end = fx.SnapshotName("n", (1, 2, 3, 4), second.key)
    short = fx.SnapshotName("n", (1, 2, 3), second.key)       # not the state after the block it names
    other = fx.SnapshotName("n", (1, 2, 9, 9), second.key)    # as long, but after other tokens
    saved = [done.SavedBlock(name, 10, 10, trimmable=False) for name in (first, second, at_end, short, other)]
    core(done.Scanned(blocks=tuple(saved)))
    snapshots = [e for e in core.state.entries.values() if e.is_snapshot]
    assert [(s.tokens, s.residence) for s in snapshots] == [((1, 2, 3, 4), R.DISK)]
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(short), fx.DeleteFile(other)]


def test_a_saved_partial_block_a_scan_found_is_deleted_once_a_longer_chain_supersedes_it():
    from kvstate.core.blocks import block_names
    core = tiered(block_tokens=2)
    full, partial = block_names("n", (1, 2, 3), 2)
    core(done.Scanned(blocks=(done.SavedBlock(full, 10, 10), done.SavedBlock(partial, 5, 5))))
    tokens = (1, 2, 3, 4)
    core(ev.Publish(Request(tokens, 1), "n", tokens, 999, 4, 20, True, 20, blocks=((10, 10), (10, 10))))
    assert fx.DeleteFile(partial) in core.of(fx.DeleteFile) and core.counts()["superseded"] == 1
