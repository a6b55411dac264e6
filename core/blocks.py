"""Token blocks: a prompt cut into fixed-size runs, each named by a chain hash, held at most once.

A block is ``BLOCK_TOKENS`` consecutive prompt tokens at a block boundary. Its key is the hash of
its parent's key and its own tokens, and the first block's parent is its namespace: two prefixes
that agree on their first n full blocks, in one namespace, name the same n blocks, whatever follows.
So one block is one object, in RAM and on disk, shared by every prefix that contains it (a chat's
turns, a regenerate, two agents on one system prompt), and a publish, a spill or a restore deals
only in the blocks the other side lacks.

Why 256 tokens: mlx-lm's KV caches grow in steps of 256 positions (``KVCache.step``), so a block is
one step of every layer's arrays, and caches assembled from blocks grow as mlx-lm's own would; it is
also LMCache's chunk. Smaller blocks share more at a divergence (less than a block is recomputed)
but cost a key, an object and a file record each; at 256, an 8,000-token prompt is 31 blocks. The
tokens past the last full block are not a block: what holds them is the caller's to decide.

A :class:`BlockTable` is the set of held blocks as a persistent value: adding a chain keeps only the
blocks not already held, a block records how many held blocks extend it, and only a leaf (a block
nothing held extends) may be removed, so eviction goes leaf first and never strands a block whose
parent is gone. Keys are blake2b-128 digests (a collision is a 2^-64 event at 2^32 blocks).
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import attrs
import immutables

from kvstate.core.errors import UsageError
from kvstate.core.tokens import WIDTH, ids_of, packed
from kvstate.effects.effects import BlockName

#: Tokens per block (see the module's docstring for why 256).
BLOCK_TOKENS = 256

_EMPTY: immutables.Map = immutables.Map()


class NotALeaf(UsageError):
    """A block another held block extends was asked to go: blocks leave leaf first."""


class UnknownBlock(UsageError):
    """A key no held block has (or a chain whose parent is not held)."""


def namespace_key(namespace: str) -> bytes:
    """The key a namespace's first blocks take as their parent."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"kvstate-ns").digest()


#: blake2b-128 with the blocks' personalisation, set up once: each key copies it (cheaper than a new
#: hasher's parameter block) and feeds it the parent's key and the tokens, never joined into one copy.
_BLOCK_HASHER = hashlib.blake2b(digest_size=16, person=b"kvstate-block")


def block_key(parent: bytes, tokens: bytes | memoryview) -> bytes:
    """The key of the block of packed ``tokens`` after the block (or namespace) keyed ``parent``."""
    hasher = _BLOCK_HASHER.copy()
    hasher.update(parent)
    hasher.update(tokens)
    return hasher.digest()


def block_tag(key: bytes) -> int:
    """A block's content identity for ghost lists: its chain key already names every token from its
    namespace's start, so its first 8 bytes serve, where hashing the path again would cost a publish
    of n blocks the square of n."""
    return int.from_bytes(key[:8], "little")


