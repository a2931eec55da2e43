"""Reading CUDA's last error away without ``torch.cuda.cudart()`` (which has no cudaGetLastError):
the lookup of a binding never raises and never loads a library, whatever this process has."""

from __future__ import annotations

import ctypes.util
import logging
import os
from pathlib import Path

import pytest

from streamckpt.cuda import lasterror


def _maps(tmp_path: Path, *paths: str) -> str:
    lines = ["7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n"]  # an anonymous mapping: no path
    lines += [f"7f0000001000-7f0000002000 r-xp 00000000 08:01 1234   {p}\n" for p in paths]
    f = tmp_path / "maps"
    f.write_text("".join(lines))
    return str(f)


def test_no_libcudart_and_no_bindings_is_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "streamckpt"):
        assert lasterror.clear_last_error(_maps(tmp_path, "/usr/lib/libc.so.6"), bindings=lambda: None) is False
    assert [r.getMessage()[:37] for r in caplog.records] == ["CUDA's last error was not cleared: no"]


def test_a_mapped_libcudart_that_cannot_be_opened_falls_through(tmp_path: Path) -> None:
    maps = _maps(tmp_path, str(tmp_path / "gone" / "libcudart.so.13"))
    assert lasterror.loaded_cudart(maps) == str(tmp_path / "gone" / "libcudart.so.13")
    assert lasterror.clear_last_error(maps, bindings=lambda: None) is False  # RTLD_NOLOAD: nothing loaded
    assert lasterror.clear_last_error(maps, bindings=lambda: 0) is True  # cuda.bindings read it


def test_a_library_without_the_symbol_and_a_failing_binding_do_not_raise(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    libc = ctypes.util.find_library("c")
    real = next((line.split()[-1] for line in open("/proc/self/maps") if libc and libc in line), None)
    if real is None:
        pytest.skip("no libc path in /proc/self/maps")
    link = tmp_path / "libcudart.so.13"
    os.symlink(real, link)  # an already-loaded library by another name, without cudaGetLastError

    def broken() -> int:
        raise RuntimeError("cuda.bindings failed to initialise")

    with caplog.at_level(logging.WARNING, "streamckpt"):
        assert lasterror.clear_last_error(_maps(tmp_path, str(link)), bindings=broken) is False
    assert "RuntimeError: cuda.bindings failed to initialise" in caplog.text


def test_no_proc_maps(tmp_path: Path) -> None:
    assert lasterror.loaded_cudart(str(tmp_path / "no-such-file")) is None
