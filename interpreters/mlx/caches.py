"""What the MLX interpreter needs of each mlx-lm cache kind: one small codec per class.

A codec answers, for one layer's cache: how many tokens it covers, the bytes
its live tokens hold (not the 256-step padded buffer), whether it can be
trimmed, a copy trimmed to ``n`` tokens that shares no array object with the
original (mlx-lm updates caches in place), and the tensors plus scalars that
save it and build it back. Classes: ``KVCache``, ``RotatingKVCache``,
``QuantizedKVCache``, ``ArraysCache``, ``CacheList``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from kvstate.core.errors import InvalidRequest


class UnsupportedCache(InvalidRequest):
    """A cache object of a class the MLX interpreter has no codec for."""


def _slice(array: mx.array, n: int) -> mx.array:
    """The first ``n`` positions (axis 2) as a new array object."""
    return array[..., :n, :]


@attrs.frozen
class ArrayShape:
    """An array's dtype and shape, without the array: what a block would hold, measured before it is cut."""

    dtype: mx.Dtype
    shape: tuple[int, ...]

    @classmethod
    def along(cls, array: mx.array, positions: int) -> "ArrayShape":
        """``array``'s dtype and shape with ``positions`` positions on axis -2."""
        return cls(array.dtype, (*array.shape[:-2], positions, array.shape[-1]))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


def _nbytes(array: mx.array, n: int) -> int:
    return array[..., :n, :].nbytes


class KVCodec:
    """Plain keys and values for every token."""

    cls = KVCache

    def covered(self, cache: KVCache) -> int | None:
        return cache.offset

    def live_bytes(self, cache: KVCache) -> int:
        if cache.keys is None:
            return 0
        return _nbytes(cache.keys, cache.offset) + _nbytes(cache.values, cache.offset)

    def trimmable(self, cache: KVCache) -> bool:
        return True

    def clone(self, cache: KVCache, n: int) -> KVCache:
        copy = KVCache()
        if cache.keys is not None and n > 0:
            copy.keys, copy.values = _slice(cache.keys, n), _slice(cache.values, n)
            copy.offset = n
        return copy

    def save(self, cache: KVCache) -> tuple[dict[str, mx.array], dict[str, Any]]:
        if cache.keys is None or cache.offset == 0:
            return {}, {"offset": 0}
        return ({"keys": _slice(cache.keys, cache.offset), "values": _slice(cache.values, cache.offset)},
                {"offset": cache.offset})

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> KVCache:
        cache = KVCache()
        if meta["offset"]:
            cache.keys, cache.values, cache.offset = arrays["keys"], arrays["values"], int(meta["offset"])
        return cache

    def buffered(self, cache: KVCache) -> int:
        """Positions its buffer holds: its offset, or up to a step more."""
        return 0 if cache.keys is None else cache.keys.shape[-2]

    def span(self, cache: KVCache, start: int, stop: int) -> dict[str, mx.array]:
        """Positions ``start`` to ``stop`` as new arrays: one block's share of this layer."""
        # Copied out (``contiguous``): a bare slice is a view that keeps the whole cache's buffer alive.
        return {"keys": mx.contiguous(cache.keys[..., start:stop, :]),
                "values": mx.contiguous(cache.values[..., start:stop, :])}

    def span_shapes(self, cache: KVCache, positions: int) -> dict[str, ArrayShape]:
        """The shapes of :meth:`span`'s arrays over ``positions`` positions (nothing cut: to measure)."""
        return {"keys": ArrayShape.along(cache.keys, positions), "values": ArrayShape.along(cache.values, positions)}

    def joined(self, spans: list[dict[str, mx.array]], like: KVCache) -> KVCache:
        """A cache of the consecutive ``spans``, first position first, of ``like``'s kind."""
        if not spans:
            return KVCache()
        joined = {name: mx.concatenate([s[name] for s in spans], axis=2) for name in ("keys", "values")}
        return self.holding(joined, like, joined["keys"].shape[2])

    def holding(self, arrays: dict[str, mx.array], like: KVCache, tokens: int) -> KVCache:
        """A cache of ``like``'s kind over the first ``tokens`` positions of one span's ``arrays``, held
        as they are (no copy: they must be the new cache's alone)."""
        return self.load(arrays, {"offset": tokens})


