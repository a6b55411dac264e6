"""What the disk tier writes, for the SSD's wear: a write once an entry sits idle, and a write-rate cap.

On the simulator, whose writes land at once: each kept entry's file bytes are
known from the report, so the tests say exactly which entries were written.
"""

import pytest
from hypothesis import given, settings, strategies as st

from kvstate import InvalidConfig, KvCacheService, Source, model_spec
from kvstate.interpreters.simulator import FaultPlan
from tests.test_pace import serve

SPEC = model_spec("llama-3.2-1b")
HOUR = 3600.0


def build(**options):
    return KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000), **options)


def file_bytes(prompt) -> int:
    """The bytes the simulator's file of ``prompt`` takes, measured by writing it alone."""
    service = build()
    serve(service, prompt)
    return service.report().bytes_written


# ---------------------------------------------------------------- a write once idle


def test_an_entry_is_written_once_idle_and_stays_in_ram():
    service = build(write_idle_after=30.0)
    serve(service, tuple(range(100)))
    assert service.report().spills == 0  # not when kept
    service.tick(29.0)
    assert service.report().spills == 0
    service.tick(30.0)
    report = service.report()
    assert report.spills == 1 and report.saved_entries == 1 and report.entries == 1 and report.demotions == 0
    service.tick(120.0)
    assert service.report().spills == 1  # one idle spell, one write


def test_a_use_restarts_the_idle_time():
    service = build(write_idle_after=30.0)
    prompt = tuple(range(100))
    serve(service, prompt)
    service.tick(20.0)
    assert serve(service, prompt + (7,)).reused_tokens == 100  # used at 20 s; keeps 101 tokens, superseding
    service.tick(45.0)
    assert service.report().spills == 0
    service.tick(50.0)
    assert service.report().spills == 1


def test_state_superseded_before_it_is_idle_is_never_written():
    service = build(write_idle_after=30.0)
    turn = tuple(range(100))
    serve(service, turn)
    service.tick(10.0)
    serve(service, turn + tuple(range(500, 550)))  # the next turn extends it: the shorter copy goes
    service.tick(100.0)
    report = service.report()
    assert report.superseded == 1 and report.spills == 1 and report.saved_entries == 1
    assert report.bytes_written == file_bytes(turn + tuple(range(500, 550)))


def test_state_evicted_before_it_is_idle_is_not_written():
    service = build(write_idle_after=30.0)
    first = tuple(range(200))
    serve(service, first)
    serve(service, tuple(range(1000, 1200)))  # evicts the first from RAM, unwritten
    service.tick(100.0)
    report = service.report()
    assert report.evictions == 1 and report.spills == 1
    assert serve(service, first + (1,)).source is Source.FRESH


def test_an_entry_whose_file_the_disk_drops_is_written_again_after_another_idle_spell():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(150),
                                       write_idle_after=30.0)
    first, second = tuple(range(100)), tuple(range(1000, 1100))
    serve(service, first)
    service.tick(30.0)
    assert service.report().spills == 1
    service.tick(40.0)
    serve(service, second)
    service.tick(70.0)  # the second is written; the disk holds one file, so the first's goes
    report = service.report()
    assert (report.spills, report.disk_evictions, report.entries) == (2, 1, 2)
    service.tick(99.0)
    assert service.report().spills == 2  # not at once: the disk has just chosen to drop it
    service.tick(100.0)
    report = service.report()
    assert (report.spills, report.disk_evictions) == (3, 2)


def test_flush_writes_what_is_not_idle_yet():
    service = build(write_idle_after=30.0)
    serve(service, tuple(range(100)))
    assert service.flush().durable
    assert service.report().saved_entries == 1


def test_without_write_behind_nothing_is_written_when_idle():
    service = build(write_idle_after=30.0, write_behind=False)
    serve(service, tuple(range(100)))
    service.tick(100.0)
    assert service.report().spills == 0


