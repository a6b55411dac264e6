"""Every limit at its edge: the last value a setting, a request or a budget accepts, and the first it
refuses. The model checks rarely land exactly on an edge; these do, on the simulator."""

import pytest

from kvstate import (ContextLimitExceeded, InvalidConfig, InvalidRequest, KvCacheService, NotAdmitted, OverBudget,
                     Request, RequestAlreadyAcquired, ServiceConfig, SimObject, model_spec, retention)
from kvstate.core import events
from kvstate.core.replies import GaveBack
from kvstate.core.state import initial_state
from kvstate.core.transitions import step

SPEC = model_spec("llama-3.2-1b")
SIZES = ("ram_capacity_bytes", "kv_budget_bytes", "disk_capacity_bytes", "write_queue_bytes")


def config(**options) -> ServiceConfig:
    return ServiceConfig(**{"model": SPEC, "ram_capacity_bytes": 100, **options})


def accepted_or_named(name: str, value, accepted: bool) -> None:
    """Setting ``name`` to ``value`` is accepted as given, or refused with an error that names it."""
    if accepted:
        assert getattr(config(**{name: value}), name) == value
    else:
        with pytest.raises(InvalidConfig, match=name):
            config(**{name: value})


@pytest.mark.parametrize("name", SIZES)
def test_every_size_setting_accepts_zero_and_refuses_minus_one(name):
    assert getattr(config(**{name: 0}), name) == 0
    with pytest.raises(InvalidConfig, match=name):
        config(**{name: -1})


@pytest.mark.parametrize("name, optional", [("ram_capacity_bytes", False), ("kv_budget_bytes", True),
                                            ("disk_capacity_bytes", True), ("write_queue_bytes", False)])
def test_only_the_optional_sizes_may_be_none(name, optional):
    if optional:
        assert getattr(config(**{name: None}), name) is None
    else:
        with pytest.raises(InvalidConfig, match=name):
            config(**{name: None})


@pytest.mark.parametrize("seconds, accepted", [(0.001, True), (0.5, True), (1, True), (0, False), (-1, False)])
def test_demotion_takes_any_positive_idle_time(seconds, accepted):
    accepted_or_named("demote_idle_after", seconds, accepted)


def test_checkpoints_every_token_is_allowed_and_need_a_disk_tier():
    assert config(disk_capacity_bytes=10, checkpoint_every_tokens=1).checkpoints
    assert not config(checkpoint_every_tokens=1).checkpoints  # no disk, no checkpoints
    assert not config(disk_capacity_bytes=10).checkpoints


def test_short_prefixes_protects_up_to_its_length_and_needs_a_positive_one():
    protect = retention.short_prefixes(1)
    request = Request((1, 2), 1)
    assert protect("n", (1,), request) and not protect("n", (1, 2), request)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(InvalidConfig, match="max_tokens"):
            retention.short_prefixes(bad)


@pytest.mark.parametrize("session", ["", 5, b"s"])
def test_a_session_id_is_a_non_empty_string(session):
    with pytest.raises(InvalidRequest, match="session_id"):
        Request((1, 2), 1, session_id=session)


def test_an_object_key_is_a_non_empty_string():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100))
    before = service.state
    for bad in ("", None, 3):
        with pytest.raises(InvalidRequest, match="object key"):
            service.objects.put(bad, SimObject("x", 10))
    assert service.state == before


def test_without_ram_an_object_is_not_kept_and_that_is_counted():
    service = KvCacheService.simulated(SPEC, ram_bytes=0)
    assert not service.objects.put("image", SimObject("image", 10))
    report = service.report()
    assert (report.not_kept, report.kept, report.entries) == (1, 0, 0)
    assert service.objects.get("image") is None


def test_a_request_exactly_at_the_context_limit_is_admitted_one_past_it_is_not():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100))
    limit = SPEC.context_limit
    assert service.admit(Request(tuple(range(10)), limit - 10))
    with pytest.raises(ContextLimitExceeded):
        service.admit(Request(tuple(range(10)), limit - 9))


