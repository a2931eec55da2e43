"""Targets one rank alone holds (ZeRO slices, unreplicated shards): planned near each rank.

With ``rank=r`` the planner looks only at the *closure* of r's targets: every
single-holder target that meets a stored shard one of r's targets meets. Needs
whose fetched bytes overlap form chains; only the checksum chunks two ranks both
touch become *edge reads*, read once by one of them and sent to the other, and
every rank of an edge read derives it alike. docs/PLANNER.md, step 4. Pure.
"""

from __future__ import annotations

import bisect
import math
import zlib
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..core import dtypes
from ..core.manifest import Shard
from ..core.regions import Box, CoalesceOptions
from ..core.targets import TargetSpec
from .data import Copy, Read, Target, ranks_of
from .gathered import LazySpecs
from .needs import FrameOffsets, Need, PlanContext, make_read, need_bytes


def edge_tag(r: Read) -> int:
    """A tag both ends of an edge read derive alike (they number their reads differently)."""
    return (zlib.crc32(r.file.encode()) * 1_000_003 + r.start) % (1 << 30)


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


def _region(s: TargetSpec | Shard) -> tuple[Box, tuple[int, int]]:
    """A target's or shard's bounding box and the dim-0 rows it covers."""
    box = tuple.__new__(Box, (s.offset, s.shape))  # a Box at C speed: closures make thousands
    return box, _rows(box, s.flat_range)


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


def closure(rank: int, by_key: dict[str, list[int]], private_keys: set[str], mine: Sequence[int],
             ctx: PlanContext, specs: Sequence[TargetSpec] = ()) -> list[int]:
    """Private targets whose needs can share a stored shard with ``rank``'s own.

    Every target that meets a shard one of the rank's targets meets is in it,
    so every chain of overlapping reads through such a shard is seen whole —
    the same on each rank of the chain.
    """
    targets = ctx.targets
    own = {u for u in mine if u >= 0}
    own_keys = {targets[u].spec.key for u in own}
    out: list[int] = []
    for key, uids in by_key.items():
        if key not in own_keys or key not in private_keys:
            continue
        if isinstance(specs, LazySpecs):
            out.extend(_closure_of_rows(key, uids, own, specs, ctx))
            continue
        regions = [_region(targets[u].spec) for u in uids]
        ours = [regions[i] for i, u in enumerate(uids) if u in own]
        touched = [sb for sb in map(_region, ctx.manifest.tensors[key].shards)
                   if any(_meets(*region, *sb) for region in ours)]
        out.extend(u for u, region in zip(uids, regions)
                   if u in own or any(_meets(*region, *sb) for sb in touched))
    return out


def _closure_of_rows(key: str, uids: list[int], own: set[int], specs: LazySpecs, ctx: PlanContext) -> list[int]:
    """``closure``'s test for one key's targets from gathered pieces, without building
    their specs: the key's boxes are few (its TP boxes), and each target's rows come
    from its flat range, so the rows of every target are tested at once with numpy."""
    boxes, which, rows = specs.rows(uids)
    regions = [tuple.__new__(Box, b) for b in boxes]
    ours_at = [i for i, u in enumerate(uids) if u in own]
    ours = [(regions[int(which[i])], (int(rows[i, 0]), int(rows[i, 1]))) for i in ours_at]
    touched = [sb for sb in map(_region, ctx.manifest.tensors[key].shards)
               if any(_meets(*region, *sb) for region in ours)]
    hit = np.zeros(len(uids), dtype=bool)
    hit[ours_at] = True
    for b, box in enumerate(regions):
        mine = which == b
        for sbox, (s0, s1) in touched:  # _meets, with the rows of every target of this box at once
            if box.ndim == 0 or sbox.ndim == 0:
                hit |= mine
            elif all(box.offset[d] < sbox.offset[d] + sbox.shape[d] and sbox.offset[d] < box.offset[d] + box.shape[d]
                     for d in range(1, box.ndim)):
                hit |= mine & (rows[:, 0] < s1) & (s0 < rows[:, 1])
    return np.asarray(uids, dtype=np.int64)[hit].tolist()


def plan_private(uids: Sequence[int], focus: set[int], ctx: PlanContext) -> tuple[list[Read], list[Read]]:
    """Reads of single-holder targets: each rank's own, and the shared "edge" reads.

    Needs whose fetched bytes overlap form chains (ZeRO slices meeting inside a
    checksum chunk). A contiguous need is cut at chunk boundaries so only the
    chunks two ranks both touch are read once and shared; the rest stays
    private. Returns reads for ranks in ``focus``: (private reads, edge reads).
    """
    by_file: dict[str, list[Need]] = {}
    for uid in uids:
        owner = ctx.targets[uid].needers[0]
        for need in ctx.needs(uid):
            need.owner = owner
            by_file.setdefault(need.file, []).append(need)
    own: list[Read] = []
    edges: list[Read] = []
    extents = ShardExtents(ctx)
    for file in sorted(by_file):
        ns = by_file[file]
        ns.sort(key=lambda n: (n.fetch_start, n.fetch_stop))
        units: list[list[Need]] = []
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
        _private_reads(file, units, focus, ctx, own, edges, extents)
    return own, edges


def _chains(ns: Sequence[Need]) -> list[list[Need]]:
    """Maximal runs of needs (sorted by start) whose fetched bytes overlap."""
    out: list[list[Need]] = []
    stop = -1
    for n in ns:
        if out and n.fetch_start < stop:
            out[-1].append(n)
            stop = max(stop, n.fetch_stop)
        else:
            out.append([n])
            stop = n.fetch_stop
    return out


class ShardExtents:
    """Per file, the byte ranges the manifest's shards occupy (built on first use):
    whether a gap between two shards holds no tensor bytes at all (a DCP item's ZIP
    headers between two tensors, say). Derived from the manifest alone, so every
    rank answers alike."""

    def __init__(self, ctx: PlanContext) -> None:
        self._ctx = ctx
        self._by_file: dict[str, tuple[list[int], list[int]]] | None = None

    def bare(self, file: str, lo: int, hi: int) -> bool:
        """No shard has bytes in ``[lo, hi)``."""
        if self._by_file is None:
            spans: dict[str, list[tuple[int, int]]] = {}
            for t in self._ctx.manifest.tensors.values():
                for sh in t.shards:
                    if sh.byte_length > 0:
                        spans.setdefault(sh.file, []).append((sh.byte_offset, sh.byte_offset + sh.byte_length))
            self._by_file = {}
            for f, sp in spans.items():
                sp.sort()
                ends, reach = [], 0
                for _, b in sp:  # running maximum: shards may nest or overlap in a hostile manifest
                    reach = max(reach, b)
                    ends.append(reach)
                self._by_file[f] = ([a for a, _ in sp], ends)
        starts, ends = self._by_file.get(file, ([], []))
        i = bisect.bisect_right(ends, lo)  # first shard (in start order) still reaching past lo
        return i == len(starts) or starts[i] >= hi


def _bare_gap(last: Need, stop: int, nxt: Need, extents: ShardExtents) -> bool:
    """The bytes between one shard's end and the next shard's start hold no tensor
    bytes. Asked only where both reads meet their shards' ends (so a slice of a
    native checkpoint, whose gaps are other rows, never builds the index)."""
    a, b = last.shard, nxt.shard
    return (
        stop == a.byte_offset + a.byte_length and nxt.fetch_start == b.byte_offset
        and extents.bare(a.file, stop, nxt.fetch_start)
    )


def _near_gap(last: Need, stop: int, nxt: Need, extents: ShardExtents) -> bool:
    """The gap holds only bytes of the two needs' own shards (the rest of the one,
    the start of the other) and bytes of no shard. Every target with bytes there
    meets a shard the rank's own needs meet, so it is in the rank's closure: the
    rank's own plan and the all-ranks plan see the same units in the gap. For a
    private read (one owner) only: a DCP item's predicted head and the rows of a
    norm just after it become one request."""
    a, b = last.shard, nxt.shard
    lo = max(stop, a.byte_offset + a.byte_length)
    hi = min(nxt.fetch_start, b.byte_offset)
    return a.file == b.file and (lo >= hi or extents.bare(a.file, lo, hi))


def _private_reads(
    file: str, units: list[list[Need]], focus: set[int], ctx: PlanContext, own: list[Read], edges: list[Read],
    extents: ShardExtents,
) -> None:
    """Turn chains into reads. Chains of the same ranks merge across small gaps
    inside one shard, across small gaps that hold no shard's bytes (between the
    items of a DCP file), or with no gap at all; never across another's bytes:
    every rank of an edge read sees the same chains between its ends, so all of
    them merge alike."""
    opts = ctx.options
    small = CoalesceOptions().small_gap_bytes
    ratio = CoalesceOptions().max_gap_ratio
    cur: list[Need] = []
    cur_owners: frozenset[int] = frozenset()
    start = stop = 0

    def flush() -> None:
        if not cur:
            return
        if len(cur_owners) == 1:
            own.append(make_read(file, start, stop, list(cur), next(iter(cur_owners)), ctx.offsets))
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
                and (gap <= small or (gap <= opts.max_gap_bytes and gap <= ratio * merged))
                and merged <= max(opts.max_piece_bytes, 1)
                and (gap == 0 or unit[0].shard is cur[-1].shard or _bare_gap(cur[-1], stop, unit[0], extents)
                     or (len(owners) == 1 and _near_gap(cur[-1], stop, unit[0], extents)))
            ):
                cur.extend(unit)
                stop = u_stop
                continue
            flush()
        if owners & focus:
            cur.extend(unit)
            cur_owners, start, stop = owners, u_start, u_stop
    flush()


def _edge_read(file: str, start: int, stop: int, members: list[Need], ctx: PlanContext) -> Read:
    """A read several ranks' private targets share. Its reader needs most of it;
    among ranks needing comparable shares, a hash of the read spreads the load."""
    read = make_read(file, start, stop, members, -1, ctx.offsets)
    want: dict[int, int] = {}
    for n in members:
        want[n.owner] = want.get(n.owner, 0) + n.copy.length
    top = max(want.values())
    cands = sorted(r for r, w in want.items() if 2 * w >= top)
    read.reader = cands[_spread(read) % len(cands)]
    return read


def _spread(r: Read) -> int:
    """A hash of where a read starts, alike on every rank, that picks its reader among
    equals. Its low bits must vary from read to read: ``edge_tag``'s do not (starts are
    aligned, so its parity was the file's), and a whole file went to one rank, leaving
    the other ranks' storage connections idle for rounds on end."""
    return zlib.crc32(r.start.to_bytes(8, "little"), zlib.crc32(r.file.encode()))


def _split_contested(comp: list[Need], offsets: "FrameOffsets") -> list[Need]:
    """Cut contiguous needs so that the chunks another rank also touches stand apart."""
    spans = [(n.chunk_lo, n.chunk_hi, n.owner) for n in comp]
    out: list[Need] = []
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
            piece = need_bytes(n.shard, a, b, part, isz, offsets)
            piece.owner = n.owner
            out.append(piece)
    return out



SMALL_SHARED = 64 << 10  # a shared read this small rides on a neighbouring edge read


def absorb_small_shared(shared: list[Read], edges: list[Read], targets: Sequence[Target]) -> list[Read]:
    """Fold each small raw shared read into an edge read that touches it in the file and
    serves exactly its ranks; returns the shared reads left.

    A replicated norm between two column-split matrices is otherwise a request of a few
    hundred bytes of its own, and small requests cost a store nearly what large ones do
    (under a bandwidth cap, 76 of them cost a reshard ~0.1 s). Alike on every rank: the
    shared read is global and every rank of the edge read sees it, and only the ranks of
    the edge read drop the shared read, so the shared reads' rounds (already packed) and
    tags stay the same everywhere. Call before edge tags and edge rounds are given.
    """
    ends: dict[tuple[str, int], Read] = {}
    starts: dict[tuple[str, int], Read] = {}
    for e in edges:
        if not e.zstd:
            ends.setdefault((e.file, e.stop), e)
            starts.setdefault((e.file, e.start), e)
    kept: list[Read] = []
    for s in shared:
        host = None
        if not s.zstd and s.length <= SMALL_SHARED:
            group = ranks_of(s, targets)
            for cand in (ends.get((s.file, s.start)), starts.get((s.file, s.stop))):
                if cand is not None and ranks_of(cand, targets) == group:
                    host = cand
                    break
        if host is None:
            kept.append(s)
            continue
        ends.pop((host.file, host.stop), None)
        starts.pop((host.file, host.start), None)
        _merge_into(host, s)
        ends.setdefault((host.file, host.stop), host)
        starts.setdefault((host.file, host.start), host)
    return kept


def _merge_into(host: Read, s: Read) -> None:
    """``host`` also fetches ``s``'s adjacent bytes and serves its copies."""
    if s.start == host.stop:
        shift, host.stop = host.length, s.stop
        host.copies = host.copies + [replace(c, offset=c.offset + shift) for c in s.copies]
        host.runs = host.runs + s.runs
    else:
        shift, host.start = s.length, s.start
        host.copies = [replace(c, offset=c.offset + shift) for c in host.copies] + list(s.copies)
        host.runs = s.runs + host.runs
    host.staging += s.staging
