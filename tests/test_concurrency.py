"""Shared use: threads on one service (simulated and MLX), processes on one saved-state root.

The threads check content: every reuse, from RAM or disk, continues exactly as recomputing the whole
prompt would. The processes check the root budget's locks across process boundaries: a live
process's files are never evicted by another process, and its files count once it closes or dies.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvstate import KvCacheService, Request, model_spec
from kvstate.core.state import Residence
from kvstate.effects import DiskKey
from kvstate.interpreters.mlx.disk_budget import RootBudget, directory_bytes
from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity
from kvstate.models.mlx_adapter import spec_from_model
from kvstate.models.reference import build

TOLERANCE = 1e-4
SPEC = model_spec("llama-3.2-1b")


def in_threads(work, seeds) -> list[BaseException]:
    """Run ``work(seed)`` on one thread per seed, all at once; what they raised."""
    errors: list[BaseException] = []

    def guarded(seed):
        try:
            work(seed)
        except BaseException as error:  # noqa: BLE001 - returned to the test
            errors.append(error)
    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def last_logits(model, tokens, caches):
    out = model(mx.array([list(tokens)]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def test_threads_on_the_mlx_interpreter_reuse_only_what_was_published(tmp_path):
    model, config = build("llama", seed=7)
    # RAM for a few prompts only, so threads evict, spill, restore and give back while others prefill.
    two_at_once = 2 * spec_from_model(model, "llama").bytes_for(40)  # the KV budget admits two requests at a time
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=200 << 10, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, kv_budget_bytes=two_at_once)
    bases = [tuple(range(b * 40 + 1, b * 40 + 33)) for b in range(4)]
    reused: list[int] = []
    not_admitted: list[int] = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(12):
            prompt = rng.choice(bases) + tuple(rng.randrange(1, 200) for _ in range(rng.randint(1, 6)))
            request = Request(prompt, 2)
            if not service.admit(request):
                not_admitted.append(seed)
                continue
            state = service.acquire(request, "n")
            logits = last_logits(model, prompt[state.reused_tokens:], state.caches)
            expected = last_logits(model, prompt, make_prompt_cache(model))
            assert float(mx.abs(logits - expected).max()) <= TOLERANCE, (seed, state.source)
            service.publish(request, "n", prompt, state.caches)
            service.release(request)
            reused.append(state.reused_tokens)
            if rng.random() < 0.3:
                service.boundary()
            if rng.random() < 0.1:
                service.flush()

    assert in_threads(worker, range(4)) == []
    report = service.report()
    assert report.live_requests == 0 and report.projected_bytes == 0
    assert report.bytes <= report.capacity_bytes
    assert sum(1 for n in reused if n > 0) >= 12 and report.evictions + report.demotions > 0
    assert len(reused) + len(not_admitted) == 4 * 12
    assert service.flush().durable
    service.close()


def test_threads_hammering_the_facade_keep_its_invariants():
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(300), kv_budget_bytes=SPEC.bytes_for(400),
                                       disk_bytes=SPEC.bytes_for(3000))

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(150):
            prompt = tuple(range(rng.randrange(4) * 50, rng.randrange(4) * 50 + 30)) + (rng.randrange(5),)
            request = Request(prompt, 8, session_id=f"s{seed % 3}")
            if not service.admit(request):
                continue
            state = service.acquire(request, "n")
            assert state.caches.tokens == prompt[:state.reused_tokens]
            service.publish(request, "n", prompt, service.interpreter.prefill(state.caches,
                                                                              prompt[state.reused_tokens:]))
            service.release(request)
            if rng.random() < 0.1:
                service.boundary()
            if rng.random() < 0.05:
                service.flush()

    assert in_threads(worker, range(6)) == []
    report = service.report()
    assert report.projected_bytes == 0 and report.live_requests == 0
    assert report.bytes <= report.capacity_bytes
    flushed = service.flush()
    # A flush writes every RAM-only entry the disk has room for; it never evicts a durable file for one.
    room = service.state.disk.capacity - service.state.disk.bytes
    left = [e for e in service.state.entries.values() if e.residence in (Residence.RAM, Residence.SPILLING)]
    assert flushed.pending_writes == 0 and len(left) == flushed.ram_only_entries
    assert flushed.durable or all(entry.file_bytes > room for entry in left)


# A second process: a store under the shared root, live until told to close (or killed).
CHILD = textwrap.dedent("""
    import sys
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvstate.effects import DiskKey
    from kvstate.interpreters.mlx.disk_budget import RootBudget
    from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity

    root, budget_bytes, name, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    budget = RootBudget(root, budget_bytes)
    store = DiskStore(root, StoreIdentity(name, "t", "cfg-" + name), budget=budget)
    for i in range(count):
        cache = KVCache()
        keys = mx.random.normal((1, 2, 64, 32), key=mx.random.key(i)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, keys)
        store.commit(store.encode_prefix(DiskKey("n", tuple(range(i, i + 64))), [cache], True, 0))
    print(store.directory, flush=True)
    sys.stdin.readline()
    store.close()
    print("closed", flush=True)
