"""The hardware's pace: a disk hit serves only where reading it back beats prefilling the same tokens,
and state that could never pay back its read is not written; on the simulator, whose reads report
the seconds its cost model gives them, and on the MLX interpreter, whose reads are timed."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from kvstate import InvalidRequest, KvCacheService, Request, Source, model_spec
from kvstate.interpreters.simulator import CostModel, SimDisk

SPEC = model_spec("llama-3.2-1b")
READ_BYTES_PER_S = 1e9


def build(**options):
    return KvCacheService.simulated(
        SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000),
        interpreter_options={"disk": SimDisk(), "cost": CostModel(restore_bytes_per_second=READ_BYTES_PER_S)},
        **options)


def serve(service, prompt, namespace="n"):
    request = Request(prompt, 4)
    state = service.acquire(request, namespace)
    caches = service.interpreter.prefill(state.caches, tuple(prompt[state.reused_tokens:]))
    service.publish(request, namespace, tuple(prompt), caches)
    service.release(request)
    return state


def read_seconds_per_token() -> float:
    """What the simulated disk takes to read back one token of this model's state (headers aside)."""
    return SPEC.bytes_for(1000) / 1000 / READ_BYTES_PER_S


_evictors = iter(range(100_000, 10**9, 1000))


def evicted_to_disk(service, prompt):
    """``prompt`` kept, then pushed out of RAM by a new prompt of 240 tokens: only its file holds it."""
    serve(service, prompt)
    start = next(_evictors)
    serve(service, tuple(range(start, start + 240)))
    assert service.peek_prefix_len(prompt + (1,), "n") == 0


def test_while_the_pace_is_unknown_every_disk_hit_is_taken():
    service = build()
    prompt = tuple(range(200))
    evicted_to_disk(service, prompt)
    state = serve(service, prompt + (1,))
    assert (state.source, state.reused_tokens) == (Source.DISK, 200)
    report = service.report()
    assert report.restores_passed_up == 0 and report.prefill_tokens_per_s is None
    # the read reported its seconds: the read pace is known now
    assert report.read_bytes_per_s == pytest.approx(READ_BYTES_PER_S, rel=0.05)


def test_a_disk_hit_slower_than_prefilling_its_tokens_is_passed_up_for_a_prefill():
    service = build()
    first = tuple(range(200))
    evicted_to_disk(service, first)
    serve(service, first + (1,))  # a read: its pace is learnt
    second = tuple(range(500, 700))
    evicted_to_disk(service, second)  # written while the prefill pace was unknown
    fast = read_seconds_per_token() / 10
    service.measure_prefill(1000, 1000 * fast)  # prefill ten times faster than the read
    state = serve(service, second + (1,))
    assert (state.source, state.reused_tokens) == (Source.FRESH, 0)
    report = service.report()
    assert report.restores_passed_up == 1 and report.restores == 1
    assert report.prefill_tokens_per_s == pytest.approx(1 / fast)


def test_a_disk_hit_faster_than_the_prefill_it_saves_is_taken():
    service = build()
    first = tuple(range(200))
    evicted_to_disk(service, first)
    serve(service, first + (1,))
    service.measure_prefill(1000, 1000 * read_seconds_per_token() * 10)  # prefill ten times slower
    second = tuple(range(500, 700))
    evicted_to_disk(service, second)
    state = serve(service, second + (1,))
    assert (state.source, state.reused_tokens) == (Source.DISK, 200)
    assert service.report().restores_passed_up == 0


def test_what_ram_already_covers_is_not_counted_as_saved_by_the_read():
    """A disk entry a little longer than the RAM one saves only the difference: it is read only if
    reading its whole file beats prefilling that difference."""
    service = build()
    base = tuple(range(150))
    longer = base + tuple(range(2000, 2050))
    evicted_to_disk(service, longer)
    serve(service, longer + (1,))  # a disk hit: the read pace is learnt
    serve(service, tuple(range(30_000, 30_200)))  # pushes it out of RAM again
    service.measure_prefill(1000, 1000 * read_seconds_per_token() * 2)  # prefill twice as slow as a read
    serve(service, base)  # worth a read (149 tokens saved for a file of 201): RAM now holds the 150
    assert service.report().restores == 2
    state = serve(service, longer + (2,))
    # RAM covers 150; the file would add 50 tokens for a read of 201: passed up
    assert (state.source, state.reused_tokens) == (Source.RAM, 150)
    assert service.report().restores_passed_up == 1


