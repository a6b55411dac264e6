"""Read a model's cache geometry and identity off a loaded mlx-lm model.

``spec_from_model`` runs the model's own ``make_cache()`` caches over one and
then two tokens and reads each layer's kind and size from what they hold:
``KVCache`` (full attention), ``RotatingKVCache`` (its window),
``QuantizedKVCache`` (bits and group size), ``ArraysCache`` (fixed recurrent
state). ``model_fingerprint`` hashes weights, config, dtype and KV scheme;
with ``tokenizer_hash`` it is the identity every saved file carries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from kvstate.models.spec import KvScheme, LayerKind, LayerSpec, ModelSpec


class UnsupportedModel(ValueError):
    """A model whose caches kvstate cannot describe."""


def _scheme(caches: list) -> KvScheme:
    for cache in caches:
        if isinstance(cache, QuantizedKVCache):
            return KvScheme(f"q{cache.bits}", cache.bits, group_size=cache.group_size)
        if isinstance(cache, (KVCache, RotatingKVCache)) and cache.keys is not None:
            bits = cache.keys.dtype.size * 8
            return KvScheme({16: "bf16" if cache.keys.dtype == mx.bfloat16 else "fp16", 32: "fp32"}[bits], bits)
    return KvScheme("bf16", 16)


def spec_from_model(model: Any, name: str, context_limit: int | None = None) -> ModelSpec:
    """The geometry of ``model``'s caches, measured by running it over one token."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    layers = []
    for i, cache in enumerate(caches):
        if isinstance(cache, ArraysCache):
            layers.append(LayerSpec(LayerKind.RECURRENT,
                                    state_bytes=sum(a.nbytes for a in cache.cache if a is not None)))
            continue
        if isinstance(cache, QuantizedKVCache):
            shape, packed = cache.keys[0].shape, cache.keys[0].shape[-1] * 32 // cache.bits
            layers.append(LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=shape[1], head_dim=packed))
            continue
        if isinstance(cache, (KVCache, RotatingKVCache)):
            heads, head_dim = cache.keys.shape[1], cache.keys.shape[-1]
            if isinstance(cache, RotatingKVCache):
                layers.append(LayerSpec(LayerKind.SLIDING_WINDOW, kv_heads=heads, head_dim=head_dim,
                                        window=cache.max_size))
            else:
                layers.append(LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=heads, head_dim=head_dim))
            continue
        raise UnsupportedModel(f"layer {i} keeps a {type(cache).__name__}, which kvstate cannot describe yet")
    if context_limit is None:
        args = getattr(model, "args", None)
        context_limit = getattr(args, "max_position_embeddings", None)
    return ModelSpec(name, tuple(layers), context_limit, kv=_scheme(caches),
                     source=f"measured off an mlx-lm {type(model).__module__}.Model")


def model_fingerprint(model: Any, config: dict | None = None) -> str:
    """A hash of every weight (name, dtype, shape, bytes) and the config: the model's identity."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(config or {}, sort_keys=True, default=str).encode())
    for name, weight in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        digest.update(f"{name}:{weight.dtype}:{tuple(weight.shape)}".encode())
        digest.update(memoryview(mx.view(mx.contiguous(weight), mx.uint8)))
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any | None) -> str:
    """A hash of a tokenizer's vocabulary (``get_vocab()``), or ``"none"`` without one."""
    if tokenizer is None:
        return "none"
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else tokenizer
    return hashlib.blake2b(json.dumps(vocab, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