""")


def child(root, budget, name, count):
    """Start a process holding a live store of ``count`` files under ``root``; it and its directory."""
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(budget), name, str(count)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    directory = process.stdout.readline().strip()
    assert directory, f"the child store did not start (exit {process.poll()})"
    return process, directory


def saved_files(directory):
    return sorted(p.name for p in os.scandir(directory) if p.name.endswith(".safetensors"))


def test_two_processes_share_one_root_budget_and_never_evict_each_others_live_files(tmp_path):
    root = tmp_path / "root"
    probe, probe_dir = child(tmp_path / "probe", 1 << 40, "probe", 1)
    probe.communicate("\n", timeout=60)
    one_file = directory_bytes(Path(probe_dir))
    limit = 5 * one_file + one_file // 2  # five files (names, so headers, differ by a few bytes)

    other, other_dir = child(root, limit, "other", 4)       # live in another process
    budget = RootBudget(root, limit)
    mine = DiskStore(root, StoreIdentity("mine", "t", "cfg-mine"), budget=budget)
    before = saved_files(other_dir)
    try:
        for i in range(4):
            cache = KVCache()
            keys = mx.random.normal((1, 2, 64, 32), key=mx.random.key(100 + i)).astype(mx.bfloat16)
            cache.update_and_fetch(keys, keys)
            mine.commit(mine.encode_prefix(DiskKey("n", tuple(range(i, i + 64))), [cache], True, 0))
        assert len(saved_files(mine.directory)) == 4 and budget.used_bytes() > limit
        assert budget.reclaim() == 0                          # both live, in two processes: nothing goes
        assert saved_files(other_dir) == before
        out, _ = other.communicate("\n", timeout=60)          # the other closes: its own reclaim runs there
        assert out.strip() == "closed" and other.returncode == 0
        assert budget.used_bytes() <= limit
        assert len(saved_files(mine.directory)) == 4
        assert len(saved_files(other_dir)) == 1
        assert set(saved_files(other_dir)) <= set(before)     # the newest of its own files stayed
    finally:
        if other.poll() is None:
            other.kill()
        mine.close()


def test_a_killed_process_leaves_its_files_to_the_budget(tmp_path):
    root = tmp_path / "root"
    crashed, crashed_dir = child(root, 1 << 40, "crashed", 3)
    os.kill(crashed.pid, signal.SIGKILL)                      # no close(): the kernel drops its lock
    crashed.wait(timeout=60)
    assert crashed.returncode == -signal.SIGKILL
    one_file = directory_bytes(Path(crashed_dir)) // 3
    budget = RootBudget(root, one_file)
    assert budget.reclaim() == 2 * one_file
    assert len(saved_files(crashed_dir)) == 1