def test_a_request_exactly_at_the_budget_is_admitted_and_fills_it():
    need = SPEC.bytes_for(50)
    service = KvCacheService.simulated(SPEC, ram_bytes=need, kv_budget_bytes=need)
    assert service.admit(Request(tuple(range(10)), 40))
    assert service.report().projected_bytes == need
    assert not service.admit(Request((1,), 1))  # nothing left: waits
    with pytest.raises(OverBudget):
        KvCacheService.simulated(SPEC, ram_bytes=need, kv_budget_bytes=need - 1).admit(Request(tuple(range(10)), 40))


def test_acquiring_without_admission_admits_implicitly_and_never_bypasses_the_budget():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100), kv_budget_bytes=SPEC.bytes_for(10))
    request = Request((1, 2, 3), 4)                       # 7 tokens projected: fits
    service.acquire(request, "n")
    assert service.report().projected_bytes == SPEC.bytes_for(7)
    other = Request((4, 5, 6), 4)                         # 7 more would be 14 > 10
    before = service.state
    with pytest.raises(NotAdmitted, match="admit"):
        service.acquire(other, "n")
    assert service.state == before
    with pytest.raises(OverBudget):
        service.acquire(Request(tuple(range(8)), 4), "n")  # 12 > 10 on its own: never
    service.release(request)
    assert (service.report().projected_bytes, service.report().live_requests) == (0, 0)
    service.acquire(other, "n")                           # room now
    assert service.report().projected_bytes == SPEC.bytes_for(7)


def test_try_acquire_admits_and_acquires_at_once_or_waits_holding_nothing():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100), kv_budget_bytes=SPEC.bytes_for(10))
    first = Request((1, 2, 3), 4)                         # 7 tokens projected: fits
    state = service.try_acquire(first, "n")
    assert state is not None and state.reused_tokens == 0
    assert (service.report().projected_bytes, service.report().misses) == (SPEC.bytes_for(7), 1)
    service.publish(first, "n", (1, 2, 3), service.interpreter.prefill(state.caches, (1, 2, 3)))
    other = Request((1, 2, 3, 9), 4)                      # 8 more would be 15 > 10: waits
    before = service.state
    assert service.try_acquire(other, "n") is None
    assert service.state == before
    with pytest.raises(OverBudget):
        service.try_acquire(Request(tuple(range(8)), 4), "n")  # 12 > 10 on its own: never
    with pytest.raises(ContextLimitExceeded):
        service.try_acquire(Request((1,), SPEC.context_limit), "n")
    assert service.state == before
    service.release(first)
    state = service.try_acquire(other, "n")               # room now: admitted, and its prefix reused
    assert state is not None and state.reused_tokens == 3
    assert service.report().projected_bytes == SPEC.bytes_for(8)
    with pytest.raises(RequestAlreadyAcquired):
        service.try_acquire(other, "n")


def test_published_tokens_are_checked_where_they_differ_from_the_prompt():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100))
    request = Request((1, 2, 3), 4)
    state = service.acquire(request, "n")
    caches = service.interpreter.prefill(state.caches, (1, 2, 3, 4))
    before = service.state
    with pytest.raises(InvalidRequest, match="negative"):
        service.publish(request, "n", (-1, 2, 3, 4), caches)
    with pytest.raises(InvalidRequest, match="negative"):
        service.publish(request, "n", (1, 2, 3, -4), caches)
    assert service.state == before


def test_the_initial_state_holds_nothing_and_counts_nothing():
    state = initial_state(config(disk_capacity_bytes=10))
    counts = state.counters
    assert counts._asdict() == dict.fromkeys(counts._fields, 0)
    assert (state.ram.bytes, state.disk.bytes, state.projected_bytes, len(state.entries)) == (0, 0, 0, 0)


def serve(service, prompt, namespace="n"):
    request = Request(prompt, 4)
    state = service.acquire(request, namespace)
    caches = service.interpreter.prefill(state.caches, tuple(prompt[state.reused_tokens:]))
    kept = service.publish(request, namespace, tuple(prompt), caches)
    service.release(request)
    return kept


