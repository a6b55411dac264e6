"""The core's transitions one by one: each scenario drives ``step`` by hand and checks the exact
counters, effects, replies and pins that follow. The model checks reach these paths at random; here
each is reached on purpose, including the edges (an exact fit, a stale completion, a second reader)."""

import itertools
import re

import attrs
import pytest

from kvstate.core import events as ev
from kvstate.core.errors import CheckpointNotAllowed, InvalidRequest, OverBudget, RequestKeepsNoState, \
    TokensDoNotMatchCaches
from kvstate.core.replies import Acquired, Admission, FlushResult, GaveBack, Kept, NotKept, NotKeptReason, ObjectFound, \
    ObjectMissing, Pending, ScanResult, Source, RamHeld, HeldEntry, MaxTokensFit
from kvstate.core.request import Continuation, Request
from kvstate.core.policies import POLICIES
from kvstate.core.state import OBJECTS, Phase, Residence, ServiceConfig, initial_state
from kvstate.core.tiers import MAX_READ_ERRORS
from kvstate.core.transitions import optional_bytes, step
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from kvstate.models import model_spec

SPEC = model_spec("llama-3.2-1b")
R = Residence
CORRUPT = done.FailureReason.CORRUPT


class Core:
    """The pure core, driven by hand: events in; the last reply and effects kept for the checks."""

    def __init__(self, **options):
        self.state = initial_state(ServiceConfig(**{"model": SPEC, "ram_capacity_bytes": 100, **options}))
        self.handles = itertools.count(1000)
        self.leases = itertools.count(1)
        self.effects: tuple = ()

    def __call__(self, event):
        result = step(self.state, event)
        self.state, self.effects = result.state, result.effects
        return result.reply

    def keep(self, tokens, nbytes=10, trimmable=True, session=None, namespace="n", file_bytes=None):
        """Publish ``tokens`` as a request would after prefill (its file as large as its state unless
        ``file_bytes`` says otherwise); the reply."""
        request = Request(tokens, 1, session_id=session)
        return self(ev.Publish(request, namespace, tuple(tokens), next(self.handles), len(tokens), nbytes,
                               trimmable, nbytes if file_bytes is None else file_bytes))

    def acquire(self, prompt, session=None, namespace="n", continuation=None):
        """Acquire for a new request; ``(lease, handle, reply)``."""
        lease, handle = next(self.leases), next(self.handles)
        request = Request(prompt, 4, session_id=session, continuation=continuation)
        return lease, handle, self(ev.Acquire(lease, request, namespace, handle))

    def settle_writes(self):
        """Complete every spill the last step started."""
        for effect in [e for e in self.effects if isinstance(e, fx.SpillEntry)]:
            self(done.SpillDone(effect.entry))

    def counts(self):
        """The counters that are not zero."""
        return {name: value for name, value in self.state.counters._asdict().items() if value}

    def residence(self, entry):
        return self.state.entries[entry].residence if entry in self.state.entries else None

    def of(self, kind):
        return [e for e in self.effects if isinstance(e, kind)]


def on_disk_only(core, tokens, nbytes=10, trimmable=True, session=None):
    """An entry kept, written to disk and then given back from RAM: disk-only. Its id."""
    entry = core.keep(tokens, nbytes, trimmable, session).entry
    core.settle_writes()
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, nbytes)
    assert core.residence(entry) is R.DISK
    return entry


def tiered(**options):
    return Core(**{"disk_capacity_bytes": 1000, **options})


# ---------------------------------------------------------------- admission and fit


def test_a_request_admitted_twice_is_projected_once():
    core = Core(kv_budget_bytes=SPEC.bytes_for(100))
    request = Request(tuple(range(10)), 10)
    assert core(ev.Admit(1, request)) is Admission.ADMITTED
    assert core(ev.Admit(1, request)) is Admission.ADMITTED
    assert core.state.projected_bytes == SPEC.bytes_for(20)


def test_fits_counts_prompt_plus_max_tokens_against_the_context_and_the_budget():
    spec = attrs.evolve(SPEC, context_limit=10)
    core = Core(model=spec, kv_budget_bytes=spec.bytes_for(10))
    assert core(ev.Fits(Request(tuple(range(5)), 5))) is True           # exactly the limit and the budget
    assert core(ev.Fits(Request(tuple(range(5)), 6))) is False          # one over the context
    assert Core(model=spec)(ev.Fits(Request(tuple(range(5)), 6))) is False  # over the context, with no budget
    core(ev.Admit(1, Request(tuple(range(2)), 1)))
    assert core(ev.Fits(Request(tuple(range(5)), 5))) is False          # no longer within the budget
    core(ev.Close())
    assert core.state.phase is Phase.CLOSED
    assert core(ev.Fits(Request((1,), 1))) is False                     # a closed service fits nothing


