"""A recording, lazily executing stand-in for CUDA: the only thing the GPU invariant tests fake.

It implements ``streamckpt.cuda.runtime.CudaApi`` on a machine without a GPU. "Device"
memory is host memory the fake knows as living on ``cuda:i`` (``place`` for tensors
the test allocates, ``empty`` for the library's buffers). Work enqueued on a stream
does not run when enqueued: it runs only when the host forces it (an event or stream
synchronize, a download, ``synchronize``) — in stream order, after the work the
cross-stream waits made it depend on: the latest a real GPU could run it. So a missing
wait shows up as wrong bytes, and as a recorded violation:

* ``host-write``: a copy reading host (pinned) memory finds it changed between enqueue
  and the host's next wait covering it — the host wrote an arena before waiting on the
  event after its copies (checked again when the copy ran early, see NCCL below);
* ``race``: two ops touch the same bytes, one writing, and neither is ordered before the
  other (vector clocks over the stream waits) — e.g. a pending init kernel on the
  caller's stream and a loaded piece on the side stream;
* ``no-record-stream``: a device buffer used on a stream other than the one it was
  allocated on without ``record_stream`` on that stream (NCCL's own use exempt: it
  records its buffers itself);
* ``pageable``: a non-blocking copy (every ``copy``) whose host side was not allocated
  by ``pinned`` (torch would silently make it a blocking copy);
* ``device``: a stream, event, buffer or copy on another GPU than the one expected
  (``expect_device``).

**NCCL** is a stream of its own per device. ``exchange_posted`` enqueues one op on it
that waits on the caller's current stream, reads the send buffers and writes the
receive buffers; it runs only when forced, like any op. The bytes themselves travel over
the real gloo group when the library posts it, so the op's dependencies (the send
copies) run then, *early* — not forced: their host reads are checked again when the
host forces them later. ``exchange_waited`` (after ``work.wait()``) makes the stream that
was current then (``use_stream``) wait on NCCL, and — when the op has not run yet — takes the bytes gloo delivered
and fills the receive buffers with ``POISON`` until the op runs: a read of a receive
buffer not ordered after NCCL sees poison.

**The caching allocator**: ``empty`` hands out device blocks from segments the fake
keeps; a freed block (its storage's last reference gone) goes back to its allocation
stream's pool at once, or, if it was ``record_stream``-ed, once those streams' work
enqueued before the free has run — as torch's allocator does. The next ``empty`` on
that stream gets the same bytes, so a buffer freed too early is overwritten under a
pending reader (wrong bytes and a ``race``). Ops refer to device blocks through
aliases that do not keep them allocated.

``fail_alloc(kind, nbytes)`` (``kind`` "pinned" or "empty") makes that allocation raise
``torch.OutOfMemoryError``, as a nearly full GPU or host would.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass(eq=False)
class FakeStream:
    device: torch.device
    name: str
    sid: int
    ops: list["Op"] = field(default_factory=list)
    done: int = 0  # ops[:done] have run
    forced: int = 0  # ops[:forced] the host has waited for (forced <= done)
    clock: dict[int, int] = field(default_factory=dict)  # vector clock: stream id -> ops ordered before now

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}>"


@dataclass(eq=False)
class FakeEvent:
    device: torch.device
    stream: FakeStream | None = None
    pos: int = 0
    clock: dict[int, int] = field(default_factory=dict)


@dataclass(eq=False)
class Op:
    stream: FakeStream
    pos: int  # 1-based position in its stream
    clock: dict[int, int]
    label: str
    fn: Callable[[], None]
    reads: list[tuple[int, int, int]]  # (storage ptr, lo, hi) byte spans
    writes: list[tuple[int, int, int]]
    host_reads: list[tuple[torch.Tensor, torch.Tensor]]  # (source view, its bytes at enqueue time)
    writes_target: bool = False
    ran: bool = False
    early: bool = False  # ran for NCCL's transport before the host forced it


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """The bytes a tensor view covers in its storage (a superset for strided views)."""
    st = t.untyped_storage()
    isz = t.element_size()
    lo = t.storage_offset() * isz
    if t.numel() == 0:
        return st.data_ptr(), lo, lo
    extent = sum((s - 1) * abs(d) for s, d in zip(t.shape, t.stride())) + 1
    return st.data_ptr(), lo, lo + extent * isz


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone() if t.numel() else torch.empty(0, dtype=torch.uint8)


def _overlap(a: Sequence[tuple[int, int, int]], b: Sequence[tuple[int, int, int]]) -> bool:
    return any(p == q and lo < hi2 and lo2 < hi for p, lo, hi in a for q, lo2, hi2 in b)


POISON = 0xA5  # what a receive buffer holds until NCCL's op has run


@dataclass
class _Block:
    device: torch.device
    stream: FakeStream | None  # allocation stream (None: placed by the test)
    target: bool
    recorded: set[int] = field(default_factory=set)
    used_on: set[int] = field(default_factory=set)
    label: str = ""
    memory: tuple[torch.Tensor, int, int] | None = None  # (segment, offset, size) of an ``empty`` block


@dataclass(eq=False)
class _Free:
    """A freed block in its allocation stream's pool: reusable once ``after`` has run."""

    segment: torch.Tensor
    offset: int
    size: int
    after: list[tuple[FakeStream, int]]


