"""Keeping, RAM eviction, spills, giving RAM back under pressure or limits, and prefetch (``core/tiers.py``).
Each scenario drives ``step`` by hand (``tests/core_driver.py``) and checks the exact counters, effects,
replies and pins that follow."""

import pytest

from kvstate.core import events as ev
from kvstate.core.blocks import block_names, spans
from kvstate.core.errors import InvalidRequest
from kvstate.core.replies import GaveBack, Kept, NotKept, NotKeptReason, Pending, Source
from kvstate.core.request import Continuation, Request
from kvstate.core.state import IN_RAM
from kvstate.core.tiers import MAX_READ_ERRORS
from kvstate.core.transitions import optional_bytes
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import CORRUPT, SPEC, Core, R, on_disk_only, tiered


def test_an_entry_exactly_the_ram_capacity_is_kept_one_byte_more_is_too_large():
    core = Core()
    assert core.keep((1, 2), nbytes=100) == Kept(1)
    assert core.keep((3, 4), nbytes=101) == NotKept(NotKeptReason.TOO_LARGE)
    assert core.counts() == {"kept": 1, "not_kept": 1}


def test_a_publish_that_meets_ram_pinned_by_writes_waits_for_them_then_keeps():
    core = tiered()
    first = core.keep((1, 2), nbytes=40).entry     # its write is in flight: pinned
    before = core.state
    assert core.keep((3, 4), nbytes=100) == Pending() and core.effects == (fx.Sync(),)
    assert core.state.entries == before.entries and core.state.deferred is not None
    core(done.SpillDone(first))
    assert core(done.Synced()) == Kept(2)          # the wait is over: the write settled, room is made
    assert core.of(fx.DropEntry) == [fx.DropEntry(first)] and core.residence(first) is R.DISK
    assert core.state.deferred is None and core.counts()["evictions"] == 1


def test_a_deferred_publish_is_decided_when_the_writes_settle_never_deferred_again():
    core = tiered()
    core.keep((1, 2), nbytes=40)                   # its write is in flight: pinned
    assert core.keep((3, 4), nbytes=100) == Pending()
    assert core(done.Synced()) == NotKept(NotKeptReason.NO_ROOM)  # still pinned when told: decided now
    assert core.state.deferred is None and core.of(fx.DropPublished)


def test_an_entry_that_fits_but_meets_ram_pinned_once_writes_settled_has_no_room():
    core = tiered()
    saved = on_disk_only(core, (1, 2), nbytes=40)
    assert core(ev.Prefetch((1, 2, 3), "n")) is True  # pinned by a read, not by a write
    assert core.keep((3, 4), nbytes=100) == NotKept(NotKeptReason.NO_ROOM)
    assert core.of(fx.DropPublished) and not core.of(fx.DropEntry) and core.residence(saved) is R.PREFETCHING


def test_a_publish_of_zero_bytes_is_kept():
    core = Core()
    assert core.keep((1, 2), nbytes=0) == Kept(1)


def test_a_new_entry_is_not_a_duplicate_the_same_tokens_again_are():
    core = Core()
    first = core.keep((1, 2, 3))
    assert first == Kept(1) and first.duplicate is False
    again = core.keep((1, 2, 3))
    assert again == Kept(1, duplicate=True)
    assert core.of(fx.DropPublished) and core.counts() == {"kept": 1, "duplicates": 1}


def test_protected_entries_go_last_but_do_go():
    def protect_short(namespace, tokens, request):
        return len(tokens) < 3
    core = Core(retention=protect_short)
    protected = core.keep((1, 2), nbytes=50).entry
    plain = core.keep((5, 6, 7), nbytes=50).entry
    newer = core.keep((8, 9, 10), nbytes=50).entry  # LRU would take the protected (older) one: the plain one goes
    assert core.residence(plain) is None and core.residence(protected) is R.RAM
    core.keep((11, 12), nbytes=50)                   # protected too: the other unprotected one goes
    assert core.residence(newer) is None and core.residence(protected) is R.RAM
    core.keep((13, 14, 15), nbytes=50)               # only protected entries left: the oldest of them goes
    assert core.residence(protected) is None
    assert core.counts() == {"kept": 5, "evictions": 3}


