"""The disk tier, prefetch, demotion, flush, restart and checkpoint decisions, on the simulator."""

import pytest

from kvstate import Continuation, KvCacheService, Request, Source, model_spec
from kvstate.effects import DiskKey
from kvstate.interpreters.simulator import FaultPlan, SimDisk

SPEC = model_spec("llama-3.2-1b")


def build(disk=None, faults=None, deferred=False, **options):
    return KvCacheService.simulated(
        SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(2000),
        interpreter_options={"disk": disk if disk is not None else SimDisk(), "faults": faults or FaultPlan(),
                             "deferred_writes": deferred}, **options)


def serve(service, prompt, namespace="n", session=None, extra=()):
    request = Request(prompt, 4, session_id=session)
    state = service.acquire(request, namespace)
    assert state.caches.tokens == tuple(prompt[:state.reused_tokens])
    caches = service.interpreter.prefill(state.caches, tuple(prompt[state.reused_tokens:]) + tuple(extra))
    service.publish(request, namespace, tuple(prompt) + tuple(extra), caches)
    service.release(request)
    return state


def test_evicted_prefixes_come_back_from_disk():
    service = build()
    first = tuple(range(200))
    serve(service, first)
    serve(service, tuple(range(1000, 1200)))  # evicts the first from RAM; it stays on disk
    assert service.peek_prefix_len(first + (7,), "n") == 0
    state = serve(service, first + (7,))
    assert (state.source, state.reused_tokens) == (Source.DISK, 200)
    report = service.report()
    assert report.restores == 1 and report.evictions >= 1 and report.spills >= 2


def test_a_corrupt_file_is_rejected_counted_and_the_next_best_prefix_used():
    disk = SimDisk()
    service = build(disk)
    base = tuple(range(100))
    serve(service, base)
    serve(service, base + tuple(range(500, 600)))
    serve(service, tuple(range(2000, 2200)))  # both leave RAM
    disk.corrupt(DiskKey("n", base + tuple(range(500, 600))))
    state = serve(service, base + tuple(range(500, 650)))
    assert (state.source, state.reused_tokens) == (Source.DISK, 100)
    assert service.report().rejected_files == 1
    assert disk.rejected and disk.rejected[0][0].tokens[-1] == 599


def test_a_file_of_another_model_is_never_restored():
    disk = SimDisk()
    service = build(disk)
    serve(service, tuple(range(200)))
    assert service.flush().durable
    other = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(2000),
                                     interpreter_options={"disk": disk, "identity": "another-model"})
    assert other.report().saved_entries == 0 and other.report().rejected_files == 1
    assert serve(other, tuple(range(201))).reused_tokens == 0


def test_failed_writes_leave_the_ram_copy_and_flush_says_not_durable():
    service = build(faults=FaultPlan(fail_writes={1, 2}))
    serve(service, tuple(range(50)))
    assert service.report().failed_writes == 1
    assert service.report().entries == 1
    result = service.flush()  # the retry is write 2, which fails too
    assert not result.durable and result.ram_only_entries == 1
    assert service.flush().durable  # write 3 succeeds


def test_flush_then_crash_and_restart_finds_every_kept_prefix():
    disk = SimDisk()
    service = build(disk, deferred=True)
    prompts = [tuple(range(i * 100, i * 100 + 60)) for i in range(3)]
    for prompt in prompts:
        serve(service, prompt)
    assert service.report().pending_writes == 3
    assert service.flush().durable
    restarted = build(disk)
    for prompt in prompts:
        assert serve(restarted, prompt + (1,)).reused_tokens == 60


def test_entries_pinned_by_a_write_in_flight_are_not_evicted():
    from kvstate.core import events as ev
    from kvstate.core.replies import Pending
    from kvstate.core.transitions import step

    service = build(deferred=True)
    serve(service, tuple(range(200)))
    request, tokens = Request(tuple(range(1000, 1200)), 4), tuple(range(1000, 1200))
    decided = step(service.state, ev.Publish(request, "n", tokens, 99, 200, SPEC.bytes_for(200), True,
                                                    SPEC.bytes_for(200)))
    assert decided.reply == Pending()  # the first is pinned by its write: wait for it
    assert [type(e).__name__ for e in decided.effects] == ["Sync"]


