"""Reliability: damaged files at every offset, fuzzed loader input, a full disk, every crash point,
threads on the facade, and garbage at the port. ``KVSTATE_CHECK_PROFILE=long`` widens the fuzzing."""

from __future__ import annotations

import errno
import os
import random

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from mlx_lm.models.cache import KVCache

from kvstate import (
    KvCacheService, KvStateError, Request, SimObject, SimulatedCrash, Source, model_spec,
)
from kvstate.effects import DiskKey, FailureReason
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.mlx.disk_store import DiskStore, RejectedFile, StoreIdentity
from kvstate.interpreters.mlx.framing import read_header
from kvstate.interpreters.simulator import FaultPlan, SimDisk
from kvstate.models.reference import build

LONG = os.environ.get("KVSTATE_CHECK_PROFILE", "ci") == "long"
IDENTITY = StoreIdentity("model-r", "tok-r", "cfg-r")


def small_file(tmp_path, identity=IDENTITY):
    """A saved 5-token prefix of one small KV layer: its store, key and path."""
    store = DiskStore(tmp_path, identity)
    cache = KVCache()
    keys = mx.arange(1 * 1 * 5 * 4, dtype=mx.float32).reshape(1, 1, 5, 4)
    cache.update_and_fetch(keys, keys + 1)
    key = DiskKey("n", (1, 2, 3, 4, 5))
    store.commit(store.encode_prefix(key, [cache], True, mlx_caches.live_bytes([cache])))
    return store, key, store.prefix_path(key)


def loaded_values(caches):
    return [(c.offset, c.keys[..., :c.offset, :].tolist(), c.values[..., :c.offset, :].tolist()) for c in caches]


def test_every_truncation_and_every_bit_flip_is_rejected_or_harmless(tmp_path):
    """Truncated at every offset, one bit flipped at every offset: a named rejection, never other content."""
    store, key, path = small_file(tmp_path)
    original = path.read_bytes()
    expected = loaded_values(store.read_prefix(key))
    damaged = accepted = 0
    offsets = range(len(original)) if LONG else sorted(set(range(0, len(original), 7)) | set(range(0, 64)))
    variants = [original[:n] for n in range(len(original))]
    variants += [original[:i] + bytes([original[i] ^ (1 << b)]) + original[i + 1:] for i in offsets for b in (0, 5)]
    for variant in variants:
        path.write_bytes(variant)
        try:
            restored = store.read_prefix(key)
        except RejectedFile:
            damaged += 1
            assert not path.exists()  # moved aside, not left to be read again
            continue
        accepted += 1
        assert loaded_values(restored) == expected  # e.g. a flip in JSON whitespace: the same content
    assert damaged >= len(variants) - accepted and accepted <= len(variants) // 50
    assert len(store.rejected) == damaged


@settings(max_examples=2000 if LONG else 300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=600))
def test_fuzzed_bytes_give_only_the_stores_own_error(tmp_path, data):
    store = DiskStore(tmp_path, IDENTITY)
    key = DiskKey("n", (1, 2))
    store.prefix_path(key).write_bytes(data)
    with pytest.raises(RejectedFile):
        store.read_prefix(key)
    store.prefix_path(key).write_bytes(data)
    records, _, rejected = store.scan()
    assert records == [] and rejected == 1


@settings(max_examples=1000 if LONG else 200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(length=st.integers(0, 2**64 - 1), tail=st.binary(max_size=64))
def test_a_header_length_is_checked_before_anything_is_read(tmp_path, length, tail):
    path = tmp_path / "f.safetensors"
    path.write_bytes(length.to_bytes(8, "little") + tail)
    with pytest.raises(RejectedFile):
        read_header(path)


def full_disk(path, chunks):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_fails_writes_cleanly_and_the_service_keeps_serving(tmp_path):
    model, config = build("llama", seed=60)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, write_file=full_disk)
    prompt = tuple(range(1, 31))
    state = service.acquire(request := Request(prompt, 2), "n")
    model(mx.array([list(prompt)]), cache=state.caches)
    assert service.publish(request, "n", prompt, state.caches)
    service.release(request)
    result = service.flush()
    report = service.report()
    assert not result.durable and report.failed_writes >= 1 and report.entries == 1
    assert service.acquire(Request(prompt + (1,), 2), "n").reused_tokens == 30  # the RAM copy stayed
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".safetensors"]


