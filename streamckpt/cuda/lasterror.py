"""Clearing CUDA's last error after a refused ``cudaHostRegister``, through a binding that exists.

``torch.cuda.cudart()`` binds only cudaGetErrorString, cudaProfilerStart/Stop,
cudaHostRegister/Unregister, cudaStreamCreate/Destroy and cudaMemGetInfo: no
``cudaGetLastError``. A failed register leaves its error for the next kernel launch's check
to raise as that kernel's own, so it is read away here from the libcudart torch already
loaded (found in ``/proc/self/maps``, opened with ``RTLD_NOLOAD``: never a second copy,
whose error state would be another one), else through ``cuda.bindings`` where installed.
Neither there: the error is left, and a log line says so. Nothing here raises.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Callable

log = logging.getLogger(__name__)


def loaded_cudart(maps: str = "/proc/self/maps") -> str | None:
    """The path of the libcudart this process has mapped, or None (not loaded, no /proc)."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


def _via_ctypes(path: str) -> int | None:
    """cudaGetLastError() of the already-loaded library at ``path``; None where it cannot be called."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    try:
        fn = ctypes.CDLL(path, mode=mode).cudaGetLastError
    except (OSError, AttributeError):  # not loaded after all, or no such symbol
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


def _via_cuda_bindings() -> int | None:
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed, or broken: no binding
        return None
    err = runtime.cudaGetLastError()
    return int(err[0] if isinstance(err, tuple) else err)


def clear_last_error(maps: str = "/proc/self/maps",
                     bindings: Callable[[], int | None] = _via_cuda_bindings) -> bool:
    """Read CUDA's last error away (the calling thread's); True if some binding did. Never raises."""
    try:
        path = loaded_cudart(maps)
        err = _via_ctypes(path) if path else None
        if err is None:
            err = bindings()
    except Exception as e:  # noqa: BLE001 - clearing is best effort; the caller raises its own error
        log.warning("could not clear CUDA's last error (%s: %s): a later kernel launch may report it", type(e).__name__, e)
        return False
    if err is None:
        log.warning("CUDA's last error was not cleared: no libcudart mapped in this process and no cuda.bindings "
                    "(torch.cuda.cudart() has no cudaGetLastError); a later kernel launch may report it")
        return False
    return True