def test_a_hit_in_ram_refreshes_the_ram_policy():
    core = Core()
    a = core.keep((1, 2, 3), nbytes=50).entry
    b = core.keep((4, 5, 6), nbytes=50).entry
    _, _, reply = core.acquire((1, 2, 3, 9))
    assert (reply.source, reply.reused_tokens) == (Source.RAM, 3)
    core.keep((7, 8, 9), nbytes=50)  # LRU: b was used longest ago
    assert core.residence(a) is R.RAM and core.residence(b) is None


def test_a_one_token_reuse_is_a_hit():
    core = Core()
    core.keep((1, 2, 3))
    _, _, reply = core.acquire((1, 9))
    assert reply.reused_tokens == 1
    assert core.counts() == {"kept": 1, "hits": 1, "prefill_tokens_saved": 1}


def test_a_spill_settles_into_both_tiers_and_is_counted_once():
    core = tiered()
    entry = core.keep((1, 2, 3), nbytes=30).entry
    assert core.of(fx.SpillEntry) == [fx.SpillEntry(entry, fx.DiskKey("n", (1, 2, 3)), 30, True, 30)]
    assert (core.state.writes.count, core.state.writes.bytes, core.state.disk.bytes) == (1, 30, 30)
    core.settle_writes()
    assert core.residence(entry) is R.BOTH
    assert (core.state.writes.count, core.state.writes.bytes, core.state.disk.bytes) == (0, 0, 30)
    assert core.counts() == {"kept": 1, "spills": 1, "bytes_written": 30}


def test_a_failed_spill_leaves_the_ram_copy_and_frees_its_disk_bytes():
    core = tiered()
    entry = core.keep((1, 2, 3), nbytes=30).entry
    core(done.SpillFailed(entry, done.FailureReason.NO_SPACE))
    assert core.residence(entry) is R.RAM
    assert (core.state.writes.count, core.state.writes.bytes, core.state.disk.bytes) == (0, 0, 0)
    assert core.counts() == {"kept": 1, "failed_writes": 1}


def test_stale_or_repeated_completions_change_nothing():
    core = tiered()
    entry = core.keep((1, 2, 3)).entry
    core.settle_writes()
    before = core.state
    for late in (done.SpillDone(entry), done.SpillFailed(entry, CORRUPT), done.SpillDone(99),
                 done.SpillFailed(99, CORRUPT), done.PrefetchDone(entry), done.PrefetchDone(99)):
        assert core(late) is None and core.effects == ()
        assert core.state == before


def test_a_stale_read_failure_is_counted_and_forgets_nothing():
    core = tiered()
    entry = core.keep((1, 2, 3)).entry
    core.settle_writes()
    core(done.RestoreFailed(99, 5, CORRUPT))          # an entry the core no longer knows
    core(done.PrefetchFailed(99, CORRUPT))
    assert core.counts()["rejected_files"] == 2 and core.residence(entry) is R.BOTH
    ram_only = core.keep((4, 5)).entry                # not on disk yet: the report is about another file
    core(done.PrefetchFailed(ram_only, CORRUPT))
    assert core.residence(ram_only) is R.SPILLING


def test_a_full_write_queue_drops_the_write_an_exact_fit_is_queued():
    core = tiered(write_queue_bytes=30)
    assert core.keep((1, 2), nbytes=30) == Kept(1)
    assert len(core.of(fx.SpillEntry)) == 1                  # exactly the queue
    core.keep((3, 4), nbytes=1)
    assert not core.of(fx.SpillEntry)                        # one byte over
    assert core.counts() == {"kept": 2, "dropped_writes": 1}


def test_an_entry_exactly_the_disk_capacity_is_written_a_disk_of_zero_takes_nothing():
    core = tiered(disk_capacity_bytes=30)
    core.keep((1, 2), nbytes=30)
    assert len(core.of(fx.SpillEntry)) == 1
    empty = tiered(disk_capacity_bytes=0)
    empty.keep((1, 2), nbytes=1)
    assert not empty.of(fx.SpillEntry) and empty.counts() == {"kept": 1, "dropped_writes": 1}