def test_state_that_could_never_pay_back_its_read_is_not_written_but_flush_still_writes_it():
    service = build()
    first = tuple(range(200))
    evicted_to_disk(service, first)
    serve(service, first + (1,))
    service.measure_prefill(1000, 1000 * read_seconds_per_token() / 10)
    written = service.report().bytes_written
    serve(service, tuple(range(3000, 3100)))
    report = service.report()
    assert report.spills_passed_up >= 1 and report.bytes_written == written
    assert service.flush().durable  # durability asked for is not second-guessed
    assert service.report().bytes_written > written


def test_pressure_drops_what_is_not_worth_writing_instead_of_spilling_it():
    held = {"limit": None}
    service = KvCacheService.simulated(
        SPEC, ram_bytes=SPEC.bytes_for(1000), disk_bytes=SPEC.bytes_for(4000), write_behind=False,
        pressure=lambda nbytes: held["limit"] is not None and nbytes > held["limit"],
        interpreter_options={"disk": SimDisk(), "cost": CostModel(restore_bytes_per_second=READ_BYTES_PER_S)})
    serve(service, tuple(range(100)))
    held["limit"] = 0
    service.boundary()  # pace unknown: given back by a spill
    assert service.report().spills == 1
    held["limit"] = None
    serve(service, tuple(range(100)) + (5,))  # a disk hit: the read pace is learnt
    service.measure_prefill(1000, 1000 * read_seconds_per_token() / 10)
    serve(service, tuple(range(500, 600)))
    held["limit"] = 0
    service.boundary()
    report = service.report()
    assert report.spills == 1 and report.spills_passed_up >= 1 and report.entries == 0


@pytest.mark.parametrize("tokens, seconds", [(-1, 1.0), (1.5, 1.0), (True, 1.0), (10, -1.0), (10, math.nan),
                                             (10, "1")])
def test_a_bad_prefill_measure_is_refused_and_changes_nothing(tokens, seconds):
    service = build()
    before = service.state
    with pytest.raises(InvalidRequest):
        service.measure_prefill(tokens, seconds)
    assert service.state is before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e-7, 1e-2), min_size=1, max_size=6),
       st.sampled_from([1e8, 1e9, 1e10]), st.integers(20, 240))
def test_the_choice_follows_the_paces_as_decayed_sums_of_the_samples_give_them(prefill_samples, read_rate,
                                                                                    length):
    """The reference: fold each pace's samples into decayed sums of seconds and tokens, as documented,
    then compare the seconds of reading the file with those of prefilling its tokens."""
    service = KvCacheService.simulated(
        SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000),
        interpreter_options={"disk": SimDisk(), "cost": CostModel(restore_bytes_per_second=read_rate)})
    warm = tuple(range(50_000, 50_000 + 200))
    evicted_to_disk(service, warm)
    serve(service, warm + (1,))  # one read: the read pace is one sample
    prompt = tuple(range(length))
    evicted_to_disk(service, prompt)  # written while the prefill pace is unknown
    for per_token in prefill_samples:
        service.measure_prefill(1000, 1000 * per_token)
    seconds = tokens = 0.0
    for sample in prefill_samples:  # each sample 1,000 tokens: the sums decay by a quarter a sample
        seconds, tokens = 0.75 * seconds + 1000 * sample, 0.75 * tokens + 1000
    prefill = seconds / tokens
    entry = next(e for e in service.state.entries.values() if e.tokens == prompt)
    read = service.state.pace.read_s_per_byte
    assert read == pytest.approx(1 / read_rate, rel=1e-9)
    state = serve(service, prompt + (1,))
    expected = Source.DISK if entry.file_bytes * read < length * prefill else Source.FRESH
    assert state.source is expected


