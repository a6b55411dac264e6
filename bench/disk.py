"""Disk tier throughput: spill and restore of a saved entry against raw file I/O of the same bytes.

Entries have the geometry of the 8B-like catalogue model (32 layers, 8 KV heads
x 128, bf16: 128 KiB per token): 64 MB is 512 tokens, 512 MB is 4,096. In one
run, for each size:

- spill: encode + atomic commit through the disk store, against writing the
  same bytes to a file and fsyncing it;
- restore: reading the entry back into mlx-lm caches (with and without hash
  verification), against the fastest plain read of the same bytes into a buffer allocated once and
  reused (the faster of one ``readinto`` and 8 MiB ``preadv`` pieces on every core's thread); with the page cache warm (the file was just written) and dropped
  (``posix_fadvise(DONTNEED)`` on both files before each read; Linux); and against two floors
  of any restore that ends in new MLX arrays: the same read into memory allocated for it (its
  pages faulted in by the read), and the read followed by ``mx.array`` of the buffer (the one
  copy into MLX's memory);
- clone: the RAM copy ``acquire`` makes, against a numpy copy of the same bytes.

Ratios are store time / raw time (1.0 = as fast as the raw operation).

    python bench/disk.py [--sizes-mb 64,512] [--repeat 3]
    python bench/disk.py --loaders 12   # the store's two loaders against a raw read, interleaved
    python bench/disk.py [...] --keep-freed-memory   # as kvstate serve runs: freed memory kept for reuse
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvstate.effects import DiskKey
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity
from kvstate.interpreters.mlx.file_io import read_into
from kvstate.interpreters.mlx.host_memory import keep_freed_memory
from kvstate.models import model_spec

SPEC = model_spec("llama-3.1-8b")


def caches_of(tokens: int) -> list:
    layer = SPEC.layers[0]
    out = []
    for _ in SPEC.layers:
        cache = KVCache()
        keys = mx.random.normal((1, layer.kv_heads, tokens, layer.head_dim)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, keys)
        out.append(cache)
    mx.eval(mlx_caches.arrays_of(out))
    return out


def best(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


#: Threads of the parallel raw read: one a core (MLX's own file reader reads in parallel too).
READ_THREADS = max(2, os.cpu_count() or 2)
_READERS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="raw-read")


def read_whole(path: str, target: np.ndarray) -> None:
    """``path`` into ``target`` with the store's own ``readinto`` loop."""
    with open(path, "rb", buffering=0) as file:
        view = memoryview(target)
        if read_into(file, view) < len(view):
            raise OSError(f"{path}: shorter than the {len(view):,} bytes to read")


def read_parallel(path: str, target: np.ndarray, piece: int = 8 << 20) -> None:
    """``path`` into ``target`` in ``piece``-byte ``preadv`` calls on :data:`READ_THREADS` threads (each
    call lets go of the interpreter while the kernel copies)."""
    view = memoryview(target)
    fd = os.open(path, os.O_RDONLY)

    def one(start: int) -> None:
        end, done = min(start + piece, len(view)), start
        while done < end:
            count = os.preadv(fd, [view[done:end]], done)
            if count <= 0:
                raise OSError(f"{path}: short read at {done}")
            done += count
    try:
        list(_READERS.map(one, range(0, len(view), piece)))
    finally:
        os.close(fd)


def fastest_read(path: str, target: np.ndarray, repeat: int = 1) -> float:
    """Seconds of the faster plain read of ``path`` into ``target`` (a reused buffer): one ``readinto``
    loop or parallel ``preadv`` pieces, each the best of ``repeat``."""
    return min(best(lambda: read_whole(path, target), repeat), best(lambda: read_parallel(path, target), repeat))


def measure(megabytes: int, repeat: int, directory: str) -> dict[str, float]:
    tokens = megabytes * (1 << 20) // SPEC.bytes_per_token
    caches = caches_of(tokens)
    nbytes = mlx_caches.live_bytes(caches)
    store = DiskStore(directory, StoreIdentity("bench", "none", f"bench-{megabytes}"))
    quick = DiskStore(directory, StoreIdentity("bench", "none", f"bench-{megabytes}"), verify=False)
    key = DiskKey("bench", tuple(range(tokens)))
    spill = best(lambda: store.commit(store.encode_prefix(key, caches, True, nbytes)), repeat)
    raw_bytes = np.concatenate([np.asarray(mx.view(a, mx.uint8)).reshape(-1) for a in mlx_caches.arrays_of(caches)])
    raw_path = os.path.join(directory, f"raw-{megabytes}")

    def raw_write():
        with open(raw_path, "wb") as out:
            out.write(memoryview(raw_bytes))
            out.flush()
            os.fsync(out.fileno())
    write = best(raw_write, repeat)

    def restore(s):
        loaded = s.read_prefix(key)
        mx.eval(mlx_caches.arrays_of(loaded))
    verified = best(lambda: restore(store), repeat)
    unverified = best(lambda: restore(quick), repeat)

    buffer = np.empty(os.path.getsize(raw_path), dtype=np.uint8)  # allocated once, reused by every read

    single = best(lambda: read_whole(raw_path, buffer), repeat)
    parallel = best(lambda: read_parallel(raw_path, buffer), repeat)
    fastest = read_whole if single <= parallel else read_parallel
    read = min(single, parallel)

    def raw_read():
        fastest(raw_path, buffer)

    def raw_read_into_new_memory():
        fastest(raw_path, np.empty(len(buffer), dtype=np.uint8))  # what a restore's arrays are: untouched memory
    fresh_read = best(raw_read_into_new_memory, repeat)

    def raw_read_then_mlx_array():
        raw_read()
        mx.eval(mx.array(buffer))  # the one copy any restore into MLX arrays makes
    to_mlx = best(raw_read_then_mlx_array, repeat)
    saved = store.prefix_path(key)

    def dropped(call):
        def run():
            for path in (raw_path, saved):
                drop_page_cache(path)
            call()
        return run
    cold = {}
    if hasattr(os, "posix_fadvise"):
        cold = {"restore (verified, cold)": best(dropped(lambda: restore(store)), repeat),
                "raw read (cold)": min(best(dropped(lambda: read_whole(raw_path, buffer)), repeat),
                                       best(dropped(lambda: read_parallel(raw_path, buffer)), repeat))}
    clone = best(lambda: mx.eval(mlx_caches.arrays_of(mlx_caches.clone(caches, tokens))), repeat)
    copy = best(lambda: raw_bytes.copy(), repeat)
    return {"MB": nbytes / 1e6, "spill": spill, "raw write+fsync": write, "restore (verified)": verified,
            "restore (no verify)": unverified, "raw read": read, "raw read, new memory": fresh_read,
            "raw read, then mx.array": to_mlx, **cold, "clone": clone, "numpy copy": copy}