def chain(namespace: str, prompt: tuple[int, ...] | bytes, block_tokens: int = BLOCK_TOKENS) -> tuple[bytes, ...]:
    """The keys of ``prompt``'s full blocks in ``namespace``, first to last."""
    if block_tokens < 1:
        raise ValueError(f"a block holds at least one token, got {block_tokens}")
    data = prompt if isinstance(prompt, bytes) else packed(prompt)
    step = block_tokens * WIDTH
    keys, parent = [], namespace_key(namespace)
    for start in range(0, len(data) // step * step, step):  # full blocks only
        parent = block_key(parent, data[start:start + step])
        keys.append(parent)
    return tuple(keys)


def spans(length: int, block_tokens: int = BLOCK_TOKENS) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` positions of the blocks a prefix of ``length`` tokens is kept in: its full
    blocks, then the tokens past the last one (a partial last block, kept so the prefix is served
    whole, not recomputed from the last boundary; a longer prefix's full block supersedes it)."""
    full = length // block_tokens * block_tokens
    out = [(start, start + block_tokens) for start in range(0, full, block_tokens)]
    if full < length:
        out.append((full, length))
    return tuple(out)


def path_key(namespace: str, prompt: tuple[int, ...] | bytes, block_tokens: int = BLOCK_TOKENS) -> bytes:
    """The chain key of the block that ends a prefix of ``prompt`` (its last span, full or partial)."""
    data = prompt if isinstance(prompt, bytes) else packed(prompt)
    key = namespace_key(namespace)
    for start, stop in spans(len(data) // WIDTH, block_tokens):
        key = block_key(key, data[start * WIDTH:stop * WIDTH])
    return key


def block_names(namespace: str, prompt: tuple[int, ...], block_tokens: int = BLOCK_TOKENS) -> tuple[BlockName, ...]:
    """The names of the blocks a prefix of ``prompt`` is kept in (:func:`spans`), first to last."""
    data = packed(prompt)
    names, parent = [], namespace_key(namespace)
    for start, stop in spans(len(prompt), block_tokens):
        key = block_key(parent, data[start * WIDTH:stop * WIDTH])
        names.append(BlockName(namespace, key, parent, start, tuple(prompt[start:stop])))
        parent = key
    return tuple(names)


def saved_chains(names) -> list[tuple[str, tuple[int, ...]]]:
    """``(namespace, tokens)`` of the prefix each named block ends, where every block of its chain is
    among ``names`` (objects with a block name's ``namespace``, ``key``, ``parent``, ``start`` and
    ``tokens``)."""
    by_key = {(name.namespace, name.key): name for name in names}
    out = []
    for name in by_key.values():
        runs, at = [name.tokens], name
        while at.start > 0 and (at.namespace, at.parent) in by_key:
            at = by_key[at.namespace, at.parent]
            runs.append(at.tokens)
        if at.start == 0 and at.parent == namespace_key(at.namespace):
            out.append((name.namespace, tuple(token for run in reversed(runs) for token in run)))
    return out


@attrs.frozen
class Block:
    """A held block: its key, its parent's key (None for a namespace's first block), its packed
    tokens, its position in the chain (0 first), and how many held blocks extend it."""

    key: bytes
    parent: bytes | None
    tokens: bytes = attrs.field(repr=lambda t: f"<{len(t) // WIDTH} tokens>")
    position: int
    children: int


@attrs.frozen
class BlockTable:
    """The held blocks, by key: each at most once, each one's parent held too."""

    blocks: immutables.Map = _EMPTY

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __getitem__(self, key: bytes) -> Block:
        block = self.blocks.get(key)
        if block is None:
            raise UnknownBlock(f"no held block has key {key.hex()}")
        return block

    def held(self, keys: tuple[bytes, ...]) -> int:
        """How many of the chain ``keys`` are held, from the first: the blocks a prefix reuses."""
        count = 0
        for key in keys:
            if key not in self.blocks:
                break
            count += 1
        return count

    def add(self, namespace: str, prompt: tuple[int, ...] | bytes,
            block_tokens: int = BLOCK_TOKENS) -> tuple["BlockTable", tuple[bytes, ...]]:
        """This table with every full block of ``prompt`` held, and the keys of the blocks that were
        not held before (the only ones a caller has to keep)."""
        data = prompt if isinstance(prompt, bytes) else packed(prompt)
        keys = chain(namespace, data, block_tokens)
        have = self.held(keys)
        if have == len(keys):
            return self, ()
        step = block_tokens * WIDTH
        blocks = self.blocks.mutate()
        parent = keys[have - 1] if have else None
        if parent is not None:
            above = blocks[parent]
            blocks[parent] = attrs.evolve(above, children=above.children + 1)
        for position in range(have, len(keys)):
            key = keys[position]
            last = position == len(keys) - 1
            blocks[key] = Block(key, parent, data[position * step:(position + 1) * step], position,
                                children=0 if last else 1)
            parent = key
        return BlockTable(blocks.finish()), keys[have:]

    def remove(self, key: bytes) -> "BlockTable":
        """This table without the leaf ``key``; :class:`NotALeaf` if a held block extends it."""
        block = self[key]
        if block.children:
            raise NotALeaf(f"block {key.hex()} at position {block.position} is extended by {block.children} "
                           f"held blocks; remove those first")
        blocks = self.blocks.mutate()
        del blocks[key]
        if block.parent is not None:
            above = blocks[block.parent]
            blocks[block.parent] = attrs.evolve(above, children=above.children - 1)
        return BlockTable(blocks.finish())

    def leaves(self) -> Iterator[Block]:
        """The blocks nothing held extends: the only ones eviction may take."""
        return (block for block in self.blocks.values() if not block.children)

    def tokens_of(self, key: bytes) -> tuple[int, ...]:
        """Every token from the namespace's start to the end of block ``key``."""
        runs = []
        block: Block | None = self[key]
        while block is not None:
            runs.append(block.tokens)
            block = self.blocks[block.parent] if block.parent is not None else None
        return ids_of(b"".join(reversed(runs)))
