"""Saved state on disk: kvstate's own versioned format on safetensors.

One file per saved prefix (or generation checkpoint), under
``<root>/<config fingerprint>/``. The safetensors metadata is the header:
format version, identity (model fingerprint, tokenizer hash, config
fingerprint), namespace, the token list, per layer the cache class and its
scalars, and a content hash per tensor (xxh3-128: :mod:`~kvstate.interpreters.mlx.content_hash`).
Only live tokens are stored. Files of another format version (format 1 hashed with blake2b) are
rejected and counted, as any foreign file is.

Files are encoded on the caller's thread (the only mlx work) and committed by
plain file I/O (:mod:`~kvstate.interpreters.mlx.file_io`; the safetensors framing is
:mod:`~kvstate.interpreters.mlx.framing`), so a background writer never touches mlx. Writes are
atomic: a temp file in the same directory, fsync, rename, fsync of the directory; a crash leaves either the old state or the new, never half a
file under a real name (stale temp files are removed at scan). Reads check the
header against the file's size and the store's identity, and (by default) every
tensor's hash; a file that fails is moved to ``rejected/`` with its reason and
reported as :class:`RejectedFile`, never restored. ``scan`` rebuilds the index
from headers alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import struct
import threading
from array import array
from pathlib import Path
from typing import Any, BinaryIO, Callable

import attrs
import mlx.core as mx
import numpy as np

from kvstate.core.errors import StorageError
from kvstate.core.blocks import saved_chains
from kvstate.core.state import OBJECTS
from kvstate.effects.completions import FailureReason, SavedBlock, SavedCheckpoint, SavedRecord
from kvstate.effects.effects import BlockName, CheckpointMeta, DiskKey, SnapshotName
from kvstate.interpreters.mlx import chain_reads, file_io, framing, staged_reads
from kvstate.interpreters.mlx.caches import codec_named, codec_of
from kvstate.interpreters.mlx.chain_reads import HeldPart, PartRejected, SavedPart
from kvstate.interpreters.mlx.device_memory import move_to_device, on_cuda
from kvstate.interpreters.mlx.file_io import (
    LOADERS, ReadBuffers, RejectedFile, SeamReader, WriteFailed, default_loader, open_file_path, private_directory,
    remove_quietly, writer_alive,
)
from kvstate.interpreters.mlx.framing import MX_DTYPE, SAFETENSORS_DTYPE

#: The saved files' format: 3 keeps state in blocks (``block-`` files) beside whole prefixes and
#: checkpoints; files of an earlier format are rejected and counted, never restored.
FORMAT_VERSION = "3"
#: Rejected files kept for inspection in ``rejected/``, newest first; older ones are deleted.
REJECTED_KEEP = 16
SUFFIX = ".safetensors"
#: The lock file a live service holds in its model directory (one writer per directory).
WRITER = ".writer"


class DirectoryInUse(StorageError):
    """Another live service (in this process or another) already writes this model directory."""


@attrs.frozen
class StoreIdentity:
    """What saved state must match to be restored: model, tokenizer and config."""

    model_fingerprint: str
    tokenizer_hash: str
    config_fingerprint: str

    def encoded(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)


def _name(kind: str, *parts: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part)
        digest.update(b"\x00")
    return f"{kind}-{digest.hexdigest()}{SUFFIX}"


@attrs.frozen(eq=False)
class EncodedFile:
    """A saved file, prepared on the caller's thread: metadata, and each tensor as evaluated bytes
    (where the arrays live: on a GPU they stay there until the commit copies them out)."""

    path: Path
    metadata: dict[str, str]
    described: dict[str, tuple[str, list[int]]]
    views: dict[str, mx.array]
    #: The bytes the file will take, header included.
    file_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views.values())


@attrs.frozen
class SavedFile:
    """What a header says about one saved file."""

    path: Path
    kind: str
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    checkpoint: CheckpointMeta | None
    #: The bytes the file takes, as the file system counts its size.
    file_bytes: int
    #: The file's modification time: when it was written, or last read back (a restore touches it).
    used_at: float = 0.0
    #: A block's or a snapshot's name (None for a whole prefix or a checkpoint).
    block: BlockName | SnapshotName | None = None


def _tensors_of(block: list[dict[str, Any]]) -> dict[str, Any]:
    """A block's arrays as a file names its tensors: ``"layer.array"``."""
    return {f"{i}.{array_name}": a for i, layer in enumerate(block) for array_name, a in layer.items()}


def _block_of(tensors: dict[str, Any], layers: int) -> list[dict[str, Any]]:
    """The block of ``layers`` layers whose tensors a file names ``"layer.array"``."""
    block: list[dict[str, Any]] = [{} for _ in range(layers)]
    for name, a in tensors.items():
        layer, _, array_name = name.partition(".")
        block[int(layer)][array_name] = a
    return block


def _touch(path: Path) -> None:
    """Mark a saved file used now (its modification time), so a scan at start and the root budget's
    reclaim, which delete the least recently used files first, see the read. Never an error: a file
    that cannot be touched (a read-only disk) keeps its write time."""
    try:
        os.utime(path)
    except OSError:
        pass


@attrs.frozen(eq=False)
class ReadAhead:
    """A saved file to read ahead: its checked header, and one host array for its tensors' bytes
    (allocated, not written yet) with a numpy view of it, which the read fills in place; the tensors
    are made views of that array when the content is built."""

    path: Path
    metadata: dict
    tensors: dict
    data_start: int
    data: mx.array
    target: np.ndarray