def test_disk_eviction_deletes_the_least_recently_used_file():
    core = tiered(disk_capacity_bytes=60, ram_capacity_bytes=200)
    a = core.keep((1, 2), nbytes=30).entry
    core.settle_writes()
    b = core.keep((3, 4), nbytes=30).entry
    core.settle_writes()
    core.keep((5, 6), nbytes=30)
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (1, 2)))]
    assert core.residence(a) is R.RAM and core.residence(b) is R.BOTH
    assert core.counts() == {"kept": 3, "spills": 2, "disk_evictions": 1, "bytes_written": 60}


def test_a_restore_refreshes_the_disk_policy():
    core = tiered(disk_capacity_bytes=60, ram_capacity_bytes=30)
    a = on_disk_only(core, (1, 2, 3), nbytes=30)
    b = on_disk_only(core, (4, 5, 6), nbytes=30)
    _, handle, _ = core.acquire((1, 2, 3, 9))
    core(done.RestoreDone(a, handle))
    core.keep((7, 8), nbytes=30)  # disk LRU: b was used longest ago
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (4, 5, 6)))]
    assert core.residence(a) is R.DISK and core.residence(b) is None


def test_a_file_being_read_is_never_evicted_from_disk():
    core = tiered(disk_capacity_bytes=30, ram_capacity_bytes=30)
    a = on_disk_only(core, (1, 2, 3), nbytes=30)
    _, first, _ = core.acquire((1, 2, 3, 9))
    _, second, _ = core.acquire((1, 2, 3, 8))   # a second reader of the same file
    assert core.state.reading[a] == 2
    core(done.RestoreDone(a, first))
    core.keep((7, 8), nbytes=30)                # still read by the second: the write is dropped instead
    assert core.residence(a) is R.DISK and not core.of(fx.DeleteFile)
    assert core.counts()["dropped_writes"] == 1
    core(done.RestoreDone(a, second))
    assert a not in core.state.reading
    core.keep((4, 5), nbytes=30)                # read by no one now: it goes
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (1, 2, 3)))]
    assert core.counts()["restores"] == 2


IO_ERROR = done.FailureReason.IO_ERROR


def test_an_io_error_on_a_restore_keeps_the_file_and_the_request_falls_back_to_ram():
    """An I/O error is not evidence of a bad file: the entry stays on disk, the request falls back to
    what RAM holds (not to the same file again), and the error is counted, not the file rejected."""
    core = tiered()
    a = on_disk_only(core, (1, 2, 3, 4))
    b = core.keep((1, 2), nbytes=10).entry          # a shorter prefix RAM holds
    _, handle, _ = core.acquire((1, 2, 3, 4, 9))
    reply = core(done.RestoreFailed(a, handle, IO_ERROR))
    assert (reply.source, reply.reused_tokens) == (Source.RAM, 2)
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(b, 2, handle)] and not core.of(fx.DeleteFile)
    assert core.residence(a) is R.DISK and core.state.entries[a].read_errors == 1 and a not in core.state.reading
    assert core.counts()["read_errors"] == 1 and "rejected_files" not in core.counts()


def test_a_file_whose_reads_keep_failing_is_deleted_and_a_good_read_ends_the_run():
    core = tiered()
    a = on_disk_only(core, (1, 2, 3))
    for errors in (1, 2):
        lease, handle, _ = core.acquire((1, 2, 3, 9))
        core(done.RestoreFailed(a, handle, IO_ERROR))
        core(ev.Release(lease, True))
        assert core.state.entries[a].read_errors == errors
    lease, handle, _ = core.acquire((1, 2, 3, 9))
    core(done.RestoreDone(a, handle))                 # a good read: the run is over
    core(ev.Release(lease, True))
    assert core.state.entries[a].read_errors == 0
    for _ in range(MAX_READ_ERRORS):
        lease, handle, _ = core.acquire((1, 2, 3, 9))
        reply = core(done.RestoreFailed(a, handle, IO_ERROR))
        deleted = core.of(fx.DeleteFile)
        core(ev.Release(lease, True))
    assert reply.source is Source.FRESH and a not in core.state.entries
    assert deleted == [fx.DeleteFile(fx.DiskKey("n", (1, 2, 3)))]
    assert core.counts()["read_errors"] == 2 + MAX_READ_ERRORS and core.counts()["rejected_files"] == 1
    assert core.state.disk.bytes == 0


