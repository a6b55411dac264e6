"""The shared tier: what a server fetches from an object store its fleet shares, and what it offers it.

Below RAM and the disk, a fleet may share a tier of saved blocks (``remote_tier``): an object store
every server reads and writes. The disk caches what this server fetches from there, so a fetched
block is a saved block like any other from then on (it enters the disk tier as a scan's would), and
only the shared tier's reads and writes are decided here:

- **what to fetch** (:func:`lookup`): when a request arrives, the full blocks of its prompt past the
  longest chain this server holds in any tier, one chain, in order; the interpreter reads them until
  the store lacks one. Only where the read pays: fetching the bytes and reading them back from disk
  must beat prefilling their tokens, by the paces measured (:mod:`~kvstate.core.pace`; fetches are
  timed as they land). A chain already being fetched is not asked for twice.
- **what to offer** (``tiers.spill_done``): every block this server writes to its disk, once its write is
  durable; the store keeps the first server's object of a block (a conditional write), so a block
  is written once across the fleet. Blocks fetched from there are not offered back.

Every failure of the store is counted and changes nothing else: requests go on from the local
tiers.
"""

from __future__ import annotations

from kvstate.core import events as ev
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
    """Start fetching the prompt's blocks this server lacks from the shared tier, where that pays;
    whether a fetch of them is in flight now."""
    config = state.config
    if not config.remote_tier:
        return Step(state, (), False)
    ensure_open(state, "remote_lookup")
    namespace = check_namespace(e.namespace)
    prompt = as_tokens(e.prompt)
    keys = chain(namespace, packed(prompt), config.block_tokens)
    held = 0
    while held < len(keys) and (namespace, keys[held]) in state.blocks:
        held += 1
    missing = keys[held:]
    if not missing:
        return Step(state, (), False)
    if any((namespace, key) in state.remote_reading for key in missing):
        return Step(state, (), True)
    tokens = len(missing) * config.block_tokens
    d = Draft(state)
    if not fetch_pays(state, config.model.bytes_for(tokens), tokens):
        d.count("remote_passed_up")
        return d.step(False)
    size, names = config.block_tokens, []
    parent = keys[held - 1] if held else namespace_key(namespace)
    for at, key in enumerate(missing, start=held):
        names.append(fx.BlockName(namespace, key, parent, at * size, tuple(prompt[at * size:(at + 1) * size])))
        parent = key
    d.remote_reading = d.remote_reading | {(namespace, key) for key in missing}
    d.out.append(fx.FetchRemote(tuple(names)))
    d.count("remote_fetches")
    return d.step(True)


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
    return d.step(None)
