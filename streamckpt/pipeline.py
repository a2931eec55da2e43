"""Executing a ``LoadPlan`` on one rank: fetch, verify, decode, exchange, scatter.

Round k+1's range reads are in flight (fsspec's event loop thread, or a
thread pool for local files) while round k is decoded, exchanged with one
grouped send/recv and copied into targets. Staging lives in two arenas per
rank, allocated once at the size this rank's largest round needs (at most
half the memory budget each). On CUDA the arenas are pinned and each round's
host->device copies run on a side stream; the event recorded after them gates
the reuse of that arena two rounds later. Every rank walks the same rounds,
so the grouped send/recv of a round cannot deadlock; failures are agreed on
before each exchange so that one rank's error raises on all of them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import zstandard

from . import dtypes
from .comm import P2P, GroupComm, SoloComm
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .plandata import ALIGN, Copy, LoadPlan, Read, is_packed, message_layout, message_size, messages_of, packed_copy
from .storage import RangeRead, Storage

log = logging.getLogger(__name__)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(slots=True)
class Message:
    peer: int
    read_index: int
    copies: list[Copy]


@dataclass(slots=True)
class LocalRound:
    reads: list[tuple[int, Read]] = field(default_factory=list)  # (global read index, read)
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reads or self.sends or self.recvs)


def local_schedule(plan: LoadPlan, rank: int) -> list[LocalRound]:
    """This rank's part of every round."""
    rounds = [LocalRound() for _ in range(plan.num_rounds)]
    for i, r in enumerate(plan.reads):
        if r.reader == rank:
            rounds[r.round].reads.append((i, r))
            for peer, copies in sorted(messages_of(r, plan.targets).items()):
                rounds[r.round].sends.append(Message(peer, i, copies))
        elif not r.private:
            mine = [c for c in r.copies if rank in plan.targets[c.target].needers]
            if mine:
                rounds[r.round].recvs.append(Message(r.reader, i, mine))
    return rounds


@dataclass(slots=True)
class _Layout:
    """Where each buffer of one round lives in its arena."""

    fetch: dict[int, int] = field(default_factory=dict)  # read index -> offset of fetched bytes
    decode: dict[int, int] = field(default_factory=dict)  # read index -> offset of decoded bytes
    pack: dict[tuple[int, int], int] = field(default_factory=dict)  # (read, peer) -> packed message
    recv: dict[tuple[int, int], int] = field(default_factory=dict)  # (read, peer) -> received message
    size: int = 0


def _layout(rnd: LocalRound) -> _Layout:
    lay = _Layout()
    pos = 0
    for i, r in rnd.reads:
        # fetched bytes keep the file offset's alignment so typed views stay aligned
        pos = _align(pos) + r.start % ALIGN
        lay.fetch[i] = pos
        pos += r.length
        if r.zstd:
            pos = _align(pos)
            lay.decode[i] = pos
            pos += r.staging
    for m in rnd.sends:
        if is_packed(m.copies):
            pos = _align(pos)
            lay.pack[(m.read_index, m.peer)] = pos
            pos += message_layout(m.copies)[1]
    for m in rnd.recvs:
        pos = _align(pos)
        lay.recv[(m.read_index, m.peer)] = pos
        pos += message_size(m.copies)
    lay.size = _align(pos) + ALIGN
    return lay


@dataclass(slots=True)
class Stats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    rounds: int = 0
    copies: int = 0
    staging_bytes: int = 0


class Destinations:
    """Target id -> the local tensor it fills (only this rank's targets)."""

    def __init__(self, tensors: dict[int, torch.Tensor]) -> None:
        self.tensors = tensors

    def apply(self, staged: torch.Tensor, copy: Copy) -> None:
        """Copy one piece from a uint8 buffer (starting at the piece) into its target."""
        dest = self.tensors.get(copy.target)
        if dest is None:
            return
        src = source_view(staged, copy)
        if copy.perm is not None:
            src = src.permute(copy.perm)
        if copy.dst_base is None:
            dst = dest[copy.dst_box.slices()] if copy.dst_box.ndim else dest
        else:
            frame = copy.dst_frame or ()
            dst = dest.narrow(0, copy.dst_base, math.prod(frame)).view(frame)[copy.dst_box.slices()]
        dst.copy_(src, non_blocking=dst.device.type == "cuda")


