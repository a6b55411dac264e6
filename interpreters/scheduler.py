"""The reference scheduler: kvstate embedded in an mlx-lm generation loop, the example to copy.

It embeds the service exactly as DESIGN.md's port says. A request is admitted
(or waits), acquires its state, prefills only the tokens that state does not
cover, and publishes a snapshot at the end of the prompt (the boundary a
non-trimmable model can reuse). Then it decodes one token per round, and
replayable generations are checkpointed every N tokens. At the end it
publishes its final state and is released; every round ends at a
``boundary()``.

Rows are scheduled continuously: a request joins as soon as it is admitted
and leaves when done. Each row steps with its own mlx-lm caches (batch of
one), which works for every cache kind. Sampling is greedy at temperature 0,
else drawn with a key that depends only on the request's seed and the
token's index, so a generation resumed from a checkpoint continues with the
same tokens.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import attrs
import mlx.core as mx

from kvstate.core.replies import Source
from kvstate.core.request import Request
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.service import AcquiredState, KvCacheService


def sample(logits: mx.array, seed: int, index: int, temperature: float) -> int:
    """Token ``index`` of a generation seeded with ``seed``: argmax at temperature 0."""
    if temperature <= 0:
        return int(mx.argmax(logits, axis=-1).item())
    key = mx.random.key((seed * 1_000_003 + index) % (1 << 63))
    return int(mx.random.categorical(logits / temperature, key=key).item())


@attrs.define
class Row:
    """One request being generated."""

    request: Request
    namespace: str
    caches: list | None = None
    generated: list[int] = attrs.Factory(list)
    reused_tokens: int = 0
    source: Source = Source.FRESH
    resumed: bool = False
    seed: int = 0
    started: float = 0.0
    first_token_seconds: float | None = None
    done: bool = False


@attrs.frozen
class Finished:
    """What a request produced and how its state was found."""

    request: Request
    tokens: tuple[int, ...]
    reused_tokens: int
    source: Source
    resumed: bool
    first_token_seconds: float


class Scheduler:
    """Runs requests on ``model`` over ``service``."""

    def __init__(self, model: Any, service: KvCacheService, *, temperature: float = 0.0,
                 eos_token: int | None = None, clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.service = service
        self.temperature = temperature
        self.eos_token = eos_token
        self.clock = clock
        self.every = service.config.checkpoint_every_tokens

    def _forward(self, tokens: Iterable[int], caches: list) -> mx.array:
        logits = self.model(mx.array([list(tokens)]), cache=caches)[0, -1]
        mx.eval(logits)
        return logits

    def _start(self, row: Row, state: AcquiredState) -> None:
        """Given the acquired ``state``: prefill what is not covered, publish the prompt's snapshot,
        sample the first token."""
        service, request = self.service, row.request
        row.caches, row.reused_tokens, row.source = state.caches, state.reused_tokens, state.source
        continuation = request.continuation
        row.seed = continuation.seed if continuation is not None else 0
        if state.resumed is not None:  # the caches cover prompt + generated; the pending token is next
            row.resumed = True
            row.seed = state.resumed.seed  # the seed the generation started with
            row.generated = list(state.resumed_tokens[len(request.prompt):]) + [state.resumed.pending_token]
            row.first_token_seconds = self.clock() - row.started
            return
        prompt = request.prompt
        prefill_started = self.clock()
        logits = self._forward(prompt[state.reused_tokens:], row.caches)
        service.measure_prefill(len(prompt) - state.reused_tokens, self.clock() - prefill_started)
        if service.keeps(request):  # the end of the prompt: a boundary every cache kind can reuse
            service.publish(request, row.namespace, prompt, mlx_caches.clone(row.caches, len(prompt)))
        row.generated.append(sample(logits, row.seed, 0, self.temperature))
        row.first_token_seconds = self.clock() - row.started

    def _step(self, row: Row) -> None:
        """Feed the pending token, sample the next; checkpoint replayable generations every N tokens."""
        request = row.request
        if len(row.generated) >= request.max_tokens or (self.eos_token is not None
                                                         and row.generated[-1] == self.eos_token):
            row.done = True
            return
        if self.every and request.continuation is not None and len(row.generated) % self.every == 0:
            fed = row.generated[:-1]
            self.service.checkpoint(request, mlx_caches.clone(row.caches, len(request.prompt) + len(fed)),
                                    request.prompt + tuple(fed), len(fed), pending_token=row.generated[-1])
        logits = self._forward([row.generated[-1]], row.caches)
        row.generated.append(sample(logits, row.seed, len(row.generated), self.temperature))

    def _finish(self, row: Row) -> Finished:
        request = row.request
        fed = tuple(row.generated[:-1])
        if self.service.keeps(request):
            self.service.publish(request, row.namespace, request.prompt + fed, row.caches)
        self.service.release(request, completed=True)
        return Finished(request, tuple(row.generated), row.reused_tokens, row.source, row.resumed,
                        row.first_token_seconds)

    def run(self, requests: Iterable[tuple[Request, str]], on_finish: Callable[[Finished], None] | None = None
            ) -> list[Finished]:
        """Run ``(request, namespace)`` pairs to completion, admitting in order as the budget allows."""
        waiting = list(requests)
        active: list[Row] = []
        finished: list[Finished] = []
        while waiting or active:
            while waiting:  # admitted and acquired in one call, in order, while the budget has room
                request, namespace = waiting[0]
                started = self.clock()
                state = self.service.try_acquire(request, namespace)
                if state is None:
                    break
                waiting.pop(0)
                row = Row(request, namespace)
                row.started = started
                self._start(row, state)
                active.append(row)
            if not active:
                raise RuntimeError("the first waiting request is not admitted while nothing runs")
            for row in list(active):
                self._step(row)
                if row.done:
                    active.remove(row)
                    result = self._finish(row)
                    finished.append(result)
                    if on_finish is not None:
                        on_finish(result)
            self.service.boundary()
        return finished
