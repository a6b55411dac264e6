"""The disk store on real files: round trips, atomicity, and bad files rejected, counted, moved aside."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from kvstate import KvCacheService, Request, Source
from kvstate.effects import DiskKey, FailureReason
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.mlx.device_memory import move_to_device
from kvstate.interpreters.mlx.disk_store import LOADERS, DiskStore, RejectedFile, StoreIdentity
from kvstate.interpreters.mlx.framing import read_header
from kvstate.models.reference import build

IDENTITY = StoreIdentity("model-a", "tok-a", "cfg-a")


def filled(cache, tokens, heads=2, dim=32, dtype=mx.bfloat16, step=1):
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        keys = mx.random.normal((1, heads, n, dim)).astype(dtype)
        cache.update_and_fetch(keys, keys * 2)
    return cache


def recurrent():
    cache = ArraysCache(2)
    cache[0] = mx.random.normal((1, 3, 16))
    cache[1] = mx.random.normal((1, 4, 8, 8))
    return cache


CASES = {
    "kv": lambda: [filled(KVCache(), 37), filled(KVCache(), 37)],
    "rotating-unwrapped": lambda: [filled(RotatingKVCache(max_size=64), 37)],
    "rotating-wrapped": lambda: [filled(RotatingKVCache(max_size=16), 37)],
    "quantized": lambda: [filled(QuantizedKVCache(group_size=32, bits=4), 37, dtype=mx.float16)],
    "arrays": lambda: [recurrent()],
    "cache-list": lambda: [CacheList(filled(KVCache(), 37), recurrent())],
}


def state_arrays(caches):
    out = []
    for cache in caches:
        tensors, meta = mlx_caches.codec_of(cache).save(cache)
        out.append((type(cache).__name__, meta, {k: v.tolist() for k, v in tensors.items()}))
    return out


@pytest.mark.parametrize("to_device", [False, True])
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_of_every_cache_class(case, loader, to_device, tmp_path):
    mx.random.seed(0)
    caches = CASES[case]()
    store = DiskStore(tmp_path, IDENTITY, loader=loader, to_device=to_device)
    key = DiskKey("n", tuple(range(37)))
    store.commit(store.encode_prefix(key, caches, mlx_caches.trimmable(caches), mlx_caches.live_bytes(caches)))
    loaded = store.read_prefix(key)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert state_arrays(loaded) == state_arrays(caches)
    assert mlx_caches.live_bytes(loaded) == mlx_caches.live_bytes(caches)
    records, _, rejected = store.scan()
    assert rejected == 0 and [(r.namespace, r.tokens) for r in records] == [("n", key.tokens)]


def test_restores_through_the_reused_read_buffer_never_share_it(tmp_path):
    """Every restore reads into the one host buffer the store keeps, and what it restored stays
    itself after later restores overwrite that buffer (each tensor is copied out of it)."""
    mx.random.seed(1)
    store = DiskStore(tmp_path, IDENTITY)
    originals = {}
    for length in (37, 20, 53):
        caches = [filled(KVCache(), length), filled(KVCache(), length)]
        key = DiskKey("n", tuple(range(100 * length, 100 * length + length)))
        store.commit(store.encode_prefix(key, caches, True, mlx_caches.live_bytes(caches)))
        originals[key] = state_arrays(caches)
    restored = {key: store.read_prefix(key) for key in originals}
    for _ in range(2):  # overwrite the buffer again, in another order
        for key in reversed(list(originals)):
            store.read_prefix(key)
    assert {key: state_arrays(caches) for key, caches in restored.items()} == originals


def saved(tmp_path, tokens=tuple(range(37)), loader=None):
    store = DiskStore(tmp_path, IDENTITY, loader=loader)
    caches = [filled(KVCache(), len(tokens))]
    key = DiskKey("n", tokens)
    store.commit(store.encode_prefix(key, caches, True, mlx_caches.live_bytes(caches)))
    return store, key, store.prefix_path(key)


def header_length(path):
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["tensor-bit", "header-bit", "truncated-in-header", "truncated-in-data",
                                    "empty", "garbage"])
@pytest.mark.parametrize("loader", LOADERS)
def test_damaged_files_are_rejected_and_moved_aside(damage, loader, tmp_path):
    store, key, path = saved(tmp_path, loader=loader)
    size, start = path.stat().st_size, 8 + header_length(path)
    if damage == "tensor-bit":
        flip(path, start + 100)
    elif damage == "header-bit":
        flip(path, 8 + header_length(path) // 2)
    elif damage == "truncated-in-header":
        path.write_bytes(path.read_bytes()[:start - 10])
    elif damage == "truncated-in-data":
        path.write_bytes(path.read_bytes()[:size - 7])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(b"\xff" * 64)
    with pytest.raises(RejectedFile) as rejected:
        store.read_prefix(key)
    assert rejected.value.reason in (FailureReason.CORRUPT, FailureReason.IDENTITY_MISMATCH)
    assert not path.exists()
    assert list(store.rejected_directory.iterdir())
    assert store.rejected and store.rejected[0][0] == path.name


def test_an_unknown_loader_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="loader"):
        DiskStore(tmp_path, IDENTITY, loader="mmap")


def test_a_service_with_an_unknown_loader_is_refused_before_it_claims_the_directory(tmp_path):
    from kvstate import InvalidConfig

    model, config = build("llama", seed=3)
    with pytest.raises(InvalidConfig, match="disk_loader"):
        KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                               disk_loader="mmap")
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=1 << 20, disk_loader="mlx")
    assert service.interpreter.store.loader == "mlx"
    service.close()


def test_the_loader_is_chosen_by_device(tmp_path):
    """MLX's own loader where it reads the open file by its path (Linux) or feeds a CUDA device."""
    on_cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    by_path = sys.platform.startswith("linux")
    assert DiskStore(tmp_path, IDENTITY).loader == ("mlx" if on_cuda or by_path else "buffer")