@pytest.mark.parametrize("exactly_one_fits", [True, False])
def test_idle_writes_wait_for_room_in_the_write_queue(exactly_one_fits):
    nbytes = SPEC.bytes_for(40)
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000),
                                       write_idle_after=30.0,
                                       write_queue_bytes=nbytes if exactly_one_fits else nbytes - 1,
                                       interpreter_options={"deferred_writes": True})
    serve(service, tuple(range(40)))
    serve(service, tuple(range(1000, 1040)))
    service.tick(31.0)  # both idle: the queue holds one write (or none)
    report = service.report()
    assert (report.pending_writes, report.dropped_writes) == ((1, 0) if exactly_one_fits else (0, 0))
    service.boundary()  # the write lands; the other waited for the room and takes it now
    service.tick(32.0)
    service.boundary()
    assert service.report().spills == (2 if exactly_one_fits else 0)


def test_an_idle_entry_that_could_never_pay_back_its_read_is_not_written():
    from kvstate.interpreters.simulator import CostModel, SimDisk

    read_bytes_per_s = 1e9
    service = KvCacheService.simulated(
        SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000), write_idle_after=30.0,
        interpreter_options={"disk": SimDisk(), "cost": CostModel(restore_bytes_per_second=read_bytes_per_s)})
    first = tuple(range(200))
    serve(service, first)
    service.tick(31.0)  # the pace is unknown: written
    serve(service, tuple(range(5000, 5200)))  # pushes the first out of RAM
    assert serve(service, first + (1,)).source is Source.DISK  # a read: its pace is learnt
    read_seconds_per_token = SPEC.bytes_for(1000) / 1000 / read_bytes_per_s
    service.measure_prefill(1000, 1000 * read_seconds_per_token / 10)  # prefill ten times faster than a read
    written = service.report().spills
    serve(service, tuple(range(9000, 9100)))
    service.tick(100.0)
    assert service.report().spills == written


def test_without_a_disk_tier_the_clock_moves_nothing():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), demote_idle_after=10.0,
                                       write_idle_after=10.0)
    serve(service, tuple(range(100)))
    service.tick(100.0)
    report = service.report()
    assert (report.entries, report.demotions, report.spills) == (1, 0, 0)


# ---------------------------------------------------------------- the write-rate cap


def test_spills_past_the_hours_bytes_are_not_made_and_the_clock_refills_them():
    prompts = [tuple(range(k * 1000, k * 1000 + 40)) for k in range(4)]
    one = file_bytes(prompts[0])
    service = build(write_bytes_per_hour=2 * one)
    for prompt in prompts[:3]:
        serve(service, prompt)
    report = service.report()
    assert (report.spills, report.spills_over_rate, report.bytes_written) == (2, 1, 2 * one)
    service.tick(HOUR / 2)  # half an hour refills one file's bytes
    serve(service, prompts[3])
    assert service.report().spills == 3


def test_an_idle_entry_the_cap_has_no_room_for_waits_for_the_refill():
    prompts = [tuple(range(k * 1000, k * 1000 + 40)) for k in range(2)]
    service = build(write_idle_after=30.0, write_bytes_per_hour=file_bytes(prompts[0]) * 3 // 2)
    serve(service, prompts[0])
    serve(service, prompts[1])
    service.tick(31.0)  # both are idle: the cap has room for one, the other waits (not refused, not lost)
    report = service.report()
    assert (report.spills, report.spills_over_rate) == (1, 0)
    service.tick(31.0 + HOUR / 4)  # a quarter hour refills 3/8 of a file: not room enough yet
    assert service.report().spills == 1
    service.tick(31.0 + HOUR / 2)  # half an hour, 3/4 of a file: room
    assert service.report().spills == 2 and service.report().saved_entries == 2


def test_an_idle_write_that_failed_waits_another_idle_spell():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(4000),
                                       write_idle_after=30.0,
                                       interpreter_options={"faults": FaultPlan(fail_writes={1})})
    serve(service, tuple(range(100)))
    service.tick(30.0)
    assert service.report().failed_writes == 1
    for now in (31.0, 40.0, 59.0):  # not tried again at every tick
        service.tick(now)
    assert service.report().failed_writes == 1 and service.report().spills == 0
    service.tick(60.0)
    report = service.report()
    assert report.spills == 1 and report.saved_entries == 1


