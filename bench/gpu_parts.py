"""Where a disk hit's time goes on a GPU, part by part (the figures behind bench/README.md's H200 notes).

- ``h2d``: 512 MiB of bytes from host memory to the device through each path MLX offers
  (``mx.array`` of numpy, ``mx.load`` of a safetensors file, pieces then ``concatenate``, a slice
  assignment into a device array), each timed to the end of its first GPU use.
- ``views``: 64 tensors of (1, 8, 4096, 128) bf16 (the 8B 4k geometry) built as a restore builds them
  (a dtype view of a byte buffer) and otherwise, then used as a decode step uses a KV cache.
- ``disk-hit``: the 8B geometry at 4,096 tokens; a file written by the service, then, with a freshly
  built service each time, the acquire that restores it, and the first and second forward on the
  restored caches.

- ``restore``: the disk store's two loaders (a reused host buffer, then a copy into MLX arrays; MLX's
  own safetensors loader) at the 8B geometry, 4k and 16k tokens, timed to the first GPU use of
  what they restored, beside a plain read of the same file.

- ``restore-steps``: the served restore (MLX's loader by path, moved to the device) at 16k and 32k
  tokens of the 8B geometry, step by step: MLX's read of the file into memory it allocates, the
  hash of every tensor, the move to the device with the first GPU use; beside the fastest plain
  read of the same file into a reused buffer and into memory allocated for it, and MLX allocating
  and filling as many bytes on its own (what its memory costs before any byte is read).

- ``ram-hit``: a RAM hit's caches as the generation loop takes them into its batch (``BatchKVCache.merge``),
  at the 8B geometry and 2,816 tokens: assembled from the chain's blocks of 256 (a concatenation of 11
  spans a layer), of 1,024 (3 spans) and from one span (a copy of one array a layer), and held as a
  view of one array (no copy), against stock's ``copy.deepcopy`` of one whole cache; each timed on the
  host (building the graph) and to the end of the merge's evaluation, then the prefill of 352 tokens of
  one layer's attention over the merged cache, as the first step after a hit computes it. What a hit
  costs per span a layer, apart from the bytes it copies.

- ``restore-reuse``: whether a restore's memory is reused: MLX's read of a 1.1 and a 2.1 GB file
  three times in a row, its arrays freed between reads four ways (:data:`REUSE_WAYS`), each read's time
  beside how much of MLX's buffer cache it took; with ``--keep-freed-memory``, as ``kvstate serve``
  runs (glibc keeps freed blocks for reuse).

- ``restored-step``: the first prefill step after a restart, at the 8B geometry: a conversation of
  5,666 tokens kept in blocks and written to disk, then, each time in a freshly built service (a
  restart), the acquire that restores it and the next 347 tokens on the restored caches three ways
  (a model call on them as they come; merged into a batch of one first, the merge timed apart; and
  through mlx-lm's ``BatchGenerator`` to the first generated token, as ``kvstate serve`` runs it),
  beside the same after a RAM hit on the same service, and every token through the generator with no
  cache (stock's miss): whether restored arrays cost their first step more. Then MLX's fresh device
  memory against its reused memory, and MLX's loader's arrays moved and read.

- ``generator-steps``: one long-lived ``BatchGenerator``, as a server keeps it, given alternately the
  next 347 tokens of a restored 5,666-token conversation and all 6,013 tokens with no cache (stock's
  miss), each ``next`` call timed to the first generated token: where the served path's time goes.

- ``staged-restore``: the restart's fetch of a 5,666-token conversation kept in blocks (8B geometry), in a
  freshly built service each round, alternately read into host memory and moved to the device
  (:mod:`~kvstate.interpreters.mlx.chain_reads`) and read through the pinned staging buffer onto the device
  (:mod:`~kvstate.interpreters.mlx.staged_reads`), MLX's buffer cache cleared before each as mlx-lm's
  generator clears it after each prefill chunk; each fetch timed to its arrays' first GPU read, and the next
  347 tokens' logits on both compared (the same caches either way).

    python bench/gpu_parts.py h2d|views|disk-hit|restore|restore-steps|ram-hit|restore-reuse|restored-step|generator-steps|staged-restore [--keep-freed-memory]
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from kvstate.core.blocks import BLOCK_TOKENS  # the conversations' parts keep state as kvstate serve does
from kvstate.interpreters.mlx.device_memory import on_cuda

# The parts that build models or services import bench/gpu.py, beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def h2d() -> None:
    n = 512 << 20
    host = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    mx.save_safetensors(path, {"x": mx.array(host)})
    mx.eval(mx.sum(mx.array(host[:1024])))  # kernels compiled before anything is timed

    def into_device():
        out = mx.zeros((n,), dtype=mx.uint8)
        mx.eval(out)
        out[:] = mx.array(host)
        return out

    def in_pieces(count=8):
        step = n // count
        return mx.concatenate([mx.array(host[i * step:(i + 1) * step]) for i in range(count)])
    from kvstate.interpreters.mlx.device_memory import move_to_device

    def moved():
        x = mx.array(host)
        if not move_to_device([x]):
            raise SystemExit("move_to_device: no CUDA device, or the driver refused")
        return x
    for name, make in (("mx.array(numpy)", lambda: mx.array(host)), ("mx.array(numpy) + 0", lambda: mx.array(host) + 0),
                       ("mx.array(numpy), moved in bulk", moved),
                       ("mx.load(safetensors)", lambda: mx.load(path)["x"]), ("8 pieces, concatenate", in_pieces),
                       ("zeros on device, slice-assign", into_device),
                       ("mx.array(memoryview)", lambda: mx.array(memoryview(host)))):
        for _ in range(3):
            start = time.perf_counter()
            x = make()
            mx.eval(x)
            built = time.perf_counter()
            mx.eval(mx.sum(x.view(mx.uint32)))
            used = time.perf_counter()
            print(f"{name:32} build {1e3 * (built - start):7.1f} ms, first GPU use {1e3 * (used - built):6.1f} ms, "
                  f"{n / (used - start) / 1e9:5.2f} GB/s end to end", flush=True)


def views() -> None:
    shape, count = (1, 8, 4096, 128), 64
    nbytes = int(np.prod(shape)) * 2
    host = [np.frombuffer(os.urandom(nbytes), dtype=np.uint8).copy() for _ in range(count)]
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    new = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    mx.eval(q, new)

    def use(tensors):
        out = []
        for i in range(0, count, 2):
            k, v = (mx.concatenate([t, new], axis=2) for t in (tensors[i], tensors[i + 1]))
            out.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088))
        mx.eval(out)
    builds = {"view of uint8 (as restored)": lambda: [mx.view(mx.array(h), mx.bfloat16).reshape(shape) for h in host],
              "view, then contiguous": lambda: [mx.contiguous(mx.view(mx.array(h), mx.bfloat16).reshape(shape))
                                                for h in host],
              "view, then + 0": lambda: [mx.view(mx.array(h), mx.bfloat16).reshape(shape) + 0 for h in host],
              "made on device": lambda: [mx.zeros(shape, dtype=mx.bfloat16) + i for i in range(count)]}
    for name, build in builds.items():
        for _ in range(3):
            start = time.perf_counter()
            tensors = build()
            mx.eval(tensors)
            built = time.perf_counter()
            use(tensors)
            used = time.perf_counter()
            use(tensors)
            print(f"{name:30} build {1e3 * (built - start):7.1f} ms, first use {1e3 * (used - built):7.1f} ms, "
                  f"second use {1e3 * (time.perf_counter() - used):6.1f} ms", flush=True)


def disk_hit() -> None:
    import gpu
    from kvstate import Request
    from kvstate.interpreters.mlx import caches as mlx_caches

    directory = tempfile.mkdtemp()
    gpu.writer_phase("8b", [4096], directory, 1)
    model, config = gpu.build("8b")
    prompt = gpu.prompt_of(4096, salt=4096)

    def forward(caches, token):
        start = time.perf_counter()
        mx.eval(mx.argmax(model(mx.array([[token]]), cache=caches)[0, -1]))
        return 1e3 * (time.perf_counter() - start)
    for i in range(3):
        service = gpu.service_for(model, config, directory)  # as bench/gpu.py's reader builds it
        request = Request(prompt + (50 + i,), 16)
        start = time.perf_counter()
        state = service.acquire(request, "bench")
        mx.eval(mlx_caches.arrays_of(state.caches))
        acquired = 1e3 * (time.perf_counter() - start)
        print(f"run {i}: acquire {acquired:.1f} ms ({state.source.value}, {state.reused_tokens} tokens), "
              f"first forward {forward(state.caches, 50 + i):.1f} ms, second {forward(state.caches, 60 + i):.1f} ms",
              flush=True)
        service.release(request)
        service.close()


def restore() -> None:
    """The disk store's two loaders on the 8B geometry at 4k, 16k and 32k tokens (0.5, 2.1 and 4.3 GB),
    from the page cache, each with and without moving the arrays to the device in bulk, timed to the
    end of the restored arrays' first GPU use, beside a plain read of the same file into a reused
    buffer."""
    import disk
    from kvstate.interpreters.mlx import caches as mlx_caches
    from kvstate.interpreters.mlx.disk_store import DiskStore
    from kvstate.interpreters.mlx.file_io import read_into

    directory = tempfile.mkdtemp()
    for tokens in (4096, 16384, 32768):
        stores, key, path = disk.saved_for_each_loader(tokens, directory)
        stores = {f"{loader}{', moved' if moved else ''}": DiskStore(directory, store.identity, loader=loader,
                                                                      to_device=moved)
                  for loader, store in stores.items() for moved in (False, True)}
        size = os.path.getsize(path)
        buffer = np.empty(size, dtype=np.uint8)
        mx.eval(mx.sum(mx.array(buffer[:1024]).view(mx.uint32)))  # kernels compiled before anything is timed

        def raw():
            with open(path, "rb", buffering=0) as file:
                read_into(file, memoryview(buffer))

        def used(store):
            arrays = mlx_caches.arrays_of(store.read_prefix(key))
            mx.eval([mx.sum(a.view(mx.uint16)) for a in arrays])
        timed = {f"loader {loader}": (lambda s=store: used(s)) for loader, store in stores.items()}
        timed["raw read"] = raw
        for _ in range(2):  # the first round pays fresh memory on both sides; the second is reported
            seconds = {}
            for name, call in timed.items():
                start = time.perf_counter()
                call()
                seconds[name] = time.perf_counter() - start
        os.remove(path)
        print(f"{tokens} tokens, {size / 1e9:.2f} GB: " + ", ".join(
            f"{name} {1e3 * t:.0f} ms ({size / t / 1e9:.2f} GB/s)" for name, t in seconds.items()), flush=True)


def copy_into_device_steps(host: np.ndarray) -> tuple[dict, Callable[[], None]]:
    """Steps of a restore that would not go through MLX's host memory at all: MLX arrays allocated and
    first written on the device, then the read bytes copied into them by the CUDA driver
    (``cuMemcpyHtoD``) from the reused host buffer, pageable and then registered (pinned); and what
    unregisters the buffer once the steps are done (a registration left on freed memory breaks later
    allocations)."""
    import ctypes

    from kvstate.interpreters.mlx import device_memory

    lib = ctypes.CDLL("libcuda.so.1")
    device_memory.move_to_device([mx.zeros((1,))])  # the driver's context, as restores use it
    driver = device_memory._driver
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    held: dict = {}

    def allocate():
        held["device"] = mx.zeros((host.nbytes // 4,), dtype=mx.uint32)  # written by a GPU kernel: on the device
        mx.eval(held["device"])

    def copy():
        lib.cuCtxSetCurrent(driver.context)
        target = np.frombuffer(memoryview(held["device"]), dtype=np.uint8).ctypes.data
        result = lib.cuMemcpyHtoD_v2(target, host.ctypes.data, host.nbytes)
        assert result == 0, f"cuMemcpyHtoD failed with CUDA error {result}"

    def copy_pinned() -> float:
        if not held.get("pinned"):  # registered once, as a store would its reused buffer: not timed
            lib.cuCtxSetCurrent(driver.context)
            held["pinned"] = lib.cuMemHostRegister_v2(host.ctypes.data, host.nbytes, 0) == 0
            assert held["pinned"], "cuMemHostRegister failed"
        start = time.perf_counter()
        copy()
        return time.perf_counter() - start

    def first_use():
        mx.eval(mx.sum(held["device"]))

    def unpin() -> None:
        if held.pop("pinned", False):
            lib.cuMemHostUnregister(ctypes.c_void_p(host.ctypes.data))
    return {"a. MLX allocates on the device": allocate, "b. driver copies pageable bytes in": copy,
            "c. driver copies pinned bytes in": copy_pinned, "d. first GPU use": first_use}, unpin


#: Entry lengths of ``restore-steps`` (8B geometry: 2.1 and 4.3 GB).
STEP_TOKENS = (16384, 32768)


def restore_steps() -> None:
    """The served restore's steps, each timed on its own (second of two rounds; page cache warm)."""
    import disk
    from kvstate.interpreters.mlx import caches as mlx_caches
    from kvstate.interpreters.mlx.device_memory import move_to_device
    from kvstate.interpreters.mlx.disk_store import DiskStore
    from kvstate.interpreters.mlx.framing import bytes_of, hash_all

    directory = tempfile.mkdtemp()
    for tokens in STEP_TOKENS:
        stores, key, path = disk.saved_for_each_loader(tokens, directory)
        store = DiskStore(directory, stores["mlx"].identity, loader="mlx", to_device=True)
        size = os.path.getsize(path)
        reused = np.empty(size, dtype=np.uint8)
        disk.read_whole(path, reused)
        mx.eval(mx.sum(mx.array(reused[:1024]).view(mx.uint32)))  # kernels compiled before anything is timed
        held: dict = {}

        def mlx_read():
            held["arrays"] = mx.load(path, format="safetensors", stream=mx.cpu)
            mx.eval(list(held["arrays"].values()))

        def to_device():
            arrays = list(held["arrays"].values())
            move_to_device(arrays)
            mx.eval([mx.sum(a.view(mx.uint16)) for a in arrays])

        def served():
            arrays = mlx_caches.arrays_of(store.read_prefix(key))
            mx.eval([mx.sum(a.view(mx.uint16)) for a in arrays])

        def mlx_fill():
            mx.eval(mx.full((size // 4,), 1, dtype=mx.uint32, stream=mx.cpu))
        steps = {
            "served restore": served,
            "1. MLX reads the file into its memory": mlx_read,
            "2. hash every tensor": lambda: hash_all(bytes_of(list(held["arrays"].values()))),
            "3. move to the device, first GPU use": to_device,
            "plain read into a reused buffer": lambda: disk.fastest_read(path, reused),
            "plain read into new memory": lambda: disk.read_parallel(path, np.empty(size, dtype=np.uint8)),
            "MLX allocates and fills as many bytes": mlx_fill,
        }
        release = None
        if on_cuda():  # another way there: bytes read into a pinned buffer, copied into arrays already on the device
            device_steps, release = copy_into_device_steps(reused)
            steps.update(device_steps)
        for _ in range(2):  # the first round pays fresh memory everywhere; the second is reported
            seconds = {}
            for name, call in steps.items():
                start = time.perf_counter()
                got = call()
                seconds[name] = got if isinstance(got, float) else time.perf_counter() - start
            held.clear()
            if release is not None:  # each round's pageable copy then copies from pageable memory again
                release()
        os.remove(path)
        print(f"{tokens} tokens, {size / 1e9:.2f} GB:", flush=True)
        for name, t in seconds.items():
            print(f"  {name:40} {1e3 * t:8.1f} ms {size / t / 1e9:7.2f} GB/s", flush=True)


#: How ``restore-reuse`` frees a read's arrays before the next read: a name, whether MLX's buffer
#: cache may hold every freed byte (else MLX's default limit), whether the arrays were first moved to
#: the device and used there, and whether MLX's cache is then cleared, as mlx-lm's ``BatchGenerator``
#: does after every prefill chunk.
REUSE_WAYS = (("freed", False, False, False),
              ("freed, then MLX's cache cleared", False, False, True),
              ("freed, MLX's cache up to the memory limit", True, False, False),
              ("moved, used on the device, freed, cache up to the limit", True, True, False))


#: Entry lengths of ``restore-reuse`` (8B geometry: 1.07 and 2.15 GB, either side of the 2 GiB that
#: glibc's trim threshold can be set to at most).
REUSE_TOKENS = (8192, 16384)


def restore_reuse() -> None:
    """MLX's read of a saved entry (8B geometry, each of :data:`REUSE_TOKENS`) three times in a row for
    each of :data:`REUSE_WAYS`: each read's time, and the bytes of MLX's buffer cache it took (the cache
    before the read less after: what it reused rather than allocated)."""
    import disk
    from kvstate.interpreters.mlx.device_memory import move_to_device

    directory = tempfile.mkdtemp()
    mx.eval(mx.sum(mx.zeros((1024,), dtype=mx.uint32)))  # kernels compiled before anything is timed
    default = mx.set_cache_limit(mx.get_memory_limit())
    mx.set_cache_limit(default)
    print(f"on {'CUDA' if on_cuda() else 'the CPU'}; MLX's default cache limit {default / 1e9:.2f} GB, memory "
          f"limit {mx.get_memory_limit() / 1e9:.1f} GB:", flush=True)
    for tokens in REUSE_TOKENS:
        _, _, path = disk.saved_for_each_loader(tokens, directory)
        size = os.path.getsize(path)
        disk.read_whole(path, np.empty(size, dtype=np.uint8))  # the page cache holds the file
        print(f"{tokens} tokens, {size / 1e9:.2f} GB:", flush=True)
        for way, whole_cache, on_device, cleared in REUSE_WAYS:
            mx.set_cache_limit(mx.get_memory_limit() if whole_cache else default)
            mx.clear_cache()
            for round_ in range(1, 4):
                cached = mx.get_cache_memory()
                start = time.perf_counter()
                arrays = list(mx.load(path, format="safetensors", stream=mx.cpu).values())
                mx.eval(arrays)
                seconds = time.perf_counter() - start
                took = cached - mx.get_cache_memory()
                if on_device:
                    move_to_device(arrays)
                    mx.eval([mx.sum(a.view(mx.uint16)) for a in arrays])
                del arrays
                if cleared:
                    mx.clear_cache()
                print(f"  {way:56} read {round_}: {1e3 * seconds:7.1f} ms ({size / seconds / 1e9:5.2f} GB/s), "
                      f"{took / 1e9:5.2f} GB from the cache", flush=True)
        mx.set_cache_limit(default)
        mx.clear_cache()
        os.remove(path)


def ram_hit(layers: int = 32, heads: int = 8, dim: int = 128, tokens: int = 2816, new: int = 352) -> None:
    import copy
    import statistics

    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from kvstate.interpreters.mlx import blocks as mlx_blocks
    whole = []
    for _ in range(layers):
        cache = KVCache()
        cache.update_and_fetch(*(mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16) for _ in range(2)))
        whole.append(cache)
    mx.eval([a for c in whole for a in (c.keys, c.values)])

    def chain_of(block_tokens: int) -> list:
        return [mlx_blocks.cut(whole, start, min(start + block_tokens, tokens))
                for start in range(0, tokens, block_tokens)]

    chains = {size: chain_of(size) for size in (256, 1024, tokens)}
    like = [KVCache() for _ in range(layers)]
    query = mx.random.normal((1, heads * 4, new, dim)).astype(mx.bfloat16)
    ways = {f"blocks of {size}, {len(chain)} a layer": functools.partial(mlx_blocks.assemble, chain, like)
            for size, chain in chains.items()}
    ways["one array, a view of it"] = lambda: mlx_blocks.assemble_joined(
        [{"keys": c.keys, "values": c.values} for c in whole], like, tokens=tokens)
    ways["whole, deep-copied (stock)"] = lambda: copy.deepcopy(whole)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    for _ in range(12):
        for name, make in ways.items():
            mx.synchronize()
            start = time.perf_counter()
            caches = make()
            merged = [BatchKVCache.merge([cache]) for cache in caches]
            built = time.perf_counter()
            mx.eval([a for m in merged for a in (m.keys, m.values)])
            mx.synchronize()
            ready = time.perf_counter()
            keys, values = merged[0].update_and_fetch(*(mx.random.normal((1, heads, new, dim)).astype(mx.bfloat16)
                                                        for _ in range(2)))
            mx.eval(scaled_dot_product_attention(query, keys, values, cache=merged[0], scale=dim ** -0.5, mask="causal"))
            mx.synchronize()
            times[name].append((built - start, ready - start, time.perf_counter() - ready))
            del caches, merged
    print(f"{layers} layers x {heads} heads x {dim}, bf16, {tokens} tokens, median of "
          f"{len(times[next(iter(ways))]) - 2} after 2 warm-ups:")
    for name, samples in times.items():
        host, merged, attention = (1e3 * statistics.median(s[k] for s in samples[2:]) for k in range(3))
        print(f"  {name:30} graph built {host:6.2f} ms, merged {merged:6.2f} ms, then one layer's attention over "
              f"{new} new tokens {attention:6.2f} ms", flush=True)


def saved_conversation(tokens: int, new: int, geometry: str):
    """A model of ``geometry`` with random weights, a prompt of ``tokens + new + 1`` tokens, and a
    directory where a service kept its first ``tokens`` in blocks and wrote them to disk (fingerprinting
    the weights once: every service built after it would otherwise pull them to the host)."""
    import gpu

    from kvstate import Request
    gpu.fingerprint_once()
    directory = tempfile.mkdtemp()
    model, config = gpu.build(geometry)
    prompt = gpu.prompt_of(tokens + new + 1, salt=11)
    service = gpu.service_for(model, config, directory, BLOCK_TOKENS)
    request = Request(prompt[:tokens], 16)
    state = service.acquire(request, "bench")
    gpu.prefill(model, state.caches, prompt[:tokens], chunk=2048)
    service.publish(request, "bench", prompt[:tokens], state.caches)
    service.release(request)
    assert service.close().durable
    return model, config, prompt, directory


def restored_step(tokens: int = 5666, new: int = 347, geometry: str = "8b") -> None:
    import gpu
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import BatchKVCache

    from kvstate import Request
    from kvstate.interpreters.mlx import caches as mlx_caches
    from kvstate.interpreters.mlx import device_memory

    model, config, prompt, directory = saved_conversation(tokens, new, geometry)

    def step(caches, merged: bool) -> str:
        """The step of the next ``new`` tokens; merged first into a batch of one (evaluated on its own,
        so the merge's copy into fresh memory is told apart from the step)."""
        start = time.perf_counter()
        if merged:
            caches = [BatchKVCache.merge([c]) for c in caches]
            mx.eval([a for c in caches for a in (c.keys, c.values)])
        joined = time.perf_counter()
        mx.eval(mx.argmax(model(mx.array([list(prompt[tokens:tokens + new])]), cache=caches)[0, -1]))
        done = time.perf_counter()
        return (f"{1e3 * (done - start):.1f} ms" if not merged else
                f"{1e3 * (done - start):.1f} ms (merge {1e3 * (joined - start):.1f}, step {1e3 * (done - joined):.1f})")

    def touch(caches) -> float:
        start = time.perf_counter()
        mx.eval([mx.sum(a) for a in mlx_caches.arrays_of(caches)])
        return 1e3 * (time.perf_counter() - start)
    def through_generator(caches) -> str:
        """The next ``new`` tokens through mlx-lm's ``BatchGenerator`` on ``caches``, as ``kvstate serve``
        hands them: to the first generated token."""
        start = time.perf_counter()
        generator = BatchGenerator(model, max_tokens=1, prefill_step_size=2048)
        generator.insert([list(prompt[tokens:tokens + new])], max_tokens=[1], caches=[caches])
        while not generator.next_generated():
            pass
        generator.close()
        return f"{1e3 * (time.perf_counter() - start):.1f} ms"

    modes = ("as restored", "merged into a batch", "through BatchGenerator")
    for i in range(6):
        mode = modes[i % 3]
        service = gpu.service_for(model, config, directory, BLOCK_TOKENS)
        request = Request(prompt, 16)
        start = time.perf_counter()
        state = service.acquire(request, "bench")
        mx.eval(mlx_caches.arrays_of(state.caches))
        fetched = 1e3 * (time.perf_counter() - start)
        source, reused = state.source.value, state.reused_tokens
        touched = touch(state.caches) if i >= 3 else 0.0
        run = through_generator if mode == modes[2] else functools.partial(step, merged=mode == modes[1])
        first = run(state.caches)
        service.release(request)
        state = service.acquire(request, "bench")  # a RAM hit on what the restore left
        mx.eval(mlx_caches.arrays_of(state.caches))
        resident = run(state.caches)
        service.release(request)
        service.close()
        print(f"round {i} ({mode}): fetch {fetched:.1f} ms ({source}, {reused} tokens), "
              f"first GPU read of them {touched:.1f} ms, the next {new} "
              f"tokens on the restored caches {first}, after a RAM hit {resident}", flush=True)
    for _ in range(2):  # stock's miss: every token prefilled through the same loop, no cache handed in
        start = time.perf_counter()
        generator = BatchGenerator(model, max_tokens=1, prefill_step_size=2048)
        generator.insert([list(prompt[:tokens + new])], max_tokens=[1])
        while not generator.next_generated():
            pass
        generator.close()
        print(f"all {tokens + new} tokens through BatchGenerator, no cache: "
              f"{1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
    # MLX's fresh memory against its reused memory: as many bytes as the restored caches, allocated and
    # written on the device, once after the buffer cache is emptied and once again.
    nbytes = sum(a.nbytes for a in mlx_caches.arrays_of(state.caches))
    mx.clear_cache()
    for label in ("fresh", "reused", "fresh", "reused"):
        if label == "fresh":
            mx.clear_cache()
        start = time.perf_counter()
        filled = [mx.full((a.size,), 1, a.dtype) for a in mlx_caches.arrays_of(state.caches)]
        mx.eval(filled)
        mx.synchronize()
        print(f"{nbytes / 2**20:.0f} MiB of {label} device memory written in "
              f"{1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
        del filled
    # The same bytes outside the service: arrays allocated as a chain read allocates them (MLX's loader of
    # a file object), and as a whole-prefix read does (by path), filled on the host, moved, first GPU read.
    from kvstate.interpreters.mlx import chain_reads
    layers = mlx_caches.arrays_of(state.caches)
    table = {f"{k}": ("BF16", list(a.shape)) for k, a in enumerate(layers)}
    path = os.path.join(directory, "probe.safetensors")
    mx.save_safetensors(path, {f"{k}": a for k, a in enumerate(layers)})
    for label in ("file object", "path", "file object", "path"):
        if label == "path":
            arrays = mx.load(path, format="safetensors", stream=mx.cpu)
            mx.eval(list(arrays.values()))
        else:
            arrays = chain_reads.unfilled_arrays(table)
            for a in arrays.values():
                np.asarray(mx.view(a, mx.uint8))[...] = 1
        start = time.perf_counter()
        device_memory.move_to_device(arrays.values())
        moved_at = time.perf_counter()
        mx.eval([mx.sum(a) for a in arrays.values()])
        done = time.perf_counter()
        print(f"{sum(a.nbytes for a in arrays.values()) / 2**20:.0f} MiB allocated by MLX's loader of a {label}: "
              f"move {1e3 * (moved_at - start):.1f} ms, first GPU read {1e3 * (done - moved_at):.1f} ms", flush=True)
        del arrays


def generator_steps(tokens: int = 5666, new: int = 347, geometry: str = "8b") -> None:
    """One long-lived ``BatchGenerator``, as a server keeps it: the next ``new`` tokens of a restored
    conversation, and every token of it with no cache (stock's miss), alternately; each ``next`` call
    timed to the first generated token."""
    import gpu
    from mlx_lm.generate import BatchGenerator

    from kvstate import Request
    from kvstate.interpreters.mlx import caches as mlx_caches

    model, config, prompt, directory = saved_conversation(tokens, new, geometry)
    generator = BatchGenerator(model, max_tokens=1, prefill_step_size=2048)
    for i in range(8):
        restored = i % 2 == 0
        caches, fetched = None, 0.0
        if restored:
            service = gpu.service_for(model, config, directory, BLOCK_TOKENS)
            request = Request(prompt[:tokens + new], 16)
            start = time.perf_counter()
            state = service.acquire(request, "bench")
            mx.eval(mlx_caches.arrays_of(state.caches))
            fetched, caches = 1e3 * (time.perf_counter() - start), state.caches
        start = time.perf_counter()
        if restored:
            generator.insert([list(prompt[tokens:tokens + new])], max_tokens=[1], caches=[caches])
        else:
            generator.insert([list(prompt[:tokens + new])], max_tokens=[1])
        inserted, steps = time.perf_counter(), []
        while True:
            at = time.perf_counter()
            _, generated = generator.next()
            steps.append(1e3 * (time.perf_counter() - at))
            if generated:
                break
        total = 1e3 * (time.perf_counter() - start)
        print(f"round {i} ({'restored, ' + f'fetch {fetched:.1f} ms' if restored else 'no cache'}): insert "
              f"{1e3 * (inserted - start):.1f} ms, next calls {', '.join(f'{t:.1f}' for t in steps)} ms, "
              f"to the first token {total:.1f} ms", flush=True)
        if restored:
            service.release(request)
            service.close()
    generator.close()


def staged_restore(tokens: int = 5666, new: int = 347, geometry: str = "8b") -> None:
    import gpu

    from kvstate import Request
    from kvstate.interpreters.mlx import caches as mlx_caches
    from kvstate.interpreters.mlx import staged_reads

    model, config, prompt, directory = saved_conversation(tokens, new, geometry)
    pinned, logits, spent = staged_reads.cuda_staging(), {}, {}
    print(f"pinned staging: {'yes' if pinned is not None else 'none (no CUDA device)'}", flush=True)
    if pinned is not None:  # the staging's own steps timed apart, by when each starts and ends
        marks: list[tuple[str, float, float]] = []
        for step in ("host", "window", "copy_in"):
            def marked(*args, _call=getattr(pinned, step), _step=step):
                start = time.perf_counter()
                try:
                    return _call(*args)
                finally:
                    marks.append((_step, start, time.perf_counter()))
            setattr(pinned, step, marked)
        reader = staged_reads.read_chain

        def timed_read(*args, **kwargs):
            """The chain read, split: its reads and hashes (from each window's host buffer to its copy),
            the driver's copies, the device window's memory, and the rest (the copies out of the window
            on the device)."""
            marks.clear()
            start = time.perf_counter()
            try:
                return reader(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                ready = [end for step, _, end in marks if step == "host"]  # each window's reads start here
                copies = [(begin, end) for step, begin, end in marks if step == "copy_in"]
                spent["reads and hashes"] = sum(begin - at for at, (begin, _) in zip(ready, copies))
                spent["copies"] = sum(end - begin for begin, end in copies)
                spent["windows"] = sum(end - begin for step, begin, end in marks if step == "window")
                spent["copies out and the rest"] = total - sum(spent.values())
                spent["read_chain"] = total
        staged_reads.read_chain = timed_read
    for i in range(8):
        way = "staged" if i % 2 else "host"
        staged_reads.cuda_staging = (lambda: pinned) if way == "staged" else (lambda: None)
        service = gpu.service_for(model, config, directory, BLOCK_TOKENS)
        request = Request(prompt[:tokens + new], 16)
        mx.clear_cache()
        spent.clear()
        start = time.perf_counter()
        state = service.acquire(request, "bench")
        arrays = mlx_caches.arrays_of(state.caches)
        mx.eval(arrays)
        fetched = time.perf_counter()
        mx.eval([mx.sum(a) for a in arrays])
        read = time.perf_counter()
        out = model(mx.array([list(prompt[tokens:tokens + new])]), cache=state.caches)[0, -1].astype(mx.float32)
        mx.eval(out)
        same = "" if way not in logits else f", logits the same as the last {way} round's: {mx.array_equal(out, logits[way]).item()}"
        other = "host" if way == "staged" else "staged"
        if other in logits:
            same += f", the {other} round's: {mx.allclose(out, logits[other]).item()}"
        logits[way] = out
        print(f"round {i} ({way}): fetch {1e3 * (fetched - start):.1f} ms ({state.source.value}, "
              f"{state.reused_tokens} tokens, {sum(a.nbytes for a in arrays) / 2**20:.0f} MiB), first GPU read "
              f"{1e3 * (read - fetched):.1f} ms{same}"
              + "".join(f"; {step} {1e3 * t:.1f} ms" for step, t in spent.items()), flush=True)
        service.release(request)
        service.close()
    if pinned is not None:  # the driver's copy alone, from the pinned buffer into the device's window, three times
        size = sum(a.nbytes for a in arrays)
        host = pinned.host(size)
        pinned.window(size)
        for _ in range(3):
            start = time.perf_counter()
            pinned.copy_in(host[:size])
            took = time.perf_counter() - start
            print(f"copy of {size / 2**20:.0f} MiB into the device's window: {1e3 * took:.1f} ms "
                  f"({size / took / 1e9:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    import argparse

    from kvstate.interpreters.mlx.host_memory import keep_freed_memory

    parts = {"h2d": h2d, "views": views, "disk-hit": disk_hit, "restore": restore, "restore-steps": restore_steps,
             "ram-hit": ram_hit, "restore-reuse": restore_reuse,
             "restored-step": restored_step, "generator-steps": generator_steps, "staged-restore": staged_restore}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=parts)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="first ask glibc to keep freed memory for reuse, as kvstate serve does at start")
    args = parser.parse_args()
    if args.keep_freed_memory:
        print(f"keep_freed_memory(): {keep_freed_memory()}", flush=True)
    parts[args.part]()
