"""The load planner: pure, deterministic, the same on every rank.

Inputs: the checkpoint's ``Manifest``, every rank's ``TargetSpec`` list and a
name ``View`` (transforms or identity). Output: a ``LoadPlan`` — the storage
reads (file byte ranges, checksums to verify, zstd frames to decode), which
rank performs each read, which strided copies each read feeds into which
targets, and the round each read belongs to so that every rank's staging stays
within its memory budget. No I/O, no torch.distributed.

Steps: deduplicate identical targets across ranks (a DP replica group plans a
box once); map each target box through the view to source boxes; intersect
those with stored shards through a per-tensor index sorted on dim 0; turn each
intersection into pieces whose byte span is bounded; widen pieces to checksum
chunks / zstd frames; coalesce per file; assign each read to the least-loaded
rank needing it; pack reads into rounds.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

from . import dtypes
from .errors import IncompatibleStateDictError, TransformError
from .manifest import Manifest, Shard
from .regions import (
    Box,
    CoalesceOptions,
    coalesce,
    cut_pieces,
    flat_range_boxes,
    intersect,
    max_gap,
    row_major_strides,
    span,
    split_aligned,
)
from .targets import TargetSpec

log = logging.getLogger(__name__)

ALIGN = 64  # staging and message layouts place every piece at a multiple of this


@dataclass(frozen=True, slots=True)
class PlanOptions:
    memory_budget: int = 256 << 20
    max_gap_bytes: int = 1 << 20
    max_request_bytes: int = 16 << 20
    read_once: bool = True

    @property
    def round_cap(self) -> int:
        """Bytes one round may stage per rank: two rounds are alive at once."""
        return max(1, self.memory_budget // 2)

    @property
    def max_piece_bytes(self) -> int:
        return max(4096, min(self.max_request_bytes, self.round_cap // 3))


# ------------------------------------------------------------------ the view


@dataclass(frozen=True, slots=True)
class Segment:
    """Part of a target box that comes from one source tensor box."""

    source_key: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None = None


class ViewLike(Protocol):
    tensors: Mapping[str, Any]  # name -> object with .shape, .dtype, .source_dtype

    def map_box(self, name: str, box: Box) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class _IdentityTensor:
    shape: tuple[int, ...]
    dtype: str
    source_dtype: str


class IdentityView:
    """Checkpoint names as they are: every target box maps to itself."""

    def __init__(self, manifest: Manifest) -> None:
        self.tensors = {k: _IdentityTensor(t.shape, t.dtype, t.dtype) for k, t in manifest.tensors.items()}
        self.transformed = False

    def map_box(self, name: str, box: Box) -> list[Segment]:
        return [Segment(name, box, box, None)]


# ------------------------------------------------------------------ plan data


@dataclass(slots=True)
class Target:
    """A distinct target region and the ranks that hold it."""

    spec: TargetSpec
    needers: list[int]


@dataclass(slots=True, eq=False)
class Copy:
    """One strided copy from a staged byte span into one target.

    Source: ``length`` bytes at ``offset`` of the read's staging buffer, viewed as
    ``src_dtype`` with ``src_shape``/``src_strides`` (elements). Destination: the
    box ``dst_box`` (relative to the destination frame) of target ``target``; the
    frame is the target's local tensor itself when ``dst_base`` is None, else the
    contiguous sub-box ``dst_frame`` at element ``dst_base`` of a 1-D local tensor.
    ``perm`` permutes source dims into target order.
    """

    target: int
    offset: int
    length: int
    src_dtype: str
    src_shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_box: Box
    dst_base: int | None = None
    dst_frame: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Chunks ``[lo, hi)`` of one stored shard inside a read (checked, maybe decoded)."""

    shard: Shard
    raw_total: int  # raw bytes of the whole shard
    lo: int
    hi: int
    file_start: int  # file offset of chunk ``lo``
    out_start: int  # decoded offset of chunk ``lo`` in the staging buffer (zstd)

    def raw_len(self, c: int) -> int:
        return min(self.shard.chunk_size, self.raw_total - c * self.shard.chunk_size)