class RotatingCodec:
    """A sliding window: trimmable until it wraps, then only its exact position."""

    cls = RotatingKVCache

    def covered(self, cache: RotatingKVCache) -> int | None:
        return cache.offset

    def _held(self, cache: RotatingKVCache) -> int:
        return 0 if cache.keys is None else min(cache.offset, cache.keys.shape[2])

    def live_bytes(self, cache: RotatingKVCache) -> int:
        held = self._held(cache)
        return 0 if held == 0 else _nbytes(cache.keys, held) + _nbytes(cache.values, held)

    def trimmable(self, cache: RotatingKVCache) -> bool:
        return cache.offset < cache.max_size

    def clone(self, cache: RotatingKVCache, n: int) -> RotatingKVCache:
        copy = RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
        if cache.keys is None or n == 0:
            return copy
        if n != cache.offset and not self.trimmable(cache):
            raise InvalidRequest(f"a wrapped sliding window at {cache.offset} tokens cannot serve {n}")
        held = n if n != cache.offset else self._held(cache)
        copy.keys, copy.values = _slice(cache.keys, held), _slice(cache.values, held)
        copy.offset = n
        copy._idx = cache._idx if n == cache.offset else n
        return copy

    def save(self, cache: RotatingKVCache) -> tuple[dict[str, mx.array], dict[str, Any]]:
        meta = {"offset": cache.offset, "keep": cache.keep, "max_size": cache.max_size, "idx": cache._idx}
        held = self._held(cache)
        if held == 0:
            return {}, meta
        return {"keys": _slice(cache.keys, held), "values": _slice(cache.values, held)}, meta

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> RotatingKVCache:
        cache = RotatingKVCache(max_size=int(meta["max_size"]), keep=int(meta["keep"]))
        if arrays:
            cache.keys, cache.values = arrays["keys"], arrays["values"]
            cache.offset, cache._idx = int(meta["offset"]), int(meta["idx"])
        return cache


class QuantizedCodec:
    """Grouped-quantised keys and values: packed data, scales and biases per token."""

    cls = QuantizedKVCache

    def covered(self, cache: QuantizedKVCache) -> int | None:
        return cache.offset

    def live_bytes(self, cache: QuantizedKVCache) -> int:
        if cache.keys is None:
            return 0
        return sum(_nbytes(part, cache.offset) for part in (*cache.keys, *cache.values))

    def trimmable(self, cache: QuantizedKVCache) -> bool:
        return True

    def clone(self, cache: QuantizedKVCache, n: int) -> QuantizedKVCache:
        copy = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None and n > 0:
            copy.keys = tuple(_slice(part, n) for part in cache.keys)
            copy.values = tuple(_slice(part, n) for part in cache.values)
            copy.offset = n
        return copy

    def save(self, cache: QuantizedKVCache) -> tuple[dict[str, mx.array], dict[str, Any]]:
        meta = {"offset": cache.offset, "group_size": cache.group_size, "bits": cache.bits}
        if cache.keys is None or cache.offset == 0:
            return {}, {**meta, "offset": 0}
        arrays = {f"keys.{i}": _slice(part, cache.offset) for i, part in enumerate(cache.keys)}
        arrays.update({f"values.{i}": _slice(part, cache.offset) for i, part in enumerate(cache.values)})
        return arrays, meta

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=int(meta["group_size"]), bits=int(meta["bits"]))
        if meta["offset"]:
            cache.keys = tuple(arrays[f"keys.{i}"] for i in range(3))
            cache.values = tuple(arrays[f"values.{i}"] for i in range(3))
            cache.offset = int(meta["offset"])
        return cache

    def buffered(self, cache: QuantizedKVCache) -> int:
        return 0 if cache.keys is None else cache.keys[0].shape[-2]

    def span(self, cache: QuantizedKVCache, start: int, stop: int) -> dict[str, mx.array]:
        """Positions ``start`` to ``stop`` of the packed data, scales and biases (quantised per position)."""
        arrays = {f"keys.{i}": mx.contiguous(part[..., start:stop, :]) for i, part in enumerate(cache.keys)}
        arrays.update({f"values.{i}": mx.contiguous(part[..., start:stop, :]) for i, part in enumerate(cache.values)})
        return arrays

    def span_shapes(self, cache: QuantizedKVCache, positions: int) -> dict[str, ArrayShape]:
        shapes = {f"keys.{i}": ArrayShape.along(part, positions) for i, part in enumerate(cache.keys)}
        shapes.update({f"values.{i}": ArrayShape.along(part, positions) for i, part in enumerate(cache.values)})
        return shapes

    def joined(self, spans: list[dict[str, mx.array]], like: QuantizedKVCache) -> QuantizedKVCache:
        if not spans:
            return QuantizedKVCache(group_size=like.group_size, bits=like.bits)
        joined = {name: mx.concatenate([s[name] for s in spans], axis=2) for name in spans[0]}
        return self.holding(joined, like, joined["keys.0"].shape[2])

    def holding(self, arrays: dict[str, mx.array], like: QuantizedKVCache, tokens: int) -> QuantizedKVCache:
        """As :meth:`KVCodec.holding`, with ``like``'s quantisation."""
        return self.load(arrays, {"offset": tokens, "group_size": like.group_size, "bits": like.bits})


class ArraysCodec:
    """Fixed-size recurrent state (conv and SSM state): never trimmed, position unknown to the cache."""

    cls = ArraysCache

    def covered(self, cache: ArraysCache) -> int | None:
        return None

    def live_bytes(self, cache: ArraysCache) -> int:
        return sum(a.nbytes for a in cache.cache if a is not None)

    def trimmable(self, cache: ArraysCache) -> bool:
        return False

    def clone(self, cache: ArraysCache, n: int) -> ArraysCache:
        copy = ArraysCache(len(cache.cache))
        copy.cache = [None if a is None else mx.array(a) for a in cache.cache]
        return copy

    def save(self, cache: ArraysCache) -> tuple[dict[str, mx.array], dict[str, Any]]:
        present = [i for i, a in enumerate(cache.cache) if a is not None]
        return {f"cache.{i}": cache.cache[i] for i in present}, {"size": len(cache.cache), "present": present}

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> ArraysCache:
        cache = ArraysCache(int(meta["size"]))
        for i in meta["present"]:
            cache.cache[int(i)] = arrays[f"cache.{i}"]
        return cache


