"""Host memory for staged copies of tensors being saved: a ring over one block.

``async_save`` copies this rank's share of the state aside before it returns, and the
uploader frees each copy as soon as its bytes are written, in the order they were
staged. With a budget that order makes a ring buffer exact: copies are carved out of
one block of ``budget`` bytes (pinned when the tensors live on a GPU), so staging never
holds more than the budget, whatever the allocator would have done with thousands of
freed tensors, and the block is reused by the next save instead of paying its page
faults (and, pinned, its registration) again. Without a budget the block is sized to the
share (``size``) and kept for the next save whose share fits it: a training loop saving
every N steps pays the block's page faults once (here: 0.05 s instead of 0.17 s to stage
242 MiB). On the CPU the block is an anonymous mapping left to the kernel's default pages.
It asked for transparent huge pages (``MADV_HUGEPAGE``) until December 2026: on this
project's VMs (virtio-balloon free page reporting) a free 2 MiB block is mostly one the
host has taken back, and first-touching it cost 2.7-3.4 CPU-s per GiB against ~0.5 for
default pages; a fresh process's ``async_save`` of 1 GiB blocked 6.7 s against DCP's 2.1 s
(after: 1.05 s; BENCHMARKS.md). DCP's staging uses default pages too, and the loads'
targets dropped the advice for the same reason.

For CUDA tensors the block is page-locked at exactly its size (``CudaApi.pin``: torch's
pinned allocator would round it up to a power of two and cache it after use: a 17 GB
share would pin 32 GiB for good), the copies run on a side stream of the area, after
the caller's stream's pending work, and the host waits for them before a copy counts as
staged (tensors on several GPUs: a stream per GPU, after that GPU's caller's stream). ``close``
unpins the block (also done when the area is garbage collected, on whatever thread: every
unpin names its device). Where CUDA refuses to pin, ``device.pin_host`` falls back.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref
from typing import Iterable, Sequence

import torch

from ..cuda.device import pin_host, unpin_host
from ..cuda.runtime import CudaApi, TorchCuda

ALIGN = 64  # every copy starts 64-byte aligned (any dtype view is valid)
PIECE = 4 << 20  # copy_all's unit of work


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingArea:
    """Copies handed out in FIFO order and given back in the same order.

    ``copy(t)`` waits until ``t`` fits behind the live copies (one copy always may go:
    an oversized tensor when nothing is live gets memory of its own), ``release()`` frees
    the oldest live copy, ``fail()`` wakes and stops every waiter (the upload died).
    """

    def __init__(self, budget: int | None, gpu: torch.device | None = None, *, size: int | None = None,
                 cuda: CudaApi | None = None) -> None:
        self.budget = budget
        self.gpu = gpu  # the tensors' GPU: copies go to pinned memory, registered under it
        self.cuda = cuda if cuda is not None or gpu is None else TorchCuda()
        self.stream = self.cuda.new_stream(gpu) if self.cuda is not None and gpu is not None else None
        self._streams: dict[torch.device, object] = {}  # other GPUs' copy streams (a rank on several GPUs)
        self.size = budget if budget is not None else size  # the block's bytes (None: copies of their own)
        self._pinned: list[torch.Tensor] = []  # what ``close`` (or the finalizer) unpins
        self._finalizer = weakref.finalize(self, _unpin_all, self.cuda, self._pinned, gpu)
        self.block: torch.Tensor | None = None
        if self.size is not None:
            self.block = self._block(self.size)
        self._live: collections.deque[tuple[int, int, torch.Tensor | None]] = collections.deque()  # (start, end, own)
        self._head = 0
        self._cond = threading.Condition()
        self.failed = False
        self.peak = 0
        self._used = 0

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this area holds page-locked now."""
        return sum(t.numel() for t in self._pinned)

    def _own(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of memory of its own: pinned at exactly that size for a GPU's tensors."""
        if self.gpu is None or self.cuda is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        t = pin_host(self.cuda, nbytes, self.gpu)
        self._pinned.append(t)
        return t

    def _block(self, n: int) -> torch.Tensor:
        if self.gpu is not None or n == 0:
            return self._own(n)
        mem = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # default pages: see the module doc
        return torch.frombuffer(mem, dtype=torch.uint8)  # the tensor keeps the mapping alive

    def close(self) -> None:
        """Unpin this area's memory now (its copies stay readable, as plain host memory)."""
        self._finalizer()
        self.block = None
        self.size = None

    @staticmethod
    def needed(sizes: Iterable[int]) -> int:
        """The block that holds copies of ``sizes`` bytes all at once."""
        return sum(_aligned(max(n, 1)) for n in sizes)

    def fits(self, budget: int | None, gpu: torch.device | None, share: int, cuda: CudaApi | None = None) -> bool:
        """Whether this area can stage the next save (same budget, device and CUDA runtime;
        without a budget, a block at least as large as the share)."""
        if budget != self.budget or gpu != self.gpu or not self._finalizer.alive:  # not alive: closed
            return False
        if gpu is not None and cuda is not None and cuda is not self.cuda and not (
                isinstance(cuda, TorchCuda) and isinstance(self.cuda, TorchCuda)):
            return False
        return budget is not None or (self.size is not None and self.size >= share)

    def reset(self) -> None:
        """Ready for the next save (nothing live)."""
        with self._cond:
            for _, _, own in self._live:
                self._unpin_own(own)
            self._live.clear()
            self._head = 0
            self.failed = False
            self._used = 0

    def _place(self, n: int) -> int | None:
        """Where ``n`` bytes fit now (block offset), or None."""
        size = self.size or 0
        if not self._live:
            return 0 if n <= size else -1
        oldest = self._live[0][0]
        if self._head > oldest or (self._head == oldest and not self._live):
            if self._head + n <= size:
                return self._head
            return 0 if n <= oldest else None
        return self._head if self._head + n <= oldest else None

    def copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """A host copy of ``t`` that its owner cannot change any more; None after ``fail``."""
        out = self.reserve(t)
        if out is not None:
            self.fill([(out, t)])
        return out

    def fill(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every pair; returns once the bytes are in host memory.

        A GPU's tensors are copied on a stream of that GPU (the area's own for its GPU), which
        first waits on the caller's stream there (its pending writes to them); one host wait per
        GPU. A rank's tensors may live on several GPUs, as ``save`` allows: one stream on the
        first GPU would not be ordered after another GPU's pending writes."""
        api, gpu = self.cuda, self.gpu
        if api is None or gpu is None or self.stream is None:
            for dst, src in pairs:
                dst.copy_(src.detach())  # blocking
            return
        streams: dict[torch.device, object] = {}  # each GPU's copies on a stream of that GPU
        for dst, src in pairs:
            dev = api.device_of(src)
            if dev.type != "cuda":
                dst.copy_(src.detach())  # a host tensor beside the GPU's
                continue
            stream = streams.get(dev)
            if stream is None:
                stream = streams[dev] = self._stream(dev)
                api.wait_stream(stream, api.current_stream(dev))  # after the caller's pending writes there
            api.copy(dst, src.detach(), stream)
        for dev, stream in streams.items():
            done = api.new_event(dev)
            api.record(done, stream)
            api.host_wait(done)

    def _stream(self, dev: torch.device) -> object:
        """The area's copy stream on ``dev`` (the area's own GPU's, or one made for another GPU
        a rank's tensors also live on)."""
        assert self.cuda is not None
        if dev == self.gpu:
            return self.stream
        if dev not in self._streams:
            self._streams[dev] = self.cuda.new_stream(dev)
        return self._streams[dev]

    def reserve(self, t: torch.Tensor) -> torch.Tensor | None:
        """Room for a copy of ``t`` (its shape and dtype), taken in FIFO order but not yet
        filled; None after ``fail``. ``copy`` is ``reserve`` and ``fill``."""
        nbytes = t.numel() * t.element_size()
        if self.block is None:
            return self._own(nbytes).view(t.dtype).view(t.shape)
        n = _aligned(max(nbytes, 1))
        with self._cond:
            while True:
                if self.failed:
                    return None
                at = self._place(n)
                if at is not None:
                    break
                self._cond.wait()
            own = self._own(nbytes) if at < 0 else None  # larger than the whole block: memory of its own
            if own is not None:
                self._live.append((-1, n, own))
            else:
                self._live.append((at, at + n, None))
                self._head = at + n
            self._used += n
            self.peak = max(self.peak, self._used)
        if own is not None:
            return own.view(t.dtype).view(t.shape)
        return self.block[at:at + nbytes].view(t.dtype).view(t.shape)

    def release(self) -> None:
        """The oldest live copy has been written."""
        if self.block is None:
            return  # copies of their own: freed with the last reference
        with self._cond:
            start, end, own = self._live.popleft()
            self._used -= (end - start) if start >= 0 else end
            self._unpin_own(own)
            if not self._live:
                self._head = 0
            self._cond.notify_all()

    def _unpin_own(self, own: torch.Tensor | None) -> None:
        if own is None or self.cuda is None or self.gpu is None:
            return
        for k, t in enumerate(self._pinned):
            if t is own:
                del self._pinned[k]
                unpin_host(self.cuda, own, self.gpu)  # on the uploader thread: named device
                return

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()


def _unpin_all(cuda: CudaApi | None, pinned: list[torch.Tensor], gpu: torch.device | None) -> None:
    """Unpin what an area pinned (at ``close``, or when the area is garbage collected, on
    whatever thread that happens: under the area's device)."""
    while pinned:
        t = pinned.pop()
        if cuda is not None and gpu is not None:
            unpin_host(cuda, t, gpu)


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], workers: int) -> None:
    """``dst.copy_(src)`` for every pair, on the CPU, spread over ``workers`` threads.

    Why: a first save copies into fresh memory, and the kernel's page faults and zeroing
    run on the thread that first touches a page. One thread leaves the other cores idle;
    torch's own intra-op threads do not help a plain same-dtype copy. Tensors are cut
    into pieces of ``PIECE`` bytes so that one large tensor spreads too.
    """
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        d, s = _flat_bytes(dst), _flat_bytes(src.detach())
        if d is None or s is None:
            dst.copy_(src.detach())
            continue
        for at in range(0, len(d), PIECE):
            pieces.append((d[at:at + PIECE], s[at:at + PIECE]))
    workers = max(1, min(workers, len(pieces)))
    if workers == 1:
        for d, s in pieces:
            d.copy_(s)
        return
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for d, s in pieces[k::workers]:
                d.copy_(s)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), name="streamckpt-stage") for k in range(1, workers)]
    for th in threads:
        th.start()
    run(0)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CPU tensor's bytes as one flat uint8 view (None: anything else)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.reshape(-1).view(torch.uint8)
