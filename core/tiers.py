"""The tiers: keeping published state, eviction, spilling to disk, giving RAM back, idle demotion,
prefetch, and rejected files.

Every move of an entry between residences goes through :func:`~kvstate.core.state.moved`, so the
lifecycle table is the only place that says which moves exist. One eviction rule serves both tiers
(:func:`victim`): the policy names the victim among evictable entries, unprotected ones first.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import attrs

from kvstate.core import block_events
from kvstate.core.admission import held_bound
from kvstate.core.draft import Draft, TierDraft
from kvstate.core.pace import read_measured, read_pays
from kvstate.core.replies import GaveBack, Kept, NotKept, NotKeptReason
from kvstate.core.blocks import block_key, block_tag, namespace_key, spans
from kvstate.core.state import (
    IN_RAM, ON_DISK, OBJECTS, Entry, Move, Phase, Residence, ServiceConfig, ServiceState, Writes, content_tag, moved,
)
from kvstate.core.tokens import WIDTH, packed, plain
from kvstate.effects import completions as done
from kvstate.effects import effects as fx

R = Residence
Evictable = Callable[[Entry], bool]


# ---------------------------------------------------------------- eviction


def victim(tier: TierDraft, entries, evictable: Evictable, protect: bool) -> tuple[object, int | None]:
    """The policy's next victim among ``evictable`` entries and its policy state after choosing;
    with ``protect``, protected entries are chosen only once no other is left."""
    passes = (False, True) if protect else (True,)
    for protected_too in passes:
        def candidate(key: int) -> bool:
            entry = entries.get(key)
            return entry is not None and evictable(entry) and (protected_too or not entry.protected)
        policy, chosen = tier.strategy.evict(tier.policy, candidate)
        if chosen is not None:
            return policy, chosen
    return tier.policy, None


def pinned(d: Draft | ServiceState, entry_id: int) -> bool:
    """Whether ``entry_id``'s RAM copy is pinned now (:mod:`~kvstate.core.pins`): no rule takes it from
    RAM (eviction, pressure, idle demotion, a longer prefix that serves it) until its pin runs out."""
    until = d.pinned_until.get(entry_id)
    return until is not None and until > d.now


def in_ram_evictable(entry: Entry) -> bool:
    """Whether ``entry``'s RAM copy may be dropped now: no block RAM holds extends it, and, where it has
    no saved copy, no held block at all (leaf first: a block never goes before what extends it)."""
    return (entry.residence in (R.RAM, R.BOTH) and not entry.ram_children
            and (entry.residence is R.BOTH or not entry.children))


def can_give_back(entry: Entry) -> bool:
    """Whether ``entry``'s RAM may be given back (written first where it has no saved copy): no block RAM
    holds extends it."""
    return entry.residence in (R.RAM, R.BOTH) and not entry.ram_children


def ram_prefixes(state) -> int:
    """The prefixes RAM holds: what its index lists (whole prefixes, snapshots, and the blocks no RAM
    block extends: each the end of one chain)."""
    return len(state.ram.index)


def make_ram_room(d: Draft, need: int, spare: frozenset = frozenset()) -> bool:
    """Evict until ``need`` more bytes fit in RAM (never the entries in ``spare``: the blocks a keep
    builds on); False, with nothing changed, when pinned entries forbid."""
    def evictable(entry: Entry) -> bool:
        return in_ram_evictable(entry) and entry.id not in spare and not pinned(d, entry.id)
    return _make_room(d, d.ram, need, evictable, True, drop_ram, "evictions")


def make_disk_room(d: Draft, need: int) -> bool:
    """Evict saved state until ``need`` more bytes fit on disk; False, nothing changed, when pinned files forbid."""
    reading = d.reading

    def evictable(entry: Entry) -> bool:
        return (entry.residence in (R.BOTH, R.DISK) and entry.id not in reading and not entry.disk_children
                and (entry.residence is R.BOTH or not entry.children))
    return _make_room(d, d.disk, need, evictable, False, lambda d, e: drop_disk(d, e, delete=True),
                      "disk_evictions")


def _make_room(d: Draft, tier: TierDraft, need: int, evictable: Evictable, protect: bool,
               drop: Callable[[Draft, Entry], None], counter: str) -> bool:
    if need > tier.capacity:
        return False
    mark = None
    while tier.bytes + need > tier.capacity:
        mark = mark or d.mark()  # taken once, only when something has to go
        policy, chosen = victim(tier, d.entries, evictable, protect)
        if chosen is None:
            d.rollback(mark)  # nothing was evicted after all: state and effects as before
            return False
        tier.policy = policy
        drop(d, d.entries[chosen])
        d.count(counter)
    return True


# ---------------------------------------------------------------- entries in and out of a tier


def drop_ram(d: Draft, entry: Entry) -> None:
    """Release ``entry``'s RAM copy: gone if it had no disk copy, disk-only otherwise."""
    d.out.append(fx.DropEntry(entry.id))
    _leave(d, d.ram, entry, entry.nbytes, moved(entry.residence, Move.DROP_RAM))


def drop_disk(d: Draft, entry: Entry, delete: bool) -> None:
    """Forget ``entry``'s disk copy (deleting its file when ``delete``): RAM-only if it had one."""
    after = moved(entry.residence, Move.DROP_DISK if entry.residence is not R.PREFETCHING else Move.READ_FAILED)
    if delete:
        d.out.append(fx.DeleteFile(saved_name(d, entry)))
    _leave(d, d.disk, entry, entry.file_bytes, after)
    if after is R.RAM:
        _idle_again(d, entry.id)


def _leave(d: Draft, tier: TierDraft, entry: Entry, charge: int, after: Residence | None, **changes) -> None:
    """``entry`` leaves ``tier`` (its index, its ``charge`` of bytes, its policy) for residence
    ``after``; None: the entry is gone."""
    if listed(d.entries[entry.id], tier is d.ram):
        tier.index = tier.index.remove(entry.namespace, entry.packed)
    tier.bytes -= charge
    tier.policy = tier.strategy.removed(tier.policy, entry.id)
    block_events.removed(d, entry, block_events.RAM if tier is d.ram else block_events.DISK)
    if after is None:
        if entry.children:  # only where everything goes (close, a rejected file): what extends it is unusable
            _drop_extensions(d, entry)
        _delete(d, entry)
        count_child(d, entry, children=-1)
    else:
        d.set_entry(attrs.evolve(d.entries[entry.id], residence=after, **changes))
    if tier is d.ram:
        count_child(d, entry, ram_children=-1)
    else:
        count_child(d, entry, disk_children=-1)


def _delete(d: Draft, entry: Entry) -> None:
    """``entry`` is gone from the state (and, a block, from the blocks by key; and its pin)."""
    d.entries = d.entries.delete(entry.id)
    if entry.id in d.pinned_until:
        d.pinned_until = d.pinned_until.delete(entry.id)
    if entry.is_block:
        d.blocks = d.blocks.delete((entry.namespace, entry.block))


def add_entry(d: Draft, entry: Entry) -> None:
    """A new ``entry`` joins the state: a block is known by its key, and counted by its parent."""
    d.set_entry(entry)
    if entry.is_block:
        d.blocks = d.blocks.set((entry.namespace, entry.block), entry.id)
    if entry.parent is not None:
        count_child(d, entry, children=1)


