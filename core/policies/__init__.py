"""Eviction policies: pure strategies behind one protocol, one module each.

A new policy is one file with a class following
:class:`~kvstate.core.policies.base.EvictionPolicy`, and one line in ``POLICIES``.
"""

from __future__ import annotations

from kvstate.core.policies.base import EvictionPolicy, UnknownPolicy
from kvstate.core.policies.fifo import FIFO
from kvstate.core.policies.gdsf import GDSF
from kvstate.core.policies.lfu import LFU
from kvstate.core.policies.lru import LRU
from kvstate.core.policies.s3fifo import S3FIFO
from kvstate.core.policies.sieve import SIEVE

POLICIES: dict[str, EvictionPolicy] = {p.name: p for p in (LRU(), FIFO(), LFU(), S3FIFO(), SIEVE(), GDSF())}


def policy(name: str) -> EvictionPolicy:
    """The policy called ``name`` (lowercase); :class:`UnknownPolicy` lists the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicy(f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}") from None


__all__ = ["EvictionPolicy", "UnknownPolicy", "POLICIES", "policy", "LRU", "FIFO", "LFU", "S3FIFO", "SIEVE", "GDSF"]
