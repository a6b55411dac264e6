"""S3-FIFO (Yang et al., SOSP'23) as libCacheSim's ``S3FIFO.c`` defines it, in bytes.

A small probationary FIFO holds a tenth of the capacity, a main FIFO the rest,
run as a 2-bit clock; a ghost FIFO remembers the content of keys evicted from
the small queue, up to 0.9 x capacity bytes of them. New keys enter the small
queue, or main when the ghost remembers their content (or while the small queue
is full and nothing was evicted yet). Eviction takes from main when main is
over its share or the small queue has nothing to give, else from the small
queue: there a key used at least twice is promoted to main and the first one
that is not goes (into the ghost); in main a used key is queued again with one
use less (at most 2 kept) and the first unused one goes. Keys the caller may
not evict (pinned) are passed over.
"""

from __future__ import annotations

import attrs
import immutables

from kvstate.core.policies.base import EMPTY_MAP, NO_STAMP, Evictable, OneAtATime, ReadsPastExtended, \
    StampQueue, next_stamp

SMALL_SHARE = 0.1
GHOST_SHARE = 0.9
MAX_FREQ = 3
PROMOTE_AT = 2


@attrs.frozen
class S3FifoState:
    small: StampQueue
    main: StampQueue
    stamps: immutables.Map   # key -> stamp of its slot (in small or main)
    in_small: immutables.Map  # key -> bool
    freq: immutables.Map     # key -> 0..3
    sizes: immutables.Map    # key -> bytes
    tags: immutables.Map     # key -> content tag
    small_bytes: int
    ghost: StampQueue        # content tags evicted from small, oldest first
    ghost_tags: immutables.Map  # tag -> stamp of its ghost slot
    capacity: int
    clock: int
    total_bytes: int = 0
    ghost_sizes: immutables.Map = EMPTY_MAP  # tag -> bytes it stood for
    ghost_bytes: int = 0
    evicted: bool = False    # whether anything was evicted yet (insertion into main until then)
    #: A tag the ghost remembered when it arrived (taken off the ghost before room was made for it).
    arrived: int | None = None

    @property
    def small_capacity(self) -> int:
        return int(SMALL_SHARE * self.capacity)


