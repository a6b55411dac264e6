"""Token ids as the core compares them: a tuple that also carries its ids packed, 8 bytes each.

Comparing a prompt with kept prefixes is the core's commonest work. Python ints
compare one object at a time (about 7 µs per 1,000 tokens), packed bytes in one
``memcmp`` (about 0.1 µs). A prompt is packed once, where it is checked
(:func:`kvstate.core.request.as_tokens` builds the packed form anyway to check
every id in C), and every later comparison reads the bytes.

:class:`Tokens` is a ``tuple``: it equals, hashes and slices as the plain tuple
of its ids (a slice is a plain tuple), so nothing that reads token ids needs to
know. Functions here accept either, or the packed bytes themselves; a plain tuple is packed when it
is compared.

What the state keeps for long (an entry's ids, a session's key) is the packed bytes alone
(:class:`PackedIds` reads ``tokens`` back off them), never a :class:`Tokens` nor a plain tuple of
ids. CPython's collector scans every new tuple of ints id by id before it stops tracking it, and
never stops tracking a tuple subclass: a full collection over 100,000 kept entries of 2,000 ids
each took 1.7 s while they were ``Tokens``, and young collections stalled a publish for 12 ms while
they were plain tuples. Bytes hold no objects, so the collector never looks inside them.
:attr:`Tokens.ids` is the caller's plain tuple, for effects that name a file by its ids.
"""

from __future__ import annotations

import array
from typing import Iterable

#: Bytes per packed token id (``array('Q')``: unsigned, native byte order).
WIDTH = 8


class Tokens(tuple):
    """A tuple of token ids with the same ids packed in :attr:`packed` (``array('Q')`` bytes), and as
    the plain tuple :attr:`ids` (the caller's own, where it passed a tuple)."""

    packed: bytes
    ids: tuple[int, ...]

    def __new__(cls, ids: Iterable[int], packed: bytes | None = None) -> "Tokens":
        self = super().__new__(cls, ids)
        self.ids = ids if type(ids) is tuple else tuple(self)
        self.packed = array.array("Q", self).tobytes() if packed is None else packed
        return self

    def __getnewargs__(self) -> tuple:
        return self.ids, self.packed

    def __eq__(self, other: object) -> bool:
        if type(other) is Tokens:
            return self.packed == other.packed
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        if type(other) is Tokens:
            return self.packed != other.packed
        return tuple.__ne__(self, other)

    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return f"Tokens({tuple.__repr__(self)})"


def packed(tokens: tuple[int, ...] | bytes) -> bytes:
    """The ids of ``tokens`` packed 8 bytes each (kept by a :class:`Tokens`, built for a plain tuple;
    packed bytes are returned as they are)."""
    kind = type(tokens)
    if kind is Tokens:
        return tokens.packed
    if kind is bytes:
        return tokens
    return array.array("Q", tokens).tobytes()


def plain(tokens: tuple[int, ...]) -> tuple[int, ...]:
    """``tokens`` as a plain tuple, to keep (:attr:`Tokens.ids`, or the tuple itself)."""
    return tokens.ids if type(tokens) is Tokens else tokens


def ids_of(data: bytes) -> tuple[int, ...]:
    """The plain tuple of ids whose packed form is ``data``."""
    ids = array.array("Q")
    ids.frombytes(data)
    return tuple(ids)


class PackedIds:
    """A record that keeps token ids packed in its ``packed`` field: ``tokens`` and ``length`` read
    them (the ids are unpacked on each call)."""

    __slots__ = ()
    packed: bytes

    @property
    def tokens(self) -> tuple[int, ...]:
        return ids_of(self.packed)

    @property
    def length(self) -> int:
        """How many tokens it covers."""
        return len(self.packed) // WIDTH


def matched_bytes(label: bytes, data: bytes, start: int) -> int:
    """How many leading bytes of ``label`` match ``data[start:]``, in whole tokens (a multiple of 8)."""
    n = len(label)
    if data.startswith(label, start):
        return n
    lo, hi = 0, n // WIDTH  # in tokens: the first lo agree, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(label[lo * WIDTH:mid * WIDTH], start + lo * WIDTH):
            lo = mid
        else:
            hi = mid
    return lo * WIDTH


def common_prefix(a: tuple[int, ...] | bytes, b: tuple[int, ...] | bytes) -> int:
    """The number of leading token ids ``a`` and ``b`` share."""
    first, second = packed(a), packed(b)
    if len(first) > len(second):
        first, second = second, first
    return matched_bytes(first, second, 0) // WIDTH


def starts_with(tokens: tuple[int, ...] | bytes, prefix: tuple[int, ...] | bytes) -> bool:
    """Whether ``tokens`` begins with every id of ``prefix``."""
    return packed(tokens).startswith(packed(prefix))
