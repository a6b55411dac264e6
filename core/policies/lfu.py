"""LFU: evict the entry used least often; among equals, the one used least recently."""

from __future__ import annotations

import attrs
import immutables

from kvstate.core.policies.base import EMPTY_MAP, NO_STAMP, Evictable, OneAtATime, ReadsPastExtended, \
    RemembersNothing, StampQueue, next_stamp


@attrs.frozen
class LfuState:
    """Per key its use count; per count a queue in order of entering that count (= last use)."""

    stamps: immutables.Map      # key -> stamp of its current slot
    counts: immutables.Map      # key -> uses so far
    buckets: immutables.Map     # count -> StampQueue
    live: immutables.Map        # count -> live keys in that bucket
    clock: int


class LFU(RemembersNothing, OneAtATime, ReadsPastExtended):
    """Least frequently used first, ties by least recent use."""

    name = "lfu"

    def empty(self, capacity: int) -> LfuState:
        return LfuState(EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, NO_STAMP)

    def _enter(self, state: LfuState, key: int, count: int, old: int | None) -> LfuState:
        clock = next_stamp(state.clock)
        stamps = state.stamps.set(key, clock)
        live, buckets = state.live, state.buckets
        if old is not None and live[old] > 1:
            live = live.set(old, live[old] - 1)
        elif old is not None:  # the last key of its count left: so does the bucket
            live, buckets = live.delete(old), buckets.delete(old)
        live = live.set(count, live.get(count, 0) + 1)
        bucket = buckets.get(count, StampQueue()).push(key, clock).compacted(stamps)
        return LfuState(stamps, state.counts.set(key, count), buckets.set(count, bucket), live, clock)

    def inserted(self, state: LfuState, key: int, size: int, cost: float, tag: int) -> LfuState:
        return self._enter(state, key, 1, state.counts.get(key))

    def accessed(self, state: LfuState, key: int) -> LfuState:
        count = state.counts.get(key)
        return state if count is None else self._enter(state, key, count + 1, count)

    def removed(self, state: LfuState, key: int) -> LfuState:
        count = state.counts.get(key)
        if count is None:
            return state
        stamps = state.stamps.delete(key)
        live = state.live.set(count, state.live[count] - 1) if state.live[count] > 1 else state.live.delete(count)
        buckets = state.buckets
        if count in live:
            buckets = buckets.set(count, buckets[count].advanced(stamps))
        else:
            buckets = buckets.delete(count)
        return LfuState(stamps, state.counts.delete(key), buckets, live, state.clock)

    def evict(self, state: LfuState, evictable: Evictable) -> tuple[LfuState, int | None]:
        for count in sorted(state.live.keys()):
            for _, key, _ in state.buckets[count].live(state.stamps):
                if evictable(key):
                    return self.removed(state, key), key
        return state, None
