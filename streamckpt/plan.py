"""The load planner: pure, deterministic, the same on every rank.

Inputs: the checkpoint's ``Manifest``, every rank's ``TargetSpec`` list and a
name ``View`` (transforms or identity). Output: a ``LoadPlan`` — the storage
reads (file byte ranges, checksums to verify, zstd frames to decode), which
rank performs each read, which strided copies each read feeds into which
targets, and the round each read belongs to so that every rank's staging stays
within its memory budget. No I/O, no torch.distributed.

Steps: deduplicate identical targets across ranks; plan targets several ranks
hold alike on every rank (``needs`` turns targets into reads; each read goes to
the least-loaded rank needing it); plan targets one rank holds near that rank,
sharing only the checksum chunks their seams cut; pack reads into rounds.
docs/PLANNER.md states the guarantees.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import math
import zlib
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Iterable, Iterator, Sequence

from . import dtypes
from .errors import IncompatibleStateDictError, TransformError
from .manifest import Manifest, Shard
from .needs import (
    FrameOffsets,
    Need,
    NeedFinder,
    coalesce_needs,
    fresh_copy,
    group_needs,
    make_read,
    need_bytes,
)
from .plandata import (
    ALIGN,
    ChunkRun,
    Copy,
    IdentityView,
    LoadPlan,
    PlanOptions,
    Read,
    Segment,
    Target,
    ViewLike,
    costs_of,
    is_packed,
    message_layout,
    message_size,
    messages_of,
    packed_copy,
    ranks_of,
    read_cost,
    settle_all,
    settle_rounds,
    wire_length,
)
from .regions import Box, CoalesceOptions
from .rounds import RoundPacker, reachable
from .targets import TargetSpec

__all__ = [  # the plan's data lives in plandata; importers may take it from here
    "ALIGN", "ChunkRun", "Copy", "IdentityView", "LoadPlan", "PlanOptions", "Read", "Segment", "Target", "ViewLike",
    "build_plan", "costs_of", "is_packed", "message_layout", "message_size", "messages_of", "packed_copy", "ranks_of",
    "read_cost", "settle_all", "settle_rounds", "wire_length",
]

log = logging.getLogger(__name__)


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
    distinct = _dedupe(targets_by_rank)
    census = _census(distinct, view)
    targets = list(map(tuple.__new__, repeat(Target), zip(distinct.specs, distinct.needers)))
    rank_targets = distinct.rank_targets
    missing: list[list[str]] = [[] for _ in range(world)]
    for u in census.dead:
        for r in targets[u].needers:
            missing[r].append(targets[u].spec.key)
    if census.dead:
        alive = [True] * len(targets)
        for u in census.dead:
            alive[u] = False
        rank_targets = [[u if alive[u] else -1 for u in mine] for mine in rank_targets]
    unexpected = sorted(k for k in view.tensors if k not in census.by_key)

    ctx = _Ctx(manifest, view, options, targets)
    focus = set(range(world)) if rank is None else {rank}
    private_keys = _private_keys(census, view) if options.read_once else set()
    if options.read_once:
        shared_uids = census.uids(k for k in census.by_key if k not in private_keys)
        if rank is None:
            private_uids = census.uids(private_keys)
        else:
            private_uids = _closure(rank, census.by_key, private_keys, rank_targets[rank], ctx)
        own, edges = _plan_private(private_uids, focus, ctx)
    else:
        shared_uids = []
        mine = census.uids(census.by_key) if rank is None else sorted({u for u in rank_targets[rank] if u >= 0})
        own, edges = _plan_owned(mine, ctx, focus), []
    placed = _plan_shared(shared_uids, ctx, world, private_keys, rank)
    rounds = RoundPacker(world, options.round_cap)
    for i, r in enumerate(placed):
        if r is not None:
            r.tag = i
            rounds.place(r, targets)
    shared = [r for r in placed if r is not None]
    for r in own:
        rounds.place(r, targets)
    for r in edges:
        r.tag = _edge_tag(r)
    if rank is not None:
        held = set(rank_targets[rank])
        shared = [r for r in shared if r.reader == rank or not held.isdisjoint([c.target for c in r.copies])]
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
    offsets: FrameOffsets = field(default_factory=FrameOffsets)
    finder: NeedFinder = field(init=False)

    def __post_init__(self) -> None:
        self.finder = NeedFinder(self.manifest, self.view, self.options, self.offsets)

    def needs(self, uid: int) -> list[Need]:
        return self.finder(uid, self.targets[uid].spec)


@dataclass(slots=True)
class _Distinct:
    """The distinct target specs (ids in first-seen order) and the ranks holding each."""

    specs: list[TargetSpec]
    needers: list[list[int]]
    rank_targets: list[list[int]]  # per rank: the id of each of its specs
    several: list[int]  # ids held by more than one rank


def _dedupe(targets_by_rank: Sequence[Sequence[TargetSpec]]) -> _Distinct:
    """Number the distinct specs and list each one's holders.

    The targets one rank alone holds share one holder list per rank (none is
    ever appended to): at scale they are most targets, and fewer live objects
    make the collection after the plan cheaper.
    """
    uid_of: dict[TargetSpec, int] = {}
    seen = uid_of.setdefault
    rank_targets: list[list[int]] = []
    needers: list[list[int]] = []
    several: list[int] = []
    for r, specs in enumerate(targets_by_rank):
        before = len(uid_of)
        mine = [seen(s, len(uid_of)) for s in specs]
        rank_targets.append(mine)
        fresh = len(uid_of) - before
        needers.extend([[r]] * fresh)  # first held here: one shared list
        if fresh == len(mine):
            continue
        for u in mine:
            if u < before:
                held = needers[u]
                if held[-1] != r:
                    if len(held) == 1:
                        needers[u] = [held[0], r]  # a shared one-rank list: copied, never appended to
                        several.append(u)
                    else:
                        held.append(r)
    equal: dict[tuple[int, ...], list[int]] = {}
    for u in several:  # equal holder lists of several ranks: one object (see rounds.reachable)
        needers[u] = equal.setdefault(tuple(needers[u]), needers[u])
    return _Distinct(list(uid_of), needers, rank_targets, several)


@dataclass(slots=True)
class _Census:
    """The live targets by key, and what the plan needs to know of each key."""

    by_key: dict[str, list[int]]  # live target ids, keys in first-seen order, ids ascending
    dead: list[int]  # targets of keys the view lacks
    replicated: set[str]  # keys with a live target that several ranks hold

    def uids(self, keys: Iterable[str]) -> list[int]:
        """The live targets of ``keys``, ascending."""
        by_key = self.by_key
        return sorted(u for k in keys for u in by_key[k])


def _census(distinct: _Distinct, view: ViewLike) -> _Census:
    """One pass over the distinct targets: group them by key, and check each distinct
    (key, dtype, global shape) against the view once (the first failing target, in
    id order, raises)."""
    tensors = view.tensors
    transformed = getattr(view, "transformed", True)
    info: dict[str, tuple[list[int], str, tuple[int, ...], list[tuple[str, tuple[int, ...]]]]] = {}
    dead: list[int] = []
    needers = distinct.needers
    for uid, spec in enumerate(distinct.specs):
        key = spec[0]
        got = info.get(key)
        if got is None:
            vt = tensors.get(key)
            if vt is None:
                dead.append(uid)
                continue
            _check_target(spec, vt, transformed, needers[uid])
            got = info[key] = ([], spec[1], spec[2], [(spec[1], spec[2])])
        elif (spec[1] != got[1] or spec[2] != got[2]) and (spec[1], spec[2]) not in got[3]:
            _check_target(spec, tensors[key], transformed, needers[uid])
            got[3].append((spec[1], spec[2]))
        got[0].append(uid)
    by_key = {k: v[0] for k, v in info.items()}
    replicated = {k for k in (distinct.specs[u][0] for u in distinct.several) if k in by_key}
    return _Census(by_key, dead, replicated)


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



def _assign_readers(reads: list[Read], needs_world: int, targets: list[Target]) -> None:
    """Each shared read goes to the least-loaded rank (by bytes) among those needing it,
    the lowest rank among ties. A run of reads with the same candidates keeps them in
    a heap of (load, rank): within the run only its own picks change their loads."""
    load = [0] * needs_world
    by_load = load.__getitem__
    run: list[int] | None = None
    heap: list[tuple[int, int]] = []
    for r in reads:
        first = targets[r.copies[0].target].needers
        if all(targets[c.target].needers is first for c in r.copies):
            cands: list[int] = first  # ascending
        else:
            cands = sorted({n for c in r.copies for n in targets[c.target].needers})
        if len(cands) < 8:
            run = None
            best = min(cands, key=by_load)
        else:
            if run is None or (run is not cands and run != cands):
                run = cands
                heap = [(load[x], x) for x in cands]
                heapq.heapify(heap)
            best = heap[0][1]
            heapq.heapreplace(heap, (load[best] + r.length, best))
        r.reader = best
        load[best] += r.length


def _degree(edges: list[Read], focus: set[int], targets: list[Target]) -> int:
    """The most distinct groups of ranks that edge reads make one rank of ``focus`` serve."""
    groups: dict[int, set[tuple[int, ...]]] = {}
    for g in {ranks_of(r, targets) for r in edges}:
        for rank in g:
            if rank in focus:
                groups.setdefault(rank, set()).add(g)
    return max((len(v) for v in groups.values()), default=0)


def _edge_tag(r: Read) -> int:
    """A tag both ends of an edge read derive alike (they number their reads differently)."""
    return (zlib.crc32(r.file.encode()) * 1_000_003 + r.start) % (1 << 30)


# ------------------------------------------------------------------ private targets


def _private_keys(census: _Census, view: ViewLike) -> set[str]:
    """Tensors every live target of which one rank alone holds: planned near their ranks.

    Only with the identity view: under transforms one stored tensor can feed
    several names, so its reads may be shared across keys.
    """
    if not isinstance(view, IdentityView):
        return set()
    return {k for k in census.by_key if k not in census.replicated}


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
    box = Box(s.offset, s.shape)
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


def _closure(rank: int, by_key: dict[str, list[int]], private_keys: set[str], mine: Sequence[int],
             ctx: _Ctx) -> list[int]:
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
        regions = [_region(targets[u].spec) for u in uids]
        ours = [regions[i] for i, u in enumerate(uids) if u in own]
        touched = [sb for sb in map(_region, ctx.manifest.tensors[key].shards)
                   if any(_meets(*region, *sb) for region in ours)]
        out.extend(u for u, region in zip(uids, regions)
                   if u in own or any(_meets(*region, *sb) for sb in touched))
    return out


def _plan_owned(uids: Sequence[int], ctx: _Ctx, focus: set[int]) -> list[Read]:
    """read_once=False: every needer (of those in ``focus``) reads its own needs."""
    needs: list[Need] = []
    for uid in uids:
        for need in ctx.needs(uid):
            for o in ctx.targets[uid].needers:
                if o not in focus:
                    continue
                needs.append(Need(need.file, need.fetch_start, need.fetch_stop, need.shard, need.chunk_lo,
                                   need.chunk_hi, need.raw_start, fresh_copy(need.copy), o, need.raw_total))
    return coalesce_needs(needs, ctx.options, ctx.offsets, [])


def _plan_shared(
    uids: Sequence[int], ctx: _Ctx, world: int, private_keys: set[str], rank: int | None,
) -> list[Read | None]:
    """Targets more than one rank holds: planned alike on every rank. With ``rank``,
    reads that cannot affect that rank's are counted (their index is a tag) but
    not laid out: None in their place."""
    if not uids:
        return []
    needs = [n for uid in uids for n in ctx.needs(uid)]
    fences: dict[str, list[tuple[int, int]]] = {}
    for key in private_keys:
        for sh in ctx.manifest.tensors[key].shards:
            fences.setdefault(sh.file, []).append((sh.byte_offset, sh.byte_offset + sh.byte_length))
    files = {n.file for n in needs}
    barriers = {f: _merge_ranges(fences[f]) for f in files if f in fences}
    groups = group_needs(needs, ctx.options, ctx.targets, barriers)
    keep = reachable(groups, rank, world, ctx.targets) if rank is not None else [True] * len(groups)
    reads = [make_read(*g, ctx.offsets) if k else None for g, k in zip(groups, keep)]
    _assign_readers([r for r in reads if r is not None], world, ctx.targets)
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
    by_file: dict[str, list[Need]] = {}
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
        _private_reads(file, units, focus, ctx, own, edges)
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


def _private_reads(
    file: str, units: list[list[Need]], focus: set[int], ctx: _Ctx, own: list[Read], edges: list[Read],
) -> None:
    """Turn chains into reads. Chains of the same ranks merge across small gaps
    inside one shard, or with no gap at all, never across another's bytes: every
    rank of an edge read sees the same chains between its ends, so all of them
    merge alike."""
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


def _edge_read(file: str, start: int, stop: int, members: list[Need], ctx: _Ctx) -> Read:
    """A read several ranks' private targets share. Its reader needs most of it;
    among ranks needing comparable shares, a hash of the read spreads the load."""
    read = make_read(file, start, stop, members, -1, ctx.offsets)
    want: dict[int, int] = {}
    for n in members:
        want[n.owner] = want.get(n.owner, 0) + n.copy.length
    top = max(want.values())
    cands = sorted(r for r, w in want.items() if 2 * w >= top)
    read.reader = cands[_edge_tag(read) % len(cands)]
    return read


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

