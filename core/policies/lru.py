"""LRU: evict the entry used least recently (mlx-lm's server and most prompt caches)."""

from __future__ import annotations

import attrs
import immutables

from kvstate.core.policies.base import EMPTY_MAP, NO_STAMP, Evictable, ReadsPastExtended, RemembersNothing, \
    StampQueue, first_evictable, next_stamp


@attrs.frozen
class QueueState:
    """Keys in order of their stamp (last use for LRU, insertion for FIFO)."""

    queue: StampQueue
    stamps: immutables.Map
    clock: int


class LRU(RemembersNothing, ReadsPastExtended):
    """Least recently used first."""

    name = "lru"
    requeue_on_access = True

    def empty(self, capacity: int) -> QueueState:
        return QueueState(StampQueue(), EMPTY_MAP, NO_STAMP)

    def inserted(self, state: QueueState, key: int, size: int, cost: float, tag: int) -> QueueState:
        return self._queued(state, key)

    def accessed(self, state: QueueState, key: int) -> QueueState:
        if not self.requeue_on_access or key not in state.stamps:
            return state
        return self._queued(state, key)

    def inserted_all(self, state: QueueState, items: list[tuple[int, int, float, int]]) -> QueueState:
        return self._queued_all(state, [key for key, _, _, _ in items])

    def accessed_all(self, state: QueueState, keys: list[int]) -> QueueState:
        if not self.requeue_on_access:
            return state
        return self._queued_all(state, [key for key in keys if key in state.stamps])

    @staticmethod
    def _queued_all(state: QueueState, keys: list[int]) -> QueueState:
        """Each of ``keys`` at the back of the queue in turn: one append of their slots, as
        :meth:`_queued` of each would leave the queue's live slots."""
        if not keys:
            return state
        clock, stamps, slots = state.clock, state.stamps.mutate(), []
        for key in keys:
            clock = next_stamp(clock)
            stamps[key] = clock
            slots.append((key, clock))
        finished = stamps.finish()
        return QueueState(state.queue.pushed_all(slots).compacted(finished), finished, clock)

    @staticmethod
    def _queued(state: QueueState, key: int) -> QueueState:
        """``key`` at the back of the queue."""
        clock = next_stamp(state.clock)
        stamps = state.stamps.set(key, clock)
        return QueueState(state.queue.push(key, clock).compacted(stamps), stamps, clock)

    def removed(self, state: QueueState, key: int) -> QueueState:
        if key not in state.stamps:
            return state
        stamps = state.stamps.delete(key)
        return QueueState(state.queue.advanced(stamps), stamps, state.clock)

    def evict(self, state: QueueState, evictable: Evictable) -> tuple[QueueState, int | None]:
        victim = first_evictable(state.queue, state.stamps, evictable)
        if victim is None:
            return state, None
        return self.removed(state, victim), victim
