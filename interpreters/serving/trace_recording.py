"""The server's own traffic as a request trace (``kvstate serve --record-trace PATH``), for replay.

One JSON line a request, in the bundled traces' format (``interpreters/traces/README.md``), so
``kvstate simulate PATH`` and ``kvstate replay PATH`` read it as they read those:

```json
{"timestamp": 1520, "input_length": 1811, "output_length": 8, "hash_ids": [...], "kept_ids": [...],
 "kept_length": 1818, "cached_tokens": 1280, "namespace": "9f3c..."}
```

- ``timestamp``: when the request's state was fetched, in ms since the recording began (a file
  appended to after a restart goes on from its last timestamp);
- ``hash_ids``: one id per 512-token block of the prompt, chained (an id stands for its block and
  everything before it, and for the request's namespace);
- ``kept_ids``, ``kept_length``: the same for the state the server offered to keep at the end (the
  prompt and the tokens generated, but the last), and its tokens: a replay keeps these, so the next
  turn's hits are those the server saw;
- ``cached_tokens``: the prompt tokens the server reused, as it reported them to the client;
- ``namespace``: a keyed hash of the request's namespace (its tenant).

Ids and namespaces are keyed hashes (BLAKE2b) under a key of the deployment's, kept beside the trace
in ``PATH.key`` (owner-only; made on first use): without it no prompt can be tested against the
file, and with one key the ids of every recording agree. Lines are written when a request's reply
is kept (the prompt, the output), so the file is in completion order; readers sort by timestamp.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from kvstate.interpreters.lab.traces import BLOCK_TOKENS
from kvstate.interpreters.serving.deployment_keys import DeploymentKeyUnreadable
from kvstate.interpreters.serving.deployment_keys import deployment_key as _deployment_key

#: Requests fetched and not yet answered, at most: a client that never gets its answer (a disconnect,
#: an error) must not grow the recorder without end; the oldest is written with no output.
MAX_PENDING = 4096


class TraceKeyUnreadable(DeploymentKeyUnreadable):
    """The deployment's key file beside the trace cannot be read or made, or is not a key."""


def deployment_key(path: Path) -> bytes:
    """The trace key in ``path`` (``PATH.key`` beside a trace), made where there is none."""
    try:
        return _deployment_key(path, "trace key")
    except DeploymentKeyUnreadable as error:
        raise TraceKeyUnreadable(str(error)) from None


class TraceHasher:
    """Chained keyed ids of a prompt's 512-token blocks, and keyed names of namespaces."""

    def __init__(self, key: bytes):
        self._key = key

    def _digest(self, data: bytes, person: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=8, person=person).digest()

    def namespace(self, namespace: str) -> str:
        return self._digest(namespace.encode(), b"kvst-ns").hex()

    def ids(self, namespace: str, tokens: tuple[int, ...]) -> list[int]:
        """One id per block of ``tokens`` (the last may be partial), each standing for the block, the
        blocks before it and the namespace."""
        return [_as_id(digest) for digest in self._chain(namespace, tokens)]

    def ids_of_both(self, namespace: str, prompt: tuple[int, ...], kept: tuple[int, ...]
                    ) -> tuple[list[int], list[int]]:
        """:meth:`ids` of ``prompt`` and of ``kept``, which extends it: the full blocks they share
        hashed once."""
        chain = self._chain(namespace, kept)
        full = len(prompt) // BLOCK_TOKENS
        prompt_chain = chain[:full]
        if len(prompt) % BLOCK_TOKENS:  # its partial last block: its own, after the shared ones
            parent = chain[full - 1] if full else self._root(namespace)
            prompt_chain += self._chain(namespace, prompt[full * BLOCK_TOKENS:], parent)
        return [_as_id(d) for d in prompt_chain], [_as_id(d) for d in chain]

    def _root(self, namespace: str) -> bytes:
        return self._digest(namespace.encode(), b"kvst-root")

    def _chain(self, namespace: str, tokens: tuple[int, ...], parent: bytes | None = None) -> list[bytes]:
        """The chained digests of ``tokens``' blocks, after ``parent`` (the namespace's root if None)."""
        parent, out = parent if parent is not None else self._root(namespace), []
        for start in range(0, len(tokens), BLOCK_TOKENS):
            block = tokens[start:start + BLOCK_TOKENS]
            parent = self._digest(parent + struct.pack(f"<{len(block)}q", *block), b"kvst-block")
            out.append(parent)
        return out