def test_an_io_error_on_a_prefetch_leaves_the_entry_on_disk_and_ram_uncharged():
    core = tiered()
    a = on_disk_only(core, (1, 2, 3))
    ram_before = core.state.ram.bytes
    assert core(ev.Prefetch((1, 2, 3, 9), "n")) is True and core.residence(a) is R.PREFETCHING
    core(done.PrefetchFailed(a, IO_ERROR))
    assert core.residence(a) is R.DISK and core.state.ram.bytes == ram_before
    assert core(ev.Prefetch((1, 2, 3, 9), "n")) is True  # tried again later, from the same file


def test_a_prefetch_that_reads_its_file_ends_the_run_of_io_errors():
    core = tiered()
    a = on_disk_only(core, (1, 2, 3))
    core(ev.Prefetch((1, 2, 3, 9), "n"))
    core(done.PrefetchFailed(a, IO_ERROR))
    core(ev.Prefetch((1, 2, 3, 9), "n"))
    core(done.PrefetchDone(a))                       # read whole: the file is good
    assert core.state.entries[a].read_errors == 0 and core.residence(a) is R.BOTH
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 10) and core.residence(a) is R.DISK
    for _ in range(MAX_READ_ERRORS - 1):             # a new run, one short of the limit: the file stays
        core(ev.Prefetch((1, 2, 3, 9), "n"))
        core(done.PrefetchFailed(a, IO_ERROR))
    assert core.residence(a) is R.DISK and not core.of(fx.DeleteFile)


def test_an_io_error_reported_for_an_entry_the_core_forgot_is_counted_and_changes_nothing_else():
    core = tiered()
    kept = core.keep((1, 2, 3)).entry                # RAM only: its write is in flight
    before = core.state
    core(done.PrefetchFailed(99, IO_ERROR))
    core(done.PrefetchFailed(kept, IO_ERROR))
    assert core.counts()["read_errors"] == 2 and core.effects == ()
    assert core.state.entries == before.entries and core.state.disk == before.disk


def test_disk_eviction_takes_the_policys_victim_protected_or_not():
    def protect_short(namespace, tokens, request):
        return len(tokens) < 3
    core = tiered(retention=protect_short, disk_capacity_bytes=60, ram_capacity_bytes=200)
    protected = core.keep((1, 2), nbytes=30).entry   # the oldest file: disk LRU's victim
    core.settle_writes()
    plain = core.keep((3, 4, 5), nbytes=30).entry
    core.settle_writes()
    core.keep((6, 7, 8), nbytes=30)                  # protection orders RAM, not the disk tier
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (1, 2)))]
    assert core.residence(protected) is R.RAM and core.residence(plain) is R.BOTH
    only_protected = tiered(retention=lambda *_: True, disk_capacity_bytes=30, ram_capacity_bytes=200)
    only_protected.keep((1, 2), nbytes=30)
    only_protected.settle_writes()
    only_protected.keep((3, 4), nbytes=30)           # every file is protected: one still goes
    assert only_protected.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey("n", (1, 2)))]


def test_a_rejected_file_is_forgotten_without_deleting_it_and_the_acquire_falls_back():
    core = tiered()
    a = on_disk_only(core, (1, 2, 3))
    _, handle, _ = core.acquire((1, 2, 3, 9))
    reply = core(done.RestoreFailed(a, handle, CORRUPT))
    assert not core.of(fx.DeleteFile)  # the interpreter moved it aside
    assert core.of(fx.MakeFresh) == [fx.MakeFresh(handle)]
    assert (reply.source, reply.reused_tokens) == (Source.FRESH, 0)
    assert a not in core.state.entries and a not in core.state.reading
    assert core.counts()["rejected_files"] == 1 and "restores" not in core.counts()


