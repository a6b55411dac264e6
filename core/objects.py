"""Tensor objects: exact-key values (an encoder's output for one prepared image) kept under the
prefixes' RAM budget, policy and disk tier, in a namespace no caller's prefix can name."""

from __future__ import annotations

from kvstate.core import events as ev
from kvstate.core.checks import check_sizes, ensure_open
from kvstate.core.draft import Draft, Step
from kvstate.core.replies import NotKept, NotKeptReason, ObjectFound, ObjectMissing, Source
from kvstate.core.reuse import wait_for
from kvstate.core.state import OBJECTS, ServiceState, object_tokens
from kvstate.core.tiers import Offer, keep, touch
from kvstate.effects import effects as fx


def object_get(state: ServiceState, e: ev.ObjectGet) -> Step:
    """An exact-key object: a copy from RAM, else a read from disk, else a miss."""
    ensure_open(state, "objects.get")
    tokens = object_tokens(e.key)
    d = Draft(state)
    entry_id = state.ram.index.exact(OBJECTS, tokens)
    if entry_id is not None:
        touch(d, state.entries[entry_id])
        d.count("object_hits")
        d.out.append(fx.CloneEntry(entry_id, len(tokens), e.handle))
        return d.step(ObjectFound(e.handle, Source.RAM))
    entry_id = state.disk.index.exact(OBJECTS, tokens) if state.config.has_disk else None
    if entry_id is not None:
        d.reading = d.reading.set(entry_id, d.reading.get(entry_id, 0) + 1)
        reply = wait_for(d, None, e.handle, len(tokens))
        d.out.append(fx.RestoreEntry(entry_id, fx.DiskKey(OBJECTS, tokens), len(tokens), e.handle))
        return d.step(reply)
    d.count("object_misses")
    return d.step(ObjectMissing())


def object_put(state: ServiceState, e: ev.ObjectPut) -> Step:
    """Keep an object under the prefixes' RAM budget and policy, spilled like them."""
    ensure_open(state, "objects.put")
    tokens = object_tokens(e.key)
    check_sizes(e.nbytes, e.file_bytes)
    d = Draft(state)
    if state.config.ram_capacity_bytes == 0:
        d.count("not_kept")
        d.out.append(fx.DropPublished(e.handle))
        return d.step(NotKept(NotKeptReason.TOO_LARGE))
    reply = keep(d, Offer(OBJECTS, tokens, e.handle, e.nbytes, e.file_bytes, trimmable=False, notify=False))
    return d.step(reply)