def listed(entry: Entry, ram: bool) -> bool:
    """Whether the index of the tier (RAM where ``ram``) lists ``entry``, which that tier holds: a whole
    prefix or a snapshot always; a block that serves alone only while no block that tier holds extends
    it: every shorter prefix is served through the blocks that end the tier's chains, cut back, so the
    index holds one path a chain, as it holds one a whole prefix. A block that serves only under a
    snapshot is never listed."""
    if not entry.indexed:
        return False
    return not entry.is_block or not (entry.ram_children if ram else entry.disk_children)


def count_child(d: Draft, entry: Entry, children: int = 0, ram_children: int = 0, disk_children: int = 0) -> None:
    """Block ``entry`` entered or left a tier, or was made or forgotten: its parent's counts of it, and
    whether the tier's index lists the parent (it does while nothing there extends it)."""
    parent = d.entries.get(entry.parent) if entry.parent is not None else None
    if parent is None:
        return
    counted = parent.counted(parent.children + children, parent.ram_children + ram_children,
                             parent.disk_children + disk_children)
    d.set_entry(counted)
    if ram_children and parent.residence in IN_RAM:
        _relist(d.ram, parent, counted, True)
        if not parent.ram_children:  # RAM's policy may set aside what leaf-first eviction cannot take
            d.ram.policy = d.ram.strategy.extended(d.ram.policy, parent.id)
        elif not counted.ram_children:
            d.ram.policy = d.ram.strategy.leaf_again(d.ram.policy, parent.id)
    if disk_children and parent.residence in ON_DISK:
        _relist(d.disk, parent, counted, False)


def _relist(tier: TierDraft, before: Entry, after: Entry, ram: bool) -> None:
    """The tier's index follows a change of what extends ``before`` there (``after``). Unlisting
    checks the index: a keep makes a chain's blocks last first, so a parent may not be in it yet."""
    was, now = listed(before, ram), listed(after, ram)
    if was and not now and tier.index.exact(after.namespace, after.packed) == after.id:
        tier.index = tier.index.remove(after.namespace, after.packed)
    elif now and not was:
        tier.index = tier.index.insert(after.namespace, after.packed, after.id, after.trimmable)


def _drop_extensions(d: Draft, entry: Entry) -> None:
    """Every block extending ``entry`` goes, from RAM and disk: without ``entry`` they serve nothing."""
    for child in [c for c in d.entries.values() if c.parent == entry.id]:
        _forget(d, child)


def _forget(d: Draft, entry: Entry) -> None:
    """``entry`` and what extends it leave both tiers at once: RAM copies released, files deleted."""
    for child in [c for c in d.entries.values() if c.parent == entry.id]:
        _forget(d, child)
    entry = d.entries[entry.id]
    if entry.residence in IN_RAM:
        d.out.append(fx.DropEntry(entry.id))
    if entry.residence in (R.BOTH, R.DISK, R.SPILLING, R.PREFETCHING):
        d.out.append(fx.DeleteFile(saved_name(d, entry)))
    if entry.residence in IN_RAM and listed(entry, True):
        d.ram.index = d.ram.index.remove(entry.namespace, entry.packed)
    if entry.residence in IN_RAM:
        d.ram.bytes -= entry.nbytes
        d.ram.policy = d.ram.strategy.removed(d.ram.policy, entry.id)
        block_events.removed(d, entry, block_events.RAM)
    if entry.residence is R.PREFETCHING:
        d.ram.bytes -= entry.nbytes  # charged when its read ahead began
    if entry.residence in (R.BOTH, R.DISK, R.PREFETCHING):
        if listed(entry, False):
            d.disk.index = d.disk.index.remove(entry.namespace, entry.packed)
        d.disk.policy = d.disk.strategy.removed(d.disk.policy, entry.id)
        block_events.removed(d, entry, block_events.DISK)
    if entry.residence in (R.BOTH, R.DISK, R.PREFETCHING, R.SPILLING):
        d.disk.bytes -= entry.file_bytes
    if entry.residence is R.SPILLING:
        d.writes_add(-1, -entry.nbytes)
    _delete(d, entry)


def chain_of(d: Draft | ServiceState, entry: Entry, length: int) -> list[Entry]:
    """The blocks that serve the first ``length`` tokens through block ``entry``, first first (a whole
    prefix is its own chain)."""
    chain = []
    block: Entry | None = entry
    while block is not None:
        if block.start < length or block.is_snapshot:
            chain.append(block)
        block = d.entries.get(block.parent) if block.parent is not None else None
    chain.reverse()
    return chain


def saved_name(d: Draft, entry: Entry) -> fx.DiskKey | fx.BlockName:
    """What ``entry``'s saved copy is named by: its tokens for a whole prefix, its chain for a block."""
    parent = d.entries.get(entry.parent) if entry.parent is not None else None
    if entry.block is None:
        if parent is not None:
            return fx.SnapshotName(entry.namespace, entry.tokens, parent.block)
        return fx.DiskKey(entry.namespace, entry.tokens)
    return block_events.name_of(d, entry)

def insert_ram(d: Draft, entry: Entry) -> None:
    """Index ``entry`` (already set in a RAM residence) and tell the policy."""
    ram = d.ram
    if listed(entry, True):
        ram.index = ram.index.insert(entry.namespace, entry.packed, entry.id, entry.trimmable)
    if entry.ram_children:  # told first: a policy may never queue it
        ram.policy = ram.strategy.extended(ram.policy, entry.id)
    ram.policy = ram.strategy.inserted(ram.policy, entry.id, entry.nbytes, entry.length, entry.tag)
    block_events.stored(d, entry, block_events.RAM)
    count_child(d, entry, ram_children=1)
    _used(d, d.entries[entry.id])


def _used(d: Draft, entry: Entry) -> None:
    """``entry`` entered RAM or was used: where a rule acts on idle entries, it joins the idle order."""
    if d.config.idle_rules:
        d.idle = d.idle.used(entry.id, entry.last_used, d.entries)


def _idle_again(d: Draft, entry_id: int) -> None:
    """Entry ``entry_id`` is RAM-only again (its write failed, or the disk dropped its file): where idle
    entries are written, it waits another idle spell before it is written again."""
    entry = d.entries[entry_id]
    if d.config.write_idle_after is not None:
        if entry.last_used != d.now:
            d.set_entry(entry.used(d.now, entry.read_errors))
        # A slot even where it was used this instant: the order's front may have passed its slot while
        # its write was in flight (nothing for the clock to do then).
        _used(d, d.entries[entry_id])


def insert_disk(d: Draft, entry: Entry) -> None:
    disk = d.disk
    if listed(entry, False):
        disk.index = disk.index.insert(entry.namespace, entry.packed, entry.id, entry.trimmable)
    disk.policy = disk.strategy.inserted(disk.policy, entry.id, entry.file_bytes, entry.length, entry.tag)
    block_events.stored(d, entry, block_events.DISK)
    count_child(d, entry, disk_children=1)


def touch(d: Draft, entry: Entry, disk: bool = False) -> None:
    """``entry`` was used now: its stamp, and the policy of the tier that served it (a read of its file
    that worked also ends its run of I/O errors)."""
    _stamp(d, entry, disk)
    tier = d.disk if disk else d.ram
    tier.policy = tier.strategy.accessed(tier.policy, entry.id)


def touch_all(d: Draft, entries: list[Entry]) -> None:
    """Each of RAM ``entries`` was used now, in that order (a chain's blocks, the last first): as
    :func:`touch` of each, the entries map changed once and RAM's policy told in one call."""
    now = d.now
    stale = [entry for entry in entries if entry.last_used != now] if d.config.idle_rules else ()
    if stale:  # only where a rule reads the last use (see ``Entry.last_used``)
        changed = d.entries.mutate()
        for entry in stale:
            changed[entry.id] = entry.used(now, entry.read_errors)
        d.entries = changed.finish()
        for entry in stale:
            d.idle = d.idle.used(entry.id, now, d.entries)
    d.ram.policy = d.ram.strategy.accessed_all(d.ram.policy, [entry.id for entry in entries])


def _stamp(d: Draft, entry: Entry, disk: bool) -> None:
    """``entry``'s last use is now (and a read of its file that worked ends its run of I/O errors)."""
    read_errors = 0 if disk else entry.read_errors
    stamped = d.config.idle_rules and entry.last_used != d.now  # only where a rule reads it (``Entry.last_used``)
    if stamped or entry.read_errors != read_errors:
        d.set_entry(entry.used(d.now if stamped else entry.last_used, read_errors))
        _used(d, d.entries[entry.id])


def start_spill(d: Draft, entry: Entry, demote: bool = False, bounded: bool = True,
                evict: bool = True) -> None:
    """Start writing RAM-only ``entry`` to disk, making disk room (evicting saved state only when
    ``evict``); a full queue or disk drops the write, and so does the write-rate cap. A flush is not
    ``bounded``: it writes past the queue's bound and the cap (and is charged to the cap)."""
    if entry.parent is not None:  # a block is written after its parent: saved chains have no gaps
        parent = d.entries.get(entry.parent)
        if parent is not None and parent.residence is R.RAM:
            start_spill(d, parent, bounded=bounded, evict=evict)
            if d.entries[parent.id].residence is R.RAM:
                return  # the parent could not be written, so neither is this (its counter says why)
        entry = d.entries[entry.id]
    if bounded:
        blocked = _spill_blocked(d, entry)
        if blocked is not None:
            d.count(blocked)
            return
    if not evict and d.disk.bytes + entry.file_bytes > d.disk.capacity:
        d.count("dropped_writes")
        return
    if not make_disk_room(d, entry.file_bytes):
        d.count("dropped_writes")
        return
    entry = d.entries[entry.id]
    d.disk.bytes += entry.file_bytes
    d.writes_add(1, entry.nbytes)
    _charge_write_rate(d, entry.file_bytes)
    d.out.append(fx.SpillEntry(entry.id, saved_name(d, entry), entry.nbytes, entry.trimmable, entry.file_bytes))
    d.set_entry(attrs.evolve(entry, residence=moved(entry.residence, Move.SPILL), demote=demote))


def _spill_blocked(d: Draft, entry: Entry) -> str | None:
    """What keeps ``entry`` from being written now, as the counter it would count (None: nothing):
    the write queue's bound, then the write-rate cap."""
    if d.writes.bytes + entry.nbytes > d.config.write_queue_bytes:
        return "dropped_writes"
    if not within_write_rate(d, entry.file_bytes):
        return "spills_over_rate"
    return None


HOUR = 3600.0


def _write_rate_spent(d: Draft) -> float:
    """Bytes of the write-rate bucket spent now: what was spent, less the clock's refill since."""
    w = d.writes
    return max(0.0, w.rate_spent - d.config.write_bytes_per_hour * (d.now - w.rate_at) / HOUR)


def within_write_rate(d: Draft, nbytes: int) -> bool:
    """Whether writing ``nbytes`` more stays within the write-rate cap (always, without one)."""
    cap = d.config.write_bytes_per_hour
    return cap is None or _write_rate_spent(d) + nbytes <= cap


def _charge_write_rate(d: Draft, nbytes: int) -> None:
    if d.config.write_bytes_per_hour is not None:
        w = d.writes
        d.writes = Writes(w.count, w.bytes, _write_rate_spent(d) + nbytes, d.now)


def spill_pays(d: Draft, entry: Entry, counted: bool = True) -> bool:
    """Whether writing ``entry`` to disk can pay back: reading it again beats prefilling its tokens
    (objects are not prefilled: always written). Counted where it cannot, when ``counted``."""
    if entry.namespace == OBJECTS or read_pays(d.pace, entry.file_bytes, entry.length - entry.start):
        return True
    if counted:
        d.count("spills_passed_up")
    return False


# ---------------------------------------------------------------- keeping published state


@attrs.frozen
class Offer:
    """State offered for keeping: the caches staged under ``handle`` covering ``tokens`` in
    ``namespace``, their bytes in RAM and on disk, whether they can be cut back, the session that
    published them, whether a retention rule protects them, and whether observers hear of them."""

    namespace: str
    tokens: tuple[int, ...]
    handle: int
    nbytes: int
    file_bytes: int
    trimmable: bool
    session: str | None = None
    protected: bool = False
    notify: bool = True
    #: Where the state is kept in blocks: each block's ``(nbytes, file_bytes)``, in the order of
    #: :func:`~kvstate.core.blocks.spans` (empty: kept whole).
    blocks: tuple[tuple[int, int], ...] = ()
    #: Where some layers cannot be cut (recurrent, sliding windows): the ``(nbytes, file_bytes)`` of
    #: their state at the end, kept as a snapshot on the chain of the other layers' blocks.
    snapshot: tuple[int, int] | None = None
    #: Offered mid-prefill: a guess, unless it is the last chunk before a branch point
    #: (:func:`at_a_branch_point`), kept only where worth its bytes (:func:`snapshot_worth_keeping`) and
    #: only in free RAM.
    chunk: bool = False
    #: A chunk's following tokens, to where the next chunk is offered (empty: not known).
    next_chunk: tuple[int, ...] | bytes = ()


def keep(d: Draft, offer: Offer) -> object:
    """Keep the state ``offer`` stages as an entry (making room by policy), or drop it; the reply (the
    effects go to the draft)."""
    if offer.blocks:
        return _keep_blocks(d, offer)
    namespace, tokens, handle, nbytes = offer.namespace, offer.tokens, offer.handle, offer.nbytes
    file_bytes, trimmable, session = offer.file_bytes, offer.trimmable, offer.session
    data = packed(tokens)  # what the state keeps: the packed ids, never a tuple of them (see core/tokens.py)
    existing = d.ram.index.exact(namespace, data)
    if existing is not None:
        touch(d, d.entries[existing])
        d.count("duplicates")
        if session is not None:
            d.sessions = d.sessions.set(session, (namespace, data))
        d.out.append(fx.DropPublished(handle))
        return Kept(existing, duplicate=True)
    if (offer.chunk and d.config.snapshot_admission == "reuse" and nbytes > d.ram.capacity - d.ram.bytes
            and not at_a_branch_point(d, offer)):
        return _pass_up_snapshot(d, handle, NotKeptReason.NO_FREE_ROOM_FOR_A_GUESS)
    tag = content_tag(namespace, data)
    d.ram.policy = d.ram.strategy.arriving(d.ram.policy, tag)  # before room is made for it
    if not make_ram_room(d, nbytes):
        reason = NotKeptReason.TOO_LARGE if nbytes > d.ram.capacity else NotKeptReason.NO_ROOM
        d.count("not_kept")
        d.out.append(fx.DropPublished(handle))
        return NotKept(reason)
    saved = d.disk.index.exact(namespace, data) if d.config.has_disk else None
    if saved is not None and d.entries[saved].residence is R.PREFETCHING:
        d.out.append(fx.DropPublished(handle))
        d.count("duplicates")
        return Kept(saved, duplicate=True)
    if saved is not None:
        entry = d.entries[saved]
        entry = attrs.evolve(entry, residence=moved(entry.residence, Move.ADOPT), last_used=d.now)
        d.set_entry(entry)
        insert_ram(d, entry)
        d.ram.bytes += entry.nbytes
        d.out.append(fx.AdoptPublished(handle, entry.id))
    else:
        entry = Entry(d.new_entry_id(), namespace, data, nbytes, trimmable, R.RAM, d.now, session, offer.protected,
                      tag, file_bytes=file_bytes)
        d.set_entry(entry)
        d.ram.bytes += nbytes
        insert_ram(d, entry)
        d.out.append(fx.AdoptPublished(handle, entry.id))
        config = d.config
        if config.has_disk and config.write_behind and config.write_idle_after is None and spill_pays(d, entry):
            start_spill(d, entry)
    if trimmable:
        _drop_served_prefixes(d, entry)
    if session is not None:
        d.sessions = d.sessions.set(session, (namespace, data))
    if offer.notify:
        d.out.append(fx.NotifyKept(fx.DiskKey(namespace, plain(tokens))))
    d.count("kept")
    return Kept(entry.id)


class _Link(NamedTuple):
    """One block of a chain being kept: its span, its chain key, its sizes, and the entry that already
    holds it (None: none does). The path from the namespace's start to its end is the first ``stop``
    tokens of the offer's packed prompt (cut only where needed). A tuple: a publish makes one a block."""

    start: int
    stop: int
    key: bytes
    nbytes: int
    file_bytes: int
    held: Entry | None


def _chain_links(d: Draft, offer: Offer) -> list[_Link] | None:
    """The blocks ``offer`` is kept in, each with the entry holding it now; None where a path is held
    by a whole entry (state kept whole before): then the offer is kept whole too."""
    data = packed(offer.tokens)
    view = memoryview(data)  # each block's tokens hashed where they lie, not copied out first
    links, parent = [], namespace_key(offer.namespace)
    cuts = spans(len(offer.tokens), d.config.block_tokens)
    if (not d.config.partial_blocks and offer.snapshot is None and cuts
            and cuts[-1][1] - cuts[-1][0] < d.config.block_tokens):
        cuts = cuts[:-1]  # a snapshot needs the blocks up to its end: only plain KV drops its partial block
    whole: set[int] | None = None
    known = _indexed_keys(d, offer.namespace, data, cuts)
    for at, ((start, stop), (nbytes, file_bytes)) in enumerate(zip(cuts, offer.blocks)):
        key = known[at] if at < len(known) else block_key(parent, view[start * WIDTH:stop * WIDTH])
        found = d.blocks.get((offer.namespace, key))
        if found is None:  # a whole entry at this path (state kept whole before): the offer is kept whole too
            if whole is None:
                whole = _whole_lengths(d, offer.namespace, data)
            if stop in whole:
                return None
        held = d.entries[found] if found is not None else None
        if (offer.snapshot is None and stop - start < d.config.block_tokens
                and (held is None or held.residence not in IN_RAM) and (not links or links[-1].held is not None)):
            # A partial last block a RAM block already covers is not kept again (nor its saved copy adopted).
            # Only a block on the held block before it can cover it: none where that one is new.
            held = _covering(d, offer.namespace, data[:stop * WIDTH], start) or held
        links.append(_Link(start, stop, key, nbytes, file_bytes, held))
        parent = key
    return links


def _indexed_keys(d: Draft, namespace: str, data: bytes, cuts: tuple[tuple[int, int], ...]) -> list[bytes]:
    """The chain keys of the first of ``cuts`` (the spans packed ``data`` is kept in) that a chain the
    tiers' indexes list already holds, read from its blocks: a turn that extends a held conversation
    hashes only its new blocks. A held block's key is its tokens' chain hash (a saved one whose name
    does not hash to its key is never entered), so reading it gives what hashing again would."""
    covered, found = 0, None
    for tier in (d.ram, d.disk) if d.config.has_disk else (d.ram,):
        length, entry_id = tier.index.longest(namespace, data)
        if length > covered:
            covered, found = length, entry_id
    held: dict[int, tuple[int, bytes]] = {}  # a held block's start: its stop and key, where data has its tokens
    entry, past = (d.entries[found] if found is not None else None), 0
    while entry is not None:
        if entry.length > covered:  # past where data leaves the chain: walked, not read
            past += 1
            if past > len(cuts):  # a long chain beyond: walking to data's blocks costs more than hashing them
                return []
        elif entry.block is not None:
            held[entry.start] = (entry.length, entry.block)
        entry = d.entries[entry.parent] if entry.parent is not None else None
    keys = []
    for start, stop in cuts:  # from the chain's start: each key names every block before it too
        span = held.get(start)
        if span is None or span[0] != stop:
            break
        keys.append(span[1])
    return keys


def _whole_lengths(d: Draft, namespace: str, data: bytes) -> set[int]:
    """The lengths of the prefixes of packed ``data`` that a whole entry holds (state kept whole
    before), in either tier: one walk of each index, not a lookup a block."""
    tiers = (d.ram, d.disk) if d.config.has_disk else (d.ram,)
    return {length for tier in tiers for length, entry_id, _ in tier.index.prefixes_of(namespace, data)
            if not d.entries[entry_id].chained}


def _covering(d: Draft, namespace: str, path: bytes, start: int) -> Entry | None:
    """A RAM block from ``start`` that already holds every token of the partial last block ending
    ``path`` (a longer partial block, or a full one): the partial block is not kept twice."""
    covered, found = d.ram.index.longest(namespace, path + bytes(WIDTH))  # one token past, never compared
    entry = d.entries[found] if found is not None and covered * WIDTH == len(path) else None
    while entry is not None and entry.start > start:
        entry = d.entries.get(entry.parent) if entry.parent is not None else None
    return entry if entry is not None and entry.start == start and entry.is_block and entry.trimmable else None


