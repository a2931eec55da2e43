"""Executing a ``LoadPlan`` on one rank: fetch, verify, decode, exchange, scatter.

Round k+1's range reads are in flight (fsspec's event loop thread, or a
thread pool for local files) while round k is decoded, exchanged with one
grouped send/recv and copied into targets. Staging lives in two arenas per
rank, allocated once at the size this rank's largest round needs (at most
half the memory budget each). A ``device`` stage owns the arenas and every
device-side rule: on CUDA they are pinned, each piece's span goes to the GPU
as raw bytes on a side stream and is viewed/permuted/cast there, and the
event recorded after a round gates its arena's reuse two rounds later; on CPU
the same steps are plain host copies. Every rank walks the same rounds, so the
grouped send/recv of a round cannot deadlock; failures are agreed on so that
one rank's error raises on all of them (see ``Executor``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import zstandard

from .comm import P2P, GroupComm, SoloComm
from .cudaapi import TorchCuda
from .device import Placement, finishing, place
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .plandata import ALIGN, Copy, LoadPlan, Read, is_packed, message_layout, message_size, messages_of
from .scatter import Destinations, message_pieces, pack_message, source_view, unpack_message
from .storage import RangeRead, Storage

log = logging.getLogger(__name__)

__all__ = [  # the scatter helpers live in scatter; importers may take them from here
    "Destinations", "Executor", "LocalRound", "Message", "Stats", "local_schedule", "message_pieces",
    "pack_message", "source_view", "unpack_message",
]


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


class Executor:
    """Runs one rank's schedule against storage and the process group.

    **No rank can deadlock, and every rank raises when one fails.** Every rank walks
    the same ``num_rounds`` (settled across ranks) and in round k posts exactly the
    send/recv pairs its schedule names, with sizes from the plan, whether or not it
    has failed: a failed rank stops fetching and scattering but keeps exchanging
    (whatever bytes its buffers hold). Failures are agreed on (one collective) before
    the exchange of every round k with ``k % agree_every == agree_every - 1`` and once
    after the last round; these rounds depend only on ``num_rounds`` and
    ``agree_every`` (1 when the group has a CPU backend, ``AGREE_EVERY_ON_GPU`` on an
    NCCL-only group, where each agreement costs a host sync), both the same on every
    rank. So every rank issues the same sequence of collectives and leaves it at the
    same agreement, all raising together; the only other exit is the backend itself
    failing (a peer died), which gloo reports on every survivor. A failure is seen at
    most ``agree_every`` rounds late; the targets of a failed load are unspecified.
    """

    def __init__(
        self,
        plan: LoadPlan,
        comm: SoloComm | GroupComm,
        storage: Storage,
        destinations: Destinations,
        *,
        progress: Callable[[int], None] | None = None,
        placement: Placement | None = None,
        agree_every: int | None = None,
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
        self.agree_every = max(1, agree_every or comm.agree_every)
        if placement is None:
            placement = place(TorchCuda(), list(destinations.tensors.values()), comm.data_device)
        self.placement = placement
        self.on_device = {uid for uid, t in destinations.tensors.items() if placement.is_device(t)}
        sizes = [max((lay.size for lay in self.layouts[slot::2]), default=0) for slot in range(2)]
        self.stats.staging_bytes = sum(sizes)
        if self.stats.staging_bytes > plan.options.memory_budget:
            log.warning(
                "rank %d stages %d bytes, above memory_budget=%d: a checksum chunk (or zstd frame) is staged "
                "whole, so the budget must hold about 4 chunks (the default chunk is 256 KiB)",
                self.rank, self.stats.staging_bytes, plan.options.memory_budget,
            )
        self.stage = placement.stage(sizes)
        self.arenas = self.stage.arenas
        self.views = [memoryview(a.numpy()) if a.numel() else memoryview(b"") for a in self.arenas]
        self.dctx = zstandard.ZstdDecompressor()

    # ------------------------------------------------------------- round steps

    def _fetch(self, k: int) -> cf.Future | None:
        """Start round k's reads into its arena (``stage.acquire`` was called for it)."""
        rnd = self.schedule[k]
        if not rnd.reads:
            return None
        lay = self.layouts[k]
        view = self.views[k % 2]
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
        on_device = self.placement.data_on_device
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
            if on_device:
                payload = self.stage.send_buffer(payload)  # type: ignore[union-attr]
            sends.append(P2P(m.peer, payload, self.plan.reads[m.read_index].tag))
        recvs: list[P2P] = []
        landed: list[tuple[Message, torch.Tensor]] = []
        for m in rnd.recvs:
            size = message_size(m.copies)
            if on_device:
                buf = self.stage.recv_buffer(size)  # type: ignore[union-attr]
            else:
                base = lay.recv[(m.read_index, m.peer)]
                buf = arena[base: base + size]
            recvs.append(P2P(m.peer, buf, self.plan.reads[m.read_index].tag))
            landed.append((m, buf))
        if on_device:
            self.stage.posted([s.tensor for s in sends], [r.tensor for r in recvs])  # type: ignore[union-attr]
        return self.comm.exchange(sends, recvs), landed

    def _split(self, buf: torch.Tensor, lo: int, hi: int, targets: Iterable[int]) -> tuple[Any, Any]:
        """``buf`` as (host view, device view) for the pieces in bytes [lo, hi) of it: each
        side exists only where a target needs it; a device view is indexed from ``lo``."""
        targets = set(targets)
        dev_side = bool(targets & self.on_device)
        host_side = bool(targets - self.on_device)
        if not self.placement.is_device(buf):
            return buf, (self.stage.upload(buf[lo:hi]) if dev_side else None, lo)
        return (self.stage.download(buf) if host_side else None), (buf[lo:], lo)

    def _apply(self, host: Any, dev: tuple[Any, int], offset: int, c: Copy) -> None:
        if c.target in self.on_device:
            base, lo = dev
            self.dest.apply(base[offset - lo:], c, self.stage)
        else:
            self.dest.apply(host[offset:], c, self.stage)
        self.stats.copies += 1

    def _scatter_local(self, k: int) -> None:
        for i, r in self.schedule[k].reads:
            mine = [c for c in r.copies if c.target in self.dest.tensors]
            if not mine:
                continue
            lo = min(c.offset for c in mine)
            hi = max(c.offset + c.length for c in mine)
            host, dev = self._split(self._staged(k, i, r), lo, hi, (c.target for c in mine))
            for c in mine:
                self._apply(host, dev, c.offset, c)

    def _scatter_received(self, landed: Sequence[tuple[Message, torch.Tensor]]) -> None:
        """Called once the round's receives have completed: only then do they count as received."""
        for m, buf in landed:
            self.stats.bytes_received += buf.numel()
            host, dev = self._split(buf, 0, buf.numel(), (c.target for c in m.copies))
            for o, c in message_pieces(m.copies):
                self._apply(host, dev, o, c)

    # ------------------------------------------------------------------ driver

    def run(self) -> Stats:
        if self.plan.num_rounds:  # the same on every rank
            self.comm.open_exchange()
        self.stage.begin()
        with finishing(self.stage):
            self._rounds()
        return self.stats

    def _rounds(self) -> None:
        n = self.plan.num_rounds
        error: BaseException | None = None
        pending: cf.Future | None = None
        if n:
            self.stage.acquire(0)
            try:
                pending = self._fetch(0)
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = e
        for k in range(n):
            current, pending = pending, None
            if k + 1 < n:
                self.stage.acquire((k + 1) % 2)  # before any write into that arena, reads or not
            if error is None:
                try:
                    if k + 1 < n:
                        pending = self._fetch(k + 1)  # overlaps with everything below
                    if current is not None:
                        self.stats.requests += _result(current)
                    self._decode(k)
                except Exception as e:  # noqa: BLE001
                    error = e
            if error is not None:
                self._drain(current)
                self._drain(pending)
                pending = None
            if k % self.agree_every == self.agree_every - 1:
                self._agree(error, pending)
            error = self._exchange_and_scatter(k, error, pending)
            if self.progress is not None and error is None:
                self.progress(sum(r.length for _, r in self.schedule[k].reads))
        self._agree(error, None)

    def _exchange_and_scatter(self, k: int, error: BaseException | None, pending: cf.Future | None) -> BaseException | None:
        """Round k's exchange (posted even after a failure, see the class doc) and scatter."""
        try:
            works, landed = self._post_exchange(k)
            if error is None:
                error = _attempt(lambda: self._scatter_local(k))
            self.comm.wait(works)
            if landed and self.placement.data_on_device:
                self.stage.received([buf for _, buf in landed])  # type: ignore[union-attr]
            if error is None:
                error = _attempt(lambda: self._scatter_received(landed))
            self.stage.release(k % 2)
        except BaseException:
            self._drain(pending)
            raise
        if error is not None:
            self._drain(pending)
        return error

    def _agree(self, error: BaseException | None, pending: cf.Future | None) -> None:
        try:
            self.comm.agree(error)
        except BaseException:
            self._drain(pending)
            raise

    @staticmethod
    def _drain(pending: cf.Future | None) -> None:
        if pending is not None:
            pending.cancel()
            try:
                pending.result(timeout=60)
            except BaseException:  # noqa: BLE001 - already failing
                pass


def _attempt(fn: Callable[[], None]) -> BaseException | None:
    """Run a local step; its failure is returned, to be agreed on with the other ranks."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _result(fut: cf.Future) -> int:
    """A round's reads; a data object the manifest lists but storage lacks is corruption."""
    try:
        return int(fut.result())
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{e}, but the checkpoint's manifest lists it (deleted or never uploaded)") from None
