"""Naive reference models, written apart from the code under test: plain dicts, lists and loops."""

from __future__ import annotations

from collections import OrderedDict


def attention_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """Keys and values, 2 bytes an element, for every token of every layer."""
    total = 0
    for _ in range(layers):
        total += tokens * kv_heads * head_dim * 2  # keys
        total += tokens * kv_heads * head_dim * 2  # values
    return total


def lcp(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def usable(tokens: tuple, trimmable: bool, prompt: tuple) -> int:
    """What one held state can serve of ``prompt`` (DESIGN.md's reuse rules, literally)."""
    limit = len(prompt) - 1
    if trimmable:
        return min(lcp(tokens, prompt), limit)
    if len(tokens) <= limit and tuple(prompt[:len(tokens)]) == tuple(tokens):
        return len(tokens)
    return 0


def longest_usable(held, namespace: str, prompt: tuple) -> int:
    """``held``: iterable of (namespace, tokens, trimmable)."""
    best = 0
    for ns, tokens, trimmable in held:
        if ns == namespace:
            best = max(best, usable(tokens, trimmable, prompt))
    return best


class NaiveFifoPrefixCache:
    """Kept prefixes under a byte capacity, evicted oldest-kept first, with the counts a report shows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[tuple, tuple[int, bool]] = OrderedDict()
        self.counts = {"kept": 0, "duplicates": 0, "not_kept": 0, "evictions": 0, "superseded": 0, "demotions": 0}

    @property
    def held_bytes(self) -> int:
        return sum(size for size, _ in self.items.values())

    def put(self, key: tuple, size: int, trimmable: bool) -> bool:
        if key in self.items:
            self.counts["duplicates"] += 1
            return True
        if size > self.capacity:
            self.counts["not_kept"] += 1
            return False
        while self.held_bytes + size > self.capacity:
            self.items.popitem(last=False)
            self.counts["evictions"] += 1
        self.items[key] = (size, trimmable)
        self.counts["kept"] += 1
        if trimmable:  # a trimmable entry serves every shorter trimmable prefix of it: those go
            namespace, tokens = key
            for (ns, held), (_, held_trimmable) in list(self.items.items()):
                if ns == namespace and held_trimmable and len(held) < len(tokens) and tokens[:len(held)] == held:
                    del self.items[(ns, held)]
                    self.counts["superseded"] += 1
        return True

    def drop_oldest(self) -> None:
        """Given back under memory pressure (a demotion: with no disk tier it is gone)."""
        self.items.popitem(last=False)
        self.counts["demotions"] += 1

    def held(self):
        return [(ns, tokens, trim) for (ns, tokens), (_, trim) in self.items.items()]


class NaiveLRU:
    """Keys with sizes; evict least recently used among the evictable."""

    def __init__(self):
        self.order: list = []

    def insert(self, key, size=0, cost=0.0, tag=0):
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    def access(self, key):
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    def remove(self, key):
        if key in self.order:
            self.order.remove(key)

    def evict(self, evictable):
        for key in self.order:
            if evictable(key):
                self.order.remove(key)
                return key
        return None


class NaiveFIFO(NaiveLRU):
    def access(self, key):
        pass


class NaiveLFU:
    """Least uses first; among equals, least recently used."""

    def __init__(self):
        self.uses: dict = {}
        self.last: dict = {}
        self.clock = 0

    def insert(self, key, size=0, cost=0.0, tag=0):
        self.clock += 1
        self.uses[key] = 1
        self.last[key] = self.clock

    def access(self, key):
        if key in self.uses:
            self.clock += 1
            self.uses[key] += 1
            self.last[key] = self.clock

    def remove(self, key):
        self.uses.pop(key, None)
        self.last.pop(key, None)

    def evict(self, evictable):
        candidates = [k for k in self.uses if evictable(k)]
        if not candidates:
            return None
        victim = min(candidates, key=lambda k: (self.uses[k], self.last[k]))
        self.remove(victim)
        return victim


class NaiveSIEVE:
    """SIEVE over a plain list (oldest first), a visited map and the key the hand rests on."""

    def __init__(self):
        self.order: list = []
        self.visited: dict = {}
        self.hand = None

    def remove(self, key):
        if key not in self.visited:
            return
        i = self.order.index(key)
        if self.hand == key:
            self.hand = self.order[i + 1] if i + 1 < len(self.order) else None
        self.order.pop(i)
        del self.visited[key]

    def insert(self, key, size=0, cost=0.0, tag=0):
        self.remove(key)
        self.order.append(key)
        self.visited[key] = False

    def access(self, key):
        if key in self.visited:
            self.visited[key] = True

    def evict(self, evictable):
        if not self.order:
            return None
        i = self.order.index(self.hand) if self.hand in self.visited else 0
        for _ in range(2 * len(self.order) + 1):
            key = self.order[i]
            if evictable(key):
                if self.visited[key]:
                    self.visited[key] = False
                else:
                    self.remove(key)
                    self.hand = self.order[i] if i < len(self.order) else None
                    return key
            i = (i + 1) % len(self.order)
        return None


class NaiveGDSF:
    """Greedy-Dual-Size-Frequency over a plain dict: the lowest ``L + uses * cost / size`` goes first,
    ties to the one set longest ago, and ``L`` rises to each victim's priority."""

    def __init__(self):
        self.keys: dict = {}  # key -> [uses, size, cost, priority, stamp]
        self.inflation = 0.0
        self.clock = 0

    def _set(self, key, uses, size, cost):
        self.clock += 1
        self.keys[key] = [uses, size, cost, self.inflation + uses * cost / max(size, 1), self.clock]

    def insert(self, key, size=0, cost=0.0, tag=0):
        self._set(key, 1, size, cost)

    def access(self, key):
        if key in self.keys:
            uses, size, cost, _, _ = self.keys[key]
            self._set(key, uses + 1, size, cost)

    def remove(self, key):
        self.keys.pop(key, None)

    def evict(self, evictable):
        candidates = [k for k in self.keys if evictable(k)]
        if not candidates:
            return None
        victim = min(candidates, key=lambda k: (self.keys[k][3], self.keys[k][4]))
        self.inflation = max(self.inflation, self.keys.pop(victim)[3])
        return victim


class NaiveS3FIFO:
    """S3-FIFO as libCacheSim's ``S3FIFO.c`` defines it, over plain lists, in bytes: a small FIFO of a
    tenth of the capacity, a main FIFO run as a 2-bit clock, and a ghost FIFO of content tags holding
    0.9 x capacity bytes; keys that may not be evicted are passed over."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.small_cap = int(0.1 * capacity)
        self.ghost_cap = int(0.9 * capacity)
        self.small: list = []
        self.main: list = []
        self.freq: dict = {}
        self.size: dict = {}
        self.tag: dict = {}
        self.ghost: list = []  # (tag, bytes), oldest first
        self.evicted = False
        self.arrived = None

    def arriving(self, tag):
        """A miss on ``tag``: it leaves the ghost before room is made for it."""
        self.arrived = tag if any(t == tag for t, _ in self.ghost) else None
        self.ghost = [(t, s) for t, s in self.ghost if t != tag]

    def insert(self, key, size=0, cost=0.0, tag=0):
        self.remove(key)
        remembered = tag == self.arrived or any(t == tag for t, _ in self.ghost)
        self.arrived = None
        self.ghost = [(t, s) for t, s in self.ghost if t != tag]
        full = sum(self.size[k] for k in self.small) >= self.small_cap
        self.freq[key], self.size[key], self.tag[key] = 0, size, tag
        (self.main if remembered or (not self.evicted and full) else self.small).append(key)

    def access(self, key):
        if key in self.freq:
            self.freq[key] += 1

    def remove(self, key):
        for queue in (self.small, self.main):
            if key in queue:
                queue.remove(key)
        for table in (self.freq, self.size, self.tag):
            table.pop(key, None)

    def evict(self, evictable):
        self.evicted = True
        small = next((k for k in self.small if evictable(k)), None)
        main = next((k for k in self.main if evictable(k)), None)
        if small is None and main is None:
            return None
        main_bytes = sum(self.size[k] for k in self.main)
        if main is not None and (main_bytes > self.capacity - self.small_cap or small is None):
            order = (self._evict_main, self._evict_small)
        else:
            order = (self._evict_small, self._evict_main)
        for evict_from in order:
            victim = evict_from(evictable)
            if victim is not None:
                return victim
        return None

    def _evict_small(self, evictable):
        while True:
            key = next((k for k in self.small if evictable(k)), None)
            if key is None:
                return None
            if self.freq[key] >= 2:  # used again while on probation: promoted, uses spent
                self.small.remove(key)
                self.main.append(key)
                self.freq[key] = 0
                continue
            tag, size = self.tag[key], self.size[key]
            self.remove(key)
            if size <= self.ghost_cap and all(t != tag for t, _ in self.ghost):
                while self.ghost and sum(s for _, s in self.ghost) + size > self.ghost_cap:
                    self.ghost.pop(0)
                self.ghost.append((tag, size))
            return key

    def _evict_main(self, evictable):
        while True:
            key = next((k for k in self.main if evictable(k)), None)
            if key is None:
                return None
            if self.freq[key] >= 1:  # used since it was queued: once more round, one use less
                self.main.remove(key)
                self.main.append(key)
                self.freq[key] = min(self.freq[key], 3) - 1
                continue
            self.remove(key)
            return key