"""Two ``kvstate serve`` processes, each with its own disk directory, share one bucket on a real
S3-compatible store (SeaweedFS on loopback): a conversation begun on one continues on the other with
its prefix fetched from the bucket (``cached_tokens`` says so) and greedy output equal to stock
``mlx_lm.server``'s; a tampered object is rejected; the store killed changes no answer."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("boto3", reason="the shared tier talks S3 through boto3 (the fleet extra)")
openai = pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from kvstate.core.blocks import BLOCK_TOKENS  # noqa: E402
from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.object_store import ObjectStore  # noqa: E402
from tests.test_serve import SYSTEM, Server, chat  # noqa: E402
from tests.test_serve_kv_events import LONG  # noqa: E402

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvstate", "AWS_SECRET_ACCESS_KEY": "kvstate", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("fleet-serve") / "llama", "llama", seed=3)


def objects(store: ObjectStore, prefix: str) -> dict[str, int]:
    listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=prefix)
    return {item["Key"]: item["Size"] for item in listed.get("Contents", [])}


def wait_for_objects(store: ObjectStore, prefix: str, count: int, server: Server) -> dict[str, int]:
    """The bucket's objects under ``prefix`` once there are ``count`` (a server writes them behind its
    replies): asked again after each scrape of ``server``'s metrics, which collects its finished writes."""
    for _ in range(2000):
        found = objects(store, prefix)
        if len(found) >= count:
            return found
        server.metrics()
    raise AssertionError(f"the bucket holds {len(objects(store, prefix))} objects, not {count}")


def test_a_conversation_moves_between_servers_through_the_bucket_and_faults_change_no_answer(model_dir, tmp_path):
    store = ObjectStore(tmp_path / "seaweedfs")
    environment = {**os.environ, **CREDENTIALS}
    shared = ("--remote", f"s3://{store.bucket}/serve", "--remote-endpoint", store.endpoint, "--remote-timeout", "60",
              "--salt-key-file", str(tmp_path / "salt.key"), "--ram-bytes", "64MiB", "--disk-bytes", "256MiB")
    conversation = [SYSTEM, {"role": "user", "content": LONG}]
    servers, stock = [], None
    try:
        first = Server(model_dir, "--disk-dir", str(tmp_path / "a"), *shared, environment=environment)
        servers.append(first)
        reply = chat(first, conversation)
        full = reply.usage.prompt_tokens // BLOCK_TOKENS
        assert full >= 2
        wait_for_objects(store, "serve/", full, first)
        follow = conversation + [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": "Why?"}]
        second = Server(model_dir, "--disk-dir", str(tmp_path / "b"), *shared, environment=environment)
        servers.append(second)
        moved = chat(second, follow)
        assert moved.usage.prompt_tokens_details.cached_tokens >= full * BLOCK_TOKENS  # fetched, not prefilled
        metrics = second.metrics()
        assert metrics["kvstate_remote_blocks_read_total"] >= full and metrics["kvstate_remote_rejected_total"] == 0
        stock = Server(model_dir, stock=True)
        servers.append(stock)
        expected = chat(stock, follow).choices[0].message.content
        assert moved.choices[0].message.content == expected
        # A tampered object (one bit of its last tensor): a third server rejects it and keeps nothing of it.
        keys = sorted(objects(store, "serve/"))
        for key in keys:
            body = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
            body[-3] ^= 0x40
            store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))
        third = Server(model_dir, "--disk-dir", str(tmp_path / "c"), *shared, environment=environment)
        servers.append(third)
        answered = chat(third, follow)
        assert answered.choices[0].message.content == expected
        assert answered.usage.prompt_tokens_details.cached_tokens == 0
        metrics = third.metrics()
        assert metrics["kvstate_remote_rejected_total"] >= 1 and metrics["kvstate_remote_blocks_read_total"] == 0
        # The store killed: a fourth server fetches nothing and answers the same.
        store.stop()
        fourth = Server(model_dir, "--disk-dir", str(tmp_path / "d"), *shared, environment=environment)
        servers.append(fourth)
        assert chat(fourth, follow).choices[0].message.content == expected
        assert fourth.metrics()["kvstate_remote_failures_total"] >= 1
    finally:
        statuses = [(server, server.stop()) for server in servers]
        store.stop()
    assert all(status == 0 for server, status in statuses if server is not stock)  # stock dies of SIGTERM


@pytest.mark.parametrize("arguments, says", [
    (("--remote", "s3://kvstate-fleet/x"), "needs --disk-dir"),
    (("--remote", "http://bucket/x", "--disk-dir", "DISK"), "is not s3://BUCKET"),
    (("--remote-endpoint", "http://127.0.0.1:9"), "needs --remote"),
    (("--remote-timeout", "10"), "needs --remote"),
    (("--remote", "s3://kvstate-fleet/x", "--disk-dir", "DISK", "--remote-timeout", "0"), "positive number of seconds"),
    (("--remote", "s3://kvstate-fleet/x", "--disk-dir", "DISK", "--block-tokens", "0"), "needs state in blocks"),
])
def test_shared_tier_flags_that_cannot_work_are_refused_in_one_line(model_dir, tmp_path, arguments, says):
    from tests.test_serve import _refusal
    arguments = tuple(str(tmp_path / "disk") if a == "DISK" else a for a in arguments)
    result = _refusal("--model", str(model_dir), *arguments)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr
