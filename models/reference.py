"""Tiny random-weight reference models, built offline from mlx-lm architectures.

Each is a real mlx-lm ``Model`` class with a small config and seeded random
weights in float32 (so recomputation comparisons are exact to 1e-5): a dense
llama, a gemma3_text with sliding-window layers, a qwen3_next hybrid of gated
DeltaNet and attention, and a pure-recurrent mamba. No hub, no download.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_map

from kvstate.core.errors import UsageError

VOCAB = 256

CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
                        sliding_window=32, sliding_window_pattern=2, max_position_embeddings=4096,
                        query_pre_attn_scalar=16),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
                       rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=4096, full_attention_interval=2),
    "mamba": dict(model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8),
}


class UnknownReferenceModel(UsageError, KeyError):
    """A reference model name that is not one of :data:`CONFIGS`."""

    def __str__(self) -> str:
        return str(self.args[0])


def build(name: str, seed: int = 0, dtype=mx.float32, vocab_size: int = VOCAB, **overrides):
    """``(model, config)`` for reference model ``name`` with weights drawn from ``seed``; ``overrides``
    change config fields (a larger geometry for benchmarks, say)."""
    if name not in CONFIGS:
        raise UnknownReferenceModel(f"unknown reference model {name!r}; choose one of: {', '.join(CONFIGS)}")
    config = {**CONFIGS[name], "vocab_size": vocab_size, **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    # Fresh mlx-lm modules draw their own initial weights; re-draw them all from the seed, small and in dtype.
    key = mx.random.key(seed)

    def redraw(array):
        nonlocal key
        key, sub = mx.random.split(key)
        return (mx.random.normal(array.shape, key=sub) * 0.08).astype(dtype)
    model.update(tree_map(redraw, model.parameters()))
    mx.eval(model.parameters())
    return model, config
