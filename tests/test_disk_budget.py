"""The shared root budget while other live stores delete their own files under it.

A live store deletes evicted files without the root lock, so between a listing of the root and a
look at one file, that file may be gone. These tests make that interleaving happen on real files:
the listing is taken, then another store's file is deleted, then the budget looks.
"""

from __future__ import annotations

import fcntl
import os

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvstate.core.state import ON_DISK
from kvstate.effects import DiskKey, FailureReason
from kvstate.interpreters.mlx.disk_budget import LIVE, ROOT_LOCK, RootBudget, directory_bytes
from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity


def save(store, count, start=0):
    for i in range(start, start + count):
        cache = KVCache()
        keys = mx.random.normal((1, 2, 16, 8), key=mx.random.key(i)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, keys)
        store.commit(store.encode_prefix(DiskKey("n", tuple(range(i, i + 16))), [cache], True, 0))


class DeletedAfterListing:
    """``os.scandir`` as another live store sees it race: each listing of ``directory`` is taken
    whole, then one of its saved files is deleted before the caller looks at the entries."""

    def __init__(self, directory):
        self.directory = str(directory)
        self.deleted = []
        self._scandir = os.scandir

    def __call__(self, path="."):
        entries = list(self._scandir(path))
        if os.path.abspath(path) == os.path.abspath(self.directory):
            victims = [e for e in entries if e.name.endswith(".safetensors") and not e.name.startswith(".")]
            if victims:
                os.unlink(victims[0].path)
                self.deleted.append(victims[0].name)
        return _Listing(entries)


class _Listing(list):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_file_deleted_after_the_listing_counts_nothing_and_is_no_error(tmp_path, monkeypatch):
    root = tmp_path / "root"
    budget = RootBudget(root, 1 << 40)
    live = DiskStore(root, StoreIdentity("live", "t", "cfg-live"), budget=budget)
    save(live, 3)
    sizes = {p.name: p.stat().st_size for p in live.directory.glob("*.safetensors")}
    race = DeletedAfterListing(live.directory)
    monkeypatch.setattr(os, "scandir", race)
    assert directory_bytes(live.directory) == sum(sizes.values()) - sizes[race.deleted[0]]
    assert budget.used_bytes() == sum(sizes[name] for name in sizes if name not in race.deleted)
    assert budget.reclaim() == 0
    assert len(race.deleted) == 3


@pytest.mark.parametrize("when", ["start", "close"])
def test_a_start_or_close_survives_another_stores_deletes(tmp_path, monkeypatch, when):
    """Another live store deletes its files while this one starts or closes (and reclaims)."""
    root = tmp_path / "root"
    other_budget = RootBudget(root, 1 << 40)
    other = DiskStore(root, StoreIdentity("other", "t", "cfg-other"), budget=other_budget)
    save(other, 6)
    idle = DiskStore(root, StoreIdentity("idle", "t", "cfg-idle"))
    save(idle, 4, start=100)
    one_file = directory_bytes(idle.directory) // 4
    budget = RootBudget(root, 8 * one_file)  # over: the idle directory's oldest files must go
    race = DeletedAfterListing(other.directory)
    if when == "start":
        monkeypatch.setattr(os, "scandir", race)
    mine = DiskStore(root, StoreIdentity("mine", "t", "cfg-mine"), budget=budget)
    save(mine, 1, start=200)
    monkeypatch.setattr(os, "scandir", race)
    mine.close()
    monkeypatch.undo()
    assert race.deleted
    assert budget.used_bytes() <= budget.max_bytes
    assert len(os.listdir(other.directory)) > 1  # the live one lost only what it deleted itself
    other.close()


def test_a_failed_start_leaves_no_live_lock_behind(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / ROOT_LOCK).mkdir()  # the root lock cannot be opened: reclaim fails at start
    budget = RootBudget(root, 1 << 20)
    identity = StoreIdentity("m", "t", "cfg-m")
    with pytest.raises(OSError):
        DiskStore(root, identity, budget=budget)
    lock = os.open(root / identity.config_fingerprint / LIVE, os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # idle: nobody holds it any more
    finally:
        os.close(lock)


# ---------------------------------------------------------------- one unit: the bytes a file takes


def directory_files_bytes(directory):
    """Every file in a store's directory, temp files included, as the file system counts their sizes."""
    return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file() and e.name.endswith(".safetensors"))


@pytest.mark.parametrize(("prompt_tokens", "limit"), [(4, 16_384), (100, 262_144)])
def test_what_flush_called_durable_survives_close_and_restart_under_one_budget(tmp_path, prompt_tokens, limit):
    """Eight prompts, more than fit, with the service's disk budget and the root budget both ``limit``:
    the service charges each file its real size (header included), so what it holds durable after a
    flush fits the root too, and close's reclaim deletes none of it."""
    from kvstate import KvCacheService, Request
    from kvstate.models.reference import build

    model, config = build("llama", seed=71)

    def service():
        return KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, disk_dir=str(tmp_path),
                                      disk_bytes=limit, root_budget=RootBudget(tmp_path, limit))
    first = service()
    prompts = [tuple((7 * n + i) % 255 + 1 for i in range(prompt_tokens)) for n in range(8)]  # ids < vocab
    for prompt in prompts:
        state = first.acquire(request := Request(prompt, 2), "n")
        model(mx.array([list(prompt)]), cache=state.caches)
        first.publish(request, "n", prompt, state.caches)
        first.release(request)
    first.flush()
    report = first.report()
    directory = first.interpreter.store.directory
    assert report.disk_bytes == report.saved_bytes == directory_files_bytes(directory) <= limit
    durable = {(e.namespace, e.tokens) for e in first.state.entries.values() if e.residence in ON_DISK}
    assert 0 < len(durable) == report.saved_entries < len(prompts)  # the budget holds some, not all
    assert set(first.saved_prefixes()) == durable
    first.close()
    assert directory_files_bytes(directory) <= limit
    second = service()
    assert set(second.saved_prefixes()) == durable  # nothing reported durable was deleted
    assert second.report().saved_entries == len(durable)
    second.close()


