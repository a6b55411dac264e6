"""Block-granularity caches, as paged engines keep KV: fixed-size blocks, one policy each.

These are the offline simulator's own small mutable caches, written for
speed (millions of block accesses a second): the service's pure policies in
``core/policies`` decide whole prefixes and pay for immutability on every
call, which a block-level sweep over a trace cannot afford. Each class has
``lookup(block) -> bool`` (a hit also counts as a use) and ``insert(block)
-> evicted block or None``. ``Belady`` also needs ``at(position)``: the index
of the access being served, to look up each block's next use.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict


class LRUBlocks:
    """Least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()

    def lookup(self, block: int) -> bool:
        d = self._d
        if block in d:
            d.move_to_end(block)
            return True
        return False

    def insert(self, block: int):
        d = self._d
        d[block] = None
        if len(d) > self.capacity:
            return d.popitem(last=False)[0]
        return None


class FIFOBlocks(LRUBlocks):
    """First in, first out."""

    def lookup(self, block: int) -> bool:
        return block in self._d


class LFUBlocks:
    """Least frequently used first; among equals the least recently used (O(1) buckets)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._uses: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict] = {}
        self._least = 0

    def _move(self, block: int, uses: int) -> None:
        self._uses[block] = uses
        self._buckets.setdefault(uses, OrderedDict())[block] = None

    def lookup(self, block: int) -> bool:
        uses = self._uses.get(block)
        if uses is None:
            return False
        bucket = self._buckets[uses]
        del bucket[block]
        if not bucket:
            del self._buckets[uses]
            if self._least == uses:
                self._least = uses + 1
        self._move(block, uses + 1)
        return True

    def insert(self, block: int):
        victim = None
        if len(self._uses) >= self.capacity:
            bucket = self._buckets[self._least]
            victim, _ = bucket.popitem(last=False)
            if not bucket:
                del self._buckets[self._least]
            del self._uses[victim]
        self._move(block, 1)
        self._least = 1
        return victim


class SIEVEBlocks:
    """A FIFO queue with visited bits and a hand sweeping from the oldest (NSDI'24)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._visited: dict[int, bool] = {}
        self._newer: dict = {}   # block -> the next newer block (None at the newest)
        self._older: dict = {}
        self._oldest = self._newest = self._hand = None

    def lookup(self, block: int) -> bool:
        if block in self._visited:
            self._visited[block] = True
            return True
        return False

    def _unlink(self, block: int) -> None:
        older, newer = self._older.pop(block), self._newer.pop(block)
        if older is None:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer is None:
            self._newest = older
        else:
            self._older[newer] = older

    def insert(self, block: int):
        victim = None
        if len(self._visited) >= self.capacity:
            hand = self._hand if self._hand is not None else self._oldest
            while self._visited[hand]:
                self._visited[hand] = False
                hand = self._newer[hand] if self._newer[hand] is not None else self._oldest
            victim = hand
            self._hand = self._newer[hand]
            self._unlink(hand)
            del self._visited[hand]
        self._visited[block] = False
        self._older[block], self._newer[block] = self._newest, None
        if self._newest is None:
            self._oldest = block
        else:
            self._newer[self._newest] = block
        self._newest = block
        return victim


class S3FIFOBlocks:
    """S3-FIFO (SOSP'23) as libCacheSim's ``S3FIFO.c`` defines it: a small FIFO of a tenth of the
    capacity, a main FIFO run as a 2-bit clock, and a ghost FIFO of 0.9 x capacity ids.

    A miss enters the small queue, or the main queue when its id is in the ghost (or while the small
    queue is full and nothing was evicted yet). Evicting from the small queue moves a block used at
    least twice to the main queue and otherwise evicts it into the ghost; evicting from the main
    queue gives a used block another pass with one use less (at most 2 kept). The main queue is
    evicted from when it is over its share or the small queue is empty.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._small_size = int(capacity * 0.1)
        self._main_size = capacity - self._small_size
        self._ghost_size = int(capacity * 0.9)
        self._small: OrderedDict = OrderedDict()   # block -> uses since it entered
        self._main: OrderedDict = OrderedDict()
        self._ghost: OrderedDict = OrderedDict()
        self._evicted = False

    def lookup(self, block: int) -> bool:
        for queue in (self._small, self._main):
            if block in queue:
                queue[block] += 1
                return True
        return False

    def _evict(self) -> int | None:
        self._evicted = True
        if len(self._main) > self._main_size or not self._small:
            while self._main:
                block, uses = self._main.popitem(last=False)
                if uses < 1:
                    return block
                self._main[block] = min(uses, 3) - 1
            return None
        while self._small:
            block, uses = self._small.popitem(last=False)
            if uses >= 2:
                self._main[block] = 0
                continue
            if self._ghost_size > 0:
                while len(self._ghost) >= self._ghost_size:
                    self._ghost.popitem(last=False)
                self._ghost[block] = None
            return block
        return None

    def insert(self, block: int):
        if self._small_size < 1:
            return None  # a block larger than the small queue is not taken (libCacheSim's can_insert)
        ghost_hit = block in self._ghost
        if ghost_hit:
            del self._ghost[block]
        victim = None
        while len(self._small) + len(self._main) >= self.capacity:
            victim = self._evict()
        if ghost_hit or (not self._evicted and len(self._small) >= self._small_size):
            self._main[block] = 0
        elif self._small_size > 1:
            self._small[block] = 0
        # else: libCacheSim never lets one block fill the whole small queue; it is not kept (room was made)
        return victim


class GDSFBlocks:
    """Greedy-Dual-Size-Frequency; with equal sizes and costs: ``L + uses``, ties by age."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._priority: dict[int, tuple[float, int]] = {}
        self._uses: dict[int, int] = {}
        self._heap: list = []
        self._inflation = 0.0
        self._clock = 0

    def _set(self, block: int, uses: int) -> None:
        self._clock += 1
        key = (self._inflation + uses, self._clock)
        self._uses[block], self._priority[block] = uses, key
        heapq.heappush(self._heap, (key, block))

    def lookup(self, block: int) -> bool:
        uses = self._uses.get(block)
        if uses is None:
            return False
        self._set(block, uses + 1)
        return True

    def insert(self, block: int):
        victim = None
        if len(self._uses) >= self.capacity:
            while True:
                key, candidate = heapq.heappop(self._heap)
                if self._priority.get(candidate) == key:
                    break
            victim = candidate
            self._inflation = key[0]
            del self._uses[victim], self._priority[victim]
        self._set(block, 1)
        if len(self._heap) > 4 * len(self._uses) + 64:
            self._heap = [(k, b) for b, k in self._priority.items()]
            heapq.heapify(self._heap)
        return victim


class ARCBlocks:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03): recency and frequency lists with ghosts.

    The target size ``p`` of the recency list is a real number moved by the plain ratio of the ghost
    lists (at least 1), as the paper's Figure 4 and libCacheSim's wheel have it; an integer ``p``
    moved by the floored ratio decides differently once the ratio is not whole."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._t1: OrderedDict = OrderedDict()
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()
        self._p = 0.0

    def lookup(self, block: int) -> bool:
        if block in self._t1:
            del self._t1[block]
            self._t2[block] = None
            return True
        if block in self._t2:
            self._t2.move_to_end(block)
            return True
        return False

    def _replace(self, in_b2: bool):
        if self._t1 and (len(self._t1) > self._p or (in_b2 and len(self._t1) == self._p)):
            block, _ = self._t1.popitem(last=False)
            self._b1[block] = None
        else:
            block, _ = self._t2.popitem(last=False)
            self._b2[block] = None
        return block

    def insert(self, block: int):
        c, victim = self.capacity, None
        if block in self._b1:
            self._p = min(float(c), self._p + max(1.0, len(self._b2) / len(self._b1)))
            victim = self._replace(False)
            del self._b1[block]
            self._t2[block] = None
            return victim
        if block in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            victim = self._replace(True)
            del self._b2[block]
            self._t2[block] = None
            return victim
        if len(self._t1) + len(self._b1) == c:
            if len(self._t1) < c:
                self._b1.popitem(last=False)
                victim = self._replace(False)
            else:
                victim, _ = self._t1.popitem(last=False)
        elif len(self._t1) + len(self._b1) < c:
            total = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
            if total >= c:
                if total == 2 * c:
                    self._b2.popitem(last=False)
                victim = self._replace(False)
        self._t1[block] = None
        return victim


