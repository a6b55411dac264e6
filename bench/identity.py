"""Start-up's model identity from weight files: the first start hashes them, a later one only looks
them up.

Writes a model directory of ``--gigabytes`` of weight files (``--files`` safetensors-named files of
incompressible bytes, fsynced, an 8B model's bf16 weights by default) and a ``config.json``, then
times ``weights_fingerprint``:

- first start, page cache dropped (``posix_fadvise(DONTNEED)`` on every file): each file is read and
  hashed once, and the result is remembered;
- first start again with a fresh remembered cache, page cache warm: the hash alone;
- a later start: the remembered hashes, keyed by path, size, inode and both file times, so no
  weight is read.

    python bench/identity.py [--gigabytes 16] [--files 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvstate.interpreters.mlx.weights_identity import weights_fingerprint

CHUNK = 64 << 20


def write_weights(directory: Path, gigabytes: float, files: int) -> int:
    per_file = int(gigabytes * 1e9) // files
    chunk = os.urandom(CHUNK)
    for i in range(files):
        with open(directory / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as out:
            left = per_file
            while left:
                left -= out.write(memoryview(chunk)[:min(CHUNK, left)])
            out.flush()
            os.fsync(out.fileno())
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return per_file * files


def drop_page_cache(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(call) -> tuple[float, str]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=16.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write the weights (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvstate-identity-", dir=args.dir))
    try:
        model = work / "model"
        model.mkdir()
        nbytes = write_weights(model, args.gigabytes, args.files)
        cold_cache, warm_cache = work / "cold.json", work / "warm.json"
        if hasattr(os, "posix_fadvise"):
            drop_page_cache(model)
        cold, first = timed(lambda: weights_fingerprint(model, cold_cache))
        warm, second = timed(lambda: weights_fingerprint(model, warm_cache))
        later = min(timed(lambda: weights_fingerprint(model, cold_cache))[0] for _ in range(5))
        assert first == second == weights_fingerprint(model, cold_cache)
        print(f"{nbytes / 1e9:.1f} GB of weights in {args.files} files:")
        print(f"  first start, page cache dropped   {cold:8.2f} s  ({nbytes / cold / 1e9:.2f} GB/s)")
        print(f"  first start, page cache warm      {warm:8.2f} s  ({nbytes / warm / 1e9:.2f} GB/s)")
        print(f"  a later start (hashes remembered) {later * 1e3:8.2f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