def test_publish_waits_for_writes_in_flight_when_they_pin_all_of_ram():
    service = build(deferred=True)
    serve(service, tuple(range(200)))
    serve(service, tuple(range(1000, 1200)))  # backpressure: the first write completes, then it can go
    report = service.report()
    assert report.entries == 1 and report.not_kept == 0 and report.kept == 2 and report.evictions == 1
    assert serve(service, tuple(range(201))).source is Source.DISK


def test_idle_entries_are_demoted_to_disk():
    service = build(demote_idle_after=60.0)
    serve(service, tuple(range(100)))
    service.tick(30.0)
    assert service.report().entries == 1
    service.tick(61.0)
    report = service.report()
    assert report.entries == 0 and report.demotions == 1 and report.saved_entries == 1


def test_prefetch_reads_a_saved_prefix_into_ram():
    service = build()
    prompt = tuple(range(200))
    serve(service, prompt)
    serve(service, tuple(range(1000, 1200)))
    assert service.peek_prefix_len(prompt + (1,), "n") == 0
    assert service.prefetch(prompt + (1,), "n")
    assert service.peek_prefix_len(prompt + (1,), "n") == 200
    assert service.report().prefetches == 1


def test_pressure_gives_ram_back_spilling_first():
    held = {"limit": None}
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(2000),
                                       write_behind=False,
                                       pressure=lambda nbytes: held["limit"] is not None and nbytes > held["limit"])
    serve(service, tuple(range(100)))
    serve(service, tuple(range(500, 600)))
    held["limit"] = SPEC.bytes_for(100)
    service.boundary()
    report = service.report()
    assert report.entries == 1 and report.saved_entries == 1 and report.demotions == 1
    assert serve(service, tuple(range(101))).reused_tokens == 100  # spilled, not lost


def test_session_affinity_prefers_the_sessions_own_state():
    service = build()
    shared = tuple(range(50))
    serve(service, shared, session="a", extra=(1, 2))
    serve(service, shared, session="b", extra=(3, 4))
    serve(service, shared + (9,), session="a")
    report = service.report()
    assert (report.session_hits, report.session_misses) == (1, 0)
    service.close_session("a")
    serve(service, shared + (9,), session="a")
    assert service.report().session_hits == 1


def test_non_trimmable_models_reuse_only_exact_positions():
    spec = model_spec("qwen3-next-80b-a3b")
    service = KvCacheService.simulated(spec, ram_bytes=spec.bytes_for(200) * 4)
    prompt = tuple(range(100))
    serve(service, prompt)
    assert serve(service, prompt[:80] + (5,)).reused_tokens == 0
    assert serve(service, prompt + (5,)).reused_tokens == 100


def test_checkpoint_decisions_resume_and_completion():
    disk = SimDisk()
    service = build(disk, checkpoint_every_tokens=4)
    request = Request(tuple(range(10)), 20, continuation=Continuation("gen-1", seed=3, seed_was_explicit=True))
    state = service.acquire(request, "n")
    caches = service.interpreter.prefill(state.caches, tuple(range(10)) + (50, 51, 52, 53))
    assert service.checkpoint(request, caches, caches.tokens, generated_tokens=4, pending_token=54)
    flushed = service.flush()
    assert flushed.durable and flushed.pending_writes == 0 and flushed.pending_write_bytes == 0
    service.release(request, completed=False)
    assert service.report().checkpoints == 1
    again = Request(tuple(range(10)), 20, continuation=Continuation("gen-1", seed=99))
    resumed = service.acquire(again, "n")
    assert resumed.source is Source.CHECKPOINT and resumed.resumed_tokens == caches.tokens
    assert resumed.resumed.pending_token == 54 and resumed.resumed.seed == 3
    assert resumed.caches.tokens == caches.tokens
    service.release(again, completed=True)
    assert service.report().checkpoints == 0 and not disk.checkpoints
    other_namespace = Request(tuple(range(10)), 20, continuation=Continuation("gen-1", seed=3))
    assert service.acquire(other_namespace, "m").source is not Source.CHECKPOINT


