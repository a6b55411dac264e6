"""The shared saved-state tier on a real S3-compatible store (SeaweedFS on loopback): a block one server
saved is written once to the bucket, read by another server with its own disk directory, verified as
its own files are and restored as a recompute; a tampered or foreign object is rejected and nothing of
it kept; a store that goes away is an error the caller can count, quickly, never a crash."""

from __future__ import annotations

import pytest

pytest.importorskip("boto3", reason="the remote tier talks S3 through boto3 (the fleet extra)")

from kvstate.core.blocks import block_names  # noqa: E402
from kvstate.effects.completions import FailureReason  # noqa: E402
from kvstate.interpreters.fleet.remote_store import (  # noqa: E402
    BadRemoteUrl, RemoteStore, RemoteUnavailable, parse_remote,
)
from kvstate.interpreters.mlx.file_io import RejectedFile  # noqa: E402
from kvstate.core.replies import Source  # noqa: E402
from kvstate.models.reference import build  # noqa: E402
from tests.object_store import ObjectStore  # noqa: E402
from tests.test_mlx_block_store import SIZE, assert_recomputed, service_for, turn  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=5)


@pytest.fixture(scope="module")
def object_store(tmp_path_factory):
    store = ObjectStore(tmp_path_factory.mktemp("seaweedfs"))
    yield store
    store.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def remote_of(service, object_store, clock=None, prefix="fleet"):
    store = service.interpreter.store
    return RemoteStore(f"s3://{object_store.bucket}/{prefix}", store.identity.encoded(), endpoint_url=object_store.endpoint,
                       clock=clock or Clock(), client=object_store.client)


def test_a_block_saved_by_one_server_is_restored_by_another_from_the_bucket(llama, tmp_path, object_store):
    model, config = llama
    prompt = tuple(range(3, 3 + 3 * SIZE + 5))
    first = service_for(model, config, tmp_path / "a")
    turn(first, model, prompt)
    assert first.flush().durable
    names = block_names("n", prompt, SIZE)[:3]  # the full blocks
    remote = remote_of(first, object_store)
    assert [remote.offer(name, first.interpreter.store.saved_block_bytes(name)) for name in names] == [True] * 3
    assert [remote.offer(name, first.interpreter.store.saved_block_bytes(name)) for name in names] == [False] * 3
    first.close()
    # Another server, its own (empty) disk: the bucket's blocks become its own files once verified.
    second = service_for(model, config, tmp_path / "b")
    store = second.interpreter.store
    fetched = remote_of(second, object_store)
    assert all(fetched.holds(name) for name in names)
    for name in names:
        assert store.adopt_block(name, fetched.fetch(name)).file_bytes == store.block_path(name).stat().st_size
    second.close()
    again = service_for(model, config, tmp_path / "b")
    assert again.scan_result.kept == 3
    state, logits = turn(again, model, prompt)
    assert state.source is Source.DISK and state.reused_tokens == 3 * SIZE
    assert_recomputed(model, prompt, logits)
    again.close()


def test_a_tampered_or_foreign_object_is_rejected_and_nothing_of_it_kept(llama, tmp_path, object_store):
    model, config = llama
    prompt = tuple(range(40, 40 + SIZE + 1))
    first = service_for(model, config, tmp_path / "a")
    turn(first, model, prompt)
    assert first.flush().durable
    name = block_names("n", prompt, SIZE)[0]
    good = first.interpreter.store.saved_block_bytes(name)
    first.close()
    second = service_for(model, config, tmp_path / "b")
    store = second.interpreter.store
    tampered = bytearray(good)
    tampered[-3] ^= 0x40  # one bit of the last tensor
    other = block_names("n", tuple(range(90, 90 + SIZE)), SIZE)[0]
    for data, name_asked, reason in ((bytes(tampered), name, FailureReason.CORRUPT),
                                     (good, other, FailureReason.CORRUPT),          # another block's object
                                     (good[:-10], name, FailureReason.CORRUPT)):    # cut short
        with pytest.raises(RejectedFile) as rejected:
            store.adopt_block(name_asked, data)
        assert rejected.value.reason is reason
    other_model, other_config = build("llama", seed=6)  # another model's weights: another identity
    foreign = service_for(other_model, other_config, tmp_path / "c")
    turn(foreign, other_model, prompt)
    assert foreign.flush().durable
    with pytest.raises(RejectedFile) as rejected:
        store.adopt_block(name, foreign.interpreter.store.saved_block_bytes(name))
    assert rejected.value.reason is FailureReason.IDENTITY_MISMATCH
    foreign.close()
    assert not any(path.name.endswith(".safetensors") for path in store.directory.iterdir())
    second.close()


def test_a_store_that_is_down_fails_fast_and_is_left_alone_for_a_while(tmp_path, caplog):
    clock = Clock()
    remote = RemoteStore("s3://kvstate-fleet/x", "identity", endpoint_url="http://127.0.0.1:9", clock=clock,
                         timeout_s=1.0, back_off_s=30.0)
    name = block_names("n", tuple(range(SIZE)), SIZE)[0]
    with pytest.raises(RemoteUnavailable):
        remote.holds(name)
    calls = remote.failures
    clock.now = 29.0
    with pytest.raises(RemoteUnavailable, match="backing off"):
        remote.fetch(name)
    assert remote.failures == calls  # not asked while it backs off
    clock.now = 31.0
    with pytest.raises(RemoteUnavailable):
        remote.offer(name, b"x")
    assert remote.failures == calls + 1
    outages = [r for r in caplog.records if "shared tier" in r.getMessage()]
    assert len(outages) == 1 and "failed" in outages[0].getMessage()  # an outage is logged once


