"""Pure geometry of tensor regions: boxes, flat ranges and their byte spans.

Everything here is plain integers: no torch, no I/O. A *box* is an N-d
rectangle of a global tensor (``offset`` and ``shape`` per dim). A *flat range*
``[start, stop)`` selects elements of a box in row-major order; it decomposes
into at most ``2*ndim - 1`` sub-boxes, each contiguous in that order. A *frame*
is a box whose row-major layout defines where elements live in memory or in a
file; a sub-box of a frame occupies the byte span from its first to its last
element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

Shape = tuple[int, ...]


class Box(NamedTuple):
    """An axis-aligned N-d region: ``offset[d] <= i[d] < offset[d] + shape[d]``.

    A named tuple: immutable, hashable and cheap to create (the planner makes millions).
    """

    offset: Shape
    shape: Shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def contains(self, other: "Box") -> bool:
        return all(
            so <= oo and oo + os <= so + ss
            for so, ss, oo, os in zip(self.offset, self.shape, other.offset, other.shape)
        )

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (whose offset becomes 0)."""
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset)), self.shape)

    def shifted(self, delta: Sequence[int]) -> "Box":
        return Box(tuple(a + d for a, d in zip(self.offset, delta)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


def whole(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None if they do not meet."""
    offset = []
    shape = []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo = ao if ao > bo else bo
        ae = ao + as_
        be = bo + bs
        hi = ae if ae < be else be
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return tuple.__new__(Box, (tuple(offset), tuple(shape)))  # Box(...) at C speed


def row_major_strides(shape: Sequence[int]) -> Shape:
    """Element strides of a contiguous row-major array of ``shape``."""
    strides = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)


def flat_index(frame: Box, point: Sequence[int]) -> int:
    """Row-major element index of a global ``point`` inside ``frame``."""
    idx = 0
    for p, o, s in zip(point, frame.offset, frame.shape):
        idx = idx * s + (p - o)
    return idx


def unflatten(frame: Box, index: int) -> Shape:
    """The global point at row-major element ``index`` of ``frame``."""
    point = [0] * frame.ndim
    for d in range(frame.ndim - 1, -1, -1):
        s = frame.shape[d]
        point[d] = frame.offset[d] + (index % s if s else 0)
        index = index // s if s else 0
    return tuple(point)


def flat_range_boxes(frame: Box, start: int, stop: int) -> list[tuple[int, Box]]:
    """Decompose elements ``[start, stop)`` of ``frame`` (row-major) into sub-boxes.

    Returns ``(flat_start, box)`` pairs in order; each box is contiguous in the
    frame's row-major order and the boxes tile the range exactly. At most
    ``2*ndim - 1`` boxes for ``ndim >= 1``.
    """
    if not 0 <= start <= stop <= frame.numel:
        raise ValueError(f"flat range [{start}, {stop}) outside box of {frame.numel} elements")
    if start == stop:
        return []
    if frame.ndim == 0:
        return [(0, frame)]
    out: list[tuple[int, Box]] = []
    _decompose(frame, 0, start, stop, out, frame.offset, 0)
    return out


def _decompose(
    frame: Box, dim: int, start: int, stop: int, out: list[tuple[int, Box]],
    prefix: Shape, base: int,
) -> None:
    """Recursive helper: range [start, stop) relative to the sub-frame at ``dim``."""
    inner = math.prod(frame.shape[dim + 1:])
    ndim = frame.ndim
    if dim == ndim - 1:
        off = prefix[:dim] + (frame.offset[dim] + start,)
        shp = (1,) * dim + (stop - start,)
        out.append((base + start, Box(off, shp)))
        return
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(stop, inner)
    if first == last:
        pre = prefix[:dim] + (frame.offset[dim] + first,)
        _decompose(frame, dim + 1, first_rem, last_rem, out, pre + frame.offset[dim + 1:],
                   base + first * inner)
        return
    if first_rem:
        pre = prefix[:dim] + (frame.offset[dim] + first,)
        _decompose(frame, dim + 1, first_rem, inner, out, pre + frame.offset[dim + 1:],
                   base + first * inner)
        first += 1
    if last > first:
        off = prefix[:dim] + (frame.offset[dim] + first,) + frame.offset[dim + 1:]
        shp = (1,) * dim + (last - first,) + frame.shape[dim + 1:]
        out.append((base + first * inner, Box(off, shp)))
    if last_rem:
        pre = prefix[:dim] + (frame.offset[dim] + last,)
        _decompose(frame, dim + 1, 0, last_rem, out, pre + frame.offset[dim + 1:],
                   base + last * inner)


def flat_range_bounding_box(frame: Box, start: int, stop: int) -> Box:
    """The smallest box containing elements ``[start, stop)`` of ``frame``."""
    boxes = [b for _, b in flat_range_boxes(frame, start, stop)]
    lo = [min(b.offset[d] for b in boxes) for d in range(frame.ndim)]
    hi = [max(b.offset[d] + b.shape[d] for b in boxes) for d in range(frame.ndim)]
    return Box(tuple(lo), tuple(h - l for h, l in zip(hi, lo)))


def span(frame: Box, sub: Box) -> tuple[int, int]:
    """Element span ``[first, last + 1)`` of ``sub`` inside ``frame``'s row-major order."""
    first = last = 0
    for o, s, fo, fs in zip(sub[0], sub[1], frame[0], frame[1]):
        first = first * fs + (o - fo)
        last = last * fs + (o + s - 1 - fo)
    return first, last + 1


def runs(frame: Box, sub: Box) -> list[tuple[int, int]]:
    """The contiguous element runs ``(start, length)`` that ``sub`` occupies in ``frame``.

    One run when ``sub`` spans whole inner dims, else one per outer index.
    """
    if sub.is_empty():
        return []
    nd = frame.ndim
    if nd == 0:
        return [(0, 1)]
    # Find the innermost dim k such that sub spans the frame fully in all dims > k.
    k = nd - 1
    while k > 0 and sub.shape[k] == frame.shape[k] and sub.offset[k] == frame.offset[k]:
        k -= 1
    run_len = math.prod(sub.shape[k:])
    strides = row_major_strides(frame.shape)
    base = flat_index(frame, sub.offset)
    out = [(base, run_len)]
    for d in range(k - 1, -1, -1):
        step = strides[d]
        out = [(s + i * step, n) for i in range(sub.shape[d]) for s, n in out]
    out.sort()
    return out


def is_contiguous(frame: Box, sub: Box) -> bool:
    """Whether ``sub`` is one run of ``frame``'s row-major order (``len(runs(...)) == 1``,
    without listing the runs)."""
    if sub.is_empty():
        return False
    k = len(frame[1]) - 1
    while k > 0 and sub[1][k] == frame[1][k] and sub[0][k] == frame[0][k]:
        k -= 1
    return all(n == 1 for n in sub[1][:k])


def max_gap(frame: Box, sub: Box, cut: int, strides: Shape | None = None) -> int:
    """Largest gap (elements) between consecutive runs of ``sub`` when its dims
    before ``cut`` are fixed to single indices (pieces cut at ``cut``); ``strides``
    are the frame's, when the caller has them."""
    if strides is None:
        strides = row_major_strides(frame.shape)
    gap = 0
    for j in range(max(cut, 0) + 1, frame.ndim):
        if sub.shape[j - 1] <= 1:
            continue
        extent = sum((sub.shape[m] - 1) * strides[m] for m in range(j, frame.ndim)) + 1
        gap = max(gap, strides[j - 1] - extent)
    return gap


def cut_pieces(frame: Box, sub: Box, cut: int) -> Iterable[Box]:
    """Split ``sub`` into pieces with single indices in every dim before ``cut``."""
    if cut <= 0:
        yield sub
        return
    outer = sub.shape[:cut]
    for flat in range(math.prod(outer)):
        idx = []
        for s in reversed(outer):
            idx.append(flat % s)
            flat //= s
        idx.reverse()
        yield Box(
            tuple(o + i for o, i in zip(sub.offset[:cut], idx)) + sub.offset[cut:],
            (1,) * cut + sub.shape[cut:],
        )


def split_for_span(frame: Box, sub: Box, max_elems: int) -> list[Box]:
    """Split ``sub`` into boxes whose span in ``frame`` is at most ``max_elems``
    (or a single innermost element run, if even that is larger)."""
    first, stop = span(frame, sub)
    if stop - first <= max_elems or sub.numel <= 1:
        return [sub]
    # split along the outermost dim with extent > 1
    d = next((i for i, s in enumerate(sub.shape) if s > 1), None)
    if d is None:
        return [sub]
    if d == sub.ndim - 1:
        step = max(1, max_elems)
    else:
        per_index = span(frame, Box(sub.offset, (1,) * (d + 1) + sub.shape[d + 1:]))
        per = per_index[1] - per_index[0]
        stride = row_major_strides(frame.shape)[d]
        step = max(1, (max_elems - per) // stride + 1) if per <= max_elems else 1
    out: list[Box] = []
    for lo in range(0, sub.shape[d], step):
        n = min(step, sub.shape[d] - lo)
        piece = Box(
            sub.offset[:d] + (sub.offset[d] + lo,) + sub.offset[d + 1:],
            sub.shape[:d] + (n,) + sub.shape[d + 1:],
        )
        if n == 1 and step == 1:
            out.extend(split_for_span(frame, piece, max_elems))
        else:
            out.append(piece)
    return out


@dataclass(frozen=True, slots=True)
class CoalesceOptions:
    """Knobs for merging byte ranges into requests (zarr-style).

    A gap is read through (one request instead of two) when it is at most
    ``small_gap_bytes``, or at most ``max_gap_bytes`` and at most ``max_gap_ratio``
    of the merged request — so bridging never costs more than a few percent of
    extra bytes, and tiny gaps (a norm between two matrices) never cost a request.
    """

    max_gap_bytes: int = 1 << 20
    max_request_bytes: int = 16 << 20
    small_gap_bytes: int = 16 << 10
    max_gap_ratio: float = 1 / 64


def coalesce(
    ranges: Sequence[tuple[int, int]],
    opts: CoalesceOptions = CoalesceOptions(),
    keys: Sequence[object] | None = None,
) -> list[tuple[int, int, list[int]]]:
    """Merge ``(start, stop)`` byte ranges into requests.

    Overlapping ranges always merge; ranges whose gap is at most
    ``max_gap_bytes`` merge while the request stays within
    ``max_request_bytes`` (and, with ``keys``, only ranges of equal key — e.g.
    the same set of ranks needing them). Returns ``(start, stop, member_indices)``.
    """
    order = sorted(range(len(ranges)), key=ranges.__getitem__)
    out: list[tuple[int, int, list[int]]] = []
    group_key: object = None
    for i in order:
        s, e = ranges[i]
        if out:
            cs, ce, members = out[-1]
            overlaps = s < ce
            gap = s - ce
            merged = max(ce, e) - cs
            close = (
                (gap <= opts.small_gap_bytes or (gap <= opts.max_gap_bytes and gap <= opts.max_gap_ratio * merged))
                and merged <= opts.max_request_bytes
                and (keys is None or keys[i] == group_key)
            )
            if overlaps or close:
                members.append(i)
                out[-1] = (cs, max(ce, e), members)
                continue
        out.append((s, e, [i]))
        group_key = keys[i] if keys is not None else None
    return out


def split_aligned(frame: Box, sub: Box, max_elems: int, base: int, align: int) -> list[Box]:
    """Like ``split_for_span``, but cut where the element index ``base + i`` (``i``
    in the frame's row-major order) is a multiple of ``align``, so that pieces of
    a checksummed shard start on chunk boundaries and never share a chunk.

    A contiguous sub-box is cut at exact chunk boundaries (its pieces come from
    flat-range decomposition); a strided one into bands of whole indices along
    its outermost dim whose starts are aligned. Falls back to unaligned bands when
    no aligned band fits ``max_elems``.
    """
    if align <= 1:
        return split_for_span(frame, sub, max_elems)
    first, stop = span(frame, sub)
    if stop - first <= max_elems:
        return [sub]
    if is_contiguous(frame, sub):
        step = max(align, (max_elems // align) * align)
        cuts = [first]
        pos = first
        while stop - pos > step:
            cut = ((base + pos + step) // align) * align - base
            if cut <= pos:
                cut = ((base + pos) // align + 1) * align - base
            if cut >= stop:
                break
            cuts.append(cut)
            pos = cut
        cuts.append(stop)
        out: list[Box] = []
        for a, b in zip(cuts, cuts[1:]):
            out.extend(box for _, box in flat_range_boxes(frame, a, b))
        return out
    d = next((i for i, s in enumerate(sub.shape) if s > 1), None)
    if d is None:
        return [sub]
    stride = row_major_strides(frame.shape)[d]
    period = align // math.gcd(align, stride)
    one = span(frame, Box(sub.offset, (1,) * (d + 1) + sub.shape[d + 1:]))
    band_elems = lambda n: (n - 1) * stride + (one[1] - one[0])  # noqa: E731 - tiny local formula
    if band_elems(period) > max_elems:
        return split_for_span(frame, sub, max_elems)
    per = period
    while band_elems(per + period) <= max_elems:
        per += period
    # first aligned index i0 >= 1: (base + first + i*stride) % align == 0
    i0 = next((i for i in range(1, period + 1) if (base + first + i * stride) % align == 0), None)
    if i0 is None:
        return split_for_span(frame, sub, max_elems)
    bounds = [0] + list(range(i0, sub.shape[d], per)) + [sub.shape[d]]
    bounds = sorted(set(bounds))
    return [
        Box(
            sub.offset[:d] + (sub.offset[d] + lo,) + sub.offset[d + 1:],
            sub.shape[:d] + (hi - lo,) + sub.shape[d + 1:],
        )
        for lo, hi in zip(bounds, bounds[1:])
    ]
