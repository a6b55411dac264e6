"""The safetensors framing of a saved file: its header (the tensor table and kvstate's metadata, with
a hash of its own), read back bounded by the file's size, and the bytes and content hashes of its
tensors.

Nothing here knows what a file holds (a prefix, a checkpoint): :mod:`~kvstate.interpreters.mlx.disk_store`
writes and reads the metadata; this module frames it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from kvstate.effects.completions import FailureReason
from kvstate.interpreters.mlx import content_hash
from kvstate.interpreters.mlx.file_io import RejectedFile

MAX_HEADER_BYTES = 64 << 20
SAFETENSORS_DTYPE = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
                     mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32",
                     mx.float32: "F32", mx.uint64: "U64", mx.int64: "I64"}
MX_DTYPE = {name: dtype for dtype, name in SAFETENSORS_DTYPE.items()}
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4,
               "F32": 4, "U64": 8, "I64": 8, "F64": 8}


#: Threads that hash and read saved files.
WORKER_COUNT = min(8, os.cpu_count() or 1)
_WORKERS: ThreadPoolExecutor | None = None


_digest = content_hash.digest


def workers() -> ThreadPoolExecutor:
    """The threads that hash and read saved files (reads and the hash let go of the GIL)."""
    global _WORKERS
    if _WORKERS is None:
        _WORKERS = ThreadPoolExecutor(max_workers=WORKER_COUNT, thread_name_prefix="kvstate-hash")
    return _WORKERS


def hash_all(buffers: list) -> list[str]:
    """The content hash of each buffer, on a few threads (the hash lets go of the GIL on large buffers)."""
    if len(buffers) < 2:
        return [_digest(b) for b in buffers]
    return list(workers().map(_digest, buffers))


def header_digest(metadata: dict[str, str], tensors: dict[str, Any]) -> str:
    """The hash of the header (metadata and tensor table): a flipped byte in it that still parses is caught."""
    table = {name: info for name, info in tensors.items() if name != "__metadata__"}
    canonical = json.dumps({"metadata": metadata, "tensors": table}, sort_keys=True, separators=(",", ":"))
    return _digest(canonical.encode())


PLACEHOLDER_DIGEST = "0" * content_hash.DIGEST_CHARS  # a header's size does not depend on its digests


def header_bytes(metadata: dict[str, str], described: dict[str, tuple[str, list[int]]], sizes: list[int],
            hashes: dict[str, str] | None) -> bytes:
    """The safetensors header (length, JSON, padding) of a file of these tensors; with ``hashes`` None,
    one of the same size (digests are all one length), to measure a file before it is hashed."""
    table: dict[str, Any] = {}
    offset = 0
    for (name, (dtype, shape)), size in zip(described.items(), sizes):
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    measuring = hashes is None
    if measuring:
        hashes = dict.fromkeys(described, PLACEHOLDER_DIGEST)
    metadata = {**metadata, "kvstate.hashes": json.dumps(hashes)}
    digest = PLACEHOLDER_DIGEST if measuring else header_digest(metadata, table)
    table["__metadata__"] = {**metadata, "kvstate.header_hash": digest}
    encoded = json.dumps(table, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def bytes_of(arrays: list[mx.array]) -> list[np.ndarray]:
    """The bytes of each evaluated array, as numpy views of their memory (no copy), to hash; the byte
    views are evaluated together (one at a time, their evaluation cost as much as hashing them)."""
    flat = [a.reshape(-1) for a in arrays]
    views = [f if f.dtype == mx.uint8 or f.size == 0 else mx.view(f, mx.uint8) for f in flat]
    mx.eval(views)
    return [np.asarray(v) if v.size else np.empty(0, dtype=np.uint8) for v in views]


def read_header(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """``(metadata, tensors)`` of a safetensors file, checked against its size; :class:`RejectedFile` if bad."""
    try:
        with open(path, "rb") as file:
            return header_of(file, path.name)
    except FileNotFoundError:
        raise RejectedFile(FailureReason.MISSING, f"{path.name}: not there") from None


def header_of(file: BinaryIO, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``(metadata, tensors)`` of the open safetensors ``file`` (``name`` for messages), from its start.

    Size and header come from the one open file, so a file replaced under its
    name meanwhile is never read half old, half new. No allocation is sized
    from an unchecked field: the header length is bounded by the file size and
    ``MAX_HEADER_BYTES`` before it is read.
    """
    try:
        size = os.fstat(file.fileno()).st_size
        file.seek(0)
        head = file.read(8)
        if len(head) < 8:
            raise RejectedFile(FailureReason.CORRUPT, f"{name}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise RejectedFile(FailureReason.CORRUPT, f"{name}: header length {length} past the file")
        header = json.loads(file.read(length))
    except (ValueError, UnicodeDecodeError) as error:
        raise RejectedFile(FailureReason.CORRUPT, f"{name}: header is not JSON ({error})") from None
    except OSError as error:
        raise RejectedFile(FailureReason.IO_ERROR, f"{name}: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise RejectedFile(FailureReason.CORRUPT, f"{name}: no metadata")
    metadata = header.pop("__metadata__")
    end = 0
    for tensor, info in header.items():
        try:
            start, stop = info["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in info["shape"]):
                raise ValueError
            count = math.prod(info["shape"])
            if not (0 <= start <= stop) or stop - start != count * DTYPE_BYTES[info["dtype"]]:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise RejectedFile(FailureReason.CORRUPT, f"{name}: tensor {tensor!r} is described wrongly") from None
        end = max(end, stop)
    if 8 + length + end != size:
        raise RejectedFile(FailureReason.CORRUPT, f"{name}: {size} bytes, header describes {8 + length + end}")
    return metadata, header