def test_without_idle_writes_a_dropped_file_leaves_the_entrys_idle_time_alone():
    """Waiting another idle spell is the idle write's rule: where only demotion reads the clock, an
    entry whose file the full disk gave up is still demoted on the time of its last use."""
    first, second = tuple(range(100)), tuple(range(1000, 1100))
    one = file_bytes(first)
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=one * 3 // 2,
                                       demote_idle_after=30.0)
    serve(service, first)  # used and written at 0 s
    service.tick(20.0)
    serve(service, second)  # its write takes the disk from the first entry, which stays in RAM
    assert service.report().saved_entries == 1 and service.report().entries == 2
    service.tick(30.0)
    assert service.report().demotions == 1  # the first, idle since 0 s; the second is not idle yet


def test_flush_writes_past_the_cap_and_is_charged():
    prompts = [tuple(range(k * 1000, k * 1000 + 40)) for k in range(3)]
    one = file_bytes(prompts[0])
    service = build(write_bytes_per_hour=one)
    serve(service, prompts[0])
    serve(service, prompts[1])
    assert service.report().spills_over_rate == 1
    assert service.flush().durable
    assert service.report().saved_entries == 2
    service.tick(HOUR / 2)  # the flush's file is still being paid back
    serve(service, prompts[2])
    assert service.report().spills == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.floats(0, HOUR / 4)), min_size=1, max_size=30),
       st.integers(1, 6))
def test_spills_never_pass_the_cap_over_any_stretch_of_time(steps, files_per_hour):
    """A naive bucket over the same steps: what is written by time t never passes the bucket's hour
    plus its refill, and a spill is refused only when the bucket really has no room for it."""
    cap = files_per_hour * file_bytes(tuple(range(60)))
    service = build(write_bytes_per_hour=cap)
    now, written = 0.0, []
    for k, (length, wait) in enumerate(steps):
        now += wait
        service.tick(now)
        before = service.report()
        serve(service, tuple(range(k * 1000, k * 1000 + length)))
        after = service.report()
        wrote = after.bytes_written - before.bytes_written
        if wrote:
            written.append((now, wrote))
        for start, _ in written:  # every stretch of time that starts at a write
            inside = sum(nbytes for at, nbytes in written if at >= start)
            assert inside <= cap + cap * (now - start) / HOUR + 1e-6
        if after.spills_over_rate > before.spills_over_rate:
            spent = 0.0
            last = 0.0
            for at, nbytes in written:  # the naive bucket, replayed from the start
                spent = max(0.0, spent - cap * (at - last) / HOUR) + nbytes
                last = at
            spent = max(0.0, spent - cap * (now - last) / HOUR)
            refused = file_bytes(tuple(range(k * 1000, k * 1000 + length)))
            assert spent + refused > cap


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("options, named", [
    ({"write_idle_after": 0}, "write_idle_after"), ({"write_idle_after": -5.0}, "write_idle_after"),
    ({"write_idle_after": float("inf")}, "write_idle_after"), ({"write_idle_after": True}, "write_idle_after"),
    ({"write_bytes_per_hour": 0}, "write_bytes_per_hour"), ({"write_bytes_per_hour": -1}, "write_bytes_per_hour"),
    ({"write_bytes_per_hour": 2.5}, "write_bytes_per_hour"),
])
def test_bad_wear_settings_are_refused_by_name(options, named):
    with pytest.raises(InvalidConfig, match=named):
        build(**options)
