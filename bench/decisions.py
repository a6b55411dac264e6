"""Decision latency of the service: admit, acquire (hit and miss), publish, release, against mlx-lm's
``LRUPromptCache`` on the same token lists, timed in the same run.

Runs the facade on the simulator (every call goes through ``core.step`` and
its effects) with 1k, 10k and 100k kept entries of 2,000 tokens (10 families
sharing a 1,000-token system prompt, then 1,000 tokens of their own) and
4,000-token prompts: a hit reuses an entry's 2,000 tokens, a miss shares
nothing. Publish keeps a new 4,000-token state (capacity leaves room, so no
eviction is timed). The clock ticks between samples, as a server's boundaries move it, so a
hit restamps every entry or block it uses. ``index lookup`` is the prefix index alone answering the
longest usable prefix of a hit prompt. The peer, ``LRUPromptCache`` (what
``mlx_lm.server`` uses), holds the same entries (with empty cache lists, so no
tensor copy is timed on either side): ``fetch_nearest_cache`` of the hit
prompt, and ``insert_cache`` of the published tokens. Prints median and p99
microseconds per call, each median as a ratio to a plain dict lookup keyed by
the prompt (hashing it once, the least any cache keyed by tokens does), and
kvstate's request (admit + acquire hit + release; and in one call, ``try_acquire``
hit + release, as a scheduler that starts what it admits runs it) and publish
as ratios of the peer's fetch and insert. ``--no-gc`` keeps the cyclic garbage collector off
while timing; ``--no-peer`` times kvstate alone. ``--parts`` times one request's parts instead, and a
hit request and a miss's publish three ways beside the peer: through the facade, as core steps, and as
the least those steps could write on the same structures (no check, no decision): the floor of this
representation of the state.

    python bench/decisions.py [--sizes 1000,10000,100000] [--samples 300]
    python bench/decisions.py --parts
    python bench/decisions.py --block-tokens 256   # the service keeps state in blocks
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from mlx_lm.models.cache import LRUPromptCache

from kvstate import KvCacheService, Request, SimCaches, model_spec

SPEC = model_spec("llama-3.1-8b")
FAMILIES, SYSTEM, TURN, PROMPT = 10, 1000, 1000, 4000
BASELINE = "dict lookup"
TRY, ONE_CALL = "try_acquire hit", "request, one call"
PEER_FETCH, PEER_INSERT = "peer fetch", "peer insert"


def entry_tokens(i: int) -> tuple[int, ...]:
    family = i % FAMILIES
    system = tuple(range(family * 10_000, family * 10_000 + SYSTEM))
    return system + tuple(range(10**9 + i * TURN, 10**9 + (i + 1) * TURN))


#: What a hit prompt adds after the kept entry it reuses.
HIT_TAIL = tuple(range(2 * 10**9, 2 * 10**9 + PROMPT - SYSTEM - TURN))


def hit_prompt(k: int, entries: int) -> tuple[int, ...]:
    """The ``k``-th hit prompt: one of the ``entries`` kept entries (spread over them), then new tokens."""
    return entry_tokens((k * 7919) % entries) + HIT_TAIL


#: Tokens per block where the service keeps state in blocks (``--block-tokens``; None: whole prefixes).
BLOCKS: dict[str, int] = {}


def build(entries: int, samples: int, with_peer: bool = True) -> tuple[KvCacheService, LRUPromptCache | None]:
    capacity = SPEC.bytes_for(SYSTEM + TURN) * entries + SPEC.bytes_for(PROMPT) * (samples + 8)
    service = KvCacheService.simulated(SPEC, ram_bytes=capacity, kv_budget_bytes=SPEC.bytes_for(PROMPT + 256) * 4096,
                                       **BLOCKS)
    peer = LRUPromptCache(max_size=1 << 62) if with_peer else None
    for i in range(entries):
        tokens = entry_tokens(i)
        service.publish(Request(tokens, 1), "bench", tokens, SimCaches(tokens, SPEC))
        if peer is not None:
            peer.insert_cache("bench", list(tokens), [])
    assert (BLOCKS or service.report().entries == entries) and (peer is None or len(peer) == entries)
    return service, peer


def timed(call) -> float:
    start = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - start) / 1000


def measure(entries: int, samples: int, with_peer: bool = True) -> dict[str, list[float]]:
    service, peer = build(entries, samples, with_peer)
    times: dict[str, list[float]] = {"admit": [], "acquire hit": [], "acquire miss": [], "publish": [],
                                     "release": [], "request": [], TRY: [], ONE_CALL: [], "index lookup": [],
                                     BASELINE: [], PEER_FETCH: [], PEER_INSERT: []}
    index = service.state.ram.index
    table = {entry_tokens(i): i for i in range(entries)}
    gc.collect()
    for k in range(samples):
        # The clock moves between requests, as a server's boundaries move it, so a hit restamps
        # every entry (or block) it uses, as in production.
        service.tick(float(k + 1))
        prompt = hit_prompt(k, entries)
        miss_prompt = tuple(range(3 * 10**9 + k * PROMPT, 3 * 10**9 + (k + 1) * PROMPT))
        hit, miss = Request(prompt, 256), Request(miss_prompt, 256)
        # Even samples run the hit as admit + acquire + release, odd ones as try_acquire + release,
        # each from the same point of the loop, so both meet the same cold caches.
        one_call = k % 2 == 1
        got = []
        if one_call:
            times[TRY].append(timed(lambda: got.append(service.try_acquire(hit, "bench"))))
        else:
            times["admit"].append(timed(lambda: service.admit(hit)))
        service.admit(miss)
        if not one_call:
            times["acquire hit"].append(timed(lambda: got.append(service.acquire(hit, "bench"))))
        assert got[0].reused_tokens == SYSTEM + TURN
        times["acquire miss"].append(timed(lambda: got.append(service.acquire(miss, "bench"))))
        assert got[1].reused_tokens == 0
        caches = SimCaches(miss_prompt, SPEC)
        times["publish"].append(timed(lambda: service.publish(miss, "bench", miss_prompt, caches)))
        released = timed(lambda: service.release(hit))
        if one_call:
            times[ONE_CALL].append(times[TRY][-1] + released)
        else:
            times["release"].append(released)
            times["request"].append(times["admit"][-1] + times["acquire hit"][-1] + released)
        times["index lookup"].append(timed(lambda: index.longest("bench", hit.prompt)))
        times[BASELINE].append(timed(lambda: table.get(prompt)))
        service.release(miss)
        if peer is None:
            continue
        listed_hit, listed_miss = list(prompt), list(miss_prompt)
        fetched = []
        times[PEER_FETCH].append(timed(lambda: fetched.append(peer.fetch_nearest_cache("bench", listed_hit))))
        assert len(listed_hit) - len(fetched[0][1]) == SYSTEM + TURN
        times[PEER_INSERT].append(timed(lambda: peer.insert_cache("bench", listed_miss, [])))
    return {name: values for name, values in times.items() if values}


def parts(entries: int = 1000, samples: int = 300) -> None:
    """What one request's decisions spend, each part timed on its own (``--parts``)."""
    import timeit

    from kvstate.core import events as ev, step
    from kvstate.core.blocks import spans
    from kvstate.core.state import content_tag
    from kvstate.core.tokens import Tokens

    service, peer = build(entries, 3 * samples)  # room for what floor() publishes
    prompts = [hit_prompt(k, entries) for k in range(samples)]
    requests = [Request(p, 256) for p in prompts]
    calls: dict[str, list[float]] = {"admit": [], "acquire hit": [], "release": []}
    for request in requests:
        calls["admit"].append(timed(lambda: service.admit(request)))
        calls["acquire hit"].append(timed(lambda: service.acquire(request, "bench")))
        calls["release"].append(timed(lambda: service.release(request)))
    calls[TRY], calls["release after it"] = [], []
    for request in [Request(p, 256) for p in prompts]:
        calls[TRY].append(timed(lambda: service.try_acquire(request, "bench")))
        calls["release after it"].append(timed(lambda: service.release(request)))
    print(f"{samples} fresh {PROMPT}-token requests in a tight loop, {entries:,} entries, µs per call (median):")
    for name, values in calls.items():
        print(f"  {name:44} {statistics.median(values):8.1f}")

    def best(call, number=500) -> float:
        return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6
    prompt, index = requests[0].prompt, service.state.ram.index
    twin = tuple(range(10**9, 10**9 + PROMPT))
    other = tuple(range(10**9, 10**9 + PROMPT))
    packed_twin, packed_other = Tokens(twin).packed, Tokens(other).packed
    raw = list(range(100_000, 100_000 + PROMPT))
    print("  parts, µs each (best of 5):")
    rows = {
        "index lookup of a 2,000-token hit": lambda: index.longest("bench", prompt),
        "compare 2,000 tokens (tuple slices)": lambda: twin[:SYSTEM + TURN] == other[:SYSTEM + TURN],
        "compare 2,000 packed tokens (bytes)": lambda: packed_twin.startswith(packed_other[:8 * (SYSTEM + TURN)]),
        f"build a {PROMPT}-token Request (checks, packs)": lambda: Request(raw, 256),
        f"content tag of {PROMPT} tokens": lambda: content_tag("bench", prompt),
    }
    for name, call in rows.items():
        print(f"  {name:44} {best(call):8.1f}")
    # The pure steps, each repeated on one state (no facade, no interpreter): what core.step costs.
    lease, request = 10**9, requests[1]
    admit = ev.Admit(lease, request)
    admitted = step(service.state, admit).state
    acquire = ev.Acquire(lease, request, "bench", 10**9)
    acquired = step(admitted, acquire).state
    release = ev.Release(lease, True)
    # A miss's publish of a new state, with the sizes the simulator reports (each block's, in blocks).
    miss = Request(tuple(range(3 * 10**9, 3 * 10**9 + PROMPT)), 256)
    missed = step(step(service.state, ev.Admit(lease + 1, miss)).state, ev.Acquire(lease + 1, miss, "bench", 10**9 + 1)).state
    cuts = spans(PROMPT, BLOCKS["block_tokens"]) if BLOCKS else ()
    sizes = tuple((SPEC.bytes_for(stop - start), 0) for start, stop in cuts)
    publish = ev.Publish(miss, "bench", miss.prompt, 10**9 + 2, PROMPT, SPEC.bytes_for(PROMPT), True, 0, sizes)
    # The hit's publish of its whole prompt: the turn after a kept state, whose first 2,000 tokens are held.
    turn = ev.Publish(request, "bench", request.prompt, 10**9 + 3, PROMPT, SPEC.bytes_for(PROMPT), True, 0, sizes)
    print("  core.step alone, µs each (best of 5):")
    for name, state, event, number in (("admit", service.state, admit, 5000), ("acquire hit", admitted, acquire, 5000),
                                       ("release", acquired, release, 5000),
                                       (f"publish of a new {PROMPT}-token state", missed, publish, 500),
                                       (f"publish of a hit's {PROMPT} tokens ({SYSTEM + TURN:,} held)", acquired, turn,
                                        500)):
        print(f"  {name:44} {best(lambda: step(state, event), number):8.1f}")
    by_length(service, samples)
    floor(service, peer, entries, 3 * samples)