def device_lost(path, chunks):
    raise RuntimeError("the storage device went away")


@pytest.mark.parametrize("background", [True, False])
def test_a_write_failing_in_an_unforeseen_way_is_a_failed_write_not_a_hang(tmp_path, background):
    model, config = build("llama", seed=63)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, write_file=device_lost, background_writes=background)
    for n in range(3):
        prompt = tuple(range(n * 50 + 1, n * 50 + 31))
        state = service.acquire(request := Request(prompt, 2), "n")
        model(mx.array([list(prompt)]), cache=state.caches)
        service.publish(request, "n", prompt, state.caches)
        service.release(request)
    result = service.flush()  # returns: the writer survived every failure
    assert not result.durable and service.report().failed_writes >= 3
    assert service.acquire(Request(tuple(range(1, 31)) + (9,), 2), "n").reused_tokens == 30


def workload(service, seed):
    """Sessions over shared prefixes on the simulator, a flush halfway; returns what was published."""
    rng = random.Random(seed)
    published, flushed = [], None
    for n in range(14):
        base = tuple(range(rng.randrange(3) * 100, rng.randrange(3) * 100 + 40))
        prompt = base + tuple(rng.randrange(9) for _ in range(rng.randint(1, 30)))
        request = Request(prompt, 4)
        state = service.acquire(request, "n")
        caches = service.interpreter.prefill(state.caches, prompt[state.reused_tokens:])
        service.publish(request, "n", prompt, caches)
        published.append(prompt)
        service.release(request)
        if n == 7:
            flushed = (service.flush(), {(e.namespace, e.tokens) for e in service.state.entries.values()})
    return published, flushed


SPEC = model_spec("llama-3.2-1b")


def simulated(disk, faults):
    return KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(150), disk_bytes=SPEC.bytes_for(2000),
                                    interpreter_options={"disk": disk, "faults": faults, "deferred_writes": True})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_crash_between_every_pair_of_effects_keeps_invariant_5(seed):
    """Crash before effect k, for every k of a workload; restart on the disk; check what is found."""
    disk, faults = SimDisk(), FaultPlan()
    clean = simulated(disk, faults)
    published, _ = workload(clean, seed)
    total = clean.interpreter.stats.effects
    explored = 0
    for k in range(1, total + 1):
        disk, faults = SimDisk(), FaultPlan(crash_before_effect=k)
        service = simulated(disk, faults)
        durable_before = None
        try:
            _, flushed = workload(service, seed)
            durable_before = flushed
        except SimulatedCrash:
            pass
        explored += 1
        faults.crash_before_effect = None
        restarted = simulated(disk, faults)
        found = {(ns, t) for ns, t, _, _ in restarted.state.disk.index.items()}
        for file in disk.files.values():  # nothing claimed that was not written whole, nothing foreign
            assert file.content == file.tokens and file.tokens in published
        if durable_before is not None and durable_before[0].durable:
            assert durable_before[1] <= found  # everything flush called durable survives
        for namespace, tokens in found:  # every restore gives back exactly what was published
            state = restarted.acquire(request := Request(tokens + (0,), 1), namespace)
            assert state.source is Source.DISK and state.caches.tokens == tokens
            restarted.release(request)
    assert explored == total and total > 50


GARBAGE = [None, -1, 10**30, "text", b"bytes", 2.5, [], [1.5], [-3], {"a": 1}, object()]


@pytest.mark.parametrize("call", ["admit", "fits", "acquire", "keeps", "release", "publish", "checkpoint",
                                  "prefetch", "peek_prefix_len", "close_session", "tick", "objects.get",
                                  "objects.put"])
