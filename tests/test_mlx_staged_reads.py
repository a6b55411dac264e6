"""The staged read of a chain (``interpreters/mlx/staged_reads.py``, how a CUDA device restores blocks)
against the read into host memory (``chain_reads.read_chain``), the reference: for any chain of
blocks, some read from their files and some held in RAM, any window and any task size, both give the
same arrays, byte for byte."""

from __future__ import annotations

import tempfile

import mlx.core as mx
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import KVCache

from kvstate.core.blocks import block_names
from kvstate.interpreters.mlx import chain_reads, staged_reads
from kvstate.interpreters.mlx.blocks import cut
from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity

SIZE = 8


@st.composite
def chains(draw):
    """A model's caches over some tokens, cut into blocks of SIZE (the last maybe partial), which of
    them a restore finds in RAM, and the window and task sizes the staged read runs with."""
    tokens = draw(st.integers(1, 6 * SIZE))
    layers = draw(st.integers(1, 3))
    heads, dim = draw(st.sampled_from([(1, 4), (2, 8), (3, 2)]))
    dtype = draw(st.sampled_from([mx.bfloat16, mx.float32, mx.float16]))
    seed = draw(st.integers(0, 2 ** 16))
    in_ram = draw(st.sets(st.integers(0, -(-tokens // SIZE) - 1)))
    window = draw(st.sampled_from([1, 100, 1000, 10 ** 9]))
    task_bytes = draw(st.sampled_from([1, 600, chain_reads.TASK_BYTES]))
    caches = []
    for layer in range(layers):
        cache = KVCache()
        keys = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed + layer)).astype(dtype)
        cache.update_and_fetch(keys, (keys * 2 + 1).astype(dtype))
        caches.append(cache)
    return tuple(range(1, tokens + 1)), caches, in_ram, window, task_bytes


@settings(max_examples=40, deadline=None)
@given(chains())
def test_the_staged_read_gives_what_the_read_into_host_memory_does(chain):
    tokens, caches, in_ram, window, task_bytes = chain
    names = block_names("n", tokens, SIZE)
    blocks = [cut(caches, name.start, name.start + len(name.tokens)) for name in names]
    parts = [blocks[i] if i in in_ram else names[i] for i in range(len(names))]
    saved_window, saved_tasks = staged_reads.WINDOW_BYTES, chain_reads.TASK_BYTES
    with tempfile.TemporaryDirectory() as root:
        store = DiskStore(root, StoreIdentity("test", "none", "staged-reads"), to_device=False)
        classes = [type(cache).__name__ for cache in caches]
        for name, block in zip(names, blocks):
            store.commit(store.encode_block(name, block, classes))
        want = store.read_chain(parts)  # into host memory
        store.to_device = True
        staging, real = staged_reads.HostStaging(), staged_reads.cuda_staging
        staged_reads.cuda_staging = lambda: staging
        staged_reads.WINDOW_BYTES, chain_reads.TASK_BYTES = window, task_bytes
        try:
            got = store.read_chain(parts)
            again = store.read_chain(parts)  # the staging reused, its buffers written over
        finally:
            staged_reads.cuda_staging = real
            staged_reads.WINDOW_BYTES, chain_reads.TASK_BYTES = saved_window, saved_tasks
            store.close()
    for read in (got, again):
        assert len(read) == len(want)
        for layer_got, layer_want in zip(read, want):
            assert layer_got.keys() == layer_want.keys()
            for key in layer_want:
                a, b = layer_got[key], layer_want[key]
                assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
