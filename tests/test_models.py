"""Model geometry: bytes per token from the public configs, and the formula against real mlx caches."""

import attrs
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvstate import CATALOGUE, LayerKind, LayerSpec, ModelSpec, model_spec
from kvstate.models import BF16, Q4, Q8, KvScheme
from tests.reference import attention_bytes


def live_bytes(arrays, tokens: int) -> int:
    """Bytes of the first ``tokens`` positions (axis 2) of every array, however nested: what is live
    in mlx-lm's step-padded buffers."""
    if isinstance(arrays, mx.array):
        return arrays[..., :tokens, :].nbytes
    return sum(live_bytes(part, tokens) for part in arrays)


def test_dense_models_from_their_configs():
    assert model_spec("llama-3.1-8b").bytes_per_token == attention_bytes(32, 8, 128, 1) == 128 * 1024
    assert model_spec("llama-3.2-1b").bytes_per_token == attention_bytes(16, 8, 64, 1)
    assert model_spec("qwen3-8b").bytes_per_token == attention_bytes(36, 8, 128, 1)
    assert model_spec("llama-3.1-8b").fixed_bytes == 0


def test_sliding_window_layers_stop_growing_at_their_window():
    gemma = model_spec("gemma-3-12b")
    globals_ = sum(1 for layer in gemma.layers if layer.kind is LayerKind.FULL_ATTENTION)
    assert globals_ == 8 and len(gemma.layers) == 48
    per_layer_token = attention_bytes(1, 8, 256, 1)
    assert gemma.bytes_for(4096) == 8 * 4096 * per_layer_token + 40 * 1024 * per_layer_token
    assert gemma.trimmable_at(1023) and not gemma.trimmable_at(1024)


def test_recurrent_state_is_fixed_and_never_trimmable():
    mamba = model_spec("mamba-2.8b")
    assert mamba.bytes_for(1) == mamba.bytes_for(100_000) == mamba.fixed_bytes > 0
    assert not mamba.trimmable_at(10)
    nxt = model_spec("qwen3-next-80b-a3b")
    assert nxt.fixed_bytes > 0 and nxt.bytes_per_token == attention_bytes(12, 2, 256, 1)
    assert not nxt.trimmable_at(10)


def test_latent_attention_stores_one_vector_per_token():
    assert model_spec("deepseek-v3").bytes_per_token == 61 * (512 + 64) * 2


def test_every_catalogue_entry_cites_its_source():
    for spec in CATALOGUE.values():
        assert spec.source and spec.name in CATALOGUE


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_bf16_bytes_equal_a_real_kvcache(tokens):
    heads, head_dim = 2, 64
    cache = KVCache()
    keys = mx.zeros((1, heads, tokens, head_dim), dtype=mx.bfloat16)
    cache.update_and_fetch(keys, keys)
    live = live_bytes((cache.keys, cache.values), cache.offset)
    layer = LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=heads, head_dim=head_dim)
    assert layer.bytes_for(tokens, BF16) == live


@pytest.mark.parametrize("bits, scheme", [(8, Q8), (4, Q4)])
def test_quantised_bytes_equal_a_real_quantized_kvcache(bits, scheme):
    heads, head_dim, tokens = 2, 128, 33
    cache = QuantizedKVCache(group_size=64, bits=bits)
    keys = mx.zeros((1, heads, tokens, head_dim), dtype=mx.float16)
    cache.update_and_fetch(keys, keys)
    live = live_bytes((cache.keys, cache.values), cache.offset)
    layer = LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=heads, head_dim=head_dim)
    assert layer.bytes_for(tokens, scheme) == live


def test_rotating_cache_holds_its_window():
    window, heads, head_dim = 16, 1, 32
    cache = RotatingKVCache(max_size=window)
    for _ in range(3):
        chunk = mx.zeros((1, heads, 10, head_dim), dtype=mx.bfloat16)
        cache.update_and_fetch(chunk, chunk)
    live = live_bytes((cache.keys, cache.values), min(cache.offset, window))
    layer = LayerSpec(LayerKind.SLIDING_WINDOW, kv_heads=heads, head_dim=head_dim, window=window)
    assert layer.bytes_for(30, BF16) == live


def test_invalid_geometry_is_refused():
    with pytest.raises(ValueError, match="window"):
        LayerSpec(LayerKind.SLIDING_WINDOW, kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="bits"):
        KvScheme("q3", 3, group_size=64)
    with pytest.raises(ValueError, match="no layers"):
        ModelSpec("empty", (), 10)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("scheme", [BF16, Q8, Q4])
@pytest.mark.parametrize("block", [1, 512])
def test_bytes_for_any_length_is_the_sum_over_every_layer(name, scheme, block):
    """The geometry's total, however it is worked out, is each layer's own bytes summed."""
    spec = attrs.evolve(model_spec(name), kv=scheme).per_block(block)
    for tokens in (0, 1, 2, 7, 511, 512, 4096, 131_072, 10**7):
        assert spec.bytes_for(tokens) == sum(layer.bytes_for(tokens * block, scheme) for layer in spec.layers)