#: Prompt lengths ``by_length`` compares: admit and release should cost the same at each.
LENGTHS = (500, 32_000)


def by_length(service: KvCacheService, samples: int) -> None:
    """Admit and release of fresh requests at each of :data:`LENGTHS` prompt tokens, through the facade
    and as core steps alone (``--parts``): neither should grow with the prompt."""
    from kvstate.core import events as ev, step

    print(f"  admit and release by prompt length, {samples} fresh requests each, µs (median):")
    for length in LENGTHS:
        requests = [Request(tuple(range(5 * 10**9 + k * length, 5 * 10**9 + (k + 1) * length)), 256)
                    for k in range(samples)]
        calls: dict[str, list[float]] = {"admit": [], "release": [], "admit step": [], "release step": []}
        for request in requests:
            calls["admit"].append(timed(lambda: service.admit(request)))
            calls["release"].append(timed(lambda: service.release(request)))
        state = service.state
        for k, request in enumerate(requests):
            admit, release = ev.Admit(10**9 + k, request), ev.Release(10**9 + k, True)
            calls["admit step"].append(timed(lambda: step(state, admit)))
            admitted = step(state, admit).state
            calls["release step"].append(timed(lambda: step(admitted, release)))
        print(f"  {length:>6,} tokens: " + ", ".join(f"{name} {statistics.median(values):.1f}"
                                                   for name, values in calls.items()))