@dataclass(slots=True)
class Read:
    """One range request and what its bytes are for.

    Checksums and zstd frames are kept as chunk runs and expanded only by the
    rank that performs the read, so planning stays O(pieces), not O(chunks).
    """

    file: str
    start: int
    stop: int
    reader: int
    runs: tuple[ChunkRun, ...]
    zstd: bool
    staging: int  # bytes of the decoded staging buffer
    copies: list[Copy]
    private: bool = False  # read_once=False: serves only its reader
    round: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def checks(self) -> tuple[tuple[int, int, int], ...]:
        """(offset from ``start``, stored length, CRC32C) of every covered chunk."""
        out = []
        for run in self.runs:
            s = run.shard
            pos = run.file_start - self.start
            for c in range(run.lo, run.hi):
                n = s.frame_lengths[c] if s.frame_lengths is not None else run.raw_len(c)
                out.append((pos, n, s.crc32c[c]))  # type: ignore[index]
                pos += n
        return tuple(out)

    @property
    def frames(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """zstd: (in_off, in_len, out_off, out_len) of every frame to decode; None for raw."""
        if not self.zstd:
            return None
        out = []
        for run in self.runs:
            s = run.shard
            pos = run.file_start - self.start
            dst = run.out_start
            for c in range(run.lo, run.hi):
                n = s.frame_lengths[c]  # type: ignore[index]
                raw = run.raw_len(c)
                out.append((pos, n, dst, raw))
                pos += n
                dst += raw
        return tuple(out)


@dataclass(slots=True)
class LoadPlan:
    world_size: int
    targets: list[Target]
    reads: list[Read]
    num_rounds: int
    rank_targets: list[list[int]]  # per rank: target id of each of its specs, -1 if missing
    missing: list[list[str]]  # per rank
    unexpected: list[str]
    options: PlanOptions = field(default_factory=PlanOptions)

    def needers_of(self, copy: Copy) -> list[int]:
        return self.targets[copy.target].needers


# ------------------------------------------------------------------ the index


@dataclass(frozen=True, slots=True)
class _SourcePart:
    """A box of a stored shard, contiguous in a frame of the shard's raw bytes."""

    box: Box
    frame: Box
    base: int  # element offset of the frame's first element in the shard's raw bytes
    shard: Shard


class _TensorIndex:
    """Source parts of one tensor sorted by dim-0 start for range queries."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        parts: list[_SourcePart] = []
        for s in shards:
            if s.flat_range is None:
                if not s.box.is_empty():
                    parts.append(_SourcePart(s.box, s.box, 0, s))
            else:
                for flat_start, b in flat_range_boxes(s.box, *s.flat_range):
                    parts.append(_SourcePart(b, b, flat_start - s.flat_range[0], s))
        self.scalar = bool(parts) and parts[0].box.ndim == 0
        parts.sort(key=lambda p: p.box.offset[0] if p.box.ndim else 0)
        self.parts = parts
        self.starts = [p.box.offset[0] if p.box.ndim else 0 for p in parts]
        self.max_extent = max((p.box.shape[0] if p.box.ndim else 1 for p in parts), default=0)
        # shards grouped by box, flat ranges sorted: the flat fast path's 1-D lookups
        groups: dict[Box, list[Shard]] = {}
        for s in shards:
            groups.setdefault(s.box, []).append(s)
        self.boxes: list[tuple[Box, list[int], list[Shard]]] = []
        for b, group in groups.items():
            group.sort(key=lambda sh: sh.flat_range[0] if sh.flat_range else 0)
            self.boxes.append((b, [sh.flat_range[1] if sh.flat_range else math.prod(b.shape) for sh in group], group))
        self.boxes.sort(key=lambda x: x[0].offset[0] if x[0].ndim else 0)

    def shards_in_rows(self, band: Box, r0: int, r1: int, lo: int, hi: int) -> Iterable[Shard]:
        """Shards whose box meets rows ``[r0, r1)`` of the row band ``band`` and whose
        elements, in the band's flattening, meet ``[lo, hi)``. A shard whose box is not
        a row band like ``band`` is yielded as is (the caller falls back)."""
        inner = math.prod(band.shape[1:])
        for b, stops, group in self.boxes:
            if not b.ndim or b.offset[0] >= r1 or b.offset[0] + b.shape[0] <= r0:
                continue
            if b.offset[1:] != band.offset[1:] or b.shape[1:] != band.shape[1:]:
                yield group[0]
                continue
            d = (b.offset[0] - band.offset[0]) * inner
            i = bisect.bisect_right(stops, lo - d)  # first shard ending after lo
            for sh in group[i:]:
                start = sh.flat_range[0] if sh.flat_range else 0
                if start + d >= hi:
                    break
                yield sh

    def query(self, box: Box) -> Iterable[_SourcePart]:
        if self.scalar or not box[1]:
            yield from self.parts
            return
        q0 = box[0][0]
        q1 = q0 + box[1][0]
        lo = bisect.bisect_left(self.starts, q0 - self.max_extent + 1)
        hi = bisect.bisect_left(self.starts, q1)
        for p in self.parts[lo:hi]:
            pb = p.box
            if pb[0][0] + pb[1][0] > q0 and intersect(pb, box) is not None:
                yield p


# ------------------------------------------------------------------ planning


@dataclass(slots=True)
class _Need:
    """A byte span of a shard that one copy needs, before coalescing."""

    file: str
    fetch_start: int
    fetch_stop: int
    shard: Shard
    chunk_lo: int  # first chunk/frame index (or -1 without chunks)
    chunk_hi: int
    raw_start: int  # byte offset of the span in the shard's raw bytes
    copy: Copy  # offset field is relative to the span start until placed
    owner: int  # rank for read_once=False; -1 otherwise
    raw_total: int = 0  # raw (decoded) bytes of the whole shard


def build_plan(
    manifest: Manifest,
    targets_by_rank: Sequence[Sequence[TargetSpec]],
    options: PlanOptions = PlanOptions(),
    view: ViewLike | None = None,
) -> LoadPlan:
    """Plan a load of every rank's targets from ``manifest``."""
    view = view or IdentityView(manifest)
    world = len(targets_by_rank)
    targets, rank_targets = _dedupe(targets_by_rank)
    missing: list[list[str]] = [[] for _ in range(world)]
    live: list[int] = []
    for uid, t in enumerate(targets):
        vt = view.tensors.get(t.spec.key)
        if vt is None:
            for r in t.needers:
                missing[r].append(t.spec.key)
            continue
        _check_target(t.spec, vt, getattr(view, "transformed", True), t.needers)
        live.append(uid)
    for r in range(world):
        rank_targets[r] = [
            uid if view.tensors.get(targets[uid].spec.key) is not None else -1 for uid in rank_targets[r]
        ]
    wanted = {targets[u].spec.key for u in live}
    unexpected = sorted(k for k in view.tensors if k not in wanted)

    indexes: dict[str, _TensorIndex] = {}
    offsets = _FrameOffsets()
    needs: list[_Need] = []
    for uid in live:
        owners = targets[uid].needers if not options.read_once else [-1]
        for need in _needs_for_target(uid, targets[uid].spec, view, manifest, indexes, options, offsets):
            if len(owners) == 1:
                need.owner = owners[0]
                needs.append(need)
            else:
                for o in owners:
                    needs.append(_Need(need.file, need.fetch_start, need.fetch_stop, need.shard,
                                       need.chunk_lo, need.chunk_hi, need.raw_start, _fresh(need.copy), o,
                                       need.raw_total))
    targets_needers = [tuple(t.needers) for t in targets]
    reads = _coalesce(needs, options, offsets, targets_needers)
    _assign_readers(reads, needs_world=world, targets=targets, read_once=options.read_once)
    num_rounds = _pack_rounds(reads, targets, world, options)
    return LoadPlan(world, targets, reads, num_rounds, rank_targets, missing, unexpected, options)


def _dedupe(targets_by_rank: Sequence[Sequence[TargetSpec]]) -> tuple[list[Target], list[list[int]]]:
    uid_of: dict[TargetSpec, int] = {}
    targets: list[Target] = []
    rank_targets: list[list[int]] = []
    for r, specs in enumerate(targets_by_rank):
        mine = []
        for s in specs:
            uid = uid_of.get(s)
            if uid is None:
                uid = uid_of[s] = len(targets)
                targets.append(Target(s, []))
            if not targets[uid].needers or targets[uid].needers[-1] != r:
                targets[uid].needers.append(r)
            mine.append(uid)
        rank_targets.append(mine)
    return targets, rank_targets


def _check_target(spec: TargetSpec, vt: Any, transformed: bool, needers: Sequence[int] = ()) -> None:
    err = TransformError if transformed else IncompatibleStateDictError
    who = f" (rank {', '.join(map(str, needers[:8]))}{', ...' if len(needers) > 8 else ''})" if len(needers) else ""
    if tuple(vt.shape) != tuple(spec.global_shape):
        raise err(
            f"{spec.key}: checkpoint{' (after transforms)' if transformed else ''} has shape "
            f"{list(vt.shape)}, the state_dict{who} expects global shape {list(spec.global_shape)}"
        )
    if vt.dtype != spec.dtype:
        raise err(
            f"{spec.key}: checkpoint{' (after transforms)' if transformed else ''} has dtype {vt.dtype}, "
            f"the state_dict{who} has {spec.dtype}; add a 'cast' transform to convert on load"
        )


def _target_parts(spec: TargetSpec) -> list[tuple[Box, int | None, tuple[int, ...] | None]]:
    """(global box, dst_base, dst_frame) of each contiguous part of a target."""
    if spec.flat_range is None:
        return [] if spec.box.is_empty() else [(spec.box, None, None)]
    return [
        (b, flat_start - spec.flat_range[0], b.shape)
        for flat_start, b in flat_range_boxes(spec.box, *spec.flat_range)
    ]


def _needs_for_target(
    uid: int, spec: TargetSpec, view: ViewLike, manifest: Manifest,
    indexes: dict[str, _TensorIndex], options: PlanOptions, offsets: "_FrameOffsets",
) -> Iterable[_Need]:
    if spec.flat_range is not None and _is_identity(view, spec.key):
        meta = manifest.tensors[spec.key]
        index = indexes.get(spec.key)
        if index is None:
            index = indexes[spec.key] = _TensorIndex(meta.shards)
        fast = _flat_fast_path(uid, spec, meta.dtype, index, options, offsets)
        if fast is not None:
            yield from fast
            return
    for part_box, dst_base, dst_frame in _target_parts(spec):
        frame_origin = part_box.offset if dst_base is not None else spec.offset
        for seg in view.map_box(spec.key, part_box):
            meta = manifest.tensors.get(seg.source_key)
            if meta is None:
                raise TransformError(f"{spec.key}: source tensor {seg.source_key!r} is not in the checkpoint")
            index = indexes.get(seg.source_key)
            if index is None:
                index = indexes[seg.source_key] = _TensorIndex(meta.shards)
            isz = dtypes.itemsize(meta.dtype)
            max_elems = max(1, options.max_piece_bytes // isz)
            for sp in index.query(seg.source_box):
                inter = intersect(sp.box, seg.source_box) if sp.box.ndim else sp.box
                if inter is None:
                    continue
                align = sp.shard.chunk_size // isz if sp.shard.chunk_size % isz == 0 else 0
                max_e = max(max_elems, align)
                for piece in _pieces(sp.frame, inter, options.max_gap_bytes // isz, max_e, sp.base, align):
                    yield _need(uid, piece, sp, seg, meta.dtype, isz, frame_origin, dst_base, dst_frame, offsets)


def _is_identity(view: ViewLike, name: str) -> bool:
    if isinstance(view, IdentityView):
        return True
    check = getattr(view, "is_identity", None)
    return bool(check(name)) if check is not None else False


def _pieces(frame: Box, inter: Box, gap_elems: int, max_elems: int, base: int, align: int) -> Iterable[Box]:
    """Cut an intersection where gaps are too wide, then bound each span (on chunk boundaries)."""
    cut = 0
    while cut < inter.ndim - 1 and max_gap(frame, inter, cut) > gap_elems:
        cut += 1
    for p in cut_pieces(frame, inter, cut):
        yield from split_aligned(frame, p, max_elems, base, align)


def _map_to_target(seg: Segment, box: Box) -> Box:
    if seg.perm is None:
        delta = [t - s for t, s in zip(seg.target_box.offset, seg.source_box.offset)]
        return box.shifted(delta)
    offset = tuple(
        seg.target_box.offset[d] + box.offset[p] - seg.source_box.offset[p] for d, p in enumerate(seg.perm)
    )
    return Box(offset, tuple(box.shape[p] for p in seg.perm))


def _need(
    uid: int, piece: Box, sp: _SourcePart, seg: Segment, src_dtype: str, isz: int,
    frame_origin: tuple[int, ...], dst_base: int | None, dst_frame: tuple[int, ...] | None,
    offsets: "_FrameOffsets",
) -> _Need:
    first, stop = span(sp.frame, piece) if piece.ndim else (0, 1)
    raw_start = (sp.base + first) * isz
    raw_stop = (sp.base + stop) * isz
    tbox = _map_to_target(seg, piece)
    copy = Copy(
        target=uid,
        offset=-1,
        length=raw_stop - raw_start,
        src_dtype=src_dtype,
        src_shape=piece.shape,
        src_strides=row_major_strides(sp.frame.shape),
        dst_box=tbox.relative_to(Box(frame_origin, tbox.shape)),
        dst_base=dst_base,
        dst_frame=dst_frame,
        perm=seg.perm,
    )
    return _need_bytes(sp.shard, raw_start, raw_stop, copy, isz, offsets)


def _need_bytes(s: Shard, raw_start: int, raw_stop: int, copy: Copy, isz: int, offsets: "_FrameOffsets") -> _Need:
    """The stored byte range (widened to whole chunks/frames) that raw bytes need."""
    raw_len = s.numel * isz
    if s.chunk_size:
        lo = raw_start // s.chunk_size
        hi = -(-raw_stop // s.chunk_size)
        if s.frame_lengths is None:
            f_start = s.byte_offset + lo * s.chunk_size
            f_stop = s.byte_offset + min(hi * s.chunk_size, raw_len)
        else:
            f_start = offsets.of(s, lo)
            f_stop = offsets.of(s, hi - 1) + s.frame_lengths[hi - 1]
        return _Need(s.file, f_start, f_stop, s, lo, hi, raw_start, copy, -1, raw_len)
    return _Need(s.file, s.byte_offset + raw_start, s.byte_offset + raw_stop, s, 0, 0, raw_start, copy, -1,
                 raw_len)


def _flat_fast_path(
    uid: int, spec: TargetSpec, dtype: str, index: _TensorIndex, options: PlanOptions, offsets: "_FrameOffsets",
) -> list[_Need] | None:
    """A flat-range target over row bands: 1-D interval overlap, no box decomposition.

    Applies when every source part meeting the target spans the target box's full
    inner dims (row bands: ZeRO shards of row-parallel weights, whole tensors): such
    a part is contiguous both in its shard and in the target's flattening. Returns
    None when it does not apply.
    """
    box = spec.box
    if box.ndim == 0 or spec.flat_range is None:
        return None
    a, b = spec.flat_range
    if a == b:
        return []
    inner = math.prod(box.shape[1:])
    if inner == 0:
        return []
    r0 = box.offset[0] + a // inner
    r1 = box.offset[0] + -(-b // inner)
    isz = dtypes.itemsize(dtype)
    max_elems = max(1, options.max_piece_bytes // isz)
    out: list[_Need] = []
    for sh in index.shards_in_rows(box, r0, r1, a, b):
        if sh.shape[1:] != box.shape[1:] or sh.offset[1:] != box.offset[1:]:
            return None  # not a row band of the target box: use the general path
        # a row band's flattening is the target's flattening shifted by d elements
        d = (sh.offset[0] - box.offset[0]) * inner
        s0, s1 = sh.flat_range if sh.flat_range is not None else (0, math.prod(sh.shape))
        lo = max(a, s0 + d)
        hi = min(b, s1 + d)
        if hi <= lo:
            continue
        src0 = lo - d - s0  # element offset in the shard's raw bytes
        align = sh.chunk_size // isz if sh.chunk_size and sh.chunk_size % isz == 0 else 0
        for x, y in _aligned_cuts(src0, src0 + hi - lo, max(max_elems, align), align):
            n = y - x
            copy = Copy(uid, -1, n * isz, dtype, (n,), (1,), Box((0,), (n,)), lo - a + (x - src0), (n,), None)
            out.append(_need_bytes(sh, x * isz, y * isz, copy, isz, offsets))
    return out


def _aligned_cuts(start: int, stop: int, step: int, align: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into pieces of at most ``step`` whose inner cuts fall on ``align``."""
    if stop - start <= step:
        return [(start, stop)]
    if align > 1:
        step = max(align, step // align * align)
    cuts = [start]
    pos = start
    while stop - pos > step:
        nxt = (pos + step) // align * align if align > 1 else pos + step
        if nxt <= pos:
            nxt = (pos // align + 1) * align
        cuts.append(nxt)
        pos = nxt
    cuts.append(stop)
    return list(zip(cuts, cuts[1:]))


def _coalesce(
    needs: list[_Need], options: PlanOptions, offsets: "_FrameOffsets", targets_needers: list[tuple[int, ...]],
) -> list[Read]:
    groups: dict[tuple[int, str], list[int]] = {}
    for i, n in enumerate(needs):
        groups.setdefault((n.owner, n.file), []).append(i)
    opts = CoalesceOptions(options.max_gap_bytes, max(options.max_piece_bytes, 1))
    reads: list[Read] = []
    for (owner, file), idxs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ranges = [(needs[i].fetch_start, needs[i].fetch_stop) for i in idxs]
        # gaps are bridged only between ranges the same ranks need: a rank's private
        # rows are not read by a peer just because they sit next to shared ones
        keys = [targets_needers[needs[i].copy.target] if owner < 0 else () for i in idxs]
        for start, stop, members in coalesce(ranges, opts, keys):
            reads.append(_make_read(file, start, stop, [needs[idxs[m]] for m in members], owner, offsets))
    return reads


def _make_read(
    file: str, start: int, stop: int, members: list[_Need], owner: int, offsets: "_FrameOffsets",
) -> Read:
    """Lay out one read: merged chunk runs per shard, decoded layout, copy offsets."""
    per_shard: dict[int, tuple[_Need, list[tuple[int, int]]]] = {}
    for n in members:
        if n.chunk_hi > n.chunk_lo:
            per_shard.setdefault(id(n.shard), (n, []))[1].append((n.chunk_lo, n.chunk_hi))
    zstd = any(n.shard.codec == "zstd" for n in members)
    spans: list[tuple[int, _Need, int, int]] = []
    for n, intervals in per_shard.values():
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a <= hi:
                hi = max(hi, b)
            else:
                spans.append((offsets.of(n.shard, lo), n, lo, hi))
                lo, hi = a, b
        spans.append((offsets.of(n.shard, lo), n, lo, hi))
    spans.sort(key=lambda x: x[0])
    runs: list[ChunkRun] = []
    run_of: dict[int, list[ChunkRun]] = {}
    out = 0
    for file_start, n, lo, hi in spans:
        run = ChunkRun(n.shard, n.raw_total, lo, hi, file_start, out)
        if zstd:
            out += min(hi * n.shard.chunk_size, n.raw_total) - lo * n.shard.chunk_size
        runs.append(run)
        run_of.setdefault(id(n.shard), []).append(run)
    copies = []
    for n in members:
        if zstd:
            run = next(r for r in run_of[id(n.shard)] if r.lo <= n.chunk_lo < r.hi)
            base = run.out_start + n.raw_start - run.lo * n.shard.chunk_size
        else:
            base = n.shard.byte_offset + n.raw_start - start
        copies.append(_with_offset(n.copy, base))
    return Read(
        file=file, start=start, stop=stop, reader=owner, runs=tuple(runs), zstd=zstd,
        staging=out if zstd else stop - start, copies=copies, private=owner >= 0,
    )


class _FrameOffsets:
    """File offsets of chunks/frames, computed once per zstd shard during a plan."""

    def __init__(self) -> None:
        self._cache: dict[int, list[int]] = {}

    def of(self, s: Shard, c: int) -> int:
        if s.frame_lengths is None:
            return s.byte_offset + c * s.chunk_size
        offs = self._cache.get(id(s))
        if offs is None:
            offs = self._cache[id(s)] = s.frame_offsets()
        return offs[c]


def _with_offset(c: Copy, offset: int) -> Copy:
    """Place a copy in its read (each copy belongs to exactly one read)."""
    c.offset = offset
    return c


def _fresh(c: Copy) -> Copy:
    return Copy(c.target, -1, c.length, c.src_dtype, c.src_shape, c.src_strides, c.dst_box,
                c.dst_base, c.dst_frame, c.perm)


def _assign_readers(reads: list[Read], needs_world: int, targets: list[Target], read_once: bool) -> None:
    """Each shared read goes to the least-loaded rank (by bytes) among those needing it."""
    if not read_once:
        return
    load = [0] * needs_world
    for r in reads:
        cands: set[int] = set()
        for c in r.copies:
            cands.update(targets[c.target].needers)
        best = min(cands, key=lambda x: (load[x], x))
        r.reader = best
        load[best] += r.length


def message_layout(copies: Sequence[Copy]) -> tuple[list[int], int]:
    """Offsets of copies packed back to back (aligned) in one message, and its size."""
    offs = []
    pos = 0
    for c in copies:
        offs.append(pos)
        pos += -(-c.length // ALIGN) * ALIGN
    return offs, pos


def read_cost(r: Read) -> int:
    """Staging bytes a read takes on its reader: fetch buffer (+ decode buffer)."""
    fetch = -(-r.length // ALIGN) * ALIGN + ALIGN
    return fetch + (-(-r.staging // ALIGN) * ALIGN if r.zstd else 0)


def messages_of(r: Read, targets: list[Target]) -> dict[int, list[Copy]]:
    """Receiver rank -> the copies of read ``r`` it needs (none for private reads)."""
    out: dict[int, list[Copy]] = {}
    if r.private:
        return out
    for c in r.copies:
        for rank in targets[c.target].needers:
            if rank != r.reader:
                out.setdefault(rank, []).append(c)
    return out


def _pack_rounds(reads: list[Read], targets: list[Target], world: int, options: PlanOptions) -> int:
    """Greedy: a read goes to the earliest round where every rank it touches has room."""
    cap = options.round_cap
    cur = [0] * world
    used = [0] * world
    sole = [t.needers[0] if len(t.needers) == 1 else -1 for t in targets]  # the only rank needing it
    last = -1
    for r in reads:
        cost = read_cost(r)
        reader = r.reader
        if r.private or all(sole[c.target] == reader for c in r.copies):
            # only the reader is involved: its own staging decides
            u = used[reader]
            rnd = cur[reader] + 1 if u > 0 and u + cost > cap else cur[reader]
            if rnd > cur[reader]:
                cur[reader] = rnd
                used[reader] = 0
            used[reader] += cost
            r.round = rnd
            last = rnd if rnd > last else last
            continue
        costs: dict[int, int] = {reader: cost}
        for rank, copies in messages_of(r, targets).items():
            size = message_layout(copies)[1]
            costs[reader] += size if len(copies) > 1 else 0
            costs[rank] = costs.get(rank, 0) + size
        rnd = 0
        for rank, c in costs.items():
            need_new = used[rank] > 0 and used[rank] + c > cap
            rnd = max(rnd, cur[rank] + (1 if need_new else 0))
        for rank, c in costs.items():
            if cur[rank] < rnd:
                cur[rank] = rnd
                used[rank] = 0
            used[rank] += c
        r.round = rnd
        last = max(last, rnd)
    return last + 1