@pytest.mark.parametrize("budget, shown", [(1023, "1023 B"), (1024, "1 KiB"), (1 << 20, "1 MiB"),
                                           (3 << 30, "3 GiB"), (1 << 50, "1.02e+03 TiB")])
def test_over_budget_names_the_budget_in_binary_units(budget, shown):
    core = Core(model=attrs.evolve(SPEC, context_limit=None), kv_budget_bytes=budget)
    with pytest.raises(OverBudget, match=f"budget of {re.escape(shown)} on its own"):
        core(ev.Admit(1, Request((1,), 1 << 40)))


def test_a_service_without_ram_keeps_nothing_and_says_so_before_publish():
    core = Core(ram_capacity_bytes=0)
    assert core(ev.Keeps(Request((1, 2), 1))) is False
    with pytest.raises(RequestKeepsNoState, match="RAM capacity 0"):
        core.keep((1, 2))


@pytest.mark.parametrize("measure", [-1, "100", True, 1.5])
def test_a_batch_measure_is_a_non_negative_int_of_bytes(measure):
    core = Core(kv_budget_bytes=SPEC.bytes_for(100))
    core(ev.Admit(1, Request(tuple(range(10)), 10)))
    before = core.state
    with pytest.raises(InvalidRequest, match="batch measure"):
        core(ev.BatchMeasured(measure))
    assert core.state == before
    assert core(ev.BatchMeasured(0)) is None and core.state.measured_bytes == 0  # nothing held is a measure


def test_a_measure_taken_with_nothing_admitted_charges_nothing():
    request = Request(tuple(range(10)), 10)
    core = Core(kv_budget_bytes=SPEC.bytes_for(20))                  # exactly the request alone
    core(ev.BatchMeasured(SPEC.bytes_for(5)))                        # caches of no admitted request
    assert core.state.measured_bytes == 0
    assert core(ev.Admit(1, request)) is Admission.ADMITTED


def test_a_batch_measured_above_its_projection_leaves_that_much_less_room():
    core = Core(kv_budget_bytes=SPEC.bytes_for(60))
    core(ev.Admit(1, Request(tuple(range(10)), 10)))                 # projected: 20 positions
    core(ev.BatchMeasured(SPEC.bytes_for(30)))                       # the batch really holds 30
    assert core(ev.Admit(2, Request(tuple(range(21)), 10))) is Admission.WAIT      # 20 + 31 + 10 > 60
    assert core(ev.Admit(3, Request(tuple(range(20)), 10))) is Admission.ADMITTED  # 20 + 30 + 10: exactly


def test_a_release_takes_its_share_off_the_last_measure():
    core = Core(kv_budget_bytes=SPEC.bytes_for(1000))
    first, second = Request(tuple(range(10)), 10), Request(tuple(range(20)), 10)
    core(ev.Admit(1, first))
    core(ev.Admit(2, second))
    projected = core.state.projected_bytes
    core(ev.BatchMeasured(projected + 100))                          # the batch holds more than projected
    core(ev.Release(1, completed=True))
    assert core.state.measured_bytes == projected + 100 - SPEC.bytes_for(20)
    assert core(ev.ReportQuery()).measured_bytes == core.state.measured_bytes
    core(ev.Release(2, completed=True))
    assert (core.state.projected_bytes, core.state.measured_bytes) == (0, 0)


def test_a_measure_smaller_than_the_released_share_goes_to_zero_not_below():
    core = Core(kv_budget_bytes=SPEC.bytes_for(1000))
    core(ev.Admit(1, Request(tuple(range(10)), 10)))
    core(ev.Admit(2, Request(tuple(range(20)), 10)))
    core(ev.BatchMeasured(5))                                        # measured before the caches grew
    core(ev.Release(1, completed=True))
    assert core.state.projected_bytes == SPEC.bytes_for(30) and core.state.measured_bytes == 0


