"""The core's policies and the lab's block caches are one set: on the same random access sequences in
count mode (every key one unit), each core policy and its lab twin hit and evict exactly alike."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvstate.core.policies import POLICIES, policy
from kvstate.interpreters.lab.blocks import BLOCK_POLICIES

accesses = st.lists(st.integers(0, 60), min_size=100, max_size=400)  # long enough to cycle the ghost


def core_run(name: str, capacity: int, sequence: list[int]) -> list[tuple[bool, int | None]]:
    strategy = policy(name)
    state, held, out = strategy.empty(capacity), set(), []
    for key in sequence:
        if key in held:
            state = strategy.accessed(state, key)
            out.append((True, None))
            continue
        victim = None
        state = strategy.arriving(state, key)
        while len(held) + 1 > capacity:
            state, victim = strategy.evict(state, lambda k: True)
            held.discard(victim)
        state = strategy.inserted(state, key, 1, 1.0, key)
        held.add(key)
        out.append((False, victim))
    return out


def lab_run(name: str, capacity: int, sequence: list[int]) -> list[tuple[bool, int | None]]:
    cache, out = BLOCK_POLICIES[name](capacity), []
    for key in sequence:
        out.append((True, None) if cache.lookup(key) else (False, cache.insert(key)))
    return out


@settings(max_examples=300, deadline=None)
@given(sequence=accesses, capacity=st.integers(20, 50), name=st.sampled_from(sorted(POLICIES)))
def test_every_core_policy_decides_as_its_lab_twin(name, capacity, sequence):
    assert core_run(name, capacity, sequence) == lab_run(name, capacity, sequence)


def test_the_labs_prefix_policies_are_the_cores_registry_and_each_has_a_block_twin():
    from kvstate.interpreters.lab.runs import PREFIX_POLICIES

    assert PREFIX_POLICIES == tuple(POLICIES)
    assert set(POLICIES) <= set(BLOCK_POLICIES)
