"""Every eviction policy: capacity kept, pinned keys never evicted, each exactly as its naive reference,
and its memory bounded by what it holds."""

import random

import attrs
import hypothesis.strategies as st
import immutables
import pytest
from hypothesis import example, given, settings

from kvstate.core.policies import POLICIES, UnknownPolicy, policy
from kvstate.core.policies.base import StampQueue
from kvstate.core.policies.s3fifo import GHOST_SHARE, MAX_FREQ
from tests.reference import NaiveFIFO, NaiveGDSF, NaiveLFU, NaiveLRU, NaiveS3FIFO, NaiveSIEVE

CAPACITY = 100
REFERENCES = {"lru": NaiveLRU, "fifo": NaiveFIFO, "lfu": NaiveLFU, "sieve": NaiveSIEVE, "gdsf": NaiveGDSF,
              "s3fifo": lambda: NaiveS3FIFO(CAPACITY)}
#: ``extend`` and ``leaf``: a block the tier holds comes to extend the key's, or none does any more (the
#: tier refuses the key in between, and tells the policy: see ``EvictionPolicy.extended``).
operation = st.tuples(st.sampled_from(["put", "hit", "hit", "pin", "unpin", "remove", "extend", "leaf"]),
                      st.integers(0, 25), st.integers(1, 40))
#: Runs long enough to fill a table and evict from it in every example (short lists are hypothesis' favourite).
long_ops = st.lists(operation, min_size=30, max_size=150)
#: Short runs for the edge cases, long ones so that eviction happens inside the run, not only in the drain.
ops = st.one_of(st.lists(operation, max_size=20), long_ops)


def extension_told(strategy, state, op, key, held, extended: set):
    """``state`` after ``extend`` (a held key not extended yet comes to be) or ``leaf`` (an extended key
    is a leaf again), told to the policy as the tier tells it; ``extended`` kept up to date."""
    if op == "extend" and key in held and key not in extended:
        extended.add(key)
        return strategy.extended(state, key)
    if op == "leaf" and key in extended:
        extended.discard(key)
        return strategy.leaf_again(state, key)
    return state


def drive(strategy, operations, reference=None, capacity=CAPACITY):
    """A byte-bounded cache over ``strategy``; checks every victim, returns the eviction sequence. Keys
    pinned or extended are refused; the policy is told of extensions, the reference is not: a policy
    that sets an extended key aside must name the victims of one that reads past it."""
    state = strategy.empty(capacity)
    sizes: dict[int, int] = {}
    pinned: set[int] = set()
    extended: set[int] = set()

    def allowed(k: int) -> bool:
        return k not in pinned and k not in extended
    evicted = []
    for op, key, size in operations:
        if op == "put" and key not in sizes:
            cost, tag = float(size * (key % 3 + 1)), key % 7
            state = strategy.arriving(state, tag)
            if hasattr(reference, "arriving"):
                reference.arriving(tag)
            while sum(sizes.values()) + size > capacity:
                state, victim = strategy.evict(state, allowed)
                if reference is not None:
                    assert victim == reference.evict(allowed)
                if victim is None:
                    assert not any(allowed(k) for k in sizes), "a key could go, yet the policy named none"
                    break
                assert victim in sizes and allowed(victim)
                del sizes[victim]
                evicted.append(victim)
            if sum(sizes.values()) + size <= capacity:
                sizes[key] = size
                state = strategy.inserted(state, key, size, cost, tag)
                if reference is not None:
                    reference.insert(key, size, cost, tag)
        elif op == "hit" and key in sizes:
            state = strategy.accessed(state, key)
            if reference is not None:
                reference.access(key)
        elif op == "pin" and key in sizes:
            pinned.add(key)
        elif op == "unpin":
            pinned.discard(key)
        elif op in ("extend", "leaf"):
            state = extension_told(strategy, state, op, key, sizes, extended)
        elif op == "remove" and key in sizes and key not in pinned:
            del sizes[key]
            extended.discard(key)
            state = strategy.removed(state, key)
            if reference is not None:
                reference.remove(key)
        assert sum(sizes.values()) <= capacity
    # Draining evicts every key allowed exactly once, then names none; then, nothing extending any key,
    # every unpinned key.
    for leaves in (False, True):
        if leaves:
            for key in sorted(extended):
                state = strategy.leaf_again(state, key)
            extended.clear()
        held_left = {k for k in sizes if not allowed(k)}
        while True:
            state, victim = strategy.evict(state, allowed)
            if reference is not None:
                assert victim == reference.evict(allowed)
            if victim is None:
                break
            assert victim in sizes and allowed(victim)
            del sizes[victim]
        assert set(sizes) == held_left
    return evicted


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=200, deadline=None)
@given(operations=ops)
def test_capacity_kept_and_pinned_never_evicted(name, operations):
    drive(policy(name), operations)


