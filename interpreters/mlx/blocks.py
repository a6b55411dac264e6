"""mlx-lm caches cut into token blocks and assembled back (:mod:`kvstate.core.blocks` names them).

A block of positions ``start`` to ``stop`` is, for each layer, that span of its keys and values (for
a quantised cache, of its packed data, scales and biases): new arrays that share nothing with the
caches they were cut from, so a block outlives the request that computed it. Assembling consecutive
blocks concatenates each layer's spans into a cache of the same mlx-lm class, which a generation
loop takes unchanged.

Only caches whose every position can be cut out are cut: plain and quantised KV (``KVCache``,
``QuantizedKVCache``). Recurrent state and sliding windows cannot be cut back (their state at a
position is not a span of arrays); they are kept as snapshots at chunk boundaries instead.
"""

from __future__ import annotations

import mlx.core as mx

from kvstate.interpreters.mlx.caches import UnsupportedCache, codec_of

#: A block of one request's caches: for each layer, its span's arrays.
Block = list[dict[str, mx.array]]


def blockable(caches: list) -> bool:
    """Whether every layer of ``caches`` can be cut into blocks."""
    return all(callable(getattr(codec_of(cache), "span", None)) for cache in caches)


def cut(caches: list, start: int, stop: int, evaluate: bool = True) -> Block:
    """Positions ``start`` to ``stop`` of every layer of ``caches`` (a block to keep), evaluated unless
    not ``evaluate`` (the caller schedules it)."""
    if not blockable(caches):
        kinds = sorted({type(c).__name__ for c in caches if not callable(getattr(codec_of(c), "span", None))})
        raise UnsupportedCache(f"caches of {', '.join(kinds)} cannot be cut into blocks: keep them as snapshots")
    covered = min(cache.offset for cache in caches)
    if not 0 <= start < stop <= covered:
        raise ValueError(f"a block of positions {start} to {stop} is not within the {covered} the caches cover")
    block = [codec_of(cache).span(cache, start, stop) for cache in caches]
    if evaluate:
        mx.eval([array for layer in block for array in layer.values()])
    return block


def assemble(blocks: list[Block], like: list) -> list:
    """Caches covering the consecutive ``blocks``, first position first, of ``like``'s classes (a
    model's fresh caches, say): what a hit on those blocks hands the generation loop."""
    return [codec_of(cache).joined([block[layer] for block in blocks], cache) for layer, cache in enumerate(like)]
