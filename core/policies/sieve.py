"""SIEVE: a FIFO queue with a visited bit and a hand that sweeps it (Zhang et al., NSDI'24).

A hit only sets the key's visited bit. To evict, the hand moves from the
oldest slot toward the newest, clearing visited bits, and evicts the first
unvisited key; it remembers where it stopped and wraps around to the oldest.
"""

from __future__ import annotations

import attrs
import immutables
from pyrsistent import pvector

from kvstate.core.policies.base import EMPTY_MAP, Evictable, StampQueue


@attrs.frozen(slots=True)
class SieveState:
    queue: StampQueue
    stamps: immutables.Map
    visited: immutables.Map  # key -> bool
    hand: int
    clock: int


class SIEVE:
    """Lazy promotion, quick demotion."""

    name = "sieve"

    def empty(self, capacity: int) -> SieveState:
        return SieveState(StampQueue(), EMPTY_MAP, EMPTY_MAP, 0, 0)

    def inserted(self, state: SieveState, key: int, size: int, cost: float, tag: int) -> SieveState:
        clock = state.clock + 1
        stamps = state.stamps.set(key, clock)
        queue, hand = state.queue.push(key, clock), state.hand
        if len(queue.slots) - queue.head > 2 * len(stamps) + 64:
            live = list(queue.live(stamps))
            hand = sum(1 for index, _, _ in live if index < hand)
            queue = StampQueue(pvector((k, s) for _, k, s in live), 0)
        return SieveState(queue, stamps, state.visited.set(key, False), hand, clock)

    def accessed(self, state: SieveState, key: int) -> SieveState:
        if key not in state.stamps or state.visited[key]:
            return state
        return SieveState(state.queue, state.stamps, state.visited.set(key, True), state.hand, state.clock)

    def removed(self, state: SieveState, key: int) -> SieveState:
        if key not in state.stamps:
            return state
        stamps = state.stamps.delete(key)
        return SieveState(state.queue.advanced(stamps), stamps, state.visited.delete(key), state.hand, state.clock)

    def evict(self, state: SieveState, evictable: Evictable) -> tuple[SieveState, int | None]:
        slots, head, stamps = state.queue.slots, state.queue.head, state.stamps
        visited = state.visited
        span = len(slots) - head
        if not stamps or span <= 0:
            return state, None
        i = state.hand if head <= state.hand < len(slots) else head
        for _ in range(2 * span + 1):  # one pass may only clear bits; the second finds a victim if any
            if i >= len(slots):
                i = head
            key, stamp = slots[i]
            if stamps.get(key) == stamp and evictable(key):
                if visited[key]:
                    visited = visited.set(key, False)
                else:
                    cleared = SieveState(state.queue, stamps, visited, i + 1, state.clock)
                    return self.removed(cleared, key), key
            i += 1
        return SieveState(state.queue, stamps, visited, state.hand, state.clock), None
