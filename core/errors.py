"""The errors kvstate raises, split by whose fault they are.

:class:`UsageError` is the caller's misuse of the port (a bad request, an
unknown lease): fix the call. :class:`StorageError` is the other side failing
(a corrupt file, a full disk): the service counts it and carries on where it can.
Every error leaves the service's state exactly as it was before the call.
"""

from __future__ import annotations


class KvStateError(Exception):
    """Base of every error kvstate raises."""


class UsageError(KvStateError):
    """The caller used the port wrongly; nothing changed."""


class InvalidRequest(UsageError, ValueError):
    """A request, token list or size that is not well formed."""


class InvalidNamespace(UsageError, ValueError):
    """A namespace that is not a non-empty string free of path separators."""


class InvalidConfig(UsageError, ValueError):
    """A service configuration that cannot work (negative sizes, unknown policy, a bad retention rule)."""


class ContextLimitExceeded(UsageError):
    """Prompt plus max_tokens is past the model's context limit: the request can never run."""


class OverBudget(UsageError):
    """The request's projected KV bytes exceed the whole KV budget on their own."""


class NotAdmitted(UsageError):
    """``acquire`` of a request never admitted, while the KV budget has no room for it now: call
    ``admit`` first and wait while it says False (acquire admits implicitly only what fits)."""


class UnknownRequest(UsageError, KeyError):
    """A request the service has never seen (not admitted, not acquired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class RequestAlreadyAcquired(UsageError):
    """``acquire`` for a request that already holds its state; release it first."""


class RequestKeepsNoState(UsageError):
    """``publish`` for a request whose state the service does not keep (see ``keeps``)."""


class TokensDoNotMatchCaches(UsageError, ValueError):
    """Published tokens and the caches offered with them cover different lengths."""


class CheckpointNotAllowed(UsageError):
    """``checkpoint`` for a request that is not a replayable generation, or without checkpoint storage."""


class PinRefused(UsageError):
    """A pin the service's bounds refuse (:mod:`~kvstate.core.pins`); nothing was pinned."""


class PinTooLong(PinRefused):
    """A pin for longer than ``max_pin_seconds``."""


class PinOverBudget(PinRefused):
    """A pin that would take pinned state past ``pin_share`` of the RAM capacity."""


class ServiceClosed(UsageError):
    """A call after ``close()``; only ``report`` and ``close`` still answer."""


class StorageError(KvStateError):
    """Saved state could not be read or written (corrupt, foreign, missing, no space)."""