def test_close_lets_go_of_the_running_requests_and_their_measure():
    core = Core(kv_budget_bytes=SPEC.bytes_for(1000))
    core(ev.Admit(1, Request(tuple(range(10)), 10)))
    core(ev.BatchMeasured(SPEC.bytes_for(50)))
    core(ev.Close())
    report = core(ev.ReportQuery())
    assert (report.projected_bytes, report.measured_bytes, report.live_requests) == (0, 0, 0)


def test_the_report_carries_what_the_interpreter_holds_aside():
    core = Core()
    report = core(ev.ReportQuery())
    assert (report.rejected_held_files, report.rejected_held_bytes) == (0, 0)
    report = core(ev.ReportQuery(rejected_held_files=2, rejected_held_bytes=70))
    assert (report.rejected_held_files, report.rejected_held_bytes) == (2, 70)


@pytest.mark.parametrize("nbytes, file_bytes", [(-1, 10), (10, -1), ("10", 10), (10, None)])
def test_a_publish_with_sizes_that_are_not_byte_counts_is_refused(nbytes, file_bytes):
    core = Core()
    before = core.state
    request = Request((1, 2), 1)
    with pytest.raises(InvalidRequest, match="bytes"):
        core(ev.Publish(request, "n", (1, 2), 7, 2, nbytes, True, file_bytes))
    assert core.state == before


# ---------------------------------------------------------------- keeping and RAM eviction


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


# ---------------------------------------------------------------- session affinity


def test_affinity_prefers_the_sessions_own_entry_on_disk_over_an_equal_ram_entry():
    core = tiered(write_behind=True)
    own = on_disk_only(core, (1, 2, 3), session="s")
    other = core.keep((1, 7, 7)).entry
    _, handle, reply = core.acquire((1, 5, 6), session="s")  # both serve one token
    assert reply == Pending(handle) and core.of(fx.RestoreEntry) == [fx.RestoreEntry(own, fx.DiskKey("n", (1, 2, 3)), 1,
                                                                          handle)]
    reply = core(done.RestoreDone(own, handle))
    assert (reply.source, reply.reused_tokens) == (Source.DISK, 1)
    assert core.counts()["session_hits"] == 1 and other in core.state.entries


def test_affinity_takes_an_exact_own_entry_of_all_but_the_last_token():
    core = tiered()
    own = on_disk_only(core, (1, 2, 3), trimmable=False, session="s")
    core.keep((1, 2, 3, 8, 8))  # a trimmable RAM entry serving the same three tokens
    _, handle, _ = core.acquire((1, 2, 3, 4), session="s")
    assert core.of(fx.RestoreEntry) == [fx.RestoreEntry(own, fx.DiskKey("n", (1, 2, 3)), 3, handle)]


def test_affinity_never_serves_an_own_entry_that_does_not_match_the_prompt():
    core = Core()
    core.keep((9, 9), trimmable=False, session="s")
    shared = core.keep((1,), trimmable=False).entry
    _, handle, reply = core.acquire((1, 2), session="s")
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(shared, 1, handle)]
    longer = core.keep((1, 2), trimmable=False).entry
    core.keep((9, 9), trimmable=False, session="s")
    _, handle, reply = core.acquire((1, 2, 3), session="s")
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(longer, 2, handle)]
    assert core.counts()["session_misses"] == 2


def test_affinity_never_serves_an_own_entry_that_differs_only_in_its_first_token():
    core = Core()
    core.keep((9, 2, 3), session="s")                # agrees with the prompt everywhere but first
    shared = core.keep((1, 2)).entry
    _, handle, _ = core.acquire((1, 2, 3, 4), session="s")
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(shared, 2, handle)]
    _, handle, reply = core.acquire((7, 8), session="s")  # nothing kept matches: fresh caches
    assert reply.source is Source.FRESH and core.effects == (fx.MakeFresh(handle),)


def test_affinity_never_trims_an_own_entry_that_cannot_be_trimmed():
    core = Core()
    prompt = (1, 2, 3, 4)
    core.keep(prompt, trimmable=False, session="s")  # the whole prompt: unusable (one token is left to compute)
    short = core.keep((1, 2), trimmable=False).entry
    _, handle, _ = core.acquire(prompt, session="s")
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(short, 2, handle)]


def test_affinity_finds_an_own_entry_held_in_ram_only_when_there_is_a_disk_tier():
    core = tiered(write_behind=False)
    own = core.keep((1, 2, 3, 4), session="s").entry       # trimmable, RAM only (no write-behind)
    core.keep((1, 2), trimmable=False)                     # the index's own pick for (1, 2, 9)
    _, handle, _ = core.acquire((1, 2, 9), session="s")
    assert core.of(fx.CloneEntry) == [fx.CloneEntry(own, 2, handle)]
    assert core.counts()["session_hits"] == 1