@pytest.mark.parametrize("name, reference", sorted(REFERENCES.items()))
@settings(max_examples=300, deadline=None)
@given(operations=ops)
# GDSF: a hit adds one use, not two (after the first eviction key 0 ties key 6 and goes, being older);
# an entry starts with one use (key 2's two uses at priority 6 outrank key 5 at L = 2 plus 3).
@example(operations=[("put", 0, 40), ("put", 3, 40), ("hit", 0, 0), ("put", 6, 40), ("put", 9, 40)])
@example(operations=[("put", 2, 40), ("put", 1, 40), ("hit", 2, 0), ("put", 5, 40), ("put", 8, 40)])
# S3-FIFO: uses are capped at 3 (keys 0 and 1, promoted to main, then used 4 and 3 times: 0 goes first).
@example(operations=[("put", 0, 5), ("hit", 0, 0), ("hit", 0, 0), ("put", 1, 5), ("hit", 1, 0), ("hit", 1, 0),
                     ("put", 2, 85), ("put", 3, 10)] + [("hit", 0, 0)] * 4 + [("hit", 1, 0)] * 3
                    + [("pin", 3, 0), ("put", 4, 85)])
# SIEVE: removing the key under the hand moves the hand to the next key, here one inserted after the hand
# last moved (key 1 is evicted, the hand rests on 2, 3 comes in, 2 is removed: 3 goes next, not 0).
@example(operations=[("put", 0, 40), ("put", 1, 40), ("put", 2, 20), ("hit", 0, 0), ("put", 3, 40),
                     ("remove", 2, 0), ("put", 4, 40)])
def test_agrees_exactly_with_reference(name, reference, operations):
    drive(policy(name), operations, reference())


@settings(max_examples=300, deadline=None)
@given(operations=ops, capacity=st.sampled_from([150, 300, 600]))
def test_s3fifo_agrees_with_reference_when_the_small_queue_has_room(operations, capacity):
    """At 100 bytes the small queue's tenth is nearly always over its share; larger caches reach both
    sides of it, and of the ghost list's bound."""
    drive(policy("s3fifo"), operations, NaiveS3FIFO(capacity), capacity)


runs = st.lists(st.tuples(st.sampled_from(["insert", "access"]), st.lists(st.integers(0, 40), max_size=6, unique=True)),
                max_size=25)


@pytest.mark.parametrize("name, reference", sorted(REFERENCES.items()))
@settings(max_examples=150, deadline=None)
@given(runs=runs)
def test_a_run_of_keys_in_one_call_is_each_key_in_turn(name, reference, runs):
    """``inserted_all`` and ``accessed_all`` (a chain's blocks, told in one call) leave the policy as
    the naive reference told one key at a time: it then evicts in the same order."""
    strategy, naive, held = policy(name), reference(), set()
    state = strategy.empty(CAPACITY)
    for kind, keys in runs:
        if kind == "insert":
            items = [(key, 1, float(key % 3 + 1), key % 7) for key in keys if key not in held]
            for _, _, _, tag in items:
                state = strategy.arriving(state, tag)
                if hasattr(naive, "arriving"):
                    naive.arriving(tag)
            state = strategy.inserted_all(state, items)
            for key, size, cost, tag in items:
                naive.insert(key, size, cost, tag)
                held.add(key)
        else:
            state = strategy.accessed_all(state, [key for key in keys if key in held])
            for key in keys:
                if key in held:
                    naive.access(key)
    while True:
        state, victim = strategy.evict(state, lambda k: True)
        assert victim == naive.evict(lambda k: True)
        if victim is None:
            break
        held.remove(victim)
    assert not held


def test_policies_differ_where_they_should():
    """A scan-resistant order: LRU evicts the hot key after a scan, LFU keeps it."""
    operations = [("put", 1, 30), ("hit", 1, 0), ("hit", 1, 0), ("put", 2, 30), ("put", 3, 30), ("put", 4, 30)]
    assert drive(policy("lru"), operations) == [1]
    assert drive(policy("lfu"), operations) == [2]
    assert drive(policy("fifo"), operations) == [1]


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(UnknownPolicy, match="lru"):
        policy("random")