def test_pressure_spills_a_ram_only_entry_and_drops_its_ram_copy_once_written():
    core = tiered(write_behind=False)
    entry = core.keep((1, 2, 3), nbytes=30).entry
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 30)
    assert core.residence(entry) is R.SPILLING and "demotions" not in core.counts()
    assert optional_bytes(core.state) == 30  # being given back, but held until its write lands
    core.settle_writes()
    assert core.residence(entry) is R.DISK and core.of(fx.DropEntry) == [fx.DropEntry(entry)]
    assert core.counts() == {"kept": 1, "spills": 1, "demotions": 1, "bytes_written": 30}


def test_pressure_with_only_spills_in_flight_left_waits_for_them_then_gives_back():
    """RAM under pressure holds only entries being written: nothing can go before the writes land, so
    the boundary waits for them (a Sync of its own, which answers nothing), then gives back."""
    core = tiered()                            # write-behind: a kept entry starts spilling at once
    entry = core.keep((1, 2, 3), nbytes=30).entry
    assert core.residence(entry) is R.SPILLING
    assert core(ev.Boundary(pressure=True)) == GaveBack(0, 0, waited=True)
    assert core.of(fx.Sync) == [fx.Sync(pressure=True)]
    core(done.SpillDone(entry))                # what the interpreter feeds back before Synced
    assert core(done.Synced(pressure=True)) is None and core.residence(entry) is R.BOTH
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 30)
    assert core.residence(entry) is R.DISK and optional_bytes(core.state) == 0
    assert core(ev.Boundary(pressure=True)) == GaveBack(0, 0)  # nothing in RAM, nothing being written


def test_pressure_waits_for_an_entry_being_given_back_before_it_takes_another():
    """The first victim's RAM is held until its spill lands: a second boundary waits for that write
    instead of giving back a second entry the pressure may not need."""
    core = tiered(write_behind=False)
    first = core.keep((1, 2, 3), nbytes=30).entry
    second = core.keep((4, 5, 6), nbytes=30).entry
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 30)
    assert core.residence(first) is R.SPILLING
    assert core(ev.Boundary(pressure=True)) == GaveBack(0, 0, waited=True)
    assert core.residence(second) is R.RAM and core.of(fx.Sync) == [fx.Sync(pressure=True)]
    core(done.SpillDone(first))
    assert core.residence(first) is R.DISK and optional_bytes(core.state) == 30
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 30)  # still pressed: now the next one


def test_a_boundary_without_pressure_gives_nothing_back():
    core = tiered()
    core.keep((1, 2, 3))
    core.settle_writes()
    before = core.state
    for quiet in (ev.Boundary(), ev.Boundary(pressure=False)):
        reply = core(quiet)
        assert reply == GaveBack(0, 0) and reply.waited is False and core.state == before
    pressed = Core()                                  # pressure, nothing kept, no writes: nothing to wait for
    reply = pressed(ev.Boundary(pressure=True))
    assert reply == GaveBack(0, 0) and reply.waited is False and pressed.effects == ()


def test_a_boundary_gives_back_while_ram_is_over_its_byte_or_entry_limit_and_stops_within_it():
    core = Core()
    first, second, third = (core.keep((i, i + 1, i + 2)).entry for i in (1, 10, 20))
    assert core(ev.Boundary(max_bytes=25)) == GaveBack(1, 10)     # 30 held: one goes, the policy's victim
    assert core.residence(first) is None
    assert core(ev.Boundary(max_bytes=25)) == GaveBack(0, 0)      # 20 held: within, nothing more
    assert core(ev.Boundary(max_bytes=20)) == GaveBack(0, 0)      # exactly the limit is within it
    assert core(ev.Boundary(max_entries=1)) == GaveBack(1, 10) and core.residence(second) is None
    assert core(ev.Boundary(max_entries=1)) == GaveBack(0, 0) and core.residence(third) is R.RAM


