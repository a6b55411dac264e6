"""mlx-lm caches cut into blocks and assembled back, on real models with random weights: the assembled
caches hold exactly the arrays that were cut, share none of them, and a generation continued from
blocks computes what a recompute of the same tokens does."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

from kvstate.interpreters.mlx.blocks import assemble, blockable, cut, measured
from kvstate.interpreters.mlx.caches import UnsupportedCache
from kvstate.models.reference import build

SIZE = 16  # tokens per block here: prompts of a few blocks and a partial one


def prefilled(model, tokens):
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens)]), cache=caches))
    return caches


def logits_after(model, caches, tokens):
    out = model(mx.array([list(tokens)]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def test_a_generation_continued_from_blocks_computes_what_a_recompute_does():
    model, _ = build("llama", seed=3)
    prompt = tuple(range(1, 3 * SIZE + 5))  # three full blocks and a partial one
    caches = prefilled(model, prompt)
    blocks = [cut(caches, i * SIZE, (i + 1) * SIZE) for i in range(3)]
    del caches  # the blocks stand on their own
    assembled = assemble(blocks[:2], make_prompt_cache(model))  # a prefix of two blocks
    assert [type(c) for c in assembled] == [KVCache] * len(assembled) and assembled[0].offset == 2 * SIZE
    other = prompt[:2 * SIZE] + (200, 201, 202)  # diverges right after the second block (in the vocabulary: 256)
    got = logits_after(model, assembled, other[2 * SIZE:])
    want = logits_after(model, make_prompt_cache(model), other)
    assert float(mx.abs(got - want).max()) <= 1e-5


def test_assembled_caches_hold_exactly_what_was_cut_and_share_no_array():
    model, _ = build("llama", seed=4)
    caches = prefilled(model, tuple(range(1, 2 * SIZE + 1)))
    blocks = [cut(caches, 0, SIZE), cut(caches, SIZE, 2 * SIZE)]
    assembled = assemble(blocks, make_prompt_cache(model))
    for original, joined in zip(caches, assembled):
        assert mx.array_equal(joined.keys, original.keys[..., :2 * SIZE, :])
        assert mx.array_equal(joined.values, original.values[..., :2 * SIZE, :])
        assert joined.keys is not original.keys
    before = [mx.array(b["keys"]) for b in blocks[0]]
    mx.eval(model(mx.array([[5, 6, 7]]), cache=assembled))  # the generation loop writes its caches in place
    assert all(mx.array_equal(b["keys"], kept) for b, kept in zip(blocks[0], before))


def test_quantized_caches_cut_and_assemble_per_position():
    cache = QuantizedKVCache(group_size=32, bits=8)
    keys = mx.random.normal((1, 2, 40, 64))
    cache.update_and_fetch(keys, keys * 2)
    assembled = assemble([cut([cache], 0, 16), cut([cache], 16, 40)], [QuantizedKVCache(group_size=32, bits=8)])[0]
    assert assembled.offset == 40
    for part, original in zip(assembled.keys, cache.keys):
        assert mx.array_equal(part, original[..., :40, :])


def test_state_that_cannot_be_cut_back_is_refused_by_name_and_a_span_past_the_caches_too():
    recurrent = ArraysCache(2)
    recurrent[0] = mx.zeros((1, 3, 8))
    assert not blockable([recurrent])
    with pytest.raises(UnsupportedCache, match="ArraysCache.*snapshots"):
        cut([recurrent], 0, 1)
    model, _ = build("llama", seed=5)
    caches = prefilled(model, tuple(range(1, SIZE + 1)))
    with pytest.raises(ValueError, match="not within"):
        cut(caches, 0, SIZE + 1)


@pytest.mark.parametrize("quantized", [False, True], ids=["kv", "quantized"])
def test_a_block_measured_before_it_is_cut_holds_the_bytes_and_shapes_of_the_cut(quantized):
    cache = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
    keys = mx.random.normal((1, 2, 3 * SIZE + 5, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys * 2)
    for start, stop in ((0, SIZE), (3 * SIZE, 3 * SIZE + 5)):
        cut_block, shapes = cut([cache], start, stop)[0], measured([cache], stop - start)[0]
        assert set(shapes) == set(cut_block)
        for name, array in cut_block.items():
            assert (shapes[name].dtype, shapes[name].shape, shapes[name].nbytes) == (array.dtype, array.shape, array.nbytes)