def _slices_of(data: np.ndarray, tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each tensor's bytes in a whole safetensors file read into ``data`` (views, not copies)."""
    (length,) = struct.unpack("<Q", data[:8].tobytes())
    start = 8 + length
    return {name: data[start + info["data_offsets"][0]:start + info["data_offsets"][1]]
            for name, info in tensors.items() if name != "__metadata__"}


class DiskStore:
    """Saved prefixes and checkpoints of one model identity under ``root``."""

    def __init__(self, root: str | os.PathLike, identity: StoreIdentity, *, verify: bool = True,
                 budget: Any = None, write_file: Callable[[Path, list], None] | None = None,
                 rejected_keep: int = REJECTED_KEEP, loader: str | None = None, to_device: bool | None = None):
        if loader is not None and loader not in LOADERS:
            raise ValueError(f"loader must be one of {LOADERS} or None (chosen by device), got {loader!r}")
        self.loader = loader or default_loader()
        #: Whether a restore moves its arrays onto the CUDA device before handing them out
        #: (:mod:`~kvstate.interpreters.mlx.device_memory`); by default, where the device is a CUDA GPU.
        self.to_device = on_cuda() if to_device is None else to_device
        if self.to_device:  # the staging of chain reads made and checked now, not at the first restore
            staged_reads.cuda_staging()
        self.write_file = write_file or file_io.write_durably  # the storage seam: tests put a full disk here
        self.rejected_keep = rejected_keep
        self.root = Path(root)
        self.identity = identity
        self.verify = verify
        self._reads = ReadBuffers()
        self.directory = self.root / identity.config_fingerprint
        self.rejected_directory = self.directory / "rejected"
        private_directory(self.root)
        private_directory(self.directory)
        self.rejected: list[tuple[str, FailureReason]] = []
        #: Files in ``rejected/`` and their bytes, as the last prune found them.
        self.rejected_held: tuple[int, int] = (0, 0)
        self.budget = budget
        self._writer: int | None = None  # the claim on the directory, while a service writes it
        if budget is not None:
            budget.attach(self.directory)
            try:
                budget.reclaim()  # a lowered budget, or another process's leftovers, take effect now
            except BaseException:
                budget.detach(self.directory)  # a failed start leaves no live lock behind
                raise

    def claim_writer(self) -> None:
        """Hold the model directory for this store's service alone, until :meth:`close`: two live
        services on one directory would each keep its files within their own budget and delete
        files the other still counts, so a second one is refused. The kernel lets go of a killed
        process's claim. On a read-only file system, where nothing can be written or deleted, an
        existing lock file is claimed and a missing one is not needed."""
        try:
            descriptor = os.open(self.directory / WRITER, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            if error.errno not in (errno.EROFS, errno.EACCES):
                raise
            try:
                descriptor = os.open(self.directory / WRITER, os.O_RDONLY)
            except FileNotFoundError:
                return
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise DirectoryInUse(f"another live service already writes {self.directory}: give each service "
                                 f"its own disk_dir, or close the other first") from None
        self._writer = descriptor

    def close(self) -> None:
        """This store is idle from now on: its files count against the root budget and may be evicted."""
        writer, self._writer = self._writer, None
        if writer is not None:
            fcntl.flock(writer, fcntl.LOCK_UN)
            os.close(writer)
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.detach(self.directory)
            budget.reclaim()

    # ------------------------------------------------------------ names

    def prefix_path(self, key: DiskKey) -> Path:
        return self.directory / _name("prefix", key.namespace.encode(), array("q", key.tokens).tobytes())

    def block_path(self, name: BlockName) -> Path:
        return self.directory / _name("block", name.namespace.encode(), name.key)

    def snapshot_path(self, name: SnapshotName) -> Path:
        """A snapshot is named by the block its chain ends in: it is the state at that block's end."""
        return self.directory / _name("snapshot", name.namespace.encode(), name.parent)

    def _path_of(self, name: DiskKey | BlockName | SnapshotName) -> Path:
        if isinstance(name, BlockName):
            return self.block_path(name)
        if isinstance(name, SnapshotName):
            return self.snapshot_path(name)
        return self.prefix_path(name)

    def checkpoint_path(self, key: str) -> Path:
        return self.directory / _name("checkpoint", key.encode())

    # ------------------------------------------------------------ writes

    def encode_prefix(self, key: DiskKey, caches: list, trimmable: bool, nbytes: int) -> "EncodedFile":
        """The file for a prefix, ready to commit (mlx work happens here, on the caller's thread)."""
        return self._encode(self.prefix_path(key), *self._prefix_fields(key, trimmable, nbytes), caches)

    def encode_checkpoint(self, meta: CheckpointMeta, tokens: tuple[int, ...], caches: list) -> "EncodedFile":
        return self._encode(self.checkpoint_path(meta.key), *self._checkpoint_fields(meta, tokens), caches)

    def prefix_file_bytes(self, key: DiskKey, caches: list, trimmable: bool, nbytes: int) -> int:
        """The exact bytes the file of this prefix will take, header included; nothing is evaluated."""
        return self._file_bytes(*self._prefix_fields(key, trimmable, nbytes), caches)

    def checkpoint_file_bytes(self, meta: CheckpointMeta, tokens: tuple[int, ...], caches: list) -> int:
        """The exact bytes the file of this checkpoint will take, header included."""
        return self._file_bytes(*self._checkpoint_fields(meta, tokens), caches)

    def encode_block(self, name: BlockName, block: list[dict[str, mx.array]], classes: list[str]) -> "EncodedFile":
        """The file of one block (each layer's arrays of its span; ``classes``, the layers' cache classes),
        ready to commit."""
        metadata, tensors = self._block_layout(name, block, classes)
        return self._encoded(self.block_path(name), metadata, tensors)

    def block_file_bytes(self, name: BlockName, block: list[dict[str, mx.array]], classes: list[str]) -> int:
        """The exact bytes the file of this block will take, header included; nothing is evaluated."""
        return self._sized(*self._block_layout(name, block, classes))

    def _block_layout(self, name: BlockName, block: list[dict[str, mx.array]],
                      classes: list[str]) -> tuple[dict[str, str], dict[str, mx.array]]:
        tensors = _tensors_of(block)
        nbytes = sum(a.nbytes for a in tensors.values())
        metadata = {
            "kvstate.format": FORMAT_VERSION, "kvstate.identity": self.identity.encoded(), "kvstate.kind": "block",
            "kvstate.namespace": name.namespace, "kvstate.tokens": json.dumps(list(name.tokens)),
            "kvstate.block": json.dumps({"key": name.key.hex(), "parent": name.parent.hex(), "start": name.start}),
            "kvstate.layers": json.dumps([{"class": c} for c in classes]),
            # Serves alone only where every layer is cut; else only with a snapshot at its chain's end.
            "kvstate.trimmable": json.dumps(all(block)), "kvstate.nbytes": str(nbytes)}
        return metadata, tensors

    def encode_snapshot(self, name: SnapshotName, snapshot: list) -> "EncodedFile":
        """The file of one snapshot (a cache for each layer blocks do not hold, None for the others)."""
        return self._encoded(self.snapshot_path(name), *self._snapshot_layout(name, snapshot))

    def snapshot_file_bytes(self, name: SnapshotName, snapshot: list) -> int:
        return self._sized(*self._snapshot_layout(name, snapshot))

    def _snapshot_layout(self, name: SnapshotName, snapshot: list) -> tuple[dict[str, str], dict[str, mx.array]]:
        tensors: dict[str, mx.array] = {}
        layers = []
        for i, cache in enumerate(snapshot):
            if cache is None:
                layers.append({"class": None})
                continue
            arrays, meta = codec_of(cache).save(cache)
            tensors.update({f"{i}.{array_name}": a for array_name, a in arrays.items()})
            layers.append({"class": type(cache).__name__, **meta})
        metadata = {
            "kvstate.format": FORMAT_VERSION, "kvstate.identity": self.identity.encoded(),
            "kvstate.kind": "snapshot", "kvstate.namespace": name.namespace,
            "kvstate.tokens": json.dumps(list(name.tokens)), "kvstate.parent": name.parent.hex(),
            "kvstate.layers": json.dumps(layers), "kvstate.trimmable": "false",
            "kvstate.nbytes": str(sum(a.nbytes for a in tensors.values()))}
        return metadata, tensors

    @staticmethod
    def _prefix_fields(key: DiskKey, trimmable: bool, nbytes: int) -> tuple:
        return ("prefix", key.namespace, key.tokens,
                {"kvstate.trimmable": json.dumps(trimmable), "kvstate.nbytes": str(nbytes)})

    @staticmethod
    def _checkpoint_fields(meta: CheckpointMeta, tokens: tuple[int, ...]) -> tuple:
        return ("checkpoint", meta.namespace, tokens,
                {"kvstate.checkpoint": json.dumps(attrs.asdict(meta)), "kvstate.trimmable": "false",
                 "kvstate.nbytes": "0"})

    def _layout(self, kind: str, namespace: str, tokens: tuple[int, ...], extra: dict[str, str],
                caches: list) -> tuple[dict[str, str], dict[str, mx.array]]:
        """The file's metadata (hashes aside) and its tensors, as lazy arrays."""
        tensors: dict[str, mx.array] = {}
        layers = []
        for i, cache in enumerate(caches):
            arrays, meta = codec_of(cache).save(cache)
            tensors.update({f"{i}.{name}": a for name, a in arrays.items()})
            layers.append({"class": type(cache).__name__, **meta})
        metadata = {
            "kvstate.format": FORMAT_VERSION, "kvstate.identity": self.identity.encoded(), "kvstate.kind": kind,
            "kvstate.namespace": namespace, "kvstate.tokens": json.dumps(list(tokens)),
            "kvstate.layers": json.dumps(layers), **extra}
        return metadata, tensors

    def _file_bytes(self, kind: str, namespace: str, tokens: tuple[int, ...], extra: dict[str, str],
                    caches: list) -> int:
        return self._sized(*self._layout(kind, namespace, tokens, extra, caches))

    @staticmethod
    def _sized(metadata: dict[str, str], tensors: dict[str, mx.array]) -> int:
        described = {name: (SAFETENSORS_DTYPE[a.dtype], list(a.shape)) for name, a in tensors.items()}
        sizes = [a.nbytes for a in tensors.values()]
        return len(framing.header_bytes(metadata, described, sizes, None)) + sum(sizes)

    def _encode(self, path: Path, kind: str, namespace: str, tokens: tuple[int, ...], extra: dict[str, str],
                caches: list) -> "EncodedFile":
        return self._encoded(path, *self._layout(kind, namespace, tokens, extra, caches))

    @staticmethod
    def _encoded(path: Path, metadata: dict[str, str], tensors: dict[str, mx.array]) -> "EncodedFile":
        views = {name: mx.view(mx.contiguous(a), mx.uint8) for name, a in tensors.items()}
        mx.eval(list(views.values()))  # the only mlx work; copying to the host and hashing happen at commit
        described = {name: (SAFETENSORS_DTYPE[a.dtype], list(a.shape)) for name, a in tensors.items()}
        sizes = [v.nbytes for v in views.values()]
        file_bytes = len(framing.header_bytes(metadata, described, sizes, None)) + sum(sizes)
        return EncodedFile(path, metadata, described, views, file_bytes)

    def commit(self, file: "EncodedFile") -> None:
        """Write ``file`` atomically (temp file, fsync, rename, fsync of the directory); plain file I/O only.

        :class:`WriteFailed` if it could not; nothing under the real name changed then.
        """
        temp = file.path.with_name(f".{file.path.stem}.tmp-{os.getpid()}-{threading.get_ident()}{SUFFIX}")
        buffers = [np.asarray(view).reshape(-1) for view in file.views.values()]  # device to host, if it must
        hashes = dict(zip(file.views, framing.hash_all(buffers)))
        head = framing.header_bytes(file.metadata, file.described, [raw.nbytes for raw in buffers], hashes)
        if len(head) + sum(raw.nbytes for raw in buffers) != file.file_bytes:
            raise WriteFailed(FailureReason.IO_ERROR, f"{file.path.name}: encoded to another size than measured "
                                                      f"({file.file_bytes} bytes); its caches changed meanwhile")
        try:
            self.write_file(temp, [head, *buffers])
            os.replace(temp, file.path)
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            remove_quietly(temp)
            no_space = error.errno in (errno.ENOSPC, errno.EDQUOT)
            raise WriteFailed(FailureReason.NO_SPACE if no_space else FailureReason.IO_ERROR,
                              f"{file.path.name}: {error}") from None

    def saved_block_bytes(self, name: BlockName) -> bytes | None:
        """The bytes of the file of block ``name`` as they lie on disk (to offer another tier), or None
        where there is none or it cannot be read."""
        try:
            return self.block_path(name).read_bytes()
        except OSError:
            return None

    def adopt_block(self, name: BlockName, data: bytes) -> SavedFile:
        """Take the bytes of a block file from elsewhere (another server's, through a shared tier) as
        this store's file of ``name``, once verified as a restore verifies a file, whatever ``verify``
        says: its header (hash, format, model identity, the very block ``name`` names) and every tensor
        against its hash. What its header says (``nbytes``, ``trimmable``, ``file_bytes``).
        :class:`RejectedFile` where it cannot be trusted, and
        :class:`WriteFailed` where it cannot be written: nothing is kept either way."""
        path = self.block_path(name)
        temp = path.with_name(f".{path.stem}.adopt-{os.getpid()}-{threading.get_ident()}{SUFFIX}")
        buffer = np.frombuffer(data, np.uint8)
        try:
            self.write_file(temp, [buffer])
        except OSError as error:
            remove_quietly(temp)
            no_space = error.errno in (errno.ENOSPC, errno.EDQUOT)
            raise WriteFailed(FailureReason.NO_SPACE if no_space else FailureReason.IO_ERROR,
                              f"{path.name}: {error}") from None
        try:
            with open(temp, "rb") as file:
                described, metadata, tensors = self._describe_named(name, path, file)
            start = described.file_bytes - max((info["data_offsets"][1] for info in tensors.values()), default=0)
            self._verify(path, metadata, {tensor: buffer[start + info["data_offsets"][0]:start + info["data_offsets"][1]]
                                          for tensor, info in tensors.items()})
            os.replace(temp, path)
        except BaseException:
            remove_quietly(temp)
            raise
        return described

    def delete_prefix(self, key: DiskKey | BlockName | SnapshotName) -> None:
        remove_quietly(self._path_of(key))

    def delete_checkpoint(self, key: str) -> None:
        remove_quietly(self.checkpoint_path(key))

    # ------------------------------------------------------------ reads

    @staticmethod
    def _open(path: Path) -> BinaryIO:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise RejectedFile(FailureReason.MISSING, f"{path.name}: not there") from None
        except OSError as error:
            raise RejectedFile(FailureReason.IO_ERROR, f"{path.name}: {error}") from None

    @staticmethod
    def _still_named(path: Path, file: BinaryIO) -> bool:
        """Whether ``path`` still names the open ``file`` (not replaced or deleted since it was opened)."""
        try:
            now = os.stat(path)
        except OSError:
            return False
        opened = os.fstat(file.fileno())
        return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)

    def _reject(self, path: Path, file: BinaryIO, rejected: RejectedFile) -> bool:
        """Move the rejected open ``file`` aside; False (nothing done) when ``path`` no longer names it
        (the file there now has not been judged), or when the read failed with an I/O error, which says
        nothing of the file: only a verified mismatch moves a file aside."""
        if rejected.reason in (FailureReason.MISSING, FailureReason.IO_ERROR) or not self._still_named(path, file):
            return False
        self.move_aside(path, rejected.reason)
        return True

    def _describe_named(self, name: BlockName | SnapshotName, path: Path, file: BinaryIO
                        ) -> tuple[SavedFile, dict[str, str], dict[str, Any]]:
        """:meth:`_describe`, and :class:`RejectedFile` where the header names other state than ``name``."""
        described, metadata, tensors = self._describe(path, file)
        if described.block != name:
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: holds other state than its name says")
        return described, metadata, tensors

    def _describe(self, path: Path, file: BinaryIO) -> tuple[SavedFile, dict[str, str], dict[str, Any]]:
        metadata, tensors = framing.header_of(file, path.name)
        recorded = metadata.get("kvstate.header_hash")
        rest = {k: v for k, v in metadata.items() if k != "kvstate.header_hash"}
        if recorded is None or recorded != framing.header_digest(rest, tensors):
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: the header fails its hash (or has none)")
        if metadata.get("kvstate.format") != FORMAT_VERSION:
            raise RejectedFile(FailureReason.IDENTITY_MISMATCH,
                               f"{path.name}: format {metadata.get('kvstate.format')!r}, this store reads "
                               f"{FORMAT_VERSION}")
        if metadata.get("kvstate.identity") != self.identity.encoded():
            raise RejectedFile(FailureReason.IDENTITY_MISMATCH, f"{path.name}: saved for another model identity")
        try:
            tokens = tuple(int(t) for t in json.loads(metadata["kvstate.tokens"]))
            checkpoint = None
            if metadata["kvstate.kind"] == "checkpoint":
                checkpoint = CheckpointMeta(**json.loads(metadata["kvstate.checkpoint"]))
            block: BlockName | SnapshotName | None = None
            if metadata["kvstate.kind"] == "block":
                fields = json.loads(metadata["kvstate.block"])
                block = BlockName(metadata["kvstate.namespace"], bytes.fromhex(fields["key"]),
                                  bytes.fromhex(fields["parent"]), int(fields["start"]), tokens)
            elif metadata["kvstate.kind"] == "snapshot":
                block = SnapshotName(metadata["kvstate.namespace"], tokens, bytes.fromhex(metadata["kvstate.parent"]))
            stat = os.fstat(file.fileno())
            described = SavedFile(path, metadata["kvstate.kind"], metadata["kvstate.namespace"], tokens,
                                  int(metadata["kvstate.nbytes"]), json.loads(metadata["kvstate.trimmable"]) is True,
                                  checkpoint, stat.st_size, stat.st_mtime, block)
            json.loads(metadata["kvstate.layers"])
            hashes = json.loads(metadata["kvstate.hashes"])
        except (KeyError, TypeError, ValueError) as error:
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: header field missing or malformed "
                                                      f"({error})") from None
        if not isinstance(hashes, dict) or set(hashes) != set(tensors):
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: tensor hashes do not name its tensors")
        return described, metadata, tensors

    def _load(self, path: Path) -> tuple[SavedFile, list]:
        """Read the file once; verify each tensor's bytes on the host; then build the arrays from them.

        Header and data come from one open file: a file replaced under its name
        meanwhile gives the content of the one that was opened, never a mix. An
        I/O error or a short read is tried once more from a fresh open before the
        file is rejected; whatever goes wrong, the caller hears :class:`RejectedFile`.
        """
        return self._opened(path, functools.partial(self._load_open, path))

    def _opened(self, path: Path, read: Callable[[BinaryIO], Any]) -> Any:
        """``read`` of the file at ``path``, opened: an I/O error or a short read is tried once more from
        a fresh open; a file that cannot be trusted is moved aside (:class:`RejectedFile`)."""
        for attempt in (1, 2):
            try:
                file = self._open(path)
            except RejectedFile as rejected:
                if rejected.reason is FailureReason.IO_ERROR and attempt == 1:
                    continue
                raise
            with file:
                try:
                    return read(file)
                except RejectedFile as rejected:
                    if rejected.reason is FailureReason.IO_ERROR and attempt == 1:
                        continue
                    self._reject(path, file, rejected)
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _read_whole(path: Path, file: BinaryIO, data: np.ndarray) -> None:
        """The open ``file``, all of it, into ``data`` (as large as the file); an I/O error or a short read
        is :class:`RejectedFile` with ``IO_ERROR``."""
        try:
            file.seek(0)
            got = file_io.read_into(file, memoryview(data))
        except (OSError, ValueError) as error:
            raise RejectedFile(FailureReason.IO_ERROR, f"{path.name}: {error}") from None
        if got != len(data):
            raise RejectedFile(FailureReason.IO_ERROR, f"{path.name}: read {got} of its {len(data)} bytes")

    def _load_open(self, path: Path, file: BinaryIO) -> tuple[SavedFile, list]:
        described, metadata, tensors = self._describe(path, file)
        if self.loader == "mlx":
            return described, self._load_by_mlx(path, file, metadata, tensors)
        size = os.fstat(file.fileno()).st_size
        with self._reads.take(size) as data:
            self._read_whole(path, file, data[:size])
            try:
                return described, self._decode(path, data, metadata, tensors)
            except RejectedFile:
                raise
            except Exception as error:  # noqa: BLE001 - a header that passed its checks and still fails to build
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: cannot be rebuilt ({error!r})") from None

    def _load_by_mlx(self, path: Path, file: BinaryIO, metadata: dict[str, str], tensors: dict[str, Any]) -> list:
        """MLX's own safetensors loader reads the arrays straight into their memory from the file the
        header was checked in (no host buffer between); then each tensor's bytes are hashed where they lie.

        Where the open file has a path of its own (:func:`open_file_path`), MLX reads it there with its
        parallel reader, into host memory (``mx.cpu``), which a CUDA device then takes in bulk; else it
        reads through :class:`SeamReader`, one Python read a tensor. The header check has already held
        the file's size to what its header describes."""
        by_path = open_file_path(file)
        stream = None if by_path is not None else SeamReader(file, path.name)
        try:
            if stream is None:
                arrays = mx.load(by_path, format="safetensors", stream=mx.cpu)
            else:
                file.seek(0)
                arrays = mx.load(stream, format="safetensors")
            mx.eval(list(arrays.values()))
        except (RuntimeError, ValueError, OSError) as error:
            if stream is not None and stream.failure is not None:
                raise stream.failure from None
            if stream is None and str(error).startswith("[read]"):  # MLX's own read of the file failed
                raise RejectedFile(FailureReason.IO_ERROR, f"{path.name}: {error}") from None
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: cannot be read as safetensors "
                                                      f"({error})") from None
        try:
            names = [name for name in tensors if name != "__metadata__"]
            if set(arrays) != set(names):
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: its tensors are not the ones its header "
                                                          f"names")
            for name in names:
                dtype = MX_DTYPE.get(tensors[name]["dtype"])
                if dtype is None or arrays[name].dtype != dtype:
                    raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: tensor {name!r} has dtype "
                                                              f"{tensors[name]['dtype']}")
            if self.verify:
                self._verify(path, metadata, dict(zip(names, framing.bytes_of([arrays[name] for name in names]))))
            return self._caches(path, metadata, arrays)
        except RejectedFile:
            raise
        except Exception as error:  # noqa: BLE001 - a header that passed its checks and still fails to build
            raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: cannot be rebuilt ({error!r})") from None

    def _verify(self, path: Path, metadata: dict[str, str], buffers: dict[str, Any]) -> None:
        """Every tensor's bytes against the hash its header records."""
        hashes = json.loads(metadata["kvstate.hashes"])
        for name, digest in zip(buffers, framing.hash_all(list(buffers.values()))):
            if digest != hashes.get(name):
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: tensor {name!r} fails its hash")

    def _caches(self, path: Path, metadata: dict[str, str], arrays: dict[str, mx.array]) -> list:
        """The mlx-lm caches of the file's layers, built from its arrays by each layer's codec (verified
        by now, so moving them to the device is the last thing done to their bytes)."""
        if self.to_device:
            move_to_device(arrays.values())
        if metadata["kvstate.kind"] == "block":  # a block is its layers' arrays: assembled by the caller
            return _block_of(arrays, len(json.loads(metadata["kvstate.layers"])))
        caches = []
        for i, layer in enumerate(json.loads(metadata["kvstate.layers"])):
            prefix = f"{i}."
            own = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
            try:
                if layer["class"] is None:  # a snapshot's layer that blocks hold
                    caches.append(None)
                    continue
                caches.append(codec_named(layer["class"]).load(own, layer))
            except (KeyError, TypeError, ValueError):
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: layer {i} cannot be rebuilt") from None
        return caches

    def _decode(self, path: Path, data: np.ndarray, metadata: dict[str, str], tensors: dict[str, Any]) -> list:
        slices = _slices_of(data, tensors)
        if self.verify:
            self._verify(path, metadata, slices)
        return self._built(path, metadata, tensors, slices)

    def _built(self, path: Path, metadata: dict[str, str], tensors: dict[str, Any], slices: dict[str, Any]) -> list:
        """The file's content, its arrays built (copied) from its verified host bytes."""
        arrays = {}
        for name, raw in slices.items():
            info = tensors[name]
            dtype = MX_DTYPE.get(info["dtype"])
            if dtype is None:
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: tensor {name!r} has dtype "
                                                          f"{info['dtype']}")
            arrays[name] = mx.view(mx.array(raw), dtype).reshape(info["shape"])  # a copy: the buffer is reused
        return self._caches(path, metadata, arrays)

    def read_prefix(self, key: DiskKey) -> list:
        """The caches saved under ``key``; :class:`RejectedFile` (moved aside) if they cannot be trusted."""
        described, caches = self._load(self.prefix_path(key))
        if (described.namespace, described.tokens) != (key.namespace, key.tokens):
            self.move_aside(described.path, FailureReason.CORRUPT)
            raise RejectedFile(FailureReason.CORRUPT, f"{described.path.name}: covers other tokens than its name")
        _touch(described.path)
        return caches

    def read_block(self, name: BlockName) -> list[dict[str, mx.array]]:
        """The arrays of the block ``name`` names, each layer's; :class:`RejectedFile` (moved aside) if
        they cannot be trusted (a header that names another block, or fails its hashes)."""
        return self._read_named(name)

    def read_chain(self, chain: list[BlockName | list[dict[str, mx.array]]]) -> list[dict[str, mx.array]]:
        """Each layer's arrays of a chain of blocks, joined (first position first): the blocks named read
        from their files straight into their places and verified there, the others (blocks held in RAM)
        copied in (:mod:`~kvstate.interpreters.mlx.chain_reads`).

        :class:`PartRejected` names the block that cannot be trusted (its file moved aside where its
        header or bytes are wrong); an I/O error or a short read is tried once more from fresh opens."""
        for attempt in (1, 2):
            try:
                return self._read_chain_once(chain)
            except PartRejected as failure:
                if failure.rejected.reason is not FailureReason.IO_ERROR or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _read_chain_once(self, chain: list[BlockName | list[dict[str, mx.array]]]) -> list[dict[str, mx.array]]:
        layers = 0
        with contextlib.ExitStack() as files:
            parts: list[SavedPart | HeldPart] = []
            opened: dict[int, tuple[Path, BinaryIO]] = {}
            for index, part in enumerate(chain):
                if not isinstance(part, BlockName):
                    arrays = _tensors_of(part)
                    positions = next(iter(arrays.values())).shape[-2] if arrays else 0
                    parts.append(HeldPart(arrays, positions))
                    layers = max(layers, len(part))
                    continue
                path = self.block_path(part)
                try:
                    file = files.enter_context(self._open(path))
                    opened[index] = (path, file)
                    described, metadata, tensors = self._describe_named(part, path, file)
                except RejectedFile as rejected:
                    if index in opened:  # moved aside where its header or its name is wrong
                        self._reject(path, file, rejected)
                    raise PartRejected(index, rejected) from None
                layers = max(layers, len(json.loads(metadata["kvstate.layers"])))
                data = max((info["data_offsets"][1] for info in tensors.values()), default=0)
                parts.append(SavedPart(file, path.name, tensors, described.file_bytes - data,
                                       json.loads(metadata["kvstate.hashes"]), len(part.tokens)))
            try:
                arrays, on_device = self._read_parts(parts)
            except PartRejected as failure:
                if failure.index in opened:
                    self._reject(*opened[failure.index], failure.rejected)
                raise
        for path, _ in opened.values():
            _touch(path)
        if self.to_device and not on_device:
            move_to_device(arrays.values())
        return _block_of(arrays, layers)

    def _read_parts(self, parts: list[SavedPart | HeldPart]) -> tuple[dict[str, mx.array], bool]:
        """A chain's joined arrays, and whether they were read onto the CUDA device: through the pinned
        staging there (:mod:`~kvstate.interpreters.mlx.staged_reads`), else into host memory."""
        staging = staged_reads.cuda_staging() if self.to_device else None
        if staging is not None:
            try:
                return staged_reads.read_chain(parts, staging, self.verify), True
            except (OSError, RuntimeError, TypeError, ValueError):  # the driver or MLX refused the staging
                staged_reads.refused()  # (read errors and bad blocks come as PartRejected)
        return chain_reads.read_chain(parts, self.verify), False

    def read_snapshot(self, name: SnapshotName) -> list:
        """The caches of the snapshot ``name`` names (None for the layers blocks hold);
        :class:`RejectedFile` (moved aside) if they cannot be trusted."""
        return self._read_named(name)

    def _read_named(self, name: BlockName | SnapshotName) -> list:
        described, content = self._load(self._path_of(name))
        if described.block != name:
            self.move_aside(described.path, FailureReason.CORRUPT)
            raise RejectedFile(FailureReason.CORRUPT, f"{described.path.name}: holds other state than its name says")
        _touch(described.path)
        return content

    def plan_read_ahead(self, name: BlockName | SnapshotName) -> "ReadAhead":
        """The file ``name`` names, its header read and checked and its arrays allocated, unfilled, on
        this thread (the MLX work of a read ahead); :meth:`fill` reads its bytes into them on any
        thread, and :meth:`built` makes its content. :class:`RejectedFile` (moved aside) for a header
        that cannot be trusted."""
        path = self._path_of(name)
        return self._opened(path, functools.partial(self._planned, name, path))

    def _planned(self, name: BlockName | SnapshotName, path: Path, file: BinaryIO) -> "ReadAhead":
        described, metadata, tensors = self._describe_named(name, path, file)
        for tensor, info in tensors.items():
            if info["dtype"] not in MX_DTYPE:
                raise RejectedFile(FailureReason.CORRUPT, f"{path.name}: tensor {tensor!r} has dtype {info['dtype']}")
        size = max((info["data_offsets"][1] for info in tensors.values()), default=0)
        # One array a file, not one a tensor: an allocation costs about 0.1 ms whatever its size.
        data = chain_reads.unfilled_arrays({"data": ("U8", [size])})["data"] if size else mx.zeros((0,), mx.uint8)
        target = np.asarray(data) if size else np.empty(0, np.uint8)
        return ReadAhead(path, metadata, tensors, described.file_bytes - size, data, target)

    def fill(self, read: "ReadAhead") -> None:
        """Read the file of ``read`` straight into its array, in one read, and verify each tensor there:
        no MLX call, so a background reader may do it. :class:`RejectedFile` (moved aside) where the
        bytes fail their hashes; an I/O error or a short read is tried once more from a fresh open."""
        self._opened(read.path, functools.partial(self._filled, read))
        _touch(read.path)

    def _filled(self, read: "ReadAhead", file: BinaryIO) -> None:
        try:
            got = file_io.read_pieces(file, [read.target], read.data_start)
        except (OSError, ValueError) as error:
            raise RejectedFile(FailureReason.IO_ERROR, f"{read.path.name}: {error}") from None
        if got != len(read.target):
            raise RejectedFile(FailureReason.IO_ERROR, f"{read.path.name}: a read of {len(read.target)} bytes got {got}")
        if self.verify:
            self._verify(read.path, read.metadata, {tensor: read.target[slice(*info["data_offsets"])]
                                                    for tensor, info in read.tensors.items()})

    def built(self, read: "ReadAhead") -> list:
        """The content of a file read ahead and filled (:meth:`fill`): its tensors views of the array
        the read filled (no copy); :class:`RejectedFile` (moved aside) where they cannot be rebuilt."""
        arrays = {tensor: mx.view(read.data[slice(*info["data_offsets"])], MX_DTYPE[info["dtype"]]
                                  ).reshape(info["shape"]) for tensor, info in read.tensors.items()}
        try:
            return self._caches(read.path, read.metadata, arrays)
        except RejectedFile as rejected:
            self.move_aside(read.path, rejected.reason)
            raise
        except (ValueError, TypeError) as error:  # a shape that passed its checks and still does not fit
            self.move_aside(read.path, FailureReason.CORRUPT)
            raise RejectedFile(FailureReason.CORRUPT, f"{read.path.name}: cannot be rebuilt ({error!r})") from None

    def read_checkpoint(self, key: str) -> tuple[CheckpointMeta, tuple[int, ...], list]:
        described, caches = self._load(self.checkpoint_path(key))
        if described.checkpoint is None or described.checkpoint.key != key:
            self.move_aside(described.path, FailureReason.CORRUPT)
            raise RejectedFile(FailureReason.CORRUPT, f"{described.path.name}: not the checkpoint of {key!r}")
        return described.checkpoint, described.tokens, caches

    def move_aside(self, path: Path, reason: FailureReason) -> None:
        """Move a rejected file into ``rejected/`` (never deleted silently) and remember why.

        Where the directory cannot be written (a read-only file system) the file
        stays where it is: it is still rejected, and judged again at the next scan.
        """
        target = self.rejected_directory / f"{path.name}.{reason.value}"
        n = 1
        while target.exists():
            n += 1
            target = self.rejected_directory / f"{path.name}.{reason.value}.{n}"
        try:
            private_directory(self.rejected_directory)
            os.replace(path, target)
        except FileNotFoundError:
            return
        except OSError:
            pass  # not movable: left in place, never restored all the same
        self.rejected.append((path.name, reason))
        self.prune_rejected()

    def prune_rejected(self) -> int:
        """Keep the newest ``rejected_keep`` files of ``rejected/`` and delete the rest (they are
        outside every budget); the number deleted. Never an error: what cannot go stays."""
        try:
            with os.scandir(self.rejected_directory) as entries:
                found = []
                for entry in entries:
                    try:
                        info = entry.stat()
                    except OSError:
                        continue
                    found.append((info.st_mtime, entry.path, info.st_size))
        except OSError:
            return 0
        found.sort(reverse=True)
        pruned, held = 0, [size for _, _, size in found[:self.rejected_keep]]
        for _, old, size in found[self.rejected_keep:]:
            try:
                os.unlink(old)
                pruned += 1
            except OSError:
                held.append(size)
        self.rejected_held = (len(held), sum(held))
        return pruned

    # ------------------------------------------------------------ scan

    def scan(self) -> tuple[list[SavedRecord], list[SavedCheckpoint], int]:
        """Prefix records and checkpoints from headers alone; bad files moved aside and counted (the
        blocks found are :meth:`scan_all`'s)."""
        records, checkpoints, rejected, _ = self.scan_all()
        return records, checkpoints, rejected

    def scan_all(self) -> tuple[list[SavedRecord], list[SavedCheckpoint], int, list[SavedBlock]]:
        """Prefix records, checkpoints and blocks from headers alone; bad files moved aside and counted.

        A file deleted since the listing is skipped; a file replaced since is
        read as it now is (once more; a name replaced again is left to the next
        scan). Temp files of interrupted writes are removed, unless the process
        named in them is still running (its write may be in flight).
        """
        records, checkpoints, rejected, blocks = [], [], 0, []
        self.prune_rejected()
        for path in sorted(self.directory.iterdir()):
            if not path.is_file():
                continue
            if path.name.startswith(".") and ".tmp-" in path.name:
                if not writer_alive(path.name):
                    remove_quietly(path)  # an interrupted write: never claimed
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                described = self._scanned(path)
            except RejectedFile:
                rejected += 1
                continue
            if described is None:
                continue
            if described.kind == "checkpoint" and described.checkpoint is not None:
                checkpoints.append(SavedCheckpoint(described.checkpoint, len(described.tokens), described.file_bytes,
                                                   described.used_at))
            elif described.kind == "prefix":
                records.append(SavedRecord(described.namespace, described.tokens, described.nbytes,
                                           described.trimmable, described.file_bytes, described.used_at))
            elif described.kind in ("block", "snapshot") and described.block is not None:
                blocks.append(SavedBlock(described.block, described.nbytes, described.file_bytes, described.used_at,
                                         described.trimmable))
        return records, checkpoints, rejected, blocks

    def _scanned(self, path: Path) -> SavedFile | None:
        """What the file ``path`` names holds, from its header; None once it is gone. A file replaced
        while read is read once more; a bad one is moved aside and :class:`RejectedFile` raised."""
        for _ in range(2):
            try:
                file = self._open(path)
            except RejectedFile:
                return None  # deleted since the listing: nothing to claim
            with file:
                try:
                    described = self._describe(path, file)[0]
                except RejectedFile as error:
                    if self._reject(path, file, error):
                        raise
                    continue  # replaced or deleted while read: judge what is there now
                if self._still_named(path, file):
                    return described
        return None

    def saved_prefixes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(namespace, tokens)`` of every valid saved prefix, from headers alone. A look, not a scan:
        nothing is moved, deleted or counted (a bad file is left for the next scan to judge). Blocks give
        the prefixes their chains end, where every block of a chain is saved."""
        found, blocks = [], []
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(".") or not path.name.endswith(SUFFIX):
                continue
            try:
                with self._open(path) as file:
                    described = self._describe(path, file)[0]
            except RejectedFile:
                continue
            if described.kind == "prefix" and described.namespace != OBJECTS:
                found.append((described.namespace, described.tokens))
            elif described.kind == "snapshot" and described.block is not None:
                found.append((described.namespace, described.tokens))
            elif described.block is not None and described.trimmable:
                blocks.append(described.block)
        return found + saved_chains(blocks)