def _keep_blocks(d: Draft, offer: Offer) -> object:
    """Keep ``offer`` in blocks: only those RAM does not hold are cut from the staged caches (a block
    saved on disk regains its RAM copy), room made for them by policy, never at the expense of the
    blocks the chain builds on. The reply names the chain's last block."""
    namespace, handle = offer.namespace, offer.handle
    links = _chain_links(d, offer)
    snapshot = _held_snapshot(d, offer) if offer.snapshot is not None else None
    if links is None or snapshot is False:
        return keep(d, attrs.evolve(offer, blocks=(), snapshot=None))
    # A chunk snapshot not held yet is a guess unless it is the last before a branch point (then it is
    # kept as any snapshot is): a guess must be worth its bytes, and is kept only in free RAM (below).
    guess = offer.chunk and offer.snapshot is not None and snapshot is None and (
        d.config.snapshot_admission == "bytes" or not at_a_branch_point(d, offer))
    if guess and not snapshot_worth_keeping(d, offer):  # the chain's blocks wait for one worth keeping
        return _pass_up_snapshot(d, handle, NotKeptReason.NOT_WORTH_ITS_BYTES)
    if not links:
        d.count("not_kept")
        d.out.append(fx.DropPublished(handle))
        return NotKept(NotKeptReason.NO_FULL_BLOCK)
    if (any(link.held is not None and link.held.residence is R.PREFETCHING for link in links)
            or (snapshot is not None and snapshot.residence is R.PREFETCHING)):
        d.count("not_kept")  # a later publish keeps what the read leaves missing
        d.out.append(fx.DropPublished(handle))
        return NotKept(NotKeptReason.READ_IN_FLIGHT)
    missing = [link for link in links if link.held is None or link.held.residence not in IN_RAM]
    snapshot_missing = offer.snapshot is not None and (snapshot is None or snapshot.residence not in IN_RAM)
    if not missing and not snapshot_missing:
        if snapshot is not None:  # the snapshot, then the last block first: a chain's start is its most recent
            touch(d, d.entries[snapshot.id])
        for link in reversed(links):
            touch(d, d.entries[link.held.id])
        last = links[-1].held if snapshot is None else snapshot
        d.count("duplicates")
        if offer.session is not None:
            d.sessions = d.sessions.set(offer.session, (namespace, d.entries[last.id].packed))
        d.out.append(fx.DropPublished(handle))
        return Kept(last.id, duplicate=True)
    need = sum(link.nbytes for link in missing) + (offer.snapshot[0] if snapshot_missing else 0)
    if guess and d.config.snapshot_admission == "reuse" and need > d.ram.capacity - d.ram.bytes:
        return _pass_up_snapshot(d, handle, NotKeptReason.NO_FREE_ROOM_FOR_A_GUESS)
    tags = {link.start: block_tag(link.key) for link in missing if link.held is None}
    for tag in tags.values():
        d.ram.policy = d.ram.strategy.arriving(d.ram.policy, tag)
    spare = frozenset(link.held.id for link in links if link.held is not None)
    if not make_ram_room(d, need, spare):
        reason = NotKeptReason.TOO_LARGE if need > d.ram.capacity else NotKeptReason.NO_ROOM
        d.count("not_kept")
        d.out.append(fx.DropPublished(handle))
        return NotKept(reason)
    config, parent, new, entering, held_ids, kept = d.config, None, [], set(), [], []
    for at, link in enumerate(links):  # first to last: each block's parent is made before it
        held = d.entries.get(link.held.id) if link.held is not None else None
        if held is None:  # no tier holds this block, nor any after it
            new = _new_blocks(d, offer, links[at:], tags, parent, kept)
            parent = new[-1]
            break
        if held.residence not in IN_RAM:  # saved only: the published caches give its RAM copy back
            held = attrs.evolve(held, residence=moved(held.residence, Move.ADOPT), last_used=d.now)
            d.set_entry(held)
            d.ram.bytes += held.nbytes
            kept.append(fx.KeptSpan(held.id, link.start, link.stop, parent))
            entering.add(held.id)
        held_ids.append(held.id)
        parent = held.id
    blocks_made = list(new)
    if offer.snapshot is not None:
        parent = _keep_snapshot(d, offer, d.entries.get(snapshot.id) if snapshot is not None else None, parent, new)
    # The policy and the idle order meet the chain last block first, so its start is its most recently
    # used: an LRU's oldest entries are then leaves, the only blocks it may take.
    _enter_ram([d.entries[entry_id] for entry_id in reversed(blocks_made)], d)
    touched: list[Entry] = []
    for entry_id in reversed(held_ids):
        entry = d.entries[entry_id]
        if entry_id in entering:
            touch_all(d, touched)
            touched = []
            insert_ram(d, entry)
        else:
            touched.append(entry)
    touch_all(d, touched)
    last = d.entries[parent]
    if last.trimmable:  # before the blocks are cut, so an interpreter keeping the chain knows what stays
        _drop_served_prefixes(d, last)
    if kept:
        d.out.append(fx.KeepBlocks(handle, tuple(kept)))
    d.out.append(fx.DropPublished(handle))
    if config.has_disk and config.write_behind and config.write_idle_after is None:
        for entry_id in new:
            entry = d.entries[entry_id]
            if entry.residence is R.RAM and spill_pays(d, entry):
                start_spill(d, entry)
    if offer.session is not None:
        d.sessions = d.sessions.set(offer.session, (namespace, last.packed))
    if offer.notify:
        d.out.append(fx.NotifyKept(fx.DiskKey(namespace, plain(offer.tokens))))
    d.count("kept")
    return Kept(last.id)


def _new_blocks(d: Draft, offer: Offer, links: list[_Link], tags: dict[int, int], parent: int | None,
                kept: list[fx.KeptSpan]) -> list[int]:
    """Entries in RAM for ``links``, the blocks of ``offer``'s chain no tier holds (always its last), on
    block ``parent``; their ids (their spans appended to ``kept``). Each is made with its final counts
    (all but the last extended by the next, in RAM), the maps changed once and ``parent`` counted once:
    what :func:`add_entry` and :func:`insert_ram` of each would leave, bar the index and the policy
    (:func:`_enter_ram`)."""
    namespace, last = offer.namespace, len(links) - 1
    # A block serves alone (any shorter prefix) where every layer is cut, else only under a snapshot.
    trimmable = offer.snapshot is None
    entries, blocks, above, made = d.entries.mutate(), d.blocks.mutate(), parent, None
    data = packed(offer.tokens)  # shared by every block made here: each covers its first ``stop`` tokens
    length = len(data) // WIDTH
    ids = d.new_entry_ids(len(links))
    for at, (entry_id, link) in enumerate(zip(ids, links)):
        extended, ends = int(at < last), None if link.stop == length else link.stop
        if made is None:
            made = Entry(entry_id, namespace, data, link.nbytes, trimmable, R.RAM, d.now, offer.session,
                         offer.protected, tags[link.start], link.file_bytes, parent=above, start=link.start,
                         block=link.key, children=extended, ram_children=extended, ends=ends)
        else:
            made = made.next_block(entry_id, link.nbytes, link.file_bytes, tags[link.start], link.start, ends,
                                   link.key, extended)
        entries[entry_id] = made
        blocks[namespace, link.key] = entry_id
        kept.append(fx.KeptSpan(entry_id, link.start, link.stop, above))
        above = entry_id
    d.ram.bytes += sum(link.nbytes for link in links)
    d.entries, d.blocks = entries.finish(), blocks.finish()
    if parent is not None:
        count_child(d, d.entries[ids[0]], children=1, ram_children=1)
    return ids


def _enter_ram(run: list[Entry], d: Draft) -> None:
    """The blocks ``run`` (made by :func:`_new_blocks`, the last first) enter RAM's index (only one no
    RAM block extends is listed), its policy (in one call) and the idle order."""
    ram = d.ram
    if run and listed(run[0], True):  # the chain's last: the others are each extended by the next
        ram.index = ram.index.insert(run[0].namespace, run[0].packed, run[0].id, run[0].trimmable)
    for entry in run:
        if entry.ram_children:  # every block but the chain's last, told first: a policy may never queue it
            ram.policy = ram.strategy.extended(ram.policy, entry.id)
    ram.policy = ram.strategy.inserted_all(ram.policy, [(e.id, e.nbytes, e.length, e.tag) for e in run])
    if d.config.idle_rules:
        for entry in run:
            _used(d, entry)
    if d.config.block_events:
        for entry in reversed(run):  # told first block first, as a chain is read
            block_events.stored(d, entry, block_events.RAM)


