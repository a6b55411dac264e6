"""The server's batch admission (``interpreters/serving/batch_admission.py``) on the simulator: the
order in which waiting requests are admitted, and the waits for a prefix a row in prefill will publish."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstate import KvCacheService
from kvstate.interpreters.serving.batch_admission import BatchAdmission
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from tests.test_padded_batch_admission import BUDGET, SPEC, STEP


def test_a_request_waiting_for_a_shared_prefix_lets_unrelated_ones_go_first():
    """Head of line: A waits for the system prompt a row in prefill will publish; B, behind A,
    shares nothing with that row, so it is admitted at once instead of waiting out A's wait."""
    service = KvCacheService.simulated(SPEC, ram_bytes=BUDGET * 8, kv_budget_bytes=BUDGET * 8,
                                       batch_padding_step=STEP)
    admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=60.0, min_shared_tokens=8)
    system, user = list(range(1, 101)), list(range(500, 520))

    def item(prompt):
        return (SimpleNamespace(put=lambda _: None), SimpleNamespace(), SimpleNamespace(max_tokens=4)), prompt
    row, row_prompt = item(system + user)
    a, a_prompt = item(system + list(range(900, 910)))
    b, b_prompt = item(list(range(2000, 2030)))
    prompts = {id(row): row_prompt, id(a): a_prompt, id(b): b_prompt}
    arrivals = [row]

    def take(timeout):
        return arrivals.pop(0) if arrivals else None

    def tokenize(server_item):
        return (prompts[id(server_item)], [prompts[id(server_item)]], ["user"], "normal", None)
    assert admission.next_admitted(take, tokenize, 0) is row
    admission.placed([7], segments=[[system, user]], cached=[[]])  # a row in prefill: it publishes at 100
    arrivals.extend([a, b])
    assert admission.next_admitted(take, tokenize, 0) is b
    assert admission.shared_waits == 1 and [w.item for w in admission._waiting] == [a]
    assert service.report().live_requests == 2  # the row's lease and B's; A holds nothing while it waits


def _restarted_with_saved_blocks(prompt):
    """A simulated service in blocks of 4 whose disk holds ``prompt``'s blocks and whose RAM holds none
    (a restart), and whose reads ahead land when the caller collects them."""
    from kvstate import Request, SimCaches
    from kvstate.interpreters.simulator import SimDisk
    disk = SimDisk()

    def service():
        return KvCacheService.simulated(SPEC, ram_bytes=BUDGET * 8, disk_bytes=BUDGET * 64, block_tokens=4,
                                        interpreter_options={"disk": disk, "deferred_reads": True})
    first = service()
    lease = Request(prompt, 1)
    first.acquire(lease)
    first.publish(lease, "default", prompt, SimCaches(prompt, SPEC))
    first.release(lease)
    assert first.close().durable
    return service()


@pytest.mark.parametrize("read_ahead", [True, False, None], ids=["read-ahead", "no-read-ahead", "by-default"])
def test_saved_blocks_are_read_ahead_only_when_asked_and_the_batch_is_busy(read_ahead):
    """With ``read_ahead``, a request whose state only the disk holds has it read into RAM while a batch
    runs (it waits for the read, not the generation thread); arriving at an idle batch it is admitted at
    once and restores its own state, as every request does without ``read_ahead``."""
    saved = list(range(1, 13))
    service = _restarted_with_saved_blocks(tuple(saved))
    options = {} if read_ahead is None else {"read_ahead": read_ahead}  # off unless asked for
    admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=0.0, **options)
    idle, busy, row = saved + [40, 41], saved + [50, 51], list(range(200, 230))
    items = {}

    def item(prompt):
        server_item = (SimpleNamespace(put=lambda _: None), SimpleNamespace(), SimpleNamespace(max_tokens=4))
        items[id(server_item)] = prompt
        return server_item

    def tokenize(server_item):
        prompt = items[id(server_item)]
        return (prompt, [prompt], ["user"], "normal", None)
    arrivals = [item(idle)]

    def take(timeout):
        return arrivals.pop(0) if arrivals else None
    assert admission.next_admitted(take, tokenize, 0) is not None
    assert service.report().prefetches == 0  # the batch was idle: nothing to overlap a read with
    admission._end_unplaced()
    arrivals.append(item(row))
    assert admission.next_admitted(take, tokenize, 0) is not None
    admission.placed([1], segments=[[row]], cached=[[]])  # a row runs in the batch now
    arrivals.append(item(busy))
    assert admission.next_admitted(take, tokenize, 0) is not None
    assert service.report().prefetches == (1 if read_ahead else 0)
    assert service.peek_prefix_len(busy, "default") == (len(saved) if read_ahead else 0)