def _as_id(digest: bytes) -> int:
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit id


def recording_refusal(path: Path) -> str | None:
    """Why a trace cannot be recorded at ``path`` (checked before the model loads), or None: the file
    and its key can be opened, the key made where there is none."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        return f"cannot append to it ({error.strerror or error})"
    try:
        deployment_key(Path(f"{path}.key"))
    except TraceKeyUnreadable as error:
        return str(error)
    return None


def _last_timestamp(path: Path) -> int | None:
    """The timestamp of the last line of an existing trace, or None (none, or empty)."""
    try:
        with open(path, "rb") as trace:
            trace.seek(0, os.SEEK_END)
            size = trace.tell()
            trace.seek(max(0, size - 65536))
            lines = [line for line in trace.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["timestamp"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


class TraceRecorder:
    """Writes a line for each request the server serves: :meth:`fetched` when its state is fetched,
    :meth:`answered` when the state of its prompt and reply is kept (or :meth:`close` for one never
    answered). Safe from any thread."""

    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self._hasher = TraceHasher(deployment_key(Path(f"{self.path}.key")))
        self._clock = clock
        last = _last_timestamp(self.path)
        self._origin = clock() - (0.0 if last is None else (last + 1) / 1000)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str, tuple[int, ...], int, int]] = {}
        self._next = 0
        self.written = 0

    def fetched(self, namespace: str, prompt: tuple[int, ...], cached: int) -> None:
        """The server fetched state for ``prompt`` in ``namespace`` and reused ``cached`` of its tokens."""
        stamp = int(round(1000 * (self._clock() - self._origin)))
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                oldest = next(iter(self._pending))
                self._write(*self._pending.pop(oldest), tokens=None)
            self._pending[self._next] = (namespace, prompt, cached, stamp)
            self._next += 1

    def answered(self, namespace: str, tokens: tuple[int, ...], kept: int | None = None) -> None:
        """A reply in ``namespace`` ended with ``tokens`` (its prompt, then what it generated), and the
        server offered the state of the first ``kept`` of them (all if None; the last sampled token is
        not in the caches yet): the request fetched first whose prompt they extend is answered
        (nothing, if none is waiting)."""
        with self._lock:
            for number, (spoken, prompt, _, _) in self._pending.items():
                if spoken == namespace and len(tokens) >= len(prompt) and tokens[:len(prompt)] == prompt:
                    self._write(*self._pending.pop(number), tokens=tokens,
                                kept=max(len(prompt), len(tokens) if kept is None else kept))
                    return

    def _write(self, namespace: str, prompt: tuple[int, ...], cached: int, stamp: int,
               tokens: tuple[int, ...] | None, kept: int | None = None) -> None:
        tokens = tokens if tokens is not None else prompt
        kept_tokens = tokens[:kept if kept is not None else len(tokens)]
        prompt_ids, kept_ids = self._hasher.ids_of_both(namespace, prompt, kept_tokens)
        record = {"timestamp": stamp, "input_length": len(prompt), "output_length": len(tokens) - len(prompt),
                  "hash_ids": prompt_ids, "kept_ids": kept_ids,
                  "kept_length": len(kept_tokens), "cached_tokens": cached,
                  "namespace": self._hasher.namespace(namespace)}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self.written += 1

    def close(self) -> None:
        """Write what was fetched and never answered (no output), and close the file. Idempotent."""
        with self._lock:
            if self._file.closed:
                return
            for pending in self._pending.values():
                self._write(*pending, tokens=None)
            self._pending.clear()
            self._file.close()
