"""mlx-lm's prompt-cache interface, backed by a :class:`~kvstate.interpreters.service.KvCacheService`.

``mlx_lm.server`` asks its prompt cache (an ``LRUPromptCache``) for the nearest
cache of a prompt (``fetch_nearest_cache``), offers caches at the end of the
system and user segments and at the end of a generation (``insert_cache`` with
``cache_type``), trims it to what the running batch leaves (``trim_to``), and
logs ``len``, ``nbytes`` and ``stats_by_type``. :class:`KvStatePromptCache`
answers all of these through the service, so the server gains kvstate's reuse
rules, eviction policies, disk tier, restart and metrics with nothing else
changed. Segment ends become kept snapshots: a hybrid or sliding-window model,
whose caches serve only their exact length, reuses a shared system prompt.

The server offers a row's segment ends between its prefill and its first token, so the keep's work
on the generation thread (cutting blocks, deciding them) would lie on the request's time to first
token. Where the batch generator says when a row has begun generating
(:mod:`~kvstate.interpreters.serving.batch_admission`), a segment end is held until then and kept
at the next step, while the device computes the step queued before it; anything that may read it
first (a fetch, another insert, a trim) keeps it before it does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any, Iterator

import attrs
import mlx.core as mx

from kvstate.core.checks import size_text
from kvstate.core.errors import KvStateError
from kvstate.core.request import Request
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.service import DEFAULT_NAMESPACE, KvCacheService
from kvstate.interpreters.serving.pins import PinAsked, pin_kept

#: The cache types ``mlx_lm.server`` inserts, as ``LRUPromptCache`` orders them.
#: The kinds of state the server inserts, and a chunk snapshot kvstate takes mid-prefill.
CACHE_TYPES = ("assistant", "user", "system", "chunk")
#: Announced inserts the server never made are forgotten past this many (a bound, not a rule).
MAX_ANNOUNCED = 4096
#: How often ``stats_by_type`` (a pass over every entry, logged by the server per request) is redone.
STATS_EVERY_S = 1.0
#: The segment ends the server offers before a row's first token: kept after it, where rows are known.
SEGMENT_TYPES = ("system", "user")


@attrs.frozen
class HeldSegment:
    """A batch row's segment end, offered and not kept yet: kept once its row generates."""

    row: int
    namespace: str
    pin: PinAsked | None
    tokens: tuple[int, ...]
    caches: list
    cache_type: str