def test_garbage_at_every_port_call_is_a_named_error_and_changes_nothing(call):
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(300), disk_bytes=SPEC.bytes_for(3000),
                                       checkpoint_every_tokens=4)
    good = Request((1, 2, 3), 4)
    service.acquire(good, "n")
    for value in GARBAGE:
        shapes = {
            "admit": [(value,)], "fits": [(value,)], "acquire": [(value, "n"), (good, value)],
            "keeps": [(value,)], "release": [(value,), (Request((9,), 1),)],
            "publish": [(good, "n", value, good), (good, value, (1, 2, 3), good), (good, "n", (1, 2, 3), value)],
            "checkpoint": [(good, value, (1, 2, 3), 0), (good, SimObject(1, 1), value, 0)],
            "prefetch": [(value, "n"), ((1, 2), value)], "peek_prefix_len": [(value, "n"), ((1, 2), value)],
            "close_session": [(value,)], "tick": [(value,)], "objects.get": [(value,)],
            "objects.put": [(value, SimObject(1, 1)), ("k", value)],
        }[call]
        target = service.objects if call.startswith("objects.") else service
        method = getattr(target, call.split(".")[-1])
        for args in shapes:
            if isinstance(value, str) and (call in ("close_session", "objects.get")
                                           or (call in ("prefetch", "peek_prefix_len") and args[0] == (1, 2))
                                           or (call == "objects.put" and args[0] == value)):
                continue  # any such string is a valid session, namespace or object key
            if call == "tick" and isinstance(value, (int, float)) and not isinstance(value, bool):
                continue  # any number is a time
            before = service.state
            try:
                method(*args)
            except KvStateError:
                pass
            else:
                raise AssertionError(f"{call}{args!r} was accepted")
            assert service.state == before, f"{call}{args!r} changed the state"


def replaced_while_read(monkeypatch, path, replace):
    """Run ``replace()`` the first time the store reads ``path``'s header, after the file is open."""
    from kvstate.interpreters.mlx import framing
    original, done = framing.header_of, []

    def header_of(file, name):
        if name == path.name and not done:
            done.append(True)
            replace()
        return original(file, name)
    monkeypatch.setattr(framing, "header_of", header_of)
    return done


def another_version(tmp_path, key, seed):
    """A valid file for ``key`` with other content, written elsewhere: its path."""
    store = DiskStore(tmp_path / f"elsewhere-{seed}", IDENTITY)
    cache = KVCache()
    keys = mx.random.normal((1, 1, len(key.tokens), 4), key=mx.random.key(seed))
    cache.update_and_fetch(keys, keys * 2)
    store.commit(store.encode_prefix(key, [cache], True, mlx_caches.live_bytes([cache])))
    return store.prefix_path(key)


def test_a_file_replaced_mid_scan_is_judged_as_it_now_is(tmp_path, monkeypatch):
    store, key, path = small_file(tmp_path)
    valid = path.read_bytes()
    path.write_bytes(b"garbage that a newer writer is about to replace")
    newer = another_version(tmp_path, key, 1)
    replaced = replaced_while_read(monkeypatch, path, lambda: os.replace(newer, path))
    records, _, rejected = store.scan()
    assert replaced and [(r.namespace, r.tokens) for r in records] == [(key.namespace, key.tokens)] and rejected == 0
    assert path.exists() and not store.rejected_directory.exists()  # the valid newer file was not moved

    monkeypatch.undo()
    path.write_bytes(valid)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00" * 5)
    replaced_while_read(monkeypatch, path, lambda: os.replace(garbage, path))
    records, _, rejected = store.scan()
    assert records == [] and rejected == 1  # the garbage now there is what is judged
    assert [reason for _, reason in store.rejected] == [FailureReason.CORRUPT]


def test_a_file_deleted_mid_scan_is_neither_claimed_nor_counted(tmp_path, monkeypatch):
    store, key, path = small_file(tmp_path)
    deleted = replaced_while_read(monkeypatch, path, path.unlink)
    assert store.scan() == ([], [], 0) and deleted
    assert not store.rejected_directory.exists()


