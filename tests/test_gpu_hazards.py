"""Hazards a real GPU would show (issue 36), each shown on CPU: the stand-in (``fakecuda``) or
the real ``TorchCuda`` over a recording stand-in for the CUDA runtime library (``torch.cuda.cudart()``
and ``torch.cuda.device``, the only two things ``TorchCuda.pin``/``unpin`` touch).

* a refused ``cudaHostRegister`` (some VM runtimes): the error state is cleared, and staging
  falls back to torch's pinned allocator with one warning; saves go on;
* ``unpin`` on the async-save uploader thread (whose current device is 0) runs under the device
  the memory was pinned for;
* an ``async_save`` of one rank's tensors on two GPUs copies each GPU's tensors after that GPU's
  pending kernels;
* a load that fails on the NCCL data plane leaves the caller's stream free of the side stream
  and of NCCL's (a dead peer's receive never completes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from fakecuda import FakeCuda, FakeCudart
from test_gpu_save import _gpu_state, _loads_back

import streamckpt as sc
from streamckpt.comm import SoloComm
from streamckpt.cuda import device as _device
from streamckpt.cuda.runtime import PinRefused, TorchCuda
from streamckpt.saving.asyncsave import start_save
from streamckpt.saving.saver import run_save
from streamckpt.storage import Storage

DEV = torch.device("cuda", 3)


@pytest.fixture(autouse=True)
def _fresh_pin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "_PIN_REFUSED", {})  # process state: no refusal seen yet


# ----------------------------------------------------------------------------- the CUDA runtime, recorded

_current = threading.local()  # the calling thread's current device, as CUDA keeps it (0 on a new thread)


class _DeviceGuard:
    """``torch.cuda.device(d)``: the thread's current device is ``d`` inside."""

    def __init__(self, device: Any) -> None:
        self.index = torch.device(device).index

    def __enter__(self) -> None:
        self.prev = getattr(_current, "index", 0)
        _current.index = self.index

    def __exit__(self, *exc: Any) -> None:
        _current.index = self.prev


class RecordingCudart(FakeCudart):
    """``torch.cuda.cudart()`` (exactly torch's methods, see ``fakecuda.FakeCudart``): each call
    with the calling thread's current device; a failing ``cudaHostRegister`` leaves an error
    pending until ``read_last_error`` (what ``lasterror`` does through libcudart) takes it."""

    def __init__(self, register_error: int = 0) -> None:
        super().__init__(register_error)
        self.log: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.log.append(("register", getattr(_current, "index", 0)))
        return super().cudaHostRegister(ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.log.append(("unregister", getattr(_current, "index", 0)))
        return super().cudaHostUnregister(ptr)

    def read_last_error(self) -> bool:
        self.log.append(("get-last-error", getattr(_current, "index", 0)))
        return super().read_last_error()


@contextlib.contextmanager
def recorded_cudart(monkeypatch: pytest.MonkeyPatch, register_error: int = 0) -> Iterator[RecordingCudart]:
    rt = RecordingCudart(register_error)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "device", _DeviceGuard)
    yield rt


def test_a_refused_pin_clears_cudas_error_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaHostRegister failing leaves its error for the next kernel launch's check to raise as
    that kernel's own: TorchCuda.pin reads it away (under the same device) before raising PinRefused."""
    with recorded_cudart(monkeypatch, register_error=712) as rt:  # cudaErrorHostMemoryAlreadyRegistered, say
        with pytest.raises(PinRefused, match=r"pinning 4096 bytes of host memory on cuda:3 failed "
                                             r"\(cudaHostRegister: cudaError 712\)"):
            TorchCuda(clear_error=rt.read_last_error).pin(4096, DEV)
    assert rt.log == [("register", 3), ("get-last-error", 3)]
    assert rt.pending == 0  # a later kernel launch finds no stray error


