"""What each tier holds of blocks, told as it changes: the events a fleet's router reads.

A router that sends each conversation to the server holding most of its prefix needs to know, per
server, which blocks each tier holds (vLLM's KV events, read by NVIDIA Dynamo's KV router and
llm-d's indexer). Where ``block_events`` is on, every transition that makes a tier hold a full block
emits :class:`~kvstate.effects.effects.BlockStored` after the effects that put it there, and every
one that makes a tier let one go emits :class:`~kvstate.effects.effects.BlockRemoved`. They are
emitted exactly where a tier's policy is told (an entry enters or leaves it), so they follow what
the tier holds, not what was asked: a block enters the disk tier once its write is durable, not
when the write starts.

With a shared tier (:mod:`~kvstate.core.remote`), a block this server learns the tier holds (it
wrote it, found it there, or fetched it) is told once with the medium ``"remote"``, and never
removed: no server drops the store's objects.

Only full blocks are told: a partial last block covers fewer tokens than a block, and a router
hashes whole blocks. Snapshots (the state of layers that cannot be cut) are not blocks.
:func:`held` answers what the tiers hold now, for an observer that starts watching later (each
block's :class:`~kvstate.effects.effects.BlockStored`, parents first).
"""

from __future__ import annotations

from kvstate.core.blocks import namespace_key
from kvstate.core.state import IN_RAM, ON_DISK, Entry, ServiceState
from kvstate.core.tokens import WIDTH, ids_of
from kvstate.effects import effects as fx

#: The tiers' names in the events (vLLM's ``medium``).
RAM = "ram"
DISK = "disk"
#: The tier a fleet shares (:mod:`~kvstate.core.remote`): told once a server learns it holds a block
#: (wrote it, found it there, or fetched it), and never removed (a server never drops its objects).
REMOTE = "remote"


def told(state, entry: Entry) -> bool:
    """Whether ``entry``'s presence in a tier is told: a full block, with ``block_events`` on."""
    config = state.config
    return (config.block_events and entry.block is not None
            and len(entry.packed) // WIDTH - entry.start == config.block_tokens)


def name_of(state, entry: Entry) -> fx.BlockName:
    """Block ``entry``'s name: its namespace, key, parent's key and own tokens."""
    parent = state.entries.get(entry.parent) if entry.parent is not None else None
    parent_key = parent.block if parent is not None else namespace_key(entry.namespace)
    return fx.BlockName(entry.namespace, entry.block, parent_key, entry.start, ids_of(entry.packed[entry.start * WIDTH:]))


def stored(d, entry: Entry, medium: str) -> None:
    """Tier ``medium`` now holds ``entry`` (called where its policy is told so)."""
    if told(d, entry):
        d.out.append(fx.BlockStored(name_of(d, entry), medium))


def removed(d, entry: Entry, medium: str) -> None:
    """Tier ``medium`` no longer holds ``entry`` (called where its policy is told so)."""
    if told(d, entry):
        d.out.append(fx.BlockRemoved(entry.namespace, entry.block, medium))


def on_remote(d, name: fx.BlockName) -> None:
    """This server learnt the shared tier holds block ``name`` (not known before): told, where it is a
    full block."""
    config = d.config
    if config.block_events and len(name.tokens) == config.block_tokens:
        d.out.append(fx.BlockStored(name, REMOTE))


def held(state: ServiceState) -> tuple[fx.BlockStored, ...]:
    """What the tiers hold now, as the events that would have told it: RAM's blocks, the disk's, then
    those this server learnt the shared tier holds, each tier's parents before the blocks that extend
    them (a pass over every entry)."""
    out = []
    for medium, residences in ((RAM, IN_RAM), (DISK, ON_DISK)):
        blocks = [e for e in state.entries.values() if e.residence in residences and told(state, e)]
        blocks.sort(key=lambda e: (e.namespace, e.start))  # a parent starts before what extends it
        out.extend(fx.BlockStored(name_of(state, e), medium) for e in blocks)
    remote = sorted((name for name in state.remote_held.values()
                     if name is not None and len(name.tokens) == state.config.block_tokens),
                    key=lambda name: (name.namespace, name.start))
    out.extend(fx.BlockStored(name, REMOTE) for name in remote)
    return tuple(out)
