"""Pins: a prefix held in RAM, out of every rule's reach, until a time.

An operator warms a system prompt at start and pins it for good; a client pins its own prefix for a
while (an agent's context during a long tool call). A pin names tokens in a namespace; it holds the
RAM entries that serve the longest prefix of them RAM holds (a whole prefix, or a chain of blocks
and its snapshot). While pinned, no rule takes those entries from RAM: eviction, memory pressure,
idle demotion, nor a longer prefix that serves them (:func:`~kvstate.core.tiers.pinned`); their
saved copies on disk are the disk tier's as before. A pin runs out at its time, read from the
clock's ticks; pinning again extends it, never shortens it.

What pins may hold is bounded, so pinned state never starves the rest: at most ``pin_share`` of the
RAM capacity, and a request's pin lasts at most ``max_pin_seconds``. A pin over either bound is
refused with an error that names both numbers, and nothing changes.
"""

from __future__ import annotations

import math

from kvstate.core import events as ev
from kvstate.core.checks import ensure_open, size_text
from kvstate.core.draft import Draft, Step
from kvstate.core.errors import InvalidRequest, PinOverBudget, PinTooLong
from kvstate.core.replies import Pinned
from kvstate.core.state import ServiceConfig, ServiceState, check_namespace
from kvstate.core.tiers import chain_of, drop_if_superseded, pinned
from kvstate.core.tokens import WIDTH, packed


def pinned_bytes(state: ServiceState | Draft) -> tuple[int, int]:
    """``(entries, bytes)`` pinned now."""
    count = nbytes = 0
    for entry_id in state.pinned_until:
        if pinned(state, entry_id):
            count += 1
            nbytes += state.entries[entry_id].nbytes
    return count, nbytes


def pin_room(state: ServiceState | Draft) -> int:
    """The bytes pins may still hold: ``pin_share`` of the RAM capacity, less what is pinned now."""
    config = state.config
    return max(0, int(config.pin_share * config.ram_capacity_bytes) - pinned_bytes(state)[1])


def _check_seconds(config: ServiceConfig, seconds: float | None) -> None:
    """A pin lasts a positive, finite time of at most ``max_pin_seconds``, or (None) until the service
    closes: an operator's warm prompt."""
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise InvalidRequest(f"a pin lasts a positive number of seconds, got {seconds!r}")
    if seconds > config.max_pin_seconds:
        raise PinTooLong(f"a pin of {seconds:g} s is longer than the {config.max_pin_seconds:g} s this service "
                         f"allows (max_pin_seconds, kvstate serve --max-pin-seconds); ask for less")


def _over_budget(state: ServiceState | Draft, nbytes: int) -> str | None:
    """Why pinning ``nbytes`` more is refused now, or None where it fits."""
    room = pin_room(state)
    if nbytes <= room:
        return None
    config = state.config
    share = int(config.pin_share * config.ram_capacity_bytes)
    return (f"pinning {size_text(nbytes)} more would pass what pins may hold: {config.pin_share:g} of the RAM "
            f"capacity of {size_text(config.ram_capacity_bytes)} is {size_text(share)} (pin_share, kvstate serve "
            f"--pin-share), and {size_text(share - room)} is pinned now; pin a shorter prefix or for less time")


def pin(state: ServiceState, e: ev.Pin) -> Step:
    """Pin the RAM entries that serve the longest held prefix of ``e.tokens`` until ``e.seconds`` from
    now (None: until close); the reply says how many tokens and bytes are pinned, and until when (0
    tokens: RAM holds no prefix of them, counted ``pins_missed``)."""
    ensure_open(state, "pin")
    namespace = check_namespace(e.namespace)
    _check_seconds(state.config, e.seconds)
    until = math.inf if e.seconds is None else state.now + e.seconds
    data = packed(e.tokens)
    # One token past the end, never compared: a prefix may serve every token asked for.
    length, found = state.ram.index.longest(namespace, data + bytes(WIDTH))
    d = Draft(state)
    if found is None or length == 0:
        d.count("pins_missed")
        return d.step(Pinned(0, 0, until))
    entry = d.entries[found]
    held = chain_of(d, entry, length) if entry.chained else [entry]
    refusal = _over_budget(d, sum(block.nbytes for block in held if not pinned(d, block.id)))
    if refusal is not None:
        raise PinOverBudget(refusal)
    for block in held:
        d.pinned_until = d.pinned_until.set(block.id, max(until, d.pinned_until.get(block.id, -math.inf)))
    d.count("pins")
    return d.step(Pinned(length, sum(block.nbytes for block in held), until))


def pin_fits(state: ServiceState, e: ev.PinFits) -> Step:
    """Why a pin of state of ``e.nbytes`` for ``e.seconds`` would be refused now (None: it would fit), so
    a server refuses a request before it is served, not after: the reply is the refusal's text."""
    ensure_open(state, "pin_fits")
    try:
        _check_seconds(state.config, e.seconds)
    except PinTooLong as error:
        return Step(state, (), str(error))
    return Step(state, (), _over_budget(state, e.nbytes))


def expire(d: Draft) -> None:
    """Pins that have run out are forgotten (at a tick): what they held is every rule's again."""
    gone = [entry_id for entry_id, until in d.pinned_until.items() if until <= d.now]
    if gone:
        pins = d.pinned_until.mutate()
        for entry_id in gone:
            del pins[entry_id]
        d.pinned_until = pins.finish()
        for entry_id in gone:  # what a pin held back from a longer prefix that serves it goes now
            if entry_id in d.entries:
                drop_if_superseded(d, d.entries[entry_id])