def test_a_file_replaced_while_restored_gives_the_opened_files_content(tmp_path, monkeypatch):
    store, key, path = small_file(tmp_path)
    first = loaded_values(store.read_prefix(key))
    newer = another_version(tmp_path, key, 2)
    expected_next = loaded_values(DiskStore(newer.parent.parent, IDENTITY).read_prefix(key))
    assert expected_next != first
    replaced = replaced_while_read(monkeypatch, path, lambda: os.replace(newer, path))
    assert loaded_values(store.read_prefix(key)) == first and replaced  # all of the opened file, none of the new one
    assert path.exists() and store.rejected == []
    assert loaded_values(store.read_prefix(key)) == expected_next


def tmpfs(directory, size):
    """Mount a real tmpfs of ``size`` at ``directory`` where this machine allows it (root); else skip, saying why."""
    import subprocess
    directory.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs."""
    yield from tmpfs(tmp_path / "tmpfs", "256k")


@pytest.fixture
def roomy_tmpfs(tmp_path):
    """A real 8 MiB tmpfs (to be remounted read-only)."""
    yield from tmpfs(tmp_path / "tmpfs", "8m")


def test_a_real_full_filesystem_fails_writes_cleanly_and_keeps_what_was_written(small_tmpfs):
    model, config = build("llama", seed=61)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, disk_dir=str(small_tmpfs),
                                     disk_bytes=64 << 20)  # the budget believes in room the device lacks
    prompts = [tuple(range(n * 16 + 1, n * 16 + 61)) for n in range(12)]  # no two share a first token
    with service:  # closed at the end, so the file system can be unmounted
        for prompt in prompts:
            request = Request(prompt, 2)
            state = service.acquire(request, "n")
            model(mx.array([list(prompt[state.reused_tokens:])]), cache=state.caches)
            service.publish(request, "n", prompt, state.caches)
            service.release(request)
        result = service.flush()
        report = service.report()
        assert not result.durable and report.failed_writes >= 1 and report.spills >= 1
        assert report.entries == len(prompts)  # every RAM copy stayed and serves
        assert service.acquire(request := Request(prompts[-1] + (1,), 2), "n").reused_tokens == 60
        service.release(request)
        files = [p for p in small_tmpfs.rglob("*") if p.is_file() and p.name.endswith(".safetensors")]
        assert files and not [p for p in files if ".tmp-" in p.name]  # no half-written file left behind
        scanned = DiskStore(small_tmpfs, service.interpreter.store.identity).scan()
        assert len(scanned[0]) == report.spills and scanned[2] == 0  # each file written whole is valid


def test_a_read_only_filesystem_still_serves_what_it_holds_and_fails_writes_cleanly(roomy_tmpfs):
    import subprocess
    model, config = build("llama", seed=62)

    def service():
        return KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, disk_dir=str(roomy_tmpfs),
                                      disk_bytes=64 << 20)

    def serve(svc, prompt):
        request = Request(prompt, 2)
        state = svc.acquire(request, "n")
        model(mx.array([list(prompt[state.reused_tokens:])]), cache=state.caches)
        svc.publish(request, "n", prompt, state.caches)
        svc.release(request)
        return state

    first = service()
    saved = [tuple(range(n * 100 + 1, n * 100 + 41)) for n in range(2)]
    for prompt in saved:
        serve(first, prompt)
    assert first.close().durable
    directory = first.interpreter.store.directory
    (directory / "prefix-0000.safetensors").write_bytes(b"not a saved file")
    (directory / ".prefix-0001.tmp-999999999-1.safetensors").write_bytes(b"half a write")
    subprocess.run(["mount", "-o", "remount,ro", str(roomy_tmpfs)], check=True)
    again = None
    try:
        again = service()  # the scan can neither move the bad file aside nor remove the temp file
        report = again.report()
        assert report.saved_entries == 2 and report.rejected_files == 1
        state = serve(again, saved[0] + (7,))
        assert (state.source, state.reused_tokens) == (Source.DISK, 40)
        serve(again, tuple(range(200, 240)))
        result = again.flush()
        assert not result.durable and again.report().failed_writes >= 1
        assert serve(again, tuple(range(200, 240)) + (1,)).reused_tokens == 40  # the RAM copy serves
    finally:
        if again is not None:
            again.close()
        subprocess.run(["mount", "-o", "remount,rw", str(roomy_tmpfs)], check=True)
