"""KV events in vLLM's format, published over ZMQ: which blocks one server holds, for a fleet's router.

The service tells each change of which full blocks a tier holds (``on_block_events``: a
``BlockStored`` or ``BlockRemoved`` effect, after a ``BlockStored`` for each block held when the
publisher started watching). :class:`KvEventPublisher` turns them into vLLM's KV events and
publishes them as vLLM's ``ZmqEventPublisher`` does, so what reads vLLM's events reads these:

- each message is three frames: the topic, a sequence number (8 bytes, big-endian, from 0), and a
  msgpack ``KVEventBatch`` encoded as vLLM's msgspec structs with ``array_like=True``:
  ``[ts, [event, ...], data_parallel_rank]``, each event a tagged array:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name(, extra_keys)]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- block hashes are 64-bit ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the last
  8 bytes of kvstate's chain key, big-endian; a namespace's first block has no parent (None);
- ``medium`` names the tier: ``"ram"``, ``"disk"``, or ``"remote"`` (the tier the fleet shares: a
  block this server learnt it holds, never removed, since no server drops the store's objects);
- a block outside the default namespace (a ``cache_salt``'s: a keyed hash, never the salt) carries
  its namespace as its extra key, as vLLM carries a request's ``cache_salt``, so a router that
  rebuilds hashes from tokens keeps tenants apart;
- the endpoint is bound where it has a wildcard (``tcp://*:5557``) or is ``ipc://`` or
  ``inproc://``, else connected to (vLLM's rule); a replay endpoint (a ROUTER socket) answers a
  request frame of a starting sequence number with every batch kept from there, then the sequence
  number -1 and an empty frame.

The first batch says ``AllBlocksCleared``: a router drops what it knew of this server (a restart),
then learns what it holds. Events are batched as they queue: one batch is whatever the publishing
thread finds waiting, consecutive stores of one chain and tier made one ``BlockStored``; the events
of one call of the service (``told_together``, as ``kvstate serve`` subscribes) are never split.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

from kvstate.effects.effects import BlockRemoved, BlockStored

try:
    import msgspec
    import zmq
except ImportError:  # the fleet extra is not installed: KvEventPublisher says so when built
    msgspec = zmq = None

#: The end of a replay: its sequence number, signed (vLLM's ``END_SEQ``).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

#: How long a close waits for a connected subscriber to take what was published (a router that
#: stopped reading must not hold a server's stop for longer).
CLOSE_LINGER_MS = 5000


class FleetExtraMissing(ImportError):
    """``pyzmq`` or ``msgspec`` is not installed: KV events need the ``fleet`` extra."""


def external_hash(key: bytes) -> int:
    """A chain key as vLLM's int block hash: its last 8 bytes, big-endian."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