def _admission(share_wait_s=60.0, budget=BUDGET * 8):
    service = KvCacheService.simulated(SPEC, ram_bytes=BUDGET * 8, kv_budget_bytes=budget, batch_padding_step=STEP)
    return service, BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=share_wait_s, min_shared_tokens=8)


def _items(prompts_and_tokens, namespaces=None):
    """Server items for ``(prompt, max_tokens)`` pairs (each request in its namespace, where given), and
    ``take`` and ``tokenize`` over them."""
    from kvstate.interpreters.serving.tenants import NAMESPACE_ATTRIBUTE
    items, prompts = [], {}
    for n, (prompt, max_tokens) in enumerate(prompts_and_tokens):
        request = SimpleNamespace()
        if namespaces and namespaces[n] is not None:
            setattr(request, NAMESPACE_ATTRIBUTE, namespaces[n])
        item = (SimpleNamespace(put=lambda _: None), request, SimpleNamespace(max_tokens=max_tokens))
        items.append(item)
        prompts[id(item)] = prompt
    arrivals: list = []

    def take(timeout):
        return arrivals.pop(0) if arrivals else None

    def tokenize(server_item):
        return (prompts[id(server_item)], [prompts[id(server_item)]], ["user"], "normal", None)
    return items, arrivals, take, tokenize


def test_a_tenant_never_waits_for_another_tenants_prefill_of_the_same_prefix():
    """The row in prefill is tenant X's; A sends the same system prompt as tenant Y: nothing X computes
    can serve Y, so A is admitted at once, where the same request of X's own would wait."""
    system, user = list(range(1, 101)), list(range(500, 520))
    for a_namespace, waits in (("tenant-y", False), ("tenant-x", True)):
        service, admission = _admission()
        (row, a), arrivals, take, tokenize = _items([(system + user, 4), (system + list(range(900, 910)), 4)],
                                                    namespaces=["tenant-x", a_namespace])
        arrivals.append(row)
        assert admission.next_admitted(take, tokenize, 0) is row
        admission.placed([7], segments=[[system, user]], cached=[[]])   # X's row in prefill publishes at 100
        arrivals.append(a)
        assert (admission.next_admitted(take, tokenize, 0) is None) is waits
        assert admission.shared_waits == (1 if waits else 0)


def test_under_a_full_budget_a_later_request_never_overtakes_an_earlier_one_waiting_for_room():
    """A row holds most of the budget; A needs more than is left and waits; B, behind A, would fit in
    what is left, but room is first come, first served: B waits behind A, and A goes first once the row
    ends."""
    from kvstate import Request
    service, admission = _admission(share_wait_s=0.0, budget=BUDGET)
    a_prompt, b_prompt = list(range(1000, 1300)), list(range(2000, 2010))  # A fits the budget alone, not beside the row
    (row, a, b), arrivals, take, tokenize = _items([(list(range(1, 51)), 10), (a_prompt, 100), (b_prompt, 2)])
    arrivals.append(row)
    assert admission.next_admitted(take, tokenize, 0) is row
    admission.placed([1], segments=[[list(range(1, 51))]], cached=[[]])
    assert service.fits(Request(tuple(b_prompt), 2)) and not service.fits(Request(tuple(a_prompt), 100))
    arrivals.extend([a, b])
    assert admission.next_admitted(take, tokenize, None) is None       # A waits for room ...
    assert admission.next_admitted(take, tokenize, None) is None       # ... and B, though it would fit, behind it
    assert [w.item for w in admission._waiting] == [a, b] and admission.waited >= 1
    admission.ended([1])                                               # the row ends: room for A first
    assert admission.next_admitted(take, tokenize, None) is a


def _sharer_behind_a_row(share_wait_s):
    """An admission whose row in prefill will publish a system prompt, and A, which shares it, arriving:
    the admission, A, and ``take``, ``tokenize``."""
    system, user = list(range(1, 101)), list(range(500, 520))
    _, admission = _admission(share_wait_s=share_wait_s)
    (row, a), arrivals, take, tokenize = _items([(system + user, 4), (system + list(range(900, 910)), 4)])
    arrivals.append(row)
    admission.next_admitted(take, tokenize, 0)
    admission.placed([7], segments=[[system, user]], cached=[[]])
    arrivals.append(a)
    return admission, a, take, tokenize


def test_no_wait_for_a_shared_prefix_without_a_share_wait_and_a_wait_ends_at_its_deadline(monkeypatch):
    """``share_wait_s`` 0 turns the wait off (none counted); otherwise a request waits until exactly its
    deadline, on the clock admission reads."""
    from kvstate.interpreters.serving import batch_admission as module
    admission, a, take, tokenize = _sharer_behind_a_row(0.0)
    assert admission.next_admitted(take, tokenize, 0) is a and admission.shared_waits == 0

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    admission, a, take, tokenize = _sharer_behind_a_row(0.5)
    assert admission.next_admitted(take, tokenize, 0) is None and admission.shared_waits == 1
    clock[0] += 0.499
    assert admission.next_admitted(take, tokenize, 0) is None
    clock[0] = 1000.5  # the deadline itself: the wait is over
    assert admission.next_admitted(take, tokenize, 0) is a


def test_the_admitted_requests_tokenization_is_handed_back_for_it_alone():
    service, admission = _admission()
    (first, other), arrivals, take, tokenize = _items([(list(range(1, 21)), 4), (list(range(30, 40)), 4)])
    arrivals.append(first)
    assert admission.next_admitted(take, tokenize, 0) is first
    assert admission.tokenized(first[1])[0] == list(range(1, 21))
    assert admission.tokenized(other[1]) is None


def test_rows_placed_without_segments_or_with_nothing_left_to_compute_are_rows_all_the_same():
    service, admission = _admission()
    (first, second), arrivals, take, tokenize = _items([(list(range(1, 21)), 4), (list(range(30, 40)), 4)])
    arrivals.append(first)
    admission.next_admitted(take, tokenize, 0)
    admission.placed([1])  # the server said nothing of its segments
    arrivals.append(second)
    admission.next_admitted(take, tokenize, 0)
    admission.placed([2], segments=[[[]]], cached=[list(range(30, 40))])  # its prompt all reused
    assert service.report().live_requests == 2
    admission.ended([1, 2])
    assert service.report().live_requests == 0


def test_the_peaks_start_at_nothing_and_hold_the_batch_and_the_kept_ram():
    from kvstate import Request, SimCaches
    service, admission = _admission()
    assert (admission.peak_batch_bytes, admission.peak_held_bytes) == (0, 0)
    prompt = tuple(range(1, 41))
    lease = Request(prompt, 1)
    service.acquire(lease)
    service.publish(lease, "default", prompt, SimCaches(prompt, SPEC))
    service.release(lease)
    kept = admission.cache.nbytes
    admission.measure(1000)
    assert (admission.peak_batch_bytes, admission.peak_held_bytes) == (1000, 1000 + kept) and kept > 0


def test_a_prefill_that_measured_nothing_teaches_no_pace():
    service, admission = _admission()
    admission.prefilled(0, 1.0)
    admission.prefilled(100, 0.0)
    assert service.state.pace.prefill_s_per_token is None
    admission.prefilled(100, 0.5)
    assert service.state.pace.prefill_s_per_token is not None


