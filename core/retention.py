"""Retention rules: which kept prefixes are evicted only after every other.

A rule is a pure function ``(namespace, tokens, request) -> bool`` given to
``ServiceConfig(retention=...)``; True protects the entry. Eviction (by
capacity or memory pressure) takes unprotected entries first, in the policy's
order, and protected ones only when nothing else can go. Like mlx-lm's server,
which keeps system-prompt entries over assistant turns.
"""

from __future__ import annotations

from typing import Callable

from kvstate.core.errors import InvalidConfig
from kvstate.core.request import Request

Retention = Callable[[str, tuple, Request], bool]


def short_prefixes(max_tokens: int) -> Retention:
    """Protect prefixes of at most ``max_tokens`` tokens: system prompts and shared preambles."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidConfig(f"short_prefixes needs max_tokens as a positive int, got {max_tokens!r}")

    def protect(namespace: str, tokens: tuple, request: Request) -> bool:
        return len(tokens) <= max_tokens
    return protect

