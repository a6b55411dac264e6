"""Host memory the C library keeps for reuse, so restores do not fault in fresh pages each time.

A restore builds its arrays in memory just allocated. glibc's malloc serves
blocks above a threshold (128 KiB at first, then moving with what was last
freed, up to 32 MiB) with fresh ``mmap`` pages and gives them back on ``free``,
so the next restore faults every page in again: on this project's CPU a
verified 512 MiB restore then takes 240-250 ms against a 30-33 ms plain read,
and 55-75 ms when freed blocks are kept and reused (``bench/disk.py
--keep-freed-memory``). Which of the two a process gets depends on the sizes it
freed last. A serving process reuses the same sizes all day, so ``kvstate
serve`` asks for the second at start; the memory it frees then stays with the
process (its RSS does not shrink) for the next request to reuse, whatever its
size: glibc never trims the heap's top. (A trim threshold in bytes is an int,
so at most 2 GiB: a freed 2.15 GB restore gave its memory back, and the next
one faulted every page in again, about 3x slower: ``bench/gpu_parts.py
restore-reuse``.)
"""

from __future__ import annotations

import ctypes
import os
import platform

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: A trim threshold of -1 (the largest size, to glibc): the heap's top is never given back.
NEVER_TRIM = -1
#: The environment settings of the same thresholds: where the operator set one, it stands.
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory(block_bytes: int = 1 << 30) -> bool:
    """Ask glibc's malloc to serve blocks up to ``block_bytes`` from its heap and keep what is freed
    for reuse; True if it took both settings. False, changing nothing, where the C library is not
    glibc (macOS, musl) or the operator set either threshold in the environment."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in ENVIRONMENT):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # The mmap threshold first: where glibc refuses it, nothing has changed (setting either threshold
    # stops glibc moving the other, and a trim threshold alone would pin mmap at 128 KiB); where a
    # glibc caps it, at 32 MiB. Then the trim threshold, at never, so freed blocks at the heap's top
    # are kept however many consolidate there.
    if not mallopt(M_MMAP_THRESHOLD, block_bytes):
        block_bytes = min(block_bytes, 32 << 20)
        if not mallopt(M_MMAP_THRESHOLD, block_bytes):
            return False
    return bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