def snapshot_worth_keeping(d: Draft, offer: Offer) -> bool:
    """Whether a chunk snapshot is worth its bytes: it saves the prefill of the tokens since the
    deepest snapshot held before it on its chain (in either tier), and it must hold no more bytes than
    the attention state of those same tokens does. Keeping attention state is how any prefix is
    reused, so a snapshot that saves less compute per byte than that is passed up; the next chunk's,
    further on, saves more for the same bytes. Snapshots at the end of a prompt or a segment are
    always offered to the policy (they are what a continuation reuses)."""
    tokens = offer.tokens
    before = 0
    tiers = (d.ram, d.disk) if d.config.has_disk else (d.ram,)
    for tier in tiers:
        for length, entry_id, _ in tier.index.prefixes_of(offer.namespace, tokens):
            if length > before and d.entries[entry_id].is_snapshot:
                before = length
    attention_per_token = sum(nbytes for nbytes, _ in offer.blocks) / len(tokens)
    return offer.snapshot[0] <= (len(tokens) - before) * attention_per_token


def _pass_up_snapshot(d: Draft, handle: int, reason: NotKeptReason) -> NotKept:
    """A chunk snapshot not kept, for ``reason``: its staged caches dropped, and counted. A guess never
    takes the room of state a request used."""
    d.count("snapshots_passed_up")
    d.out.append(fx.DropPublished(handle))
    return NotKept(reason)


def at_a_branch_point(d: Draft, offer: Offer) -> bool:
    """Whether chunk snapshot ``offer`` is the last before a branch point: a prefix held in either tier
    goes past its end (another request's prompt went through these tokens, so where this one leaves
    it, or beyond, is a branch point), and none goes past its next chunk (where the caller takes its
    next snapshot, which would then be nearer the branch). Whatever branches there next reuses it
    (Marconi's evidence of reuse, one snapshot a branch). Any other chunk is a guess: kept only in
    free RAM."""
    tiers = (d.ram, d.disk) if d.config.has_disk else (d.ram,)
    if not any(tier.index.extends(offer.namespace, offer.tokens) for tier in tiers):
        return False
    if not offer.next_chunk:
        return True
    further = packed(offer.tokens) + packed(offer.next_chunk)
    return not any(tier.index.extends(offer.namespace, further) for tier in tiers)


def _held_snapshot(d: Draft, offer: Offer) -> Entry | None | bool:
    """The snapshot held at the end of ``offer``'s tokens (None: none; False: a whole entry is there)."""
    found = d.ram.index.exact(offer.namespace, offer.tokens)
    if found is None and d.config.has_disk:
        found = d.disk.index.exact(offer.namespace, offer.tokens)
    if found is None:
        return None
    entry = d.entries[found]
    return entry if entry.is_snapshot else False


def _keep_snapshot(d: Draft, offer: Offer, held: Entry | None, parent: int, new: list[int]) -> int:
    """The snapshot at the end of ``offer``'s chain (whose last block is ``parent``) in RAM: used if
    held there, its RAM copy regained if saved, else kept from the staged caches; its id."""
    if held is not None and held.residence in IN_RAM:
        touch(d, held)
        return held.id
    if held is not None:
        held = attrs.evolve(held, residence=moved(held.residence, Move.ADOPT), last_used=d.now)
        d.set_entry(held)
        insert_ram(d, held)
        d.ram.bytes += held.nbytes
    else:
        data = packed(offer.tokens)
        nbytes, file_bytes = offer.snapshot
        held = Entry(d.new_entry_id(), offer.namespace, data, nbytes, False, R.RAM, d.now, offer.session,
                     offer.protected, content_tag(offer.namespace, data), file_bytes=file_bytes, parent=parent,
                     start=len(offer.tokens))
        add_entry(d, held)
        d.ram.bytes += held.nbytes
        insert_ram(d, held)
        new.append(held.id)
    d.out.append(fx.KeepSnapshot(offer.handle, held.id))
    return held.id


def _drop_served_prefixes(d: Draft, longer: Entry) -> None:
    """RAM holds no trimmable prefix that the trimmable ``longer`` entry already serves: their RAM
    copies go (a saved copy stays). Pinned and protected entries stay."""
    for _, entry_id, trimmable in d.ram.index.prefixes_of(longer.namespace, longer.packed):
        entry = d.entries[entry_id]
        if entry.children or pinned(d, entry_id):
            continue  # a block the chain builds on (the partial last blocks a chain supersedes extend nothing)
        if trimmable and entry.residence in (R.RAM, R.BOTH) and not entry.protected:
            drop_ram(d, entry)
            d.count("superseded")
        elif entry.is_block and entry.residence is R.SPILLING and not entry.demote and not entry.protected:
            d.set_entry(attrs.evolve(entry, demote=True))  # pinned by its write: its RAM goes once that lands
            d.count("superseded")
    if longer.is_block and d.config.has_disk:  # a superseded partial block's saved copy is a duplicate too
        for _, entry_id, _ in d.disk.index.prefixes_of(longer.namespace, longer.packed):
            entry = d.entries[entry_id]
            if (entry.is_block and not entry.children and entry.residence is R.DISK and not entry.protected
                    and entry_id not in d.reading):
                drop_disk(d, entry, delete=True)
                d.count("superseded")


def spill_done(d: Draft, e: done.SpillDone) -> object:
    entry = d.entries.get(e.entry)
    if entry is None or entry.residence is not R.SPILLING:
        return None
    d.writes_add(-1, -entry.nbytes)
    written = attrs.evolve(entry, residence=moved(entry.residence, Move.WRITTEN))
    d.set_entry(written)
    insert_disk(d, written)
    d.count("spills")
    d.count("bytes_written", written.file_bytes)
    # Offered to the shared tier, which keeps the first server's copy (a block that serves only under a
    # snapshot is not: no other server could use it).
    if d.config.remote_tier and written.is_block and written.trimmable:
        d.out.append(fx.OfferRemote(saved_name(d, written)))
    # A block RAM came to extend meanwhile keeps its RAM copy, and so does an entry pinned meanwhile.
    if entry.demote and not written.ram_children and not pinned(d, entry.id):
        drop_ram(d, written)
        d.count("demotions")
    return None


def offer_what_the_remote_lacks(d: Draft) -> None:
    """A flush or a clean stop: every saved block the shared tier is not known to hold is offered (a
    write that failed while it was down, blocks found at start), as the disk is made durable."""
    if not d.config.remote_tier:
        return
    for entry in d.entries.values():
        if (entry.is_block and entry.trimmable and entry.residence in ON_DISK
                and (entry.namespace, entry.block) not in d.remote_held):
            d.out.append(fx.OfferRemote(saved_name(d, entry)))


def spill_failed(d: Draft, e: done.SpillFailed) -> object:
    entry = d.entries.get(e.entry)
    if entry is None or entry.residence is not R.SPILLING:
        return None
    d.writes_add(-1, -entry.nbytes)
    d.disk.bytes -= entry.file_bytes
    d.set_entry(attrs.evolve(entry, residence=moved(entry.residence, Move.WRITE_FAILED)))
    d.count("failed_writes")
    # A partial block a longer one came to serve while its write was in flight goes now, as it would
    # have once the write landed; anything else is RAM-only again, and waits.
    drop_if_superseded(d, d.entries[entry.id])
    if entry.id in d.entries:
        _idle_again(d, entry.id)
    return None


# ---------------------------------------------------------------- giving RAM back


def give_back(d: Draft, entry: Entry) -> None:
    """Release ``entry``'s RAM, spilling it first when it has no durable copy and a disk tier exists."""
    if entry.residence is R.RAM and d.config.has_disk and spill_pays(d, entry):
        start_spill(d, entry, demote=True)
        if d.entries[entry.id].residence is R.SPILLING:
            return
    drop_ram(d, d.entries[entry.id])
    d.count("demotions")


