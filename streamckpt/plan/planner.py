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
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..core.manifest import Manifest
from ..errors import IncompatibleStateDictError, TransformError
from .gathered import Distinct, Kinds, RankTargets, distinct as number_targets, stable_order, unique
from .needs import Need, PlanContext, coalesce_needs, fresh_copy, group_needs, make_read, split_sizes
from .data import (ALIGN, ChunkRun, Copy, IdentityView, LoadPlan, PlanOptions, Read, Segment, Target, Targets, ViewLike,
                   is_packed, message_layout, message_size, messages_of, packed_copy, ranks_of, read_cost, settle_all,
                   settle_rounds, wire_length)
from .routes import costs_of, relay_over
from ..core.targets import TargetSpec
from .balance import reader_order
from .private import absorb_small_shared, closure, edge_tag, plan_private
from .rounds import RoundPacker, reachable
from .ranksets import RankSets

__all__ = [  # the plan's data lives in plan.data; importers may take it from here
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
    distinct = number_targets(targets_by_rank)
    census = _census(distinct, view)
    if rank is None or isinstance(distinct.specs, list):
        targets: Sequence[Target] = list(map(tuple.__new__, repeat(Target), zip(distinct.specs, distinct.needers)))
    else:  # a one-rank plan from gathered pieces: only the targets it looks at are built
        targets = Targets(distinct.specs, distinct.needers)
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

    ctx = PlanContext(manifest, view, options, targets)
    focus = set(range(world)) if rank is None else {rank}
    private_keys = _private_keys(census, view) if options.read_once else set()
    if options.read_once:
        shared_keys = [k for k in census.by_key if k not in private_keys]
        if rank is None:
            private_uids = census.uids(private_keys)
        else:
            private_uids = closure(rank, census.by_key, private_keys, rank_targets[rank], ctx, distinct.specs)
        own, edges = plan_private(private_uids, focus, ctx)
    else:
        shared_keys = []
        mine = census.uids(census.by_key) if rank is None else sorted({u for u in rank_targets[rank] if u >= 0})
        own, edges = _plan_owned(mine, ctx, focus), []
    placed = _plan_shared(shared_keys, census, ctx, distinct.needers, world, private_keys, rank, rank_targets)
    rounds = RoundPacker(world, options.round_cap, max(2, options.max_peers))
    for r in placed:
        rounds.place(r, targets)
    shared = absorb_small_shared(placed, edges, targets)
    for r in own:
        rounds.place(r, targets)
    for r in edges:
        r.tag = edge_tag(r)
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
class _Census:
    """The live targets by key, and what the plan needs to know of each key."""

    by_key: dict[str, list[int]]  # live target ids, keys in first-seen order, ids ascending
    dead: list[int]  # targets of keys the view lacks
    replicated: set[str]  # keys with a live target that several ranks hold
    key_names: list[str] = field(default_factory=list)  # with key_ids: every target's key by number
    key_ids: np.ndarray | None = None
    specs: Sequence[TargetSpec] = ()  # without key_ids: the targets' specs, whose keys they are

    def keys_of(self, uids: Sequence[int]) -> set[str]:
        """The keys of targets ``uids`` (-1: none)."""
        live = [u for u in uids if u >= 0]
        if self.key_ids is None:
            return {self.specs[u][0] for u in live}
        names = self.key_names
        return {names[i] for i in set(self.key_ids[live].tolist())}

    def keys_of_ranks(self, rank_targets: Sequence[Sequence[int]], ranks: list[int]) -> set[str]:
        """The keys of the targets of ``ranks``: for a component's walk, many ranks at once."""
        if self.key_ids is None or not isinstance(rank_targets, RankTargets):
            return set().union(*(self.keys_of(rank_targets[r]) for r in ranks))
        ids = rank_targets.ids_of(ranks)
        names = self.key_names
        return {names[i] for i in unique(self.key_ids[ids[ids >= 0]])[0].tolist()}

    def uids(self, keys: Iterable[str]) -> list[int]:
        """The live targets of ``keys``, ascending."""
        by_key = self.by_key
        return sorted(u for k in keys for u in by_key[k])


def _census(distinct: Distinct, view: ViewLike) -> _Census:
    """One pass over the distinct targets: group them by key, and check each distinct
    (key, dtype, global shape) against the view once (the first failing target, in
    id order, raises)."""
    if distinct.kinds is not None:
        return _census_of_kinds(distinct, distinct.kinds, view)
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
    return _Census(by_key, dead, replicated, specs=distinct.specs)


def _census_of_kinds(distinct: Distinct, kinds: Kinds, view: ViewLike) -> _Census:
    """``_census`` from the targets' numbered kinds (gathered pieces): each kind checked
    once, in the order of its first target, and the targets grouped by key with numpy."""
    tensors = view.tensors
    transformed = getattr(view, "transformed", True)
    found, first, _ = unique(kinds.of_uid)
    by_first = np.argsort(first, kind="stable")
    key_ids: dict[str, int] = {}
    key_of_kind = np.zeros(len(kinds.table), dtype=np.int64)
    for k, u in zip(found[by_first].tolist(), first[by_first].tolist()):
        key = kinds.table[k][0]
        vt = tensors.get(key)
        if vt is not None:
            _check_target(distinct.specs[u], vt, transformed, distinct.needers[u])
        key_of_kind[k] = key_ids.setdefault(key, len(key_ids))
    keys = list(key_ids)
    alive = np.array([k in tensors for k in keys], dtype=bool)
    key_of_uid = key_of_kind[kinds.of_uid]
    grouped = stable_order(key_of_uid).tolist()
    bounds = np.cumsum(np.bincount(key_of_uid, minlength=len(keys))).tolist()
    by_key = {k: grouped[a:b] for k, a, b, live in zip(keys, [0] + bounds, bounds, alive.tolist()) if live}
    dead = np.nonzero(~alive[key_of_uid])[0].tolist()
    several = unique(key_of_uid[distinct.several])[0]
    replicated = {keys[i] for i in several.tolist() if alive[i]}
    return _Census(by_key, dead, replicated, keys, key_of_uid)


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



def _assign_readers(reads: list[Read], needs_world: int, targets: Sequence[Target], relay_above: int = 0) -> None:
    """Each shared read goes to the least-loaded rank (by bytes) among those needing it,
    the lowest rank among ties; among more than ``relay_above`` candidates (0: never), a
    relayed holder set, ties go by ``balance.reader_order`` instead, so that the readers
    of its pieces, and so the ranks that relay them, spread evenly over its grid. A run of
    reads with the same candidates keeps them in a heap of (load, tie key, rank): within
    the run only its own picks change their loads."""
    load = [0] * needs_world
    by_load = load.__getitem__
    run: list[int] | None = None
    heap: list[tuple[int, int, int]] = []
    orders: dict[int, list[int]] = {}  # holder count -> its reader_order
    for r in reads:
        first = targets[r.copies[0].target].needers
        if all(targets[c.target].needers is first for c in r.copies):
            cands: list[int] = first  # ascending
        else:
            cands = sorted({n for c in r.copies for n in targets[c.target].needers})
        relayed = relay_above and len(cands) > relay_above
        if relayed and len(cands) not in orders:
            orders[len(cands)] = reader_order(len(cands))
        if len(cands) < 8:
            run = None
            if relayed:
                best = min(zip(cands, orders[len(cands)]), key=lambda x: (load[x[0]], x[1]))[0]
            else:
                best = min(cands, key=by_load)
        else:
            if run is None or (run is not cands and run != cands):
                run = cands
                keys = orders[len(cands)] if relayed else cands
                heap = [(load[x], k, x) for k, x in zip(keys, cands)]
                heapq.heapify(heap)
            _, key, best = heap[0]
            heapq.heapreplace(heap, (load[best] + r.length, key, best))
        r.reader = best
        load[best] += r.length


def _degree(edges: list[Read], focus: set[int], targets: Sequence[Target]) -> int:
    """The most distinct groups of ranks that edge reads make one rank of ``focus`` serve."""
    groups: dict[int, set[tuple[int, ...]]] = {}
    for g in {ranks_of(r, targets) for r in edges}:
        for rank in g:
            if rank in focus:
                groups.setdefault(rank, set()).add(g)
    return max((len(v) for v in groups.values()), default=0)


# ------------------------------------------------------------------ private targets


def _private_keys(census: _Census, view: ViewLike) -> set[str]:
    """Tensors every live target of which one rank alone holds: planned near their ranks.

    Only with the identity view: under transforms one stored tensor can feed
    several names, so its reads may be shared across keys.
    """
    if not isinstance(view, IdentityView):
        return set()
    return {k for k in census.by_key if k not in census.replicated}


def _plan_owned(uids: Sequence[int], ctx: PlanContext, focus: set[int]) -> list[Read]:
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
    keys: list[str], census: _Census, ctx: PlanContext, needers: Sequence[list[int]], world: int,
    private_keys: set[str], rank: int | None, rank_targets: Sequence[Sequence[int]],
) -> list[Read]:
    """Targets more than one rank holds: planned alike on every rank of their component.

    Shared tensors fall into components (``_components``): ranks holding targets of
    one tensor, joined through tensors they share. A read's needs, reader and round
    depend only on its own component, so a one-rank plan plans only its rank's (at
    scale, a PP stage's tensors: the plan grows with the stage, not the world), and
    a shared read's tag is its index among its component's reads, which every rank of
    the component numbers alike. Reads of the component that cannot affect ``rank``'s
    are counted but not laid out (``rounds.reachable``)."""
    if not keys:
        return []
    if rank is None:
        comps = _components(keys, census, ctx, needers, world)
    else:
        comps = _component_of(rank, keys, census, ctx, needers, rank_targets)
    out: list[Read] = []
    for comp in comps:
        out.extend(_plan_component(comp, keys, census, ctx, world, private_keys, rank))
    if len(comps) > 1:  # the reads in file order, as one component's are (components share no read)
        out.sort(key=lambda r: (r.file, r.start))
    return out


