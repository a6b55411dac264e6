"""The one protocol every eviction policy follows, and the lazy queue most of them share.

A policy is a stateless strategy object; what it remembers lives in a frozen
state value it returns from every call, so the core's state stays immutable.
Keys are entry ids. ``evict`` picks one victim among the keys the core says
may go (never one pinned by a running request or an in-flight effect) and
forgets it; it returns None when nothing may go.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import attrs
import immutables
from pyrsistent import PVector, pvector

from kvstate.core.errors import UsageError

Evictable = Callable[[int], bool]


class EvictionPolicy(Protocol):
    """What the core asks of a policy. ``S`` is the policy's own frozen state."""

    name: str

    def empty(self, capacity: int) -> Any:
        """State for a cache of ``capacity`` bytes holding nothing."""

    def arriving(self, state: Any, tag: int) -> Any:
        """Content ``tag`` missed and is about to be kept (room is made next): a policy that remembers
        evicted content (S3-FIFO's ghost) takes note before it evicts for it."""

    def inserted(self, state: Any, key: int, size: int, cost: float, tag: int) -> Any:
        """``key`` entered, holding ``size`` bytes that cost ``cost`` to recompute; ``tag`` names its content."""

    def accessed(self, state: Any, key: int) -> Any:
        """``key`` was used (a hit)."""

    def inserted_all(self, state: Any, items: list[tuple[int, int, float, int]]) -> Any:
        """Each ``(key, size, cost, tag)`` of ``items`` entered, in that order (a chain's new blocks)."""

    def accessed_all(self, state: Any, keys: list[int]) -> Any:
        """Each of ``keys`` was used, in that order (the blocks of a chain a hit assembles)."""

    def removed(self, state: Any, key: int) -> Any:
        """``key`` left by the core's own decision (demoted, rejected); forget it."""

    def evict(self, state: Any, evictable: Evictable) -> tuple[Any, int | None]:
        """``(state, victim)``: the key to evict among those ``evictable`` allows, forgotten; or None."""

    def extended(self, state: Any, key: int) -> Any:
        """A block the tier holds now extends ``key``'s: ``evictable`` refuses it until
        :meth:`leaf_again` (leaf first). A policy may set it aside instead of reading past it. A key
        that enters already extended is told just before it is inserted."""

    def leaf_again(self, state: Any, key: int) -> Any:
        """Nothing the tier holds extends ``key``'s block any more (after :meth:`extended`)."""


class RemembersNothing:
    """For policies without memory of evicted content: an arriving miss changes nothing."""

    def arriving(self, state: Any, tag: int) -> Any:
        return state


class ReadsPastExtended:
    """For policies that read past the keys a tier holds back for their extensions as they read past
    any other it refuses (LRU's order meets them last): told of them, they change nothing."""

    def extended(self, state: Any, key: int) -> Any:
        return state

    def leaf_again(self, state: Any, key: int) -> Any:
        return state


class OneAtATime:
    """For policies that take a run of keys as they take each one: ``inserted_all`` and
    ``accessed_all`` are the single calls in order."""

    def inserted_all(self, state: Any, items: list[tuple[int, int, float, int]]) -> Any:
        for key, size, cost, tag in items:
            state = self.inserted(state, key, size, cost, tag)  # type: ignore[attr-defined]
        return state

    def accessed_all(self, state: Any, keys: list[int]) -> Any:
        for key in keys:
            state = self.accessed(state, key)  # type: ignore[attr-defined]
        return state


class UnknownPolicy(UsageError, KeyError):
    """A policy name that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0])


EMPTY_MAP: immutables.Map = immutables.Map()


#: The clock of a policy state that has stamped nothing yet.
NO_STAMP = 0


def next_stamp(clock: int) -> int:
    """The stamp after ``clock``. Stamps order slots and tell a live slot from a stale one, so they
    only have to grow."""
    return clock + 1


def worth_compacting(slots: int, live: int) -> bool:
    """Whether a lazy queue or heap of ``slots`` slots, ``live`` of them live, is rebuilt from its live
    slots: once the stale ones outnumber the live ones (with some slack), so it holds memory in
    proportion to what is kept, however long it runs."""
    return slots > 2 * live + 64


@attrs.frozen
class StampQueue:
    """An append-only persistent queue of ``(key, stamp)`` with lazy deletion.

    A slot is live while ``stamps[key] == stamp``; re-queueing a key gives it a
    new stamp, so its old slot goes stale without being found and removed. The
    queue is rebuilt from its live slots when its slots, behind the head or not, outnumber
    twice the live ones.
    (pyrsistent's pvector is C and appends in ~0.1 µs; slicing it would copy,
    so the front is an index, not a slice.)
    """

    slots: PVector = pvector()
    head: int = 0

    def push(self, key: int, stamp: int) -> "StampQueue":
        return StampQueue(self.slots.append((key, stamp)), self.head)

    def pushed_all(self, slots: list[tuple[int, int]]) -> "StampQueue":
        """The queue with ``(key, stamp)`` ``slots`` appended in order."""
        return StampQueue(self.slots.extend(slots), self.head)

    def live(self, stamps: immutables.Map, start: int | None = None) -> Iterator[tuple[int, int, int]]:
        """``(index, key, stamp)`` of live slots from ``start`` (default the front), oldest first."""
        slots = self.slots
        for i in range(self.head if start is None else start, len(slots)):
            key, stamp = slots[i]
            if stamps.get(key) == stamp:
                yield i, key, stamp

    def compacted(self, stamps: immutables.Map) -> "StampQueue":
        """The same live slots, stale ones dropped, when they have piled up (those behind the head
        too: the vector keeps them until it is rebuilt)."""
        if not worth_compacting(len(self.slots), len(stamps)):
            return self
        return StampQueue(pvector((key, stamp) for _, key, stamp in self.live(stamps)), 0)

    def advanced(self, stamps: immutables.Map) -> "StampQueue":
        """The front moved past stale slots."""
        head, slots = self.head, self.slots
        while head < len(slots) and stamps.get(slots[head][0]) != slots[head][1]:
            head += 1
        return self if head == self.head else StampQueue(slots, head)


def first_evictable(queue: StampQueue, stamps: immutables.Map, evictable: Evictable) -> int | None:
    """The oldest live key of ``queue`` that ``evictable`` allows, or None."""
    for _, key, _ in queue.live(stamps):
        if evictable(key):
            return key
    return None
