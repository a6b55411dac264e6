"""The shared tier: what a server fetches from an object store its fleet shares, and what it offers it.

Below RAM and the disk, a fleet may share a tier of saved blocks (``remote_tier``): an object store
every server reads and writes. The disk caches what this server fetches from there, so a fetched
block is a saved block like any other from then on (it enters the disk tier as a scan's would), and
only the shared tier's reads and writes are decided here:

- **what to fetch** (:func:`lookup`): when a request arrives, the full blocks of its prompt past the
  longest chain this server holds in any tier, one chain, in order, and then the longest partial
  block after them that the prompt goes on with (the end of a conversation another server kept);
  the interpreter reads them until the store lacks one. Only where the read pays: fetching the
  bytes and reading them back from disk must beat prefilling their tokens, by the paces measured
  (:mod:`~kvstate.core.pace`; fetches are timed as they land). A chain already being fetched is
  not asked for twice.
- **what to offer** (``tiers.spill_done``): every block this server writes to its disk, once its
  write is durable, a partial last block too (the next turn of a conversation moved to another
  server reads it); the store keeps the first server's object of a block (a conditional write), so
  a block is written once across the fleet. Blocks fetched from there are not offered back. A
  flush or a clean stop offers every saved block the tier is not known to hold
  (``tiers.offer_what_the_remote_lacks``): writes that failed while it was down, blocks found at
  start.

Every failure of the store is counted and changes nothing else: requests go on from the local
tiers.
"""

from __future__ import annotations

from kvstate.core import block_events, events as ev
from kvstate.core.blocks import chain, namespace_key
from kvstate.core.checks import ensure_open
from kvstate.core.draft import Draft, Step
from kvstate.core.lifecycle import enter_saved_blocks
from kvstate.core.pace import remote_measured
from kvstate.core.request import as_tokens
from kvstate.core.state import Residence as R, ServiceState, check_namespace
from kvstate.core.tokens import packed
from kvstate.effects import completions as done
from kvstate.effects import effects as fx


def lookup(state: ServiceState, e: ev.RemoteLookup) -> Step:
    """Start fetching the prompt's blocks this server lacks from the shared tier, where that pays: its
    full blocks past the longest chain held in any tier, then the longest partial block after them
    whose tokens the prompt goes on with. Whether a fetch of them is in flight now."""
    config = state.config
    if not config.remote_tier:
        return Step(state, (), False)
    ensure_open(state, "remote_lookup")
    namespace = check_namespace(e.namespace)
    prompt = as_tokens(e.prompt)
    if not config.model.trimmable_at(len(prompt)):
        return Step(state, (), False)  # its blocks serve nothing without a snapshot, which stays local
    size = config.block_tokens
    keys = chain(namespace, packed(prompt), size)
    held = 0
    while held < len(keys) and (namespace, keys[held]) in state.blocks:
        held += 1
    missing = keys[held:]
    full_end = len(keys) * size
    tail = tuple(prompt[full_end:])
    parent = keys[-1] if keys else namespace_key(namespace)
    if not missing and (not tail or held_length(state, namespace, prompt) >= len(prompt) - 1):
        return Step(state, (), False)  # held here already, as much as a reuse can take
    # A partial block alone is marked by what it follows; full blocks by their keys.
    reading = {(namespace, key) for key in missing} if missing else {tail_mark(namespace, parent)}
    if reading & state.remote_reading:
        return Step(state, (), True)
    tokens = len(missing) * size + len(tail)
    d = Draft(state)
    if not fetch_pays(state, config.model.bytes_for(tokens), tokens):
        d.count("remote_passed_up")
        return d.step(False)
    names, above = [], keys[held - 1] if held else namespace_key(namespace)
    for at, key in enumerate(missing, start=held):
        names.append(fx.BlockName(namespace, key, above, at * size, tuple(prompt[at * size:(at + 1) * size])))
        above = key
    d.remote_reading = d.remote_reading | reading
    after = keys[held - 1] if held else namespace_key(namespace)
    d.out.append(fx.FetchRemote(tuple(names), namespace, tuple(prompt), after, held * size))
    d.count("remote_fetches")
    return d.step(True)


def fetching(state: ServiceState, namespace: str, prompt: tuple[int, ...]) -> bool:
    """Whether a block of ``prompt`` is being fetched from the shared tier (its full blocks by key, a
    partial one alone by what it follows)."""
    if not state.remote_reading:
        return False
    keys = chain(namespace, packed(prompt), state.config.block_tokens)
    if tail_mark(namespace, keys[-1] if keys else namespace_key(namespace)) in state.remote_reading:
        return True
    return any((namespace, key) in state.remote_reading for key in keys)


def tail_mark(namespace: str, parent: bytes) -> tuple:
    """What ``remote_reading`` holds while the partial block after block ``parent`` is being fetched."""
    return ("tail", namespace, parent)


def held_length(state: ServiceState, namespace: str, prompt) -> int:
    """The longest prefix of ``prompt`` RAM or disk can serve (a shared tier comes with a disk)."""
    return max(state.ram.index.longest(namespace, prompt)[0], state.disk.index.longest(namespace, prompt)[0])


def fetch_pays(state: ServiceState, nbytes: int, tokens: int) -> bool:
    """Whether fetching ``nbytes`` and reading them back from disk beats prefilling ``tokens`` (True
    while the fetch or the prefill is unmeasured)."""
    pace = state.pace
    if pace.remote_s_per_byte is None or pace.prefill_s_per_token is None:
        return True
    per_byte = pace.remote_s_per_byte + (pace.read_s_per_byte or 0.0)
    return nbytes * per_byte < tokens * pace.prefill_s_per_token


def fetched(state: ServiceState, e: done.RemoteFetched) -> Step:
    """The blocks fetched enter the disk tier as saved blocks (each after its parent; one already held
    keeps what it has); the fetch's pace and counts are noted."""
    d = Draft(state)
    asked = {(name.namespace, name.key) for name in e.asked}
    if e.tail is not None:
        asked.add(tail_mark(*e.tail))
    d.remote_reading = d.remote_reading - asked
    new = []
    for block in e.blocks:
        held = d.entries.get(d.blocks.get((block.name.namespace, block.name.key), 0))
        if held is None:
            new.append(block)
        elif held.residence is R.RAM:  # kept from RAM meanwhile, with no file: the fetched one goes
            d.out.append(fx.DeleteFile(block.name))
    if new:
        enter_saved_blocks(d, tuple(new))
    for block in e.blocks:
        _learnt(d, block.name)
    remote_measured(d, e.nbytes, e.seconds)
    d.count("remote_blocks_read", len(e.blocks))
    d.count("remote_bytes_read", e.nbytes)
    d.count("remote_rejected", int(e.rejected))
    d.count("remote_failures", int(e.failed))
    return d.step(None)


def offered(state: ServiceState, e: done.RemoteOffered) -> Step:
    d = Draft(state)
    if e.written is None:
        d.count("remote_failures")
    else:
        d.count("remote_writes" if e.written else "remote_already_held")
        _learnt(d, e.name)
    return d.step(None)


def _learnt(d: Draft, name: fx.BlockName) -> None:
    """The shared tier holds block ``name``: remembered (a clean stop does not offer it again), and told."""
    if (name.namespace, name.key) not in d.remote_held:
        # The name (its tokens) only where block events may tell it again: a key is all a stop needs.
        d.remote_held = d.remote_held.set((name.namespace, name.key), name if d.config.block_events else None)
        block_events.on_remote(d, name)