class S3FIFO(OneAtATime, ReadsPastExtended):
    """Quick demotion of one-hit wonders through a small FIFO."""

    name = "s3fifo"

    def empty(self, capacity: int) -> S3FifoState:
        return S3FifoState(StampQueue(), StampQueue(), EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, 0,
                           StampQueue(), EMPTY_MAP, capacity, NO_STAMP)

    def arriving(self, state: S3FifoState, tag: int) -> S3FifoState:
        """A miss on ``tag``: the ghost gives it up now, before evictions (which may fill the ghost)."""
        if tag not in state.ghost_tags:
            return state if state.arrived is None else attrs.evolve(state, arrived=None)
        return attrs.evolve(self._forget(state, tag), arrived=tag)

    def inserted(self, state: S3FifoState, key: int, size: int, cost: float, tag: int) -> S3FifoState:
        if key in state.stamps:
            state = self.removed(state, key)
        remembered = tag == state.arrived or tag in state.ghost_tags
        to_main = remembered or (not state.evicted and state.small_bytes >= state.small_capacity)
        if tag in state.ghost_tags:
            state = self._forget(state, tag)
        if state.arrived is not None:
            state = attrs.evolve(state, arrived=None)
        state = attrs.evolve(state, sizes=state.sizes.set(key, size), tags=state.tags.set(key, tag),
                             freq=state.freq.set(key, 0), total_bytes=state.total_bytes + size)
        return self._queue(state, key, small=not to_main)

    @staticmethod
    def _forget(state: S3FifoState, tag: int) -> S3FifoState:
        """``tag`` leaves the ghost."""
        ghost_tags = state.ghost_tags.delete(tag)
        return attrs.evolve(state, ghost_tags=ghost_tags, ghost=state.ghost.advanced(ghost_tags),
                            ghost_sizes=state.ghost_sizes.delete(tag),
                            ghost_bytes=state.ghost_bytes - state.ghost_sizes[tag])

    def _queue(self, state: S3FifoState, key: int, small: bool) -> S3FifoState:
        clock = next_stamp(state.clock)
        stamps = state.stamps.set(key, clock)
        was_small = key in state.stamps and state.in_small[key]
        small_bytes = state.small_bytes - (state.sizes[key] if was_small else 0) + (state.sizes[key] if small else 0)
        if small:
            queues = {"small": state.small.push(key, clock).compacted(stamps), "main": state.main}
        else:
            queues = {"small": state.small, "main": state.main.push(key, clock).compacted(stamps)}
        return attrs.evolve(state, stamps=stamps, in_small=state.in_small.set(key, small),
                            small_bytes=small_bytes, clock=clock, **queues)

    def accessed(self, state: S3FifoState, key: int) -> S3FifoState:
        count = state.freq.get(key)
        if count is None or count >= MAX_FREQ:
            return state
        return attrs.evolve(state, freq=state.freq.set(key, count + 1))

    def removed(self, state: S3FifoState, key: int) -> S3FifoState:
        if key not in state.stamps:
            return state
        stamps = state.stamps.delete(key)
        small = state.in_small[key]
        return attrs.evolve(
            state, stamps=stamps, in_small=state.in_small.delete(key), freq=state.freq.delete(key),
            sizes=state.sizes.delete(key), tags=state.tags.delete(key), total_bytes=state.total_bytes - state.sizes[key],
            small_bytes=state.small_bytes - (state.sizes[key] if small else 0),
            small=state.small.advanced(stamps) if small else state.small,
            main=state.main if small else state.main.advanced(stamps))

    def _remember(self, state: S3FifoState, tag: int, size: int) -> S3FifoState:
        """Put ``tag`` (content of ``size`` bytes) on the ghost FIFO, oldest going first past its bytes."""
        bound = int(GHOST_SHARE * state.capacity)
        if tag in state.ghost_tags or size > bound:
            return state
        while state.ghost_tags and state.ghost_bytes + size > bound:
            _, oldest, _ = next(state.ghost.live(state.ghost_tags))
            state = self._forget(state, oldest)
        clock = next_stamp(state.clock)
        ghost_tags = state.ghost_tags.set(tag, clock)
        return attrs.evolve(state, ghost=state.ghost.push(tag, clock).compacted(ghost_tags), ghost_tags=ghost_tags,
                            ghost_sizes=state.ghost_sizes.set(tag, size), ghost_bytes=state.ghost_bytes + size,
                            clock=clock)

    def _first(self, queue: StampQueue, state: S3FifoState, evictable: Evictable) -> int | None:
        return next((k for _, k, _ in queue.live(state.stamps) if evictable(k)), None)

    def evict(self, state: S3FifoState, evictable: Evictable) -> tuple[S3FifoState, int | None]:
        state = state if state.evicted else attrs.evolve(state, evicted=True)
        small_key, main_key = self._first(state.small, state, evictable), self._first(state.main, state, evictable)
        if small_key is None and main_key is None:
            return state, None
        main_bytes = state.total_bytes - state.small_bytes
        if main_key is not None and (main_bytes > state.capacity - state.small_capacity or small_key is None):
            order = (self._evict_main, self._evict_small)
        else:
            order = (self._evict_small, self._evict_main)
        for evict_from in order:
            state, victim = evict_from(state, evictable)
            if victim is not None:
                return state, victim
        return state, None

    def _evict_small(self, state: S3FifoState, evictable: Evictable) -> tuple[S3FifoState, int | None]:
        """Promote small keys used at least twice until one that was not goes (into the ghost). Each
        promotion takes a key out of small, so this ends."""
        while True:
            key = self._first(state.small, state, evictable)
            if key is None:
                return state, None
            if state.freq[key] >= PROMOTE_AT:
                state = self._queue(attrs.evolve(state, freq=state.freq.set(key, 0)), key, small=False)
                continue
            tag, size = state.tags[key], state.sizes[key]
            return self._remember(self.removed(state, key), tag, size), key

    def _evict_main(self, state: S3FifoState, evictable: Evictable) -> tuple[S3FifoState, int | None]:
        """Give used main keys another pass with one use less until an unused one goes. Each pass takes
        a use off, so this ends."""
        while True:
            key = self._first(state.main, state, evictable)
            if key is None:
                return state, None
            count = state.freq[key]
            if count > 0:
                state = self._queue(attrs.evolve(state, freq=state.freq.set(key, count - 1)), key, small=False)
                continue
            return self.removed(state, key), key
