"""Tenants in the server: a request's ``cache_salt`` names the namespace its state lives in.

vLLM's OpenAI server accepts a per-request ``cache_salt``; requests with
different salts never share cached state, so one tenant's cache hits (and
their timing) reveal nothing of another's prompts. ``kvstate serve`` accepts
the same field. A salt maps to a namespace of its own: the service never
mixes namespaces, so reuse, shared-prefix waits and saved files stay within
one salt. Requests without a salt share the default namespace, as before.

Salts are compared exactly, as the bytes of their UTF-8 text: salts that
differ only in case, Unicode normal form or surrounding whitespace are
different salts. The namespace is a keyed hash of the salt, so the salt itself
is never written to disk (a salt may be a tenant's secret) and any salt makes
a valid namespace.
"""

from __future__ import annotations

import hashlib
import unicodedata

from kvstate.core.errors import UsageError

#: The longest salt accepted, in characters.
MAX_SALT_CHARS = 256
#: The request attribute the handler sets to the request's namespace, for the generation thread.
NAMESPACE_ATTRIBUTE = "kvstate_namespace"


class BadCacheSalt(UsageError, ValueError):
    """A ``cache_salt`` that is not a string of 1 to 256 printable characters."""


def salt_namespace(salt: object) -> str:
    """The namespace of ``salt`` (the value of a request's ``cache_salt``), or :class:`BadCacheSalt`."""
    if not isinstance(salt, str):
        raise BadCacheSalt(f"cache_salt must be a string, got {type(salt).__name__}")
    if not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise BadCacheSalt(f"cache_salt must hold 1 to {MAX_SALT_CHARS} characters, got {len(salt)}")
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in salt):
        raise BadCacheSalt("cache_salt holds a control character or a lone surrogate; use printable text")
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"kvstate-salt").hexdigest()
    return f"salt-{digest}"
