"""What every interpreter shares: the facts it measures of caches handed in."""

from __future__ import annotations

import attrs


@attrs.frozen
class CacheFacts:
    """What an interpreter measures of caches a caller hands in (``covered`` None: the caches cannot tell)."""

    covered: int | None
    nbytes: int
    trimmable: bool