def _plan_component(
    comp: _Component, keys: list[str], census: _Census, ctx: PlanContext, world: int, private_keys: set[str],
    rank: int | None,
) -> list[Read]:
    """One component's shared reads, tagged by their index among them. Other components'
    shards fence its reads as private shards do (their bytes are read there)."""
    uids = census.uids(comp.keys)
    split = split_sizes(uids, ctx) if ctx.options.read_once else {}
    needs = [n for uid in uids for n in ctx.needs(uid, split)]
    mine = set(comp.keys)
    fenced = private_keys.union(k for k in keys if k not in mine) if len(mine) < len(keys) else private_keys
    barriers = _barriers(ctx.manifest, fenced, {n.file for n in needs})
    groups = group_needs(needs, ctx.options, ctx.targets, barriers, split)
    keep = reachable(groups, rank, world, ctx.targets) if rank is not None else [True] * len(groups)
    reads: list[Read] = []
    for i, (g, k) in enumerate(zip(groups, keep)):
        if k:
            r = make_read(*g, ctx.offsets)
            r.tag = i
            reads.append(r)
    _relay(reads, ctx.targets, ctx.options)
    _assign_readers(reads, world, ctx.targets, ctx.options.relay_above)
    return reads


def _relay(reads: list[Read], targets: Sequence[Target], options: PlanOptions) -> None:
    """Reads whose one holder set has more than ``options.relay_above`` ranks travel along
    a relay grid (``routes.grid_hops``; a tree, ``routes.relay_hops``, when the holder count has a
    prime factor above ``max_peers + 1``) instead of from the reader to every holder at
    once: no rank then exchanges with more than ``max_peers`` ranks for them in a round. A read
    whose copies go to different holder sets (overlapping chunks joined them) is sent
    directly, as before."""
    limit = options.relay_above
    for r in reads:
        first = targets[r.copies[0].target].needers
        if len(first) <= limit:
            continue
        if all(targets[c.target].needers is first or targets[c.target].needers == first for c in r.copies):
            relay_over(r, first, options)


