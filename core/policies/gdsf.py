"""GDSF: Greedy-Dual-Size-Frequency, cost and size aware (Cherkasova, 1998).

Each key has priority ``L + uses * cost / size``; the lowest goes first and
``L`` (the inflation value) rises to the victim's priority, so long-idle keys
age out. For prefixes ``cost`` is the prefill work an entry saves and ``size``
its bytes: entries cheap to hold for the work they save stay.

The priority queue is a persistent leftist heap of tuples with lazy deletion:
a key's current ``(priority, stamp)`` is in ``info``; older heap items are stale.
An eviction reads the heap in order and pops nothing the caller's rule holds back
(in blocks, every block something still extends), so its cost is the items read.
"""

from __future__ import annotations

import heapq
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
            heap, items = _heap_of(info)
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
        while heap is not None and _stale(heap[1], info):  # stale items at the front go for good
            heap, items = _merge(heap[2], heap[3]), items - 1
        victim, visited, stale = _first_allowed(heap, info, evictable)
        if victim is not None:
            info = info.delete(victim[2])
            if heap[1] is victim:
                heap, items = _merge(heap[2], heap[3]), items - 1
            # elsewhere in the heap the victim's item is left stale (its key is gone from ``info``)
        if stale > STALE_VISITS and 2 * stale >= visited:  # as many stale as live on the way: rebuilt
            heap, items = _heap_of(info)
        if victim is None:
            return GdsfState(heap, items, info, state.inflation, state.clock), None
        return GdsfState(heap, items, info, max(state.inflation, victim[0]), state.clock), victim[2]


#: Stale items one eviction may read past before the heap is rebuilt from its live items.
STALE_VISITS = 64


def _stale(item: tuple, info: immutables.Map) -> bool:
    current = info.get(item[2])
    return current is None or current.stamp != item[1]


def _heap_of(info: immutables.Map) -> tuple[Heap, int]:
    """A heap of the live items of ``info`` and their count, built at once: in order, each node's left
    child the next (a leftist heap whose right children are all empty)."""
    heap = None
    for item in sorted(((i.priority, i.stamp, key) for key, i in info.items()), reverse=True):
        heap = (1, item, heap, None)
    return heap, len(info)


def _first_allowed(heap: Heap, info: immutables.Map, evictable: Evictable) -> tuple[tuple | None, int, int]:
    """The least live item of ``heap`` whose key ``evictable`` allows (None), with the items read and
    how many of them were stale; the heap unchanged.

    Items are visited in order, a node's children once the node is passed (the order pops would give),
    so the keys the rule holds back (a block something still extends) are read, not popped and pushed
    back."""
    frontier = [(heap[1], heap)] if heap is not None else []
    visited = stale = 0
    while frontier:
        item, node = heapq.heappop(frontier)
        visited += 1
        if _stale(item, info):
            stale += 1
        elif evictable(item[2]):
            return item, visited, stale
        for child in (node[2], node[3]):
            if child is not None:
                heapq.heappush(frontier, (child[1], child))  # items are unique (stamps are): nodes never compared
    return None, visited, stale
