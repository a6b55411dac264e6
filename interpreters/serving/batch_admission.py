"""The server's requests held to the KV budget as the one padded batch they run in.

``mlx_lm.server`` puts every request it dequeues into its ``BatchGenerator``
at once; nothing bounds what the batch holds. Here each request is admitted by
the service before the server sees it (``admit`` under ``batch_padding_step``:
rows x the longest row, rounded up to the cache step) and waits, in arrival
order, while the budget has no room. Its lease lives as long as its row: it is
released when the batch finishes or removes the row. After every batch step the
batch's real bytes (``prompt_cache_nbytes``, padding included) are measured
into the service, so admission goes by the measure wherever it exceeds the
projection, and the peaks are kept for ``/metrics``.

Requests that arrive together and share a prefix nothing holds yet do not all
compute it: while a row in prefill will publish state a waiting request could
reuse (the service's ``shared_wait``, :mod:`kvstate.core.sharing`), that request waits for the
publish, at most ``share_wait_s`` seconds, and requests behind it that do not
share the prefix go first.

Each request runs in its tenant's namespace (the handler sets it from the
request's ``cache_salt``: :mod:`kvstate.interpreters.serving.tenants`): its fetch, the
inserts of its row and the rows it may wait for are all of that namespace.

Two pieces of the server are subclassed, nothing else changes:
:func:`admitting_generator` (a ``ResponseGenerator`` whose ``_next_request``
admits) and :func:`measured_batch_generator` (a ``BatchGenerator`` that
reports its rows and bytes). Both run on the server's generation thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import attrs

from kvstate.core.errors import KvStateError
from kvstate.core.request import Request
from kvstate.core.sharing import Computing
from kvstate.core.tokens import Tokens
from kvstate.interpreters.serving.model_names import requested_key
from kvstate.interpreters.serving.pins import PIN_ATTRIBUTE, PinAsked
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from kvstate.interpreters.serving.resumable import Generation, ReplayingQueue, Resumption, vocabulary
from kvstate.interpreters.serving.tenants import NAMESPACE_ATTRIBUTE

#: The step in tokens by which mlx-lm's batch caches grow (``BatchKVCache.step``).
CACHE_STEP = 256
#: A wait for another request's publish must save at least this many prompt tokens.
MIN_SHARED_TOKENS = 64
#: The longest a request waits for its saved blocks read ahead into RAM before it joins the batch
#: anyway (and its acquire reads what is still missing itself).
READ_AHEAD_WAIT_S = 2.0
#: The longest a request waits for its blocks fetched from the shared tier before it joins the batch
#: anyway (and computes what has not landed).
REMOTE_WAIT_S = 10.0
#: How often an idle server looks whether the reads it waits for have landed.
READ_POLL_S = 0.002


@attrs.define
class Arrival:
    """A dequeued server request, the server's own tokenization of it (None: not ours to admit),
    its prompt as the service's key and its namespace, until when it may wait for a shared prefix
    being computed, and whether it has waited for room."""

    item: Any
    tokenized: tuple | None
    prompt: tuple[int, ...] = ()
    namespace: str = ""
    share_deadline: float | None = None
    waited_for_room: bool = False
    #: The pin the request asked for (``cache_pin_seconds``), its prompt's length filled in.
    pin: PinAsked | None = None
    #: Until when it waits for its saved blocks being read ahead into RAM (None: nothing read ahead).
    read_deadline: float | None = None


class BatchAdmission:
    """The leases of the server's requests, from dequeue to the end of their batch row.

    Everything but the peaks is touched on the server's generation thread only.
    """

    def __init__(self, cache: KvStatePromptCache, share_wait_s: float = 5.0,
                 min_shared_tokens: int = MIN_SHARED_TOKENS, snapshot_every: int | None = None,
                 read_ahead: bool = False, resumption: Resumption | None = None, hold_segments: bool = False):
        self.cache = cache
        #: A row's segment ends are kept once it has generated its first token, not between its prefill
        #: and that token (:mod:`~kvstate.interpreters.serving.prompt_cache`); the batch generator's
        #: steps keep them (:meth:`before_step`).
        cache.holds_segments = hold_segments
        self._generating: set[int] = set()        # batch uids that have generated a token
        #: How generations with a client key are checkpointed and resumed (None: they are not).
        self.resumption = resumption
        #: Where a model's layers cannot all be cut into blocks: a row's state is kept as a snapshot
        #: whenever its prefill passes a multiple of this many tokens (None: at segment ends only).
        self.snapshot_every = snapshot_every
        self._snapshotted: dict[int, int] = {}   # batch uid -> the tokens its last chunk snapshot covered
        self.service = cache.service
        self.share_wait_s = share_wait_s
        #: Whether a request's saved blocks are read ahead when it arrives (asked for, with state kept in
        #: blocks on a disk tier). Off by default: on a GPU its first form cost more than the restore it
        #: replaces, and the present one is not measured there yet (``bench/README.md``).
        self.reads_ahead = (read_ahead and cache.service.config.block_tokens is not None
                            and cache.service.config.has_disk)
        #: Whether an arriving request's blocks this server lacks are fetched from the shared tier.
        self.fetches_remote = cache.service.config.remote_tier
        self.min_shared_tokens = min_shared_tokens
        self._waiting: deque[Arrival] = deque()   # in arrival order: waiting for room, or for a shared prefix
        self._computing: dict[int, Computing] = {}  # batch uid -> its row while in prefill
        self._namespaces: dict[int, str] = {}     # batch uid -> its request's namespace
        self._pins: dict[int, PinAsked] = {}      # batch uid -> the pin its request asked for
        self._unplaced_pin: PinAsked | None = None  # the pin of the request admitted last
        self._unplaced: Request | None = None     # admitted, not yet a batch row (or served unbatched)
        self._unplaced_namespace: str | None = None  # the namespace of the request dequeued last
        self._unplaced_generation: Generation | None = None  # its resumable generation, if it is one
        self._generations: dict[int, Generation] = {}  # batch uid -> its resumable generation
        self._tokenized: tuple[int, tuple] | None = None  # (id of the server request, its tokenization)
        self._rows: dict[int, Request] = {}       # batch uid -> its lease
        self.peak_batch_bytes = 0
        self.peak_held_bytes = 0
        self.waited = 0
        self.shared_waits = 0

    # ------------------------------------------------------------ the response generator's side

    def next_admitted(self, take: Any, tokenize: Any, timeout: float | None) -> Any:
        """The next server request the budget has room for, in arrival order, or None (the batch
        goes on). ``take(timeout)`` dequeues one; ``tokenize(item)`` is the server's own
        tokenization (prompt first), or raises for a request admission leaves to the server."""
        self._end_unplaced()
        while True:
            arrived = take(self._take_timeout(timeout))  # newcomers queue behind the waiting
            if arrived is not None:
                arrival = self._arrival(arrived, tokenize, self.cache.namespace)
                self._read_ahead(arrival)
                self._waiting.append(arrival)
            if not self._waiting:
                return None
            verdict, arrival = self._next_in_line()
            if verdict is None:  # everything in line waits for a shared prefix: see what else came
                if arrived is None:
                    return None
                continue
            if verdict is WAIT:
                return None
            self._waiting.remove(arrival)
            if verdict is ADMITTED:
                return arrival.item
            # REFUSED: the client has its answer; look at the next one

    def _take_timeout(self, timeout: float | None) -> float | None:
        """How long the dequeue waits for a newcomer: not at all while requests wait their turn in a
        running batch (``timeout`` None), and, with the batch idle, a moment while the only ones waiting
        wait for their blocks to be read (the read lands at the next pass, not a newcomer)."""
        if not self._waiting:
            return timeout
        if timeout is not None and all(arrival.read_deadline is not None for arrival in self._waiting):
            return min(timeout, READ_POLL_S)
        return None

    def _read_ahead(self, arrival: Arrival) -> None:
        """Start reading the request's saved blocks into RAM now, off the generation thread, so its row
        joins the batch with its state in memory (it waits for them at most ``READ_AHEAD_WAIT_S``)."""
        if arrival.tokenized is None:
            return
        if self.fetches_remote and self.service.remote_lookup(arrival.prompt, arrival.namespace):
            # Its blocks come from the shared tier onto the disk first, off this thread, whether the
            # batch is busy or not: a restore then reads them.
            arrival.read_deadline = time.monotonic() + REMOTE_WAIT_S
            return
        if not self.reads_ahead:
            return
        if not self._rows and not self._waiting:
            return  # it is admitted now, with nothing to overlap a read with: its own restore is sooner
        if self.service.prefetch(arrival.prompt, arrival.namespace):
            arrival.read_deadline = time.monotonic() + READ_AHEAD_WAIT_S

    def _waits_for_reads(self, arrival: Arrival) -> bool:
        """Whether the request still waits for its blocks read ahead (landed by the ``collect`` of
        :meth:`_next_in_line`)."""
        if arrival.read_deadline is None:
            return False
        if time.monotonic() < arrival.read_deadline and self.service.reading_ahead(arrival.prompt, arrival.namespace):
            return True
        arrival.read_deadline = None
        return False

    def _next_in_line(self) -> tuple[object, Arrival | None]:
        """The verdict on the first waiting request that is not waiting for a shared prefix, and that
        request: a request whose prefix is being computed lets the ones behind it go first (they do
        not share it), while room is first come, first served."""
        if any(arrival.read_deadline is not None for arrival in self._waiting):
            self.service.collect()  # reads ahead that are done land now
        for arrival in self._waiting:
            if self._waits_for_reads(arrival) or self._waits_for_shared_prefix(arrival):
                continue
            return self._admit(arrival), arrival
        return None, None

    @staticmethod
    def _arrival(item: Any, tokenize: Any, default_namespace: str) -> Arrival:
        namespace = getattr(item[1], NAMESPACE_ATTRIBUTE, None) or default_namespace
        pin = getattr(item[1], PIN_ATTRIBUTE, None)
        try:
            tokenized = tokenize(item)
            prompt = tuple(tokenized[0])
            return Arrival(item, tokenized, prompt, namespace,
                           pin=attrs.evolve(pin, prompt_tokens=len(prompt)) if pin is not None else None)
        except Exception:  # noqa: BLE001 - not ours to admit: the server tokenizes and answers itself
            return Arrival(item, None, namespace=namespace)

    def _waits_for_shared_prefix(self, arrival: Arrival) -> bool:
        """Whether a row in prefill will soon publish enough of this prompt to be worth a wait."""
        if arrival.tokenized is None or not self._computing or self.share_wait_s <= 0:
            return False
        rows = [row for uid, row in self._computing.items() if self._namespaces.get(uid) == arrival.namespace]
        if not rows or not self.service.shared_wait(arrival.prompt, arrival.namespace, rows, self.min_shared_tokens):
            return False
        now = time.monotonic()
        if arrival.share_deadline is None:
            arrival.share_deadline = now + self.share_wait_s
            self.shared_waits += 1
        return now < arrival.share_deadline

    def _admit(self, arrival: Arrival) -> object:
        if arrival.tokenized is None:
            self._unplaced_namespace = arrival.namespace  # the server's to serve, in the request's namespace
            return ADMITTED
        rqueue, request, args = arrival.item
        lease = None
        if self.resumption is not None:
            lease = self.resumption.lease(request, arrival.tokenized, args, arrival.prompt)
        lease = lease or Request(arrival.prompt, args.max_tokens)
        try:
            admitted = self.service.admit(lease, arrival.namespace)
        except KvStateError as error:  # can never run (the handler's check did not see it): say why
            rqueue.put(error)
            return REFUSED
        if not admitted:
            if not arrival.waited_for_room:
                arrival.waited_for_room = True
                self.waited += 1
            return WAIT
        tokenized, acquired, generation = arrival.tokenized, None, None
        if lease.continuation is not None:
            try:
                generation, tokenized, acquired = self.resumption.begin(lease, arrival.namespace, request,
                                                                        tokenized, args)
            except KvStateError as error:
                self.service.release(lease, completed=False)
                rqueue.put(error)
                return REFUSED
            arrival.item = (self.resumption.queue(rqueue, generation), request, args)
        self._tokenized = (id(request), tokenized)
        self._unplaced, self._unplaced_namespace = lease, arrival.namespace
        self._unplaced_pin, self._unplaced_generation = arrival.pin, generation
        self.cache.expect(lease, arrival.namespace, acquired, tokenized[0])
        return ADMITTED

    def tokenized(self, request: Any) -> tuple | None:
        """The tokenization admission made of ``request`` (the server's own), or None."""
        if self._tokenized is not None and self._tokenized[0] == id(request):
            return self._tokenized[1]
        return None

    def _end_unplaced(self) -> None:
        """A request admitted and never made a batch row was served unbatched or failed: it is done (a
        resumable generation that did not finish keeps its checkpoint for a retry)."""
        lease, self._unplaced, self._tokenized = self._unplaced, None, None
        generation, self._unplaced_generation = self._unplaced_generation, None
        self._unplaced_namespace, self._unplaced_pin = None, None
        if lease is not None:
            self.cache.unexpect(lease)
            self.service.release(lease, completed=generation is None or generation.finished)

    # ------------------------------------------------------------ the batch generator's side

    def placed(self, uids: list[int], segments: Any = None, cached: Any = None,
               extract: Callable[[list[int]], dict] | None = None) -> None:
        """Rows ``uids`` joined the batch, with their prompt ``segments`` left to compute after the
        ``cached`` tokens (``insert_segments``' arguments); ``extract(uids)`` is the batch's
        ``extract_cache`` (a resumable row's checkpoints are taken from it)."""
        lease, self._unplaced, self._tokenized = self._unplaced, None, None
        namespace, self._unplaced_namespace = self._unplaced_namespace, None
        pin, self._unplaced_pin = self._unplaced_pin, None
        generation, self._unplaced_generation = self._unplaced_generation, None
        if generation is not None and len(uids) == 1 and extract is not None:
            uid = uids[0]
            generation.state = lambda: extract([uid]).get(uid)
            self._generations[uid] = generation
        for uid in uids:
            if namespace is not None:  # a row of no known request keeps nothing
                self._namespaces[uid] = namespace
            if pin is not None and len(uids) == 1:
                self._pins[uid] = pin
        if segments is not None and len(uids) == len(segments):
            for uid, parts, done in zip(uids, segments, cached or [[]] * len(uids)):
                self._computing[uid] = self._row(parts, done)
        if lease is None:
            return
        self.cache.unexpect(lease)
        if len(uids) == 1:
            self._rows[uids[0]] = lease
        else:
            self.service.release(lease)

    def _row(self, parts: Any, cached: Any) -> Computing:
        """A row in prefill as the batch runs it: its caches are published at the end of each
        segment but the last, and one token before the prompt's end (the last token is sampled from)."""
        parts = [list(part) for part in parts if len(part)]
        prompt = tuple(cached) + tuple(token for part in parts for token in part)
        boundaries, position = [], len(cached)
        for part in parts[:-1]:
            position += len(part)
            boundaries.append(position)
        if parts and len(parts[-1]) > 1:
            boundaries.append(len(prompt) - 1)
        return Computing(Tokens(prompt), tuple(boundaries), len(cached),  # packed once, for every arrival's check
                         self.service.config.model.trimmable_at(len(prompt)))

    def progressed(self, prompt_responses: Any) -> None:
        """How far each row's prefill has got; a row whose prompt is done computes nothing shared."""
        for response in prompt_responses:
            row = self._computing.get(response.uid)
            if row is None:
                continue
            if response.end_of_prompt:
                del self._computing[response.uid]
            else:
                start = len(row.prompt) - response.progress[1]
                self._computing[response.uid] = attrs.evolve(row, position=start + response.progress[0])

    def publishing(self, uid: int, tokens: Any, final: bool = False) -> None:
        """Row ``uid``'s caches over ``tokens`` go to the server's next insert: in the row's namespace (a
        row of no known request: nowhere, the insert keeps nothing). The ``final`` insert, at the end of
        its generation, pins the row's prompt where its request asked."""
        self.cache.announce(tokens, self._namespaces.get(uid), self._pins.get(uid) if final else None, row=uid)

    def before_step(self) -> None:
        """A batch step is about to run: the segment ends held for rows that have generated are kept
        now, while the device computes what the last step queued (the first token already out)."""
        if self._generating:
            self.cache.keep_held(self._generating)

    def generated(self, generation_responses: Any) -> None:
        """Rows that generated a token in the step that just ran."""
        for response in generation_responses:
            self._generating.add(response.uid)

    def due_snapshots(self, prompt_responses: Any) -> list[int]:
        """The rows in prefill whose state passed a multiple of ``snapshot_every`` tokens since their
        last snapshot (a segment's end is the server's own insert)."""
        every = self.snapshot_every
        if not every:
            return []
        due = []
        for response in prompt_responses:
            if response.end_of_segment or response.end_of_prompt or response.uid not in self._namespaces:
                continue
            row = self._computing.get(response.uid)
            if row is None:
                continue
            start = len(row.prompt) - response.progress[1]  # where its prefill began (after what it reused)
            if row.position // every > self._snapshotted.setdefault(response.uid, start) // every:
                due.append(response.uid)
        return due

    def snapshot(self, uid: int, caches: Any, tokens: Any, prefill_step: int = 0) -> None:
        """Row ``uid``'s state over ``tokens``, mid-prefill, offered as a chunk snapshot (the server
        sets ``snapshot_every`` only for a model whose layers cannot all be cut). It says the prompt's
        tokens to where the next is due: the first prefill step (``prefill_step`` tokens at most) past
        the next multiple of ``snapshot_every``, so that only the last chunk before a branch point is
        kept as such (an end too far keeps one chunk more; too near could keep none)."""
        end = len(tokens)
        self._snapshotted[uid] = end
        row = self._computing.get(uid)
        next_chunk = ()
        if row is not None:
            due = (end // self.snapshot_every + 1) * self.snapshot_every + max(prefill_step - 1, 0)
            next_chunk = tuple(row.prompt[end:min(due, len(row.prompt))])
        self.publishing(uid, tokens)
        self.cache.insert_cache(self.cache.model_key, list(tokens), caches, cache_type="chunk",
                                next_chunk=next_chunk)

    def ended(self, uids: Any, completed: bool = True) -> None:
        """Rows ``uids`` left the batch, their generations ``completed`` or not (removed, or the server
        stopping): a resumable one that did not complete keeps its checkpoint for a retry."""
        self.cache.keep_held(set(uids))
        for uid in uids:
            self._generating.discard(uid)
            self._snapshotted.pop(uid, None)
            self._namespaces.pop(uid, None)
            self._pins.pop(uid, None)
            self._computing.pop(uid, None)
            generation = self._generations.pop(uid, None)
            lease = self._rows.pop(uid, None)
            if lease is not None:
                self.service.release(lease, completed=completed or (generation is not None and generation.finished))

    def close(self) -> None:
        self.cache.keep_held()
        self.ended(list(self._rows), completed=False)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """The batch prefilled ``tokens`` prompt tokens in ``seconds`` (its pace: whether a disk hit
        beats computing the same tokens, :mod:`kvstate.core.pace`). A step that prefilled nothing (a
        decode step, most of them) teaches it nothing, so it costs no call of the port."""
        if tokens > 0:
            self.service.measure_prefill(tokens, seconds)

    def measure(self, batch_bytes: int) -> None:
        """The batch holds ``batch_bytes`` after a step: admission goes by it, and kept RAM the batch
        has grown into is given back now (spilled first), not at the next fetch or insert (the core
        decides what, at the boundary)."""
        self.service.measure_batch(batch_bytes)
        if self.service.config.kv_budget_bytes is not None:
            self.service.boundary()
        held = batch_bytes + self.cache.nbytes
        self.peak_batch_bytes = max(self.peak_batch_bytes, batch_bytes)
        self.peak_held_bytes = max(self.peak_held_bytes, held)


#: ``BatchAdmission._admit``'s verdicts.
ADMITTED, WAIT, REFUSED = object(), object(), object()


def admitting_generator(server: Any, admission: BatchAdmission) -> type:
    """mlx-lm's ``ResponseGenerator`` whose dequeue admits each request under the KV budget, and whose
    requests served outside the batch keep their namespace."""

    class AdmittingResponseGenerator(server.ResponseGenerator):
        def _next_request(self, timeout=None):
            tokenizer = self.model_provider.tokenizer

            def tokenize(item):
                _, request, args = item
                if tokenizer is None or requested_key(self.model_provider, args.model) != admission.cache.model_key:
                    raise LookupError("not the served model: the server decides")
                return server.ResponseGenerator._tokenize(self, tokenizer, request, args)

            return admission.next_admitted(lambda wait: super(AdmittingResponseGenerator, self)._next_request(wait),
                                           tokenize, timeout)

        def _serve_single(self, request, stream):
            # Served outside the batch (a seed, --kv-bits, a draft model, images): the fetch and the
            # insert inside are this request's, in its namespace.
            queue, _, args = request
            seed = args.seed
            if isinstance(queue, ReplayingQueue) and queue.generation.resumed and seed is not None:
                admission.resumption.advance_sampler(queue.generation, args, vocabulary(self.model_provider.model))
                args.seed = None  # seeded, and advanced past the draws already made: not seeded again
            try:
                with admission.cache.serving(getattr(request[1], NAMESPACE_ATTRIBUTE, None),
                                             getattr(request[1], PIN_ATTRIBUTE, None)):
                    return super()._serve_single(request, stream)
            finally:
                args.seed = seed

        def _tokenize(self, tokenizer, request, args):
            done = admission.tokenized(request)
            if done is None:
                return super()._tokenize(tokenizer, request, args)
            prompt, segments, segment_types, initial_state, vision = done
            # the server edits segments in place: hand it fresh lists
            return list(prompt), [list(s) for s in segments], list(segment_types), initial_state, vision

    return AdmittingResponseGenerator


def measured_batch_generator(base: type, admission: BatchAdmission) -> type:
    """mlx-lm's ``BatchGenerator`` (``base``) that tells admission its rows, the caches it hands
    out for inserts, their ends, and its real bytes."""

    class MeasuredBatchGenerator(base):
        def insert_segments(self, segments, *args, **kwargs):
            uids = super().insert_segments(segments, *args, **kwargs)
            admission.placed(uids, segments, kwargs.get("all_tokens"), extract=lambda ids: base.extract_cache(self, ids))
            return uids

        def extract_cache(self, uids):
            caches = super().extract_cache(uids)
            for uid, (_, tokens) in caches.items():
                admission.publishing(uid, tokens)
            return caches

        def next(self):
            counters = getattr(self, "_counters", None)
            before = (counters.prompt_tokens, counters.prompt_time) if counters is not None else None
            admission.before_step()
            prompt_responses, generation_responses = super().next()
            admission.generated(generation_responses)
            if before is not None:
                admission.prefilled(counters.prompt_tokens - before[0], counters.prompt_time - before[1])
            admission.progressed(prompt_responses)
            due = admission.due_snapshots(prompt_responses)
            if due:
                for uid, (caches, tokens) in super().extract_cache(due).items():
                    admission.snapshot(uid, caches, tokens, getattr(self, "prefill_step_size", 0))
            finished = [r for r in generation_responses if r.finish_reason is not None]
            for response in finished:
                admission.publishing(response.uid, response.all_tokens, final=True)
            admission.ended([r.uid for r in finished])
            try:
                admission.measure(self.prompt_cache_nbytes)
            except Exception:  # noqa: BLE001 - a measure is advice; the projection still bounds the batch
                logging.exception("kvstate: could not measure the batch")
            return prompt_responses, generation_responses

        def remove(self, uids, *args, **kwargs):
            try:
                return super().remove(uids, *args, **kwargs)
            finally:
                admission.ended(list(uids), completed=False)

        def close(self):
            try:
                return super().close()
            finally:
                admission.close()

    return MeasuredBatchGenerator