def source_view(staged: torch.Tensor, copy: Copy) -> torch.Tensor:
    """The copy's source elements, viewed in a uint8 buffer that starts at the piece."""
    dt = dtypes.to_torch(copy.src_dtype)
    raw = staged[: copy.length]
    if dt.itemsize > 1 and (raw.data_ptr() % dt.itemsize):
        raw = raw.clone()
    if copy.src_shape:
        return raw.view(dt).as_strided(copy.src_shape, copy.src_strides)
    return raw.view(dt).reshape(())


def pack_message(staged: torch.Tensor, copies: Sequence[Copy], out: torch.Tensor) -> torch.Tensor:
    """Copy each piece's elements (no bytes between strided rows) into ``out``; return the message."""
    offs, size = message_layout(copies)
    for c, o in zip(copies, offs):
        src = source_view(staged[c.offset:], c)
        dst = out[o: o + src.numel() * src.element_size()].view(src.dtype)
        dst.view(src.shape).copy_(src)
    return out[:size]


def unpack_message(buf: torch.Tensor, copies: Sequence[Copy], dest: "Destinations") -> None:
    """Apply a received message: a slice of the staged read as is, or a packed one."""
    if not is_packed(copies):
        dest.apply(buf, copies[0])
        return
    offs, _ = message_layout(copies)
    for c, o in zip(copies, offs):
        dest.apply(buf[o:], packed_copy(c))


