"""Checks aimed at the plausible mistakes a reviewer would make, one field or one step at a time:
which checkpoint a resume uses, which identity fields refuse a file, which namespaces share state."""

from __future__ import annotations

import unicodedata

import attrs
import mlx.core as mx
import pytest

from kvstate import Continuation, KvCacheService, Request, Source, model_spec
from kvstate.effects import FailureReason
from kvstate.interpreters.mlx import disk_store, file_io
from kvstate.interpreters.mlx.disk_store import DiskStore, RejectedFile, StoreIdentity
from kvstate.interpreters.simulator import FaultPlan, SimDisk
from kvstate.models.reference import build
from tests.test_reliability import small_file

SPEC = model_spec("llama-3.2-1b")


# ---------------------------------------------------------------- checkpoints


def test_a_resume_uses_the_last_durable_checkpoint_after_a_later_write_failed():
    disk, faults = SimDisk(), FaultPlan(fail_writes={2})  # the second checkpoint write fails
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(250), disk_bytes=SPEC.bytes_for(2000),
                                       checkpoint_every_tokens=2, write_behind=False,
                                       interpreter_options={"disk": disk, "faults": faults})
    prompt = tuple(range(10))
    request = Request(prompt, 20, continuation=Continuation("g", seed=1))
    caches = service.interpreter.prefill(service.acquire(request, "n").caches, prompt + (50, 51))
    assert service.checkpoint(request, caches, caches.tokens, generated_tokens=2)
    later = service.interpreter.prefill(caches, (52, 53))
    assert service.checkpoint(request, later, later.tokens, generated_tokens=4)
    assert service.report().failed_writes == 1
    service.release(request, completed=False)
    resumed = service.acquire(Request(prompt, 20, continuation=Continuation("g", seed=1)), "n")
    assert resumed.source is Source.CHECKPOINT
    assert resumed.resumed_tokens == prompt + (50, 51) and resumed.resumed.generated_tokens == 2


def test_on_mlx_a_resume_uses_the_last_durable_checkpoint_after_a_later_write_failed(tmp_path):
    model, config = build("llama", seed=91)
    writes = []

    def second_write_fails(path, chunks):
        writes.append(path.name)
        if len(writes) == 2:
            raise OSError(5, "Input/output error")
        file_io.write_durably(path, chunks)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, checkpoint_every_tokens=1, write_behind=False,
                                     background_writes=False, write_file=second_write_fails)
    prompt = tuple(range(1, 11))
    request = Request(prompt, 20, continuation=Continuation("g", seed=1))
    state = service.acquire(request, "n")
    model(mx.array([list(prompt) + [7, 8]]), cache=state.caches)
    assert service.checkpoint(request, state.caches, prompt + (7, 8), generated_tokens=2)
    model(mx.array([[9, 10]]), cache=state.caches)
    assert service.checkpoint(request, state.caches, prompt + (7, 8, 9, 10), generated_tokens=4)
    assert service.report().failed_writes == 1
    service.release(request, completed=False)
    resumed = service.acquire(Request(prompt, 20, continuation=Continuation("g", seed=1)), "n")
    assert resumed.source is Source.CHECKPOINT and resumed.resumed_tokens == prompt + (7, 8)
    assert all(c.offset == len(prompt) + 2 for c in resumed.caches)


# ---------------------------------------------------------------- identity, one field at a time


def saved_file(tmp_path, identity):
    return small_file(tmp_path, identity)[1]


BASE = StoreIdentity("model-a", "tok-a", "cfg-a")


@pytest.mark.parametrize("field", ["model_fingerprint", "tokenizer_hash"])
def test_a_file_is_refused_when_any_one_identity_field_differs(tmp_path, field):
    key = saved_file(tmp_path, BASE)
    other = DiskStore(tmp_path, attrs.evolve(BASE, **{field: "changed"}))  # the same directory, one field off
    assert other.directory == DiskStore(tmp_path, BASE).directory
    with pytest.raises(RejectedFile) as refused:
        other.read_prefix(key)
    assert refused.value.reason is FailureReason.IDENTITY_MISMATCH


def test_another_config_or_geometry_reads_another_directory(tmp_path):
    """The config fingerprint (weights and geometry, dtype included) names the directory itself."""
    key = saved_file(tmp_path, BASE)
    other = DiskStore(tmp_path, StoreIdentity("model-a", "tok-a", "cfg-b"))
    assert other.directory != DiskStore(tmp_path, BASE).directory
    assert other.scan() == ([], [], 0)
    with pytest.raises(RejectedFile) as refused:
        other.read_prefix(key)
    assert refused.value.reason is FailureReason.MISSING


def test_a_file_of_another_format_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_store, "FORMAT_VERSION", "0")
    key = saved_file(tmp_path, BASE)
    monkeypatch.undo()
    with pytest.raises(RejectedFile) as refused:
        DiskStore(tmp_path, BASE).read_prefix(key)
    assert refused.value.reason is FailureReason.IDENTITY_MISMATCH


def test_a_service_of_another_dtype_finds_nothing_of_the_first(tmp_path):
    for dtype, finds in ((mx.float32, True), (mx.bfloat16, False)):
        model, config = build("llama", seed=92, dtype=dtype)
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                         disk_bytes=64 << 20)
        if dtype is mx.float32:
            prompt = tuple(range(1, 21))
            state = service.acquire(request := Request(prompt, 2), "n")
            model(mx.array([list(prompt)]), cache=state.caches)
            service.publish(request, "n", prompt, state.caches)
            service.release(request)
            assert service.close().durable
        else:
            assert service.report().saved_entries == 0
            service.close()


# ---------------------------------------------------------------- namespaces


@pytest.mark.parametrize("other", ["Tenant-A", "tenant-a ", " tenant-a",
                                   unicodedata.normalize("NFD", "ténant-a"), "tenant-a\u200b"])
def test_names_that_differ_only_in_case_form_or_whitespace_never_share_state(other):
    """The documented rule: a namespace is its exact string; no folding of any kind."""
    name = "tenant-a" if "é" not in unicodedata.normalize("NFC", other) else unicodedata.normalize("NFC", "ténant-a")
    service = KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(500))
    prompt = tuple(range(100))
    request = Request(prompt, 2)
    service.publish(request, name, prompt, service.interpreter.prefill(service.acquire(request, name).caches,
                                                                       prompt))
    service.release(request)
    assert other != name
    assert service.acquire(Request(prompt + (1,), 2), other).reused_tokens == 0
    assert service.acquire(Request(prompt + (1,), 2), name).reused_tokens == 100
