"""A persistent radix tree over token sequences: longest usable prefix per namespace.

Every kept prefix is one entry at the node where its tokens end (at most one
entry per exact token sequence and namespace). Each node counts the trimmable
entries below it, so a lookup walks the prompt once and knows, at every depth,
whether some trimmable entry extends that far: a trimmable entry serves any
shorter prefix of its tokens, a non-trimmable one only its exact length. The
usable length always leaves one prompt token to compute.

Updates copy the path from the root (persistence); children live in an
``immutables.Map`` (a C HAMT) because the root of a busy namespace has
thousands of children and pyrsistent's pure-Python pmap costs 5-20x more per
update there, measured on this project's machines.
"""

from __future__ import annotations

from typing import Iterator

import attrs
import immutables

_NO_CHILDREN: immutables.Map = immutables.Map()


@attrs.frozen
class Node:
    """A run of tokens shared by everything below it."""

    label: tuple[int, ...]
    children: immutables.Map
    entry: int | None
    trimmable: bool
    trim_below: int
    count: int


_EMPTY_ROOT = Node((), _NO_CHILDREN, None, False, 0, 0)


def common_prefix(label: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``label`` and ``tokens[start:]`` (a slice compare, then bisection)."""
    n = len(label)
    if tokens[start:start + n] == label:
        return n
    lo, hi = 0, n  # the first lo tokens agree; the first hi do not (a slice past the end is shorter)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens[start + lo:start + mid] == label[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _with_child(node: Node, old: Node | None, new: Node | None, first: int) -> Node | None:
    """``node`` with child ``old`` (under token ``first``) replaced by ``new``; merged or dropped when bare."""
    children = node.children.delete(first) if new is None else node.children.set(first, new)
    trim = node.trim_below - (old.trim_below if old else 0) + (new.trim_below if new else 0)
    count = node.count - (old.count if old else 0) + (new.count if new else 0)
    result = Node(node.label, children, node.entry, node.trimmable, trim, count)
    return _compact(result) if new is None else result


def _compact(node: Node) -> Node | None:
    """Drop an empty node; merge an entry-less node into its only child (roots keep their empty label)."""
    if node.entry is not None:
        return node
    if not node.children:
        return None
    if len(node.children) == 1 and node.label:
        (child,) = node.children.values()
        return Node(node.label + child.label, child.children, child.entry, child.trimmable,
                    child.trim_below, child.count)
    return node


def _insert(node: Node, tokens: tuple[int, ...], depth: int, entry: int, trimmable: bool) -> Node:
    if depth == len(tokens):
        old_trim = int(node.entry is not None and node.trimmable)
        old_count = int(node.entry is not None)
        return Node(node.label, node.children, entry, trimmable,
                    node.trim_below - old_trim + trimmable, node.count - old_count + 1)
    first = tokens[depth]
    child = node.children.get(first)
    if child is None:
        leaf = Node(tokens[depth:], _NO_CHILDREN, entry, trimmable, int(trimmable), 1)
        return _with_child(node, None, leaf, first)
    m = common_prefix(child.label, tokens, depth)
    if m < len(child.label):
        tail = Node(child.label[m:], child.children, child.entry, child.trimmable, child.trim_below, child.count)
        mid = Node(child.label[:m], immutables.Map({tail.label[0]: tail}), None, False,
                   child.trim_below, child.count)
        return _with_child(node, child, _insert(mid, tokens, depth + m, entry, trimmable), first)
    return _with_child(node, child, _insert(child, tokens, depth + m, entry, trimmable), first)


def _remove(node: Node, tokens: tuple[int, ...], depth: int) -> Node | None:
    if depth == len(tokens):
        if node.entry is None:
            raise KeyError(tokens)
        bare = Node(node.label, node.children, None, False, node.trim_below - node.trimmable, node.count - 1)
        return _compact(bare) if node.label else bare
    first = tokens[depth]
    child = node.children.get(first)
    if child is None or common_prefix(child.label, tokens, depth) < len(child.label):
        raise KeyError(tokens)
    return _with_child(node, child, _remove(child, tokens, depth + len(child.label)), first)


def _first_trimmable(node: Node) -> int:
    """Some trimmable entry at or below ``node`` (which has one)."""
    while not (node.entry is not None and node.trimmable):
        node = next(c for c in node.children.values() if c.trim_below)
    return node.entry


def _longest(root: Node, prompt: tuple[int, ...]) -> tuple[int, int | None]:
    limit = len(prompt) - 1
    best, best_entry, trim_node, trim_len = 0, None, None, 0
    node, depth = root, 0
    while True:
        if node.entry is not None and not node.trimmable and best < depth <= limit:
            best, best_entry, trim_node = depth, node.entry, None
        if node.trim_below and min(depth, limit) > best:
            trim_node, trim_len = node, min(depth, limit)
            best = trim_len
        if depth >= len(prompt):
            break
        child = node.children.get(prompt[depth])
        if child is None:
            break
        m = common_prefix(child.label, prompt, depth)
        if m < len(child.label):
            if child.trim_below and min(depth + m, limit) > best:
                trim_node, trim_len = child, min(depth + m, limit)
                best = trim_len
            break
        node, depth = child, depth + m
    if trim_node is not None and trim_len == best:
        return best, _first_trimmable(trim_node)
    return best, best_entry


def _walk(node: Node, prefix: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int, bool]]:
    tokens = prefix + node.label
    if node.entry is not None:
        yield tokens, node.entry, node.trimmable
    for child in node.children.values():
        yield from _walk(child, tokens)


@attrs.frozen
class PrefixIndex:
    """Kept prefixes by namespace: insert, remove, exact and longest-usable lookup, all persistent."""

    roots: immutables.Map = _NO_CHILDREN

    def insert(self, namespace: str, tokens: tuple[int, ...], entry: int, trimmable: bool) -> "PrefixIndex":
        """The index with ``entry`` at ``tokens`` (replacing any entry there)."""
        root = self.roots.get(namespace, _EMPTY_ROOT)
        return PrefixIndex(self.roots.set(namespace, _insert(root, tokens, 0, entry, trimmable)))

    def remove(self, namespace: str, tokens: tuple[int, ...]) -> "PrefixIndex":
        """The index without the entry at ``tokens``; ``KeyError`` if there is none."""
        root = self.roots.get(namespace)
        if root is None:
            raise KeyError(tokens)
        new = _remove(root, tokens, 0)
        return PrefixIndex(self.roots.delete(namespace) if new is None or not new.count
                           else self.roots.set(namespace, new))

    def exact(self, namespace: str, tokens: tuple[int, ...]) -> int | None:
        """The entry covering exactly ``tokens``, or None."""
        node, depth = self.roots.get(namespace), 0
        while node is not None:
            if depth == len(tokens):
                return node.entry
            child = node.children.get(tokens[depth])
            if child is None or tokens[depth:depth + len(child.label)] != child.label:
                return None
            node, depth = child, depth + len(child.label)
        return None

    def prefixes_of(self, namespace: str, tokens: tuple[int, ...]) -> list[tuple[int, int, bool]]:
        """``(length, entry, trimmable)`` of every entry whose tokens are a strict prefix of ``tokens``."""
        found = []
        node, depth = self.roots.get(namespace), 0
        while node is not None and depth < len(tokens):
            if node.entry is not None:
                found.append((depth, node.entry, node.trimmable))
            child = node.children.get(tokens[depth])
            if child is None or tokens[depth:depth + len(child.label)] != child.label:
                break
            node, depth = child, depth + len(child.label)
        return found

    def longest(self, namespace: str, prompt: tuple[int, ...]) -> tuple[int, int | None]:
        """``(tokens, entry)``: the longest prefix of ``prompt`` some entry can serve, at most ``len-1``."""
        root = self.roots.get(namespace)
        if root is None:
            return 0, None
        return _longest(root, prompt)

    def __len__(self) -> int:
        return sum(root.count for root in self.roots.values())

    def items(self) -> Iterator[tuple[str, tuple[int, ...], int, bool]]:
        """Every ``(namespace, tokens, entry, trimmable)`` (tree order; for checks and listings)."""
        for namespace, root in self.roots.items():
            for tokens, entry, trimmable in _walk(root, ()):
                yield namespace, tokens, entry, trimmable
