"""A chain of blocks read from its files straight into each layer's joined arrays: the caches it makes
hold exactly what was cut (plain and quantised KV, blocks read and blocks held in RAM mixed, trimmed
inside the last block) and share nothing with the RAM blocks; a block that fails its header, its
name or its hash is named, moved aside and never restored; an I/O error is tried once more and then
leaves the files as they are. Each holds for both readers: into host memory, and through a reused
staging buffer onto the device (the CUDA path, run here with the host's staging), whole and a window
at a time; a device that refuses the staging's copy leaves the read to the host's way."""

from __future__ import annotations

import errno

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvstate.core.blocks import block_names
from kvstate.effects.completions import FailureReason
from kvstate.interpreters.mlx import chain_reads, file_io, staged_reads
from kvstate.interpreters.mlx.blocks import assemble, assemble_joined, cut
from kvstate.interpreters.mlx.chain_reads import PartRejected
from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity

SIZE = 16
TOKENS = tuple(range(1, 3 * SIZE + 7))  # three full blocks and a partial one


def kv_caches(dtype=mx.bfloat16) -> list:
    out = []
    for layer in range(2):
        cache = KVCache()
        keys = mx.random.normal((1, 2, len(TOKENS), 8), key=mx.random.key(layer)).astype(dtype)
        cache.update_and_fetch(keys, keys * 3)
        out.append(cache)
    return out


def quantized_caches() -> list:
    cache = QuantizedKVCache(group_size=32, bits=8)
    keys = mx.random.normal((1, 2, len(TOKENS), 64), key=mx.random.key(9))
    cache.update_and_fetch(keys, keys * 2)
    return [cache]


REAL_CUDA_STAGING = staged_reads.cuda_staging


@pytest.fixture(autouse=True, params=["host", "staged", "staged in windows"])
def reader(request, monkeypatch):
    """Which way the stores of a test read chains: into host memory, or through a staging buffer onto
    the device (whole, or a window of a few tensors at a time)."""
    if request.param != "host":
        staging = staged_reads.HostStaging()
        monkeypatch.setattr(staged_reads, "cuda_staging", lambda: staging)
        if request.param == "staged in windows":
            monkeypatch.setattr(staged_reads, "WINDOW_BYTES", 600)
    return request.param


def saved(tmp_path, caches):
    """A store holding every block of ``caches`` over TOKENS; the block names and the cut blocks."""
    store = DiskStore(tmp_path, StoreIdentity("test", "none", "chain-reads"), to_device=True)
    names = block_names("n", TOKENS, SIZE)
    classes = [type(cache).__name__ for cache in caches]
    blocks = [cut(caches, name.start, name.start + len(name.tokens)) for name in names]
    for name, block in zip(names, blocks):
        store.commit(store.encode_block(name, block, classes))
    return store, names, blocks


def arrays_of(cache) -> list[mx.array]:
    if isinstance(cache, QuantizedKVCache):
        return [part[..., :cache.offset, :] for part in (*cache.keys, *cache.values)]
    return [cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :]]


