"""Tenants in the server: a request's ``cache_salt`` names the namespace its state lives in.

vLLM's OpenAI server accepts a per-request ``cache_salt``; requests with
different salts never share cached state, so one tenant's cache hits (and
their timing) reveal nothing of another's prompts. ``kvstate serve`` accepts
the same field. A salt maps to a namespace of its own: the service never
mixes namespaces, so reuse, shared-prefix waits and saved files stay within
one salt. Requests without a salt share the default namespace, as before.

Salts are compared exactly, as the bytes of their UTF-8 text: salts that
differ only in case, Unicode normal form or surrounding whitespace are
different salts. A salt is 1 to 256 printable characters (``str.isprintable``:
no control, format, private-use, unassigned or separator characters but the
plain space), not spaces alone. The namespace is a keyed hash of the salt
(BLAKE2b under the deployment's salt key, :func:`salt_key`), so the salt
itself is never written to disk (a salt may be a tenant's secret), no one who
reads a saved file's header can test a guessed salt against it without the
key, and any salt makes a valid namespace.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvstate.core.errors import UsageError
from kvstate.interpreters.serving.deployment_keys import KEY_BYTES, deployment_key

#: The longest salt accepted, in characters.
MAX_SALT_CHARS = 256
#: The request attribute the handler sets to the request's namespace, for the generation thread.
NAMESPACE_ATTRIBUTE = "kvstate_namespace"
#: The salt key's file under the disk tier's root (owner-only; the root budget counts directories only).
SALT_KEY_FILE = ".kvstate-salt-key"


def salt_key(disk_dir: str | os.PathLike | None, key_file: str | os.PathLike | None = None) -> bytes:
    """The deployment's salt key: ``key_file`` where given (servers that share a tier share it, so a
    tenant's namespace is the same on each), else kept under the disk tier's root, so namespaces on
    disk stay the same across restarts; a key of this process alone without either (nothing outlives
    it)."""
    if key_file is not None:
        return deployment_key(Path(key_file), "salt key")
    if disk_dir is None:
        return os.urandom(KEY_BYTES)
    return deployment_key(Path(disk_dir) / SALT_KEY_FILE, "salt key")


class BadCacheSalt(UsageError, ValueError):
    """A ``cache_salt`` that is not a string of 1 to 256 printable characters, or spaces alone."""


def salt_namespace(salt: object, key: bytes) -> str:
    """The namespace of ``salt`` (the value of a request's ``cache_salt``) under the deployment's salt
    ``key``, or :class:`BadCacheSalt`."""
    if not isinstance(salt, str):
        raise BadCacheSalt(f"cache_salt must be a string, got {type(salt).__name__}")
    if not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise BadCacheSalt(f"cache_salt must hold 1 to {MAX_SALT_CHARS} characters, got {len(salt)}")
    if not salt.isprintable():
        raise BadCacheSalt("cache_salt holds a character that is not printable (a control, format, private-use, "
                           "unassigned or separator character); use printable text")
    if not salt.strip():
        raise BadCacheSalt("cache_salt is spaces alone; use printable text")
    digest = hashlib.blake2b(salt.encode("utf-8"), key=key, digest_size=16, person=b"kvstate-salt").hexdigest()
    return f"salt-{digest}"
