"""The CUDA calls streamckpt makes, behind one small interface.

``device`` holds every ordering rule of the GPU path and calls CUDA only through a
``CudaApi``; ``TorchCuda`` is the real one, a thin wrapper over ``torch.cuda``. Every
call names its device and stream explicitly (nothing relies on the current device),
so a recording stand-in (tests/fakecuda.py) can check the rules on a machine with no
GPU. Nothing here decides anything.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

from ..errors import CheckpointError
from .lasterror import clear_last_error

log = logging.getLogger(__name__)


class CudaApi(Protocol):
    """What the GPU path needs from CUDA: devices, streams, events, memory, copies."""

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def device_of(self, t: torch.Tensor) -> torch.device:
        """Where a tensor's memory lives."""

    def current_stream(self, device: torch.device) -> Any:
        """The caller's current stream on ``device`` (where its pending kernels run)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def new_event(self, device: torch.device) -> Any: ...

    def pinned(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Page-locked host bytes, allocated without touching any other GPU's context."""

    def pin(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Exactly ``nbytes`` of page-locked host bytes (no rounding, no cache) until ``unpin``:
        what a save stages through, sized to its budget. ``PinRefused`` when CUDA will not lock
        them (``device.pin_host`` then falls back)."""

    def unpin(self, t: torch.Tensor, device: torch.device) -> None:
        """Give back what ``pin(..., device)`` locked, under that device (the caller may be a
        thread whose current device is another one); the memory itself goes with its last reference."""

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        """Device bytes from the caching allocator, in the order of ``stream``."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """``dst.copy_(src)`` enqueued on ``stream`` (host memory: non-blocking, pinned)."""

    def download(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        """A host copy of device bytes, after ``stream``'s pending work (blocks the host)."""

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        """Work enqueued on ``waiter`` from now on runs after what ``waitee`` holds now."""

    def record(self, event: Any, stream: Any) -> None: ...

    def host_wait(self, event: Any) -> None:
        """Block the host until the work before ``event`` is done."""

    def stream_sync(self, stream: Any) -> None: ...

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` uses ``t`` (no reuse before its work is done)."""

    def exchange_posted(self, device: torch.device, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
                        after: Any = None) -> None:
        """A grouped send/recv of device buffers is posted now (NCCL semantics): NCCL's stream waits
        on ``after``, the stream current when it is posted (None: the caller's current stream)."""

    def use_stream(self, stream: Any) -> ContextManager[None]:
        """``stream`` (and its device) current inside: where ``work.wait()`` makes NCCL's completion wait."""

    def exchange_waited(self, device: torch.device, recvs: Sequence[torch.Tensor], stream: Any) -> None:
        """Its works were waited on with ``stream`` current (``use_stream``): ``stream`` now follows
        the exchange."""


class PinRefused(CheckpointError):
    """CUDA refused to page-lock host memory (``cudaHostRegister`` failed: some VM runtimes and
    locked-memory limits refuse it). CUDA's last error has been read away where a binding allows
    (``lasterror``)."""


class TorchCuda:
    """The real CUDA runtime through ``torch.cuda``. ``clear_error`` reads CUDA's last error away
    (torch's cudart binding has no ``cudaGetLastError``; see ``lasterror``)."""

    def __init__(self, clear_error: Callable[[], bool] = clear_last_error) -> None:
        self._clear_error = clear_error

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_of(self, t: torch.Tensor) -> torch.device:
        return t.device

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self, device: torch.device) -> Any:
        return torch.cuda.Event()  # an event takes the device of the stream it is recorded on

    def pinned(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with torch.cuda.device(device):  # pinning needs a context: this rank's GPU, not GPU 0
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pin(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Anonymous pages of our own, registered with CUDA: torch's pinned host allocator would
        round the size up to a power of two and keep the block cached after it is freed."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # whole pages of its own
        t = torch.frombuffer(mem, dtype=torch.uint8)  # the tensor keeps the mapping alive
        with torch.cuda.device(device):  # a context on this rank's GPU, not GPU 0
            rt = torch.cuda.cudart()
            err = int(rt.cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1: portable
            if err != 0:
                self._clear_error()  # the next kernel launch's check would raise it as its own
        if err != 0:
            raise PinRefused(
                f"pinning {nbytes} bytes of host memory on {device} failed (cudaHostRegister: cudaError {err}); "
                f"free host memory, raise the locked-memory limit (ulimit -l) or pass a smaller staging_budget")
        return t

    def unpin(self, t: torch.Tensor, device: torch.device) -> None:
        if t.numel() == 0:
            return
        with torch.cuda.device(device):  # called from the uploader thread too, whose current device is 0
            rt = torch.cuda.cudart()
            err = int(rt.cudaHostUnregister(t.data_ptr()))
            if err != 0:
                self._clear_error()
        if err != 0:
            log.warning("cudaHostUnregister of %d bytes on %s failed (cudaError %d)", t.numel(), device, err)

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def download(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return src.to("cpu")

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def stream_sync(self, stream: Any) -> None:
        stream.synchronize()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def exchange_posted(self, device: torch.device, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
                        after: Any = None) -> None:
        """Nothing to do: ProcessGroupNCCL makes its stream wait on the current stream and
        keeps the buffers alive for the allocator itself."""

    def use_stream(self, stream: Any) -> ContextManager[None]:
        return torch.cuda.stream(stream)  # also makes the stream's device current

    def exchange_waited(self, device: torch.device, recvs: Sequence[torch.Tensor], stream: Any) -> None:
        """Nothing to do: ``work.wait()`` made the current stream (``stream``) wait on NCCL's."""
