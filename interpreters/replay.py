"""Replay a request trace through the service facade on the simulator.

Each trace request runs as a scheduler would run it: tick the clock to its
arrival, admit, acquire, prefill what was not reused (charged to the
simulator's cost model), publish the prompt's state, release. The figures
come from the service's own report, so they are the production decisions'.

Traces are Mooncake JSONL (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of chained 512-token blocks). A block id
stands for the block and everything before it, so block ``b`` becomes tokens
``b*512 .. b*512+511``: two prompts share a token prefix exactly when they
share leading blocks.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import attrs

from kvstate.core.errors import ContextLimitExceeded, OverBudget
from kvstate.core.report import Report
from kvstate.core.request import Request
from kvstate.interpreters.service import KvCacheService

BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake request record."""


@attrs.frozen
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt(self) -> tuple[int, ...]:
        """Token ids standing for the prompt: 512 per block, the last block cut to the input length."""
        blocks = (range(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS) for b in self.hash_ids)
        return tuple(itertools.islice(itertools.chain.from_iterable(blocks), self.input_length))


def trace_records(path: str | Path, kind: str, read: Callable[[dict], Any]) -> Iterator[tuple[int, Any]]:
    """``(line number, read(record))`` for every JSON line of ``path``; a bad line names itself."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield number, read(json.loads(line))
            except (ValueError, KeyError, TypeError) as error:
                raise TraceFormatError(f"{path}:{number}: not a {kind} record ({error})") from None


def read_mooncake(path: str | Path) -> Iterator[TraceRequest]:
    """The requests of a Mooncake JSONL trace, in file order."""
    def request_of(record: dict) -> TraceRequest:
        return TraceRequest(int(record["timestamp"]), int(record["input_length"]), int(record["output_length"]),
                            tuple(int(h) for h in record["hash_ids"]))
    for number, request in trace_records(path, "Mooncake request", request_of):
        if request.input_length < 1 or not request.hash_ids:
            raise TraceFormatError(f"{path}:{number}: a request needs input_length >= 1 and hash_ids")
        yield request


@attrs.frozen
class ReplayResult:
    """What a replay did, from the service's report and the simulator's cost model."""

    requests: int
    refused: int
    prompt_tokens: int
    reused_tokens: int
    hit_requests: int
    prefill_seconds: float
    prefill_seconds_saved: float
    wall_seconds: float
    report: Report

    @property
    def token_hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0


def replay(requests: Iterator[TraceRequest], service: KvCacheService, *, namespace: str = "default",
           limit: int | None = None, progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Run ``requests`` (at most ``limit``) through ``service``, whose interpreter must be the simulator."""
    simulator = service.interpreter
    rate = simulator.cost.prefill_tokens_per_second
    started = time.perf_counter()
    count = refused = prompt_tokens = reused = hits = 0
    for record in itertools.islice(requests, limit):
        service.tick(record.timestamp_ms / 1000)
        prompt = record.prompt()
        request = Request(prompt, max_tokens=max(1, record.output_length))
        try:
            if not service.admit(request):
                refused += 1  # sequential replay releases every request, so only a smaller budget waits
                service.release(request)
                continue
        except (ContextLimitExceeded, OverBudget):
            refused += 1
            continue
        state = service.acquire(request, namespace)
        caches = simulator.prefill(state.caches, prompt[state.reused_tokens:])
        if service.keeps(request):
            service.publish(request, namespace, prompt, caches)
        service.release(request, completed=True)
        service.boundary()
        count += 1
        prompt_tokens += len(prompt)
        reused += state.reused_tokens
        hits += state.reused_tokens > 0
        if progress is not None:
            progress(count)
    return ReplayResult(count, refused, prompt_tokens, reused, hits, simulator.stats.prefill_seconds,
                        reused / rate, time.perf_counter() - started, service.report())
