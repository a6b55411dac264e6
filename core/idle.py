"""Entries in order of their last use, so the clock's rules visit only what has gone idle.

Idle demotion and idle writes (``ServiceConfig.demote_idle_after`` and
``write_idle_after``) act on entries unused for a while. Scanning every entry at
every tick costs what the service holds, at each tick, where a trace replay
ticks once a request. Instead, each time an entry enters RAM or is used, a slot
``(entry id, last_used)`` is appended: the clock only moves forward, so the slots
are in order of last use, and a tick reads them from the front up to its
cut-off. A slot is live while its entry still has that ``last_used``; a newer use
appended a newer slot. The front moves past slots whose entries need nothing
more from the clock's rules until they are used again (gone, or on disk only).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import attrs
from pyrsistent import PVector, pvector

from kvstate.core.policies.base import worth_compacting


@attrs.frozen
class IdleOrder:
    """``(entry id, last_used)`` slots in order of last use, read from ``head`` on."""

    slots: PVector = pvector()
    head: int = 0

    def used(self, entry_id: int, at: float, entries: Any) -> "IdleOrder":
        """The order once entry ``entry_id`` was used (or entered RAM) at ``at``; rebuilt from its
        live slots once stale ones pile up, so it holds memory in proportion to the entries."""
        order = IdleOrder(self.slots.append((entry_id, at)), self.head)
        if worth_compacting(len(order.slots), len(entries)):
            return IdleOrder(pvector(slot for slot in order._live(entries)), 0)
        return order

    def _live(self, entries: Any) -> Iterator[tuple[int, float]]:
        seen = set()
        for i in range(self.head, len(self.slots)):
            slot = self.slots[i]
            if _entry_of(slot, entries) is not None and slot not in seen:
                seen.add(slot)
                yield slot

    def idle(self, entries: Callable[[], Any], cutoff: float) -> Iterator[Any]:
        """The entries last used at or before ``cutoff``, least recently used first; ``entries()`` is
        read again at each slot, so a caller that changes entries on the way sees its changes."""
        for i in range(self.head, len(self.slots)):
            slot = self.slots[i]
            if slot[1] > cutoff:
                return
            entry = _entry_of(slot, entries())
            if entry is not None:
                yield entry

    def advanced(self, entries: Any, needs_clock: Callable[[Any], bool]) -> "IdleOrder":
        """The front moved past slots whose entries are gone, used since, or need nothing more from
        the clock's rules (``needs_clock``) until their next use."""
        head, slots = self.head, self.slots
        while head < len(slots):
            entry = _entry_of(slots[head], entries)
            if entry is not None and needs_clock(entry):
                break
            head += 1
        return self if head == self.head else IdleOrder(slots, head)


def _entry_of(slot: tuple[int, float], entries: Any) -> Any:
    """The entry a slot names while the slot is live (the entry is held and last used then), else None."""
    entry_id, at = slot
    entry = entries.get(entry_id)
    return entry if entry is not None and entry.last_used == at else None
