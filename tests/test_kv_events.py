"""KV events on the wire: what a router reads of a server, held to vLLM's format as its source defines it.

The structs below are vLLM's KV-event definitions (``vllm/distributed/kv_events.py``, the releases
NVIDIA Dynamo's router reads: msgspec structs with ``array_like=True``), written out here because vLLM
does not install without a GPU stack. Decoding with them is strict: a field out of place fails.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvstate import KvCacheService
from kvstate.core.blocks import block_names
from kvstate.core.request import Request
from kvstate.effects.effects import BlockStored
from kvstate.interpreters.fleet.kv_events import KvEventPublisher, external_hash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredEvent(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None


class BlockRemovedEvent(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStoredEvent | BlockRemovedEvent | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)
BLOCK = 4


def replayed(address: str, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher kept from sequence number ``start``, asked of its replay socket as
    vLLM's subscriber asks (a DEALER's request of the start, answered until the end marker)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(address)
    try:
        socket.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            _, sequence, payload = socket.recv_multipart()
            number = int.from_bytes(sequence, "big", signed=True)
            if number == -1:
                return out
            out.append((number, DECODE.decode(payload)))
    finally:
        socket.close(linger=0)


class Router:
    """What a router knows of one server from decoded events: each medium's block hashes, with the
    tokens each covers; a store extends a chain the router already knows (or starts one)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, tuple]] = {}

    def read(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.held = {}
            elif isinstance(event, BlockStoredEvent):
                tier = self.held.setdefault(event.medium, {})
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                assert event.extra_keys is None or len(event.extra_keys) == len(event.block_hashes)
                for at, block in enumerate(event.block_hashes):
                    assert block not in tier
                    tier[block] = tuple(event.token_ids[at * BLOCK:(at + 1) * BLOCK])
            else:
                tier = self.held.setdefault(event.medium, {})
                for block in event.block_hashes:
                    assert tier.pop(block, None) is not None


def direct_view(told: list) -> dict[str, dict[int, tuple]]:
    """The same knowledge from the service's own events, before any encoding."""
    held: dict[str, dict[int, tuple]] = {}
    for event in told:
        if isinstance(event, BlockStored):
            held.setdefault(event.medium, {})[external_hash(event.name.key)] = event.name.tokens
        else:
            held.setdefault(event.medium, {}).pop(external_hash(event.key))
    return held


@pytest.fixture
def served():
    """A simulated service in blocks of 4 tokens over a disk tier, its events published on loopback."""
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                       block_events=True)
    publisher = KvEventPublisher("tcp://127.0.0.1:*", block_size=BLOCK, replay_endpoint="tcp://127.0.0.1:*")
    told: list = []
    service.on_block_events(told.append)
    service.on_block_events(publisher.told_together, together=True)  # as kvstate serve subscribes
    yield service, publisher, told
    publisher.close()
    service.close()


def serve(service, prompt, namespace="default"):
    request = Request(prompt, 4)
    service.admit(request, namespace)
    state = service.acquire(request, namespace)
    caches = service.interpreter.prefill(state.caches, prompt[state.reused_tokens:])
    service.publish(request, namespace, prompt, caches)
    service.release(request)


def test_a_kept_prompt_is_told_as_one_chain_of_full_blocks_in_ram(served):
    service, publisher, _ = served
    prompt = tuple(range(100, 110))  # two full blocks and a partial one, which is not told
    serve(service, prompt)
    batches = replayed(publisher.replay_endpoint)
    assert [number for number, _ in batches] == list(range(len(batches)))
    events = [event for _, batch in batches for event in batch.events]
    assert isinstance(events[0], AllBlocksCleared)  # a router forgets what it knew of this server first
    stored = [event for event in events if isinstance(event, BlockStoredEvent) and event.medium == "ram"]
    names = block_names("default", prompt, BLOCK)
    assert len(stored) == 1  # one event for the chain, as vLLM tells a request's new blocks
    assert stored[0].block_hashes == [external_hash(names[0].key), external_hash(names[1].key)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(prompt[:8])
    assert stored[0].block_size == BLOCK and stored[0].lora_id is None and stored[0].extra_keys is None
    assert all(batch.data_parallel_rank == 0 for _, batch in batches)


def test_an_observer_told_together_hears_each_call_of_the_port_as_one_list_in_order():
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_tokens=BLOCK, block_events=True)
    serve(service, tuple(range(8)))
    one_by_one: list = []
    lists: list[list] = []
    service.on_block_events(one_by_one.append)
    service.on_block_events(lists.append, together=True)
    assert lists == [one_by_one] and len(one_by_one) == 2  # what is held now, as the first list
    request = Request(tuple(range(20)), 4)
    service.admit(request)
    state = service.acquire(request)
    caches = service.interpreter.prefill(state.caches, tuple(range(20))[state.reused_tokens:])
    before = len(lists)
    service.publish(request, "default", tuple(range(20)), caches)  # three new full blocks, one call
    assert len(lists) == before + 1
    assert [e.name.tokens for e in lists[-1]] == [tuple(range(8, 12)), tuple(range(12, 16)), tuple(range(16, 20))]
    assert [e for told in lists for e in told] == one_by_one  # the same events, in the same order
    service.release(request)
    service.close()


