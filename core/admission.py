"""What admitting a request costs against the KV budget, summed or as one padded batch.

A request is charged its projected bytes: its caches at prompt + max_tokens,
from the model geometry. How charges add up depends on how requests run:

- one cache each (the default): the charges sum;
- one batch padded to its longest row (``ServiceConfig.batch_padding_step``):
  mlx-lm's ``BatchGenerator`` pads every row on the left to the longest and
  grows its caches a step of tokens at a time, from wherever they end, so ``n``
  live requests hold up to ``n`` rows of the longest one's positions plus a step
  less one. A short request that joins a long one costs the long one's bytes.
  Rows that start from reused prefixes are merged at the longest reuse and their
  rest padded to the longest rest, so a row's positions are the longest reuse
  plus the longest rest: each lease's reuse is estimated when it is admitted
  (what RAM or disk holds for it then) and known once it is acquired.

What the running caches were last measured holding (``BatchMeasured``) tops the
projection up: if the caches hold more than the geometry projects (a cache kind
the projection misses, an allocator's slack), admission goes by the measure.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvstate.core.request import Request
from kvstate.core.state import ServiceConfig, ServiceState


def wanted_tokens(request: Request) -> int:
    """Positions ``request``'s caches hold once it has generated ``max_tokens``."""
    return len(request.prompt) + request.max_tokens


def _padded(tokens: int, step: int) -> int:
    """The most positions a batch row allocates to hold ``tokens``: a growth step can start at
    any position, so up to a step less one beyond the last."""
    return tokens + step - 1


def expected_reuse(state: ServiceState, namespace: str, prompt: tuple[int, ...]) -> int:
    """The prompt tokens a request in ``namespace`` would start from now: the longest prefix RAM or
    disk holds for ``prompt`` (all but its last token at most, which the request computes)."""
    held = state.ram.index.longest(namespace, prompt)[0]
    if state.config.has_disk:
        held = max(held, state.disk.index.longest(namespace, prompt)[0])
    return max(0, min(held, len(prompt) - 1))


def alone_bytes(config: ServiceConfig, tokens: int) -> int:
    """Bytes a request of ``tokens`` positions (prompt + max_tokens) is charged running alone (in a
    padded batch, with the step's slack)."""
    step = config.batch_padding_step
    return config.model.bytes_for(tokens if step is None else _padded(tokens, step))


def own_bytes(state: ServiceState, request: Request) -> int:
    """Bytes ``request`` is charged running alone."""
    return alone_bytes(state.config, wanted_tokens(request))


def charge(state: ServiceState, rows: Iterable[tuple[Request, int]]) -> int:
    """The projected bytes of requests admitted together, each with the prompt tokens it starts from.

    In a padded batch every row holds the longest reuse plus the longest part that follows one
    (mlx-lm merges the rows' caches at the longest reuse, then prefills their rest padded to the
    longest): rows that start from reused prefixes of different lengths hold more than the longest
    row."""
    step = state.config.batch_padding_step
    if step is None:
        return sum(own_bytes(state, request) for request, _ in rows)
    count = longest_reuse = longest_rest = 0
    for request, reused in rows:
        count += 1
        longest_reuse = max(longest_reuse, reused)
        longest_rest = max(longest_rest, wanted_tokens(request) - reused)
    return count * state.config.model.bytes_for(_padded(longest_reuse + longest_rest, step)) if count else 0


def admitted_rows(leases: Iterable) -> list[tuple[Request, int]]:
    """The admitted ones of ``leases``, each its request and the prompt tokens it starts from."""
    return [(lease.request, lease.reused) for lease in leases if lease.admitted]


def charge_with(state: ServiceState, request: Request, own: int | None = None, reused: int = 0) -> int:
    """The projected bytes once ``request`` (starting from ``reused`` tokens) is admitted beside the
    admitted ones (``own``: its :func:`own_bytes`, where the caller has it)."""
    if state.config.batch_padding_step is None:
        return state.projected_bytes + (own_bytes(state, request) if own is None else own)
    return charge(state, [*admitted_rows(state.leases.values()), (request, reused)])


def charge_without(state: ServiceState, released: Any, leases: Iterable) -> int:
    """The projected bytes once the admitted lease ``released`` is gone and ``leases`` remain."""
    if state.config.batch_padding_step is None:
        return state.projected_bytes - released.admitted_bytes
    return charge(state, admitted_rows(leases))


def charge_now(state: ServiceState, leases: Iterable) -> int:
    """The projected bytes of the admitted ``leases`` as they stand (a padded batch's charge moves
    when an acquire finds what a row really reuses)."""
    if state.config.batch_padding_step is None:
        return state.projected_bytes
    return charge(state, admitted_rows(leases))


def has_room(state: ServiceState, projected: int) -> bool:
    """Whether the budget holds ``projected`` bytes of admitted requests, topped up by what the
    running caches were last measured holding beyond the current projection."""
    budget = state.config.kv_budget_bytes
    if budget is None:
        return True
    return projected + max(0, state.measured_bytes - state.projected_bytes) <= budget


def held_bound(state: ServiceState) -> int:
    """The most the admitted requests' caches may hold: the projection or the last measure."""
    return max(state.projected_bytes, state.measured_bytes)
