"""What the disk tier could not do is said once in the server's log, with sizes (``disk_notices.py``):
a failed write, a write with no room, and flags that promise badly, on the MLX service with real files."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys

import mlx.core as mx

from kvstate import KvCacheService, Request
from kvstate.interpreters.serving.disk_notices import DiskNotices, default_disk_bytes, start_notices
from kvstate.models.model_dir import save_model_dir
from kvstate.models.reference import build


def full_disk(path, chunks):
    raise OSError(errno.ENOSPC, "No space left on device")


def publish(service, prompt):
    request = Request(prompt, 2)
    state = service.acquire(request, "n")
    model_out = service.interpreter.model(mx.array([list(prompt)]), cache=state.caches)
    mx.eval(model_out)
    service.publish(request, "n", prompt, state.caches)
    service.release(request)
    service.flush()


def test_a_failed_write_is_said_once_with_what_it_costs(tmp_path, caplog):
    model, config = build("llama", seed=60)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, write_file=full_disk)
    notices = DiskNotices(service, tmp_path, 64 << 20, None)
    with caplog.at_level(logging.WARNING):
        notices.check()
        assert notices.said == []                      # nothing happened yet: nothing said
        publish(service, tuple(range(1, 31)))
        notices.check()
        publish(service, tuple(range(40, 70)))
        notices.check()
    assert service.report().failed_writes >= 2
    assert len(notices.said) == 1 and "a write to the disk tier failed" in notices.said[0]
    assert "not durable" in notices.said[0] and "kvstate_failed_writes_total" in notices.said[0]
    assert [r.getMessage() for r in caplog.records if "disk tier failed" in r.getMessage()] == \
        [f"kvstate: {notices.said[0]}"]
    service.close()


def test_a_write_with_no_room_is_said_once_with_the_budget(tmp_path):
    model, config = build("llama", seed=60)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=8 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, write_queue_bytes=16)  # no spill fits the queue
    notices = DiskNotices(service, tmp_path, 64 << 20, None)
    publish(service, tuple(range(1, 31)))
    notices.check()
    publish(service, tuple(range(40, 70)))
    notices.check()
    assert service.report().dropped_writes >= 2
    assert len(notices.said) == 1 and "was not written" in notices.said[0] and "--disk-bytes 64 MiB" in notices.said[0]
    service.close()


def test_flags_that_promise_badly_are_said_at_start(tmp_path):
    available = default_disk_bytes(tmp_path) * 2
    notices = start_notices(tmp_path, available * 4, block_bytes=1 << 20)
    assert len(notices) == 1 and "more than the file system of --disk-dir can give" in notices[0]
    notices = start_notices(tmp_path, 1 << 10, block_bytes=1 << 20)
    assert len(notices) == 1 and "less than one block" in notices[0] and "1 KiB" in notices[0]
    assert start_notices(tmp_path, available // 4, block_bytes=1 << 10) == []


def test_zero_sizes_are_refused_and_a_disk_dir_alone_gets_a_default(tmp_path):
    from tests.test_serve import Server  # the serving tests' server (it needs the openai client)

    model = tmp_path / "model"
    save_model_dir(model, "llama", seed=3)
    for flag in ("--ram-bytes", "--kv-budget-bytes"):
        result = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model),
                                 flag, "0"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and f"{flag} 0 holds nothing" in result.stderr
    server = Server(model, "--disk-dir", str(tmp_path / "disk"))
    try:
        given = server.metrics()["kvstate_saved_capacity_bytes"]
        assert abs(given - default_disk_bytes(tmp_path / "disk")) < 0.01 * given  # free space moves a little
    finally:
        server.stop()
    assert "--disk-bytes not given" in server.log.read_text()
