"""The next state of one transition, worked on in place and frozen once.

A handler copies the state into a :class:`Draft`, rebinds its fields (the maps
and indexes in it are persistent values, so nothing the caller holds changes),
and calls :meth:`Draft.build` once at the end. The draft never leaves the
transition: a handler that raises simply drops it, and the caller's state is as
it was. Counter increments add up in a dict and are applied in the build.
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
    """A :class:`ServiceState` being built by one transition."""

    __slots__ = ("config", "ram", "disk", "entries", "leases", "projected_bytes", "measured_bytes", "writes", "reading",
                 "acquiring", "checkpoints", "sessions", "counters", "counts", "next_entry", "now", "pace", "phase",
                 "close_result", "deferred")

    def __init__(self, state: ServiceState):
        self.config = state.config
        self.ram, self.disk = TierDraft(state.ram), TierDraft(state.disk)
        self.entries, self.leases, self.projected_bytes = state.entries, state.leases, state.projected_bytes
        self.measured_bytes = state.measured_bytes
        self.writes, self.reading, self.acquiring = state.writes, state.reading, state.acquiring
        self.checkpoints, self.sessions, self.counters = state.checkpoints, state.sessions, state.counters
        self.counts: dict[str, int] = {}
        self.next_entry, self.now, self.pace, self.phase = state.next_entry, state.now, state.pace, state.phase
        self.close_result, self.deferred = state.close_result, state.deferred

    def build(self) -> ServiceState:
        counters = self.counters.plus(self.counts) if self.counts else self.counters
        return ServiceState(self.config, self.ram.frozen(), self.disk.frozen(), self.entries, self.leases,
                            self.projected_bytes, self.measured_bytes, self.writes, self.reading, self.acquiring, self.checkpoints,
                            self.sessions, counters, self.next_entry, self.now, self.pace, self.phase, self.close_result,
                            self.deferred)

    def mark(self) -> tuple:
        """What an attempt that may fail (making room) can change, to :meth:`rollback` to."""
        ram, disk = self.ram, self.disk
        return (self.entries, ram.index, ram.bytes, ram.policy, disk.index, disk.bytes, disk.policy,
                dict(self.counts))

    def rollback(self, mark: tuple) -> None:
        ram, disk = self.ram, self.disk
        (self.entries, ram.index, ram.bytes, ram.policy, disk.index, disk.bytes, disk.policy,
         self.counts) = mark

    # ------------------------------------------------------------ small edits every concern makes

    def count(self, name: str, by: int = 1) -> None:
        if by:
            self.counts[name] = self.counts.get(name, 0) + by

    def new_entry_id(self) -> int:
        """An id no entry has had (ids only have to be new)."""
        self.next_entry += 1
        return self.next_entry - 1

    def set_entry(self, entry: Entry) -> None:
        self.entries = self.entries.set(entry.id, entry)

    def writes_add(self, count: int, nbytes: int) -> None:
        w = self.writes
        self.writes = Writes(w.count + count, w.bytes + nbytes, w.rate_spent, w.rate_at)

    def lease_set(self, lease_id: int, lease: Any) -> None:
        self.leases = self.leases.set(lease_id, lease)


def without(mapping: Any, key: Any) -> Any:
    """``mapping`` without ``key``, if it has it."""
    return mapping.delete(key) if key in mapping else mapping
