"""Published model geometries, with the numbers of their public configs.

Each entry cites the config it was read from. Recurrent state sizes are the
conv and recurrent state tensors at 2 bytes an element (bf16), as mlx-lm keeps
them in ``ArraysCache``.
"""

from __future__ import annotations

from kvstate.core.errors import UsageError
from kvstate.models.spec import LayerKind, LayerSpec, ModelSpec


class UnknownModel(UsageError, KeyError):
    """A model name that is not in the catalogue."""

    def __str__(self) -> str:
        return str(self.args[0])


def _dense(name: str, layers: int, kv_heads: int, head_dim: int, context: int, source: str) -> ModelSpec:
    layer = LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=kv_heads, head_dim=head_dim)
    return ModelSpec(name, (layer,) * layers, context, source=source)


def _gemma3(name: str, layers: int, kv_heads: int, head_dim: int, window: int, context: int,
            source: str, pattern: int = 6) -> ModelSpec:
    """Gemma 3: every ``pattern``-th layer is global, the others slide over ``window`` tokens."""
    local = LayerSpec(LayerKind.SLIDING_WINDOW, kv_heads=kv_heads, head_dim=head_dim, window=window)
    glob = LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=kv_heads, head_dim=head_dim)
    return ModelSpec(name, tuple(glob if (i + 1) % pattern == 0 else local for i in range(layers)),
                     context, source=source)


def _qwen3_next() -> ModelSpec:
    """Qwen3-Next: gated DeltaNet layers with one full-attention layer in four."""
    key_heads, value_heads, key_dim, value_dim, conv_kernel = 16, 32, 128, 128, 4
    conv_elements = (conv_kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim)
    recurrent_elements = value_heads * key_dim * value_dim
    delta = LayerSpec(LayerKind.RECURRENT, state_bytes=2 * (conv_elements + recurrent_elements))
    attention = LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=2, head_dim=256)
    layers = tuple(attention if (i + 1) % 4 == 0 else delta for i in range(48))
    return ModelSpec("qwen3-next-80b-a3b", layers, 262144,
                     source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4, "
                            "2 KV heads x 256, linear 16 key / 32 value heads x 128, conv kernel 4")


def _mamba() -> ModelSpec:
    d_inner, d_state, d_conv = 5120, 16, 4
    layer = LayerSpec(LayerKind.RECURRENT, state_bytes=2 * ((d_conv - 1) * d_inner + d_inner * d_state))
    return ModelSpec("mamba-2.8b", (layer,) * 64, None,
                     source="state-spaces/mamba-2.8b-hf config.json: 64 layers, d_model 2560, expand 2, "
                            "d_state 16, d_conv 4")


def _deepseek_v3() -> ModelSpec:
    layer = LayerSpec(LayerKind.LATENT_ATTENTION, latent_dim=512 + 64)
    return ModelSpec("deepseek-v3", (layer,) * 61, 163840,
                     source="deepseek-ai/DeepSeek-V3 config.json: 61 layers, kv_lora_rank 512, "
                            "qk_rope_head_dim 64, max_position_embeddings 163840")


CATALOGUE: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _dense("llama-3.1-8b", 32, 8, 128, 131072,
           "meta-llama/Llama-3.1-8B config.json: 32 layers, 8 KV heads, head_dim 128, 131072 positions"),
    _dense("llama-3.2-1b", 16, 8, 64, 131072,
           "meta-llama/Llama-3.2-1B config.json: 16 layers, 8 KV heads, head_dim 64, 131072 positions"),
    _dense("qwen3-8b", 36, 8, 128, 40960,
           "Qwen/Qwen3-8B config.json: 36 layers, 8 KV heads, head_dim 128, 40960 positions"),
    _dense("qwen3-0.6b", 28, 8, 128, 40960,
           "Qwen/Qwen3-0.6B config.json: 28 layers, 8 KV heads, head_dim 128, 40960 positions"),
    _gemma3("gemma-3-12b", 48, 8, 256, 1024, 131072,
            "google/gemma-3-12b-it config.json: 48 layers, 8 KV heads, head_dim 256, sliding_window 1024, "
            "one global layer in 6"),
    _gemma3("gemma-3-1b", 26, 1, 256, 512, 32768,
            "google/gemma-3-1b-it config.json: 26 layers, 1 KV head, head_dim 256, sliding_window 512, "
            "one global layer in 6"),
    _qwen3_next(),
    _mamba(),
    _deepseek_v3(),
)}


def model_spec(name: str) -> ModelSpec:
    """The catalogue's geometry called ``name``; :class:`UnknownModel` lists the known names."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; the catalogue has: {', '.join(sorted(CATALOGUE))}") from None
