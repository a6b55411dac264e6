"""A read that returns less than the file: never an escaped exception, never a wedged entry.

The file is cut while a restore reads it (after its header was judged, before its data is read), at
lengths that leave less than the 8-byte header length, part of the header, or part of the data. With
and without hash checks, the restore falls back to a recompute, the file is moved aside and counted,
and nothing stays pinned: ``reading``, ``acquiring`` and the live requests return to 0.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstate import KvCacheService, Request, Source
from kvstate.interpreters.mlx import disk_store, file_io
from kvstate.interpreters.mlx.disk_store import LOADERS, DiskStore
from kvstate.models.reference import build

PROMPT = tuple(range(1, 31))


@pytest.fixture(params=LOADERS, autouse=True)
def loader(request, monkeypatch):
    """Every test runs with each way a store reads a file (the reused buffer, MLX's own loader); MLX's
    reads go through the storage seam these tests cut (not by the open file's path, which MLX reads
    on its own)."""
    monkeypatch.setattr(disk_store, "default_loader", lambda: request.param)
    monkeypatch.setattr(file_io, "READ_BY_PATH", False)
    return request.param


def saved_service(tmp_path, verify):
    model, config = build("llama", seed=70)

    def service():
        return KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                      disk_bytes=64 << 20, verify=verify)
    first = service()
    state = first.acquire(request := Request(PROMPT, 2), "n")
    model(mx.array([list(PROMPT)]), cache=state.caches)
    first.publish(request, "n", PROMPT, state.caches)
    first.release(request)
    assert first.close().durable
    return service()


def cut_while_read(monkeypatch, keep):
    """Truncate each file the store reads right after its header is judged, to ``keep(size)`` bytes."""
    describe = DiskStore._describe

    def described_then_cut(self, path, file):
        result = describe(self, path, file)
        size = path.stat().st_size
        with open(path, "r+b") as out:
            out.truncate(keep(size))
        return result
    monkeypatch.setattr(DiskStore, "_describe", described_then_cut)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("keep", [lambda n: 0, lambda n: 5, lambda n: 7, lambda n: 40, lambda n: n - 3],
                         ids=["empty", "5-bytes", "7-bytes", "in-header", "in-data"])
def test_a_file_cut_while_restored_is_a_counted_fallback(tmp_path, monkeypatch, verify, keep):
    service = saved_service(tmp_path, verify)
    directory = service.interpreter.store.directory
    cut_while_read(monkeypatch, keep)
    request = Request(PROMPT + (3,), 2)
    state = service.acquire(request, "n")
    assert (state.source, state.reused_tokens) == (Source.FRESH, 0)
    assert service.report().rejected_files == 1 and service.report().saved_entries == 0
    assert len(service.state.reading) == 0 and len(service.state.acquiring) == 0
    assert not list(directory.glob("prefix-*.safetensors"))
    assert len(list((directory / "rejected").iterdir())) == 1
    service.release(request)
    assert service.report().live_requests == 0
    service.close()


def test_a_short_read_that_does_not_recur_restores_the_file(tmp_path, monkeypatch):
    """A read that comes back short once (a flaky device) is tried again; the valid file is kept."""
    service = saved_service(tmp_path, verify=True)
    real = file_io.read_into
    calls = []

    def short_once(file, view):
        calls.append(len(view))
        return real(file, view[:len(view) // 2] if len(calls) == 1 else view)
    monkeypatch.setattr(file_io, "read_into", short_once)
    state = service.acquire(request := Request(PROMPT + (3,), 2), "n")
    assert (state.source, state.reused_tokens) == (Source.DISK, len(PROMPT))
    assert len(calls) > 1 and calls[1] == calls[0]  # the short first read, then the file read again from its start
    assert service.report().rejected_files == 0
    service.release(request)
    service.close()


def test_an_io_error_that_recurs_leaves_a_valid_file_in_place_for_the_next_request(tmp_path, monkeypatch):
    """EIO on the read and on its retry: the request falls back and the error is counted, but an I/O
    error says nothing of the file, so it is neither moved aside nor forgotten; the next request
    restores it."""
    import errno

    service = saved_service(tmp_path, verify=True)
    directory = service.interpreter.store.directory
    real, failures = file_io.read_into, [2]

    def failing(file, view):
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(file, view)
    monkeypatch.setattr(file_io, "read_into", failing)
    state = service.acquire(request := Request(PROMPT + (3,), 2), "n")
    assert (state.source, state.reused_tokens) == (Source.FRESH, 0)
    report = service.report()
    assert report.read_errors == 1 and report.rejected_files == 0 and report.saved_entries == 1
    assert list(directory.glob("prefix-*.safetensors")) and not (directory / "rejected").exists()
    assert len(service.state.reading) == 0 and len(service.state.acquiring) == 0
    service.release(request)
    again = service.acquire(second := Request(PROMPT + (4,), 2), "n")
    assert (again.source, again.reused_tokens) == (Source.DISK, len(PROMPT))
    service.release(second)
    service.close()

