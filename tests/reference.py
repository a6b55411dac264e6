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
    """Kept prefixes under a byte capacity, evicted oldest-kept first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[tuple, tuple[int, bool]] = OrderedDict()

    @property
    def held_bytes(self) -> int:
        return sum(size for size, _ in self.items.values())

    def put(self, key: tuple, size: int, trimmable: bool) -> bool:
        if key in self.items:
            return True
        if size > self.capacity:
            return False
        while self.held_bytes + size > self.capacity:
            self.items.popitem(last=False)
        self.items[key] = (size, trimmable)
        return True

    def drop_oldest(self) -> None:
        self.items.popitem(last=False)

    def held(self):
        return [(ns, tokens, trim) for (ns, tokens), (_, trim) in self.items.items()]


class NaiveLRU:
    """Keys with sizes; evict least recently used among the evictable."""

    def __init__(self):
        self.order: list = []

    def insert(self, key):
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

    def insert(self, key):
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

    def insert(self, key):
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