# ---------------------------------------------------------------- the disk tier: spills


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


# ---------------------------------------------------------------- giving RAM back


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
    assert core(ev.Boundary(max_entries=1)) == GaveBack(1, 10) and core.residence(second) is None
    assert core(ev.Boundary(max_entries=1)) == GaveBack(0, 0) and core.residence(third) is R.RAM


def test_ram_held_to_the_kv_budget_gives_back_what_the_running_requests_need():
    budget = SPEC.bytes_for(20)
    core = Core(ram_capacity_bytes=budget, kv_budget_bytes=budget, ram_within_kv_budget=True)
    kept = core.keep(tuple(range(1, 11)), nbytes=SPEC.bytes_for(10)).entry
    assert core(ev.Boundary()) == GaveBack(0, 0)                  # nothing running: kept state may use it all
    core(ev.Admit(1, Request(tuple(range(100, 105)), 10)))        # 15 positions projected: 5 left for RAM
    assert core(ev.Boundary()) == GaveBack(1, SPEC.bytes_for(10)) and core.residence(kept) is None
    assert Core(ram_capacity_bytes=budget, kv_budget_bytes=budget)(ev.Boundary()) == GaveBack(0, 0)


@pytest.mark.parametrize("limits", [{"max_bytes": -1}, {"max_entries": "2"}, {"max_bytes": True}])
def test_a_boundary_limit_that_is_not_a_count_is_refused_and_changes_nothing(limits):
    core = Core()
    core.keep((1, 2, 3))
    before = core.state
    with pytest.raises(InvalidRequest, match="boundary"):
        core(ev.Boundary(**limits))
    assert core.state == before


def test_ram_query_answers_entries_and_bytes_and_each_entry_where_asked():
    core = tiered()
    core.keep((1, 2, 3), namespace="a")
    core.keep((7, 8), nbytes=5, namespace="b")
    assert core(ev.RamQuery()) == RamHeld(2, 15)
    assert set(core(ev.RamQuery(each=True)).each) == {HeldEntry("a", (1, 2, 3), 10), HeldEntry("b", (7, 8), 5)}


def test_the_default_max_tokens_is_lowered_to_what_fits_and_a_requested_one_is_refused_saying_whose():
    spec = attrs.evolve(SPEC, context_limit=100)
    core = Core(model=spec)
    assert core(ev.FitMaxTokens(60, 512, requested=False)) == MaxTokensFit(40)
    assert core(ev.FitMaxTokens(60, 30, requested=False)) == MaxTokensFit(30)
    assert core(ev.FitMaxTokens(60, 40, requested=True)) == MaxTokensFit(40)
    refused = core(ev.FitMaxTokens(60, 41, requested=True))
    assert refused.refusal.startswith("the prompt of 60 tokens + max_tokens 41 (the request's) = 101 tokens is past")
    assert "context limit of 100" in refused.refusal
    assert "leaves no room for one generated token" in core(ev.FitMaxTokens(100, 512, requested=False)).refusal
    budgeted = Core(model=spec, kv_budget_bytes=spec.bytes_for(70))
    assert budgeted(ev.FitMaxTokens(60, 512, requested=False)) == MaxTokensFit(10)
    assert "KV budget of" in budgeted(ev.FitMaxTokens(60, 11, requested=True)).refusal
    with pytest.raises(InvalidRequest, match="max_tokens"):
        core(ev.FitMaxTokens(60, 0, requested=True))


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


# ---------------------------------------------------------------- prefetch


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


# ---------------------------------------------------------------- objects


def test_objects_read_from_disk_are_pinned_per_reader_counted_and_never_prefixes():
    core = tiered(ram_capacity_bytes=10)
    assert core(ev.ObjectPut("weights", 1, 10, 10)) == Kept(1)
    assert not core.of(fx.NotifyKept)                          # observers hear of prefixes only
    assert core.of(fx.SpillEntry)[0].trimmable is False         # an object is never trimmed
    core.settle_writes()
    core(ev.Boundary(pressure=True))
    core(ev.ObjectGet("weights", 2))
    core(ev.ObjectGet("weights", 3))
    assert core.state.reading[1] == 2
    assert core(done.RestoreDone(1, 2)) == ObjectFound(2, Source.DISK)
    assert core.state.reading[1] == 1
    assert core(done.RestoreFailed(1, 3, CORRUPT)) == ObjectMissing()
    assert 1 not in core.state.reading
    assert core.counts() == {"kept": 1, "spills": 1, "demotions": 1, "object_hits": 1, "object_restores": 1,
                             "object_misses": 1, "rejected_files": 1, "bytes_written": 10,
                             "bytes_read": 10}