@dataclass(slots=True)
class _Component:
    """Shared tensors whose reads may involve the same ranks, and those ranks."""

    keys: list[str]  # in the census's order
    ranks: set[int]


def _components(
    keys: list[str], census: _Census, ctx: PlanContext, needers: Sequence[list[int]], world: int,
) -> list[_Component]:
    """Shared tensors joined by the ranks holding their targets, and by stored bytes two
    of them share (a hostile manifest's overlapping shards, whose needs would merge into
    one read). Every rank derives the same components from the same targets. Under
    transforms a target's bytes may come from any tensor: one component."""
    if not isinstance(ctx.view, IdentityView):
        return [_Component(list(keys), {x for k in keys for u in census.by_key[k] for x in needers[u]})]
    sets = RankSets(world)
    head = {k: sets.join_holders(needers[u] for u in census.by_key[k]) for k in keys}
    for a, b in _overlapping(ctx.manifest, keys):
        sets.union(head[a], head[b])
    comps: dict[int, _Component] = {}
    for k in keys:
        root = sets.find(head[k])
        comp = comps.get(root)
        if comp is None:
            comp = comps[root] = _Component([], set())
        comp.keys.append(k)
    for x in range(world):
        comp = comps.get(sets.find(x))
        if comp is not None:
            comp.ranks.add(x)
    return list(comps.values())