def test_a_request_waits_for_its_blocks_read_ahead_until_they_land_or_its_wait_is_over(monkeypatch):
    """A request whose saved blocks are read ahead while a batch runs waits for them (the dequeue polls
    briefly, as nothing new is awaited), and joins once they land; a read that outlasts
    ``READ_AHEAD_WAIT_S`` is waited for no longer, to the deadline itself."""
    from kvstate.interpreters.serving import batch_admission as module
    clock = [500.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    saved = list(range(1, 13))
    for lands in (True, False):
        service = _restarted_with_saved_blocks(tuple(saved))
        reads, held = service._interpreter.complete_reads, [True]  # a slow disk: the read lands when let go
        monkeypatch.setattr(service._interpreter, "complete_reads", lambda: [] if held[0] else reads())
        admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=0.0, read_ahead=True)
        (row, busy), arrivals, take, tokenize = _items([(list(range(200, 230)), 4), (saved + [50, 51], 4)])
        timeouts = []

        def polled(timeout):
            timeouts.append(timeout)
            return take(timeout)
        arrivals.append(row)
        admission.next_admitted(take, tokenize, 0)
        admission.placed([1], segments=[[list(range(200, 230))]], cached=[[]])
        arrivals.append(busy)
        assert admission.next_admitted(polled, tokenize, 1.0) is None  # its read started: it waits
        assert admission.next_admitted(polled, tokenize, 1.0) is None
        assert timeouts[-1] == module.READ_POLL_S  # nothing else awaited: the dequeue only polls
        if lands:
            held[0] = False
            assert admission.next_admitted(polled, tokenize, 1.0) is busy
            assert service.peek_prefix_len(saved + [50, 51], "default") == len(saved)
        else:
            clock[0] += module.READ_AHEAD_WAIT_S - 0.001
            assert admission.next_admitted(polled, tokenize, 1.0) is None
            clock[0] = 500.0 + module.READ_AHEAD_WAIT_S  # the deadline itself: it goes on without its blocks
            assert admission.next_admitted(polled, tokenize, 1.0) is busy


def _fleet_of_two_with_blocks_on_the_store(prompt):
    """A simulated server that wrote ``prompt``'s blocks to its disk and so to the shared store, and a
    second server on the same store, in blocks of 4, whose fetches from the store land when collected."""
    from kvstate import Request, SimCaches
    from kvstate.interpreters.simulator import SimDisk, SimRemote
    remote = SimRemote()

    def server(**options):
        return KvCacheService.simulated(SPEC, ram_bytes=BUDGET * 8, disk_bytes=BUDGET * 64, block_tokens=4,
                                        interpreter_options={"remote": remote, "disk": SimDisk(), **options})
    first = server()
    lease = Request(prompt, 1)
    first.acquire(lease)
    first.publish(lease, "default", prompt, SimCaches(prompt, SPEC))
    first.release(lease)
    first.flush()
    assert remote.objects
    first.close()
    return server(deferred_reads=True)


def test_a_request_waits_for_its_blocks_fetched_from_the_shared_tier_until_they_land_or_its_wait_is_over(
        monkeypatch):
    """A request whose blocks the shared store holds (and this server lacks) waits for their fetch,
    batch busy or not, and joins once they land; a fetch that outlasts ``REMOTE_WAIT_S`` is waited
    for no longer, to the deadline itself."""
    from kvstate.interpreters.serving import batch_admission as module
    clock = [500.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    shared = list(range(1, 13))
    for lands in (True, False):
        clock[0] = 500.0
        service = _fleet_of_two_with_blocks_on_the_store(tuple(shared))
        reads, held = service._interpreter.complete_reads, [True]  # a slow store: the fetch lands when let go
        monkeypatch.setattr(service._interpreter, "complete_reads", lambda: [] if held[0] else reads())
        admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=0.0)
        (item,), arrivals, take, tokenize = _items([(shared + [50, 51], 4)])
        arrivals.append(item)
        assert admission.next_admitted(take, tokenize, 1.0) is None  # its fetch started: it waits
        assert admission.next_admitted(take, tokenize, 1.0) is None
        if lands:
            held[0] = False
            assert admission.next_admitted(take, tokenize, 1.0) is item
            assert service.peek_prefix_len(shared + [50, 51], "default") == 0  # on disk, not in RAM
            assert service.report().remote_blocks_read == 3
        else:
            clock[0] += module.REMOTE_WAIT_S - 0.001
            assert admission.next_admitted(take, tokenize, 1.0) is None
            clock[0] = 500.0 + module.REMOTE_WAIT_S  # the deadline itself: it goes on without its blocks
            assert admission.next_admitted(take, tokenize, 1.0) is item
        service.close()