@pytest.mark.parametrize("make", [kv_caches, quantized_caches], ids=["kv", "quantized"])
@pytest.mark.parametrize("in_ram", [(), (0,), (0, 1), (2,)], ids=["all read", "first in RAM", "two in RAM", "third in RAM"])
@pytest.mark.parametrize("tokens", [len(TOKENS), 3 * SIZE + 2, 2 * SIZE + 5])
@pytest.mark.parametrize("task_bytes", [chain_reads.TASK_BYTES, 1], ids=["blocks a task", "a tensor a task"])
def test_a_chain_read_into_place_holds_what_a_join_of_its_blocks_does(tmp_path, monkeypatch, make, in_ram, tokens,
                                                                      task_bytes):
    monkeypatch.setattr(chain_reads, "TASK_BYTES", task_bytes)
    caches = make()
    store, names, blocks = saved(tmp_path, caches)
    count = -(-tokens // SIZE)
    chain = [blocks[i] if i in in_ram else names[i] for i in range(count)]
    like = [type(c)() if isinstance(c, KVCache) else QuantizedKVCache(group_size=32, bits=8) for c in caches]
    read = assemble_joined(store.read_chain(chain), like, tokens=tokens)
    want = assemble(blocks[:count], like, tokens=tokens)
    for got, expected in zip(read, want):
        assert type(got) is type(expected) and got.offset == expected.offset == tokens
        for a, b in zip(arrays_of(got), arrays_of(expected)):
            assert a.dtype == b.dtype and mx.array_equal(a, b)


def test_the_caches_read_share_nothing_with_the_blocks_held_in_ram(tmp_path):
    caches = kv_caches(mx.float32)
    store, names, blocks = saved(tmp_path, caches)
    held = [{name: mx.array(a) for name, a in layer.items()} for layer in blocks[0]]
    read = assemble_joined(store.read_chain([blocks[0], names[1]]), [KVCache(), KVCache()], tokens=SIZE + 3)
    for cache in read:  # the generation loop writes into its caches' own buffers, past the offset
        cache.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
        mx.eval(cache.keys, cache.values)
    assert all(mx.array_equal(blocks[0][i][name], held[i][name]) for i in range(2) for name in held[i])


@pytest.mark.parametrize("task_bytes", [chain_reads.TASK_BYTES, 1], ids=["blocks a task", "a tensor a task"])
def test_a_damaged_block_is_named_moved_aside_and_the_others_left_alone(tmp_path, monkeypatch, task_bytes):
    monkeypatch.setattr(chain_reads, "TASK_BYTES", task_bytes)
    store, names, _ = saved(tmp_path, kv_caches())
    path = store.block_path(names[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # one flipped bit in the block's last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(PartRejected) as failure:
        store.read_chain(names)
    assert failure.value.index == 1 and failure.value.rejected.reason is FailureReason.CORRUPT
    assert store.rejected == [(path.name, FailureReason.CORRUPT)] and not path.exists()
    assert all(store.block_path(name).exists() for name in (names[0], names[2], names[3]))


def test_a_block_file_that_holds_another_block_is_rejected_by_name(tmp_path):
    store, names, _ = saved(tmp_path, kv_caches())
    store.block_path(names[2]).write_bytes(store.block_path(names[0]).read_bytes())  # the right bytes, wrong block
    with pytest.raises(PartRejected) as failure:
        store.read_chain(names[:3])
    assert failure.value.index == 2 and failure.value.rejected.reason is FailureReason.CORRUPT
    assert [reason for _, reason in store.rejected] == [FailureReason.CORRUPT]


def test_a_missing_block_is_named_and_nothing_is_moved(tmp_path):
    store, names, _ = saved(tmp_path, kv_caches())
    store.block_path(names[3]).unlink()
    with pytest.raises(PartRejected) as failure:
        store.read_chain(names)
    assert failure.value.index == 3 and failure.value.rejected.reason is FailureReason.MISSING
    assert store.rejected == []


def test_an_io_error_is_tried_once_more_and_then_leaves_the_files_as_they_are(tmp_path, monkeypatch):
    caches = kv_caches()
    store, names, blocks = saved(tmp_path, caches)
    real, failures = file_io.read_pieces, [1]

    def failing(file, views, offset):
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(file, views, offset)
    monkeypatch.setattr(file_io, "read_pieces", failing)
    read = assemble_joined(store.read_chain(names), [KVCache(), KVCache()])  # the second try reads it all
    assert mx.array_equal(read[0].keys[..., :len(TOKENS), :], caches[0].keys[..., :len(TOKENS), :])

    failures[0] = 10 ** 6  # every read fails, the second try's too
    with pytest.raises(PartRejected) as failure:
        store.read_chain(names)
    assert failure.value.rejected.reason is FailureReason.IO_ERROR
    assert store.rejected == [] and all(store.block_path(name).exists() for name in names)


def test_a_short_read_is_never_taken_for_the_block(tmp_path, monkeypatch):
    store, names, _ = saved(tmp_path, kv_caches())
    real = file_io.read_pieces
    monkeypatch.setattr(file_io, "read_pieces", lambda file, views, offset: real(file, views[:-1], offset))
    with pytest.raises(PartRejected) as failure:
        store.read_chain(names)
    assert failure.value.rejected.reason is FailureReason.IO_ERROR and store.rejected == []


@pytest.mark.parametrize("scattered", [True, False], ids=["preadv", "no preadv"])
def test_a_scattered_read_fills_its_pieces_in_order_and_says_where_the_file_ended(tmp_path, monkeypatch, scattered):
    if not scattered:
        monkeypatch.delattr(file_io.os, "preadv", raising=False)
    path = tmp_path / "data"
    path.write_bytes(bytes(range(200)))
    pieces = [np.zeros(n, dtype=np.uint8) for n in (10, 0, 30, 5)]
    with open(path, "rb") as file:
        assert file_io.read_pieces(file, pieces, 50) == 45
        assert b"".join(piece.tobytes() for piece in pieces) == bytes(range(50, 95))
        past = [np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)]
        assert file_io.read_pieces(file, past, 190) == 10  # the file ends inside the second piece
        assert past[0].tobytes() == bytes(range(190, 198)) and past[1][:2].tobytes() == bytes((198, 199))


def test_a_device_that_refuses_the_staging_leaves_the_read_to_the_host(tmp_path, monkeypatch):
    caches = kv_caches()
    store, names, _ = saved(tmp_path, caches)
    refusing, host_reads = staged_reads.HostStaging(), []

    def copy_in(host):
        raise OSError("cuMemcpyHtoD failed with CUDA error 999")
    refusing.copy_in = copy_in
    # The process's own staging, on a device whose driver is reached but refuses the copy.
    monkeypatch.setattr(staged_reads, "cuda_staging", REAL_CUDA_STAGING)
    monkeypatch.setattr(staged_reads.device_memory, "driver", lambda: object())
    monkeypatch.setattr(staged_reads, "_staging", refusing)
    monkeypatch.setattr(staged_reads, "_refused", False)
    real = chain_reads.read_chain
    monkeypatch.setattr(chain_reads, "read_chain", lambda parts, verify=True: host_reads.append(1) or real(parts, verify))
    for _ in range(2):  # refused once: the second read goes the host's way without asking the device
        read = assemble_joined(store.read_chain(names), [KVCache(), KVCache()])
        assert mx.array_equal(read[1].values[..., :len(TOKENS), :], caches[1].values[..., :len(TOKENS), :])
    assert host_reads == [1, 1] and staged_reads.cuda_staging() is None and store.rejected == []


def test_a_staging_whose_copy_lands_elsewhere_is_refused_before_any_read(tmp_path, monkeypatch):
    class Misplacing(staged_reads.HostStaging):  # copies one byte past where it was asked
        def copy_in(self, host):
            return super().copy_in(np.concatenate([np.zeros(1, np.uint8), host[:-1]]))
    monkeypatch.setattr(staged_reads, "cuda_staging", REAL_CUDA_STAGING)
    monkeypatch.setattr(staged_reads.device_memory, "driver", lambda: object())
    monkeypatch.setattr(staged_reads, "_staging", None)
    monkeypatch.setattr(staged_reads, "_refused", False)
    monkeypatch.setattr(staged_reads, "PinnedStaging", lambda driver: Misplacing())
    assert staged_reads.cuda_staging() is None
    monkeypatch.setattr(staged_reads, "_refused", False)
    monkeypatch.setattr(staged_reads, "PinnedStaging", lambda driver: staged_reads.HostStaging())
    assert isinstance(staged_reads.cuda_staging(), staged_reads.HostStaging)  # a faithful one is taken


def test_a_store_that_restores_onto_the_device_readies_its_staging_when_it_opens(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(staged_reads, "cuda_staging", lambda: asked.append(1))
    DiskStore(tmp_path / "device", StoreIdentity("test", "none", "chain-reads"), to_device=True)
    DiskStore(tmp_path / "host", StoreIdentity("test", "none", "chain-reads"), to_device=False)
    assert asked == [1]  # once, by the store on the device: its first restore pays no pin and no window
