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
import contextlib
import gc
import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

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
    max_round_bytes: int = 32 << 20

    @property
    def round_cap(self) -> int:
        """Bytes one round may stage per rank: two rounds are alive at once, and a
        round stays small (``max_round_bytes``) even under a large budget, so that
        fetching, exchanging and scattering overlap and the arenas stay cheap to fault in."""
        return max(1, min(self.memory_budget // 2, self.max_round_bytes))

    @property
    def max_piece_bytes(self) -> int:
        """Largest span one piece of a need covers: half a round, so that a read and
        what it sends (or a zstd read and its decoded bytes) fit in one."""
        return max(4096, min(self.max_request_bytes, self.round_cap // 2))


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
    private: bool = False  # serves only its reader (no messages)
    round: int = 0
    tag: int = 0  # message tag, the same on every rank that plans this read

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
    """The reads a rank takes part in (every rank's with ``rank=None``) and their rounds.

    A plan made for one rank is complete only after ``settle_rounds``: the
    rounds of reads shared between ranks that planned them apart depend on two
    maxima over all ranks (see ``settle_rounds``).
    """

    world_size: int
    targets: list[Target]
    reads: list[Read]
    num_rounds: int
    rank_targets: list[list[int]]  # per rank: target id of each of its specs, -1 if missing
    missing: list[list[str]]  # per rank
    unexpected: list[str]
    options: PlanOptions = field(default_factory=PlanOptions)
    rank: int | None = None  # None: planned for every rank
    base_rounds: int = 0  # rounds before the edge rounds (this plan's own claim until settled)
    edge_degree: int = 0  # distinct rank groups this plan's edge reads serve (the max over ranks once settled)
    edge_reads: list[Read] = field(default_factory=list)
    settled: bool = False

    def needers_of(self, copy: Copy) -> list[int]:
        return self.targets[copy.target].needers

    def round_claim(self) -> list[int]:
        """What this rank contributes to the two maxima that place edge reads."""
        return [self.base_rounds, self.edge_degree]

    def place_edges(self, base_rounds: int, degree: int) -> int:
        """Give edge reads their rounds after ``base_rounds``; returns the edge rounds this plan uses.

        Reads shared between private targets of different ranks (a checksum
        chunk at the seam of two ZeRO slices) are planned by each rank that
        needs them, each seeing the same reads in the same order. Every group
        of ranks packs its edge reads greedily into ``round_cap / degree``
        bytes per round, so that a rank in at most ``degree`` groups stays
        within its budget in every edge round.
        """
        self.base_rounds = base_rounds
        self.edge_degree = degree
        share = max(1, self.options.round_cap // max(1, degree))
        groups: dict[tuple[int, ...], list[Read]] = {}
        for r in self.edge_reads:
            groups.setdefault(_ranks_of(r, self.targets), []).append(r)
        used_rounds = 0
        for reads in groups.values():
            j, used = 0, 0
            for r in reads:
                cost = max(_costs(r, self.targets).values())
                if used > 0 and used + cost > share:
                    j, used = j + 1, 0
                used += cost
                r.round = base_rounds + j
            used_rounds = max(used_rounds, j + 1)
        return used_rounds

    def finish(self, edge_rounds: int) -> None:
        self.num_rounds = self.base_rounds + edge_rounds
        self.settled = True


def settle_rounds(plan: LoadPlan, reduce_max: Callable[[list[int]], list[int]]) -> LoadPlan:
    """Complete a one-rank plan: ``reduce_max`` is an element-wise max over all ranks' lists."""
    if plan.settled:
        return plan
    base, degree = reduce_max(plan.round_claim())
    (edge_rounds,) = reduce_max([plan.place_edges(base, degree)])
    plan.finish(edge_rounds)
    return plan


def settle_all(plans: Sequence[LoadPlan]) -> None:
    """``settle_rounds`` for one-rank plans held side by side (simulations, benchmarks)."""
    claims = [p.round_claim() for p in plans]
    base, degree = (max(c[i] for c in claims) for i in range(2))
    edge_rounds = max(p.place_edges(base, degree) for p in plans)
    for p in plans:
        p.finish(edge_rounds)


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
    rank: int | None = None,
) -> LoadPlan:
    """Plan a load of every rank's targets from ``manifest``.

    With ``rank`` the plan holds only the reads that rank takes part in, and
    targets held by a single rank (ZeRO slices, unreplicated TP shards) are
    planned only by the ranks whose reads they can share a checksum chunk
    with, so the cost grows with the targets near this rank, not with the
    world. Such a plan needs ``settle_rounds`` before it runs.

    The cyclic garbage collector is paused while planning: the plan is
    hundreds of thousands of acyclic objects at scale, and collections
    triggered by their allocation cost about a third of the time.
    """
    with _gc_paused():
        return _build_plan(manifest, targets_by_rank, options, view, rank)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build_plan(
    manifest: Manifest,
    targets_by_rank: Sequence[Sequence[TargetSpec]],
    options: PlanOptions,
    view: ViewLike | None,
    rank: int | None,
) -> LoadPlan:
    view = view or IdentityView(manifest)
    world = len(targets_by_rank)
    targets, rank_targets = _dedupe(targets_by_rank)
    missing: list[list[str]] = [[] for _ in range(world)]
    live: list[int] = []
    checked: set[tuple[str, str, tuple[int, ...]]] = set()
    transformed = getattr(view, "transformed", True)
    for uid, t in enumerate(targets):
        spec = t.spec
        vt = view.tensors.get(spec.key)
        if vt is None:
            for r in t.needers:
                missing[r].append(spec.key)
            continue
        if (spec.key, spec.dtype, spec.global_shape) not in checked:
            _check_target(spec, vt, transformed, t.needers)
            checked.add((spec.key, spec.dtype, spec.global_shape))
        live.append(uid)
    if len(live) < len(targets):
        alive = [False] * len(targets)
        for u in live:
            alive[u] = True
        rank_targets = [[u if alive[u] else -1 for u in mine] for mine in rank_targets]
    wanted = {targets[u].spec.key for u in live}
    unexpected = sorted(k for k in view.tensors if k not in wanted)

    ctx = _Ctx(manifest, view, options, targets)
    focus = set(range(world)) if rank is None else {rank}
    if options.read_once:
        private_keys = _private_keys(targets, live, view)
        shared_uids = [u for u in live if targets[u].spec.key not in private_keys]
        private_uids = [u for u in live if targets[u].spec.key in private_keys]
        if rank is not None:
            private_uids = _closure(rank, private_uids, rank_targets[rank], ctx)
        own, edges = _plan_private(private_uids, focus, ctx)
    else:
        shared_uids = []
        mine = live if rank is None else sorted({u for u in rank_targets[rank] if u >= 0})
        own, edges = _plan_owned(mine, ctx, focus), []
    shared = _plan_shared(shared_uids, ctx, world, private_keys if options.read_once else set())
    rounds = _Rounds(world, options.round_cap)
    for i, r in enumerate(shared):
        r.tag = i
        rounds.place(r, targets)
    for r in own:
        rounds.place(r, targets)
    for r in edges:
        r.tag = _edge_tag(r)
    if rank is not None:
        shared = [r for r in shared if _involves(r, rank, targets)]
    plan = LoadPlan(world, targets, shared + own + edges, 0, rank_targets, missing, unexpected, options,
                    rank=rank, base_rounds=rounds.count(focus), edge_reads=edges)
    plan.edge_degree = _degree(edges, focus, targets)
    if rank is None:
        plan.finish(plan.place_edges(plan.base_rounds, plan.edge_degree))
    return plan


@dataclass(slots=True)
class _Ctx:
    """What every planning step reads, and the caches they share."""

    manifest: Manifest
    view: ViewLike
    options: PlanOptions
    targets: list[Target]
    indexes: dict[str, "_TensorIndex"] = field(default_factory=dict)
    offsets: "_FrameOffsets" = field(default_factory=lambda: _FrameOffsets())

    def needs(self, uid: int) -> Iterable["_Need"]:
        return _needs_for_target(uid, self.targets[uid].spec, self.view, self.manifest, self.indexes,
                                 self.options, self.offsets)

    def index(self, key: str) -> "_TensorIndex":
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = _TensorIndex(self.manifest.tensors[key].shards)
        return index


def _dedupe(targets_by_rank: Sequence[Sequence[TargetSpec]]) -> tuple[list[Target], list[list[int]]]:
    """Distinct target specs (ids in first-seen order) and the ranks holding each."""
    uid_of: dict[TargetSpec, int] = {}
    seen = uid_of.setdefault
    rank_targets = [[seen(s, len(uid_of)) for s in specs] for specs in targets_by_rank]
    needers: list[list[int]] = [[] for _ in range(len(uid_of))]
    for r, mine in enumerate(rank_targets):
        for u in mine:
            held = needers[u]
            if not held or held[-1] != r:
                held.append(r)
    return [Target(s, n) for s, n in zip(uid_of, needers)], rank_targets


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
    barriers: Mapping[str, list[tuple[int, int]]] | None = None,
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
        keys: list[object] = [targets_needers[needs[i].copy.target] if owner < 0 else () for i in idxs]
        # bytes planned elsewhere (private targets' shards) are never read through
        fence = (barriers or {}).get(file, ())
        for lo, hi in fence:
            ranges.append((lo, hi))
            keys.append(object())
        for start, stop, members in coalesce(ranges, opts, keys):
            if members[0] >= len(idxs):
                continue  # a barrier
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


def _assign_readers(reads: list[Read], needs_world: int, targets: list[Target]) -> None:
    """Each shared read goes to the least-loaded rank (by bytes) among those needing it."""
    load = [0] * needs_world
    by_load = load.__getitem__
    for r in reads:
        first = targets[r.copies[0].target].needers
        if all(targets[c.target].needers is first for c in r.copies):
            cands: Sequence[int] = first  # ascending: min() keeps the lowest rank among ties
        else:
            cands = sorted({n for c in r.copies for n in targets[c.target].needers})
        best = min(cands, key=by_load)
        r.reader = best
        load[best] += r.length


def wire_length(c: Copy) -> int:
    """Bytes of a copy's elements alone: what a message carries for it (a strided
    copy is packed, not sent with the bytes between its rows)."""
    return math.prod(c.src_shape) * dtypes.itemsize(c.src_dtype)


def is_packed(copies: Sequence[Copy]) -> bool:
    """Whether a message is built in a pack buffer (else it is a slice of the staged read)."""
    return len(copies) > 1 or wire_length(copies[0]) != copies[0].length


def message_layout(copies: Sequence[Copy]) -> tuple[list[int], int]:
    """Offsets of copies' elements packed back to back (aligned) in one message, and its size."""
    offs = []
    pos = 0
    for c in copies:
        offs.append(pos)
        pos += -(-wire_length(c) // ALIGN) * ALIGN
    return offs, pos


def message_size(copies: Sequence[Copy]) -> int:
    """Bytes a message occupies on the wire and in its receive buffer."""
    return message_layout(copies)[1] if is_packed(copies) else copies[0].length


def packed_copy(c: Copy) -> Copy:
    """The copy as its receiver applies it from a packed message: contiguous elements."""
    return Copy(c.target, 0, wire_length(c), c.src_dtype, c.src_shape, row_major_strides(c.src_shape),
                c.dst_box, c.dst_base, c.dst_frame, c.perm)


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


def _costs(r: Read, targets: list[Target]) -> dict[int, int]:
    """Staging bytes read ``r`` takes on each rank it involves in its round."""
    reader = r.reader
    costs = {reader: read_cost(r)}
    if r.private:
        return costs
    needers = [targets[c.target].needers for c in r.copies]
    first = needers[0]
    if all(n is first for n in needers):  # one target set (a replicated box): one message shape
        size = message_layout(r.copies)[1]
        packed = is_packed(r.copies)
        for rank in first:
            if rank != reader:
                costs[rank] = size
                if packed:
                    costs[reader] += size
        return costs
    for rank, copies in messages_of(r, targets).items():
        size = message_layout(copies)[1]
        costs[rank] = size
        if is_packed(copies):
            costs[reader] += size
    return costs


class _Rounds:
    """Greedy round packing: a read goes to the earliest round (at or after each
    involved rank's current one) where every involved rank still has room."""

    def __init__(self, world: int, cap: int) -> None:
        self.cap = cap
        self.cur = [0] * world
        self.used = [0] * world
        self.touched = [False] * world

    def place(self, r: Read, targets: list[Target]) -> None:
        cap, cur, used = self.cap, self.cur, self.used
        if r.private:
            reader = r.reader
            cost = read_cost(r)
            if used[reader] > 0 and used[reader] + cost > cap:
                cur[reader] += 1
                used[reader] = 0
            used[reader] += cost
            self.touched[reader] = True
            r.round = cur[reader]
            return
        costs = _costs(r, targets)
        rnd = 0
        for rank, c in costs.items():
            u = used[rank]
            x = cur[rank] + 1 if u and u + c > cap else cur[rank]
            if x > rnd:
                rnd = x
        touched = self.touched
        for rank, c in costs.items():
            if cur[rank] < rnd:
                cur[rank] = rnd
                used[rank] = c
            else:
                used[rank] += c
            touched[rank] = True
        r.round = rnd

    def count(self, ranks: Iterable[int]) -> int:
        """Rounds used by the busiest of ``ranks`` so far."""
        return max((self.cur[r] + 1 for r in ranks if self.touched[r]), default=0)


def _involves(r: Read, rank: int, targets: list[Target]) -> bool:
    return r.reader == rank or any(rank in targets[c.target].needers for c in r.copies)


def _ranks_of(r: Read, targets: list[Target]) -> tuple[int, ...]:
    return tuple(sorted({n for c in r.copies for n in targets[c.target].needers}))


def _degree(edges: list[Read], focus: set[int], targets: list[Target]) -> int:
    """The most distinct groups of ranks that edge reads make one rank of ``focus`` serve."""
    groups: dict[int, set[tuple[int, ...]]] = {}
    for g in {_ranks_of(r, targets) for r in edges}:
        for rank in g:
            if rank in focus:
                groups.setdefault(rank, set()).add(g)
    return max((len(v) for v in groups.values()), default=0)


def _edge_tag(r: Read) -> int:
    """A tag both ends of an edge read derive alike (they number their reads differently)."""
    return (zlib.crc32(r.file.encode()) * 1_000_003 + r.start) % (1 << 30)


# ------------------------------------------------------------------ private targets


def _private_keys(targets: list[Target], live: Sequence[int], view: ViewLike) -> set[str]:
    """Tensors every live target of which one rank alone holds: planned near their ranks.

    Only with the identity view: under transforms one stored tensor can feed
    several names, so its reads may be shared across keys.
    """
    if not isinstance(view, IdentityView):
        return set()
    shared: set[str] = set()
    keys: set[str] = set()
    for u in live:
        t = targets[u]
        keys.add(t.spec.key)
        if len(t.needers) > 1:
            shared.add(t.spec.key)
    return keys - shared


def _rows(box: Box, flat: tuple[int, int] | None) -> tuple[int, int]:
    """Dim-0 rows ``[r0, r1)`` a box (or a flat range of it) covers."""
    if box.ndim == 0:
        return 0, 1
    r0, n = box.offset[0], box.shape[0]
    if flat is None:
        return r0, r0 + n
    inner = math.prod(box.shape[1:])
    if inner == 0:
        return r0, r0
    return r0 + flat[0] // inner, r0 + -(-flat[1] // inner)


def _meets(a: Box, ra: tuple[int, int], b: Box, rb: tuple[int, int]) -> bool:
    """Whether two regions given by bounding box and row range may share elements."""
    if a.ndim == 0 or b.ndim == 0:
        return True
    if ra[0] >= rb[1] or rb[0] >= ra[1]:
        return False
    for d in range(1, a.ndim):
        if a.offset[d] >= b.offset[d] + b.shape[d] or b.offset[d] >= a.offset[d] + a.shape[d]:
            return False
    return True


def _closure(rank: int, private_uids: Sequence[int], mine: Sequence[int], ctx: _Ctx) -> list[int]:
    """Private targets whose needs can share a stored shard with ``rank``'s own.

    Every target that meets a shard one of the rank's targets meets is in it,
    so every chain of overlapping reads through such a shard is seen whole —
    the same on each rank of the chain.
    """
    targets = ctx.targets
    own = {u for u in mine if u >= 0}
    by_key: dict[str, list[int]] = {}
    for u in private_uids:
        by_key.setdefault(targets[u].spec.key, []).append(u)
    out: list[int] = []
    for key, uids in by_key.items():
        mine_here = [u for u in uids if u in own]
        if not mine_here:
            continue
        regions = [(targets[u].spec.box, _rows(targets[u].spec.box, targets[u].spec.flat_range)) for u in uids]
        shards = [(s.box, _rows(s.box, s.flat_range)) for s in ctx.manifest.tensors[key].shards]
        touched = [
            sb for sb in shards
            if any(_meets(regions[i][0], regions[i][1], *sb) for i, u in enumerate(uids) if u in own)
        ]
        out.extend(u for i, u in enumerate(uids) if u in own or any(_meets(*regions[i], *sb) for sb in touched))
    return out


def _plan_owned(uids: Sequence[int], ctx: _Ctx, focus: set[int]) -> list[Read]:
    """read_once=False: every needer (of those in ``focus``) reads its own needs."""
    needs: list[_Need] = []
    for uid in uids:
        for need in ctx.needs(uid):
            for o in ctx.targets[uid].needers:
                if o not in focus:
                    continue
                needs.append(_Need(need.file, need.fetch_start, need.fetch_stop, need.shard, need.chunk_lo,
                                   need.chunk_hi, need.raw_start, _fresh(need.copy), o, need.raw_total))
    return _coalesce(needs, ctx.options, ctx.offsets, [])


def _plan_shared(uids: Sequence[int], ctx: _Ctx, world: int, private_keys: set[str]) -> list[Read]:
    """Targets more than one rank holds: planned alike on every rank."""
    if not uids:
        return []
    needs = [n for uid in uids for n in ctx.needs(uid)]
    fences: dict[str, list[tuple[int, int]]] = {}
    for key in private_keys:
        for sh in ctx.manifest.tensors[key].shards:
            fences.setdefault(sh.file, []).append((sh.byte_offset, sh.byte_offset + sh.byte_length))
    files = {n.file for n in needs}
    barriers = {f: _merge_ranges(fences[f]) for f in files if f in fences}
    reads = _coalesce(needs, ctx.options, ctx.offsets, [tuple(t.needers) for t in ctx.targets], barriers)
    _assign_readers(reads, world, ctx.targets)
    return reads


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _plan_private(uids: Sequence[int], focus: set[int], ctx: _Ctx) -> tuple[list[Read], list[Read]]:
    """Reads of single-holder targets: each rank's own, and the shared "edge" reads.

    Needs whose fetched bytes overlap form chains (ZeRO slices meeting inside a
    checksum chunk). A contiguous need is cut at chunk boundaries so only the
    chunks two ranks both touch are read once and shared; the rest stays
    private. Returns reads for ranks in ``focus``: (private reads, edge reads).
    """
    by_file: dict[str, list[_Need]] = {}
    for uid in uids:
        owner = ctx.targets[uid].needers[0]
        for need in ctx.needs(uid):
            need.owner = owner
            by_file.setdefault(need.file, []).append(need)
    own: list[Read] = []
    edges: list[Read] = []
    for file in sorted(by_file):
        ns = by_file[file]
        ns.sort(key=lambda n: (n.fetch_start, n.fetch_stop))
        units: list[list[_Need]] = []
        for comp in _chains(ns):
            owners = {n.owner for n in comp}
            if len(owners) == 1:
                units.append(comp)
            elif owners & focus:
                split = sorted(_split_contested(comp, ctx.offsets), key=lambda n: (n.fetch_start, n.fetch_stop))
                units.extend(_chains(split))
            else:
                units.append(comp)  # not ours: it only fences our reads off its bytes
        units.sort(key=lambda u: u[0].fetch_start)
        _private_reads(file, units, focus, ctx, own, edges)
    return own, edges


def _chains(ns: Sequence[_Need]) -> list[list[_Need]]:
    """Maximal runs of needs (sorted by start) whose fetched bytes overlap."""
    out: list[list[_Need]] = []
    stop = -1
    for n in ns:
        if out and n.fetch_start < stop:
            out[-1].append(n)
            stop = max(stop, n.fetch_stop)
        else:
            out.append([n])
            stop = n.fetch_stop
    return out


def _private_reads(
    file: str, units: list[list[_Need]], focus: set[int], ctx: _Ctx, own: list[Read], edges: list[Read],
) -> None:
    """Turn chains into reads. Chains of the same ranks merge across small gaps
    inside one shard, or with no gap at all, never across another's bytes: every
    rank of an edge read sees the same chains between its ends, so all of them
    merge alike."""
    opts = ctx.options
    small = CoalesceOptions().small_gap_bytes
    ratio = CoalesceOptions().max_gap_ratio
    cur: list[_Need] = []
    cur_owners: frozenset[int] = frozenset()
    start = stop = 0

    def flush() -> None:
        if not cur:
            return
        if len(cur_owners) == 1:
            own.append(_make_read(file, start, stop, list(cur), next(iter(cur_owners)), ctx.offsets))
        else:
            edges.append(_edge_read(file, start, stop, list(cur), ctx))
        cur.clear()

    for unit in units:
        owners = frozenset(n.owner for n in unit)
        u_start = unit[0].fetch_start
        u_stop = max(n.fetch_stop for n in unit)
        if cur:
            gap = u_start - stop
            merged = u_stop - start
            if (
                owners == cur_owners
                and (gap == 0 or unit[0].shard is cur[-1].shard)
                and (gap <= small or (gap <= opts.max_gap_bytes and gap <= ratio * merged))
                and merged <= max(opts.max_piece_bytes, 1)
            ):
                cur.extend(unit)
                stop = u_stop
                continue
            flush()
        if owners & focus:
            cur.extend(unit)
            cur_owners, start, stop = owners, u_start, u_stop
    flush()


def _edge_read(file: str, start: int, stop: int, members: list[_Need], ctx: _Ctx) -> Read:
    """A read several ranks' private targets share. Its reader needs most of it;
    among ranks needing comparable shares, a hash of the read spreads the load."""
    read = _make_read(file, start, stop, members, -1, ctx.offsets)
    want: dict[int, int] = {}
    for n in members:
        want[n.owner] = want.get(n.owner, 0) + n.copy.length
    top = max(want.values())
    cands = sorted(r for r, w in want.items() if 2 * w >= top)
    read.reader = cands[_edge_tag(read) % len(cands)]
    return read


def _split_contested(comp: list[_Need], offsets: "_FrameOffsets") -> list[_Need]:
    """Cut contiguous needs so that the chunks another rank also touches stand apart."""
    spans = [(n.chunk_lo, n.chunk_hi, n.owner) for n in comp]
    out: list[_Need] = []
    for n in comp:
        c = n.copy
        isz = dtypes.itemsize(c.src_dtype)
        cs = n.shard.chunk_size
        splittable = (
            cs > 0 and cs % isz == 0 and n.chunk_hi - n.chunk_lo > 1 and len(c.src_shape) == 1
            and c.src_strides == (1,) and c.perm is None and c.dst_box.ndim == 1
        )
        if not splittable:
            out.append(n)
            continue
        cuts: set[int] = set()
        if any(o != n.owner and lo <= n.chunk_lo < hi for lo, hi, o in spans):
            cuts.add((n.chunk_lo + 1) * cs)
        if any(o != n.owner and lo <= n.chunk_hi - 1 < hi for lo, hi, o in spans):
            cuts.add((n.chunk_hi - 1) * cs)
        raw_stop = n.raw_start + c.length
        bounds = [n.raw_start] + sorted(x for x in cuts if n.raw_start < x < raw_stop) + [raw_stop]
        if len(bounds) == 2:
            out.append(n)
            continue
        for a, b in zip(bounds, bounds[1:]):
            k, m = (a - n.raw_start) // isz, (b - a) // isz
            part = Copy(c.target, -1, b - a, c.src_dtype, (m,), (1,), Box((c.dst_box.offset[0] + k,), (m,)),
                        c.dst_base, c.dst_frame, None)
            piece = _need_bytes(n.shard, a, b, part, isz, offsets)
            piece.owner = n.owner
            out.append(piece)
    return out