def test_ram_held_to_the_kv_budget_gives_back_what_the_running_requests_need():
    budget = SPEC.bytes_for(20)
    core = Core(ram_capacity_bytes=budget, kv_budget_bytes=budget, ram_within_kv_budget=True)
    kept = core.keep(tuple(range(1, 11)), nbytes=SPEC.bytes_for(10)).entry
    assert core(ev.Boundary()) == GaveBack(0, 0)                  # nothing running: kept state may use it all
    core(ev.Admit(1, Request(tuple(range(100, 105)), 10)))        # 15 positions projected: 5 left for RAM
    assert core(ev.Boundary()) == GaveBack(1, SPEC.bytes_for(10)) and core.residence(kept) is None
    by_default = Core(ram_capacity_bytes=budget, kv_budget_bytes=budget)  # kept RAM is not held to the budget
    kept = by_default.keep(tuple(range(1, 11)), nbytes=SPEC.bytes_for(10)).entry
    by_default(ev.Admit(1, Request(tuple(range(100, 105)), 10)))
    assert by_default(ev.Boundary()) == GaveBack(0, 0) and by_default.residence(kept) is R.RAM
    exact = Core(ram_capacity_bytes=budget, kv_budget_bytes=budget, ram_within_kv_budget=True)
    exact.keep(tuple(range(1, 6)), nbytes=SPEC.bytes_for(5))
    exact(ev.Admit(1, Request(tuple(range(100, 105)), 10)))       # 15 projected: exactly 5 left, all held
    assert exact(ev.Boundary()) == GaveBack(0, 0)


@pytest.mark.parametrize("limits", [{"max_bytes": -1}, {"max_entries": "2"}, {"max_bytes": True}])
def test_a_boundary_limit_that_is_not_a_count_is_refused_and_changes_nothing(limits):
    core = Core()
    core.keep((1, 2, 3))
    before = core.state
    with pytest.raises(InvalidRequest, match="boundary"):
        core(ev.Boundary(**limits))
    assert core.state == before


def test_pressure_gives_back_unprotected_entries_first_and_protected_ones_last():
    def protect_short(namespace, tokens, request):
        return len(tokens) < 3
    core = Core(retention=protect_short)
    protected = core.keep((1, 2)).entry
    plain = core.keep((5, 6, 7)).entry
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 10)
    assert core.residence(plain) is None and core.residence(protected) is R.RAM
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, 10)
    assert core.residence(protected) is None
    assert core(ev.Boundary(pressure=True)) == GaveBack(0, 0)


def test_optional_bytes_are_ram_entries_being_given_back_or_not_plus_queued_checkpoints():
    core = tiered(write_behind=False, checkpoint_every_tokens=1)
    core.keep((1, 2, 3), nbytes=30)
    core(ev.Flush())                          # its write is in flight, but it stays in RAM: still optional
    assert core.residence(1) is R.SPILLING and optional_bytes(core.state) == 30
    core.keep((4, 5, 6), nbytes=20)
    core(ev.Boundary(pressure=True))          # being given back: its 20 bytes are held until written
    assert core.residence(2) is R.SPILLING and optional_bytes(core.state) == 50
    lease, _, _ = core.acquire((7, 8), continuation=Continuation("k", 1))
    assert core(ev.Checkpoint(lease, 77, (7, 8, 9), 3, 1, None, 5, 6)) is True
    assert optional_bytes(core.state) == 55


def test_an_idle_entry_whose_write_is_in_flight_leaves_ram_once_written():
    core = tiered(demote_idle_after=10.0)
    entry = core.keep((1, 2, 3)).entry        # spilling (write-behind)
    core(ev.Tick(20.0))
    assert core.residence(entry) is R.SPILLING and core.state.entries[entry].demote
    core(done.SpillDone(entry))
    assert core.residence(entry) is R.DISK
    assert core.counts() == {"kept": 1, "spills": 1, "demotions": 1, "bytes_written": 10}


def test_a_use_restarts_an_entrys_idle_time():
    core = Core(demote_idle_after=10.0, disk_capacity_bytes=1000)
    entry = core.keep((1, 2, 3)).entry
    core.settle_writes()
    core(ev.Tick(8.0))
    core.acquire((1, 2, 3, 4))                  # used at 8: idle 7 s at 15, not 15 s
    core(ev.Tick(15.0))
    assert core.residence(entry) is R.BOTH
    core(ev.Tick(18.5))                         # idle 10.5 s now: given back
    assert core.residence(entry) is R.DISK


