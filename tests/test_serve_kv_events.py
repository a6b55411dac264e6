"""``kvstate serve --kv-events``: a router hears, in vLLM's format, which blocks a real server holds.

A real server process, the real ``openai`` client, and a ZMQ subscriber bound here (the server
connects to it, as a vLLM worker connects to a router's address); every batch is decoded with vLLM's
own struct definitions (``tests/test_kv_events.py``).
"""

from __future__ import annotations

import threading

import pytest
import zmq

from kvstate.core.blocks import BLOCK_TOKENS
from kvstate.models.model_dir import save_model_dir
from tests.test_kv_events import DECODE, AllBlocksCleared, BlockRemovedEvent, BlockStoredEvent, replayed
from tests.test_serve import SYSTEM, Server, _refusal, chat, free_port

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("fleet") / "llama", "llama", seed=3)


LONG = " ".join(f"Line {i} of the notes says the cache keeps state number {i} for later." for i in range(60))


def stores(batches, medium):
    return [event for _, batch in batches for event in batch.events
            if isinstance(event, BlockStoredEvent) and event.medium == medium]


def chains(events) -> list[dict]:
    """Stores as a router links them: each event extends the chain whose last block is its parent, or
    starts one (no parent); a chain's blocks, tokens and namespace (its extra key, None: the default)."""
    out: list[dict] = []
    for event in events:
        assert event.block_size == BLOCK_TOKENS and len(event.token_ids) == BLOCK_TOKENS * len(event.block_hashes)
        namespace = event.extra_keys[0][0] if event.extra_keys else None
        assert event.extra_keys is None or [tuple(k) for k in event.extra_keys] == [(namespace,)] * len(event.block_hashes)
        chain = next((c for c in out if event.parent_block_hash is not None and c["hashes"][-1] == event.parent_block_hash),
                     None)
        if chain is None:
            assert event.parent_block_hash is None
            chain = {"hashes": [], "tokens": [], "namespace": namespace}
            out.append(chain)
        assert chain["namespace"] == namespace
        chain["hashes"] += event.block_hashes
        chain["tokens"] += event.token_ids
    return out


class Subscriber:
    """A router's SUB socket bound here, read on a thread of its own (a ZMQ socket attaches a peer that
    connects, and sends it its subscription, only while its owner calls into it): every batch heard,
    with its sequence number, and an event set at the first."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.heard: list = []
        self.first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set() or self.socket.poll(0):
            if self.socket.poll(50):
                _, sequence, payload = self.socket.recv_multipart()
                self.heard.append((int.from_bytes(sequence, "big"), DECODE.decode(payload)))
                self.first.set()

    def close(self) -> list:
        self._stop.set()
        self._thread.join()
        self.socket.close(linger=0)
        return self.heard


def test_a_router_hears_each_tier_gain_and_lose_blocks_and_a_restart_tells_what_its_disk_holds(model_dir, tmp_path):
    disk = tmp_path / "disk"
    subscriber = Subscriber()
    replay = f"tcp://127.0.0.1:{free_port()}"
    options = ("--disk-dir", str(disk), "--disk-bytes", "256MiB", "--ram-bytes", "64MiB",
               "--kv-events", f"tcp://127.0.0.1:{subscriber.port}", "--kv-events-replay", replay)
    server = Server(model_dir, *options)
    try:
        reply = chat(server, [SYSTEM, {"role": "user", "content": LONG}])
        assert reply.usage.prompt_tokens > 2 * BLOCK_TOKENS
        salted = chat(server, [SYSTEM, {"role": "user", "content": LONG}], extra_body={"cache_salt": "tenant-a"})
        assert salted.usage.prompt_tokens_details.cached_tokens == 0
        for turn in range(100):  # until the subscription has surely reached the server: a batch heard live
            if subscriber.first.is_set():
                break
            chat(server, [SYSTEM, {"role": "user", "content": LONG + f" Turn {turn}."}])
        assert subscriber.first.is_set()
        batches = replayed(replay)  # what was published before (a router asks for what it missed)
    finally:
        assert server.stop() == 0
        heard = subscriber.close()
    assert isinstance(batches[0][1].events[0], AllBlocksCleared)
    plain, tenant = chains(stores(batches, "ram"))[:2]  # each conversation's blocks: one chain from its start
    full = (reply.usage.prompt_tokens + reply.usage.completion_tokens) // BLOCK_TOKENS
    assert full - 1 <= len(plain["hashes"]) <= full
    assert len(plain["tokens"]) == BLOCK_TOKENS * len(plain["hashes"]) and plain["namespace"] is None
    assert tenant["namespace"] is not None and "tenant-a" not in str(tenant["namespace"])  # a keyed hash
    assert tenant["tokens"][:BLOCK_TOKENS] == plain["tokens"][:BLOCK_TOKENS]  # the same tokens, another tenant:
    assert not set(tenant["hashes"]) & set(plain["hashes"])                 # other blocks
    # Live: every batch from the first heard to the clean stop, in order, none lost; with the replay
    # before it, the whole story, after which RAM holds nothing.
    numbers = [number for number, _ in heard]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] <= batches[-1][0] + 1
    story = batches + [item for item in heard if item[0] > batches[-1][0]]
    ram: set[int] = set()
    for _, batch in story:
        for event in batch.events:
            if isinstance(event, BlockStoredEvent) and event.medium == "ram":
                ram |= set(event.block_hashes)
            elif isinstance(event, BlockRemovedEvent) and event.medium == "ram":
                assert set(event.block_hashes) <= ram
                ram -= set(event.block_hashes)
    assert ram == set()  # a clean stop lets RAM's blocks go, and says so
    # Written behind: on disk too, told once each write lands, which may be after the replay was read.
    on_disk = {block for event in stores(story, "disk") for block in event.block_hashes}
    assert set(plain["hashes"]) | set(tenant["hashes"]) <= on_disk
    # A restart: the router hears the server forget, then learn what the scan found on its disk.
    again = Server(model_dir, *options[:-4], "--kv-events-replay", replay, "--kv-events", "tcp://127.0.0.1:*")
    try:
        restarted = replayed(replay)
    finally:
        again.stop()
    assert isinstance(restarted[0][1].events[0], AllBlocksCleared) and not stores(restarted, "ram")
    saved = {block for event in stores(restarted, "disk") for block in event.block_hashes}
    assert set(plain["hashes"]) | set(tenant["hashes"]) <= saved <= on_disk | {
        block for _, batch in heard for event in batch.events if isinstance(event, BlockStoredEvent)
        for block in event.block_hashes}


@pytest.mark.parametrize("arguments, says", [
    (("--kv-events", "tcp://127.0.0.1:5999", "--block-tokens", "0"), "needs state in blocks"),
    (("--kv-events-replay", "tcp://127.0.0.1:5999"), "need --kv-events ENDPOINT"),
    (("--kv-events", "127.0.0.1:5999"), "not a ZMQ endpoint"),
])
def test_kv_event_flags_that_cannot_work_are_refused_in_one_line(model_dir, arguments, says):
    result = _refusal("--model", str(model_dir), *arguments)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr
