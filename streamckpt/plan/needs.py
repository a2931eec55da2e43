"""What each target needs from storage: source pieces, byte spans, reads.

A per-tensor index (``tensorindex``) finds the stored shards a target box meets; each
intersection becomes pieces whose byte span is bounded (cut on checksum chunk
boundaries), widened to whole chunks or zstd frames (``Need``); needs are then
coalesced per file into ``Read``s whose copies know where their bytes sit in
the read. Pure: no I/O, no ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ..core import dtypes
from ..core.manifest import Manifest, Shard
from ..core.regions import Box, CoalesceOptions, coalesce, cut_pieces, flat_range_boxes, max_gap, span, split_aligned
from ..core.targets import TargetSpec
from ..errors import TransformError
from .data import ChunkRun, Copy, IdentityView, PlanOptions, Read, Segment, Target, ViewLike
from .tensorindex import SourcePart, TensorIndex


# ------------------------------------------------------------------ needs and reads


@dataclass(slots=True)
class Need:
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



def _target_parts(spec: TargetSpec) -> list[tuple[Box, int | None, tuple[int, ...] | None]]:
    """(global box, dst_base, dst_frame) of each contiguous part of a target."""
    if spec.flat_range is None:
        return [] if spec.box.is_empty() else [(spec.box, None, None)]
    return [
        (b, flat_start - spec.flat_range[0], b.shape)
        for flat_start, b in flat_range_boxes(spec.box, *spec.flat_range)
    ]


class NeedFinder:
    """Turns targets into needs. Holds what one plan's targets share: the
    per-tensor indexes (built on first use), the frame offsets, the limits."""

    def __init__(self, manifest: Manifest, view: ViewLike, options: PlanOptions, offsets: "FrameOffsets") -> None:
        self.manifest = manifest
        self.view = view
        self.offsets = offsets
        self.indexes: dict[str, TensorIndex] = {}
        self.max_piece = options.max_piece_bytes
        self.max_gap = options.max_gap_bytes
        self.identity = isinstance(view, IdentityView)
        self._geometry: dict[tuple, list[tuple[tuple[int, ...], int, int, Box]]] = {}

    def index(self, key: str) -> TensorIndex:
        index = self.indexes.get(key)
        if index is None:
            meta = self.manifest.tensors[key]
            index = self.indexes[key] = TensorIndex(meta.shards, meta.dtype)
        return index

    def __call__(self, uid: int, spec: TargetSpec, max_piece: int = 0) -> list[Need]:
        """The needs of target ``uid``, each at most ``max_piece`` bytes (default: the plan's)."""
        max_piece = max_piece or self.max_piece
        if spec[5] is not None and (self.identity or _is_identity(self.view, spec[0])):
            fast = _flat_fast_path(uid, spec, self.index(spec[0]), max_piece, self.offsets)
            if fast is not None:
                return fast
        out: list[Need] = []
        for part_box, dst_base, dst_frame in _target_parts(spec):
            frame_origin = part_box.offset if dst_base is not None else spec.offset
            for seg in self.view.map_box(spec.key, part_box):
                meta = self.manifest.tensors.get(seg.source_key)
                if meta is None:
                    raise TransformError(f"{spec.key}: source tensor {seg.source_key!r} is not in the checkpoint")
                isz = dtypes.itemsize(meta.dtype)
                max_elems = max(1, max_piece // isz)
                gap_elems = self.max_gap // isz
                to_dst = _to_target(seg, frame_origin)
                for sp, inter in self.index(seg.source_key).meets(seg.source_box):
                    cs = sp.shard.chunk_size
                    align = cs // isz if cs % isz == 0 else 0
                    pieces = self._pieces(sp, inter, gap_elems, max(max_elems, align), align, to_dst, seg.perm)
                    shard, base, strides = sp.shard, sp.base, sp.strides
                    for shape, first, stop, dst in pieces:
                        raw_start, raw_stop = (base + first) * isz, (base + stop) * isz
                        copy = Copy(uid, -1, raw_stop - raw_start, meta.dtype, shape, strides, dst, dst_base,
                                    dst_frame, seg.perm)
                        out.append(need_bytes(shard, raw_start, raw_stop, copy, isz, self.offsets))
        return out

    def _pieces(
        self, sp: SourcePart, inter: Box, gap_elems: int, max_elems: int, align: int, to_dst: tuple[int, ...],
        perm: tuple[int, ...] | None,
    ) -> list[tuple[tuple[int, ...], int, int, Box]]:
        """(shape, element span in the part's frame, destination box) of each piece of
        ``inter``: geometry alone, so computed once for the many targets that repeat it
        (the same slice of every layer)."""
        key = (sp.frame, sp.base, inter, gap_elems, max_elems, align, to_dst, perm)
        got = self._geometry.get(key)
        if got is None:
            got = self._geometry[key] = [
                (piece[1], *span(sp.frame, piece), _dst_box(piece, to_dst, perm))
                for piece in _pieces(sp, inter, gap_elems, max_elems, align)
            ]
        return got


def _is_identity(view: ViewLike, name: str) -> bool:
    if isinstance(view, IdentityView):
        return True
    check = getattr(view, "is_identity", None)
    return bool(check(name)) if check is not None else False


def _pieces(sp: SourcePart, inter: Box, gap_elems: int, max_elems: int, align: int) -> Iterable[Box]:
    """Cut an intersection where gaps are too wide, then bound each span (on chunk boundaries)."""
    frame = sp.frame
    ndim = len(inter[1])
    if ndim < 2 or max_gap(frame, inter, 0, sp.strides) <= gap_elems:
        first, stop = span(frame, inter)
        if stop - first <= max_elems:
            return (inter,)  # what split_aligned returns for a span that fits
        return split_aligned(frame, inter, max_elems, sp.base, align)
    cut = 1
    while cut < ndim - 1 and max_gap(frame, inter, cut, sp.strides) > gap_elems:
        cut += 1
    return [q for p in cut_pieces(frame, inter, cut) for q in split_aligned(frame, p, max_elems, sp.base, align)]


def _to_target(seg: Segment, frame_origin: tuple[int, ...]) -> tuple[int, ...]:
    """Per dim (in target order): what turns a source offset into one in the destination frame."""
    if seg.perm is None:
        return tuple(t - s - f for t, s, f in zip(seg.target_box[0], seg.source_box[0], frame_origin))
    return tuple(seg.target_box[0][d] - seg.source_box[0][p] - frame_origin[d] for d, p in enumerate(seg.perm))


def _dst_box(piece: Box, to_dst: tuple[int, ...], perm: tuple[int, ...] | None) -> Box:
    """Where a source piece lands in the destination frame."""
    offset, shape = piece
    if perm is None:
        return Box(tuple(o + d for o, d in zip(offset, to_dst)), shape)
    return Box(tuple(offset[p] + d for p, d in zip(perm, to_dst)), tuple(shape[p] for p in perm))


def need_bytes(s: Shard, raw_start: int, raw_stop: int, copy: Copy, isz: int, offsets: "FrameOffsets") -> Need:
    """The stored byte range (widened to whole chunks/frames) that raw bytes need."""
    flat = s.flat_range  # s.numel, inlined: a plan asks once per need
    raw_len = (flat[1] - flat[0] if flat is not None else math.prod(s.shape)) * isz
    cs = s.chunk_size
    if cs:
        lo = raw_start // cs
        hi = -(-raw_stop // cs)
        if s.frame_lengths is None:
            f_start = s.byte_offset + lo * cs
            f_stop = s.byte_offset + min(hi * cs, raw_len)
        else:
            f_start = offsets.of(s, lo)
            f_stop = offsets.of(s, hi - 1) + s.frame_lengths[hi - 1]
        return Need(s.file, f_start, f_stop, s, lo, hi, raw_start, copy, -1, raw_len)
    return Need(s.file, s.byte_offset + raw_start, s.byte_offset + raw_stop, s, 0, 0, raw_start, copy, -1,
                 raw_len)


def _flat_fast_path(
    uid: int, spec: TargetSpec, index: TensorIndex, max_piece: int, offsets: "FrameOffsets",
) -> list[Need] | None:
    """A flat-range target over row bands: 1-D interval overlap, no box decomposition.

    Applies when every source part meeting the target spans the target box's full
    inner dims (row bands: ZeRO shards of row-parallel weights, whole tensors): such
    a part is contiguous both in its shard and in the target's flattening. Returns
    None when it does not apply.
    """
    offset, shape, flat = spec[3:]
    if not shape or flat is None:
        return None
    a, b = flat
    if a == b:
        return []
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    row0 = offset[0]
    shards = index.shards_in_rows(offset, shape, row0 + a // inner, row0 + -(-b // inner), a, b)
    if shards is None:
        return None  # a shard there is not a row band of the target box: use the general path
    dtype, isz = index.dtype, index.itemsize
    max_elems = max(1, max_piece // isz)
    out: list[Need] = []
    new = tuple.__new__  # a Box at C speed
    for sh in shards:
        # a row band's flattening is the target's flattening shifted by d elements
        d = (sh.offset[0] - row0) * inner
        s0, s1 = sh.flat_range if sh.flat_range is not None else (0, math.prod(sh.shape))
        lo = max(a, s0 + d)
        hi = min(b, s1 + d)
        if hi <= lo:
            continue
        src0 = lo - d - s0  # element offset in the shard's raw bytes
        align = sh.chunk_size // isz if sh.chunk_size and sh.chunk_size % isz == 0 else 0
        step = max_elems if max_elems > align else align
        cuts = ((src0, src0 + hi - lo),) if hi - lo <= step else _aligned_cuts(src0, src0 + hi - lo, step, align)
        for x, y in cuts:
            n = y - x
            copy = Copy(uid, -1, n * isz, dtype, (n,), (1,), new(Box, ((0,), (n,))), lo - a + (x - src0), (n,), None)
            out.append(need_bytes(sh, x * isz, y * isz, copy, isz, offsets))
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


Group = tuple[str, int, int, list[Need], int]  # file, start, stop, member needs, owner: one read to be


def coalesce_needs(
    needs: list[Need], options: PlanOptions, offsets: "FrameOffsets", targets: Sequence[Target],
    barriers: Mapping[str, list[tuple[int, int]]] | None = None,
) -> list[Read]:
    """Merge each (owner, file)'s needs into reads (see ``group_needs``)."""
    return [make_read(*g, offsets) for g in group_needs(needs, options, targets, barriers)]


def group_needs(
    needs: list[Need], options: PlanOptions, targets: Sequence[Target],
    barriers: Mapping[str, list[tuple[int, int]]] | None = None,
    split: Mapping[tuple[int, ...], int] | None = None,
) -> list[Group]:
    """What each read ``coalesce_needs`` makes holds, in its order. ``owner`` -1 (shared
    needs) merges across gaps only between needs of targets the same ranks hold,
    never across ``barriers``."""
    groups: dict[tuple[int, str], list[int]] = {}
    for i, n in enumerate(needs):
        groups.setdefault((n.owner, n.file), []).append(i)
    opts = CoalesceOptions(options.max_gap_bytes, max(options.max_piece_bytes, 1))
    out: list[Group] = []
    for (owner, file), idxs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ranges = [(needs[i].fetch_start, needs[i].fetch_stop) for i in idxs]
        # gaps are bridged only between ranges the same ranks need: a rank's private
        # rows are not read by a peer just because they sit next to shared ones
        keys: list[object] = [targets[needs[i].copy.target].needers if owner < 0 else () for i in idxs]
        # bytes planned elsewhere (private targets' shards) are never read through
        fence = (barriers or {}).get(file, ())
        for lo, hi in fence:
            ranges.append((lo, hi))
            keys.append(object())
        for start, stop, members in coalesce(ranges, opts, keys):
            if members[0] >= len(idxs):
                continue  # a barrier
            key = keys[members[0]]
            if split and owner < 0 and len(key) > options.relay_above:  # type: ignore[arg-type]
                cap = split[tuple(key)]  # type: ignore[arg-type]
                if stop - start > cap:
                    out.extend((file, a, b, [needs[idxs[m]] for m in part], owner)
                               for a, b, part in _split_relayed(ranges, members, keys, cap))
                    continue
            out.append((file, start, stop, [needs[idxs[m]] for m in members], owner))
    return out


def _split_relayed(ranges: list[tuple[int, int]], members: list[int], keys: list[object], cap: int,
                   ) -> list[tuple[int, int, list[int]]]:
    """A merged group of needs of a relayed holder set, cut back into reads of at most ``cap``
    bytes where no two needs overlap (a need larger than ``cap`` stays whole): each piece
    then has its own reader and relay tree. A group that overlapping needs of other holder
    sets joined stays whole."""
    first = keys[members[0]]
    if any(keys[m] is not first and keys[m] != first for m in members):
        return [(min(ranges[m][0] for m in members), max(ranges[m][1] for m in members), members)]
    out: list[tuple[int, int, list[int]]] = []
    part: list[int] = []
    lo = hi = 0
    for m in members:  # ascending by range, as ``coalesce`` lists them
        a, b = ranges[m]
        if part and a >= hi and max(hi, b) - lo > cap:
            out.append((lo, hi, part))
            part = []
        if not part:
            lo, hi = a, b
        part.append(m)
        hi = max(hi, b)
    out.append((lo, hi, part))
    return out


def make_read(
    file: str, start: int, stop: int, members: list[Need], owner: int, offsets: "FrameOffsets",
) -> Read:
    """Lay out one read: merged chunk runs per shard, decoded layout, copy offsets."""
    if len(members) == 1 and members[0].shard.codec != "zstd":  # most reads: one raw piece
        n = members[0]
        s = n.shard
        runs: tuple[ChunkRun, ...] = ()
        if n.chunk_hi > n.chunk_lo:
            runs = (ChunkRun(s, n.raw_total, n.chunk_lo, n.chunk_hi, offsets.of(s, n.chunk_lo), 0),)
        copy = n.copy
        copy.offset = s.byte_offset + n.raw_start - start
        return Read(file, start, stop, owner, runs, False, stop - start, [copy], owner >= 0)
    per_shard: dict[int, tuple[Need, list[tuple[int, int]]]] = {}
    for n in members:
        if n.chunk_hi > n.chunk_lo:
            per_shard.setdefault(id(n.shard), (n, []))[1].append((n.chunk_lo, n.chunk_hi))
    zstd = any(n.shard.codec == "zstd" for n in members)
    spans: list[tuple[int, Need, int, int]] = []
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
    chunk_runs: list[ChunkRun] = []
    run_of: dict[int, list[ChunkRun]] = {}
    out = 0
    for file_start, n, lo, hi in spans:
        run = ChunkRun(n.shard, n.raw_total, lo, hi, file_start, out)
        if zstd:
            out += min(hi * n.shard.chunk_size, n.raw_total) - lo * n.shard.chunk_size
        chunk_runs.append(run)
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
        file=file, start=start, stop=stop, reader=owner, runs=tuple(chunk_runs), zstd=zstd,
        staging=out if zstd else stop - start, copies=copies, private=owner >= 0,
    )


class FrameOffsets:
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


def fresh_copy(c: Copy) -> Copy:
    return Copy(c.target, -1, c.length, c.src_dtype, c.src_shape, c.src_strides, c.dst_box,
                c.dst_base, c.dst_frame, c.perm)


@dataclass(slots=True)
class PlanContext:
    """What every planning step reads, and the caches they share."""

    manifest: Manifest
    view: ViewLike
    options: PlanOptions
    targets: Sequence[Target]
    offsets: FrameOffsets = field(default_factory=FrameOffsets)
    finder: NeedFinder = field(init=False)

    def __post_init__(self) -> None:
        self.finder = NeedFinder(self.manifest, self.view, self.options, self.offsets)

    def needs(self, uid: int, split: Mapping[tuple[int, ...], int] | None = None) -> list[Need]:
        """Target ``uid``'s needs; a relayed holder set's in pieces of at most ``split[holders]``."""
        t = self.targets[uid]
        if split and len(t.needers) > self.options.relay_above:
            return self.finder(uid, t.spec, split[tuple(t.needers)])
        return self.finder(uid, t.spec)


def split_sizes(uids: Sequence[int], ctx: PlanContext) -> dict[tuple[int, ...], int]:
    """Largest read of each holder set with more than ``relay_above`` ranks (relayed) among
    targets ``uids``: the set's bytes spread over all its holders' reads, so that reading
    and the relay egress after each read spread too (a 256 MiB model loaded whole on 256
    ranks: 1 MiB per rank), never over the plan's ``max_piece_bytes`` (a large set of
    tensors already spreads at that size), nor under ``min_split_bytes`` (a request's
    first byte costs as much as megabytes of transfer)."""
    limit = ctx.options.relay_above
    total: dict[tuple[int, ...], int] = {}
    targets = ctx.targets
    for u in uids:
        t = targets[u]
        if len(t.needers) > limit:
            spec = t.spec
            numel = spec.flat_range[1] - spec.flat_range[0] if spec.flat_range is not None else math.prod(spec.shape)
            key = tuple(t.needers)
            total[key] = total.get(key, 0) + numel * dtypes.itemsize(spec.dtype)
    floor = relay_cap(ctx.options)
    return {k: max(floor, min(-(-b // len(k)), ctx.options.max_piece_bytes)) for k, b in total.items()}


def relay_cap(options: PlanOptions) -> int:
    """Smallest piece a relayed holder set's reads are cut to: ``min_split_bytes``, within
    the plan's piece bound."""
    return max(1, min(options.min_split_bytes, options.max_piece_bytes))