if msgspec is not None:
    class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class _BlockStored(_Event, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None

    class _BlockRemoved(_Event, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
        pass


class KvEventPublisher:
    """Publishes a service's block events on ``endpoint`` (and answers replays on ``replay_endpoint``),
    from a thread of its own; ``told`` is what the service calls (cheap: it queues).

    ``block_size`` is the service's tokens per block; ``default_namespace`` the namespace whose
    blocks carry no extra key; ``buffer_batches`` how many recent batches a replay can return."""

    def __init__(self, endpoint: str, *, block_size: int, replay_endpoint: str | None = None, topic: str = "",
                 default_namespace: str = "default", data_parallel_rank: int = 0, buffer_batches: int = 10_000):
        if zmq is None or msgspec is None:
            raise FleetExtraMissing("KV events need pyzmq and msgspec: pip install 'kvstate[fleet]'")
        self.block_size, self.default_namespace, self.rank = block_size, default_namespace, data_parallel_rank
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._sequence = itertools.count()
        # A context of its own, ended at close: only ending it sends what is still queued (the process
        # may exit right after, and a shared context is never ended before that).
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = None
        self._wake_address = f"inproc://kvstate-kv-events-{id(self)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(self._wake_address)
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.connect(self._wake_address)
        try:
            bound = _attach(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        #: The addresses bound, as ZMQ reports them (a wildcard port resolved), or None where connected.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if bound else None
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        #: Batches published so far (each a message).
        self.published = 0
        self._closing = False
        self._thread = threading.Thread(target=self._publish_loop, name="kvstate-kv-events", daemon=True)
        self._thread.start()
        self._queue([_AllBlocksCleared()])

    def told(self, event: BlockStored | BlockRemoved) -> None:
        """One change the service tells (``on_block_events``'s callback)."""
        self._queue([self._event(event)])

    def told_together(self, events: list[BlockStored | BlockRemoved]) -> None:
        """The changes of one call of the service (``on_block_events(..., together=True)``'s callback):
        published in one batch, a chain's stores as one ``BlockStored``, however the thread runs."""
        self._queue([self._event(event) for event in events])

    def _event(self, event: BlockStored | BlockRemoved) -> Any:
        if isinstance(event, BlockStored):
            name = event.name
            parent = None if name.start == 0 else external_hash(name.parent)
            extra = None if name.namespace == self.default_namespace else [[name.namespace]]
            return _BlockStored([external_hash(name.key)], parent, list(name.tokens), self.block_size,
                                None, event.medium, None, extra)
        return _BlockRemoved([external_hash(event.key)], event.medium)

    def close(self) -> None:
        """Publish what is queued, send it to the subscribers connected (for up to
        ``CLOSE_LINGER_MS``), then stop (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.send(b"")
        self._thread.join()
        self._close_sockets()

    def _queue(self, events: list) -> None:
        """Queue ``events`` for one batch (with whatever else the thread finds waiting)."""
        with self._lock:
            if self._closing or not events:
                return
            self._pending.append(events)
            if len(self._pending) == 1:  # the thread may be asleep: one wake for a run of calls
                self._wake.send(b"")

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay, self._wake, self._wake_in):
            if socket is not None:
                socket.close(linger=CLOSE_LINGER_MS if socket is self._pub else 0)
        self._context.term()

    def _publish_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            # Queued events first: a replay asked for after an event was told answers with it.
            if ready.get(self._wake_in):
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                with self._lock:
                    events, closing = [e for told in self._pending for e in told], self._closing
                    self._pending.clear()
                if events:
                    self._send(merged(events))
                if closing:
                    return
            if self._replay is not None and ready.get(self._replay):
                self._answer_replay()

    def _send(self, events: list) -> None:
        sequence = next(self._sequence)
        payload = self._encoder.encode(_Batch(time.time(), events, self.rank))
        self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
        self._buffer.append((sequence, payload))
        self.published += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: nothing to answer
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def merged(events: list) -> list:
    """``events`` with each run of stores that continue one chain in one tier as one ``BlockStored``
    (vLLM tells a request's new blocks so), and each run of removals from one tier as one
    ``BlockRemoved``."""
    out: list = []
    for event in events:
        last = out[-1] if out else None
        if _continues(last, event):
            last.block_hashes.append(event.block_hashes[0])
            last.token_ids.extend(event.token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(event.extra_keys[0])
        elif isinstance(event, _BlockRemoved) and isinstance(last, _BlockRemoved) and event.medium == last.medium:
            last.block_hashes.append(event.block_hashes[0])
        else:
            out.append(event)
    return out


def _continues(last: Any, event: Any) -> bool:
    """Whether the store ``event`` extends the chain the store ``last`` ends, in its tier and namespace."""
    if not (isinstance(event, _BlockStored) and isinstance(last, _BlockStored)):
        return False
    same_namespace = (event.extra_keys is None) == (last.extra_keys is None) and (
        event.extra_keys is None or event.extra_keys[0] == last.extra_keys[0])
    return event.medium == last.medium and event.parent_block_hash == last.block_hashes[-1] and same_namespace


def _attach(socket: Any, endpoint: str) -> bool:
    """Bind where the endpoint has a wildcard or is local (``ipc://``, ``inproc://``), else connect;
    whether it was bound."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
        return True
    socket.connect(endpoint)
    return False
