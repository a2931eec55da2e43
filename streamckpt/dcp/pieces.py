"""Where a DCP read item's bytes lie: stored pieces, the reads (units) that cover them, the
spans of one file joined into one request, and the landing of bytes straight into targets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import zstandard
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..core import dtypes, manifest as mf
from ..core.regions import Box, flat_range_boxes, runs
from ..errors import CorruptCheckpointError
from ..formats import speculation as spec
from ..formats.dcpmeta import DcpMetadata, DcpTensor, ItemInfo
from ..storage import Landing, RangeRead, Storage
from .common import GAP_BYTES


@dataclass(frozen=True, slots=True)
class Piece:
    """One DCP chunk: a box stored contiguously in a shard, from raw byte ``raw_base`` on."""

    key: str
    shard: mf.Shard
    box: Box
    raw_base: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Unlocated:
    """A DCP chunk whose tensor bytes are not located yet (``StorageReader._locate``)."""

    key: str
    box: Box
    tensor: DcpTensor
    item: ItemInfo


@dataclass(slots=True)
class Unit:
    """A fetched span of one shard's raw bytes ``[raw_lo, raw_hi)`` (decoded when zstd)."""

    raw_lo: int
    raw_hi: int
    read: RangeRead
    frames: tuple[int, ...] = ()  # raw length of each zstd frame; empty: stored bytes are raw
    data: Any = None


def pieces_of(key: str, shard: mf.Shard, dtype: str) -> list[Piece]:
    """A shard as DCP chunks: its box, or the contiguous boxes of its flat range."""
    if shard.flat_range is None:
        return [Piece(key, shard, shard.box, 0, dtype)]
    lo, hi = shard.flat_range
    size = dtypes.itemsize(dtype)
    return [Piece(key, shard, box, (start - lo) * size, dtype) for start, box in flat_range_boxes(shard.box, lo, hi)]


@dataclass(slots=True)
class Want:
    """One read item: its stored piece, the raw byte runs of its sub-box, its target."""

    req: ReadItem
    piece: Piece
    runs: list[tuple[int, int]]  # (raw start, length) in the piece's shard
    target: torch.Tensor
    landed: bool = False  # read straight into ``target``


def want_of(req: ReadItem, p: Piece, planner: LoadPlanner) -> Want:
    sub = Box(tuple(o + s for o, s in zip(p.box.offset, req.storage_offsets)), tuple(req.lengths))
    byte_runs = [(p.raw_base + s * p.itemsize, n * p.itemsize) for s, n in runs(p.box, sub) if n]
    return Want(req, p, byte_runs, planner.resolve_tensor(req).detach())


def direct_memory(w: Want) -> memoryview | None:
    """The target's memory, when the item's one run can land in it as stored."""
    t = w.target
    if len(w.runs) != 1 or t.device.type != "cpu" or not t.is_contiguous() or \
            t.dtype != dtypes.to_torch(w.piece.dtype) or t.numel() * t.element_size() != w.runs[0][1]:
        return None
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def landing_of(u: Unit, wants: list[Want]) -> Landing | None:
    """The unit's bytes straight into its items' targets (scratch between them), when every
    item inside it can take its bytes directly and none overlaps another; else None."""
    if u.frames:
        return None
    inside = sorted((w for w in wants if w.runs and u.raw_lo <= w.runs[0][0] < u.raw_hi), key=lambda w: w.runs[0][0])
    mems = [direct_memory(w) for w in inside]
    if not inside or any(m is None for m in mems):
        return None
    parts: list[memoryview] = []
    pos = u.raw_lo
    for w, mem in zip(inside, mems):
        a, n = w.runs[0]
        if a < pos or a + n > u.raw_hi:
            return None
        if a > pos:
            parts.append(memoryview(bytearray(a - pos)))
        parts.append(mem)
        pos = a + n
    if pos < u.raw_hi:
        parts.append(memoryview(bytearray(u.raw_hi - pos)))
    for w in inside:
        w.landed = True
    return Landing(parts)


def check_parts(c: spec.Checked) -> set[tuple[str, str]]:
    """The parts of a check this batch compares: its head (its chunk is read), its tail (the
    previous chunk is read). A part verified for one chunk says nothing of the other's."""
    return {(c.head.name, part) for part, on in (("head", c.check_head), ("tail", c.check_tail)) if on}


