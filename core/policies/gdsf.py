"""GDSF: Greedy-Dual-Size-Frequency, cost and size aware (Cherkasova, 1998).

Each key has priority ``L + uses * cost / size``; the lowest goes first and
``L`` (the inflation value) rises to the victim's priority, so long-idle keys
age out. For prefixes ``cost`` is the prefill work an entry saves and ``size``
its bytes: entries cheap to hold for the work they save stay.

The priority queue is a persistent leftist heap of tuples with lazy deletion:
a key's current ``(priority, stamp)`` is in ``info``; older heap items are stale.
An eviction reads the heap in order and pops nothing the caller's rule holds back,
so its cost is the items read. In blocks most of what it would read are blocks
something still extends, whose priority leaf-first eviction cannot act on: the
tier says so (``extended``), and such a key is set aside (``parked``, its items
stale) until it is a leaf again, when its item goes back as it was, with the same
``(priority, stamp)``: the same victims, without reading past every parent.
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
    parked: immutables.Map = EMPTY_MAP  # key -> True: extended, out of the heap until a leaf again


class GDSF(RemembersNothing, OneAtATime):
    """Evict the lowest ``L + uses * cost / size``."""

    name = "gdsf"

    def empty(self, capacity: int) -> GdsfState:
        return GdsfState(None, 0, EMPTY_MAP, 0.0, NO_STAMP)

    def _set(self, state: GdsfState, key: int, uses: int, size: int, cost: float) -> GdsfState:
        clock = next_stamp(state.clock)
        priority = state.inflation + uses * cost / max(size, 1)
        info = state.info.set(key, GdsfInfo(uses, size, cost, priority, clock))
        heap, items = state.heap, state.items
        if key not in state.parked:  # a parked key's item goes in when it is a leaf again
            heap, items = _push(heap, (priority, clock, key)), items + 1
        if worth_compacting(items, len(info)):
            heap, items = _heap_of(info, state.parked)
        return GdsfState(heap, items, info, state.inflation, clock, state.parked)

    def inserted(self, state: GdsfState, key: int, size: int, cost: float, tag: int) -> GdsfState:
        return self._set(state, key, 1, size, cost)

    def accessed(self, state: GdsfState, key: int) -> GdsfState:
        info = state.info.get(key)
        return state if info is None else self._set(state, key, info.uses + 1, info.size, info.cost)

    def removed(self, state: GdsfState, key: int) -> GdsfState:
        if key not in state.info:
            return state
        parked = state.parked.delete(key) if key in state.parked else state.parked
        return GdsfState(state.heap, state.items, state.info.delete(key), state.inflation, state.clock, parked)

    def extended(self, state: GdsfState, key: int) -> GdsfState:
        """Told before ``key`` is inserted (a chain's new blocks), its item never goes in until it is a
        leaf again; told after, its items read as stale from now."""
        if key in state.parked:
            return state
        return attrs.evolve(state, parked=state.parked.set(key, True))

    def leaf_again(self, state: GdsfState, key: int) -> GdsfState:
        if key not in state.parked:
            return state
        current = state.info[key]
        return attrs.evolve(state, heap=_push(state.heap, (current.priority, current.stamp, key)),
                            items=state.items + 1, parked=state.parked.delete(key))

    def evict(self, state: GdsfState, evictable: Evictable) -> tuple[GdsfState, int | None]:
        heap, items, info, parked = state.heap, state.items, state.info, state.parked
        while heap is not None and _stale(heap[1], info, parked):  # stale items at the front go for good
            heap, items = _merge(heap[2], heap[3]), items - 1
        victim, visited, stale = _first_allowed(heap, info, parked, evictable)
        if victim is not None:
            info = info.delete(victim[2])
            if heap[1] is victim:
                heap, items = _merge(heap[2], heap[3]), items - 1
            # elsewhere in the heap the victim's item is left stale (its key is gone from ``info``)
        if stale > STALE_VISITS and 2 * stale >= visited:  # as many stale as live on the way: rebuilt
            heap, items = _heap_of(info, parked)
        if victim is None:
            return GdsfState(heap, items, info, state.inflation, state.clock, parked), None
        return GdsfState(heap, items, info, max(state.inflation, victim[0]), state.clock, parked), victim[2]


#: Stale items one eviction may read past before the heap is rebuilt from its live items.
STALE_VISITS = 64


def _stale(item: tuple, info: immutables.Map, parked: immutables.Map) -> bool:
    current = info.get(item[2])
    return current is None or current.stamp != item[1] or item[2] in parked


def _heap_of(info: immutables.Map, parked: immutables.Map) -> tuple[Heap, int]:
    """A heap of the live items of ``info`` (bar the parked keys') and their count, built at once: in
    order, each node's left child the next (a leftist heap whose right children are all empty)."""
    heap, count = None, 0
    for item in sorted(((i.priority, i.stamp, key) for key, i in info.items() if key not in parked), reverse=True):
        heap, count = (1, item, heap, None), count + 1
    return heap, count


def _first_allowed(heap: Heap, info: immutables.Map, parked: immutables.Map,
                   evictable: Evictable) -> tuple[tuple | None, int, int]:
    """The least live item of ``heap`` whose key ``evictable`` allows (None), with the items read and
    how many of them were stale; the heap unchanged.

    Items are visited in order, a node's children once the node is passed (the order pops would give),
    so the keys the rule holds back (pinned, read, leased; a block something extends is set aside, not
    read) are read, not popped and pushed back."""
    frontier = [(heap[1], id(heap), heap)] if heap is not None else []
    visited = stale = 0
    while frontier:
        item, _, node = heapq.heappop(frontier)
        visited += 1
        if _stale(item, info, parked):
            stale += 1
        elif evictable(item[2]):
            return item, visited, stale
        for child in (node[2], node[3]):
            if child is not None:
                # A key set aside and back may have two equal items in the heap: the node's id breaks the tie.
                heapq.heappush(frontier, (child[1], id(child), child))
    return None, visited, stale