def over_limits(state: ServiceState | Draft, max_bytes: int | None, max_entries: int | None) -> bool:
    """Whether kept state is over a boundary's limits: more than ``max_bytes`` held (those being given
    back included), more than ``max_entries`` RAM entries, or, where the config says so, more than the
    KV budget leaves beside the running requests."""
    held = optional_bytes(state)
    if max_bytes is not None and held > max_bytes:
        return True
    if max_entries is not None and ram_prefixes(state) > max_entries:
        return True
    config = state.config
    budget = config.kv_budget_bytes
    return config.ram_within_kv_budget and budget is not None and held > budget - held_bound(state)


def boundary(d: Draft, pressure: bool) -> object:
    """Under pressure give back one entry (the policy's victim); the facade repeats while the boundary
    gives back or waits.

    An entry being given back holds its RAM until its spill lands, so while such spills are in flight
    the boundary waits for them (a ``Sync``) before it picks another victim: it gives back no more
    than the pressure needs. With no victim left and writes in flight it waits too (a written entry
    becomes one whose RAM copy can go)."""
    if not pressure or d.phase is not Phase.OPEN:
        return GaveBack(0, 0)
    if d.writes.count and any(e.demote and e.residence is R.SPILLING for e in d.entries.values()):
        d.out.append(fx.Sync(pressure=True))
        return GaveBack(0, 0, waited=True)
    # The policy names the victim; its own bookkeeping follows the entry's fate in give_back
    # (an entry that starts spilling stays known to the policy, pinned until its write settles).
    _, chosen = victim(d.ram, d.entries, lambda entry: can_give_back(entry) and not pinned(d, entry.id), protect=True)
    if chosen is None:
        if d.writes.count:  # what is left is being written: its RAM goes once the writes land
            d.out.append(fx.Sync(pressure=True))
            return GaveBack(0, 0, waited=True)
        return GaveBack(0, 0)
    entry = d.entries[chosen]
    give_back(d, entry)
    return GaveBack(1, entry.nbytes)


def optional_bytes(state: ServiceState) -> int:
    """Memory optional state holds, as memory pressure sees it: kept RAM entries, those being given
    back included (their RAM copy is held until their write lands: pressure waits for it), plus
    checkpoint writes queued. A spill in flight is the RAM entry's own memory, so it is not counted
    twice."""
    checkpoints = sum(record.pending_bytes for record in state.checkpoints.values())
    return state.ram.bytes + checkpoints


def tick(d: Draft, now: float) -> None:
    """The clock reads ``now``: entries idle past the demotion threshold are given back, and RAM-only
    entries idle past the write threshold are written (:func:`_write_idle`). Only entries gone idle
    are visited, least recently used first (:mod:`~kvstate.core.idle`)."""
    d.now = max(d.now, float(now))
    config = d.config
    if not config.idle_rules or d.phase is not Phase.OPEN:
        return
    after = config.demote_idle_after
    if after is not None:
        for entry in d.idle.idle(lambda: d.entries, d.now - after):
            if pinned(d, entry.id):
                continue  # demoted at the first tick after its pin runs out
            if entry.residence is R.SPILLING:
                if not entry.demote:
                    d.set_entry(attrs.evolve(entry, demote=True))
            elif can_give_back(entry):  # a block RAM still extends waits: it goes after its extension
                give_back(d, entry)
                _give_back_idle_parents(d, entry, d.now - after)
    if config.write_behind and config.write_idle_after is not None:
        _write_idle(d, config.write_idle_after)
    d.idle = d.idle.advanced(d.entries, lambda entry: _needs_clock(config, entry))


def _give_back_idle_parents(d: Draft, entry: Entry, idle_since: float) -> None:
    """After block ``entry`` was given back, the blocks it extended that are idle too and now extended
    by nothing in RAM go as well (leaf first, within one tick)."""
    while entry.parent is not None:
        entry = d.entries.get(entry.parent)
        if entry is None or entry.last_used > idle_since or entry.ram_children or pinned(d, entry.id):
            return
        if entry.residence is R.SPILLING:  # being written (as the parent of a block written after it)
            if not entry.demote:
                d.set_entry(attrs.evolve(entry, demote=True))
            return
        if not can_give_back(entry):
            return
        give_back(d, entry)


def _needs_clock(config: ServiceConfig, entry: Entry) -> bool:
    """Whether a rule of the clock may still act on ``entry`` before its next use: demotion on
    anything in RAM, idle writes on a RAM-only entry the write queue's bound lets through."""
    return ((config.demote_idle_after is not None and entry.residence in (R.RAM, R.SPILLING, R.BOTH))
            or (config.write_idle_after is not None and entry.residence is R.RAM
                and entry.nbytes <= config.write_queue_bytes))


def _write_idle(d: Draft, after: float) -> None:
    """Write RAM-only entries idle ``after`` seconds or more (they stay in RAM), while the write queue
    and the write-rate cap have room for them; the rest wait for a later tick. An entry whose file
    could never pay back its read is not written; one whose write failed waits another idle spell."""
    for entry in d.idle.idle(lambda: d.entries, d.now - after):
        if entry.residence is R.RAM and _spill_blocked(d, entry) is None and spill_pays(d, entry, counted=False):
            start_spill(d, entry)  # a wait is counted nowhere: the entry is tried again at the next tick


# ---------------------------------------------------------------- prefetch and rejected files


def prefetch(d: Draft, namespace: str, prompt: tuple[int, ...]) -> object:
    if not d.config.has_disk or d.ram.capacity == 0:
        return False
    disk_len, disk_entry = d.disk.index.longest(namespace, prompt)
    ram_len, _ = d.ram.index.longest(namespace, prompt)
    if disk_len <= ram_len:
        return False
    entry = d.entries[disk_entry]
    if entry.chained:
        return _prefetch_chain(d, entry, disk_len, ram_len)
    if entry.residence is not R.DISK or disk_entry in d.reading:
        return False
    d.ram.policy = d.ram.strategy.arriving(d.ram.policy, entry.tag)
    if not make_ram_room(d, entry.nbytes):
        return False
    entry = attrs.evolve(d.entries[entry.id], residence=moved(R.DISK, Move.PREFETCH))
    d.set_entry(entry)
    d.ram.bytes += entry.nbytes
    d.out.append(fx.PrefetchEntry(entry.id, fx.DiskKey(entry.namespace, entry.tokens)))
    return True


def _prefetch_chain(d: Draft, entry: Entry, length: int, in_ram: int) -> bool:
    """Start reading into RAM the blocks (and the snapshot) of ``entry``'s chain up to ``length`` that
    only the disk holds, room made for them all by policy (never at the expense of the chain's own
    RAM blocks); False where none is missing, one is being read, reading them is slower than
    prefilling the tokens they add over the ``in_ram`` RAM serves (the pace rule, as for a restore),
    or RAM has no room."""
    chain = chain_of(d, entry, length)
    if any(block.residence is R.PREFETCHING or block.id in d.reading for block in chain):
        return False  # a read of this chain is in flight
    missing = [block for block in chain if block.residence is R.DISK]
    if not missing:
        return False
    if not read_pays(d.pace, sum(block.file_bytes for block in missing), length - in_ram):
        d.count("restores_passed_up")
        return False
    for block in missing:
        d.ram.policy = d.ram.strategy.arriving(d.ram.policy, block.tag)
    if not make_ram_room(d, sum(block.nbytes for block in missing), frozenset(block.id for block in chain)):
        return False
    parts = []
    for block in missing:
        d.set_entry(attrs.evolve(block, residence=moved(R.DISK, Move.PREFETCH)))
        d.ram.bytes += block.nbytes
        parts.append(fx.BlockPart(block.id, saved_name(d, block)))
    d.out.append(fx.PrefetchBlocks(tuple(parts)))
    return True