def test_restored_arrays_move_to_the_device_where_it_is_a_cuda_gpu(tmp_path):
    on_cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    assert DiskStore(tmp_path, IDENTITY).to_device is on_cuda
    arrays = [mx.arange(10), mx.zeros((0,)), mx.ones((3, 4), dtype=mx.bfloat16)]
    assert move_to_device(arrays) is on_cuda  # and where it moves nothing, it says so
    assert arrays[0].tolist() == list(range(10)) and arrays[2].tolist() == [[1.0] * 4] * 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX reads a file by its path on Linux only")
def test_mlx_reads_the_open_file_by_its_path_and_a_failed_read_there_is_an_io_error(tmp_path, monkeypatch):
    """MLX's loader reads the very file the header was checked in, by the open descriptor's path, with
    its own reader. A read that fails there (MLX's own error, struck where it reads by path) is an I/O
    error: tried once more from a fresh open, then reported; the file is neither moved aside nor
    forgotten, and restores once the reads work."""
    from kvstate.interpreters.mlx import disk_store

    store, key, path = saved(tmp_path, loader="mlx")
    real_load, read = mx.load, []

    def load(source, *args, **kwargs):
        if isinstance(source, str):
            read.append(os.path.samefile(source, path))
            if failing:
                raise RuntimeError("[read] Unable to read from file.")
        return real_load(source, *args, **kwargs)
    monkeypatch.setattr(disk_store.mx, "load", load)
    failing = True
    with pytest.raises(RejectedFile) as rejected:
        store.read_prefix(key)
    assert rejected.value.reason is FailureReason.IO_ERROR and read == [True, True]  # the read, and its retry
    assert path.exists() and not store.rejected
    failing = False
    assert mlx_caches.live_bytes(store.read_prefix(key)) > 0 and read[-1] is True


def test_a_foreign_identity_is_never_restored(tmp_path):
    store, key, path = saved(tmp_path)
    other = DiskStore(tmp_path, StoreIdentity("model-b", "tok-a", "cfg-a"))  # same directory, other weights
    assert other.directory == store.directory
    with pytest.raises(RejectedFile) as rejected:
        other.read_prefix(key)
    assert rejected.value.reason is FailureReason.IDENTITY_MISMATCH
    assert not path.exists() and other.rejected == [(path.name, FailureReason.IDENTITY_MISMATCH)]


def test_a_header_larger_than_the_file_is_refused_before_reading_it(tmp_path):
    store, key, path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(RejectedFile, match="past the file"):
        read_header(path)


def test_scan_removes_stale_temp_files_and_counts_bad_ones(tmp_path):
    store, key, path = saved(tmp_path)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead = store.directory / f".{path.stem}.tmp-{int(finished.stdout)}-1.safetensors"
    dead.write_bytes(b"half a write")  # its writer has exited
    live = store.directory / f".{path.stem}.tmp-{os.getpid()}-1.safetensors"
    live.write_bytes(b"a write in flight")  # its writer runs: the file is left alone
    (store.directory / "prefix-deadbeef.safetensors").write_bytes(b"\x00" * 3)
    records, _, rejected = store.scan()
    assert len(records) == 1 and rejected == 1
    assert sorted(p.name for p in store.directory.iterdir() if p.is_file()) == sorted([path.name, live.name])


def test_the_header_describes_live_tokens_only(tmp_path):
    store, key, path = saved(tmp_path)
    metadata, tensors = read_header(path)
    assert json.loads(metadata["kvstate.tokens"]) == list(key.tokens)
    assert tensors["0.keys"]["shape"][2] == len(key.tokens)  # not the 256-step buffer