@dataclass(slots=True)
class Span:
    """Bytes ``[start, stop)`` of file ``name`` and the buffers that take them, in order."""

    name: str
    start: int
    stop: int
    parts: list[memoryview]


def joined(spans: list[Span], gap: int) -> list[Span]:
    """Spans of one file that follow each other within ``gap`` bytes as one (scratch for the
    gaps); overlapping ones stay apart. A span at byte 0 is not extended: a read from 0 may
    be the whole object and is then one request, not parallel pieces (``storage.reads``)."""
    out: list[Span] = []
    for sp in sorted(spans, key=lambda x: (x.name, x.start)):
        last = out[-1] if out else None
        if last is None or last.name != sp.name or last.start == 0 or not 0 <= sp.start - last.stop <= gap:
            out.append(Span(sp.name, sp.start, sp.stop, list(sp.parts)))
            continue
        if sp.start > last.stop:
            last.parts.append(memoryview(bytearray(sp.start - last.stop)))
        last.parts.extend(sp.parts)
        last.stop = sp.stop
    return out


def dcp_pieces(md: DcpMetadata, guessed: dict[str, mf.TensorMeta] | None) -> dict[str, list[Piece | Unlocated]]:
    """Each DCP tensor's chunks: at their predicted (or exactly located) shards, else unlocated."""
    out: dict[str, list[Piece | Unlocated]] = {}
    for key, t in md.tensors.items():
        if guessed is not None:  # guess_tensors keeps the order of the chunks
            out[key] = [Piece(key, sh, sh.box, 0, t.dtype) for sh in guessed[key].shards]
        else:
            out[key] = [Unlocated(key, Box(tuple(o), tuple(z)), t, item) for o, z, item in t.chunks]
    return out


def merged_spans(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted spans with overlaps (and gaps up to ``gap``) merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def units_of(shard: mf.Shard, itemsize: int, spans: list[tuple[int, int]]) -> list[Unit]:
    """The reads that cover the raw byte ``spans`` of one shard: exact ranges when the shard
    has no checksums, else the whole chunks (zstd frames) covering them, with their CRC32C."""
    spans = [(a, b) for a, b in spans if b > a]
    if shard.chunk_size == 0:
        return [Unit(a, b, RangeRead(shard.file, shard.byte_offset + a, shard.byte_offset + b))
                for a, b in merged_spans(spans, GAP_BYTES)]
    cs, crcs = shard.chunk_size, shard.crc32c or ()
    raw_total = shard.numel * itemsize
    chunks = merged_spans([(a // cs, -(-b // cs)) for a, b in spans], 0)
    starts = shard.frame_offsets()
    out = []
    for c0, c1 in chunks:
        lo = starts[c0]
        hi = starts[c1 - 1] + (shard.frame_lengths[c1 - 1] if shard.frame_lengths else
                               min(cs, raw_total - (c1 - 1) * cs))
        checks = tuple((starts[c] - lo, (shard.frame_lengths[c] if shard.frame_lengths else
                                         min(cs, raw_total - c * cs)), crcs[c]) for c in range(c0, c1))
        frames = tuple(min(cs, raw_total - c * cs) for c in range(c0, c1)) if shard.codec == "zstd" else ()
        out.append(Unit(c0 * cs, min(c1 * cs, raw_total), RangeRead(shard.file, lo, hi, checks), frames))
    return out


def decode(u: Unit, buf: bytearray, storage: Storage) -> Any:
    """A fetched unit's raw bytes: as read, or its zstd frames decoded (each to its exact size)."""
    if not u.frames:
        return memoryview(buf)
    dctx = zstandard.ZstdDecompressor()
    out = bytearray()
    for (off, length, _crc), raw_len in zip(u.read.checks, u.frames):
        where = f"{storage.describe(u.read.name)} bytes [{u.read.start + off}, {u.read.start + off + length})"
        try:
            data = dctx.decompress(bytes(buf[off:off + length]), max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{where}: zstd frame does not decode ({e})") from None
        if len(data) != raw_len:
            raise CorruptCheckpointError(f"{where}: zstd frame decodes to {len(data)} bytes, expected {raw_len}")
        out += data
    return memoryview(out)
