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
update there, measured on this project's machines. Labels hold packed token
ids (:mod:`kvstate.core.tokens`), so following a prompt down the tree compares
bytes; every method takes token ids as a tuple, a ``Tokens`` or their packed
bytes.
"""

from __future__ import annotations

import sys
from typing import Iterator

import attrs
import immutables

from kvstate.core.tokens import WIDTH, ids_of, matched_bytes, packed

_NO_CHILDREN: immutables.Map = immutables.Map()


@attrs.frozen
class Node:
    """A run of tokens shared by everything below it (``label``: their packed ids)."""

    label: bytes
    children: immutables.Map
    entry: int | None
    trimmable: bool
    trim_below: int
    count: int


_EMPTY_ROOT = Node(b"", _NO_CHILDREN, None, False, 0, 0)


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


# Below, ``data`` is a token sequence's packed ids and ``depth`` an offset into it, in bytes.

def _first(data: bytes, depth: int) -> int:
    """The token id at byte offset ``depth``: children are keyed by it. (An int, not its bytes: an
    int's hash is the same in every process, so the children's order, and so which of several
    equal entries a lookup names, is too.)"""
    return int.from_bytes(data[depth:depth + WIDTH], sys.byteorder)


def _insert(node: Node, data: bytes, depth: int, entry: int, trimmable: bool) -> Node:
    if depth == len(data):
        old_trim = int(node.entry is not None and node.trimmable)
        old_count = int(node.entry is not None)
        return Node(node.label, node.children, entry, trimmable,
                    node.trim_below - old_trim + trimmable, node.count - old_count + 1)
    first = _first(data, depth)
    child = node.children.get(first)
    if child is None:
        leaf = Node(data[depth:], _NO_CHILDREN, entry, trimmable, int(trimmable), 1)
        return _with_child(node, None, leaf, first)
    m = matched_bytes(child.label, data, depth)
    if m < len(child.label):
        tail = Node(child.label[m:], child.children, child.entry, child.trimmable, child.trim_below, child.count)
        mid = Node(child.label[:m], immutables.Map({_first(tail.label, 0): tail}), None, False,
                   child.trim_below, child.count)
        return _with_child(node, child, _insert(mid, data, depth + m, entry, trimmable), first)
    return _with_child(node, child, _insert(child, data, depth + m, entry, trimmable), first)


def _remove(node: Node, data: bytes, depth: int) -> Node | None:
    if depth == len(data):
        if node.entry is None:
            raise KeyError(ids_of(data))
        bare = Node(node.label, node.children, None, False, node.trim_below - node.trimmable, node.count - 1)
        return _compact(bare) if node.label else bare
    first = _first(data, depth)
    child = node.children.get(first)
    if child is None or not data.startswith(child.label, depth):
        raise KeyError(ids_of(data))
    return _with_child(node, child, _remove(child, data, depth + len(child.label)), first)


def _first_trimmable(node: Node) -> int:
    """Some trimmable entry at or below ``node`` (which has one)."""
    while not (node.entry is not None and node.trimmable):
        node = next(c for c in node.children.values() if c.trim_below)
    return node.entry


def _longest(root: Node, prompt: bytes) -> tuple[int, int | None]:
    """``(bytes, entry)``: the longest usable prefix of the packed ``prompt``, in bytes."""
    limit = len(prompt) - WIDTH
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
        child = node.children.get(_first(prompt, depth))
        if child is None:
            break
        m = matched_bytes(child.label, prompt, depth)
        if m < len(child.label):
            if child.trim_below and min(depth + m, limit) > best:
                trim_node, trim_len = child, min(depth + m, limit)
                best = trim_len
            break
        node, depth = child, depth + m
    if trim_node is not None and trim_len == best:
        return best, _first_trimmable(trim_node)
    return best, best_entry


def _walk(node: Node, prefix: bytes) -> Iterator[tuple[bytes, int, bool]]:
    data = prefix + node.label
    if node.entry is not None:
        yield data, node.entry, node.trimmable
    for child in node.children.values():
        yield from _walk(child, data)


@attrs.frozen
class PrefixIndex:
    """Kept prefixes by namespace: insert, remove, exact and longest-usable lookup, all persistent."""

    roots: immutables.Map = _NO_CHILDREN

    def insert(self, namespace: str, tokens: tuple[int, ...] | bytes, entry: int, trimmable: bool) -> "PrefixIndex":
        """The index with ``entry`` at ``tokens`` (replacing any entry there)."""
        root = self.roots.get(namespace, _EMPTY_ROOT)
        return PrefixIndex(self.roots.set(namespace, _insert(root, packed(tokens), 0, entry, trimmable)))

    def remove(self, namespace: str, tokens: tuple[int, ...] | bytes) -> "PrefixIndex":
        """The index without the entry at ``tokens``; ``KeyError`` if there is none."""
        root = self.roots.get(namespace)
        if root is None:
            raise KeyError(tokens)
        new = _remove(root, packed(tokens), 0)
        return PrefixIndex(self.roots.delete(namespace) if new is None or not new.count
                           else self.roots.set(namespace, new))

    def exact(self, namespace: str, tokens: tuple[int, ...] | bytes) -> int | None:
        """The entry covering exactly ``tokens``, or None."""
        data = packed(tokens)
        node, depth = self.roots.get(namespace), 0
        while node is not None:
            if depth == len(data):
                return node.entry
            child = node.children.get(_first(data, depth))
            if child is None or not data.startswith(child.label, depth):
                return None
            node, depth = child, depth + len(child.label)
        return None

    def prefixes_of(self, namespace: str, tokens: tuple[int, ...] | bytes) -> list[tuple[int, int, bool]]:
        """``(length, entry, trimmable)`` of every entry whose tokens are a strict prefix of ``tokens``."""
        data = packed(tokens)
        found = []
        node, depth = self.roots.get(namespace), 0
        while node is not None and depth < len(data):
            if node.entry is not None:
                found.append((depth // WIDTH, node.entry, node.trimmable))
            child = node.children.get(_first(data, depth))
            if child is None or not data.startswith(child.label, depth):
                break
            node, depth = child, depth + len(child.label)
        return found

    def extends(self, namespace: str, tokens: tuple[int, ...] | bytes) -> bool:
        """Whether some entry's tokens start with ``tokens`` (``tokens`` included)."""
        data = packed(tokens)
        node, depth = self.roots.get(namespace), 0
        while node is not None and depth < len(data):
            child = node.children.get(_first(data, depth))
            if child is None:
                return False
            m = matched_bytes(child.label, data, depth)
            if depth + m == len(data):
                return True  # inside or at the end of the child's label: its entries extend ``tokens``
            if m < len(child.label):
                return False
            node, depth = child, depth + m
        return node is not None and node.count > 0

    def longest(self, namespace: str, prompt: tuple[int, ...] | bytes) -> tuple[int, int | None]:
        """``(tokens, entry)``: the longest prefix of ``prompt`` some entry can serve, at most ``len-1``."""
        root = self.roots.get(namespace)
        if root is None:
            return 0, None
        length, entry = _longest(root, packed(prompt))
        return length // WIDTH, entry

    def __len__(self) -> int:
        return sum(root.count for root in self.roots.values())

    def items(self) -> Iterator[tuple[str, tuple[int, ...], int, bool]]:
        """Every ``(namespace, tokens, entry, trimmable)`` (tree order; for checks and listings)."""
        for namespace, root in self.roots.items():
            for data, entry, trimmable in _walk(root, b""):
                yield namespace, ids_of(data), entry, trimmable