def test_old_policy_states_never_change():
    strategy = policy("s3fifo")
    state = strategy.empty(CAPACITY)
    states = []
    for key in range(30):
        states.append((state, strategy.evict(state, lambda k: True)[1]))
        state = strategy.inserted(state, key, 10, 10.0, key)
        state = strategy.accessed(state, key // 2)
    for old, victim in states:
        assert strategy.evict(old, lambda k: True)[1] == victim


def footprint(state) -> int:
    """Slots, heap items and table rows a policy state holds, live or stale."""
    total = 0
    for field in attrs.fields(type(state)):
        value = getattr(state, field.name)
        if isinstance(value, StampQueue):
            total += len(value.slots)
        elif isinstance(value, immutables.Map):
            total += len(value) + sum(len(v.slots) for v in value.values() if isinstance(v, StampQueue))
    return total + getattr(state, "items", 0)  # GDSF's heap, live and stale items


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_memory_stays_bounded_by_what_is_held_however_long_it_runs(name, seed):
    """Thousands of requests over at most 12 held keys: stale queue slots are compacted away,
    not kept for ever (a long-running service would leak them)."""
    rng, strategy = random.Random(seed), policy(name)
    reference = REFERENCES[name]()
    state, held, largest = strategy.empty(CAPACITY), set(), 0
    for key in range(4000):
        if len(held) == 12:
            pinned = key % 5  # a fifth of the keys, a different fifth each time, may not go
            state, victim = strategy.evict(state, lambda k: k % 5 != pinned)
            assert victim == reference.evict(lambda k: k % 5 != pinned)  # compactions change no decision
            held.discard(victim)
        size, tag = rng.randrange(1, 16), rng.randrange(20)
        state = strategy.inserted(state, key, size, float(size * (key % 3 + 1)), tag)
        reference.insert(key, size, float(size * (key % 3 + 1)), tag)
        held.add(key)
        for _ in range(rng.randrange(3)):
            hit = rng.choice(sorted(held))
            state = strategy.accessed(state, hit)
            reference.access(hit)
        largest = max(largest, footprint(state))
    # Tables of 12 rows and queues (LFU: one per use count held) compacted past 2 * 12 + 64 slots stay far
    # below the 4,000 slots a queue that is never compacted would hold by now.
    assert largest < 1200


def applied(strategy, state, op, key, size, held, tag):
    """``state`` after one put, hit or remove (pins are ignored), with ``held`` kept up to date."""
    if op == "put":
        held.add(key)
        return strategy.inserted(state, key, size, float(size * (key % 3 + 1)), tag)
    if op == "hit":
        return strategy.accessed(state, key)
    if op == "remove":
        held.discard(key)
        return strategy.removed(state, key)
    return state


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(operations=ops)
def test_a_policy_that_forgot_every_key_keeps_no_row_for_any(name, operations):
    """After every key is removed or evicted, no per-key table keeps a row (S3-FIFO's ghost list of
    evicted content is the one memory meant to outlive its keys)."""
    strategy = policy(name)
    state = strategy.empty(CAPACITY)
    keys = set()
    for op, key, size in operations:
        state = applied(strategy, state, op, key, size, keys, tag=key % 7)
    while True:
        state, victim = strategy.evict(state, lambda k: True)
        if victim is None:
            break
        keys.remove(victim)
    assert not keys
    rows = {field.name: len(getattr(state, field.name)) for field in attrs.fields(type(state))
            if isinstance(getattr(state, field.name), immutables.Map) and field.name not in ("ghost_tags", "ghost_sizes")}
    assert rows == dict.fromkeys(rows, 0)


def heap_nodes(heap, parent=None) -> int:
    """Nodes of GDSF's leftist heap, checking on the way: each node's rank is one more than its right
    child's, the left child's rank is never below the right's (so merges stay logarithmic), and no
    child's item is below its parent's."""
    if heap is None:
        return 0
    rank, item, left, right = heap
    rank_of = (lambda h: h[0] if h is not None else 0)
    assert rank == rank_of(right) + 1 and rank_of(left) >= rank_of(right)
    assert parent is None or parent <= item
    return 1 + heap_nodes(left, item) + heap_nodes(right, item)


@settings(max_examples=200, deadline=None)
@given(operations=long_ops)
def test_gdsf_heap_stays_leftist_and_counts_its_items(operations):
    strategy = policy("gdsf")
    state = strategy.empty(CAPACITY)
    held = set()
    for op, key, size in operations:
        if op == "put" and len(held) >= 4:
            state, victim = strategy.evict(state, lambda k: k % 2 == 0)  # odd keys stay: read past, left in place
            held.discard(victim)
        state = applied(strategy, state, op, key, size, held, tag=0)
        assert heap_nodes(state.heap) == state.items


@settings(max_examples=200, deadline=None)
@given(operations=long_ops)
def test_gdsf_never_reads_a_key_set_aside_while_a_block_extends_it(operations):
    """A key the tier says is extended is out of GDSF's heap until it is a leaf again: no eviction asks
    the tier about it (the reads leaf-first eviction made past every parent), and the heap stays
    leftist and counted as keys go out and come back."""
    strategy = policy("gdsf")
    state = strategy.empty(CAPACITY)
    held, extended = set(), set()

    def allowed(key: int) -> bool:
        assert key not in extended, f"key {key} was read while set aside"
        return True
    for op, key, size in operations:
        if op == "put" and len(held) > len(extended) + 3:
            state, victim = strategy.evict(state, allowed)
            held.discard(victim)
        if op in ("extend", "leaf"):
            state = extension_told(strategy, state, op, key, held, extended)
        else:
            state = applied(strategy, state, op, key, size, held, tag=0)
            extended &= held
        assert heap_nodes(state.heap) == state.items


def test_gdsf_counts_its_heap_items_exactly_through_rebuilds():
    """Every hit pushes a new heap item; past 2 * keys + 64 items the heap is rebuilt from the live ones."""
    strategy = policy("gdsf")
    state = strategy.empty(CAPACITY)
    for key in range(5):
        state = strategy.inserted(state, key, 10, float(key + 1), 0)
    rebuilt = 0
    for hit in range(300):
        before = state.items
        state = strategy.accessed(state, hit % 5)
        rebuilt += state.items < before
        assert heap_nodes(state.heap) == state.items
    assert rebuilt >= 3
    state, victim = strategy.evict(state, lambda k: True)
    assert victim is not None and heap_nodes(state.heap) == state.items


def test_gdsf_eviction_reads_past_held_back_keys_and_rebuilds_a_heap_gone_stale():
    """An eviction whose rule holds back every key but the most valuable one still names the least of
    those allowed (computed here from the live priorities), leaves the held-back keys in the heap, and,
    having read past as many stale items as live ones, rebuilds the heap from the live ones."""
    strategy = policy("gdsf")
    state = strategy.empty(CAPACITY)
    for key in range(100):
        state = strategy.inserted(state, key, 10, float(key + 1), 0)
    for key in range(100):
        state = strategy.accessed(state, key)  # each leaves its first item stale
    assert state.items == 200 and heap_nodes(state.heap) == 200
    live = {key: (info.priority, info.stamp) for key, info in state.info.items()}
    allowed = {97, 98, 99}
    state, victim = strategy.evict(state, lambda k: k in allowed)
    assert victim == min(allowed, key=live.get)
    assert state.items == 99 == len(state.info) and heap_nodes(state.heap) == 99  # rebuilt: no stale item left
    state, second = strategy.evict(state, lambda k: k in allowed)
    assert second == min(allowed - {victim}, key=live.get) and heap_nodes(state.heap) == state.items


def test_s3fifo_evicts_a_main_key_at_the_highest_use_count_when_it_is_the_only_key():
    """Each pass over main takes one use off a key; a key at the top count still goes in the end."""
    s3fifo = policy("s3fifo")
    state = s3fifo.empty(10)                       # small queue: 1 byte
    state = s3fifo.inserted(state, 1, 1, 1.0, 101)  # into small
    state = s3fifo.inserted(state, 2, 1, 1.0, 102)  # small is full before any eviction: into main
    for _ in range(5):
        state = s3fifo.accessed(state, 2)
    assert state.freq[2] == MAX_FREQ                # a 2-bit counter: capped
    state = s3fifo.removed(state, 1)
    state, victim = s3fifo.evict(state, lambda key: True)
    assert victim == 2 and 2 not in state.stamps


@pytest.mark.parametrize("size, remembered", [(9, True), (10, False)])
def test_s3fifo_ghost_remembers_content_up_to_its_own_bound(size, remembered):
    """The ghost stands for 0.9 x capacity bytes: content of exactly that size is remembered."""
    s3fifo = policy("s3fifo")
    state = s3fifo.empty(10)
    assert int(GHOST_SHARE * 10) == 9
    state = s3fifo.inserted(state, 1, size, 1.0, 101)   # into small, never used
    state, victim = s3fifo.evict(state, lambda key: True)
    assert victim == 1 and (101 in state.ghost_tags) is remembered