def test_checkpoint_files_count_against_the_disk_budget(tmp_path):
    from kvstate import Continuation, KvCacheService, Request
    from kvstate.models.reference import build

    model, config = build("llama", seed=72)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=1 << 20, checkpoint_every_tokens=1, background_writes=False)
    prompt = tuple(range(1, 21))
    request = Request(prompt, 8, continuation=Continuation("g", seed=1))
    state = service.acquire(request, "n")
    model(mx.array([list(prompt)]), cache=state.caches)
    assert service.checkpoint(request, state.caches, prompt, 0)
    report = service.report()
    directory = service.interpreter.store.directory
    assert report.checkpoint_bytes == report.disk_bytes == directory_files_bytes(directory) > 0
    service.release(request, completed=True)
    assert service.report().disk_bytes == directory_files_bytes(directory) == 0
    service.close()


def test_saved_state_is_owner_only(tmp_path):
    """Saved KV state reveals the prompts it was computed from: directories 0700, files 0600."""
    root = tmp_path / "root"
    store = DiskStore(root, StoreIdentity("m", "t", "cfg-m"), budget=RootBudget(root, 1 << 30))
    save(store, 1)
    store.move_aside(next(store.directory.glob("*.safetensors")), FailureReason.CORRUPT)
    save(store, 1, start=50)
    for directory in (root, store.directory, store.rejected_directory):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    for file in [*store.directory.glob("*.safetensors"), *store.rejected_directory.iterdir(),
                 store.directory / LIVE]:
        assert file.stat().st_mode & 0o777 == 0o600, file
    store.close()


def test_listing_saved_prefixes_changes_nothing(tmp_path):
    """saved_prefixes() only looks: a bad file stays where it is, a temp file stays, nothing is counted."""
    store = DiskStore(tmp_path, StoreIdentity("m", "t", "cfg-m"))
    save(store, 2)
    (store.directory / "prefix-bad.safetensors").write_bytes(b"garbage")
    (store.directory / ".prefix-x.tmp-1-1.safetensors").write_bytes(b"half")
    before = sorted(p.name for p in store.directory.iterdir())
    assert len(store.saved_prefixes()) == 2
    assert sorted(p.name for p in store.directory.iterdir()) == before and store.rejected == []


def test_rejected_files_are_bounded_newest_kept(tmp_path):
    """``rejected/`` is outside every budget: it keeps the newest few files for inspection, no more."""
    import time

    store = DiskStore(tmp_path, StoreIdentity("m", "t", "cfg-m"), rejected_keep=3)
    for n in range(6):
        bad = store.directory / f"prefix-bad{n}.safetensors"
        bad.write_bytes(b"garbage")
        os.utime(bad, (time.time() + n, time.time() + n))
        store.move_aside(bad, FailureReason.CORRUPT)
    kept = sorted(p.name for p in store.rejected_directory.iterdir())
    assert kept == [f"prefix-bad{n}.safetensors.corrupt" for n in (3, 4, 5)]
    assert len(store.rejected) == 6  # all six were rejected and counted
    assert store.rejected_held == (3, 3 * len(b"garbage"))  # what rejected/ holds now


def test_the_report_counts_the_rejected_files_held_aside_and_a_restart_finds_them(tmp_path):
    from kvstate import KvCacheService
    from kvstate.models.reference import build

    model, config = build("llama", seed=0)
    with KvCacheService.for_mlx(model, config=config, name="m", ram_bytes=1 << 26, disk_dir=tmp_path,
                               disk_bytes=1 << 26) as service:
        assert (service.report().rejected_held_files, service.report().rejected_held_bytes) == (0, 0)
        directory = service._interpreter.store.directory
    (directory / "prefix-bad.safetensors").write_bytes(b"not a safetensors file")
    with KvCacheService.for_mlx(model, config=config, name="m", ram_bytes=1 << 26, disk_dir=tmp_path,
                               disk_bytes=1 << 26) as service:
        report = service.report()
        assert report.rejected_files == 1
        assert (report.rejected_held_files, report.rejected_held_bytes) == (1, len(b"not a safetensors file"))


def test_a_reclaim_of_the_root_deletes_the_least_recently_used_files_first_across_idle_directories(tmp_path):
    """Files of two idle directories, each used at a known time: a reclaim to fit the root deletes
    them oldest first, whatever directory holds them, and no more than it must."""
    from kvstate.interpreters.mlx.disk_budget import RootBudget

    budget = RootBudget(tmp_path, max_bytes=3 * 1000)
    used_at = {("a", "x.safetensors"): 100, ("b", "y.safetensors"): 200, ("a", "z.safetensors"): 300,
               ("b", "w.safetensors"): 400, ("a", "v.safetensors"): 500}
    for (directory, name), when in used_at.items():
        path = tmp_path / directory / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"\0" * 1000)
        os.utime(path, (when, when))
    assert budget.reclaim() == 2 * 1000
    left = sorted((p.parent.name, p.name) for p in tmp_path.rglob("*.safetensors"))
    assert left == [("a", "v.safetensors"), ("a", "z.safetensors"), ("b", "w.safetensors")]  # x and y, the oldest, went
