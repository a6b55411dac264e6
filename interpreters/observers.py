"""Observers: callbacks told of what the service did (a prefix kept, a block gained or lost by a tier).

An observer is the caller's code run inside a call of the port. One that raises must not fail that
call, leave its effects half carried out, or keep the other observers from hearing: its error is
logged with its traceback (logger ``kvstate``) and counted, and the telling goes on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

LOG = logging.getLogger("kvstate")


class Observers:
    """The callbacks told of one kind of news (``what``, for the log), each call guarded."""

    def __init__(self, what: str) -> None:
        self.what = what
        #: Calls of an observer that raised.
        self.failures = 0
        self._callbacks: list[Callable[..., Any]] = []

    def append(self, observe: Callable[..., Any]) -> None:
        self._callbacks.append(observe)

    def tell(self, *news: Any) -> None:
        """Call every observer with ``news``."""
        for observe in list(self._callbacks):
            self.call(observe, *news)

    def call(self, observe: Callable[..., Any], *news: Any) -> None:
        """Call ``observe`` with ``news``; an exception it raises is logged and counted, not raised."""
        try:
            observe(*news)
        except Exception:
            self.failures += 1
            LOG.exception("kvstate: an observer of %s raised (%r); the others were told and the call went on",
                          self.what, observe)
