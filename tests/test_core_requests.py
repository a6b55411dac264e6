"""Admission under the KV budget, fits, the max_tokens a request may run with, and session affinity
(``core/requests.py``). Each scenario drives ``step`` by hand (``tests/core_driver.py``) and checks the exact
counters, effects, replies and pins that follow."""

import re

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvstate.core import events as ev
from kvstate.core.admission import alone_bytes
from kvstate.core.checks import most_tokens_within, size_text
from kvstate.core.errors import InvalidRequest, NotAdmitted, OverBudget, RequestKeepsNoState
from kvstate.core.replies import Admission, MaxTokensFit, Pending, Source
from kvstate.core.request import Request
from kvstate.core.state import Phase, ServiceConfig
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import SPEC, Core, on_disk_only, tiered


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
    over = budgeted(ev.FitMaxTokens(60, 11, requested=True)).refusal
    assert "KV budget of" in over and f"need {size_text(alone_bytes(budgeted.state.config, 71))} of KV" in over
    assert budgeted(ev.FitMaxTokens(60, 10, requested=True)) == MaxTokensFit(10)  # exactly the budget runs
    # A default refused for want of room: the refusal names what binds, the budget here, the context there.
    no_room = budgeted(ev.FitMaxTokens(70, 512, requested=False)).refusal
    assert "leaves no room" in no_room and "KV budget of" in no_room and "context limit" not in no_room
    assert "context limit of 100" in budgeted(ev.FitMaxTokens(100, 512, requested=False)).refusal
    with pytest.raises(InvalidRequest, match="max_tokens"):
        core(ev.FitMaxTokens(60, 0, requested=True))


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 300), off=st.sampled_from([-1, 0, 1]), step=st.sampled_from([None, 1, 16, 256]))
def test_the_most_tokens_within_a_budget_are_what_a_naive_count_finds(tokens, off, step):
    config = ServiceConfig(model=SPEC, ram_capacity_bytes=0, batch_padding_step=step)
    budget = max(0, alone_bytes(config, tokens) + off)
    naive = 0
    while alone_bytes(config, naive + 1) <= budget:
        naive += 1
    assert most_tokens_within(config, budget) == naive


def test_a_default_max_tokens_lowered_to_one_token_still_runs_and_a_budget_below_one_position_refuses():
    spec = attrs.evolve(SPEC, context_limit=100)
    assert Core(model=spec)(ev.FitMaxTokens(99, 512, requested=False)) == MaxTokensFit(1)
    tiny = Core(model=spec, kv_budget_bytes=spec.bytes_for(1) - 1)
    assert "leaves no room" in tiny(ev.FitMaxTokens(0, 512, requested=False)).refusal
    assert "KV budget" in tiny(ev.FitMaxTokens(0, 1, requested=True)).refusal


def test_an_acquire_never_admitted_is_refused_when_the_budget_has_no_room_unless_it_asks_to_wait():
    core = Core(kv_budget_bytes=SPEC.bytes_for(10))
    core.acquire((1, 2, 3))                                   # 7 tokens projected: admitted as it acquires
    before = core.state
    with pytest.raises(NotAdmitted, match="admit"):
        core.acquire((4, 5, 6))                               # 7 more: no room, and it did not ask to wait
    assert core.state == before
    assert core(ev.Acquire(99, Request((4, 5, 6), 4), "n", 500, or_wait=True)) is Admission.WAIT
    assert core.state == before