def _round(n: int) -> int:
    return max(512, -(-n // 512) * 512)


class FakeCuda:
    """See the module doc. ``current_device`` and ``device_count`` are what the fake reports."""

    def __init__(self, *, current_device: int = 0, device_count: int = 8,
                 fail_alloc: Callable[[str, int], bool] | None = None) -> None:
        self._current = current_device
        self._count = device_count
        self._fail_alloc = fail_alloc
        self._lock = threading.RLock()
        self._sids = itertools.count(1)
        self._default: dict[torch.device, FakeStream] = {}
        self._nccl: dict[torch.device, FakeStream] = {}
        self.streams: list[FakeStream] = []
        self._blocks: dict[int, _Block] = {}  # storage ptr -> block, device memory only
        self._pinned: set[int] = set()
        self._pools: dict[int, list[_Free]] = {}  # allocation stream id -> freed blocks
        self._pending_recv: dict[torch.device, Op] = {}  # the last exchange's op, until waited
        self.violations: list[str] = []
        self.devices_used: set[torch.device] = set()
        self.counts: dict[str, int] = {}
        self.expected: torch.device | None = None
        self._freed_unrecorded: list[str] = []

    # ------------------------------------------------------------------ test-side helpers

    def expect_device(self, device: torch.device) -> None:
        self.expected = device

    def place(self, t: torch.Tensor, device: torch.device, *, target: bool = True) -> torch.Tensor:
        """Declare a test-allocated host tensor to live on ``device`` (a state_dict tensor)."""
        self._register(t, _Block(device, None, target, label="placed"))
        return t

    def launch(self, device: torch.device, fn: Callable[[], None], *, writes: Sequence[torch.Tensor] = (),
               reads: Sequence[torch.Tensor] = (), label: str = "caller kernel") -> None:
        """A kernel of the caller's, enqueued on its current stream (runs lazily like any other)."""
        self._enqueue(self._caller_stream(device), fn, list(reads), list(writes), label)

    def mark(self, device: torch.device) -> tuple[int, int]:
        """(stream id, position) of the caller's current stream now: work before this must precede targets' writes."""
        s = self._caller_stream(device)
        return s.sid, len(s.ops)

    def synchronize(self) -> None:
        """Run everything, side streams before default ones (the order that exposes a missing wait)."""
        with self._lock:
            for s in sorted(self.streams, key=lambda s: s.name.startswith("default")):
                self._flush(s, len(s.ops))

    def target_writes(self) -> list[Op]:
        return [op for s in self.streams for op in s.ops if op.writes_target]

    def check_ordering(self, device: torch.device, mark: tuple[int, int]) -> list[str]:
        """Every target write follows the caller's work before ``mark``, and the caller's stream
        now follows every target write."""
        out = []
        sid, pos = mark
        cur = self._caller_stream(device)
        for op in self.target_writes():
            if op.stream.sid != sid and op.clock.get(sid, 0) < pos:
                out.append(f"order: {op.label} on {op.stream} is not ordered after the caller's stream "
                           f"(position {pos})")
            if cur.clock.get(op.stream.sid, 0) < op.pos:
                out.append(f"order: the caller's stream does not follow {op.label} on {op.stream}")
        return out

    def follows(self, device: torch.device) -> list[str]:
        """The other streams the caller's current stream on ``device`` is ordered after (a host sync
        of it, or any later kernel of the caller's, waits for their work up to there)."""
        cur = self._caller_stream(device)
        return sorted(s.name for s in self.streams if s is not cur and cur.clock.get(s.sid, 0) > 0)

    def recorded_on(self, t: torch.Tensor) -> set[int]:
        """The streams ``record_stream`` named for ``t``'s memory."""
        block = self._blocks.get(t.untyped_storage().data_ptr())
        return set(block.recorded) if block is not None else set()

    def check_record_stream(self) -> list[str]:
        out = []
        with self._lock:
            for block in self._blocks.values():
                missing = block.used_on - block.recorded
                if block.stream is not None and missing:
                    out.append(f"no-record-stream: {block.label} allocated on {block.stream} used on streams "
                               f"{sorted(missing)} without record_stream")
            out += self._freed_unrecorded
        return out

    # ------------------------------------------------------------------ CudaApi

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return self._current

    def device_of(self, t: torch.Tensor) -> torch.device:
        if t.device.type != "cpu":
            return t.device
        block = self._blocks.get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
        return block.device if block is not None else torch.device("cpu")

    def current_stream(self, device: torch.device) -> FakeStream:
        self._use(device, "current_stream")
        return self._caller_stream(device)

    def new_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            self._use(device, "new_stream")
            return self._stream(device, f"side{next(self._sids)}:{device}")

    def new_event(self, device: torch.device) -> FakeEvent:
        self._use(device, "new_event")
        return FakeEvent(device)

    def pinned(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self._use(device, "pinned")
        self._maybe_fail("pinned", nbytes)
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        st = t.untyped_storage()
        ptr = st.data_ptr()
        with self._lock:
            self._pinned.add(ptr)
        weakref.finalize(st, self._pinned.discard, ptr)
        self._count_call("pinned")
        return t[:nbytes]

    def empty(self, nbytes: int, device: torch.device, stream: FakeStream) -> torch.Tensor:
        """A block from the caching allocator: a freed one of this stream's pool when it fits."""
        self._use(device, "empty")
        self._same_device(stream.device, device, "empty")
        self._maybe_fail("empty", nbytes)
        size = _round(nbytes)
        with self._lock:
            segment, offset = self._reuse(stream, size)
            t = _view_of(segment, offset, size)
            self._register(t, _Block(device, stream, False, label=f"buffer of {nbytes} bytes",
                                     memory=(segment, offset, size)))
        self._count_call("empty")
        return t[:nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        for t, side in ((dst, "destination"), (src, "source")):
            d = self.device_of(t)
            if d.type == "cuda":
                self._same_device(stream.device, d, "copy")
            elif t.untyped_storage().data_ptr() not in self._pinned:
                self.violations.append(f"pageable: a non-blocking copy {tuple(src.shape)}->{tuple(dst.shape)} on "
                                       f"{stream} has a pageable host {side} (not from pinned()): torch makes it "
                                       f"a blocking copy")
        self._count_call("copy")
        d, s = self._alias(dst), self._alias(src)
        self._enqueue(stream, lambda: d.copy_(s), [src], [dst], f"copy {tuple(src.shape)}->{tuple(dst.shape)}")

    def download(self, src: torch.Tensor, stream: FakeStream) -> torch.Tensor:
        self._count_call("download")
        out = torch.empty(src.shape, dtype=src.dtype)
        s = self._alias(src)
        self._enqueue(stream, lambda: out.copy_(s), [src], [], "download")
        self.stream_sync(stream)
        return out

    def wait_stream(self, waiter: FakeStream, waitee: FakeStream) -> None:
        with self._lock:
            self._same_device(waiter.device, waitee.device, "wait_stream")
            for k, v in waitee.clock.items():
                if waiter.clock.get(k, 0) < v:
                    waiter.clock[k] = v

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            self._same_device(event.device, stream.device, "record")
            event.stream, event.pos, event.clock = stream, len(stream.ops), dict(stream.clock)

    def host_wait(self, event: FakeEvent) -> None:
        """Everything before the event, on its stream and on what that stream waited for."""
        if event.stream is not None:
            with self._lock:
                self._force_clock(event.clock)

    def stream_sync(self, stream: FakeStream) -> None:
        with self._lock:
            self._force_clock(stream.clock)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            block = self._blocks.get(t.untyped_storage().data_ptr())
            if block is not None:
                block.recorded.add(stream.sid)

    def exchange_posted(self, device: torch.device, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
                        after: FakeStream | None = None) -> None:
        """NCCL's op waits on the current stream (``after`` when posted under ``use_stream(after)``)
        and stays pending; gloo moves the bytes now, so what the send buffers depend on runs now,
        early (re-checked when forced)."""
        with self._lock:
            nccl = self._nccl.get(device)
            if nccl is None:
                nccl = self._nccl[device] = self._stream(device, f"nccl:{device}")
            if after is not None:
                self._same_device(after.device, device, "exchange_posted")
            self.wait_stream(nccl, after if after is not None else self._caller_stream(device))
            self._count_call("exchange")
            self._enqueue(nccl, lambda: None, list(sends), list(recvs), "nccl send/recv", nccl=True)
            op = nccl.ops[-1]
            for t in [*sends, *recvs]:  # ProcessGroupNCCL records its buffers on its stream
                self.record_stream(t, nccl)
            for s in list(self.streams):
                if s is not nccl:
                    self._flush(s, op.clock.get(s.sid, 0), force=False)
            self._pending_recv[device] = op

    def use_stream(self, stream: FakeStream) -> contextlib.AbstractContextManager[None]:
        """Where ``work.wait()`` makes NCCL's completion wait: said again to ``exchange_waited``."""
        self._use(stream.device, "use_stream")
        return contextlib.nullcontext()

    def exchange_waited(self, device: torch.device, recvs: Sequence[torch.Tensor], stream: FakeStream) -> None:
        """``work.wait()`` with ``stream`` current: ``stream`` follows NCCL. The received bytes reach
        the receive buffers only when NCCL's op runs: until then they hold ``POISON``."""
        with self._lock:
            self._same_device(stream.device, device, "exchange_waited")
            nccl = self._nccl.get(device)
            if nccl is not None:
                self.wait_stream(stream, nccl)
            op = self._pending_recv.pop(device, None)
            if op is None or op.ran or not recvs:
                return
            wire = [(self._alias(r), r.detach().clone()) for r in recvs]
            for r in recvs:
                r.view(torch.uint8).fill_(POISON)

            def deliver() -> None:
                for buf, data in wire:
                    buf.copy_(data)

            op.fn = deliver

    # ------------------------------------------------------------------ internals

    def _caller_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            if device not in self._default:
                self._default[device] = self._stream(device, f"default:{device}")
            return self._default[device]

    def _stream(self, device: torch.device, name: str) -> FakeStream:
        s = FakeStream(device, name, next(self._sids))
        self.streams.append(s)
        return s

    def _count_call(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _maybe_fail(self, kind: str, nbytes: int) -> None:
        if self._fail_alloc is not None and self._fail_alloc(kind, nbytes):
            self._count_call(f"failed {kind}")
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes ({kind}, fake)")

    def _use(self, device: torch.device, what: str) -> None:
        if device.type != "cuda" or device.index is None:
            self.violations.append(f"device: {what} on {device} (not a concrete GPU)")
            return
        self.devices_used.add(device)
        if self.expected is not None and device != self.expected:
            self.violations.append(f"device: {what} on {device}, expected {self.expected}")

    def _same_device(self, a: torch.device, b: torch.device, what: str) -> None:
        if a != b:
            self.violations.append(f"device: {what} mixes {a} and {b}")

    def _reuse(self, stream: FakeStream, size: int) -> tuple[torch.Tensor, int]:
        """The smallest freed block of ``stream``'s pool that fits and whose recorded work has run,
        else a new segment."""
        pool = self._pools.setdefault(stream.sid, [])
        ready = [f for f in pool if f.size >= size and all(s.done >= pos for s, pos in f.after)]
        if ready:
            best = min(ready, key=lambda f: f.size)
            pool.remove(best)
            self._count_call("reused")
            return best.segment, best.offset
        segment = torch.empty(size + 512, dtype=torch.uint8)
        return segment, -segment.data_ptr() % 512

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the same bytes through a storage of its own, so an op does not keep an
        ``empty`` block allocated (the caching allocator frees it when the caller drops it)."""
        block = self._blocks.get(t.untyped_storage().data_ptr())
        if block is None or block.memory is None:
            return t
        segment, offset, size = block.memory
        base = _view_of(segment, offset, size)
        return torch.empty(0, dtype=t.dtype).set_(base.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def _register(self, t: torch.Tensor, block: _Block) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        with self._lock:
            self._blocks[ptr] = block
        weakref.finalize(st, self._free, ptr, block)

    def _free(self, ptr: int, block: _Block) -> None:
        with self._lock:
            if self._blocks.get(ptr) is block:
                del self._blocks[ptr]
            missing = block.used_on - block.recorded
            pending = [s for s in self.streams if s.sid in missing and s.done < len(s.ops)]
            if block.stream is not None and pending:  # a stream that used it may still read or write it
                self._freed_unrecorded.append(
                    f"no-record-stream: {block.label} allocated on {block.stream} was used on streams "
                    f"{sorted(missing)} without record_stream")
            if block.memory is not None and block.stream is not None:
                after = [(s, len(s.ops)) for s in self.streams if s.sid in block.recorded]
                segment, offset, size = block.memory
                self._pools.setdefault(block.stream.sid, []).append(_Free(segment, offset, size, after))

    def _enqueue(self, stream: FakeStream, fn: Callable[[], None], reads: list[torch.Tensor],
                 writes: list[torch.Tensor], label: str, nccl: bool = False) -> None:
        with self._lock:
            stream.clock[stream.sid] = len(stream.ops) + 1
            host_reads = []
            for t in reads:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self._blocks:  # host memory: must not change before the copy runs
                    host_reads.append((t, _bytes(t)))
            for t in reads + writes:
                block = self._blocks.get(t.untyped_storage().data_ptr())
                if block is not None and block.stream is not None and block.stream is not stream and not nccl:
                    block.used_on.add(stream.sid)
            writes_target = any(
                (b := self._blocks.get(t.untyped_storage().data_ptr())) is not None and b.target for t in writes)
            stream.ops.append(Op(stream, len(stream.ops) + 1, dict(stream.clock), label, fn,
                                 [_span(t) for t in reads], [_span(t) for t in writes], host_reads, writes_target))

    def _force_clock(self, clock: dict[int, int]) -> None:
        """The host waits for every stream up to ``clock`` (a wait counts even with no op after it)."""
        for s in list(self.streams):
            if clock.get(s.sid, 0):
                self._flush(s, clock[s.sid])

    def _flush(self, stream: FakeStream, upto: int, force: bool = True) -> None:
        """Run ``stream``'s ops up to ``upto`` after what they wait for; ``force``: the host waits
        for them (an op that ran early has its host reads checked again)."""
        i = stream.forced if force else stream.done
        while i < upto:
            op = stream.ops[i]
            for s in self.streams:  # first what this op was made to wait for
                need = op.clock.get(s.sid, 0)
                if s is not stream and (s.forced if force else s.done) < need:
                    self._flush(s, need, force)
            if not op.ran:
                self._check_races(op)
                self._check_host_reads(op, "")
                op.fn()
                op.ran, op.early = True, not force
                stream.done = i + 1
            elif force and op.early:
                self._check_host_reads(op, " (it ran early for NCCL; a GPU may run it only now)")
            i += 1
            if force:
                stream.forced = i

    def _check_host_reads(self, op: Op, why: str) -> None:
        for view, before in op.host_reads:
            if not torch.equal(_bytes(view), before):
                self.violations.append(f"host-write: the host changed memory that {op.label} on {op.stream} "
                                       f"reads before it ran (an arena written before waiting on its event){why}")

    def _check_races(self, op: Op) -> None:
        for s in self.streams:
            if s is op.stream:
                continue
            for other in s.ops[s.done:]:
                if other.clock.get(op.stream.sid, 0) >= op.pos:
                    continue  # ordered after op
                if _overlap(op.writes, other.reads + other.writes) or _overlap(op.reads, other.writes):
                    self.violations.append(f"race: {op.label} on {op.stream} and {other.label} on {s} touch the "
                                           f"same bytes unordered")


def _view_of(segment: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """Bytes [offset, offset + size) of a segment as a tensor with a storage of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(memoryview(segment.numpy())[offset: offset + size], dtype=torch.uint8)


# ------------------------------------------------------------------ save path: exact pinned memory (h-gpusave)
# ``CudaApi.pin``/``unpin``: page-locked host bytes of exactly the size asked, until unpinned.
# Kept in one block so that the stand-in's core can change beside it; these build on ``pinned``.
# ``fake.refuse_pin = True`` makes ``pin`` raise ``PinRefused`` (cudaHostRegister failing);
# ``unpin`` names its device like every other call (checked by ``expect_device``).


@dataclass
class PinLedger:
    """What ``pin`` handed out: every size asked, and the blocks still pinned (storage ptr -> bytes)."""

    asked: list[int] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)
    unpinned: list[int] = field(default_factory=list)

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())


def _pins(self: FakeCuda) -> PinLedger:
    with self._lock:
        ledger = self.__dict__.get("_pin_ledger")
        if ledger is None:
            ledger = self.__dict__["_pin_ledger"] = PinLedger()
        return ledger


def _pin(self: FakeCuda, nbytes: int, device: torch.device) -> torch.Tensor:
    if self.__dict__.get("refuse_pin"):  # cudaHostRegister failing, as some VM runtimes make it
        from streamckpt.cuda.runtime import PinRefused

        self._use(device, "pin")
        self._count_call("refused pin")
        raise PinRefused(f"pinning {nbytes} bytes of host memory on {device} failed (cudaHostRegister: "
                         f"cudaError 1, fake)")
    t = self.pinned(nbytes, device)
    with self._lock:
        ledger = _pins(self)
        ledger.asked.append(nbytes)
        ledger.live[t.untyped_storage().data_ptr()] = nbytes
    return t


def _unpin(self: FakeCuda, t: torch.Tensor, device: torch.device) -> None:
    self._use(device, "unpin")
    ptr = t.untyped_storage().data_ptr()
    with self._lock:
        ledger = _pins(self)
        if ptr not in ledger.live or t.storage_offset() != 0:
            self.violations.append(f"unpin: {t.numel()} bytes at {ptr:#x} were not handed out by pin (or twice)")
            return
        ledger.unpinned.append(ledger.live.pop(ptr))


FakeCuda.pins = property(_pins)  # type: ignore[attr-defined]
FakeCuda.pin = _pin  # type: ignore[attr-defined]
FakeCuda.unpin = _unpin  # type: ignore[attr-defined]


# ------------------------------------------------------------------ torch.cuda.cudart(), no more than torch binds (issue 42)
# torch/csrc/cuda/shared/cudart.cpp binds these and nothing else (no cudaGetLastError): a call the
# library makes to any other method fails here on CPU as it would on the GPU, with AttributeError.

TORCH_CUDART = ("cudaGetErrorString", "cudaProfilerStart", "cudaProfilerStop", "cudaHostRegister",
                "cudaHostUnregister", "cudaStreamCreate", "cudaStreamDestroy", "cudaMemGetInfo")


class FakeCudart:
    """``torch.cuda.cudart()`` on CPU: exactly torch's methods. ``register_error``: what
    ``cudaHostRegister`` returns (0: success); a failure leaves ``pending`` (CUDA's last error)
    until something reads it away — which torch's binding cannot."""

    __slots__ = ("register_error", "pending", "calls")

    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.pending = 0
        self.calls: list[str] = []

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802 - CUDA's names
        return f"cudaError {int(err)} (fake)"

    def cudaProfilerStart(self) -> int:  # noqa: N802
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802
        return 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append("register")
        if self.register_error:
            self.pending = self.register_error
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append("unregister")
        return 0

    def cudaStreamCreate(self, ptr: int) -> int:  # noqa: N802
        return 0

    def cudaStreamDestroy(self, ptr: int) -> int:  # noqa: N802
        return 0

    def cudaMemGetInfo(self, device: int) -> tuple[int, int]:  # noqa: N802
        return 80 << 30, 80 << 30

    def read_last_error(self) -> bool:
        """What ``lasterror.clear_last_error`` does on a GPU (cudaGetLastError through libcudart)."""
        self.calls.append("get-last-error")
        self.pending = 0
        return True
