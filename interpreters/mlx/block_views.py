"""RAM blocks held as views of one array a layer, so that a hit on a chain hands out a view, not a copy.

MLX copies when it joins arrays: a hit on a chain of separately held blocks copies every position it
reuses (at the 8B geometry, 2,816 tokens took about 100 ms on a CPU where a view of one array took
1.5 ms: ``python bench/gpu_parts.py ram-hit``), while stock's deep copy of a whole cache copies
nothing. So the blocks one publish keeps are views of one array a layer, a :class:`Backing`: the
staged caches' own arrays, from the chain's start, where every earlier block of the chain can move
onto them (the backings it leaves hold nothing else worth keeping), else one copy of the positions
of the blocks kept. A chain whose blocks are consecutive views of one backing assembles as one view.
Moving a block onto a later publish's arrays swaps its arrays for another computation of the same
tokens, which is what a recompute of them would give.

Held once: a backing's positions are its members' spans, bar at most :data:`SLACK` positions it
holds for no member (a buffer's step past its offset, a partial last block a longer one superseded,
a leaf evicted), as mlx-lm's own caches hold up to a step past their offset. A drop that leaves more
copies the backing's other members out into arrays of their own, and the backing goes.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstate.interpreters.mlx.blocks import Block, cut, cuttable
from kvstate.interpreters.mlx.caches import codec_of

#: Positions a backing may hold for no member: one step of mlx-lm's caches (``KVCache.step``).
SLACK = KVCache.step


@attrs.frozen
class Link:
    """A kept block's place: its chain positions and the block before it on its chain (None first)."""

    start: int
    stop: int
    parent: int | None


@attrs.define(eq=False)
class Backing:
    """Each layer's arrays over chain positions ``start`` onwards (empty for a layer not cut; their
    buffers hold ``allocated`` positions), and the spans of the blocks that are views of them."""

    layers: list[dict[str, mx.array]]
    start: int
    allocated: int
    members: dict[int, Link] = attrs.field(factory=dict)

    @property
    def unheld(self) -> int:
        """Positions held for no member."""
        return self.allocated - sum(m.stop - m.start for m in self.members.values())

    def span(self, start: int, stop: int) -> Block:
        """Each layer's chain positions ``start`` to ``stop``: views, no copy, each a new array object
        (a cache's update writes into its array object, which must never be the backing's own)."""
        lo, hi = start - self.start, stop - self.start
        return [{name: array[..., lo:hi, :] for name, array in layer.items()} for layer in self.layers]


@attrs.frozen
class View:
    """A RAM block held as a view of ``backing``."""

    backing: Backing
    entry: int

    def block(self) -> Block:
        member = self.backing.members[self.entry]
        return self.backing.span(member.start, member.stop)


#: What RAM holds for a block: a view, or arrays of its own (read from disk, or copied out).
Held = View | Block


def block_of(held: Held) -> Block:
    """The block's arrays (views of its backing's, for a view)."""
    return held.block() if isinstance(held, View) else held


def owned(held: Held) -> Block:
    """The block's arrays as its own (a view's span copied out), scheduled for evaluation."""
    if not isinstance(held, View):
        return held
    block = [{name: mx.contiguous(array) for name, array in layer.items()} for layer in held.block()]
    mx.async_eval([array for layer in block for array in layer.values()])
    return block


def one_view(chain: list[Held]) -> Block | None:
    """The chain's layers as one view, where its blocks are consecutive members of one backing; else
    None (they are joined by a copy)."""
    first = chain[0]
    if not isinstance(first, View) or not all(isinstance(h, View) and h.backing is first.backing for h in chain):
        return None
    members = [first.backing.members[h.entry] for h in chain]
    if any(before.stop != after.start for before, after in zip(members, members[1:])):
        return None
    return first.backing.span(members[0].start, members[-1].stop)