def test_remote_addresses_are_s3_urls():
    assert parse_remote("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_remote("s3://bucket") == ("bucket", "")
    for bad in ("http://bucket/x", "s3://", "s3://ab/x", "bucket/x"):
        with pytest.raises(BadRemoteUrl):
            parse_remote(bad)


@pytest.fixture
def credentials(monkeypatch):
    """The usual AWS variables, as an operator sets them (the test store takes any)."""
    for variable, value in (("AWS_ACCESS_KEY_ID", "kvstate"), ("AWS_SECRET_ACCESS_KEY", "kvstate"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(variable, value)


def test_two_services_on_one_bucket_a_conversation_continues_on_the_other(llama, tmp_path, object_store,
                                                                          credentials):
    model, config = llama
    prompt = tuple(range(3, 3 + 3 * SIZE + 5))
    shared = {"remote": f"s3://{object_store.bucket}/{tmp_path.name}", "remote_endpoint": object_store.endpoint,
              "remote_timeout_s": 60.0}  # a busy machine's store may answer slowly: not a failure here
    first = service_for(model, config, tmp_path / "a", **shared)
    turn(first, model, prompt)
    assert first.flush().durable
    assert first.report().remote_writes == 4  # its blocks (a partial last one too), written once durable
    first.close()
    second = service_for(model, config, tmp_path / "b", **shared)
    follow = prompt + (200, 201)
    assert second.remote_lookup(follow, "n")
    assert not second.reading_ahead(follow, "n")  # landed already: no writer thread in this test
    state, logits = turn(second, model, follow)
    assert state.source is Source.DISK and state.reused_tokens == len(prompt)  # its full blocks, and its partial one
    assert_recomputed(model, follow, logits)
    report = second.report()
    assert (report.remote_fetches, report.remote_blocks_read, report.remote_rejected) == (1, 4, 0)
    second.close()


def test_a_store_killed_mid_run_changes_no_answer(llama, tmp_path, credentials):
    model, config = llama
    store = ObjectStore(tmp_path / "seaweedfs")
    shared = {"remote": f"s3://{store.bucket}/killed", "remote_endpoint": store.endpoint, "remote_timeout_s": 60.0}
    try:
        first = service_for(model, config, tmp_path / "a", **shared)
        prompt = tuple(range(60, 60 + 2 * SIZE + 3))
        turn(first, model, prompt)
        assert first.flush().durable and first.report().remote_writes == 3
    finally:
        store.stop()
    second = service_for(model, config, tmp_path / "b", **shared)
    assert second.remote_lookup(prompt, "n") and not second.reading_ahead(prompt, "n")
    state, logits = turn(second, model, prompt)
    assert state.reused_tokens == 0  # nothing from the store: prefilled, the same answer
    assert_recomputed(model, prompt, logits)
    assert second.report().remote_failures >= 1
    turn(first, model, prompt + (5,) * SIZE)  # the first goes on too: its offer fails, counted
    assert first.flush().durable and first.report().remote_failures >= 1
    first.close()
    second.close()


class _Answering:
    """A fake object store on loopback that answers every request with HTTP 500, or, with ``hang``,
    accepts connections and never answers."""

    def __init__(self, hang: bool):
        import socket
        import threading
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.hang, self.held, self.closed = hang, [], threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            if self.hang:
                self.held.append(connection)  # read nothing, answer nothing
                continue
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            connection.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for connection in self.held:
            connection.close()


@pytest.mark.parametrize("hang", [False, True], ids=["answering-errors", "hanging"])
def test_a_store_that_answers_errors_or_hangs_changes_no_answer(llama, tmp_path, credentials, hang):
    model, config = llama
    fake = _Answering(hang)
    try:
        remote = RemoteStore("s3://kvstate-fleet/x", "identity", endpoint_url=fake.endpoint, clock=Clock(),
                             timeout_s=1.0)
        service = service_for(model, config, tmp_path / "a", remote=remote)
        prompt = tuple(range(20, 20 + 2 * SIZE + 3))
        assert service.remote_lookup(prompt, "n") and not service.reading_ahead(prompt, "n")
        state, logits = turn(service, model, prompt)
        assert state.reused_tokens == 0
        assert_recomputed(model, prompt, logits)
        assert service.flush().durable  # its offers fail (or back off): counted, the disk durable regardless
        report = service.report()
        assert report.remote_failures >= 1 and report.remote_blocks_read == 0 and report.remote_writes == 0
        service.close()
    finally:
        fake.close()


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), True, "5"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(llama, tmp_path, timeout):
    from kvstate.core.errors import InvalidConfig
    model, config = llama
    with pytest.raises(InvalidConfig, match="remote_timeout_s must be a positive number of seconds"):
        service_for(model, config, tmp_path / "a", remote="s3://kvstate-fleet/x", remote_timeout_s=timeout)
    service_for(model, config, tmp_path / "a").close()  # refused before anything was held: the directory is free