@pytest.mark.parametrize("room, written", [(0, False), (-1, False), (None, True)])
def test_a_write_that_does_not_fit_the_write_queue_is_dropped_and_counted(room, written):
    """``room``: the queue's bytes less the write's (None: exactly the write's bytes fit)."""
    nbytes = SPEC.bytes_for(20)
    queue = {0: 0, -1: nbytes - 1, None: nbytes}[room]
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(100), disk_bytes=SPEC.bytes_for(100),
                                       write_queue_bytes=queue, interpreter_options={"deferred_writes": True})
    assert serve(service, tuple(range(20)))
    report = service.report()
    assert report.bytes == nbytes
    assert (report.pending_writes, report.dropped_writes) == ((1, 0) if written else (0, 1))
    assert report.entries == 1  # the RAM copy serves either way


def test_one_byte_of_ram_is_enough_to_keep_state():
    service = KvCacheService.simulated(SPEC, ram_bytes=1)
    assert serve(service, (1, 2, 3)) is False  # too large, yet publishing is allowed: the service keeps state
    assert service.report().not_kept == 1


def test_protected_entries_are_evicted_only_after_every_other():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(44), policy="lru",
                                       retention=retention.short_prefixes(5))
    serve(service, (9, 9, 9, 9, 9))          # protected, and the least recently used
    serve(service, tuple(range(20)))
    serve(service, tuple(range(100, 120)))  # no room for all three: the unprotected 20-token one goes
    assert service.peek_prefix_len((9, 9, 9, 9, 9, 1), "n") == 5
    assert service.peek_prefix_len(tuple(range(20)) + (1,), "n") == 0
    assert service.peek_prefix_len(tuple(range(100, 120)) + (1,), "n") == 20
    assert service.report().evictions == 1


def test_a_boundary_with_nothing_to_give_back_gives_back_nothing():
    state = initial_state(config())
    for pressure in (True, False):
        assert step(state, events.Boundary(pressure=pressure)).reply == GaveBack(0, 0)


@pytest.mark.parametrize("name, value, accepted", [
    ("pin_share", 0, True), ("pin_share", 1, True), ("pin_share", 0.25, True), ("pin_share", 1.5, False),
    ("pin_share", -0.1, False), ("pin_share", "0.5", False), ("pin_share", True, False),
    ("max_pin_seconds", 0, True), ("max_pin_seconds", 600.0, True), ("max_pin_seconds", -1, False),
    ("max_pin_seconds", float("inf"), False), ("max_pin_seconds", "60", False), ("max_pin_seconds", False, False),
])
def test_pin_settings_take_a_share_and_finite_seconds(name, value, accepted):
    accepted_or_named(name, value, accepted)


@pytest.mark.parametrize("value, accepted", [(1, True), (256, True), (None, True), (0, False), ("256", False),
                                             (True, False), (2.5, False)])
def test_blocks_hold_a_positive_whole_number_of_tokens(value, accepted):
    accepted_or_named("block_tokens", value, accepted)


@pytest.mark.parametrize("value, accepted", [("reuse", True), ("bytes", True), ("marconi", False), (None, False)])
def test_snapshot_admission_is_one_of_its_rules(value, accepted):
    accepted_or_named("snapshot_admission", value, accepted)


@pytest.mark.parametrize("options, accepted", [
    ({"block_tokens": 256, "disk_capacity_bytes": 1000}, True),
    ({"block_tokens": 256}, False),                                # no disk tier to keep what it fetches
    ({"disk_capacity_bytes": 1000}, False),                        # whole prefixes: no blocks to share
])
def test_a_shared_tier_needs_blocks_and_a_disk(options, accepted):
    if accepted:
        assert config(remote_tier=True, **options).remote_tier
    else:
        with pytest.raises(InvalidConfig, match="remote_tier needs"):
            config(remote_tier=True, **options)