def _rebuilt(state, **changes):
    """``state`` with ``changes``, built as a transition builds its next state (one dict copy)."""
    from kvstate.core.state import ServiceState

    fields = state.__dict__.copy()
    fields.update(changes)
    built = object.__new__(ServiceState)
    object.__setattr__(built, "__dict__", fields)
    return built


def least_request(state, request, lease: int, now: float):
    """The writes a RAM hit's three steps make, on the same structures, with no check and no decision:
    admit sets the lease and the charge; acquire looks the prompt up, restamps the entry, tells the
    policy, sets the lease and counts; release drops the lease and the charge. What a request would
    cost if its decisions were free. (Its events are built too, as a caller builds them, and dropped.)"""
    from kvstate.core import events as ev
    from kvstate.core.state import Lease

    ev.Admit(lease, request)
    state = _rebuilt(state, leases=state.leases.set(lease, Lease(request, 1, True)),
                     projected_bytes=state.projected_bytes + 1)
    ev.Acquire(lease, request, "bench", lease)
    reused, entry_id = state.ram.index.longest("bench", request.prompt)
    entry, ram = state.entries[entry_id], state.ram
    tier = type(ram)(ram.index, ram.bytes, ram.capacity, ram.strategy, ram.strategy.accessed(ram.policy, entry_id))
    state = _rebuilt(state, ram=tier, entries=state.entries.set(entry_id, entry.used(now, 0)),
                     leases=state.leases.set(lease, Lease(request, 1, True, True, "bench")),
                     counters=state.counters.plus({"hits": 1, "prefill_tokens_saved": reused}))
    ev.Release(lease, True)
    return _rebuilt(state, leases=state.leases.delete(lease), projected_bytes=state.projected_bytes - 1)