def test_a_pin_is_taken_when_the_reply_is_kept_not_at_a_segments_end():
    """A request's ``cache_pin_seconds`` pins its prompt once the state at the end of its reply is kept;
    the inserts at its segments' ends before that pin nothing."""
    from kvstate.interpreters.serving.pins import PIN_ATTRIBUTE, PinAsked
    from tests.test_prompt_cache import MODEL_KEY, adapter, computed
    model, cache = adapter()
    admission = BatchAdmission(cache, share_wait_s=0.0)
    system, user = list(range(1, 41)), list(range(100, 120))
    (item,), arrivals, take, tokenize = _items([(system + user, 4)])
    setattr(item[1], PIN_ATTRIBUTE, PinAsked(60.0))
    arrivals.append(item)
    assert admission.next_admitted(take, tokenize, 0) is item
    admission.placed([3], segments=[[system, user]], cached=[[]])
    admission.publishing(3, system)  # the system prompt's segment ends: kept, not pinned
    cache.insert_cache(MODEL_KEY, system, computed(model, system), cache_type="system")
    assert cache.service.report().pins == 0 and cache.service.report().kept == 1
    reply = system + user + [7, 8]
    admission.publishing(3, reply, final=True)
    cache.insert_cache(MODEL_KEY, reply, computed(model, reply))
    assert cache.service.report().pins == 1


def test_waits_for_room_are_counted_once_a_request_from_none():
    """``waited`` (``/metrics``' requests that waited for KV room) counts each request that waited,
    once, however many passes it waits."""
    service, admission = _admission(share_wait_s=0.0, budget=BUDGET)
    first_prompt = list(range(1, 301))  # fits the budget alone, not beside another of its size
    (first, second), arrivals, take, tokenize = _items([(first_prompt, 4), (list(range(1000, 1300)), 4)])
    assert admission.waited == 0
    arrivals.extend([first, second])
    assert admission.next_admitted(take, tokenize, 0) is first
    admission.placed([1], segments=[[first_prompt]], cached=[[]])
    assert admission.next_admitted(take, tokenize, 0) is None  # no room for the second while the first runs
    assert admission.next_admitted(take, tokenize, 0) is None
    assert admission.waited == 1


def test_a_running_batch_never_waits_on_the_dequeue_for_a_request_waiting_for_its_reads(monkeypatch):
    """While the batch runs (the server's timeout None), the dequeue does not wait at all, even when
    every request in line waits for its blocks read ahead: the batch's next step is due."""
    saved = list(range(1, 13))
    service = _restarted_with_saved_blocks(tuple(saved))
    monkeypatch.setattr(service._interpreter, "complete_reads", lambda: [])  # the read never lands here
    admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=0.0, read_ahead=True)
    (row, busy), arrivals, take, tokenize = _items([(list(range(200, 230)), 4), (saved + [50, 51], 4)])
    arrivals.append(row)
    admission.next_admitted(take, tokenize, 0)
    admission.placed([1], segments=[[list(range(200, 230))]], cached=[[]])
    arrivals.append(busy)
    timeouts = []

    def polled(timeout):
        timeouts.append(timeout)
        return take(timeout)
    assert admission.next_admitted(polled, tokenize, None) is None
    assert admission.next_admitted(polled, tokenize, None) is None
    assert timeouts[-1] is None


def test_a_pin_belongs_to_a_row_placed_alone():
    """A request's pin goes with the row it became; rows placed several at once (not one request's)
    pin nothing."""
    from kvstate.interpreters.serving.pins import PIN_ATTRIBUTE, PinAsked
    service, admission = _admission(share_wait_s=0.0)
    (item,), arrivals, take, tokenize = _items([(list(range(1, 41)), 4)])
    setattr(item[1], PIN_ATTRIBUTE, PinAsked(60.0))
    arrivals.append(item)
    assert admission.next_admitted(take, tokenize, 0) is item
    admission.placed([3, 4], segments=[[list(range(1, 41))], [list(range(1, 41))]], cached=[[], []])
    assert admission._pins == {}