def _component_of(
    rank: int, keys: list[str], census: _Census, ctx: PlanContext, needers: Sequence[list[int]],
    rank_targets: Sequence[Sequence[int]],
) -> list[_Component]:
    """The component of ``_components`` that holds ``rank`` (none when it holds no shared
    target), found by walking out from the rank: its shared keys, their holders, their
    keys, and so on. The walk visits only that component's ranks and targets, so a
    one-rank plan does not grow with the other PP stages."""
    if not isinstance(ctx.view, IdentityView):
        return [c for c in _components(keys, census, ctx, needers, len(rank_targets)) if rank in c.ranks]
    shared = set(keys)
    near: dict[str, list[str]] = {}
    for a, b in _overlapping(ctx.manifest, keys):
        near.setdefault(a, []).append(b)
        near.setdefault(b, []).append(a)
    ranks = {rank}
    found: set[str] = set()
    todo_ranks = [rank]
    joined: set[int] = set()
    while todo_ranks:
        batch, todo_ranks = todo_ranks, []  # the order of the walk does not change what it finds
        todo_keys = [k for k in census.keys_of_ranks(rank_targets, batch) if k in shared and k not in found]
        while todo_keys:
            k = todo_keys.pop()
            if k in found:
                continue
            found.add(k)
            todo_keys.extend(x for x in near.get(k, ()) if x not in found)
            for u in census.by_key[k]:
                held = needers[u]
                if id(held) in joined:  # equal holder lists are one object (gathered.distinct)
                    continue
                joined.add(id(held))
                for x in held:
                    if x not in ranks:
                        ranks.add(x)
                        todo_ranks.append(x)
    if not found:
        return []
    return [_Component([k for k in keys if k in found], ranks)]


def _overlapping(manifest: Manifest, keys: list[str]) -> list[tuple[str, str]]:
    """Pairs of ``keys`` with shards whose stored bytes overlap in a file."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for k in keys:
        for sh in manifest.tensors[k].shards:
            if sh.byte_length > 0:
                spans.setdefault(sh.file, []).append((sh.byte_offset, sh.byte_offset + sh.byte_length, k))
    out: list[tuple[str, str]] = []
    for sp in spans.values():
        sp.sort()
        reach, owner = -1, ""
        for a, b, k in sp:
            if a < reach and k != owner:
                out.append((owner, k))
            if b > reach:
                reach, owner = b, k
    return out


def _barriers(manifest: Manifest, private_keys: set[str], files: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Per file of ``files``: the merged byte ranges of private tensors' shards, which
    shared reads never read through. Walked in manifest order, not the set's (whose order
    follows string hashes): shards then come mostly sorted, and sorting them costs the
    same in every process."""
    fences: dict[str, list[tuple[int, int]]] = {}
    for key, meta in manifest.tensors.items():
        if key in private_keys:
            for sh in meta.shards:
                if sh.file in files:
                    fences.setdefault(sh.file, []).append((sh.byte_offset, sh.byte_offset + sh.byte_length))
    return {f: _merge_ranges(ranges) for f, ranges in fences.items()}


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    ranges.sort()
    lo, hi = ranges[0]
    for a, b in ranges:
        if a <= hi:
            if b > hi:
                hi = b
        else:
            out.append((lo, hi))
            lo, hi = a, b
    out.append((lo, hi))
    return out