def test_the_same_state_published_again_restarts_its_idle_time():
    core = Core(demote_idle_after=10.0, disk_capacity_bytes=1000)
    entry = core.keep((1, 2, 3)).entry
    core.settle_writes()
    core(ev.Tick(8.0))
    assert core.keep((1, 2, 3)) == Kept(entry, duplicate=True)  # used at 8: idle 7 s at 15
    core(ev.Tick(15.0))
    assert core.residence(entry) is R.BOTH
    core(ev.Tick(18.5))
    assert core.residence(entry) is R.DISK


def test_a_partial_block_a_ram_block_already_covers_is_not_kept_again():
    """A prompt whose tokens past its last full block a longer RAM block already holds keeps nothing
    new, whether that partial block follows held blocks or is the chain's first."""
    cases = (  # blocks of 2: the partial block [4, 5) on two held blocks; of 4: the chain's first, [0, 2)
        (2, (1, 2, 3, 4, 5, 6), ((10, 10),) * 3, (1, 2, 3, 4, 5), ((10, 10), (10, 10), (5, 5))),
        (4, (1, 2, 3), ((10, 10),), (1, 2), ((5, 5),)))
    for block_tokens, tokens, sizes, shorter, blocks in cases:
        core = Core(block_tokens=block_tokens)
        core(ev.Publish(Request(tokens, 1), "n", tokens, 998, len(tokens), 30, True, 30, blocks=sizes))
        held, ram_bytes = dict(core.state.entries), core.state.ram.bytes
        reply = core(ev.Publish(Request(shorter, 1), "n", shorter, 999, len(shorter), 25, True, 25, blocks=blocks))
        assert reply.duplicate and dict(core.state.entries).keys() == held.keys()
        assert core.state.ram.bytes == ram_bytes and core.counts()["duplicates"] == 1


def test_a_publish_on_a_held_chain_keeps_only_the_blocks_it_adds_each_named_by_its_own_tokens():
    """A turn that extends a held chain, or branches off it inside a block or at a block's end, shares
    exactly the blocks whose tokens it repeats; every block it keeps is named by its own tokens' chain
    hash, whether on a chain held in RAM or only on disk."""
    chat = (1, 2, 3, 4, 5, 6, 7)                    # blocks of 2: [0, 2) [2, 4) [4, 6), partial [6, 7)
    cases = ((chat, (1, 2, 3, 4, 5, 6, 7, 8, 9), 3),  # the next turn: three full blocks shared
             (chat, (1, 2, 3, 9, 5, 6), 1),         # diverges inside the second block: one shared
             (chat, (1, 2, 3, 4, 9, 9, 9), 2),      # diverges at the second block's end: two shared
             (chat, (1, 9, 3, 4), 0),               # diverges inside the first: none shared
             ((1,), (1, 2, 3), 0),                  # held only as a partial block [0, 1): not the block [0, 2)
             (tuple(range(1, 21)), (1, 2, 3, 9), 1))  # a long chain, left early: one shared

    def sizes(tokens):
        return tuple((5 * (stop - start), 5 * (stop - start)) for start, stop in spans(len(tokens), 2))
    for on_disk in (False, True):
        for held, tokens, shared in cases:
            options = {"block_tokens": 2, "ram_capacity_bytes": 1000}
            core = tiered(demote_idle_after=1.0, **options) if on_disk else Core(**options)
            core(ev.Publish(Request(held, 1), "n", held, 998, len(held), 5 * len(held), True, 5 * len(held),
                            blocks=sizes(held)))
            if on_disk:
                while core.of(fx.SpillEntry):
                    core.settle_writes()
                core(ev.Tick(5.0))                  # idle: RAM gives every block up, the chain is on disk only
                assert {core.residence(entry) for entry in core.state.entries} == {R.DISK}
            before = {entry.block: entry.id for entry in core.state.entries.values()}
            core(ev.Publish(Request(tokens, 1), "n", tokens, 999, len(tokens), 5 * len(tokens), True,
                            5 * len(tokens), blocks=sizes(tokens)))
            names = block_names("n", tokens, 2)
            assert [before.get(name.key) is not None for name in names] == [at < shared for at in range(len(names))]
            after = {entry.block: entry for entry in core.state.entries.values()}
            assert all(after[name.key].residence in IN_RAM for name in names)  # the turn is held whole, in RAM
            for entry in core.state.entries.values():
                assert entry.block == block_names("n", entry.tokens, 2)[-1].key