def test_a_refused_pin_is_pin_refused_with_torchs_own_cudart(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The default TorchCuda over a cudart with only torch's methods (no cudaGetLastError): still
    PinRefused, never AttributeError; with no libcudart mapped here (CPU) and no cuda.bindings the
    error is left, and a log line says so."""
    with recorded_cudart(monkeypatch, register_error=1) as rt, caplog.at_level(logging.WARNING, "streamckpt"):
        with pytest.raises(PinRefused):
            TorchCuda().pin(4096, DEV)
    assert rt.log == [("register", 3)]
    assert any("CUDA's last error was not cleared" in r.getMessage() for r in caplog.records)


def test_unpin_on_another_thread_runs_under_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The async-save uploader thread's current device is 0: unpin must name the device."""
    with recorded_cudart(monkeypatch) as rt:
        api = TorchCuda()
        t = api.pin(8192, DEV)
        th = threading.Thread(target=api.unpin, args=(t, DEV))
        th.start()
        th.join()
    assert rt.log == [("register", 3), ("unregister", 3)]


def test_async_save_unpins_on_the_uploader_thread_under_its_gpu(tmp_path: Path) -> None:
    """A budget below the share: the uploader releases (and an oversized item unpins) as it goes;
    every pin and unpin names the tensors' GPU, never the uploader's current device."""
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    sd, want = _gpu_state(fake, [50_000, 300_000, 20_000], seed=4)
    handle = start_save(sd, str(tmp_path), staging_budget=4 * 60_000, cuda=fake)  # the 1.2 MB item: its own pin
    handle.result(timeout=60)
    handle.release_staging()
    assert fake.pins.live == {} and sorted(fake.pins.unpinned) == sorted(fake.pins.asked)
    assert fake.violations == []
    _loads_back(tmp_path, want)


# ----------------------------------------------------------------------------- a refused pin falls back


def test_a_refused_pin_falls_back_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """cudaHostRegister refused: save and async_save stage through torch's pinned allocator,
    warn once for the process, and load back exactly; nothing is unpinned that was not pinned."""
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    fake.refuse_pin = True  # type: ignore[attr-defined]
    sd, want = _gpu_state(fake, [10_000, 7_000, 3], seed=5)
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        storage = Storage(str(tmp_path / "sync"))
        try:
            run_save(SoloComm(), storage, sd, compression=None, metadata=None, overwrite=False, cuda=fake)
        finally:
            storage.close()
        handle = start_save(sd, str(tmp_path / "async"), staging_budget=50_000, cuda=fake)
        handle.result(timeout=60)
        handle.release_staging()
    warned = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "staging through torch's pinned allocator instead" in warned[0]
    assert fake.counts.get("refused pin") == 1  # asked once; every later pin took the fallback at once
    assert fake.pins.asked == [] and fake.pins.unpinned == []
    assert fake.counts.get("pinned", 0) == 3  # the save's two blocks and async_save's budget
    assert fake.violations == []  # torch's pinned blocks: no pageable copy
    _loads_back(tmp_path / "sync", want)
    _loads_back(tmp_path / "async", want)


def test_pageable_staging_when_torchs_pinned_allocator_fails_too(tmp_path: Path) -> None:
    """Both refused: pageable blocks (their copies synchronous), the save still exact."""
    fake = FakeCuda(current_device=0, fail_alloc=lambda kind, n: kind == "pinned")
    fake.refuse_pin = True  # type: ignore[attr-defined]
    sd, want = _gpu_state(fake, [4_000, 9_000], seed=6)
    storage = Storage(str(tmp_path))
    try:
        run_save(SoloComm(), storage, sd, compression=None, metadata=None, overwrite=False, cuda=fake)
    finally:
        storage.close()
    assert fake.counts.get("failed pinned") == 2
    assert all(v.startswith("pageable:") for v in fake.violations) and fake.violations  # what torch makes synchronous
    _loads_back(tmp_path, want)


# ----------------------------------------------------------------------------- one rank, two GPUs


def test_async_save_of_tensors_on_two_gpus_waits_on_each_gpus_kernels(tmp_path: Path) -> None:
    """Each GPU's tensors are copied on a stream of that GPU after its caller's stream: a stream of
    the first GPU would copy the second GPU's tensors before their pending writes. Staged per GPU
    rather than refused: ``sc.save`` takes such a state (a stream per GPU, ``host_spans``), so
    ``async_save`` takes it too (loads refuse it: one rank loads through one GPU)."""
    fake = FakeCuda(current_device=0)
    other = torch.device("cuda", 5)
    sd, want = _gpu_state(fake, [6_000, 2_000], seed=7)  # on DEV
    g = torch.Generator().manual_seed(8)
    for k, n in (("u0", 5_000), ("u1", 3_000)):
        want[k] = torch.randn(n, generator=g)
        t = fake.place(torch.zeros(n), other)
        fake.launch(other, lambda t=t, v=want[k]: t.copy_(v), writes=[t], label=f"caller writes {k} on {other}")
        sd[k] = t
    for budget in (None, 4 * 7_000):  # all staged at once; staged one by one behind the upload
        handle = start_save(sd, str(tmp_path / f"b{budget}"), staging_budget=budget, cuda=fake)
        handle.result(timeout=60)
        handle.release_staging()
        _loads_back(tmp_path / f"b{budget}", want)
    storage = Storage(str(tmp_path / "sync"))  # what sc.save does with the same state: async_save's parity
    try:
        run_save(SoloComm(), storage, sd, compression=None, metadata=None, overwrite=False, cuda=fake)
    finally:
        storage.close()
    _loads_back(tmp_path / "sync", want)
    assert fake.violations == []
    assert fake.devices_used == {DEV, other}
    assert fake.pins.live == {}


# ----------------------------------------------------------------------------- a failed load on NCCL


def failed_nccl_worker(rank: int, world: int, root: str, doc: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from gpu_cases import Case, run_rank
    from streamckpt.comm import GroupComm

    keep: dict[str, Any] = {}
    try:
        run_rank(Case(**doc), rank, GroupComm(dist.group.WORLD), root, keep=keep)
        error = ""
    except Exception as e:  # noqa: BLE001 - what every rank raises is the point
        error = f"{type(e).__name__}: {e}"
    fake, dev = keep["fake"], keep["device"]
    side = [s for s in fake.streams if s.name.startswith("side")]
    targets = [t for t in keep["targets"].values() if fake.device_of(t).type == "cuda"]
    return {"error": error, "follows": fake.follows(dev), "exchanges": fake.counts.get("exchange", 0),
            "held": sum(any(s.sid in fake.recorded_on(t) for s in side) for t in targets), "targets": len(targets)}


@pytest.mark.timeout(200)
def test_a_failed_load_on_nccl_leaves_the_callers_stream_free(tmp_path: Path) -> None:
    """Every rank raises the agreed error; the caller's stream follows neither NCCL's stream (work.wait()
    runs with the side stream current) nor the side stream (not waited on after a failure), so a dead
    peer's receive cannot hang the caller's next kernel; the targets are held on the side stream."""
    from distributed import run_ranks
    from gpu_cases import Case, write_checkpoint

    case = Case(seed=22, world=3, budget=1024, read_once=True, zstd=False, chunk=64, data_on_device=True,
                agree_every=3, current_device=1, transform=False, cpu_targets=False)
    write_checkpoint(case, str(tmp_path))
    for f in (tmp_path / "data").iterdir():  # the last byte of every data file: a late round fails its checksum
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    reps = [r.unwrap() for r in run_ranks(3, failed_nccl_worker, kwargs={"root": str(tmp_path), "doc": case.doc()},
                                          timeout=150, pg_timeout=45)]
    assert all(r["error"].startswith("CorruptCheckpointError: ") for r in reps), reps
    assert all(r["exchanges"] > 0 for r in reps), reps  # NCCL exchanges were posted before the failure
    assert [r["follows"] for r in reps] == [[]] * 3, reps
    assert all(r["held"] == r["targets"] > 0 for r in reps), reps


def test_saving_cuda_tensors_works_when_cudahostregister_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The lent VM's case (issue 42): the stand-in's pin goes through the real TorchCuda.pin over a
    cudart with only torch's methods that refuses cudaHostRegister. The refusal must reach the
    fallback as PinRefused (it was an AttributeError: no cudaGetLastError) and the save stays exact."""
    fake = FakeCuda(current_device=0)
    fake.expect_device(DEV)
    with recorded_cudart(monkeypatch, register_error=1) as rt:
        fake.pin = TorchCuda().pin  # type: ignore[method-assign]
        sd, want = _gpu_state(fake, [9_000, 2_000], seed=11)
        storage = Storage(str(tmp_path))
        try:
            run_save(SoloComm(), storage, sd, compression=None, metadata=None, overwrite=False, cuda=fake)
        finally:
            storage.close()
    assert rt.log == [("register", 3)]  # asked once; the fallback took every later block
    assert fake.counts.get("pinned") == 2  # torch's pinned allocator: the save's two blocks
    assert fake.violations == []
    _loads_back(tmp_path, want)
