"""Replay a trace through the service on the simulator: the production decisions, one request at a time.

This is the one replay through the service: ``kvstate replay`` prints it and
the lab's whole-prefix granularity sweeps it. Each request runs as a
scheduler would run it: the clock ticks to its arrival (where a rule reads the
clock), it is admitted under the KV budget (where one is set) and acquires the
longest kept prefix in one call, extends the caches over the blocks it did not
reuse, publishes the prompt's state and releases. The figures come from what
the service replied.

Positions are 512-token blocks (``ModelSpec.per_block``): a trace names its
prompts by chained block ids, so two prompts share a prefix exactly when
they share leading ids. One extra position per prompt, unique to it, stands
for the token the model must compute, so a full match still leaves work.

A trace's last block of a prompt is usually partial, and the next turn's block
at that position holds more tokens, so it has another id. Caches that serve
any shorter prefix (attention) are kept whole and cut back on reuse. Caches
that cannot be cut back (a recurrent layer's state, a full sliding window)
serve only an exact prefix, so they are kept at the prompt's last full block,
where the next turn can reuse them, as engines that cache hybrid models' state
keep it at block boundaries.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable

import attrs

from kvstate.core.errors import ContextLimitExceeded, OverBudget
from kvstate.core.report import Report
from kvstate.core.request import Request
from kvstate.interpreters.lab.traces import BLOCK_TOKENS, TraceRequest
from kvstate.interpreters.service import KvCacheService
from kvstate.interpreters.simulator import CostModel
from kvstate.models.catalogue import model_spec
from kvstate.models.spec import ModelSpec

#: Where the per-prompt positions start: far above any block id a trace holds.
SENTINEL = 1 << 60


@attrs.frozen
class Outcome:
    """What one replay measured (lengths in tokens, accesses in blocks)."""

    requests: int
    hit_requests: int
    prompt_tokens: int
    reused_tokens: int
    block_accesses: int
    block_hits: int
    disk_bytes_written: int
    disk_bytes_read: int
    seconds: float
    refused: int = 0
    report: Report | None = attrs.field(default=None, eq=False)

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def write_amplification(self) -> float | None:
        """Bytes written to the disk tier per byte later read back (None: written, never read)."""
        if self.disk_bytes_read:
            return self.disk_bytes_written / self.disk_bytes_read
        return None if self.disk_bytes_written else 0.0

    def prefill_seconds(self, cost: CostModel) -> float:
        """Seconds the cost model gives the prompt tokens reuse did not cover."""
        return (self.prompt_tokens - self.reused_tokens) / cost.prefill_tokens_per_second

    def prefill_seconds_saved(self, cost: CostModel) -> float:
        return (self.reused_tokens / cost.prefill_tokens_per_second
                - self.disk_bytes_read / cost.restore_bytes_per_second)


def replay_service(model: str | ModelSpec, *, refuse_past_context: bool = True, **options) -> KvCacheService:
    """A simulated service over ``model`` counted in 512-token blocks (``options`` as ``simulated`` takes).

    ``refuse_past_context=False`` drops the context limit: a recorded trace's
    requests already ran, so a sweep of cache decisions refuses none for its length.
    """
    spec = (model_spec(model) if isinstance(model, str) else model).per_block(BLOCK_TOKENS)
    if not refuse_past_context:
        spec = attrs.evolve(spec, context_limit=None)
    return KvCacheService.simulated(spec, **options)


#: Which chunk snapshots a request's prefill offers, given the request, the blocks its state is kept
#: at and the blocks it reused: ``(blocks, chunk)`` pairs in ascending order, each offered before the
#: kept state with ``chunk`` as :meth:`KvCacheService.publish` takes it.
ChunkOffers = Callable[[TraceRequest, tuple, int], Iterable[tuple[int, bool]]]


def replay(requests: Iterable[TraceRequest], service: KvCacheService, *, limit: int | None = None,
           progress: Callable[[int], None] | None = None, chunk_offers: ChunkOffers | None = None) -> Outcome:
    """Run ``requests`` (at most ``limit``) through ``service``, built by :func:`replay_service`;
    ``chunk_offers`` says which snapshots mid-prefill each request offers (none without it)."""
    started = time.perf_counter()
    config = service.config
    # The clock reaches the service only where a rule reads it (idle demotion, idle writes, the write-rate cap).
    clocked = (config.demote_idle_after is not None or config.write_idle_after is not None
               or config.write_bytes_per_hour is not None)
    keeps = None  # whether published state may be kept: the same for every request a trace makes
    spec = config.model
    count = refused = hit_requests = reused = prompt = accesses = block_hits = 0
    for number, request in enumerate(itertools.islice(requests, limit)):
        if clocked:
            service.tick(request.arrival)
        lease = Request(request.blocks + (SENTINEL + number,), max(1, -(-request.output_length // BLOCK_TOKENS)))
        try:
            state = service.try_acquire(lease, request.namespace)
        except (ContextLimitExceeded, OverBudget):
            refused += 1
            continue
        if state is None:
            refused += 1  # one request at a time releases each, so only a smaller budget waits
            continue
        if keeps is None:
            keeps = service.keeps(lease)
        kept, kept_length = request.blocks, request.input_length
        if request.kept is not None and request.kept[:state.reused_tokens] == request.blocks[:state.reused_tokens]:
            # a server's recording: the state it kept covers the reply too, so the next turn reuses it
            kept = request.kept
            kept_length = (request.kept_length if request.kept_length is not None
                           else min(request.input_length + request.output_length, len(kept) * BLOCK_TOKENS))
        if kept_length % BLOCK_TOKENS and not spec.trimmable_at(len(kept)):
            kept = kept[:-1]  # the last block is partial: keep the state where the next turn can use it
        if keeps and kept and state.reused_tokens <= len(kept):
            offered = list(chunk_offers(request, kept, state.reused_tokens)) if chunk_offers else []
            for (end, chunk), following in zip(offered, [end for end, _ in offered[1:]] + [len(kept)]):
                # a chunk says where the next is taken: only the last before a branch point is kept as such
                service.publish(lease, request.namespace, kept[:end], state.caches.extended(
                    kept[state.reused_tokens:end]), chunk=chunk, next_chunk=kept[end:following] if chunk else ())
            caches = state.caches.extended(kept[state.reused_tokens:])
            service.publish(lease, request.namespace, kept, caches)
        service.release(lease)
        count += 1
        hit_requests += state.reused_tokens > 0
        reused += min(state.reused_tokens * BLOCK_TOKENS, request.input_length)
        prompt += request.input_length
        accesses += len(request.blocks)
        block_hits += state.reused_tokens
        if progress is not None:
            progress(count)
    stats = service.interpreter.stats
    return Outcome(count, hit_requests, prompt, reused, accesses, block_hits, stats.bytes_written,
                   stats.bytes_read, time.perf_counter() - started, refused, service.report())
