"""FIFO: evict the entry kept longest ago, whatever its use since."""

from __future__ import annotations

from kvstate.core.policies.lru import LRU


class FIFO(LRU):
    """First in, first out: the LRU queue without re-queueing on a hit."""

    name = "fifo"
    requeue_on_access = False
