"""One replay of a trace at one (policy, capacity): block granularity or whole-prefix granularity.

Block granularity keeps fixed 512-token blocks, as paged engines do, in the
lab's block caches; a request's prompt accesses its blocks in order. Prefix
granularity runs every request through the service itself (the core's
transitions on the simulator), which keeps whole prefixes as the MLX
interpreter does; positions are 512-token blocks, and one extra position
per prompt stands for the token the model must compute.

Both report the same figures: the share of requests that reused anything,
prompt tokens covered by the reused leading run over all prompt tokens, block
accesses found in the cache over all block accesses, bytes written to and read
from the disk tier, and the prefill seconds the cost model says reuse saved
(reused tokens at the prefill rate, less the time to read what came from disk).
"""

from __future__ import annotations

import time

import attrs

from kvstate.core.policies import POLICIES
from kvstate.interpreters.lab.blocks import BLOCK_POLICIES, LRUBlocks, BeladyBlocks, next_uses
from kvstate.interpreters.lab.traces import Trace
from kvstate.interpreters.replay import BLOCK_TOKENS
from kvstate.interpreters.simulator import CostModel
from kvstate.models.spec import ModelSpec

#: Policies the service itself can run (prefix granularity); the others need the whole trace or are lab-only.
#: The service's own policies: whatever the core registers (a new policy is one file and one line there).
PREFIX_POLICIES = tuple(POLICIES)
SENTINEL = 1 << 60


class PolicyNotAtGranularity(ValueError):
    """A policy that one granularity does not have (Belady and ARC are block-granularity only)."""


@attrs.frozen
class Outcome:
    """What one replay measured."""

    requests: int
    hit_requests: int
    prompt_tokens: int
    reused_tokens: int
    block_accesses: int
    block_hits: int
    disk_bytes_written: int
    disk_bytes_read: int
    seconds: float

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    def prefill_seconds_saved(self, cost: CostModel) -> float:
        return (self.reused_tokens / cost.prefill_tokens_per_second
                - self.disk_bytes_read / cost.restore_bytes_per_second)


def block_bytes(model: ModelSpec) -> int:
    """Bytes one 512-token block of KV holds for ``model`` (fixed recurrent state not counted)."""
    return model.bytes_for(BLOCK_TOKENS) - model.fixed_bytes


def unbounded(trace: Trace) -> Outcome:
    """The ceiling: every block ever seen is still held (prefix semantics: the leading run seen)."""
    seen: set[int] = set()
    hit_requests = prompt = reused = hits = accesses = 0
    for request in trace.requests:
        leading = 0
        for block in request.blocks:
            if block not in seen:
                break
            leading += 1
        hits += sum(1 for block in request.blocks if block in seen)
        accesses += len(request.blocks)
        seen.update(request.blocks)
        hit_requests += leading > 0
        prompt += request.input_length
        reused += min(leading * BLOCK_TOKENS, request.input_length)
    return Outcome(len(trace.requests), hit_requests, prompt, reused, accesses, hits, 0, 0, 0.0)


def run_blocks(trace: Trace, policy: str, capacity_blocks: int, disk_blocks: int | None,
               model: ModelSpec) -> Outcome:
    """Replay ``trace`` through a block cache of ``capacity_blocks`` (and an LRU disk tier behind it)."""
    if policy not in BLOCK_POLICIES:
        raise PolicyNotAtGranularity(f"unknown policy {policy!r}; block granularity has: {', '.join(BLOCK_POLICIES)}")
    started = time.perf_counter()
    if capacity_blocks < 1:
        capacity_blocks = 0
    if policy == "belady":
        accesses = [block for request in trace.requests for block in request.blocks]
        cache = BeladyBlocks(max(capacity_blocks, 1), next_uses(accesses))
        at = cache.at
    else:
        cache = BLOCK_POLICIES[policy](max(capacity_blocks, 1))
        at = None
    disk = LRUBlocks(disk_blocks) if disk_blocks else None
    if disk is None and at is None and capacity_blocks:
        return _run_ram_only(trace, cache, started)
    lookup, insert = cache.lookup, cache.insert
    per_block = block_bytes(model)
    position = hits = hit_requests = reused = prompt = written = read = 0
    for request in trace.requests:
        leading, still_leading = 0, True
        for block in request.blocks:
            if at is not None:
                at(position)
            position += 1
            if capacity_blocks and lookup(block):
                hits += 1
                leading += still_leading
                continue
            if disk is not None and disk.lookup(block):
                hits += 1
                read += per_block
                leading += still_leading
            else:
                still_leading = False
            if capacity_blocks:
                victim = insert(block)
                if victim is not None and disk is not None and not disk.lookup(victim):
                    disk.insert(victim)
                    written += per_block
        hit_requests += leading > 0
        prompt += request.input_length
        reused += min(leading * BLOCK_TOKENS, request.input_length)
    return Outcome(len(trace.requests), hit_requests, prompt, reused, position, hits, written, read,
                   time.perf_counter() - started)


def _run_ram_only(trace: Trace, cache, started: float) -> Outcome:
    """The common case, one tier and an online policy: the same replay with nothing else in the loop."""
    lookup, insert = cache.lookup, cache.insert
    accesses = hits = hit_requests = reused = prompt = 0
    for request in trace.requests:
        leading, still_leading = 0, True
        for block in request.blocks:
            if lookup(block):
                hits += 1
                if still_leading:
                    leading += 1
            else:
                still_leading = False
                insert(block)
        accesses += len(request.blocks)
        hit_requests += leading > 0
        prompt += request.input_length
        reused += min(leading * BLOCK_TOKENS, request.input_length)
    return Outcome(len(trace.requests), hit_requests, prompt, reused, accesses, hits, 0, 0,
                   time.perf_counter() - started)


def run_prefixes(trace: Trace, policy: str, ram_bytes: int, disk_bytes: int | None, model: ModelSpec) -> Outcome:
    """Replay ``trace`` through the service (core transitions, simulator) keeping whole prefixes."""
    from kvstate.core.request import Request
    from kvstate.interpreters.service import KvCacheService

    if policy not in PREFIX_POLICIES:
        raise PolicyNotAtGranularity(f"{policy!r} runs at block granularity only; the service's policies are: "
                                     f"{', '.join(PREFIX_POLICIES)}")
    started = time.perf_counter()
    # The trace's requests already ran (some past this model's context): the lab replays its cache
    # decisions, so no request is refused for its length.
    spec = attrs.evolve(model.per_block(BLOCK_TOKENS), context_limit=None)
    service = KvCacheService.simulated(spec, ram_bytes=ram_bytes, disk_bytes=disk_bytes, policy=policy)
    hit_requests = reused = prompt = accesses = block_hits = 0
    for number, request in enumerate(trace.requests):
        positions = request.blocks + (SENTINEL + number,)
        lease = Request(positions, 1)
        state = service.acquire(lease, request.namespace)
        caches = state.caches.extended(request.blocks[state.reused_tokens:])
        if service.keeps(lease):
            service.publish(lease, request.namespace, request.blocks, caches)
        service.release(lease)
        hit_requests += state.reused_tokens > 0
        reused += min(state.reused_tokens * BLOCK_TOKENS, request.input_length)
        prompt += request.input_length
        accesses += len(request.blocks)
        block_hits += state.reused_tokens
    stats = service.interpreter.stats
    return Outcome(len(trace.requests), hit_requests, prompt, reused, accesses, block_hits, stats.bytes_written,
                   stats.bytes_read, time.perf_counter() - started)
