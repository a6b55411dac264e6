"""Whether a request should wait for state another request is computing right now.

Requests that arrive together and share a prefix (a system prompt nothing holds
yet) would each compute it. The first one publishes its caches at its segment
boundaries as its prefill passes them; a later one that waits for that publish
reuses the shared part instead of computing it again. :func:`shared_target`
decides, from what is computing and how far each has got, how many prompt
tokens a wait would let a request reuse; the caller waits (boundedly) while
that is worth it and the tokens are not reusable yet.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from kvstate.core import events as ev
from kvstate.core.draft import Step
from kvstate.core.state import ServiceState, check_namespace
from kvstate.core.tokens import Tokens, common_prefix, packed


@attrs.frozen
class Computing:
    """A request in prefill: its prompt, the positions at which it publishes its caches, and how
    many of its prompt tokens are computed so far."""

    prompt: Tokens
    boundaries: tuple[int, ...]
    position: int
    trimmable: bool


def shared_target(prompt: tuple[int, ...], reusable: int, computing: Iterable[Computing], min_gain: int) -> int:
    """The prompt tokens of ``prompt`` a publish still to come would let it reuse, when that is at
    least ``min_gain`` more than the ``reusable`` tokens it can reuse now; else 0 (do not wait).

    A publish at boundary ``b`` serves ``b`` tokens where the two prompts agree that far, and, from
    trimmable caches, the common prefix where they part before ``b``. A reuse always leaves the
    last prompt token to compute."""
    best = 0
    limit = len(prompt) - 1
    data = packed(prompt)  # once, not once per row
    for other in computing:
        shared = common_prefix(other.prompt, data)
        for boundary in other.boundaries:
            if boundary <= other.position:
                continue  # published already (or not kept): what is reusable says which
            if other.trimmable:  # trimmed to where the prompts part
                best = max(best, min(boundary, shared, limit))
            elif boundary <= shared and boundary <= limit:  # served whole, or not at all
                best = max(best, boundary)
    return best if best >= reusable + min_gain else 0


def shared_wait(state: ServiceState, e: ev.SharedWait) -> Step:
    """The tokens a wait for the rows in prefill would let the prompt reuse over what RAM serves it
    now (0: not worth a wait)."""
    namespace = check_namespace(e.namespace)
    reusable = state.ram.index.longest(namespace, e.prompt)[0]
    return Step(state, (), shared_target(e.prompt, reusable, e.computing, e.min_gain))
