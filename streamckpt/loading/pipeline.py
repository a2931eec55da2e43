"""Executing a ``LoadPlan`` on one rank: fetch, verify, decode, exchange, scatter.

Round k+1's range reads are in flight (on the storage event loop and its client
threads) while round k is decoded, exchanged with one grouped send/recv and copied
into targets. A read that serves only this rank lands straight in its host targets'
memory where its bytes are theirs as stored (``landing``), verified in place; what
is left of it, and every other read, lands in two staging arenas per rank,
allocated once at the size this rank's largest round needs (at most half the memory
budget each). A read's large contiguous pieces go to each peer as messages of their own,
sent from the staged read (``schedule.split_message``); a message that is one piece of a host
target, its bytes as the target holds them, is received straight into the target
(``landing``), taking no receive buffer. On the host
path each staged read is decoded and scattered as soon as it is verified, while the
round's other reads are still in flight. A ``device``
stage owns the arenas and every device-side rule: on CUDA they are pinned, each
piece's span goes to the GPU as raw bytes on a side stream and is
viewed/permuted/cast there, and the event recorded after a round gates its arena's
reuse two rounds later (the GPU path scatters per round); on CPU the same steps are
plain host copies. Every rank walks the same rounds, so the grouped send/recv of a
round cannot deadlock; failures are agreed on so that one rank's error raises on all
of them (see ``Executor``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import zstandard

from ..comm import P2P, GroupComm, SoloComm
from ..core.report import expect_total
from ..cuda.device import HostStage, Placement, Stage, finishing, place
from ..cuda.runtime import TorchCuda
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StagingMemoryError
from ..plan.data import Copy, LoadPlan, Read, is_packed, message_size
from ..storage import Landing, RangeRead, Storage
from .direct import DirectBatch
from .landing import plan_landings, receive_targets
from .requestrate import job_spread
from .scatter import Destinations, message_pieces, pack_message, source_view, unpack_message
from .schedule import Layout, LocalRound, Message, layout, local_schedule

log = logging.getLogger(__name__)

__all__ = [  # the scatter and schedule helpers live in scatter and schedule; importers may take them from here
    "Destinations", "Executor", "LocalRound", "Message", "Stats", "local_schedule", "message_pieces",
    "pack_message", "source_view", "unpack_message",
]
_layout = layout  # the name tests and older callers use


@dataclass(slots=True)
class Stats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    rounds: int = 0
    copies: int = 0
    staging_bytes: int = 0
    bytes_direct: int = 0  # fetched straight into this rank's targets (no staging copy)


class Executor:
    """Runs one rank's schedule against storage and the process group.

    **No rank can deadlock, and every rank raises when one fails.** Every rank walks
    the same ``num_rounds`` (settled across ranks) and in round k posts exactly the
    send/recv pairs its schedule names, with sizes from the plan, whether or not it
    has failed: a failed rank stops fetching and scattering but keeps exchanging
    (whatever bytes its buffers hold). Failures are agreed on (one collective) before
    the exchange of every round k with ``k % agree_every == agree_every - 1`` and once
    after the last round; these rounds depend only on ``num_rounds`` and
    ``agree_every`` (``AGREE_EVERY_ON_CPU`` when the group has a CPU backend, where each
    agreement is a barrier that leaves a CPU-bound reader idle; ``AGREE_EVERY_ON_GPU`` on an
    NCCL-only group, where each one also costs a host sync), both the same on every
    rank. So every rank issues the same sequence of collectives and leaves it at the
    same agreement, all raising together; the only other exit is the backend itself
    failing (a peer died), which gloo reports on every survivor. A failure is seen at
    most ``agree_every`` rounds late; the targets of a failed load are unspecified.

    Nothing that can fail locally runs between two agreements unguarded: the staging
    arenas (pinned, and on the NCCL plane the device exchange arenas, one per host arena
    and mirroring its message layout) are allocated in ``__init__`` and agreed on first
    thing in ``run``, before the first all-reduce of ``open_exchange``; a round's send and
    receive buffers are views of them, so posting an exchange allocates nothing, and
    every other step's failure is kept for the next agreement. An out-of-memory on one
    rank raises ``StagingMemoryError`` (its rank, memory and bytes) on every rank.
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
        self.spread = job_spread(comm.world_size, storage.max_concurrency)  # pieces per batch of reads
        self.storage = storage
        self.dest = destinations
        self.progress = progress
        self.rank = comm.rank
        self.schedule = local_schedule(plan, self.rank, plan.options.direct_message_bytes)
        # a progress display that shows a total: the bytes progress will count
        expect_total(progress, sum(r.length for rnd in self.schedule for _, r in rnd.reads))
        self.stats = Stats(rounds=plan.num_rounds)
        self.agree_every = max(1, agree_every or comm.agree_every)
        if placement is None:
            placement = place(TorchCuda(), list(destinations.tensors.values()), comm.data_device)
        self.placement = placement
        self.on_device = {uid for uid, t in destinations.tensors.items() if placement.is_device(t)}
        self.landings = plan_landings(self.schedule, destinations, self.on_device)
        self.recv_into = {} if placement.data_on_device else receive_targets(self.schedule, destinations, self.on_device)
        self.pure = {i for i, land in self.landings.items() if all(m is not None for _, _, m in land.spans)}
        self.fetched = [[(i, r) for i, r in rnd.reads if i not in self.pure] for rnd in self.schedule]
        self.direct = DirectBatch([(i, r) for rnd in self.schedule for i, r in rnd.reads if i in self.pure],
                                  self.landings, progress)
        self.layouts = [layout(r, self.landings, self.recv_into) for r in self.schedule]
        sizes = [max((lay.size for lay in self.layouts[slot::2]), default=0) for slot in range(2)]
        self.stats.staging_bytes = sum(sizes)
        if self.stats.staging_bytes > plan.options.memory_budget:
            log.warning(
                "rank %d stages %d bytes, above memory_budget=%d: a checksum chunk (or zstd frame) is staged "
                "whole, so the budget must hold about 4 chunks (the default chunk is 256 KiB)",
                self.rank, self.stats.staging_bytes, plan.options.memory_budget,
            )
        exchange = [max((_exchange_extent(r, lay) for r, lay in zip(self.schedule[slot::2], self.layouts[slot::2])),
                        default=0) for slot in range(2)]
        # a local failure here (an OOM above all) is agreed on first thing in run(): no other
        # rank may block in a collective this rank never reaches
        self.setup_error: BaseException | None = None
        try:
            self.stage: Stage = placement.stage(sizes, exchange)
        except Exception as e:  # noqa: BLE001 - agreed on in run()
            self.setup_error = _rank_error(e, self.rank)
            self.stage = HostStage([0, 0])
        self.arenas = self.stage.arenas
        self.kept: list[set[int]] = [set(), set()]  # per slot: relay offsets whose bytes ``keep`` put on the device
        self.views = [memoryview(a.numpy()) if a.numel() else memoryview(b"") for a in self.arenas]
        self.dctx = zstandard.ZstdDecompressor()
        # On the host path each read is decoded and scattered as soon as it is verified, while
        # the round's other reads are in flight; the GPU path keeps the per-round order.
        self.scatter_early = placement.device is None
        self.settled: list[set[int]] = [set(), set()]  # per arena: reads of its round already scattered
        self.landed: list[queue.SimpleQueue] = [queue.SimpleQueue(), queue.SimpleQueue()]

    # ------------------------------------------------------------- round steps

    def _fetch(self, k: int) -> cf.Future | None:
        """Start round k's reads into its arena and targets (``stage.acquire`` was called for it)."""
        reads = self.fetched[k]
        self.settled[k % 2] = set()
        if not reads:
            return None
        lay = self.layouts[k]
        view = self.views[k % 2]
        reqs = [RangeRead(r.file, r.start, r.stop, r.checks) for _, r in reads]
        bufs: list[memoryview | Landing] = []
        for i, r in reads:
            land = self.landings.get(i)
            if land is None:
                bufs.append(view[lay.fetch[i]: lay.fetch[i] + r.length])
                continue
            staged = iter(lay.spans[i])
            parts = []
            for lo, hi, mem in land.spans:
                if mem is None:
                    at = next(staged)[2]
                    mem = view[at: at + hi - lo]
                parts.append(mem)
            bufs.append(Landing(parts))
            self.stats.bytes_direct += land.direct_bytes
        self.stats.bytes_read += sum(r.length for _, r in reads)
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.landed[k % 2] = q
        fut = self.storage.read_into(reqs, bufs, on_landed=q.put, spread=self.spread)
        fut.add_done_callback(lambda _: q.put(None))
        return fut

    def _land(self, k: int, fut: cf.Future | None) -> int:
        """Wait for round k's reads; on the host path each read is decoded and scattered as
        soon as it is verified, so copies overlap the reads still in flight. Returns the
        round's request count (raising the reads' error)."""
        if fut is None:
            return 0
        q = self.landed[k % 2]
        reads = self.fetched[k]
        while True:
            j = q.get()
            if j is None:
                break
            if self.scatter_early:
                i, r = reads[j]
                if r.zstd:
                    self._decode_read(k, i, r)
                self._scatter_read(k, i, r)
                self.settled[k % 2].add(i)
        return _result(fut)

    def _decode(self, k: int) -> None:
        for i, r in self.schedule[k].reads:
            if r.zstd and i not in self.settled[k % 2]:
                self._decode_read(k, i, r)

    def _decode_read(self, k: int, i: int, r: Read) -> None:
        view = self.views[k % 2]
        lay = self.layouts[k]
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

    def _post_exchange(self, k: int, error: BaseException | None
                       ) -> tuple[list[Any], list[tuple[Message, torch.Tensor]], BaseException | None]:
        """Post round k's grouped send/recv: buffers are views of arenas allocated up front, so
        nothing here allocates; a failure filling them is returned (agreed on later) and the
        exchange is posted anyway, with sizes from the plan, as every peer expects."""
        rnd = self.schedule[k]
        if not (rnd.sends or rnd.recvs):
            return [], [], error
        slot = k % 2
        arena = self.arenas[slot]
        lay = self.layouts[k]
        reads = dict(rnd.reads)
        stage = self.stage
        on_device = self.placement.data_on_device
        sends: list[P2P] = []
        fills: list[tuple[Message, int, torch.Tensor]] = []
        for m in rnd.sends:
            at, n = _send_span(m, reads.get(m.read_index), lay)
            wire = stage.send_buffer(slot, at, n) if on_device else arena[at: at + n]  # type: ignore[union-attr]
            self.stats.bytes_sent += n
            sends.append(P2P(m.peer, wire, self.plan.reads[m.read_index].tag))
            fills.append((m, at, wire))
        recvs: list[P2P] = []
        landed: list[tuple[Message, torch.Tensor]] = []
        for m in rnd.recvs:
            size = message_size(m.copies)
            if on_device:
                buf = stage.recv_buffer(slot, lay.recv[m.key], size)  # type: ignore[union-attr]
            else:
                buf = self.recv_into.get(m.key)
                if buf is None:
                    buf = arena[lay.recv[m.key]: lay.recv[m.key] + size]
            recvs.append(P2P(m.peer, buf, self.plan.reads[m.read_index].tag))
            landed.append((m, buf))
        kept, self.kept[slot] = self.kept[slot], set()
        failed = self._attempt(lambda: self._fill_sends(k, fills, reads, kept))
        error = error or failed
        if not on_device:
            return self.comm.exchange(sends, recvs), landed, error
        wires = [s.tensor for s in sends], [r.tensor for r in recvs]
        if kept:  # NCCL must follow the side stream's keep copies
            works = stage.post_after_keep(*wires, lambda: self.comm.exchange(sends, recvs))  # type: ignore[union-attr]
            return works, landed, error
        stage.posted(*wires)  # type: ignore[union-attr]
        return self.comm.exchange(sends, recvs), landed, error

    def _fill_sends(self, k: int, fills: Sequence[tuple[Message, int, torch.Tensor]], reads: dict[int, Read],
                    kept: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Pack the round's packed messages in its arena; on the NCCL plane copy each message
        into its device send buffer, but for relayed ones already there (``kept``)."""
        arena = self.arenas[k % 2]
        packed: set[int] = set()
        for m, at, wire in fills:
            if is_packed(m.copies) and not m.relayed and at not in packed:  # a relayed read's pack is shared
                packed.add(at)
                pack_message(self._staged(k, m.read_index, reads[m.read_index]), m.copies, arena[at:])
            if self.placement.data_on_device and not (m.relayed and at in kept):
                self.stage.fill_send(wire, arena[at: at + wire.numel()])  # type: ignore[union-attr]

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
            if i not in self.settled[k % 2]:
                self._scatter_read(k, i, r)

    def _scatter_read(self, k: int, i: int, r: Read) -> None:
        """Read i's staged pieces into this rank's targets (its landed ones are there already)."""
        land = self.landings.get(i)
        if land is not None:
            arena = self.arenas[k % 2]
            spans = self.layouts[k].spans[i]
            for c in land.staged:
                if c.length <= 0 or c.target not in self.dest.tensors:
                    continue
                at = next(a + c.offset - lo for lo, hi, a in spans if lo <= c.offset and c.offset + c.length <= hi)
                self._apply(arena, (None, 0), at, c)
            return
        mine = [c for c in r.copies if c.target in self.dest.tensors]
        if not mine:
            return
        lo = min(c.offset for c in mine)
        hi = max(c.offset + c.length for c in mine)
        host, dev = self._split(self._staged(k, i, r), lo, hi, (c.target for c in mine))
        for c in mine:
            self._apply(host, dev, c.offset, c)

    def _scatter_received(self, landed: Sequence[tuple[Message, torch.Tensor]]) -> None:
        """Called once the round's receives have completed: only then do they count as received."""
        for m, buf in landed:
            self.stats.bytes_received += buf.numel()
            if m.key in self.recv_into:
                continue  # received straight into its target
            host, dev = self._split(buf, 0, buf.numel(), (c.target for c in m.copies))
            for o, c in message_pieces(m.copies):
                self._apply(host, dev, o, c)

    def _keep_relayed(self, k: int, landed: Sequence[tuple[Message, torch.Tensor]]) -> None:
        """Relayed pieces this rank sends in round k + 1 (``routes.read_links``), received or sent
        in round k, go into that round's relay buffer: round k's arena is reused two rounds
        on, and the next round's was acquired before this round's exchange. On the NCCL plane
        they stay on the device: copied into the next round's send buffer (``DeviceStage.keep``),
        never downloaded to the host and uploaded again."""
        nxt = (k + 1) % 2
        device = self.placement.data_on_device
        for m, buf in landed:
            if m.keep:
                at = self.layouts[k + 1].relay[m.read_index]
                if device:
                    self.stage.keep(self.stage.send_buffer(nxt, at, buf.numel()), buf)  # type: ignore[union-attr]
                    self.kept[nxt].add(at)
                else:
                    self.arenas[nxt][at: at + buf.numel()].copy_(buf)
        rnd = self.schedule[k]
        if rnd.carry:  # sent this round (from the staged read, a pack or a relay buffer) and again next round
            reads = dict(rnd.reads)
            arena = self.arenas[k % 2]
            for i in rnd.carry:
                m = next(m for m in rnd.sends if m.read_index == i)
                src, n = _send_span(m, reads.get(i), self.layouts[k])
                at = self.layouts[k + 1].relay[i]
                if device:  # from this round's send buffer, filled or kept on the device
                    self.stage.keep(self.stage.send_buffer(nxt, at, n),  # type: ignore[union-attr]
                                    self.stage.send_buffer(k % 2, src, n))  # type: ignore[union-attr]
                    self.kept[nxt].add(at)
                else:
                    self.arenas[nxt][at: at + n].copy_(arena[src: src + n])

    def _attempt(self, fn: Callable[[], None]) -> BaseException | None:
        """Run a local step; its failure is returned, to be agreed on with the other ranks (an
        out-of-memory as a ``StagingMemoryError`` naming this rank)."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            if isinstance(e, (StagingMemoryError, torch.OutOfMemoryError)):
                return _rank_error(e, self.rank)
            return e
        return None

    # ------------------------------------------------------------------ driver

    def run(self) -> Stats:
        self.comm.agree(self.setup_error)  # before any collective a failed rank would not join
        if self.plan.num_rounds:  # the same on every rank
            self.comm.open_exchange()
        self.stage.begin()
        try:
            with finishing(self.stage, hold=list(self.dest.tensors.values())):
                self._rounds()
        except BaseException:
            self.direct.drain(self.storage)  # nothing may write into targets once load has raised
            raise
        return self.stats

    def _start_direct(self) -> None:
        """Start the reads that land wholly in targets, with the budget the arenas leave unused."""
        spare = self.plan.options.memory_budget - self.stats.staging_bytes
        self.stats.bytes_read += self.direct.nbytes
        self.stats.bytes_direct += sum(self.landings[i].direct_bytes for i, _ in self.direct.reads)
        self.direct.start(self.storage, max(1, min(spare, self.storage.inflight_bytes)), self.spread)

    def _rounds(self) -> None:
        n = self.plan.num_rounds
        error: BaseException | None = None
        pending: cf.Future | None = None
        if n:
            self.stage.acquire(0)
            try:
                self._start_direct()
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
                    self.stats.requests += self._land(k, current)
                    self._decode(k)
                    self.direct.poll()
                except Exception as e:  # noqa: BLE001
                    error = _result_error(e)
            if error is not None:
                self._drain(current)
                self._drain(pending)
                self.direct.drain(self.storage)
                pending = None
            if k % self.agree_every == self.agree_every - 1:
                self._agree(error, pending)
            error = self._exchange_and_scatter(k, error, pending)
            staged = sum(r.length for i, r in self.schedule[k].reads if i not in self.pure)
            if self.progress is not None and error is None and staged:
                self.progress(staged)
        if error is None:
            try:
                self.stats.requests += self.direct.finish()
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = _result_error(e)
        self._agree(error, None)

    def _exchange_and_scatter(self, k: int, error: BaseException | None, pending: cf.Future | None) -> BaseException | None:
        """Round k's exchange (posted even after a failure, see the class doc) and scatter."""
        try:
            works, landed, error = self._post_exchange(k, error)
            if error is None:
                error = self._attempt(lambda: self._scatter_local(k))
            if works and self.placement.data_on_device:  # work.wait() with the side stream current
                bufs = [buf for _, buf in landed]
                self.stage.received(lambda: self.comm.wait(works), bufs)  # type: ignore[union-attr]
            else:
                self.comm.wait(works)
            if error is None:
                error = self._attempt(lambda: self._scatter_received(landed))
            if error is None:
                error = self._attempt(lambda: self._keep_relayed(k, landed))
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

    def _drain(self, pending: cf.Future | None) -> None:
        if pending is not None:
            self.storage.stop(pending)


def _send_span(m: Message, r: Read | None, lay: Layout) -> tuple[int, int]:
    """Where message ``m`` sits in its round's arena, and its length: a relayed one in its relay
    buffer, a packed one in its pack buffer, else the copy's bytes in the staged read (decoded
    bytes for zstd)."""
    if m.relayed:
        return lay.relay[m.read_index], message_size(m.copies)
    if r is None:
        raise CheckpointError(f"internal: a message of read {m.read_index} has no staged read to send from")
    if is_packed(m.copies):
        return lay.pack[m.key], message_size(m.copies)
    c = m.copies[0]
    base = lay.decode[m.read_index] if r.zstd else lay.fetch[m.read_index]
    return base + c.offset, c.length


def _exchange_extent(rnd: LocalRound, lay: Layout) -> int:
    """Bytes of a round's arena its messages span: its device exchange arena mirrors them."""
    reads = dict(rnd.reads)
    ends = [sum(_send_span(m, reads.get(m.read_index), lay)) for m in rnd.sends]
    ends += [lay.recv[m.key] + message_size(m.copies) for m in rnd.recvs if m.key in lay.recv]
    return max(ends, default=0)


def _rank_error(e: BaseException, rank: int) -> BaseException:
    """A local failure as every rank will see it: a ``CheckpointError`` naming this rank."""
    if isinstance(e, StagingMemoryError):
        out: BaseException = StagingMemoryError(f"rank {rank} {e}")
    elif isinstance(e, torch.OutOfMemoryError):
        first = str(e).splitlines()[0][:300] if str(e) else ""
        out = StagingMemoryError(f"rank {rank} ran out of memory ({first}); lower memory_budget or free memory")
    elif isinstance(e, CheckpointError):
        return e
    else:
        out = CheckpointError(f"rank {rank} could not set up its load ({type(e).__name__}: {e})")
    out.__cause__ = e
    return out




def _result(fut: cf.Future) -> int:
    """A round's reads; a data object the manifest lists but storage lacks is corruption."""
    try:
        return int(fut.result())
    except CheckpointNotFoundError as e:
        raise _result_error(e) from None


def _result_error(e: BaseException) -> BaseException:
    if isinstance(e, CheckpointNotFoundError):
        return CorruptCheckpointError(f"{e}, but the checkpoint's manifest lists it (deleted or never uploaded)")
    return e