def test_the_disk_tier_is_told_once_writes_land_and_removals_follow_evictions(served):
    service, publisher, told = served
    first, second = tuple(range(20)), tuple(range(20)) + tuple(range(50, 62))
    serve(service, first)
    serve(service, second)  # extends the first: two new blocks under its last
    service.flush()  # the writes land: the disk holds the blocks
    service.boundary(max_bytes=0)  # RAM gives everything back: the blocks stay on disk
    router = Router()
    for _, batch in replayed(publisher.replay_endpoint):
        router.read(batch)
    assert router.held == direct_view(told)  # the wire says exactly what the service told
    assert router.held["ram"] == {}
    names = block_names("default", second, BLOCK)
    assert router.held["disk"] == {external_hash(n.key): n.tokens for n in names}
    stored = [event for _, batch in replayed(publisher.replay_endpoint) for event in batch.events
              if isinstance(event, BlockStoredEvent) and event.block_hashes[0] == external_hash(names[5].key)]
    assert [event.parent_block_hash for event in stored] == [external_hash(names[4].key)] * len(stored)


def test_a_tenants_blocks_carry_its_namespace_and_a_replay_starts_where_asked(served):
    service, publisher, _ = served
    serve(service, tuple(range(8)), namespace="tenant-hash")
    serve(service, tuple(range(8)))
    batches = replayed(publisher.replay_endpoint)
    stores = [event for _, batch in batches for event in batch.events
              if isinstance(event, BlockStoredEvent) and event.medium == "ram"]
    assert [event.extra_keys for event in stores] == [[("tenant-hash",), ("tenant-hash",)], None]
    assert stores[0].token_ids == stores[1].token_ids and stores[0].block_hashes != stores[1].block_hashes
    last = batches[-1][0]
    assert [number for number, _ in replayed(publisher.replay_endpoint, last)] == [last]


def test_a_publisher_that_starts_later_is_told_what_is_held_and_a_subscriber_reads_it_live():
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_tokens=BLOCK, block_events=True)
    serve(service, tuple(range(12)))
    publisher = KvEventPublisher("tcp://127.0.0.1:*", block_size=BLOCK, topic="kv", replay_endpoint="tcp://127.0.0.1:*")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.connect(publisher.endpoint)
    try:
        service.on_block_events(publisher.told)  # one by one: the thread batches what it finds waiting
        router = Router()
        for _, batch in replayed(publisher.replay_endpoint):
            router.read(batch)
        assert router.held == {"ram": {external_hash(n.key): n.tokens
                                       for n in block_names("default", tuple(range(12)), BLOCK)}}
        # A subscriber hears what is published once its subscription has reached the publisher (ZMQ
        # drops what a PUB sends before): each round keeps one more block, until its store is heard.
        heard: list[tuple[int, KVEventBatch]] = []
        for round_ in range(1, 600):
            serve(service, tuple(range(12)) + (7,) * 4 * round_)
            while subscriber.poll(100 if not heard else 0):
                topic, sequence, payload = subscriber.recv_multipart()
                assert topic == b"kv"
                heard.append((int.from_bytes(sequence, "big"), DECODE.decode(payload)))
            if any(event.token_ids == [7] * 4 for _, batch in heard for event in batch.events
                   if isinstance(event, BlockStoredEvent)):
                break
        numbers = [number for number, _ in heard]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # in order, none lost once heard
    finally:
        publisher.close()
        subscriber.close(linger=0)
        service.close()


def test_an_address_without_a_wildcard_is_connected_to():
    receiver = zmq.Context.instance().socket(zmq.PULL)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}", block_size=BLOCK)
    try:
        assert publisher.endpoint is None  # connected, as vLLM does with such an address
    finally:
        publisher.close()
        receiver.close(linger=0)


def test_block_events_need_blocks_and_a_service_built_for_them():
    from kvstate.core.errors import InvalidConfig
    with pytest.raises(InvalidConfig, match="needs state kept in blocks"):
        KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_events=True)
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_tokens=BLOCK)
    with pytest.raises(InvalidConfig, match="block_events=True"):
        service.on_block_events(print)


def test_an_observer_that_raises_is_logged_and_counted_and_the_others_and_the_call_go_on(caplog):
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_tokens=BLOCK, block_events=True)
    before, after, kept = [], [], []

    def broken(event):
        raise RuntimeError("a router's bug")

    service.on_block_events(before.append)
    service.on_block_events(broken)
    service.on_block_events(after.append, together=True)
    service.on_put(lambda tokens, namespace: 1 / 0)
    service.on_put(lambda tokens, namespace: kept.append(len(tokens)))
    serve(service, tuple(range(12)))  # three full blocks, stored in one call
    assert len(before) == 3 and [e for told in after for e in told] == before and kept == [12]
    assert service.observer_failures == 3 + 1  # each event the broken one was told, and the kept prefix
    untold = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, block_tokens=BLOCK, block_events=True)
    serve(untold, tuple(range(12)))
    assert service.ram(each=True) == untold.ram(each=True)  # the call went on to its end
    failures = [r for r in caplog.records if r.name == "kvstate" and r.exc_info]
    kinds = [next(kind for kind in ("block events", "kept prefixes") if kind in r.getMessage()) for r in failures]
    assert sorted(kinds) == ["block events"] * 3 + ["kept prefixes"]