class KvStatePromptCache:
    """An ``LRUPromptCache`` for ``mlx_lm.server`` whose decisions are kvstate's.

    ``model_key`` is the key the server passes for the model this service was
    built for; a request for any other model is a miss, and nothing of it is
    kept. Memory pressure (``trim_to``) gives RAM entries back through the
    service, spilling them first when it has a disk tier.

    The server's calls carry no request, so a request's namespace (its
    tenant's: :mod:`kvstate.interpreters.serving.tenants`) is announced beside them:
    :meth:`expect` before a batched fetch, :meth:`announce` before a batched
    insert, and :meth:`serving` around a request served outside the batch. A
    call nothing announced is ``unannounced``'s (the default ``namespace`` for a
    cache used on its own); with ``unannounced=None``, as in ``kvstate serve``,
    such a call reuses nothing and keeps nothing: state whose request is not
    known is never filed under another tenant's namespace.
    """

    def __init__(self, service: KvCacheService, model_key: Any, namespace: str = DEFAULT_NAMESPACE, *,
                 unannounced: str | None = DEFAULT_NAMESPACE):
        self.service = service
        self.model_key = model_key
        self.namespace = namespace
        self.unannounced = unannounced
        self._serving: str | None = None  # the namespace of the request served outside the batch now
        self._serving_pin: PinAsked | None = None  # and the pin it asked for
        self._lock = threading.Lock()
        self._types: dict[tuple[str, tuple[int, ...]], str] = {}
        self._expected: dict[tuple[int, ...], tuple[Request, str, Any]] = {}
        self._announced: dict[tuple[int, ...], deque[tuple[str | None, PinAsked | None, int | None]]] = {}
        #: Whether a batch row's segment ends wait for its first token (:meth:`keep_held`; set by the
        #: batch generator's side, which calls it) instead of being kept when offered.
        self.holds_segments = False
        self._held: list[HeldSegment] = []
        self._stats: tuple[float, dict] | None = None
        #: Told of every request's fetch and of the state kept at the end of its reply, where the server
        #: records its traffic (:mod:`~kvstate.interpreters.serving.trace_recording`); None: not recorded.
        self.recorder: Any = None
        #: The first tokens every conversation the served chat template renders begins with, and the hits
        #: that reused no more than those (counted apart on ``/metrics``: the template's reuse, not the client's).
        self.template_tokens = 0
        self.template_only_hits = 0
        #: Asked after every fetch and insert whether the disk tier had trouble to tell of
        #: (:class:`~kvstate.interpreters.serving.disk_notices.DiskNotices`); None: no disk tier.
        self.disk_notices: Any = None
        #: Publishes which blocks the tiers hold, for a fleet's router
        #: (:class:`~kvstate.interpreters.fleet.kv_events.KvEventPublisher`); None: not published.
        self.kv_events: Any = None
        config = service.config
        # The clock reaches the service only where a rule reads it (idle writes, idle demotion, checkpoints
        # left by clients that never came back).
        self._clocked = (config.write_idle_after is not None or config.demote_idle_after is not None
                         or (config.checkpoints and config.checkpoint_keep_s is not None))

    # ------------------------------------------------------------ admission's side

    def expect(self, request: Request, namespace: str | None = None, acquired: Any = None,
               tokens: Any = None) -> None:
        """The next fetch of ``request.prompt`` (or of ``tokens``) is this admitted request's, in
        ``namespace`` (the default one if None): it acquires under that lease, which stays live until
        the caller releases it (the end of its batch row). With ``acquired``, the lease's state is
        acquired already (a resumable generation's: :mod:`~kvstate.interpreters.serving.resumable`),
        and the fetch hands over its caches, fresh ones included."""
        key = request.prompt if tokens is None else tuple(tokens)
        self._expected[key] = (request, namespace or self.namespace, acquired)

    def unexpect(self, request: Request) -> None:
        for key, expected in list(self._expected.items()):
            if expected[0] is request:
                del self._expected[key]

    def announce(self, tokens: Any, namespace: str | None, pin: PinAsked | None = None,
                 row: int | None = None) -> None:
        """The server's next insert of ``tokens`` is a row of ``namespace``'s (inserts of the same
        tokens take the announced namespaces in order); None: of no known request, kept nowhere. With
        ``pin``, the prefix it names is pinned once the state is kept (:mod:`~kvstate.interpreters.serving.pins`).
        ``row``: the batch row it is from, so a segment end may be held until that row generates."""
        with self._lock:
            if len(self._announced) >= MAX_ANNOUNCED:
                self._announced.pop(next(iter(self._announced)))
            self._announced.setdefault(tuple(tokens), deque()).append((namespace, pin, row))

    def _announced_namespace(self, key: tuple[int, ...]) -> tuple[str | None, PinAsked | None, int | None]:
        with self._lock:
            waiting = self._announced.get(key)
            if not waiting:
                return self.unannounced, None, None
            announced = waiting.popleft()
            if not waiting:
                del self._announced[key]
            return announced

    @contextlib.contextmanager
    def serving(self, namespace: str | None, pin: PinAsked | None = None) -> Iterator[None]:
        """Every fetch and insert inside is the one request the server serves outside the batch (with
        a ``seed``, under ``--kv-bits``, with a draft model or images), in ``namespace`` (the default
        one if None); with ``pin``, the prefix of its prompt (its first fetch's) is pinned once kept."""
        self._serving, self._serving_pin = namespace or self.namespace, pin
        try:
            yield
        finally:
            self._serving, self._serving_pin = None, None

    # ------------------------------------------------------------ what the server calls

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list | None, list[int]]:
        """``(caches, rest)``: caches covering the longest reusable prefix of ``tokens`` (a copy the
        caller owns) and the tokens left to compute; ``(None, tokens)`` for a miss."""
        if model != self.model_key or not tokens:
            return None, tokens
        self.keep_held()  # a held segment end may be what this prompt reuses
        key = tuple(tokens)
        admitted, namespace, acquired = self._expected.pop(key, (None, self._serving or self.unannounced, None))
        if self._serving_pin is not None and not self._serving_pin.prompt_tokens:
            self._serving_pin = attrs.evolve(self._serving_pin, prompt_tokens=len(key))
        if namespace is None:
            return None, tokens  # whose request this is is not known: reuse nothing
        self._tick()
        started = time.perf_counter()
        read_before = self.service.counts().bytes_read
        if acquired is not None:
            state = acquired
        elif admitted is None:  # a request admission holds elsewhere (served on its own): a lookup, no lease
            state = self.service.lookup(key, namespace)
        else:
            try:
                state = self.service.acquire(admitted, namespace)
            except KvStateError:
                return None, tokens  # the lease cannot take state now (acquired already): compute it all
        self.service.boundary()
        read = self.service.counts().bytes_read - read_before
        logging.info("kvstate: fetch of %d tokens reused %d (%s%s) in %.1f ms", len(tokens), state.reused_tokens,
                     state.source.name.lower(), f", {size_text(read)} read from disk" if read else "",
                     1e3 * (time.perf_counter() - started))
        if self.recorder is not None:
            self.recorder.fetched(namespace, key, state.reused_tokens)
        if self.disk_notices is not None:
            self.disk_notices.check()
        covered = len(state.resumed_tokens) if state.resumed is not None else state.reused_tokens
        if 0 < covered <= self.template_tokens:
            self.template_only_hits += 1
        if covered == 0 and acquired is None:
            return None, tokens
        return state.caches, tokens[covered:]

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list, *,
                     cache_type: str = "assistant", next_chunk: tuple[int, ...] = ()) -> None:
        """Offer ``prompt_cache`` covering ``tokens`` for reuse; the service keeps it or not. A ``"chunk"``
        says in ``next_chunk`` the prompt's tokens to where the next is taken (see ``publish``)."""
        key = tuple(tokens)
        namespace, pin, row = ((self._serving, self._serving_pin, None) if self._serving
                               else self._announced_namespace(key))
        if model != self.model_key or not key or not prompt_cache:
            return
        if namespace is None:
            logging.info("kvstate: %s state of %d tokens not kept: no request announced it (its namespace is "
                         "not known)", cache_type, len(key))
            return
        recorded = self.recorder is not None and cache_type == "assistant"
        if len(prompt_cache) != len(self.service.config.model.layers):
            # a draft model's caches ride behind the model's: kvstate's geometry has no place for them
            logging.info("kvstate: %s state of %d tokens not kept: %d cache layers, the model has %d (a draft "
                         "model's caches are not kept)", cache_type, len(key), len(prompt_cache),
                         len(self.service.config.model.layers))
            if recorded:
                self.recorder.answered(namespace, tuple(tokens), 0)  # answered; nothing of it kept
            return
        if row is not None and self.holds_segments and cache_type in SEGMENT_TYPES:
            # Computed now, on the caller's stream, so the held copies share nothing with the batch's arrays.
            mx.async_eval(mlx_caches.arrays_of(prompt_cache))
            with self._lock:
                self._held.append(HeldSegment(row, namespace, pin, key, prompt_cache, cache_type))
            return
        self.keep_held()  # in the order offered
        self._keep(namespace, pin, key, prompt_cache, cache_type, next_chunk)

    def keep_held(self, rows: Any = None) -> None:
        """Keep the segment ends held for ``rows`` (None: every row), in the order they were offered."""
        with self._lock:
            if not self._held:
                return
            due, waiting = [], []
            for held in self._held:
                (due if rows is None or held.row in rows else waiting).append(held)
            self._held = waiting
        for held in due:
            self._keep(held.namespace, held.pin, held.tokens, held.caches, held.cache_type)

    def _keep(self, namespace: str, pin: PinAsked | None, key: tuple[int, ...], prompt_cache: list,
              cache_type: str, next_chunk: tuple[int, ...] = ()) -> None:
        """Offer ``prompt_cache`` over the tokens ``key`` to the service, in ``namespace``."""
        offered = key
        recorded = self.recorder is not None and cache_type == "assistant"
        self._tick()
        started = time.perf_counter()
        covered = mlx_caches.covered(prompt_cache)
        if covered is not None and covered != len(key):
            # At the end of a generation the last sampled token is not in the caches yet.
            if covered > len(key) or covered == 0:
                return
            key = key[:covered]
        if recorded:
            self.recorder.answered(namespace, offered, len(key))
        request = Request(key, 1)
        before = self.service.counts()
        try:
            chunk = cache_type == "chunk"
            kept = self.service.publish(request, namespace, key, prompt_cache, chunk=chunk,
                                        next_chunk=next_chunk if chunk and key is offered else ())  # cut: not contiguous
        except KvStateError:
            return  # caches the service cannot take (their tokens disagree): not kept, as a full cache would
        if kept:
            with self._lock:
                self._types[namespace, key] = cache_type if cache_type in CACHE_TYPES else "assistant"
            if pin is not None:
                pin_kept(self.service, namespace, key, pin)
        self.service.boundary()
        if self.disk_notices is not None:
            self.disk_notices.check()
        logging.info("kvstate: %s state of %d tokens (%s) %s in %.1f ms%s", cache_type, len(key),
                     size_text(mlx_caches.live_bytes(prompt_cache)), "kept" if kept else "not kept",
                     1e3 * (time.perf_counter() - started), _disk_work(before, self.service.counts()))

    def _tick(self) -> None:
        """Read the service's clock into it, on the generation thread (where a spill may copy arrays)."""
        if self._clocked:
            self.service.tick()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Give RAM entries back (spilled first with a disk tier) until at most ``n_sequences`` and
        ``n_bytes`` are held: what the running batch leaves of the server's prompt-cache budget."""
        self.keep_held()
        self.service.boundary(max_entries=None if n_sequences is None else max(0, n_sequences),
                              max_bytes=None if n_bytes is None else max(0, n_bytes))

    def __len__(self) -> int:
        return self.service.ram().entries

    @property
    def nbytes(self) -> int:
        return self.service.ram().nbytes

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Entries and bytes in RAM by the cache type the server inserted them as.

        The server logs these before every request, and they take a pass over every entry, so
        they are worked out at most once every ``STATS_EVERY_S`` seconds (a log line up to that old).
        """
        now = time.monotonic()
        if self._stats is not None and now - self._stats[0] < STATS_EVERY_S:
            return self._stats[1]
        stats = self._count_by_type()
        self._stats = (now, stats)
        return stats

    def _count_by_type(self) -> dict[str, dict[str, int]]:
        stats = {kind: {"n_sequences": 0, "n_bytes": 0} for kind in CACHE_TYPES}
        held = set()
        for entry in self.service.ram(each=True).each:
            key = (entry.namespace, entry.tokens)
            kind = self._types.get(key, "assistant")
            stats[kind]["n_sequences"] += 1
            stats[kind]["n_bytes"] += entry.nbytes
            held.add(key)
        with self._lock:
            for key in [k for k in self._types if k not in held]:
                del self._types[key]
        return stats


def _disk_work(before: Any, after: Any) -> str:
    """What a step started and finished on the disk, for its log line: spills begun, bytes written."""
    spills, written = after.spills - before.spills, after.bytes_written - before.bytes_written
    if not spills and not written:
        return ""
    return f"; {spills} spill{'s' if spills != 1 else ''} begun, {size_text(written)} written to disk"