def test_a_hit_on_a_chain_restarts_every_one_of_its_blocks_idle_time():
    core = Core(demote_idle_after=10.0, disk_capacity_bytes=1000, block_tokens=2)
    tokens = (1, 2, 3, 4, 5, 6)
    core(ev.Publish(Request(tokens, 1), "n", tokens, 999, 6, 30, True, 30, blocks=((10, 10),) * 3))
    blocks = sorted(core.state.entries)
    while core.of(fx.SpillEntry):               # each block is written after its parent
        core.settle_writes()
    assert [core.residence(block) for block in blocks] == [R.BOTH] * 3
    core(ev.Tick(8.0))
    core.acquire(tokens + (7,))                 # every block used at 8: idle 7 s at 15, not 15 s
    core(ev.Tick(15.0))
    assert [core.residence(block) for block in blocks] == [R.BOTH] * 3
    core(ev.Tick(18.5))                         # idle 10.5 s now: given back, leaf first
    assert [core.residence(block) for block in blocks] == [R.DISK] * 3


def test_prefetch_reads_a_longer_disk_prefix_into_ram_and_refuses_everything_else():
    core = tiered()
    entry = on_disk_only(core, (1, 2, 3))
    assert core(ev.Prefetch((1, 2, 9), "n")) is True
    assert core.residence(entry) is R.PREFETCHING and core.state.ram.bytes == 10
    assert core(ev.Prefetch((1, 2, 9), "n")) is False        # already being read
    core(done.PrefetchDone(entry))
    assert core.residence(entry) is R.BOTH and core.counts()["prefetches"] == 1
    assert core(ev.Prefetch((1, 2, 9), "n")) is False        # RAM holds it now


def test_prefetch_refuses_a_file_being_restored_and_one_without_room():
    core = tiered(ram_capacity_bytes=30)
    entry = on_disk_only(core, (1, 2, 3), nbytes=30)
    core.acquire((1, 2, 3, 4))
    assert entry in core.state.reading
    assert core(ev.Prefetch((1, 2, 9), "n")) is False
    other = on_disk_only(core, (5, 6, 7), nbytes=30)
    core.keep((8, 9), nbytes=20)                              # spilling: pinned in RAM
    assert core(ev.Prefetch((5, 6, 9), "n")) is False and core.residence(other) is R.DISK


@pytest.mark.parametrize("options", [{"disk_capacity_bytes": None}, {"ram_capacity_bytes": 0}])
def test_prefetch_needs_a_disk_tier_and_ram(options):
    core = tiered(**options)
    core(done.Scanned((done.SavedRecord("n", (1, 2), 0, True, 0),)))  # even a file of no bytes is not read into no RAM
    assert core(ev.Prefetch((1, 2, 3), "n")) is False


def test_prefetch_works_in_the_smallest_ram():
    core = tiered(ram_capacity_bytes=1)
    entry = on_disk_only(core, (1, 2, 3), nbytes=1)
    assert core(ev.Prefetch((1, 2, 3, 4), "n")) is True and core.residence(entry) is R.PREFETCHING


def test_a_publish_of_tokens_being_prefetched_is_a_duplicate():
    core = tiered()
    entry = on_disk_only(core, (1, 2, 3))
    core(ev.Prefetch((1, 2, 3, 4), "n"))
    assert core.keep((1, 2, 3)) == Kept(entry, duplicate=True)
    assert core.of(fx.DropPublished) and core.counts()["duplicates"] == 1