NEVER = float("inf")


class BeladyBlocks:
    """Belady's MIN, the offline optimum of the block hit ratio: evict (or never keep) the block
    whose next use is farthest. Needs the trace's next-use index (:func:`next_uses`)."""

    def __init__(self, capacity: int, next_use: list):
        self.capacity = capacity
        self._next_use = next_use
        self._cached: dict[int, float] = {}
        self._heap: list = []  # (-next use, block), lazy
        self._position = 0

    def at(self, position: int) -> None:
        self._position = position

    def lookup(self, block: int) -> bool:
        if block not in self._cached:
            return False
        upcoming = self._next_use[self._position]
        self._cached[block] = upcoming
        heapq.heappush(self._heap, (-upcoming, block))
        return True

    def insert(self, block: int):
        upcoming = self._next_use[self._position]
        if len(self._cached) < self.capacity:
            self._cached[block] = upcoming
            heapq.heappush(self._heap, (-upcoming, block))
            return None
        while True:
            negative, farthest = self._heap[0]
            if self._cached.get(farthest) == -negative:
                break
            heapq.heappop(self._heap)
        if upcoming >= -negative:
            return block  # the newcomer is needed last: it is the one not kept
        heapq.heappop(self._heap)
        del self._cached[farthest]
        self._cached[block] = upcoming
        heapq.heappush(self._heap, (-upcoming, block))
        return farthest