def drop_page_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (clean pages only: it was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def saved_for_each_loader(tokens: int, directory: str) -> tuple[dict, DiskKey, str]:
    """One saved entry of ``tokens`` tokens, and a store reading it through each loader."""
    from kvstate.interpreters.mlx.disk_store import LOADERS

    caches = caches_of(tokens)
    identity = StoreIdentity("bench", "none", f"loaders-{tokens}")
    stores = {loader: DiskStore(directory, identity, loader=loader) for loader in LOADERS}
    key = DiskKey("bench", tuple(range(tokens)))
    first = stores[LOADERS[0]]
    first.commit(first.encode_prefix(key, caches, True, mlx_caches.live_bytes(caches)))
    return stores, key, str(first.prefix_path(key))


def loaders(megabytes: int, rounds: int, directory: str, cold: bool) -> dict[str, float]:
    """The store's two loaders and a raw read of the same file, interleaved round by round (so the
    machine's drift falls on all three alike), verified; median milliseconds over the rounds after
    the first two (which pay fresh memory)."""
    import statistics

    stores, key, path = saved_for_each_loader(megabytes * (1 << 20) // SPEC.bytes_per_token, directory)
    buffer = np.empty(os.path.getsize(path), dtype=np.uint8)
    calls = {f"loader {loader}": (lambda s=store: mx.eval(mlx_caches.arrays_of(s.read_prefix(key))))
             for loader, store in stores.items()}
    calls["raw read"] = lambda: read_whole(path, buffer)
    calls[f"raw read, {READ_THREADS} threads"] = lambda: read_parallel(path, buffer)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if cold:
                drop_page_cache(path)
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values[2:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="64,512")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loaders", type=int, default=0, metavar="ROUNDS",
                        help="instead: the store's two loaders against a raw read, interleaved for ROUNDS rounds, "
                             "page cache warm and dropped")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="first ask the C library to keep freed memory for reuse, as kvstate serve does "
                             "(interpreters/mlx/host_memory.py)")
    args = parser.parse_args()
    if args.keep_freed_memory:
        print(f"keep_freed_memory(): {keep_freed_memory()}")
    if args.loaders:
        with tempfile.TemporaryDirectory() as directory:
            for size in args.sizes_mb.split(","):
                for cold in (False, True):
                    row = loaders(int(size), args.loaders, directory, cold)
                    print(f"{size} MB, page cache {'dropped' if cold else 'warm'}, verified, median ms: "
                          + ", ".join(f"{name} {ms:.1f}" for name, ms in row.items()), flush=True)
        return
    with tempfile.TemporaryDirectory() as directory:
        rows = [measure(int(size), args.repeat, directory) for size in args.sizes_mb.split(",")]
    print("ratios: kvstate time / raw time in the same run (lower is better; 1.0 = as fast as raw)")
    print(f"{'entry':>10} {'spill/write':>12} {'restore/read':>13} {'restore no-verify/read':>23} "
          f"{'cold restore/read':>18} {'clone/copy':>11}")
    for row in rows:
        cold = (row["restore (verified, cold)"] / row["raw read (cold)"]) if "raw read (cold)" in row else float("nan")
        print(f"{row['MB']:>8.0f}MB {row['spill'] / row['raw write+fsync']:>12.2f} "
              f"{row['restore (verified)'] / row['raw read']:>13.2f} "
              f"{row['restore (no verify)'] / row['raw read']:>23.2f} {cold:>18.2f} "
              f"{row['clone'] / row['numpy copy']:>11.2f}")
    print("the floors a restore into new MLX arrays cannot beat, as the same ratios:")
    print(f"{'entry':>10} {'restore/read into new memory':>29} {'restore/(read + mx.array)':>26}")
    for row in rows:
        print(f"{row['MB']:>8.0f}MB {row['restore (verified)'] / row['raw read, new memory']:>29.2f} "
              f"{row['restore (verified)'] / row['raw read, then mx.array']:>26.2f}")
    print("seconds:")
    for row in rows:
        print("  " + ", ".join(f"{k} {v:.3f}" if k != "MB" else f"{v:.0f} MB" for k, v in row.items()))


if __name__ == "__main__":
    main()