def test_an_object_read_from_disk_refreshes_the_disk_policy():
    core = tiered(ram_capacity_bytes=10, disk_capacity_bytes=20)
    for handle, key in enumerate(("a", "b")):
        core(ev.ObjectPut(key, handle, 10, 10))
        core.settle_writes()
        core(ev.Boundary(pressure=True))
    core(ev.ObjectGet("a", 7))
    core(done.RestoreDone(1, 7))
    core(ev.ObjectPut("c", 8, 10, 10))                 # disk LRU: "b" was used longest ago
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey(OBJECTS, tuple(b"b")))]


def test_an_object_put_needs_ram_and_fits_the_smallest():
    assert Core(ram_capacity_bytes=0)(ev.ObjectPut("k", 1, 0, 0)) == NotKept(NotKeptReason.TOO_LARGE)
    assert Core(ram_capacity_bytes=1)(ev.ObjectPut("k", 1, 1, 1)) == Kept(1)


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


# ---------------------------------------------------------------- checkpoints


def checkpointing():
    return tiered(checkpoint_every_tokens=1)


def interrupted(core, continuation, tokens=(1, 2, 3)):
    """A generation of the prompt (1, 2) that checkpointed ``tokens`` durably, then was released
    unfinished: the checkpoint's meta."""
    lease, _, _ = core.acquire((1, 2), continuation=continuation)
    assert core(ev.Checkpoint(lease, 9, tokens, len(tokens), len(tokens) - 2, None, 5, 6)) is True
    meta = core.of(fx.WriteCheckpoint)[0].meta
    core(done.CheckpointWritten(meta.key, len(tokens), 6))
    core(ev.Release(lease, completed=False))
    return meta


def test_a_checkpoint_before_acquire_is_refused_as_such():
    core = checkpointing()
    request = Request((1, 2), 4, continuation=Continuation("k", 1))
    core(ev.Admit(1, request))
    with pytest.raises(CheckpointNotAllowed, match="before acquire"):
        core(ev.Checkpoint(1, 9, (1, 2, 3), 3, 1, None, 5, 6))


@pytest.mark.parametrize("tokens, covered, generated", [((1, 2, 3), 3, -1), ((1, 2, 3), 3, 2), ((1, 2, 3), 2, 1),
                                                         ((1, 9, 3), 3, 1)])
def test_a_checkpoint_must_be_the_prompt_plus_what_was_generated(tokens, covered, generated):
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    before = core.state
    with pytest.raises(TokensDoNotMatchCaches):
        core(ev.Checkpoint(lease, 9, tokens, covered, generated, None, 5, 6))
    assert core.state == before


def test_a_checkpoint_of_nothing_generated_yet_is_written_and_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation, tokens=(1, 2))
    assert meta == fx.CheckpointMeta("n\x1f\x1fk", "n", 2, 0, None, 1, seed_was_explicit=False)
    lease, handle, reply = core.acquire((1, 2), continuation=continuation)
    assert reply == Pending(handle) and core.of(fx.ResumeCheckpoint) == [fx.ResumeCheckpoint(meta.key, handle)]
    reply = core(done.CheckpointResumed(handle, meta, (1, 2)))
    assert (reply.source, reply.resumed, reply.resumed_tokens) == (Source.CHECKPOINT, meta, (1, 2))
    assert core.counts() == {"misses": 1, "hits": 1, "checkpoints_written": 1, "resumes": 1,
                             "prefill_tokens_saved": 2, "bytes_written": 6}


def test_a_checkpoint_still_being_written_or_only_failed_is_not_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    lease, _, _ = core.acquire((1, 2), continuation=continuation)
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    core(ev.Release(lease, completed=False))
    _, _, reply = core.acquire((1, 2), continuation=continuation)   # pending only
    assert isinstance(reply, Acquired) and reply.source is Source.FRESH
    core(done.CheckpointFailed(key, done.FailureReason.NO_SPACE))
    assert (core.state.writes.count, core.state.writes.bytes) == (0, 0)
    _, _, reply = core.acquire((1, 2), continuation=continuation)   # failed only
    assert reply.source is Source.FRESH
    assert core.counts() == {"misses": 3, "failed_writes": 1}


