"""A model's identity from its weight files, hashed once and remembered, so a start need not read
every weight again.

The identity of saved state must change whenever any tensor changes. Hashing the loaded weights
(``models.mlx_adapter.model_fingerprint``) does that, but reads every weight at every start (tens of
seconds at 8B) and pulls device weights to the host. A model loaded from a directory has the same
identity in its files: each ``*.safetensors`` file's content hash, with ``config.json``. A content
hash is computed once and kept in a small cache file, keyed by what any rewrite of the file changes:
its path, size, inode, and modification and change times (a rewrite that restores the old
modification time still moves the change time, which no user call can set back).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from kvstate.interpreters.mlx import content_hash

CHUNK = 8 << 20


def default_cache_path() -> Path:
    """``$KVSTATE_CACHE_DIR/weights.json``, else ``~/.cache/kvstate/weights.json``."""
    root = os.environ.get("KVSTATE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvstate")
    return Path(root) / "weights.json"


def _file_key(path: Path) -> str:
    stat = path.stat()
    return json.dumps([content_hash.ALGORITHM, str(path.resolve()), stat.st_size, stat.st_ino, stat.st_mtime_ns,
                       stat.st_ctime_ns])


def _content_hash(path: Path) -> str:
    digest = content_hash.hasher()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _load(cache_path: Path) -> dict[str, str]:
    try:
        known = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _store(cache_path: Path, known: dict[str, str]) -> None:
    """Write the cache atomically; a cache that cannot be written only costs the next start a hash."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        temp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}")
        temp.write_text(json.dumps(known, sort_keys=True))
        os.replace(temp, cache_path)
    except OSError:
        pass


def weights_fingerprint(model_dir: str | os.PathLike, cache_path: Path | None = None) -> str:
    """The identity of the model in ``model_dir``: its config and the content of every weight file.

    Raises ``FileNotFoundError`` when the directory holds no ``*.safetensors`` file (hash the
    loaded weights instead then).
    """
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors weight files")
    cache_path = cache_path or default_cache_path()
    known = _load(cache_path)
    digest = hashlib.blake2b(digest_size=16)
    config = directory / "config.json"
    digest.update(config.read_bytes() if config.exists() else b"{}")
    keys = [_file_key(path) for path in files]
    unknown = [(path, key) for path, key in zip(files, keys) if key not in known]
    if unknown:  # the first start on these weights reads them all: say so, with progress
        total = sum(path.stat().st_size for path, _ in unknown)
        logging.info("kvstate: hashing %d weight files (%.2f GB) once, for the identity of saved state; later "
                     "starts read it from %s", len(unknown), total / 1e9, cache_path)
        started, done = time.perf_counter(), 0
        for n, (path, key) in enumerate(unknown, 1):
            known[key] = _content_hash(path)
            done += path.stat().st_size
            logging.info("kvstate: hashed %s (%d of %d, %.2f of %.2f GB, %.1f s)", path.name, n, len(unknown),
                         done / 1e9, total / 1e9, time.perf_counter() - started)
    for path, key in zip(files, keys):
        digest.update(f"{path.name}:{known[key]}".encode())
    changed = bool(unknown)
    if changed:
        _store(cache_path, known)
    return digest.hexdigest()
