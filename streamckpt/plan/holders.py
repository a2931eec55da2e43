"""Reads of files only some ranks can reach: a rank's node-local copy of a checkpoint file.

The planner assumes shared storage: any rank may read any byte, so each read goes to a rank
that needs it. A memory/peer tier breaks that for its files: only the ranks that hold a copy
can read one. ``constrain_readers`` takes a complete plan (``build_plan(..., rank=None)``, the
same on every rank) and a per-file set of ranks allowed to read it, and moves each read whose
reader may not read its file to an allowed rank: one that needs the bytes when there is one
(nothing to send), else the allowed rank with the fewest bytes to read. A read the planner
relays keeps a relay: over the same holders when its new reader is one of them, else with the
reader joined to them as the root (``Read.root``): a tier's holder sending a replicated
tensor to 128 data-parallel ranks would otherwise send it 128 times over its NIC. Files not
named are unconstrained (the bucket: anyone reads them). Pure; deterministic, so every rank
moves the same reads alike.

When a read moved, the rounds are packed again (``RoundPacker``, as the planner packs them),
so that every rank's rounds stay within the memory budget with its new reads; a moved read that
the planner kept for the edge rounds (a seam between private slices) is packed with the others.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from .data import Copy, LoadPlan, Read, Target, holders_of, ranks_of, wire_length
from .rounds import RoundPacker
from .routes import relay_over


def constrain_readers(plan: LoadPlan, holders: Mapping[str, Collection[int]]) -> int:
    """Move reads of constrained files to allowed ranks; returns how many moved.

    Raises:
        ValueError: a file that some read needs has no allowed rank (the caller must only
            constrain files that some rank holds).
    """
    if plan.rank is not None:
        raise ValueError("constrain_readers needs a plan made for every rank (build_plan(..., rank=None))")
    load = [0] * plan.world_size
    for r in plan.reads:
        load[r.reader] += r.length
    moved: set[int] = set()
    for r in plan.reads:
        allowed = holders.get(r.file)
        if allowed is None or r.reader in allowed:
            continue
        if not allowed:
            raise ValueError(f"no rank may read {r.file}")
        needers = _needers(r.copies, plan.targets)
        near = sorted(set(allowed) & needers) or sorted(allowed)
        best = min(near, key=lambda x: (load[x], x))
        load[r.reader] -= r.length
        load[best] += r.length
        r.reader = best
        r.private = needers == {best}
        if r.relay and best not in needers:
            _root_relay(r, plan)
        moved.add(id(r))
    if moved:
        _repack(plan, moved)
    return len(moved)


def _root_relay(r: Read, plan: LoadPlan) -> None:
    """A relayed read whose new reader needs none of it: the reader joins its holders as the
    root of the grid (or tree), so the piece still enters each node once and no rank sends
    it to more than ``max_peers`` others, as the planner relays it (``planner._relay``)."""
    r.root = True
    relay_over(r, holders_of(r, plan.targets), plan.options)


def _repack(plan: LoadPlan, moved: set[int]) -> None:
    """Pack every read into rounds again, alike on every rank: the planner's order, base reads
    first, then the edge reads that did not move in their edge rounds."""
    plan.edge_reads = [r for r in plan.edge_reads if id(r) not in moved]
    edges = {id(r) for r in plan.edge_reads}
    packer = RoundPacker(plan.world_size, plan.options.round_cap, max(2, plan.options.max_peers))
    for r in plan.reads:
        if id(r) not in edges:
            packer.place(r, plan.targets)
    groups: dict[int, set[tuple[int, ...]]] = {}
    for g in {ranks_of(r, plan.targets) for r in plan.edge_reads}:
        for rank in g:
            groups.setdefault(rank, set()).add(g)
    base = packer.count(range(plan.world_size))
    plan.finish(plan.place_edges(base, max((len(v) for v in groups.values()), default=0)))


def _needers(copies: Sequence[Copy], targets: Sequence[Target]) -> set[int]:
    return {n for c in copies for n in targets[c.target].needers}


def bytes_by_reader(plan: LoadPlan, rank: int, local: Collection[str]) -> tuple[int, int, int]:
    """Bytes that land in ``rank``'s targets: (read by ``rank`` from a file in ``local``,
    read by another rank from a file in ``local``, read from any other file)."""
    own = peers = rest = 0
    for r in plan.reads:
        n = sum(wire_length(c) for c in r.copies if rank in plan.targets[c.target].needers)
        if not n:
            continue
        if r.file not in local:
            rest += n
        elif r.reader == rank:
            own += n
        else:
            peers += n
    return own, peers, rest


__all__ = ["bytes_by_reader", "constrain_readers"]