def test_observers_see_every_kept_prefix():
    service = build()
    seen = []
    service.interpreter.observers.append(lambda tokens, namespace: seen.append((namespace, len(tokens))))
    serve(service, tuple(range(30)))
    assert seen == [("n", 30)]


def test_close_flushes_clears_and_is_idempotent():
    disk = SimDisk()
    service = build(disk, deferred=True)
    serve(service, tuple(range(30)))
    first = service.close()
    assert first.durable and service.report().entries == 0
    assert service.close() == first
    assert len(disk.files) == 1


def test_a_crash_between_effects_loses_only_what_was_not_durable():
    from kvstate import SimulatedCrash

    disk, faults = SimDisk(), FaultPlan()
    service = build(disk, faults, deferred=True)
    durable = tuple(range(60))
    serve(service, durable)
    assert service.flush().durable
    faults.crash_before_effect = service.interpreter.stats.effects + 3
    with pytest.raises(SimulatedCrash):
        for start in (1000, 2000, 3000):
            serve(service, tuple(range(start, start + 60)))
    faults.crash_before_effect = None
    restarted = build(disk, faults)
    held = {tokens for _, tokens, _, _ in restarted.state.disk.index.items()}
    assert durable in held  # flushed before the crash: found
    for tokens in held:  # nothing claimed that was not written whole
        assert disk.files[DiskKey("n", tokens)].content == tokens
    assert serve(restarted, durable + (1,)).reused_tokens == 60


def test_an_entry_idle_exactly_the_threshold_is_demoted():
    service = build(demote_idle_after=60.0)
    serve(service, tuple(range(100)))  # used at time 0
    service.tick(59.999)
    assert service.report().demotions == 0
    service.tick(60.0)
    assert service.report().demotions == 1


def test_admitting_after_acquiring_holds_the_projected_bytes_once():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), kv_budget_bytes=SPEC.bytes_for(1000))
    request = Request(tuple(range(100)), 50)
    service.acquire(request, "n")  # admitted implicitly
    assert service.report().projected_bytes == SPEC.bytes_for(150)
    assert service.admit(request)  # already admitted: nothing more is held
    assert service.report().projected_bytes == SPEC.bytes_for(150)
    service.release(request)
    assert service.report().projected_bytes == 0


def test_checkpoint_of_a_request_without_a_continuation_says_so():
    from kvstate import CheckpointNotAllowed
    service = build(checkpoint_every_tokens=4)
    request = Request(tuple(range(10)), 20)
    state = service.acquire(request, "n")
    caches = service.interpreter.prefill(state.caches, tuple(range(10)))
    with pytest.raises(CheckpointNotAllowed, match="continuation"):
        service.checkpoint(request, caches, caches.tokens, generated_tokens=0)


def test_the_report_counts_prefill_tokens_saved_exactly():
    service = build()
    assert service.report().prefill_tokens_saved == 0
    serve(service, tuple(range(40)))
    state = serve(service, tuple(range(40)) + (1, 2))
    assert service.report().prefill_tokens_saved == state.reused_tokens == 40


def test_a_disk_tier_filled_exactly_evicts_nothing():
    one = SPEC.bytes_for(100)
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=2 * one)
    serve(service, tuple(range(100)))
    serve(service, tuple(range(1000, 1100)))
    report = service.report()
    assert report.saved_bytes == 2 * one and report.disk_evictions == 0
    serve(service, tuple(range(2000, 2100)))
    assert service.report().disk_evictions == 1
