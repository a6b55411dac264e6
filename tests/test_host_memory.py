"""Freed host memory kept for reuse: glibc keeps a freed block in the process instead of unmapping it."""

import os
import platform
import subprocess
import sys

import pytest

from kvstate.interpreters.mlx import host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

#: Allocates ``count`` blocks of ``mib`` MiB through malloc, touches every page, frees them, and prints
#: the resident bytes gained, after calling keep_freed_memory() when asked.
FREE_AND_MEASURE = """
import ctypes, sys
from kvstate.interpreters.mlx.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
count, size = int(sys.argv[2]), int(sys.argv[3]) << 20
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = resident()
blocks = [libc.malloc(size) for _ in range(count)]
for block in blocks:
    ctypes.memset(block, 1, size)
for block in blocks:
    libc.free(block)
print(kept, resident() - before)
"""


def resident_after_free(mode: str, count: int = 1, mib: int = 256, **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode, str(count), str(mib)],
                         capture_output=True, text=True, check=True, env={**os.environ, **env}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere keep_freed_memory() changes nothing")
def test_a_freed_block_stays_with_the_process_for_reuse():
    kept, gained = resident_after_free("keep")
    assert kept == "True" and gained >= 250 << 20
    untouched, given_back = resident_after_free("leave")
    assert untouched == "None" and given_back < 16 << 20  # the default: a block this large goes back


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's; elsewhere keep_freed_memory() changes nothing")
def test_freed_blocks_past_two_gib_in_all_stay_too():
    """A restore of more than 2 GiB frees that much at once: a trim threshold in bytes (an int, so at
    most 2 GiB) would give it all back, and the next restore would fault every page in again."""
    kept, gained = resident_after_free("keep", count=80, mib=30)  # blocks under any glibc's mmap cap
    assert kept == "True" and gained >= (80 * 30 - 16) << 20


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
@pytest.mark.parametrize("setting", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_thresholds_the_operator_set_stand(setting):
    kept, given_back = resident_after_free("keep", **setting)
    assert kept == "False" and given_back < 16 << 20


def test_nothing_changes_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert host_memory.keep_freed_memory() is False
