"""The next state of one transition, worked on in place and frozen once.

A handler copies the state into a :class:`Draft`, rebinds its fields (the maps
and indexes in it are persistent values, so nothing the caller holds changes),
appends the effects it decides to ``out``, and calls :meth:`Draft.build` once
at the end. The draft never leaves the transition: a handler that raises simply
drops it, and the caller's state is as it was. Counter increments add up in a
dict and are applied in the build. An attempt that may fail (making room) marks
the whole draft, effects included (:meth:`~Draft.mark`), and rolls back to it.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvstate.core.state import Entry, ServiceState, Tier, Writes


@attrs.frozen
class Step:
    """The outcome of one transition: the next state, the effects to carry out, the caller's reply."""

    state: ServiceState
    effects: tuple = ()
    reply: Any = None


class TierDraft:
    """A tier being worked on: its index, bytes and policy state are rebound in place."""

    __slots__ = ("index", "bytes", "capacity", "strategy", "policy", "_tier")

    def __init__(self, tier: Tier):
        self.index, self.bytes, self.capacity = tier.index, tier.bytes, tier.capacity
        self.strategy, self.policy, self._tier = tier.strategy, tier.policy, tier

    def frozen(self) -> Tier:
        tier = self._tier
        if self.index is tier.index and self.bytes == tier.bytes and self.policy is tier.policy:
            return tier  # untouched: the same value
        return Tier(self.index, self.bytes, self.capacity, self.strategy, self.policy)


class Draft:
    """A :class:`ServiceState` being built by one transition: the state's fields, rebound in place,
    ``counts``, the counter increments of this transition, and ``out``, the effects it decided so far.
    The fields are copied in and out as one dict (``ServiceState`` keeps them in its instance dict),
    not one attribute at a time."""

    # The state's fields, as the draft holds them (the values live in the instance dict).
    config: Any
    ram: TierDraft
    disk: TierDraft
    entries: Any
    leases: Any
    projected_bytes: int
    measured_bytes: int
    writes: Writes
    reading: Any
    acquiring: Any
    checkpoints: Any
    sessions: Any
    blocks: Any
    pinned_until: Any
    idle: Any
    counters: Any
    next_entry: int
    now: float
    pace: Any
    phase: Any
    remote_reading: Any
    remote_held: Any
    close_result: Any
    deferred: Any
    counts: dict[str, int]
    out: list

    def __init__(self, state: ServiceState):
        fields = state.__dict__.copy()
        fields["ram"], fields["disk"] = TierDraft(state.ram), TierDraft(state.disk)
        fields["counts"], fields["out"] = {}, []
        self.__dict__ = fields

    def step(self, reply: Any = None) -> Step:
        """The transition's outcome: the state built, the effects decided, ``reply``."""
        return Step(self.build(), tuple(self.out), reply)

    def build(self) -> ServiceState:
        fields = self.__dict__.copy()
        del fields["out"]
        counts = fields.pop("counts")
        if counts:
            fields["counters"] = self.counters.plus(counts)
        fields["ram"], fields["disk"] = self.ram.frozen(), self.disk.frozen()
        state = object.__new__(ServiceState)
        object.__setattr__(state, "__dict__", fields)  # exactly ServiceState's fields: the draft adds none
        return state

    def mark(self) -> tuple:
        """The whole draft as it is now (every field, both tiers, the counts and the effects so far), for
        an attempt that may fail (making room) to :meth:`rollback` to."""
        return (self.__dict__.copy(), dict(self.counts), len(self.out),
                _tier_fields(self.ram), _tier_fields(self.disk))

    def rollback(self, mark: tuple) -> None:
        fields, counts, effects, ram, disk = mark
        self.__dict__ = fields.copy()
        self.counts = counts.copy()
        del self.out[effects:]
        self.ram.index, self.ram.bytes, self.ram.policy = ram
        self.disk.index, self.disk.bytes, self.disk.policy = disk

    # ------------------------------------------------------------ small edits every concern makes

    def count(self, name: str, by: int = 1) -> None:
        if by:
            self.counts[name] = self.counts.get(name, 0) + by

    def new_entry_id(self) -> int:
        """An id no entry has had (ids only have to be new)."""
        self.next_entry += 1
        return self.next_entry - 1

    def new_entry_ids(self, count: int) -> list[int]:
        """``count`` ids no entry has had, in order."""
        self.next_entry += count
        return list(range(self.next_entry - count, self.next_entry))

    def set_entry(self, entry: Entry) -> None:
        self.entries = self.entries.set(entry.id, entry)

    def writes_add(self, count: int, nbytes: int) -> None:
        w = self.writes
        self.writes = Writes(w.count + count, w.bytes + nbytes, w.rate_spent, w.rate_at)

    def lease_set(self, lease_id: int, lease: Any) -> None:
        self.leases = self.leases.set(lease_id, lease)


def _tier_fields(tier: TierDraft) -> tuple:
    return tier.index, tier.bytes, tier.policy


def without(mapping: Any, key: Any) -> Any:
    """``mapping`` without ``key``, if it has it."""
    return mapping.delete(key) if key in mapping else mapping