class LeafLRUBlocks:
    """Prefix-aware LRU: only a leaf goes, the least recently used block no cached block extends.

    A prompt's blocks are a chain, and a block serves a request only if every block before it is
    held too (a reuse is a leading run). Plain LRU evicts a chain from its head, since a request
    touches its first block first, and the tail it keeps serves nothing. Here a block is evictable
    only while no cached block has it as its parent (the block before it in a request, which
    :meth:`begin` and the access order give), so chains are cut from the tail, as SGLang's radix
    cache evicts leaves. A parent left childless becomes the next leaf to go.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._leaves: OrderedDict = OrderedDict()  # evictable blocks, least recently used first
        self._parent: dict[int, int | None] = {}   # cached block -> the block before it
        self._children: dict[int, int] = {}        # block -> cached blocks that extend it
        self._previous: int | None = None  # the block this request looked up last
        self._before: int | None = None    # and the one before it: the parent of a block inserted now

    def begin(self) -> None:
        """A new request: its first block extends nothing."""
        self._previous = None

    def lookup(self, block: int) -> bool:
        self._before, self._previous = self._previous, block
        hit = block in self._parent
        if hit and block in self._leaves:
            self._leaves.move_to_end(block)
        return hit

    def insert(self, block: int):
        parent = self._before
        self._parent[block] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._leaves.pop(parent, None)
        if not self._children.get(block):
            self._leaves[block] = None
            if parent is not None and parent not in self._parent:
                self._leaves.move_to_end(block, last=False)  # its prefix is gone: it serves nothing, it goes first
        if len(self._parent) <= self.capacity:
            return None
        victim = next(iter(self._leaves)) if self._leaves else block
        self._leaves.pop(victim, None)
        above = self._parent.pop(victim)
        if above is not None:
            left = self._children[above] - 1
            if left:
                self._children[above] = left
            else:
                del self._children[above]
                if above in self._parent:
                    self._leaves[above] = None
                    self._leaves.move_to_end(above, last=False)  # older than the child that just went
        return victim


def next_uses(accesses: list[int]) -> list:
    """For each access position, the position of the same block's next access (inf if none)."""
    upcoming: dict[int, int] = {}
    out = [NEVER] * len(accesses)
    for position in range(len(accesses) - 1, -1, -1):
        block = accesses[position]
        out[position] = upcoming.get(block, NEVER)
        upcoming[block] = position
    return out


BLOCK_POLICIES = {"lru": LRUBlocks, "fifo": FIFOBlocks, "lfu": LFUBlocks, "s3fifo": S3FIFOBlocks,
                  "sieve": SIEVEBlocks, "gdsf": GDSFBlocks, "arc": ARCBlocks, "leaf-lru": LeafLRUBlocks,
                  "belady": BeladyBlocks}
