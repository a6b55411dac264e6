"""GDSF: Greedy-Dual-Size-Frequency, cost and size aware (Cherkasova, 1998).

Each key has priority ``L + uses * cost / size``; the lowest goes first and
``L`` (the inflation value) rises to the victim's priority, so long-idle keys
age out. For prefixes ``cost`` is the prefill work an entry saves and ``size``
its bytes: entries cheap to hold for the work they save stay.

The priority queue is a persistent leftist heap of tuples with lazy deletion:
a key's current ``(priority, stamp)`` is in ``info``; older heap items are stale.
"""

from __future__ import annotations

from typing import Optional

import attrs
import immutables

from kvstate.core.policies.base import EMPTY_MAP, NO_STAMP, Evictable, OneAtATime, RemembersNothing, next_stamp, \
    worth_compacting

# A heap node: (rank, item, left, right), item = (priority, stamp, key).
Heap = Optional[tuple]


def _rank(heap: Heap) -> int:
    return heap[0] if heap is not None else 0


def _merge(a: Heap, b: Heap) -> Heap:
    if a is None:
        return b
    if b is None:
        return a
    if b[1] < a[1]:
        a, b = b, a
    right = _merge(a[3], b)
    left = a[2]
    if _rank(left) < _rank(right):
        left, right = right, left
    return (_rank(right) + 1, a[1], left, right)


def _push(heap: Heap, item: tuple) -> Heap:
    return _merge(heap, (1, item, None, None))


def _pop(heap: tuple) -> tuple[tuple, Heap]:
    return heap[1], _merge(heap[2], heap[3])


@attrs.frozen
class GdsfInfo:
    uses: int
    size: int
    cost: float
    priority: float
    stamp: int


@attrs.frozen
class GdsfState:
    heap: Heap
    items: int            # heap items, live and stale
    info: immutables.Map  # key -> GdsfInfo
    inflation: float
    clock: int


class GDSF(RemembersNothing, OneAtATime):
    """Evict the lowest ``L + uses * cost / size``."""

    name = "gdsf"

    def empty(self, capacity: int) -> GdsfState:
        return GdsfState(None, 0, EMPTY_MAP, 0.0, NO_STAMP)

    def _set(self, state: GdsfState, key: int, uses: int, size: int, cost: float) -> GdsfState:
        clock = next_stamp(state.clock)
        priority = state.inflation + uses * cost / max(size, 1)
        info = state.info.set(key, GdsfInfo(uses, size, cost, priority, clock))
        heap, items = _push(state.heap, (priority, clock, key)), state.items + 1
        if worth_compacting(items, len(info)):
            heap, items = None, 0
            for k, i in info.items():
                heap, items = _push(heap, (i.priority, i.stamp, k)), items + 1
        return GdsfState(heap, items, info, state.inflation, clock)

    def inserted(self, state: GdsfState, key: int, size: int, cost: float, tag: int) -> GdsfState:
        return self._set(state, key, 1, size, cost)

    def accessed(self, state: GdsfState, key: int) -> GdsfState:
        info = state.info.get(key)
        return state if info is None else self._set(state, key, info.uses + 1, info.size, info.cost)

    def removed(self, state: GdsfState, key: int) -> GdsfState:
        if key not in state.info:
            return state
        return GdsfState(state.heap, state.items, state.info.delete(key), state.inflation, state.clock)

    def evict(self, state: GdsfState, evictable: Evictable) -> tuple[GdsfState, int | None]:
        heap, items, info = state.heap, state.items, state.info
        kept: list[tuple] = []
        victim = None
        while heap is not None:
            item, heap = _pop(heap)
            items -= 1
            priority, stamp, key = item
            current = info.get(key)
            if current is None or current.stamp != stamp:
                continue  # stale
            if evictable(key):
                victim = item
                break
            kept.append(item)
        for item in kept:
            heap, items = _push(heap, item), items + 1
        if victim is None:
            return GdsfState(heap, items, info, state.inflation, state.clock), None
        priority, _, key = victim
        return GdsfState(heap, items, info.delete(key), max(state.inflation, priority), state.clock), key
