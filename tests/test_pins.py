"""Pins (``core/pins.py``): a pinned prefix stays in RAM through eviction, pressure, idle demotion and a
longer prefix that serves it, until its pin runs out; pins hold at most their share of RAM and last at
most the longest a request may ask; a refused pin changes nothing."""

import math

import pytest

from kvstate import KvCacheService, PinOverBudget, PinTooLong, Request, SimCaches
from kvstate.core import events as ev
from kvstate.core.errors import InvalidRequest
from kvstate.core.replies import GaveBack, Kept, Pinned
from kvstate.effects import completions as done
from kvstate.models import model_spec
from tests.core_driver import Core, R, tiered


def test_a_pinned_prefix_outlives_every_eviction_until_its_pin_runs_out():
    core = Core(pin_share=0.5)
    pinned = core.keep((1, 2, 3), nbytes=30).entry
    assert core(ev.Pin("n", (1, 2, 3), 10.0)) == Pinned(3, 30, 10.0)
    for k in range(10):  # each new entry needs room: the least recently used unpinned one goes
        assert isinstance(core.keep((100 + k, 7), nbytes=30), Kept)
    assert core.residence(pinned) is R.RAM
    assert core.counts()["evictions"] == 8
    core(ev.Tick(10.0))  # the pin runs out: the entry is every rule's again
    core.keep((200, 7), nbytes=30)
    core.keep((201, 7), nbytes=30)
    assert core.residence(pinned) is None


def test_a_pin_holds_against_pressure_and_idle_demotion():
    core = tiered(demote_idle_after=5.0)
    pinned = core.keep((1, 2), nbytes=30).entry
    core.settle_writes()
    other = core.keep((3, 4), nbytes=30).entry
    core.settle_writes()
    core(ev.Pin("n", (1, 2), 60.0))
    core(ev.Tick(30.0))  # both idle past the threshold: only the unpinned one is demoted
    assert core.residence(pinned) is R.BOTH and core.residence(other) is R.DISK
    assert core(ev.Boundary(pressure=True)) == GaveBack(0, 0)  # pressure finds nothing it may give back
    assert core.residence(pinned) is R.BOTH
    core(ev.Tick(61.0))  # the pin ran out: the next tick demotes it
    assert core.residence(pinned) is R.DISK


def test_an_entry_pinned_while_its_demoting_write_is_in_flight_keeps_its_ram_copy():
    core = tiered(demote_idle_after=5.0, write_behind=False)
    entry = core.keep((1, 2), nbytes=30).entry
    core(ev.Tick(10.0))  # idle: written first, its RAM to go once the write lands
    assert core.residence(entry) is R.SPILLING and core.state.entries[entry].demote
    core(ev.Pin("n", (1, 2), 60.0))
    core(done.SpillDone(entry))
    assert core.residence(entry) is R.BOTH


def test_a_longer_prefix_does_not_supersede_a_pinned_one():
    core = Core()
    shorter = core.keep((1, 2, 3), nbytes=20).entry
    core(ev.Pin("n", (1, 2, 3), 10.0))
    core.keep((1, 2, 3, 4, 5), nbytes=30)
    assert core.residence(shorter) is R.RAM and core.counts().get("superseded", 0) == 0
    unpinned = core.keep((6, 7), nbytes=10).entry
    core.keep((6, 7, 8), nbytes=15)
    assert core.residence(unpinned) is None and core.counts()["superseded"] == 1


def test_pins_hold_at_most_their_share_of_ram_and_a_refused_pin_changes_nothing():
    core = Core(pin_share=0.5)  # 50 of the 100 bytes
    core.keep((1, 2), nbytes=30)
    core.keep((3, 4), nbytes=30)
    core(ev.Pin("n", (1, 2), 10.0))
    before = core.state
    with pytest.raises(PinOverBudget, match=r"0\.5 of the RAM capacity of 100 B is 50 B.*30 B is pinned now"):
        core(ev.Pin("n", (3, 4), 10.0))
    assert core.state is before
    assert core(ev.PinFits(20, 10.0)) is None
    assert "pinning 21 B more" in core(ev.PinFits(21, 10.0))
    assert core(ev.Pin("n", (1, 2), 20.0)) == Pinned(2, 30, 20.0)  # pinned already: nothing more to hold


def test_a_pin_longer_than_allowed_or_of_no_time_is_refused():
    core = Core(max_pin_seconds=60.0)
    core.keep((1, 2), nbytes=30)
    before = core.state
    with pytest.raises(PinTooLong, match="61 s is longer than the 60 s"):
        core(ev.Pin("n", (1, 2), 61.0))
    for seconds in (0, -1.0, math.inf, math.nan, True):
        with pytest.raises(InvalidRequest):
            core(ev.Pin("n", (1, 2), seconds))
    assert core.state is before
    assert "longer than the 60 s" in core(ev.PinFits(1, 61.0))
    assert core(ev.Pin("n", (1, 2), None)) == Pinned(2, 30, math.inf)  # the operator's: until close


def test_pinning_again_extends_a_pin_and_never_shortens_it():
    core = Core()
    entry = core.keep((1, 2), nbytes=30).entry
    core(ev.Pin("n", (1, 2), 50.0))
    core(ev.Pin("n", (1, 2), 5.0))
    assert core.state.pinned_until[entry] == 50.0
    core(ev.Tick(20.0))
    core(ev.Pin("n", (1, 2), 40.0))
    assert core.state.pinned_until[entry] == 60.0


def test_a_pin_of_nothing_held_is_counted_and_the_report_shows_what_is_pinned():
    core = Core()
    assert core(ev.Pin("n", (9, 9), 10.0)) == Pinned(0, 0, 10.0)
    core.keep((1, 2, 3), nbytes=25)
    assert core(ev.Pin("n", (1, 2, 3, 4, 5), 10.0)) == Pinned(3, 25, 10.0)  # the longest prefix RAM holds
    assert core(ev.Pin("other", (1, 2, 3), 10.0)) == Pinned(0, 0, 10.0)   # another namespace's: not theirs
    report = core(ev.ReportQuery(0, 0))
    assert (report.pins, report.pins_missed, report.pinned_entries, report.pinned_bytes) == (1, 2, 1, 25)
    core(ev.Tick(10.0))
    assert core(ev.ReportQuery(0, 0)).pinned_bytes == 0 and not core.state.pinned_until


SPEC = model_spec("llama-3.2-1b")


def publish(service, tokens, namespace="default"):
    request = Request(tokens, 1)
    service.acquire(request, namespace)
    service.publish(request, namespace, tokens, SimCaches(tokens, SPEC))
    service.release(request)


def test_a_pinned_chain_of_blocks_outlives_eviction_and_keeps_its_partial_block():
    block = 4
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(40), block_tokens=block, pin_share=0.5)
    system = tuple(range(10))  # two full blocks and a partial one of 2 tokens
    publish(service, system)
    pinned = service.pin(system, seconds=100.0)
    assert pinned.tokens == 10 and pinned.nbytes == SPEC.bytes_for(10)
    publish(service, system + (50, 51, 52, 53))  # the partial block is now covered by a full one
    for k in range(12):  # other prompts fill RAM many times over
        publish(service, tuple(range(1000 * (k + 1), 1000 * (k + 1) + 12)))
    assert service.peek_prefix_len(system + (99,)) == 10
    assert service.report().pinned_entries == 3
    service.tick(now=200.0)
    for k in range(12):
        publish(service, tuple(range(50_000 + 1000 * k, 50_000 + 1000 * k + 12)))
    assert service.peek_prefix_len(system + (99,)) == 0 and service.report().pinned_bytes == 0
