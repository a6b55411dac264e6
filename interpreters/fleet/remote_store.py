"""Saved blocks on an S3-compatible object store, shared by the servers of a fleet.

A block's object is its block file, byte for byte as the disk tier writes it (its header names the
model identity and the block, and records a hash of every tensor), so a server that reads one
verifies it as it verifies its own files (:meth:`~kvstate.interpreters.mlx.disk_store.DiskStore.adopt_block`)
and keeps it in its disk tier: the local disk caches what the remote holds. Objects are
content-addressed: ``PREFIX/<model>/<namespace>/<parent key>/<tokens>-<block key>``, the model a
digest of the store's identity, the namespace as the service names it (a tenant's is a keyed hash of
its salt, never the salt), the parent's and the block's chain hashes and the tokens it holds: so the
blocks that extend one are listed together, and a server finds the partial block that ends a
conversation another server kept (:meth:`RemoteStore.children`). A block is written once, by whichever server offers it first:
the write is conditional (``If-None-Match: *``), and a block already there is not sent again.

The store may be down, slow or answering errors: every call that fails raises
:class:`RemoteUnavailable` (quickly: short time-outs, no retries), and after a failure the store is
not asked again for ``back_off_s`` seconds of the caller's clock; the caller serves from its own
tiers meanwhile. Credentials come from the usual AWS variables (or any source boto3 reads).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable
from urllib.parse import urlparse

from kvstate.effects import completions as done
from kvstate.effects.effects import BlockName
from kvstate.interpreters.base import fetch_in_order
from kvstate.interpreters.mlx.file_io import RejectedFile, WriteFailed

try:
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError:  # the fleet extra is not installed: RemoteStore says so when built
    boto3 = None


class RemoteUnavailable(Exception):
    """The object store did not answer as it should (down, slow, an error, or backing off after one)."""


class BadRemoteUrl(ValueError):
    """A remote's address is not ``s3://BUCKET[/PREFIX]``."""


def parse_remote(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://BUCKET[/PREFIX]`` (the prefix without slashes at its ends)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc or len(parsed.netloc) < 3:
        raise BadRemoteUrl(f"{url!r} is not s3://BUCKET[/PREFIX] (a bucket name has 3 characters or more)")
    return parsed.netloc, parsed.path.strip("/")


class RemoteStore:
    """The blocks of one model identity in ``s3://BUCKET[/PREFIX]`` at ``endpoint_url`` (None: AWS's).

    ``clock`` is the caller's (seconds); ``timeout_s`` bounds each call's connect and read."""

    def __init__(self, url: str, identity: str, *, endpoint_url: str | None = None, clock: Callable[[], float],
                 timeout_s: float = 5.0, back_off_s: float = 30.0, client: Any = None):
        if boto3 is None and client is None:
            raise ImportError("a remote tier needs boto3: pip install 'kvstate[fleet]'")
        self.bucket, prefix = parse_remote(url)
        model = hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
        self.root = f"{prefix}/{model}" if prefix else model
        self.clock, self.back_off_s = clock, back_off_s
        self.client = client or boto3.client(
            "s3", endpoint_url=endpoint_url,
            config=botocore.config.Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                                          retries={"max_attempts": 1, "mode": "standard"}))
        self._down_until = float("-inf")
        #: What went wrong last (for the log), and how often calls failed.
        self.last_failure: str | None = None
        self.failures = 0
        #: Whether the last call failed (an outage in progress).
        self.down = False

    def object_key(self, name: BlockName) -> str:
        return f"{self._parent_folder(name.namespace, name.parent)}{len(name.tokens):06d}-{name.key.hex()}"

    def _parent_folder(self, namespace: str, parent: bytes) -> str:
        return f"{self.root}/{namespace}/{parent.hex()}/"

    def children(self, namespace: str, parent: bytes) -> list[tuple[int, bytes]]:
        """``(tokens, key)`` of every block the store holds after block ``parent`` (longest first)."""
        def call():
            prefix = self._parent_folder(namespace, parent)
            found = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    length, _, key = item["Key"][len(prefix):].partition("-")
                    try:
                        found.append((int(length), bytes.fromhex(key)))
                    except ValueError:
                        continue  # not an object of ours
            return sorted(found, reverse=True)
        return self._called(call)

    def fetch(self, name: BlockName) -> bytes | None:
        """The object of block ``name`` (unverified: the caller verifies it), or None where the store
        has none."""
        def call():
            try:
                reply = self.client.get_object(Bucket=self.bucket, Key=self.object_key(name))
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            return reply["Body"].read()
        return self._called(call)

    def holds(self, name: BlockName) -> bool:
        """Whether the store has an object for block ``name``."""
        def call():
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.object_key(name))
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return False
                raise
            return True
        return self._called(call)

    def offer(self, name: BlockName, data: bytes) -> bool:
        """Write ``data`` as block ``name``'s object unless one is there: True if this call wrote it,
        False if another server had (the first writer's object stands)."""
        def call():
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.object_key(name), Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412",
                                                                   "ConditionalRequestConflict"):
                    return False
                raise
            return True
        return self._called(call)

    def _called(self, call: Callable[[], Any]) -> Any:
        if self.clock() < self._down_until:
            raise RemoteUnavailable(f"backing off after: {self.last_failure}")
        try:
            answer = call()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
            self.failures += 1
            if not self.down:  # an outage is logged once, when it starts
                logging.warning("kvstate: the shared tier s3://%s/%s failed (%s: %s): requests are served from this "
                                "server's own tiers; it is asked again in %g s, and every failure is counted in "
                                "kvstate_remote_failures_total", self.bucket, self.root, type(error).__name__, error,
                                self.back_off_s)
            self.down = True
            self.last_failure = f"{type(error).__name__}: {error}"
            self._down_until = self.clock() + self.back_off_s
            raise RemoteUnavailable(self.last_failure) from None
        if self.down:
            logging.warning("kvstate: the shared tier s3://%s/%s answers again", self.bucket, self.root)
            self.down = False
        return answer