def _publish_event(request: Request, handle: int):
    from kvstate.core import events as ev

    nbytes = SPEC.bytes_for(PROMPT)
    return ev.Publish(request, "bench", request.prompt, handle, PROMPT, nbytes, True, 0)


def least_publish(state, request, handle: int, now: float):
    """The writes keeping a new prompt's state makes, on the same structures, with no check and no
    decision: the content tag, the policy told of its arrival and insert, the entry, the index insert
    and its look for served prefixes, the count. What a publish would cost if its decisions were free."""
    from kvstate.core.state import Entry, Residence, content_tag

    event = _publish_event(request, handle)
    data, ram, entry_id = event.tokens.packed, state.ram, state.next_entry
    ram.index.exact("bench", data)
    tag = content_tag("bench", data)
    policy = ram.strategy.inserted(ram.strategy.arriving(ram.policy, tag), entry_id, event.nbytes, PROMPT, tag)
    entry = Entry(entry_id, "bench", data, event.nbytes, True, Residence.RAM, now, None, False, tag, file_bytes=0)
    index = ram.index.insert("bench", data, entry_id, True)
    index.prefixes_of("bench", data)
    tier = type(ram)(index, ram.bytes + event.nbytes, ram.capacity, ram.strategy, policy)
    return _rebuilt(state, ram=tier, entries=state.entries.set(entry_id, entry), next_entry=entry_id + 1,
                    counters=state.counters.plus({"kept": 1}))