def _row_in_prefill(snapshot_every: int, reused: int):
    """Row 1, the prompt 1..100, placed in a batch that snapshots every ``snapshot_every`` tokens, after
    ``reused`` tokens it reused: ``(model, cache, admission, prompt)``."""
    from tests.test_prompt_cache import adapter
    model, cache = adapter()
    admission = BatchAdmission(cache, share_wait_s=0.0, snapshot_every=snapshot_every)
    prompt = list(range(1, 101))
    (item,), arrivals, take, tokenize = _items([(prompt, 4)])
    arrivals.append(item)
    assert admission.next_admitted(take, tokenize, 0) is item
    admission.placed([1], segments=[[prompt[reused:]]], cached=[prompt[:reused]])
    return model, cache, admission, prompt


def test_a_row_is_due_a_chunk_snapshot_each_time_its_prefill_passes_a_multiple_of_the_chunk():
    """With ``snapshot_every`` 32, a row that reused 40 tokens and computes 60 more is due at 64 (its
    first multiple past where it began), not before; again at 96 once the snapshot at 64 is taken;
    never at a segment's end or the prompt's (the server keeps those itself) nor for a row of no request."""
    from tests.test_prompt_cache import computed
    model, cache, admission, prompt = _row_in_prefill(snapshot_every=32, reused=40)

    def at(position, **ends):
        response = SimpleNamespace(uid=1, progress=(position - 40, 60), end_of_segment=False, end_of_prompt=False)
        response.__dict__.update(ends)
        admission.progressed([response])
        return admission.due_snapshots([response])
    assert at(60) == []   # 60 // 32 == 40 // 32: no multiple passed since it began
    assert at(64) == [1]
    assert at(64, end_of_segment=True) == []
    admission.snapshot(1, computed(model, prompt[:64]), prompt[:64])
    assert cache.service.peek_prefix_len(tuple(prompt[:64]) + (250,), "default") == 64
    assert at(90) == []
    assert at(96) == [1]
    admission._namespaces.pop(1)  # a row of no known request keeps nothing
    assert at(97) == []


def test_a_chunk_snapshot_says_the_prompt_to_where_the_next_is_due():
    """A snapshot at 64 with ``snapshot_every`` 16 and prefill steps of 8: the next is due at the first
    step past 80, at most 87, so it says the prompt's tokens 64..87 (cut at the prompt's end); the core
    then keeps it as a branch point's only where no held prefix goes past them."""
    from tests.test_prompt_cache import computed
    model, cache, admission, prompt = _row_in_prefill(snapshot_every=16, reused=0)
    offered = []
    publish = cache.service.publish
    cache.service.publish = lambda *args, **kwargs: (offered.append(kwargs), publish(*args, **kwargs))[1]
    admission.snapshot(1, computed(model, prompt[:64]), prompt[:64], prefill_step=8)
    admission.snapshot(1, computed(model, prompt[:96]), prompt[:96], prefill_step=8)
    assert [o["next_chunk"] for o in offered] == [tuple(prompt[64:87]), tuple(prompt[96:100])]
    assert all(o["chunk"] for o in offered)


def test_a_row_in_prefill_publishes_at_each_segments_end_and_one_token_before_its_prompts():
    """What a waiting request may wait for: the row's caches at the end of each segment but the last,
    and one token before the prompt's end (the last token is sampled from), after what it reused."""
    service, admission = _admission(share_wait_s=0.0)
    system, user, header, reused = list(range(1, 41)), list(range(100, 130)), [7, 8, 9], list(range(200, 210))
    for uid, (segments, cached, boundaries) in enumerate([
            ([system, user, header], [], (40, 70, 72)),
            ([system, user, [9]], [], (40, 70)),          # a last part of one token: its end is the user's
            ([system, user, [8, 9]], [], (40, 70, 71)),
            ([user, header], reused, (40, 42))]):         # after 10 reused tokens
        admission.placed([uid], segments=[segments], cached=[cached])
        row = admission._computing[uid]
        assert row.boundaries == boundaries and row.position == len(cached)
        assert tuple(row.prompt) == tuple(cached) + tuple(t for part in segments for t in part)