def test_a_prefill_of_nothing_or_in_no_time_is_no_measure():
    service = build()
    service.measure_prefill(0, 1.0)
    service.measure_prefill(500, 0.0)  # a clock too coarse to see it
    assert service.state.pace.prefill_s_per_token is None
    service.measure_prefill(500, 0.5)
    assert service.state.pace.prefill_s_per_token == pytest.approx(1e-3)


def test_a_read_of_no_bytes_is_no_measure_and_a_read_of_one_byte_is():
    from kvstate.core.draft import Draft
    from kvstate.core.pace import read_measured

    d = Draft(build().state)
    read_measured(d, 0, 1.0)  # nothing read: no pace (and no division by zero)
    assert d.pace.read_s_per_byte is None
    read_measured(d, 1, 2.0)
    assert d.pace.read_s_per_byte == 2.0


def test_idle_state_that_could_never_pay_back_its_read_is_not_written_and_not_counted_at_every_tick():
    service = build(write_idle_after=30.0)
    first = tuple(range(200))
    serve(service, first)
    assert service.flush().durable
    serve(service, tuple(range(90_000, 90_240)))  # pushes it out of RAM: only its file holds it
    serve(service, first + (1,))  # a disk hit: the read pace is learnt
    service.measure_prefill(1000, 1000 * read_seconds_per_token() / 10)  # prefill ten times faster
    serve(service, tuple(range(3000, 3100)))
    before = service.report()
    for seconds in (31.0, 62.0, 93.0):
        service.tick(seconds)
    after = service.report()
    assert after.bytes_written == before.bytes_written and after.spills == before.spills
    assert after.spills_passed_up == before.spills_passed_up  # a wait, tried again each tick, is not a decision


def test_a_small_read_mostly_fixed_costs_does_not_make_a_large_one_look_slow():
    """As on a GPU after a restart: a warm-up read of 4 MB took 12.5 ms (mostly opening and checking the
    file), then one of 880 MB took 200 ms. The pace weighs each read by what it moved, so the next
    880 MB hit is judged at about what it takes, and taken where its prefill (6,879 tokens at 10,000
    tokens a second) takes longer; a per-read average would have judged it at two seconds."""
    from kvstate.core.draft import Draft
    from kvstate.core.pace import prefill_measured, read_measured, read_pays
    from kvstate.core import events as ev

    d = Draft(build().state)
    read_measured(d, 4_000_000, 0.0125)
    read_measured(d, 880_000_000, 0.200)
    state = prefill_measured(d.step(None).state, ev.PrefillMeasured(6879, 0.6879)).state
    weighed = (0.75 * 0.0125 + 0.200) / (0.75 * 4_000_000 + 880_000_000)  # the earlier read decayed by a quarter
    assert state.pace.read_s_per_byte == pytest.approx(weighed, rel=1e-12)
    assert 880_000_000 * weighed < 0.21
    assert read_pays(state.pace, 880_000_000, 6879)
    assert not read_pays(state.pace, 880_000_000, 1000)  # a hit that saves 0.1 s of prefill does not pay


def test_each_pace_is_the_decayed_sums_of_its_samples():
    """Read and fetch paces alike: each sample adds to sums that earlier samples keep 3/4 of."""
    from kvstate.core.draft import Draft
    from kvstate.core.pace import read_measured, remote_measured
    from kvstate.core.state import ServiceConfig, initial_state
    from kvstate.models.catalogue import model_spec

    d = Draft(initial_state(ServiceConfig(model=model_spec("llama-3.1-8b"), ram_capacity_bytes=1 << 30)))
    for measured, seconds, nbytes in ((read_measured, "read_seconds", "read_bytes"),
                                      (remote_measured, "remote_seconds", "remote_bytes")):
        measured(d, 100, 1.0)
        measured(d, 200, 3.0)
        measured(d, 0, 9.0)      # nothing moved: no sample
        measured(d, 50, None)    # not timed: no sample
        assert getattr(d.pace, seconds) == 0.75 * 1.0 + 3.0
        assert getattr(d.pace, nbytes) == 0.75 * 100 + 200