def test_a_checkpoint_found_by_a_scan_with_one_durable_token_is_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    key = "n\x1f\x1fk"
    meta = fx.CheckpointMeta(key, "n", 1, 0, None, 1, False)
    core(done.Scanned(checkpoints=(done.SavedCheckpoint(meta, 1, 6),)))
    _, handle, _ = core.acquire((1,), continuation=continuation)
    assert core.of(fx.ResumeCheckpoint) == [fx.ResumeCheckpoint(key, handle)]


def test_the_write_queue_bounds_checkpoints_too():
    core = tiered(checkpoint_every_tokens=1, write_queue_bytes=5)
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    assert core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6)) is True       # exactly the queue
    assert core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 1, 2)) is False  # one byte over
    assert core.of(fx.DropPublished) == [fx.DropPublished(10)]
    assert (core.state.writes.count, core.state.writes.bytes) == (1, 5)
    assert core.counts() == {"misses": 1, "dropped_writes": 1}


def test_checkpoint_writes_settle_one_share_at_a_time():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 6, 7))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 6, 7))
    core(done.CheckpointWritten(key, 3, 7))
    record = core.state.checkpoints[key]
    assert (record.pending, record.pending_bytes, record.durable_tokens) == (1, 6, 3)
    assert (core.state.writes.count, core.state.writes.bytes) == (1, 6)
    core(done.CheckpointWritten(key, 4, 7))
    assert core.state.checkpoints[key].durable_tokens == 4 and core.state.writes.bytes == 0
    assert core.counts()["checkpoints_written"] == 2


def test_a_completed_generation_deletes_its_checkpoint_and_its_queued_writes():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 6, 7))
    core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 6, 7))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    assert core.state.disk.bytes == 14                     # both files reserved while written
    core(ev.Release(lease, completed=True))
    assert core.of(fx.DeleteCheckpoint) == [fx.DeleteCheckpoint(key)]
    assert (core.state.writes.count, core.state.writes.bytes, core.state.disk.bytes) == (0, 0, 0)
    before = core.state
    core(done.CheckpointWritten(key, 3, 7))                 # the late completion of a deleted record
    assert core.state.checkpoints == before.checkpoints and core.state.writes.count == 0


@pytest.mark.parametrize("wrong", ["prompt_tokens", "generated_tokens", "tokens", "prefix", "key"])
def test_an_inconsistent_checkpoint_is_deleted_and_the_acquire_falls_back(wrong):
    core = checkpointing()
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation)
    _, handle, _ = core.acquire((1, 2), continuation=continuation)
    tokens = (1, 2, 3)
    if wrong == "prompt_tokens":
        meta = attrs.evolve(meta, prompt_tokens=1)
    elif wrong == "generated_tokens":
        meta, tokens = attrs.evolve(meta, prompt_tokens=4, generated_tokens=-1), (1, 2, 3)
    elif wrong == "tokens":
        tokens = (1, 2, 3, 4)
    elif wrong == "prefix":
        tokens = (1, 9, 3)
    else:
        meta = attrs.evolve(meta, key="another")
    reply = core(done.CheckpointResumed(handle, meta, tokens))
    assert reply.source is Source.FRESH
    assert core.of(fx.DropPublished)[0] == fx.DropPublished(handle)
    assert fx.DeleteCheckpoint("n\x1f\x1fk") in core.effects
    assert core.counts() == {"misses": 2, "checkpoints_written": 1, "rejected_files": 1, "bytes_written": 6}


def test_a_checkpoint_that_fails_to_read_is_deleted_and_the_acquire_falls_back():
    core = checkpointing()
    continuation = Continuation("k", 1)
    key = interrupted(core, continuation).key
    lease, handle, _ = core.acquire((1, 2), continuation=continuation)
    reply = core(done.ResumeFailed(key, handle, CORRUPT))
    assert reply == Acquired(lease, handle, 0, Source.FRESH)
    assert core.effects == (fx.DeleteCheckpoint(key), fx.MakeFresh(handle))  # the handle is the caller's still
    assert core.counts() == {"misses": 2, "checkpoints_written": 1, "rejected_files": 1, "bytes_written": 6}


# ---------------------------------------------------------------- flush


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