def fetch_chain(remote: RemoteStore, store: Any, effect: Any) -> done.RemoteFetched:
    """Carry out a ``FetchRemote``: its blocks (one chain, in order) into ``store`` (a
    :class:`~kvstate.interpreters.mlx.disk_store.DiskStore`), each verified before it is kept, up to the
    first the remote cannot give or gives in a form that fails its checks (nothing of that one is
    kept); where the remote lacks one (or has them all), then the longest partial block after the last
    one read that the prompt goes on with."""
    blocks, nbytes, trouble = [], 0, {"rejected": False, "failed": False}
    started = time.perf_counter()

    def kept(name: BlockName) -> bool | None:
        """Whether block ``name`` was fetched and kept; None where the fetch must stop (it failed its
        checks, or the remote or the disk failed)."""
        nonlocal nbytes
        try:
            data = remote.fetch(name)
        except RemoteUnavailable:
            trouble["failed"] = True
            return None
        if data is None:
            return False
        try:
            saved = store.adopt_block(name, data)
        except RejectedFile:
            trouble["rejected"] = True
            return None
        except WriteFailed:  # the local disk could not keep it: as good as not fetched
            trouble["failed"] = True
            return None
        blocks.append(done.SavedBlock(name, saved.nbytes, saved.file_bytes, 0.0, saved.trimmable))
        nbytes += len(data)
        return True

    def children(parent: bytes) -> list[tuple[int, bytes]] | None:
        try:
            return remote.children(effect.namespace, parent)
        except RemoteUnavailable:
            trouble["failed"] = True
            return None

    fetch_in_order(effect, kept, children)
    seconds = time.perf_counter() - started if nbytes else None
    tail = None if effect.names else (effect.namespace, effect.after)
    return done.RemoteFetched(effect.names, tuple(blocks), nbytes, seconds, trouble["rejected"], trouble["failed"],
                              tail)


def offer_block(remote: RemoteStore, store: Any, name: BlockName) -> done.RemoteOffered | None:
    """Offer saved block ``name``'s file to ``remote`` (None: its file is gone, nothing to offer)."""
    try:
        if remote.holds(name):  # asked first: a block already there is not sent again
            return done.RemoteOffered(name, False)
        data = store.saved_block_bytes(name)
        if data is None:
            return None
        return done.RemoteOffered(name, remote.offer(name, data))
    except RemoteUnavailable:
        return done.RemoteOffered(name, None)