def floor(service: KvCacheService, peer: LRUPromptCache, entries: int, samples: int) -> None:
    """A hit request (admit, acquire, release) and a miss's publish, each three ways: through the
    facade, as core steps alone, and as the least those steps could write (:func:`least_request`,
    :func:`least_publish`); each against the peer's fetch of the same prompt and insert of the same
    tokens, timed on alternate fresh requests in one tight loop (``--parts``)."""
    from kvstate.core import events as ev, step

    ways = ("through the facade", "as core steps", "the least they write")
    rows: dict[str, list[float]] = {f"{op} {way}": [] for op in ("request", "publish") for way in ways}
    rows[PEER_FETCH], rows[PEER_INSERT] = [], []
    state = service.state
    for k in range(samples):
        lease, way = 10**9 + k, ways[k % 3]
        prompt = hit_prompt(k, entries)
        miss_prompt = tuple(range(4 * 10**9 + k * PROMPT, 4 * 10**9 + (k + 1) * PROMPT))
        hit, miss = Request(prompt, 256), Request(miss_prompt, 256)
        if way == ways[0]:
            request = lambda: (service.admit(hit), service.acquire(hit, "bench"), service.release(hit))
            caches = SimCaches(miss_prompt, SPEC)
            publish = lambda: service.publish(miss, "bench", miss_prompt, caches)
        elif way == ways[1]:
            def request() -> None:
                nonlocal state
                state = step(state, ev.Admit(lease, hit)).state
                state = step(state, ev.Acquire(lease, hit, "bench", lease)).state
                state = step(state, ev.Release(lease, True)).state

            def publish() -> None:
                nonlocal state
                state = step(state, _publish_event(miss, lease)).state
        else:
            def request() -> None:
                nonlocal state
                state = least_request(state, hit, lease, float(k))

            def publish() -> None:
                nonlocal state
                state = least_publish(state, miss, lease, float(k))
        # Each call follows the peer's call of the same kind, so both meet the caches it left.
        listed_hit, listed_miss = list(prompt), list(miss_prompt)
        rows[PEER_FETCH].append(timed(lambda: peer.fetch_nearest_cache("bench", listed_hit)))
        rows[f"request {way}"].append(timed(request))
        rows[PEER_INSERT].append(timed(lambda: peer.insert_cache("bench", listed_miss, [])))
        rows[f"publish {way}"].append(timed(publish))
    fetch, insert = statistics.median(rows[PEER_FETCH]), statistics.median(rows[PEER_INSERT])
    print(f"  {samples} alternate fresh requests: the peer's fetch of a hit prompt, the hit request, the peer's"
          f" insert of a miss's tokens, the miss's publish; µs (median) and as a share of the peer's call:")
    for name, values in rows.items():
        peer_median = insert if name.startswith("publish") or name == PEER_INSERT else fetch
        print(f"  {name:44} {statistics.median(values):8.1f} {statistics.median(values) / peer_median:8.3f}x")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    parser.add_argument("--no-peer", action="store_true",
                        help="time kvstate alone (the peer's trie needs tens of GB at 100k entries)")
    parser.add_argument("--parts", action="store_true", help="time each part of one request's decisions instead")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="the service keeps state in blocks of this many tokens (default: whole prefixes)")
    args = parser.parse_args()
    if args.block_tokens:
        BLOCKS["block_tokens"] = args.block_tokens
    if args.parts:
        parts()
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {}
    for size in sizes:
        if args.no_gc:
            gc.disable()
        rows[size] = measure(size, args.samples, with_peer=not args.no_peer)
        gc.enable()
    ops = list(next(iter(rows.values())))
    header = f"{'operation':14}" + "".join(f"{f'{size:,} entries':>34}" for size in sizes)
    print(f"µs per call, median / p99 (median over the same run's {BASELINE} of the prompt), "
          f"{PROMPT}-token prompts, {args.samples} samples each" + (", GC off while timing" if args.no_gc else "")
          + "; 'request' is admit + acquire hit + release; 'request, one call' is try_acquire hit + release"
          + " (each on every other sample)")
    print(header)
    for op in ops:
        cells = "".join(f"{statistics.median(rows[s][op]):>13.1f} / {p99(rows[s][op]):>7.1f} "
                        f"({statistics.median(rows[s][op]) / statistics.median(rows[s][BASELINE]):>6.1f}x)"
                        for s in sizes)
        print(f"{op:14}{cells}")
    for ours, theirs in (("request", PEER_FETCH), (ONE_CALL, PEER_FETCH), ("publish", PEER_INSERT)):
        if args.no_peer:
            break
        cells = "".join(f"{statistics.median(rows[s][ours]) / statistics.median(rows[s][theirs]):>33.3f}x"
                        for s in sizes)
        print(f"{ours + ' / ' + theirs:14}{cells}")


if __name__ == "__main__":
    main()