def keep(caches: list, run: list[tuple[int, Link]], ram: dict[int, Held], links: dict[int, Link]) -> dict[int, Held]:
    """What RAM holds after the consecutive blocks ``run`` (entry and place, in order) are kept from
    the staged ``caches``: the run's blocks and as many of the chain's blocks before it as can move
    (:func:`_movable`; ``links`` places every block kept) as views of one backing, the members the
    backings they leave are left with copied out. The backing is the caches' own arrays where the
    whole chain moves, else one copy of the positions that move."""
    moved = _movable(run[0][1].parent, ram, links)
    start, stop = (links[moved[0]].start if moved else run[0][1].start), run[-1][1].stop
    arrays = _staged_arrays(caches, stop) if start == 0 else None
    if arrays is None:
        backing = Backing(cut(caches, start, stop, evaluate=False), start, stop - start)
    else:
        backing = Backing(arrays[0], 0, arrays[1])
    mx.async_eval([array for layer in backing.layers for array in layer.values()])
    left: dict[int, Backing] = {}
    for entry in moved:
        held = ram[entry]
        if isinstance(held, View):
            held.backing.members.pop(entry)
            left[id(held.backing)] = held.backing
        backing.members[entry] = links[entry]
    out: dict[int, Held] = {}
    for old in left.values():  # what the backings the chain left still hold: copied out
        out.update((entry, owned(View(old, entry))) for entry in old.members)
        old.members.clear()
    for entry, link in run:
        backing.members[entry] = link
    out.update((entry, View(backing, entry)) for entry in backing.members)
    return out


def without(view: View) -> dict[int, Held]:
    """What RAM holds for the other members of ``view``'s backing once ``view``'s block is dropped:
    nothing changes while the backing holds at most :data:`SLACK` positions for no member; past that
    each is copied out into arrays of its own, and the backing goes."""
    backing = view.backing
    backing.members.pop(view.entry)
    if not backing.members or backing.unheld <= SLACK:
        return {}
    out = {entry: owned(View(backing, entry)) for entry in backing.members}
    backing.members.clear()
    return out


def _movable(parent: int | None, ram: dict[int, Held], links: dict[int, Link]) -> list[int]:
    """The longest run of the chain's blocks ending at ``parent`` (first to last) that can move onto
    one backing: each held in RAM with a known place, and every backing they are views of holding at
    most :data:`SLACK` positions of blocks outside the run (those are copied out). A run starts where
    the chain changes backing: a shared prefix another chain's backing holds stays where it is."""
    chain, at = [], parent
    while at is not None and at in ram and at in links:
        chain.append(at)
        at = links[at].parent
    chain.reverse()
    # A backing's blocks on one chain are consecutive (a chain never rejoins a branch it left), so the
    # run grows back from the chain's end one backing at a time, while each holds little off the chain.
    on_chain, first = set(chain), len(chain)
    while first > 0:
        held = ram[chain[first - 1]]
        if not isinstance(held, View):
            first -= 1
            continue
        backing = held.backing
        if sum(m.stop - m.start for entry, m in backing.members.items() if entry not in on_chain) > SLACK:
            break
        while first > 0 and isinstance(ram[chain[first - 1]], View) and ram[chain[first - 1]].backing is backing:
            first -= 1
    return chain[first:]


def _staged_arrays(caches: list, stop: int) -> tuple[list[dict[str, mx.array]], int] | None:
    """Each layer's own arrays of the staged caches (views, no copy) and the positions their buffers
    hold, where they hold the chain from its start to ``stop`` and at most :data:`SLACK` positions
    past it; else None."""
    layers, allocated = [], stop
    for cache in caches:
        if not cuttable(cache):
            layers.append({})
            continue
        codec = codec_of(cache)
        buffered = codec.buffered(cache)
        if not stop <= (codec.covered(cache) or 0) <= buffered <= stop + SLACK:
            return None
        arrays, _ = codec.save(cache)
        layers.append(arrays)
        allocated = max(allocated, buffered)
    return layers, allocated
