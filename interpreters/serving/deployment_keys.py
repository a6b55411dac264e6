"""A deployment's secret keys, made once and kept owner-only: what its keyed hashes are keyed with.

A keyed hash lets a server name a tenant or a prompt's block in a file (a saved file's namespace, a
recorded trace's ids) without anyone who reads the file being able to test a guess against it: the
key never leaves the machine's owner. Each key is a file of random bytes beside what it protects,
made the first time it is needed and read back after, so names stay the same across restarts.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The bytes of a key (BLAKE2b takes up to 64).
KEY_BYTES = 32


class DeploymentKeyUnreadable(OSError):
    """A key file that cannot be made, or holds something other than a key."""


def deployment_key(path: Path, what: str = "key") -> bytes:
    """The key in ``path``, made (owner-only, random) where there is none; ``what`` names it in errors."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise DeploymentKeyUnreadable(f"{path} holds {len(key)} bytes, not a {what} of {KEY_BYTES}: restore the "
                                          f"deployment's {what}, or remove the file to make a new one") from None
        return key
    except OSError as error:
        raise DeploymentKeyUnreadable(f"cannot make the {what} {path}: {error}") from None
    key = os.urandom(KEY_BYTES)
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return key