def test_the_service_falls_back_past_a_corrupt_file(tmp_path):
    model, config = build("llama", seed=6)

    def service():
        return KvCacheService.for_mlx(model, ram_bytes=8 << 20, disk_dir=str(tmp_path), disk_bytes=64 << 20,
                                      config=config)
    first = service()
    short, long = tuple(range(1, 11)), tuple(range(1, 31))
    for prompt in (short, long):
        state = first.acquire(request := Request(prompt, 2), "n")
        model(mx.array([list(prompt[state.reused_tokens:])]), cache=state.caches)
        first.publish(request, "n", prompt, state.caches)
        first.release(request)
    assert first.close().durable
    directory = next(p for p in tmp_path.iterdir() if p.is_dir())
    target = max(directory.glob("prefix-*.safetensors"), key=lambda p: p.stat().st_size)
    flip(target, target.stat().st_size - 5)
    second = service()
    state = second.acquire(Request(long + (3,), 2), "n")
    assert (state.source, state.reused_tokens) == (Source.DISK, len(short))
    assert second.report().rejected_files == 1
    assert (directory / "rejected").exists()


def test_another_model_finds_nothing_of_the_first(tmp_path):
    first_model, first_config = build("llama", seed=7)
    other_model, other_config = build("llama", seed=8)
    first = KvCacheService.for_mlx(first_model, ram_bytes=8 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 26,
                                   config=first_config)
    prompt = tuple(range(1, 21))
    state = first.acquire(request := Request(prompt, 2), "n")
    first_model(mx.array([list(prompt)]), cache=state.caches)
    first.publish(request, "n", prompt, state.caches)
    first.release(request)
    assert first.close().durable
    other = KvCacheService.for_mlx(other_model, ram_bytes=8 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 26,
                                   config=other_config)
    assert other.report().saved_entries == 0
    assert other.acquire(Request(prompt + (1,), 2), "n").reused_tokens == 0


def test_stores_under_one_root_share_its_budget(tmp_path):
    from kvstate.interpreters.mlx.disk_budget import RootBudget, directory_bytes

    def save(store, count):
        for i in range(count):
            caches = [filled(KVCache(), 64)]
            store.commit(store.encode_prefix(DiskKey("n", tuple(range(i, i + 64))), caches, True, 0))

    probe = DiskStore(tmp_path / "probe", IDENTITY)
    save(probe, 1)
    one_file = directory_bytes(probe.directory)
    budget = RootBudget(tmp_path / "root", 5 * one_file)
    first = DiskStore(budget.root, StoreIdentity("model-a", "t", "cfg-a"), budget=budget)
    save(first, 4)
    second = DiskStore(budget.root, StoreIdentity("model-b", "t", "cfg-b"), budget=budget)
    save(second, 4)
    assert budget.used_bytes() == 8 * one_file
    assert budget.reclaim() == 0  # both live: neither is touched, whatever the total
    first.close()  # idle from here: evicted down to the budget, oldest first
    assert budget.used_bytes() <= 5 * one_file
    assert directory_bytes(second.directory) == 4 * one_file
    assert directory_bytes(first.directory) == one_file
    third = DiskStore(budget.root, StoreIdentity("model-c", "t", "cfg-c"), budget=budget)
    save(third, 1)
    second.close()
    third.close()
    assert budget.used_bytes() <= 5 * one_file


def test_a_restart_on_a_smaller_disk_budget_keeps_the_most_recently_used_files_and_counts_what_it_deletes(tmp_path):
    model, config = build("llama", seed=9)

    def service(disk_bytes):
        return KvCacheService.for_mlx(model, ram_bytes=8 << 20, disk_dir=str(tmp_path), disk_bytes=disk_bytes,
                                      config=config)
    first = service(64 << 20)
    prompts = [tuple(range(100 + 20 * i, 120 + 20 * i)) for i in range(6)]  # no prompt serves another
    for prompt in prompts:
        state = first.acquire(request := Request(prompt, 2), "n")
        model(mx.array([list(prompt)]), cache=state.caches)
        first.publish(request, "n", prompt, state.caches)
        first.release(request)
    assert first.close().durable
    store = first.interpreter.store
    paths = [store.prefix_path(DiskKey("n", prompt)) for prompt in prompts]
    sizes = {path.stat().st_size for path in paths}
    assert len(sizes) == 1
    one_file = sizes.pop()
    for age, path in enumerate(paths):  # written an hour apart, prompts[0] the oldest
        os.utime(path, (1e9 + 3600 * age, 1e9 + 3600 * age))

    second = service(64 << 20)  # a restore is a use: it makes prompts[1] the most recently used file
    state = second.acquire(Request(prompts[1] + (7,), 2), "n")
    assert (state.source, state.reused_tokens) == (Source.DISK, len(prompts[1]))
    second.close()

    third = service(3 * one_file + one_file // 2)
    assert third.report().disk_evictions == 3 and third.report().saved_entries == 3
    third.close()  # deletions run in order on the writer: settled by the close
    kept = {prompt for prompt in prompts if store.prefix_path(DiskKey("n", prompt)).exists()}
    assert kept == {prompts[1], prompts[4], prompts[5]}
    result = third.scan_result
    assert (result.kept, result.deleted, result.deleted_bytes, result.kept_bytes) == (3, 3, 3 * one_file,
                                                                                       3 * one_file)