class Executor:
    """Runs one rank's schedule against storage and the process group."""

    def __init__(
        self,
        plan: LoadPlan,
        comm: SoloComm | GroupComm,
        storage: Storage,
        destinations: Destinations,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.plan = plan
        self.comm = comm
        self.storage = storage
        self.dest = destinations
        self.progress = progress
        self.rank = comm.rank
        self.schedule = local_schedule(plan, self.rank)
        self.layouts = [_layout(r) for r in self.schedule]
        self.stats = Stats(rounds=plan.num_rounds)
        self.cuda = any(t.device.type == "cuda" for t in destinations.tensors.values()) or comm.device.type == "cuda"
        sizes = [max((lay.size for lay in self.layouts[slot::2]), default=0) for slot in range(2)]
        self.stats.staging_bytes = sum(sizes)
        if self.stats.staging_bytes > plan.options.memory_budget:
            log.warning(
                "rank %d stages %d bytes, above memory_budget=%d: a checksum chunk (or zstd frame) is staged "
                "whole, so the budget must hold about 4 chunks (the default chunk is 256 KiB)",
                self.rank, self.stats.staging_bytes, plan.options.memory_budget,
            )
        pin = self.cuda and torch.cuda.is_available()
        self.arenas = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
        self.views = [memoryview(a.numpy()) if a.numel() else memoryview(b"") for a in self.arenas]
        self.stream = torch.cuda.Stream() if pin else None
        self.events: list[Any] = [None, None]
        self.dctx = zstandard.ZstdDecompressor()

    # ------------------------------------------------------------- round steps

    def _submit(self, k: int) -> cf.Future | None:
        rnd = self.schedule[k]
        if not rnd.reads:
            return None
        slot = k % 2
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # the arena's last H2D copies are done
            self.events[slot] = None
        lay = self.layouts[k]
        view = self.views[slot]
        reqs = [RangeRead(r.file, r.start, r.stop, r.checks) for _, r in rnd.reads]
        bufs = [view[lay.fetch[i]: lay.fetch[i] + r.length] for i, r in rnd.reads]
        self.stats.bytes_read += sum(r.length for _, r in rnd.reads)
        return self.storage.read_into(reqs, bufs)

    def _decode(self, k: int) -> None:
        view = self.views[k % 2]
        lay = self.layouts[k]
        for i, r in self.schedule[k].reads:
            if not r.zstd:
                continue
            base_in, base_out = lay.fetch[i], lay.decode[i]
            for in_off, in_len, out_off, out_len in r.frames or ():
                src = view[base_in + in_off: base_in + in_off + in_len]
                try:
                    data = self.dctx.decompress(src, max_output_size=out_len)
                except zstandard.ZstdError as e:
                    raise CorruptCheckpointError(
                        f"{self.storage.describe(r.file)} bytes [{r.start + in_off}, {r.start + in_off + in_len}): "
                        f"zstd frame does not decode ({e})"
                    ) from None
                if len(data) != out_len:
                    raise CorruptCheckpointError(
                        f"{self.storage.describe(r.file)} bytes [{r.start + in_off}, {r.start + in_off + in_len}): "
                        f"zstd frame decodes to {len(data)} bytes, expected {out_len}"
                    )
                view[base_out + out_off: base_out + out_off + out_len] = data

    def _staged(self, k: int, read_index: int, r: Read) -> torch.Tensor:
        lay = self.layouts[k]
        base = lay.decode[read_index] if r.zstd else lay.fetch[read_index]
        return self.arenas[k % 2][base: base + r.staging]

    def _post_exchange(self, k: int) -> tuple[list[Any], list[tuple[Message, torch.Tensor]]]:
        rnd = self.schedule[k]
        if not (rnd.sends or rnd.recvs):
            return [], []
        arena = self.arenas[k % 2]
        lay = self.layouts[k]
        reads = dict(rnd.reads)
        sends: list[P2P] = []
        for m in rnd.sends:
            staged = self._staged(k, m.read_index, reads[m.read_index])
            if not is_packed(m.copies):
                c = m.copies[0]
                payload = staged[c.offset: c.offset + c.length]
            else:
                base = lay.pack[(m.read_index, m.peer)]
                payload = pack_message(staged, m.copies, arena[base:])
            self.stats.bytes_sent += payload.numel()
            sends.append(P2P(m.peer, self._to_comm_device(payload), self.plan.reads[m.read_index].tag))
        recvs: list[P2P] = []
        landed: list[tuple[Message, torch.Tensor]] = []
        for m in rnd.recvs:
            base = lay.recv[(m.read_index, m.peer)]
            size = message_size(m.copies)
            buf = arena[base: base + size]
            if self.comm.device.type == "cuda":
                buf = torch.empty(size, dtype=torch.uint8, device=self.comm.device)
            self.stats.bytes_received += size
            recvs.append(P2P(m.peer, buf, self.plan.reads[m.read_index].tag))
            landed.append((m, buf))
        return self.comm.exchange(sends, recvs), landed

    def _to_comm_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.comm.device.type == "cuda":
            return t.to(self.comm.device, non_blocking=True)
        return t

    def _scatter_local(self, k: int) -> None:
        for i, r in self.schedule[k].reads:
            staged = self._staged(k, i, r)
            for c in r.copies:
                if c.target in self.dest.tensors:
                    self.dest.apply(staged[c.offset:], c)
                    self.stats.copies += 1

    def _scatter_received(self, landed: Sequence[tuple[Message, torch.Tensor]]) -> None:
        for m, buf in landed:
            unpack_message(buf, m.copies, self.dest)
            self.stats.copies += len(m.copies)

    # ------------------------------------------------------------------ driver

    def run(self) -> Stats:
        n = self.plan.num_rounds
        pending: cf.Future | None = None
        error: BaseException | None = None
        try:
            pending = self._submit(0) if n else None
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = e
        for k in range(n):
            current = pending
            pending = None
            if error is None:
                try:
                    if k + 1 < n:
                        pending = self._submit(k + 1)  # overlaps with everything below
                    if current is not None:
                        self.stats.requests += _result(current)
                    self._decode(k)
                except Exception as e:  # noqa: BLE001
                    error = e
            if isinstance(self.comm, GroupComm):
                try:
                    self.comm.agree(error)
                except BaseException:
                    self._drain(pending)
                    raise
            elif error is not None:
                self._drain(pending)
                raise error
            works, landed = self._post_exchange(k)
            with self._side_stream():
                self._scatter_local(k)
            self.comm.wait(works)
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream())  # received device buffers are ready
            with self._side_stream():
                self._scatter_received(landed)
            self._record(k)
            if self.progress is not None:
                self.progress(sum(r.length for _, r in self.schedule[k].reads))
        if self.cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        return self.stats

    def _side_stream(self) -> Any:
        """H2D copies into CUDA targets run on a side stream (no-op on CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _record(self, k: int) -> None:
        """Mark the end of round k's copies: its arena is reused only after them."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # also covers H2D of send payloads
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[k % 2] = ev

    @staticmethod
    def _drain(pending: cf.Future | None) -> None:
        if pending is not None:
            pending.cancel()
            try:
                pending.result(timeout=60)
            except BaseException:  # noqa: BLE001 - already failing
                pass


def _result(fut: cf.Future) -> int:
    """A round's reads; a data object the manifest lists but storage lacks is corruption."""
    try:
        return int(fut.result())
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{e}, but the checkpoint's manifest lists it (deleted or never uploaded)") from None
