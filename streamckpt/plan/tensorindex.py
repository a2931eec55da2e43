"""A stored tensor's shards, indexed for the planner's two kinds of lookup.

Box queries (which stored parts a target box meets, and where) go through parts
sorted by their first row; flat-range lookups (a ZeRO slice over row bands) go
through the shards grouped by box with their flat ranges sorted. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable, NamedTuple, Sequence

from ..core import dtypes
from ..core.manifest import Shard
from ..core.regions import Box, flat_range_boxes, intersect, row_major_strides


class SourcePart(NamedTuple):
    """A box of a stored shard, contiguous in a frame of the shard's raw bytes (a tuple:
    every stored shard of every tensor a plan touches makes one)."""

    box: Box
    frame: Box
    base: int  # element offset of the frame's first element in the shard's raw bytes
    shard: Shard
    strides: tuple[int, ...]  # the frame's row-major element strides


class _Parts:
    """Every shard cut into contiguous boxes, sorted by dim-0 start for range queries."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        parts: list[SourcePart] = []
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # shapes repeat: one per shape
        new = tuple.__new__
        for s in shards:
            if s.flat_range is None:
                if 0 not in s.shape:
                    box = new(Box, (s.offset, s.shape))
                    st = strides.get(s.shape) or strides.setdefault(s.shape, row_major_strides(s.shape))
                    parts.append(new(SourcePart, (box, box, 0, s, st)))
            else:
                for flat_start, b in flat_range_boxes(s.box, *s.flat_range):
                    parts.append(SourcePart(b, b, flat_start - s.flat_range[0], s, row_major_strides(b.shape)))
        self.scalar = bool(parts) and parts[0].box.ndim == 0
        parts.sort(key=lambda p: p.box.offset[0] if p.box.ndim else 0)
        self.parts = parts
        self.starts = [p.box.offset[0] if p.box.ndim else 0 for p in parts]
        self.max_extent = max((p.box.shape[0] if p.box.ndim else 1 for p in parts), default=0)


class TensorIndex:
    """One tensor's shards: as parts for box queries and grouped by box for 1-D lookups,
    each built on its first use (the flat fast path never needs the parts, a box query
    never the groups)."""

    def __init__(self, shards: Sequence[Shard], dtype: str) -> None:
        self.shards = shards
        self.dtype = dtype
        self.itemsize = dtypes.itemsize(dtype)
        self._parts: _Parts | None = None
        self._boxes: list[tuple[Box, Box, list[int], list[Shard]]] | None = None

    @property
    def boxes(self) -> list[tuple[Box, Box, list[int], list[Shard]]]:
        """Per box of the shards, ordered by first row: the box, its inner dims (offset
        and shape after dim 0), the shards' flat-range stops, ascending, and the shards."""
        if self._boxes is None:
            groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Shard]] = {}
            for s in self.shards:
                groups.setdefault((s.offset, s.shape), []).append(s)
            boxes = []
            for (off, shape), group in groups.items():
                if len(group) > 1:
                    group.sort(key=lambda sh: sh.flat_range[0] if sh.flat_range else 0)
                numel = math.prod(shape)
                stops = [sh.flat_range[1] if sh.flat_range else numel for sh in group]
                boxes.append((Box(off, shape), Box(off[1:], shape[1:]), stops, group))
            boxes.sort(key=lambda x: x[0][0][0] if x[0][0] else 0)
            self._boxes = boxes
        return self._boxes

    def shards_in_rows(
        self, offset: tuple[int, ...], shape: tuple[int, ...], r0: int, r1: int, lo: int, hi: int,
    ) -> list[Shard] | None:
        """Shards whose box meets rows ``[r0, r1)`` of the row band ``offset``, ``shape``
        and whose elements, in the band's flattening, meet ``[lo, hi)``; None when a shard
        box meeting those rows is not a row band like it (the caller falls back)."""
        tail = (offset[1:], shape[1:])
        inner = math.prod(tail[1])
        out: list[Shard] = []
        for b, b_tail, stops, group in self.boxes:
            b_off, b_shape = b
            if not b_shape or b_off[0] >= r1 or b_off[0] + b_shape[0] <= r0:
                continue
            if b_tail != tail:
                return None
            d = (b_off[0] - offset[0]) * inner
            i = bisect.bisect_right(stops, lo - d)  # first shard ending after lo
            for sh in group[i:]:
                start = sh.flat_range[0] if sh.flat_range else 0
                if start + d >= hi:
                    break
                out.append(sh)
        return out

    def meets(self, box: Box) -> Iterable[tuple[SourcePart, Box]]:
        """The parts that meet ``box``, each with the intersection (a scalar part whole)."""
        index = self._parts
        if index is None:
            index = self._parts = _Parts(self.shards)
        if index.scalar or not box[1]:
            for p in index.parts:
                inter = intersect(p.box, box) if p.box[1] else p.box
                if inter is not None:
                    yield p, inter
            return
        q0 = box[0][0]
        q1 = q0 + box[1][0]
        lo = bisect.bisect_left(index.starts, q0 - index.max_extent + 1)
        hi = bisect.bisect_left(index.starts, q1)
        for p in index.parts[lo:hi]:
            pb = p.box
            if pb[0][0] + pb[1][0] > q0:
                inter = intersect(pb, box)
                if inter is not None:
                    yield p, inter
