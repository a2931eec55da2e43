"""Who writes what in a save: each distinct stored region exactly once, by one of the
ranks holding it, so that every rank uploads about the same number of bytes.

Pure (no I/O, no torch.distributed): every rank computes the same assignment from the
same gathered specs. Regions held by one rank are that rank's to write. Replicated
regions (held by several ranks: DDP, replicated norms) are the slack: large ones are
cut into row blocks (contiguous slices of the local tensor, stored as separate shards),
then all are given out largest first to the least-loaded holder. Under DDP on W ranks
each rank writes about 1/W of the model, where giving every replica to the lowest rank
made rank 0 upload all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core import dtypes
from ..core.targets import TargetSpec
from ..errors import IncompatibleStateDictError

MIN_BLOCK = 64 << 10  # never cut a replicated region into blocks smaller than this
BLOCKS_PER_SHARE = 16  # a block is at most 1/16 of a rank's fair share: greedy ends within 1/16 of even


@dataclass(frozen=True, slots=True)
class WriteItem:
    """Write ``spec`` (what is stored) taken from this rank's ``source`` tensor: rows
    ``[rows[0], rows[1])`` of its first dimension (all when None), then elements
    ``[flat[0], flat[1])`` of that, flattened (all when None)."""

    spec: TargetSpec
    source: TargetSpec
    rows: tuple[int, int] | None = None
    flat: tuple[int, int] | None = None


def piece_of(item: WriteItem, tensor: torch.Tensor) -> torch.Tensor:
    """The part of the source's local tensor that ``item`` stores (a view where it can be)."""
    t = tensor if item.rows is None else tensor[item.rows[0]:item.rows[1]]
    if item.flat is not None:
        t = t.reshape(-1)[item.flat[0]:item.flat[1]]
    return t


def split_item(item: WriteItem, max_bytes: int) -> list[WriteItem]:
    """``item`` in pieces of at most about ``max_bytes``: row blocks where rows are small
    enough, else flat ranges of the item's elements (the format stores both)."""
    spec = item.spec
    if spec.nbytes <= max_bytes:
        return [item]
    if spec.flat_range is None and item.flat is None and spec.shape and spec.shape[0] >= 2 \
            and spec.nbytes // spec.shape[0] <= max_bytes:
        base = item.rows[0] if item.rows is not None else 0
        return [WriteItem(p.spec, item.source, (base + p.rows[0], base + p.rows[1]))  # type: ignore[index]
                for p in split_rows(spec, max_bytes)]
    start = item.flat[0] if item.flat is not None else 0
    n = spec.numel
    per = max(1, max_bytes // dtypes.itemsize(spec.dtype))
    lo = spec.flat_range[0] - start if spec.flat_range is not None else -start  # stored range = lo + element index
    out = []
    for a in range(start, start + n, per):
        b = min(start + n, a + per)
        out.append(WriteItem(spec._replace(flat_range=(lo + a, lo + b)), item.source, item.rows, (a, b)))
    return out


def holders_of(all_specs: list[list[TargetSpec]]) -> dict[TargetSpec, list[int]]:
    """Each distinct region and the ranks holding it; global shapes/dtypes must agree."""
    holders: dict[TargetSpec, list[int]] = {}
    seen: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for rank, specs in enumerate(all_specs):
        for s in specs:
            prev = seen.setdefault(s.key, (s.global_shape, s.dtype, rank))
            if prev[:2] != (s.global_shape, s.dtype):
                raise IncompatibleStateDictError(
                    f"{s.key}: rank {prev[2]} holds global shape {list(prev[0])} {prev[1]}, rank {rank} "
                    f"holds {list(s.global_shape)} {s.dtype}"
                )
            ranks = holders.setdefault(s, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    return holders


def split_rows(spec: TargetSpec, block_bytes: int) -> list[WriteItem]:
    """``spec`` as row blocks of at most about ``block_bytes`` (whole rows; flat ranges and
    scalars are not cut)."""
    if spec.flat_range is not None or not spec.shape or spec.shape[0] < 2 or spec.nbytes <= block_bytes:
        return [WriteItem(spec, spec)]
    rows = spec.shape[0]
    k = min(rows, math.ceil(spec.nbytes / max(1, block_bytes)))
    cuts = [rows * i // k for i in range(k + 1)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        sub = spec._replace(offset=(spec.offset[0] + a, *spec.offset[1:]), shape=(b - a, *spec.shape[1:]))
        out.append(WriteItem(sub, spec, (a, b)))
    return out


def assign(all_specs: list[list[TargetSpec]]) -> list[list[WriteItem]]:
    """Per rank, the items it writes (in a fixed order: by key, then offset)."""
    holders = holders_of(all_specs)
    world = len(all_specs)
    load = [0] * world
    out: list[list[WriteItem]] = [[] for _ in range(world)]
    shared: list[tuple[WriteItem, list[int]]] = []
    writers = {r for ranks in holders.values() for r in ranks}
    total = sum(s.nbytes for s in holders)
    block = max(MIN_BLOCK, total // max(1, len(writers)) // BLOCKS_PER_SHARE)
    for spec, ranks in holders.items():
        if len(ranks) == 1:
            out[ranks[0]].append(WriteItem(spec, spec))
            load[ranks[0]] += spec.nbytes
        else:
            shared += [(item, ranks) for item in split_rows(spec, block)]
    shared.sort(key=lambda t: (-t[0].spec.nbytes, t[0].spec.key, t[0].spec.offset))
    for item, ranks in shared:
        rank = min(ranks, key=lambda r: (load[r], r))
        out[rank].append(item)
        load[rank] += item.spec.nbytes
    for items in out:
        items.sort(key=lambda it: (it.spec.key, it.spec.offset, it.spec.flat_range or (0, 0)))
    return out


def balance(assignment: list[list[WriteItem]]) -> float:
    """Max bytes written by one rank ÷ mean over the ranks that write (1.0: perfectly even)."""
    sizes = [sum(it.spec.nbytes for it in items) for items in assignment if items]
    if not sizes:
        return 1.0
    return max(sizes) / (sum(sizes) / len(sizes))

