"""Every eviction policy: capacity kept, pinned keys never evicted, and LRU/FIFO/LFU exactly as their references."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvstate.core.policies import POLICIES, UnknownPolicy, policy
from tests.reference import NaiveFIFO, NaiveLFU, NaiveLRU, NaiveSIEVE

CAPACITY = 100
ops = st.lists(st.tuples(st.sampled_from(["put", "hit", "hit", "pin", "unpin", "remove"]), st.integers(0, 25),
                         st.integers(1, 40)), max_size=150)


def drive(strategy, operations, reference=None):
    """A byte-bounded cache over ``strategy``; checks every victim, returns the eviction sequence."""
    state = strategy.empty(CAPACITY)
    sizes: dict[int, int] = {}
    pinned: set[int] = set()
    evicted = []
    for op, key, size in operations:
        if op == "put" and key not in sizes:
            while sum(sizes.values()) + size > CAPACITY:
                state, victim = strategy.evict(state, lambda k: k not in pinned)
                if reference is not None:
                    assert victim == reference.evict(lambda k: k not in pinned)
                if victim is None:
                    assert all(k in pinned for k in sizes), "a key could go, yet the policy named none"
                    break
                assert victim in sizes and victim not in pinned
                del sizes[victim]
                evicted.append(victim)
            if sum(sizes.values()) + size <= CAPACITY:
                sizes[key] = size
                state = strategy.inserted(state, key, size, float(size * (key % 3 + 1)), key % 7)
                if reference is not None:
                    reference.insert(key)
        elif op == "hit" and key in sizes:
            state = strategy.accessed(state, key)
            if reference is not None:
                reference.access(key)
        elif op == "pin" and key in sizes:
            pinned.add(key)
        elif op == "unpin":
            pinned.discard(key)
        elif op == "remove" and key in sizes and key not in pinned:
            del sizes[key]
            state = strategy.removed(state, key)
            if reference is not None:
                reference.remove(key)
        assert sum(sizes.values()) <= CAPACITY
    # Draining evicts every unpinned key exactly once, then names none.
    pinned_left = {k for k in sizes if k in pinned}
    while True:
        state, victim = strategy.evict(state, lambda k: k not in pinned)
        if reference is not None:
            assert victim == reference.evict(lambda k: k not in pinned)
        if victim is None:
            break
        assert victim in sizes and victim not in pinned
        del sizes[victim]
    assert set(sizes) == pinned_left
    return evicted


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=200, deadline=None)
@given(operations=ops)
def test_capacity_kept_and_pinned_never_evicted(name, operations):
    drive(policy(name), operations)


@pytest.mark.parametrize("name, reference", [("lru", NaiveLRU), ("fifo", NaiveFIFO), ("lfu", NaiveLFU),
                                             ("sieve", NaiveSIEVE)])
@settings(max_examples=300, deadline=None)
@given(operations=ops)
def test_agrees_exactly_with_reference(name, reference, operations):
    drive(policy(name), operations, reference())


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
