"""S3-FIFO: a small probationary FIFO, a main FIFO and a ghost list (Yang et al., SOSP'23).

New keys enter the small queue (a tenth of the capacity in bytes) unless the
ghost list remembers their content, then they enter main. Evicting from the
small queue promotes keys used more than once to main and remembers the rest
in the ghost list; evicting from main re-queues keys used since with one use
less (Algorithm 1 of the paper, use counts capped at 3).
"""

from __future__ import annotations

import attrs
import immutables

from kvstate.core.policies.base import EMPTY_MAP, Evictable, StampQueue

SMALL_SHARE = 0.1
MAX_FREQ = 3


@attrs.frozen(slots=True)
class S3FifoState:
    small: StampQueue
    main: StampQueue
    stamps: immutables.Map   # key -> stamp of its slot (in small or main)
    in_small: immutables.Map  # key -> bool
    freq: immutables.Map     # key -> 0..3
    sizes: immutables.Map    # key -> bytes
    tags: immutables.Map     # key -> content tag
    small_bytes: int
    small_count: int
    ghost: StampQueue        # content tags evicted from small, oldest first
    ghost_tags: immutables.Map  # tag -> stamp of its ghost slot
    capacity: int
    clock: int


class S3FIFO:
    """Quick demotion of one-hit wonders through a small FIFO."""

    name = "s3fifo"

    def empty(self, capacity: int) -> S3FifoState:
        return S3FifoState(StampQueue(), StampQueue(), EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, EMPTY_MAP, 0, 0,
                           StampQueue(), EMPTY_MAP, capacity, 0)

    def inserted(self, state: S3FifoState, key: int, size: int, cost: float, tag: int) -> S3FifoState:
        if key in state.stamps:
            state = self.removed(state, key)
        to_main = tag in state.ghost_tags
        ghost_tags = state.ghost_tags.delete(tag) if to_main else state.ghost_tags
        state = attrs.evolve(state, ghost_tags=ghost_tags, sizes=state.sizes.set(key, size),
                             tags=state.tags.set(key, tag), freq=state.freq.set(key, 0))
        return self._queue(state, key, small=not to_main)

    def _queue(self, state: S3FifoState, key: int, small: bool) -> S3FifoState:
        clock = state.clock + 1
        stamps = state.stamps.set(key, clock)
        was_small = state.in_small.get(key, False) and key in state.stamps
        small_bytes = state.small_bytes - (state.sizes[key] if was_small else 0) + (state.sizes[key] if small else 0)
        if small:
            queues = {"small": state.small.push(key, clock).compacted(stamps), "main": state.main}
        else:
            queues = {"small": state.small, "main": state.main.push(key, clock).compacted(stamps)}
        small_count = state.small_count - was_small + small
        return attrs.evolve(state, stamps=stamps, in_small=state.in_small.set(key, small),
                            small_bytes=small_bytes, small_count=small_count, clock=clock, **queues)

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
            sizes=state.sizes.delete(key), tags=state.tags.delete(key),
            small_bytes=state.small_bytes - (state.sizes[key] if small else 0),
            small_count=state.small_count - small,
            small=state.small.advanced(stamps) if small else state.small,
            main=state.main if small else state.main.advanced(stamps))

    def _remember(self, state: S3FifoState, tag: int) -> S3FifoState:
        """Put ``tag`` on the ghost list, keeping it no longer than main holds keys."""
        clock = state.clock + 1
        ghost_tags = state.ghost_tags.set(tag, clock)
        ghost = state.ghost.push(tag, clock)
        bound = max(1, len(state.stamps) - state.small_count)
        while len(ghost_tags) > bound:
            _, oldest, _ = next(ghost.live(ghost_tags))
            ghost_tags = ghost_tags.delete(oldest)
            ghost = ghost.advanced(ghost_tags)
        return attrs.evolve(state, ghost=ghost.compacted(ghost_tags), ghost_tags=ghost_tags, clock=clock)

    def evict(self, state: S3FifoState, evictable: Evictable) -> tuple[S3FifoState, int | None]:
        # Every round either evicts, promotes a small key to main, or spends one use of a main key:
        # bounded by (small keys) + (MAX_FREQ + 1) * (all keys) rounds.
        for _ in range(len(state.stamps) * (MAX_FREQ + 2) + 1):
            small_key = next((k for _, k, _ in state.small.live(state.stamps) if evictable(k)), None)
            main_key = next((k for _, k, _ in state.main.live(state.stamps) if evictable(k)), None)
            if small_key is None and main_key is None:
                return state, None
            if small_key is not None and (state.small_bytes > SMALL_SHARE * state.capacity or main_key is None):
                if state.freq[small_key] > 1:
                    state = self._queue(attrs.evolve(state, freq=state.freq.set(small_key, 0)), small_key, small=False)
                    continue
                tag = state.tags[small_key]
                return self._remember(self.removed(state, small_key), tag), small_key
            count = state.freq[main_key]
            if count > 0:
                state = self._queue(attrs.evolve(state, freq=state.freq.set(main_key, count - 1)), main_key, small=False)
                continue
            return self.removed(state, main_key), main_key
        return state, None
