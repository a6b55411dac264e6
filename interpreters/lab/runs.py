"""One replay of a trace at one (policy, capacity): block granularity or whole-prefix granularity.

Block granularity keeps fixed 512-token blocks, as paged engines do, in the
lab's block caches; a request's prompt accesses its blocks in order. Prefix
granularity is ``kvstate replay``'s own replay (``interpreters/lab/replay.py``):
every request runs through the service itself, the core's transitions on the
simulator, which keeps whole prefixes as the MLX interpreter does.

Both report the same figures: the share of requests that reused anything,
prompt tokens covered by the reused leading run over all prompt tokens, block
accesses found in the cache over all block accesses, bytes written to and read
from the disk tier, and the prefill seconds the cost model says reuse saved
(reused tokens at the prefill rate, less the time to read what came from disk).
"""

from __future__ import annotations

import time

from kvstate.core.policies import POLICIES
from kvstate.interpreters.lab.blocks import BLOCK_POLICIES, LRUBlocks, BeladyBlocks, next_uses
from kvstate.interpreters.lab.traces import BLOCK_TOKENS, Trace
from kvstate.interpreters.lab.replay import Outcome, replay, replay_service
from kvstate.models.spec import ModelSpec

#: The service's own policies: whatever the core registers (a new policy is one file and one line there).
PREFIX_POLICIES = tuple(POLICIES)


class PolicyNotAtGranularity(ValueError):
    """A policy that one granularity does not have (Belady and ARC are block-granularity only)."""


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


def ceiling(trace: Trace, granularity: str, model: ModelSpec) -> Outcome:
    """What an unbounded cache reuses at ``granularity``: every block ever seen, or (whole prefixes)
    the same replay as the policies' with room for everything, so the reuse rules of ``model``'s
    geometry apply to it too (state that cannot be cut back serves only the prefix it covers)."""
    if granularity == "prefix":
        return run_prefixes(trace, "lru", 1 << 62, None, model)
    return unbounded(trace)


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
    lookup, insert, begin = cache.lookup, cache.insert, getattr(cache, "begin", None)
    per_block = block_bytes(model)
    position = hits = hit_requests = reused = prompt = written = read = 0
    for request in trace.requests:
        if begin is not None:
            begin()
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
    lookup, insert, begin = cache.lookup, cache.insert, getattr(cache, "begin", None)
    accesses = hits = hit_requests = reused = prompt = 0
    for request in trace.requests:
        if begin is not None:
            begin()
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


def run_prefixes(trace: Trace, policy: str, ram_bytes: int, disk_bytes: int | None, model: ModelSpec,
                 **options) -> Outcome:
    """Replay ``trace`` through the service (core transitions, simulator) keeping whole prefixes;
    ``options`` are the service's own (a write rule, say: ``write_idle_after``)."""
    if policy not in PREFIX_POLICIES:
        raise PolicyNotAtGranularity(f"{policy!r} runs at block granularity only; the service's policies are: "
                                     f"{', '.join(PREFIX_POLICIES)}")
    # The trace's requests already ran (some past this model's context): the lab replays its cache
    # decisions, so no request is refused for its length.
    service = replay_service(model, refuse_past_context=False, ram_bytes=ram_bytes, disk_bytes=disk_bytes,
                             policy=policy, **options)
    return replay(trace.requests, service)
