"""Restored state moved onto a CUDA device in one go, not one page fault at a time.

MLX's CUDA backend keeps an array built from host data (``mx.array`` of a buffer, ``mx.load``) in
managed memory that stays on the host until a kernel reads it, and that first kernel pulls it over
a page fault at a time: 1.4-3.7 GB/s end to end on an H200 host whose bus carries 55 GB/s
(bench/README.md). :func:`move_to_device` asks the CUDA driver to migrate the arrays' pages in bulk
(``cuMemPrefetchAsync``) and waits for it, so the first use finds them on the device. :func:`driver`
also gives :mod:`~kvstate.interpreters.mlx.staged_reads` the calls that pin a host buffer and copy
from it into device memory.

It does nothing where there is no CUDA device (on Apple silicon the memory is already shared; the CPU
backend has no device). A driver that cannot be reached, or a call that fails, leaves the arrays
where they were: they are correct either way, only slower to first use, so it answers False and
never raises.
"""

from __future__ import annotations

import ctypes
from typing import Iterable

import mlx.core as mx
import numpy as np

_SUCCESS = 0
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


def on_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The few CUDA driver calls a bulk migration needs, on device 0 (MLX's GPU), in its primary context
    (the one MLX's runtime uses)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        context = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        self.lib, self.device, self.context = lib, device, context
        prefetch = getattr(lib, "cuMemPrefetchAsync_v2", None)
        if prefetch is not None:  # drivers of CUDA 12.2 on: the destination as a location
            prefetch.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
            location = _Location(_LOCATION_DEVICE, device.value)
            self._prefetch = lambda pointer, size: prefetch(pointer, size, location, 0, None)
        else:
            old = lib.cuMemPrefetchAsync
            old.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            self._prefetch = lambda pointer, size: old(pointer, size, device.value, None)
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != _SUCCESS:
            raise OSError(f"{call} failed with CUDA error {result}")

    def move(self, spans: list[tuple[int, int]]) -> None:
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        for pointer, size in spans:
            self._check(self._prefetch(pointer, size), "cuMemPrefetchAsync")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")

    def pin(self, pointer: int, size: int) -> None:
        """Page-lock ``size`` host bytes at ``pointer``, so copies from them run at the bus's pace; they
        must be unpinned before that memory is freed."""
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._check(self.lib.cuMemHostRegister_v2(pointer, size, 0), "cuMemHostRegister")

    def unpin(self, pointer: int) -> None:
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._check(self.lib.cuMemHostUnregister(pointer), "cuMemHostUnregister")

    def copy_in(self, device_pointer: int, host_pointer: int, size: int) -> None:
        """Copy ``size`` bytes from the host to device memory, returning once they are there."""
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._check(self.lib.cuMemcpyHtoD_v2(device_pointer, host_pointer, size), "cuMemcpyHtoD")


_driver: _Driver | None = None
_unavailable = False


def driver() -> _Driver | None:
    """The CUDA driver's calls on MLX's device, or None where there is no CUDA device or the driver
    cannot be reached."""
    global _driver, _unavailable
    if _unavailable or not on_cuda():
        return None
    if _driver is None:
        try:
            _driver = _Driver()
        except (OSError, AttributeError, TypeError, ValueError):
            _unavailable = True
            return None
    return _driver


def move_to_device(arrays: Iterable[mx.array]) -> bool:
    """Migrate the memory of ``arrays`` (evaluated here) to the CUDA device and wait until it is there;
    True when it was moved, False where there is no CUDA device or the driver refused."""
    global _unavailable
    found = driver()
    if found is None:
        return False
    arrays = [a for a in arrays if a.nbytes]
    mx.eval(arrays)
    try:
        spans = []
        for a in arrays:
            view = np.frombuffer(memoryview(a), dtype=np.uint8)
            spans.append((view.ctypes.data, view.nbytes))
        found.move(spans)
    except (OSError, AttributeError, TypeError, ValueError):
        _unavailable = True  # a driver that refuses once refuses again: stop asking
        return False
    return True