def reading_ahead(state: ServiceState, namespace: str, prompt: tuple[int, ...]) -> bool:
    """Whether a block of the longest saved chain serving ``prompt`` is being read ahead into RAM."""
    if not state.config.has_disk:
        return False
    length, found = state.disk.index.longest(namespace, prompt)
    if found is None:
        return False
    entry = state.entries[found]
    return entry.chained and any(block.residence is R.PREFETCHING for block in chain_of(state, entry, length))


def blocks_prefetched(d: Draft, e: done.BlocksPrefetched) -> object:
    """A chain's blocks read ahead are in RAM too, first to last, each where it is still being read
    ahead, what it extends is in RAM, and no longer block covers it; what the interpreter read and is
    not taken up is let go (``SettleReadAhead`` says which is which). The part that failed is judged
    as a restore's would be (rejected, or left on disk after an I/O error), and those after it, never
    read, are on disk only again."""
    taken: list[Entry] = []
    taken_ids: set[int] = set()
    dropped: list[int] = []
    for entry_id in e.read:
        entry = d.entries.get(entry_id)
        parent = d.entries.get(entry.parent) if entry is not None and entry.parent is not None else None
        extends_ram = parent is None or parent.residence in IN_RAM or parent.id in taken_ids
        if entry is None or entry.residence is not R.PREFETCHING or not extends_ram or _covered(d, entry):
            dropped.append(entry_id)
            if entry is not None and entry.residence is R.PREFETCHING:
                _unread(d, entry)
            continue
        taken.append(entry)
        taken_ids.add(entry_id)
    d.out.append(fx.SettleReadAhead(tuple(entry.id for entry in taken), tuple(dropped)))
    for entry in reversed(taken):  # the last first, as a keep meets a chain: its start is the most recent
        entry = attrs.evolve(d.entries[entry.id], residence=moved(R.PREFETCHING, Move.READ), last_used=d.now,
                             read_errors=0)
        d.set_entry(entry)
        insert_ram(d, entry)
    if taken:
        last = d.entries[taken[-1].id]
        if last.trimmable:  # a shorter partial block kept meanwhile is served by it now
            _drop_served_prefixes(d, last)
        d.count("prefetches")
        read_bytes = sum(entry.file_bytes for entry in taken)
        d.count("bytes_read", read_bytes)
        read_measured(d, read_bytes, e.seconds)
    for entry_id in e.unread:
        entry = d.entries.get(entry_id)
        if entry is not None and entry.residence is R.PREFETCHING:
            _unread(d, entry)
    failed = d.entries.get(e.failed) if e.failed is not None else None
    if failed is None:
        return None
    if e.reason is done.FailureReason.IO_ERROR:
        if failed.residence is R.PREFETCHING:  # else its file is left as it was, for the reads to come
            read_error(d, failed.id)
    elif failed.residence in (R.PREFETCHING, R.DISK):
        reject(d, failed.id)
    elif failed.residence is R.BOTH:  # its RAM copy came back meanwhile: only the file it had is gone
        d.count("rejected_files")
        drop_disk(d, failed, delete=False)
    return None


def drop_if_superseded(d: Draft, entry: Entry) -> None:
    """A partial last block RAM kept beside a longer one that serves it (held back by a pin that has
    run out) goes now, as it would have when the longer one was kept."""
    if not (entry.is_block and entry.trimmable and entry.length - entry.start < d.config.block_tokens
            and not entry.children and not entry.protected and entry.residence in IN_RAM):
        return
    for other in d.entries.values():  # a longer sibling: what a pin's end is rare enough to look for so
        if (other.parent == entry.parent and other.namespace == entry.namespace and other.start == entry.start
                and other.is_block and other.trimmable and other.residence in IN_RAM
                and other.length > entry.length and other.packed.startswith(entry.packed)):
            _drop_served_prefixes(d, other)  # as when it was kept
            return


def _covered(d: Draft, entry: Entry) -> bool:
    """Whether a RAM block already holds every token of ``entry``, a partial last block read ahead (a
    longer one was kept meanwhile): the partial block is not kept twice."""
    if not (entry.is_block and entry.trimmable and entry.length - entry.start < d.config.block_tokens):
        return False
    return _covering(d, entry.namespace, entry.packed, entry.start) is not None


def _unread(d: Draft, entry: Entry) -> None:
    """A read ahead of ``entry`` is not taken up: its RAM charge goes, its file stays."""
    d.ram.bytes -= entry.nbytes
    d.set_entry(attrs.evolve(entry, residence=moved(R.PREFETCHING, Move.UNREAD)))


def prefetch_done(d: Draft, e: done.PrefetchDone) -> object:
    entry = d.entries.get(e.entry)
    if entry is None or entry.residence is not R.PREFETCHING:
        return None
    entry = attrs.evolve(entry, residence=moved(entry.residence, Move.READ), last_used=d.now, read_errors=0)
    d.set_entry(entry)
    insert_ram(d, entry)
    d.count("prefetches")
    d.count("bytes_read", entry.file_bytes)
    read_measured(d, entry.file_bytes, e.seconds)
    return None


def reject(d: Draft, entry_id: int) -> None:
    """A saved file failed to read: forget it (the interpreter moved it aside) and count it."""
    entry = d.entries.get(entry_id)
    d.count("rejected_files")
    if entry is None or entry.residence not in (R.BOTH, R.DISK, R.PREFETCHING):
        return
    if entry.residence is R.PREFETCHING:
        d.ram.bytes -= entry.nbytes
    drop_disk(d, entry, delete=False)


#: Reads of one file that may hit I/O errors in a row before it is taken for unreadable and deleted.
MAX_READ_ERRORS = 3


def read_error(d: Draft, entry_id: int) -> None:
    """A read of ``entry_id``'s file hit an I/O error, which is not evidence of a bad file: the file
    stays, on disk (a prefetch's RAM charge is undone), unless its reads have now failed
    ``MAX_READ_ERRORS`` times in a row; then it is forgotten and deleted."""
    d.count("read_errors")
    entry = d.entries.get(entry_id)
    if entry is None or entry.residence not in (R.BOTH, R.DISK, R.PREFETCHING):
        return
    if entry.residence is R.PREFETCHING:
        d.ram.bytes -= entry.nbytes
    if entry.read_errors + 1 >= MAX_READ_ERRORS:
        d.count("rejected_files")
        drop_disk(d, entry, delete=True)
        return
    residence = moved(entry.residence, Move.READ_ERROR) if entry.residence is R.PREFETCHING else entry.residence
    d.set_entry(attrs.evolve(entry, residence=residence, read_errors=entry.read_errors + 1))


def prefetch_failed(d: Draft, e: done.PrefetchFailed) -> object:
    if e.reason is done.FailureReason.IO_ERROR:
        read_error(d, e.entry)
    else:
        reject(d, e.entry)
    return None


def unpin(d: Draft, entry_id: int) -> None:
    """One restore of ``entry_id`` is over: one pin fewer on its file."""
    count = d.reading.get(entry_id)
    if count is not None:
        d.reading = d.reading.set(entry_id, count - 1) if count > 1 else d.reading.delete(entry_id)