class CacheListCodec:
    """Several caches for one layer: each part by its own codec."""

    cls = CacheList

    def covered(self, cache: CacheList) -> int | None:
        return covered(list(cache.caches))

    def live_bytes(self, cache: CacheList) -> int:
        return sum(codec_of(c).live_bytes(c) for c in cache.caches)

    def trimmable(self, cache: CacheList) -> bool:
        return all(codec_of(c).trimmable(c) for c in cache.caches)

    def clone(self, cache: CacheList, n: int) -> CacheList:
        return CacheList(*(codec_of(c).clone(c, n) for c in cache.caches))

    def save(self, cache: CacheList) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays, parts = {}, []
        for i, part in enumerate(cache.caches):
            part_arrays, meta = codec_of(part).save(part)
            arrays.update({f"{i}.{name}": a for name, a in part_arrays.items()})
            parts.append({"class": type(part).__name__, **meta})
        return arrays, {"parts": parts}

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> CacheList:
        parts = []
        for i, part in enumerate(meta["parts"]):
            prefix = f"{i}."
            own = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
            parts.append(codec_named(part["class"]).load(own, part))
        return CacheList(*parts)


class TensorObject:
    """A tensor object kept by exact key (an encoder's output): named arrays, stored like a one-layer cache."""

    def __init__(self, arrays: dict[str, mx.array]):
        if not isinstance(arrays, dict) or not arrays or not all(
                isinstance(k, str) and k and "." not in k and isinstance(v, mx.array) for k, v in arrays.items()):
            raise InvalidRequest("an object is a non-empty dict of mx.array under names without dots")
        self.arrays = dict(arrays)


class TensorObjectCodec:
    cls = TensorObject

    def covered(self, cache: TensorObject) -> int | None:
        return None

    def live_bytes(self, cache: TensorObject) -> int:
        return sum(a.nbytes for a in cache.arrays.values())

    def trimmable(self, cache: TensorObject) -> bool:
        return False

    def clone(self, cache: TensorObject, n: int) -> TensorObject:
        return TensorObject({name: mx.array(a) for name, a in cache.arrays.items()})

    def save(self, cache: TensorObject) -> tuple[dict[str, mx.array], dict[str, Any]]:
        return dict(cache.arrays), {"names": sorted(cache.arrays)}

    def load(self, arrays: dict[str, mx.array], meta: dict[str, Any]) -> TensorObject:
        return TensorObject({name: arrays[name] for name in meta["names"]})


CODECS = {codec.cls: codec for codec in (KVCodec(), RotatingCodec(), QuantizedCodec(), ArraysCodec(),
                                         CacheListCodec(), TensorObjectCodec())}
_BY_NAME = {cls.__name__: codec for cls, codec in CODECS.items()}


def codec_of(cache: object):
    codec = CODECS.get(type(cache))
    if codec is None:
        raise UnsupportedCache(f"no codec for cache class {type(cache).__name__}; kvstate handles "
                               f"{', '.join(sorted(_BY_NAME))}")
    return codec


def codec_named(name: str):
    codec = _BY_NAME.get(name)
    if codec is None:
        raise KeyError(name)
    return codec


def covered(caches: list) -> int | None:
    """Tokens a cache list covers (the layers that know agree), or None if no layer knows."""
    offsets = {codec_of(c).covered(c) for c in caches} - {None}
    if len(offsets) > 1:
        raise InvalidRequest(f"the layers of these caches cover different lengths: {sorted(offsets)}")
    return offsets.pop() if offsets else None


def live_bytes(caches: list) -> int:
    return sum(codec_of(c).live_bytes(c) for c in caches)


def trimmable(caches: list) -> bool:
    """One non-trimmable layer makes the whole list non-trimmable."""
    return all(codec_of(c).trimmable(c) for c in caches)


def clone(caches: list, n: int) -> list:
    """A copy of ``caches`` covering their first ``n`` tokens, sharing no array object."""
    return [codec_of(c).clone(c, n) for c in caches]


def detached(caches: list, n: int) -> list:
    """Like :func:`clone`, but every array copied out of the buffers it was cut from (a clone's arrays
    are views that keep a running batch's whole buffer alive, and make its next update copy it);
    evaluated."""
    out = []
    for cache in clone(caches, n):
        codec = codec_of(cache)
        arrays, meta = codec.save(cache)
        out.append(codec.load({name: mx.contiguous(a) for name, a in arrays.items()}, meta))
    mx.eval(arrays_of(out))
    return out


def arrays_of(caches: list) -> list[mx.array]:
    """Every array the caches hold (to evaluate them before a write)."""
    out: list[mx.array] = []
    for cache in caches:
        tensors, _ = codec_of(cache).save(cache)
        out.extend(tensors.values())
    return out
