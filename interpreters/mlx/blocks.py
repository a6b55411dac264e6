"""mlx-lm caches cut into token blocks and assembled back (:mod:`kvstate.core.blocks` names them).

A block of positions ``start`` to ``stop`` is, for each layer that can be cut, that span of its
keys and values (for a quantised cache, of its packed data, scales and biases): new arrays that
share nothing with the caches they were cut from, so a block outlives the request that computed it.
Assembling consecutive blocks concatenates each layer's spans into a cache of the same mlx-lm
class, which a generation loop takes unchanged.

Plain and quantised KV (``KVCache``, ``QuantizedKVCache``) can be cut at any position. Recurrent
state (``ArraysCache``) and sliding windows (``RotatingKVCache``) cannot: their state at a position
is not a span of arrays. In a model that mixes them, a block holds the layers that can be cut (the
others' entries are empty), and a snapshot holds a copy of the others' state at one position: a
chain of blocks up to that position and the snapshot there assemble into the model's caches.
"""

from __future__ import annotations

import mlx.core as mx

from kvstate.interpreters.mlx.caches import ArrayShape, UnsupportedCache, codec_of

#: A block of one request's caches: for each layer, its span's arrays (empty for a layer not cut).
Block = list[dict[str, mx.array]]
#: A snapshot: for each layer that cannot be cut, a copy of its cache; None for the layers blocks hold.
Snapshot = list


def cuttable(cache: object) -> bool:
    """Whether a cache of this class can be cut at any position."""
    return callable(getattr(codec_of(cache), "span", None))


def blockable(caches: list) -> bool:
    """Whether every layer of ``caches`` can be cut into blocks."""
    return all(cuttable(cache) for cache in caches)


def partly_blockable(caches: list) -> bool:
    """Whether some layer of ``caches`` can be cut (the others then go into snapshots)."""
    return any(cuttable(cache) for cache in caches)


def cut(caches: list, start: int, stop: int, evaluate: bool = True) -> Block:
    """Positions ``start`` to ``stop`` of every layer of ``caches`` that can be cut (a block to keep),
    evaluated unless not ``evaluate`` (the caller schedules it)."""
    if not partly_blockable(caches):
        kinds = sorted({type(c).__name__ for c in caches})
        raise UnsupportedCache(f"caches of {', '.join(kinds)} have no layer that can be cut into blocks: "
                               f"keep them whole, or as snapshots beside layers that can be cut")
    covered = min(cache.offset for cache in caches if cuttable(cache))
    if not 0 <= start < stop <= covered:
        raise ValueError(f"a block of positions {start} to {stop} is not within the {covered} the caches cover")
    block = [codec_of(cache).span(cache, start, stop) if cuttable(cache) else {} for cache in caches]
    if evaluate:
        mx.eval([array for layer in block for array in layer.values()])
    return block


def measured(caches: list, positions: int) -> list[dict[str, ArrayShape]]:
    """What a block of ``positions`` positions of ``caches`` would hold, as each array's dtype and
    shape (empty for a layer not cut): its bytes, measured without cutting anything."""
    return [codec_of(cache).span_shapes(cache, positions) if cuttable(cache) else {} for cache in caches]


def snapshot_of(caches: list) -> Snapshot:
    """A copy of the state of every layer of ``caches`` that cannot be cut (None for the others)."""
    out = []
    for cache in caches:
        if cuttable(cache):
            out.append(None)
            continue
        codec = codec_of(cache)
        out.append(codec.clone(cache, codec.covered(cache) or 0))
    return out


def assemble(blocks: list[Block], like: list, snapshot: Snapshot | None = None, tokens: int | None = None) -> list:
    """Caches covering the consecutive ``blocks``, first position first, of ``like``'s classes (a
    model's fresh caches, say), cut back to ``tokens`` positions where given; the layers that cannot
    be cut copied from ``snapshot``: what a hit on them hands the generation loop."""
    if tokens is not None and blocks:
        last = [_cut_back([block[layer] for block in blocks], tokens) if blocks[-1][layer] else {}
                for layer in range(len(like))]  # the last block cut back before the join: one copy
        blocks = [*blocks[:-1], last]
    joined = [codec_of(cache).joined([block[layer] for block in blocks], cache) if cuttable(cache) else None
              for layer, cache in enumerate(like)]
    return _with_snapshot(joined, like, snapshot)


def assemble_joined(layers: list[dict[str, mx.array]], like: list, snapshot: Snapshot | None = None,
                    tokens: int | None = None) -> list:
    """As :func:`assemble`, from each layer's arrays of the blocks already joined (a chain read into
    place, :mod:`~kvstate.interpreters.mlx.chain_reads`): the caches hold them as they are, no copy,
    trimmed to ``tokens`` positions where given (the arrays may hold more, as a cache's own buffer
    does)."""
    joined = []
    for layer, cache in enumerate(like):
        if not cuttable(cache):
            joined.append(None)
            continue
        arrays = layers[layer]
        codec = codec_of(cache)
        if not arrays:
            joined.append(codec.joined([], cache))
            continue
        positions = next(iter(arrays.values())).shape[-2]
        joined.append(codec.holding(arrays, cache, positions if tokens is None else min(tokens, positions)))
    return _with_snapshot(joined, like, snapshot)


def _with_snapshot(joined: list, like: list, snapshot: Snapshot | None) -> list:
    """``joined`` with each layer that cannot be cut (None there) copied from ``snapshot``."""
    out = []
    for layer, cache in enumerate(joined):
        if cache is None:
            held = snapshot[layer] if snapshot is not None else None
            if held is None:
                raise ValueError(f"layer {layer} ({type(like[layer]).__name__}) cannot be cut and no snapshot "
                                 f"holds it")
            codec = codec_of(held)
            cache = codec.clone(held, codec.covered(held) or 0)
        out.append(cache)
    return out


def _cut_back(spans: list[dict[str, mx.array]], tokens: int) -> dict[str, mx.array]:
    """The last of ``spans`` (position axis -2, as every array of a span has it) holding only what is
    left of ``tokens`` after the spans before it."""
    before = sum(next(iter(span.values())).shape[-2] for span in spans[:-1])
    last = spans[-1]
    keep = tokens - before
    if not 0 < keep <= next(iter(last.values())).shape[-2]:
        raise ValueError(f"blocks of {before} positions and then more cannot be cut back to {tokens}")
    return {name: array[..., :keep, :] for name, array in last.items()}
