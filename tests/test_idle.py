"""The idle order: the clock's rules visit entries gone idle, oldest first, and the order stays small."""

from __future__ import annotations

from kvstate import KvCacheService, Request, SimCaches, model_spec
from kvstate.core.draft import Draft
from kvstate.core.idle import IdleOrder
from kvstate.core.state import Residence

SPEC = model_spec("llama-3.1-8b")


def serve(service: KvCacheService, prompt: tuple[int, ...]) -> None:
    request = Request(prompt + (99_999,), 4)
    service.acquire(request)
    service.publish(request, "default", prompt, SimCaches(prompt, SPEC))
    service.release(request)


def test_reads_only_what_is_idle_least_recently_used_first():
    class Used:
        def __init__(self, last_used):
            self.last_used = last_used

    entries = {1: Used(1.0), 2: Used(5.0), 3: Used(2.0)}
    order = IdleOrder()
    for entry_id, at in ((1, 0.0), (2, 1.0), (1, 1.0), (3, 2.0), (2, 5.0)):
        order = order.used(entry_id, at, entries)
    assert [e.last_used for e in order.idle(lambda: entries, 2.0)] == [1.0, 2.0]  # stale slots skipped
    assert [e.last_used for e in order.idle(lambda: entries, 1.5)] == [1.0]
    assert list(order.idle(lambda: entries, 0.5)) == []


def test_the_front_moves_only_past_entries_the_rules_are_done_with():
    class Used:
        def __init__(self, last_used, waiting):
            self.last_used, self.waiting = last_used, waiting

    entries = {1: Used(0.0, False), 2: Used(1.0, True), 3: Used(2.0, False)}
    order = IdleOrder()
    for entry_id in (1, 2, 3):
        order = order.used(entry_id, entries[entry_id].last_used, entries)
    order = order.advanced(entries, lambda entry: entry.waiting)
    assert [e.last_used for e in order.idle(lambda: entries, 10.0)] == [1.0, 2.0]  # 1 is passed; 2 holds 3
    entries[2].waiting = False
    assert list(order.advanced(entries, lambda entry: entry.waiting).idle(lambda: entries, 10.0)) == []


def test_every_entry_in_ram_stays_in_the_order_and_memory_stays_in_proportion_to_the_entries():
    # RAM and disk each hold about four of the eight prompts: entries come and go while others are used again.
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(210), disk_bytes=SPEC.bytes_for(260),
                                       demote_idle_after=1e9)
    prompts = [tuple(range(k * 1000, k * 1000 + 50)) for k in range(8)]
    # Slots are rebuilt in proportion to the entries held at a use, which is at most one more than
    # the most held between calls (a kept entry is in before a spill evicts a file to make room).
    most = 0
    for second in range(600):
        service.tick(float(second))
        serve(service, prompts[(second * 5) % 7 + (second % 2)])
        state = service.state
        most = max(most, len(state.entries))
        assert len(state.idle.slots) <= 2 * (most + 1) + 64
        in_order = {entry.id for entry in state.idle.idle(lambda: state.entries, float("inf"))
                    if entry.residence is not Residence.DISK}
        assert in_order == {entry.id for entry in state.entries.values() if entry.residence is not Residence.DISK}
    assert state.counters.evictions > 0 and state.counters.disk_evictions > 0


def test_no_order_is_kept_where_no_rule_reads_the_clock():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(4000), disk_bytes=SPEC.bytes_for(8000))
    serve(service, tuple(range(50)))
    assert len(service.state.idle.slots) == 0


def test_an_attempt_to_make_room_that_fails_leaves_the_order_as_it_was():
    # Making disk room can drop a file from an entry still in RAM, which puts the entry in the order
    # again; if the attempt then fails, everything it changed goes back, the order included.
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(4000), disk_bytes=SPEC.bytes_for(8000),
                                       write_idle_after=30.0)
    serve(service, tuple(range(50)))
    draft = Draft(service.state)
    mark = draft.mark()
    before = draft.idle
    draft.idle = draft.idle.used(1, 99.0, draft.entries)
    draft.rollback(mark)
    assert draft.idle is before
