"""A chain of blocks read ahead into RAM (``prefetch`` in blocks): the blocks only the disk holds are read,
first to last, so the request that follows is served from RAM; a block that fails its read is rejected
(an I/O error leaves it on disk) and what extends it is not taken up; a read that lands after its
blocks went elsewhere leaves nothing behind; a publish that meets blocks being read keeps nothing."""

from __future__ import annotations

from kvstate import KvCacheService, Request, SimCaches
from kvstate.core.replies import Source
from kvstate.core.state import IN_RAM, Residence
from kvstate.effects.effects import BlockName
from kvstate.interpreters.simulator import FaultPlan, SimDisk
from kvstate.models import model_spec

SPEC = model_spec("llama-3.2-1b")
BLOCK = 4
PROMPT = tuple(range(100, 110))  # blocks of 4, 4 and a partial one of 2


def build(disk, faults=None, deferred_reads=False, pressure=None):
    """A service on ``disk``; with ``deferred_reads``, reads ahead (and writes) complete only when the
    test says (``complete_reads``), as a background reader's land later."""
    return KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(64), disk_bytes=SPEC.bytes_for(256),
                                    block_tokens=BLOCK, pressure=pressure, interpreter_options={
                                        "disk": disk, "faults": faults or FaultPlan(),
                                        "deferred_reads": deferred_reads, "deferred_writes": deferred_reads})


def saved_then_restarted(**options):
    """A service whose disk holds ``PROMPT``'s three blocks and whose RAM holds nothing."""
    disk = SimDisk()
    first = build(disk)
    request = Request(PROMPT, 1)
    first.acquire(request)
    first.publish(request, "default", PROMPT, SimCaches(PROMPT, SPEC))
    first.release(request)
    assert first.flush().durable
    return build(disk, **options), disk


def blocks_of(disk):
    return sorted((key for key in disk.files if isinstance(key, BlockName)), key=lambda key: key.start)


def residences(service):
    return [e.residence for e in sorted(service.state.entries.values(), key=lambda e: e.start)]


def ram_is_consistent(service):
    state = service.state
    held = {e.id for e in state.entries.values() if e.residence in IN_RAM}
    reading = sum(e.nbytes for e in state.entries.values() if e.residence is Residence.PREFETCHING)
    assert service.interpreter.ram_entries() == held and not service.interpreter.ahead_entries()
    assert state.ram.bytes == sum(state.entries[i].nbytes for i in held) + reading


def test_a_chain_read_ahead_serves_the_next_request_from_ram():
    service, disk = saved_then_restarted()
    assert service.peek_prefix_len(PROMPT + (1,)) == 0
    assert service.prefetch(PROMPT + (1,)) is True
    assert residences(service) == [Residence.BOTH] * 3 and service.report().prefetches == 1
    reads = service.interpreter.stats.reads
    state = service.acquire(Request(PROMPT + (1,), 1))
    assert (state.reused_tokens, state.source) == (10, Source.RAM) and state.caches.tokens == PROMPT
    assert service.interpreter.stats.reads == reads  # nothing more read: the blocks were in RAM
    assert service.prefetch(PROMPT + (1,)) is False  # nothing left to read
    ram_is_consistent(service)


def test_a_corrupt_block_is_rejected_and_what_extends_it_is_not_taken_up():
    service, disk = saved_then_restarted()
    first, middle, last = blocks_of(disk)
    disk.corrupt(middle)
    assert service.prefetch(PROMPT + (1,)) is True
    assert service.peek_prefix_len(PROMPT + (1,)) == BLOCK  # the first block only
    assert service.report().rejected_files == 1 and first in disk.files
    assert middle not in disk.files and last not in disk.files  # the last serves nothing without it
    assert len(service.state.entries) == 1
    ram_is_consistent(service)


def test_an_io_error_leaves_the_block_and_what_extends_it_on_disk_for_a_later_read():
    faults = FaultPlan()
    service, disk = saved_then_restarted(faults=faults)
    faults.fail_reads.add(service.interpreter.stats.reads + 2)  # the middle block's read
    assert service.prefetch(PROMPT + (1,)) is True
    assert residences(service) == [Residence.BOTH, Residence.DISK, Residence.DISK]
    assert service.report().read_errors == 1 and len(blocks_of(disk)) == 3
    ram_is_consistent(service)
    assert service.prefetch(PROMPT + (1,)) is True  # read again: now it works
    assert residences(service) == [Residence.BOTH] * 3
    ram_is_consistent(service)


def test_a_publish_that_meets_its_blocks_being_read_keeps_nothing_and_the_read_lands():
    service, disk = saved_then_restarted(deferred_reads=True)
    assert service.prefetch(PROMPT + (1,)) is True
    assert residences(service) == [Residence.PREFETCHING] * 3
    ram_is_consistent(service)
    longer = PROMPT + (7, 8, 9)
    request = Request(longer, 1)
    assert service.publish(request, "default", longer, SimCaches(longer, SPEC)) is False
    assert service.report().not_kept == 1
    service.complete(service.interpreter.complete_reads())
    assert residences(service) == [Residence.BOTH] * 3
    ram_is_consistent(service)


def test_a_read_that_lands_after_what_it_extends_left_ram_is_not_taken_up_and_leaves_nothing_behind():
    service, _ = saved_then_restarted(deferred_reads=True)
    assert service.prefetch(PROMPT[:BLOCK] + (1,)) is True  # the first block only
    service.complete(service.interpreter.complete_reads())
    assert residences(service)[:3] == [Residence.BOTH, Residence.DISK, Residence.DISK]
    first = min(service.state.entries.values(), key=lambda e: e.start).id
    assert service.prefetch(PROMPT + (1,)) is True  # the other two, read ahead
    other = tuple(range(5000, 5056))  # meanwhile a publish needs RAM: the first block's copy goes
    request = Request(other, 1)
    service.acquire(request)
    assert service.publish(request, "default", other, SimCaches(other, SPEC)) is True
    service.release(request)
    assert service.state.entries[first].residence is Residence.DISK
    service.complete(service.interpreter.complete_reads())  # the reads land: what they extend left RAM
    chain = [e for e in service.state.entries.values() if e.namespace == "default" and e.tokens[:1] == (100,)]
    assert sorted(e.residence.value for e in chain) == ["disk"] * 3
    ram_is_consistent(service)


def test_a_read_ahead_slower_than_prefilling_what_it_adds_is_not_started():
    service, disk = saved_then_restarted()
    assert service.prefetch(PROMPT[:BLOCK] + (1,)) is True  # the first block: the read's pace is measured
    service.measure_prefill(10**9, 1.0)  # a prefill far faster than any read of the rest
    passed_up = service.report().restores_passed_up
    assert service.prefetch(PROMPT + (1,)) is False
    assert service.report().restores_passed_up == passed_up + 1
    assert residences(service) == [Residence.BOTH, Residence.DISK, Residence.DISK]
