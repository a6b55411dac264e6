"""SIEVE: a FIFO queue with a visited bit and a hand that sweeps it (Zhang et al., NSDI'24).

A hit only sets the key's visited bit. To evict, the hand moves from the
oldest slot toward the newest, clearing visited bits, and evicts the first
unvisited key; it rests on the next key and wraps around to the oldest. A key
that enters later is never under the hand: past the last key it rested before,
the hand wraps (``hand_clock`` is the clock when it was placed, and only slots
stamped no later count as ahead of it).
"""

from __future__ import annotations

import attrs
import immutables
from pyrsistent import pvector

from kvstate.core.policies.base import EMPTY_MAP, NO_STAMP, Evictable, OneAtATime, ReadsPastExtended, \
    RemembersNothing, StampQueue, next_stamp, worth_compacting


@attrs.frozen
class SieveState:
    queue: StampQueue
    stamps: immutables.Map
    visited: immutables.Map  # key -> bool
    hand: int        # slot index the hand rests at (the first live slot from there)
    hand_clock: int  # slots stamped after this entered behind the hand's back
    clock: int


class SIEVE(RemembersNothing, OneAtATime, ReadsPastExtended):
    """Lazy promotion, quick demotion."""

    name = "sieve"

    def empty(self, capacity: int) -> SieveState:
        queue = StampQueue()
        return SieveState(queue, EMPTY_MAP, EMPTY_MAP, queue.head, NO_STAMP, NO_STAMP)

    def inserted(self, state: SieveState, key: int, size: int, cost: float, tag: int) -> SieveState:
        state = self._leaving(state, key)
        clock = next_stamp(state.clock)
        stamps = state.stamps.set(key, clock)
        queue, hand = state.queue.push(key, clock), state.hand
        if worth_compacting(len(queue.slots), len(stamps)):
            live = list(queue.live(stamps))
            hand = sum(1 for index, _, _ in live if index < hand)
            queue = StampQueue(pvector((k, s) for _, k, s in live), 0)
        return SieveState(queue, stamps, state.visited.set(key, False), hand, state.hand_clock, clock)

    def _under_hand(self, state: SieveState) -> int | None:
        """The index of the slot the hand rests on, or None when it has passed the last one."""
        slots, stamps = state.queue.slots, state.stamps
        for i in range(max(state.hand, state.queue.head), len(slots)):
            key, stamp = slots[i]
            if stamps.get(key) == stamp:
                return i if stamp <= state.hand_clock else None
        return None

    def _leaving(self, state: SieveState, key: int) -> SieveState:
        """Before ``key``'s slot goes stale: if the hand rests on it, the hand moves on to the next key."""
        at = self._under_hand(state) if key in state.stamps else None
        if at is None or state.queue.slots[at][0] != key:
            return state
        return attrs.evolve(state, hand=at + 1, hand_clock=state.clock)

    def accessed(self, state: SieveState, key: int) -> SieveState:
        if key not in state.stamps or state.visited[key]:
            return state
        return SieveState(state.queue, state.stamps, state.visited.set(key, True), state.hand, state.hand_clock,
                          state.clock)

    def removed(self, state: SieveState, key: int) -> SieveState:
        if key not in state.stamps:
            return state
        return self._forget(self._leaving(state, key), key)

    def _forget(self, state: SieveState, key: int) -> SieveState:
        stamps = state.stamps.delete(key)
        return SieveState(state.queue.advanced(stamps), stamps, state.visited.delete(key), state.hand,
                          state.hand_clock, state.clock)

    def evict(self, state: SieveState, evictable: Evictable) -> tuple[SieveState, int | None]:
        slots, head, stamps = state.queue.slots, state.queue.head, state.stamps
        visited = state.visited
        span = len(slots) - head
        if not stamps:
            return state, None
        under = self._under_hand(state)
        i = head if under is None else under
        for _ in range(2 * span + 1):  # one pass may only clear bits; the second finds a victim if any
            if i >= len(slots):
                i = head
            key, stamp = slots[i]
            if stamps.get(key) == stamp and evictable(key):
                if visited[key]:
                    visited = visited.set(key, False)
                else:
                    gone = self._forget(attrs.evolve(state, visited=visited), key)
                    return attrs.evolve(gone, hand=i + 1, hand_clock=state.clock), key  # the hand rests past it
            i += 1
        return attrs.evolve(state, visited=visited), None
