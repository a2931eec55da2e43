"""Piece algebra: a view tensor as rectangles that are affine images of source boxes.

Every tensor of the transformed view is a list of *pieces*: rectangles of the view
tensor, each an offset shift plus dimension permutation of a box of one checkpoint
tensor. Concatenation and splits shift pieces, transposes permute them; nothing here
touches data, so mapping a target box back to the checkpoint stays box arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..core.regions import Box, intersect, whole

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangle ``box`` of a view tensor that is an affine image of source ``key``.

    View point ``t`` in ``box`` comes from source point ``s`` with
    ``s[perm[d]] = src_offset[perm[d]] + t[d] - box.offset[d]``.
    """

    box: Box
    key: str
    src_offset: Shape
    perm: Shape

    @property
    def identity(self) -> bool:
        return all(p == d for d, p in enumerate(self.perm))


@dataclass(frozen=True, slots=True)
class PiecedTensor:
    """A view tensor while rules are being applied: shape, dtypes and its pieces."""

    shape: Shape
    dtype: str
    source_dtype: str
    pieces: tuple[Piece, ...]


def leaf_tensor(key: str, shape: Sequence[int], dtype: str) -> PiecedTensor:
    """Checkpoint tensor ``key`` as it is stored: one whole, unpermuted piece."""
    dims = tuple(int(s) for s in shape)
    n = len(dims)
    piece = Piece(whole(dims), key, (0,) * n, tuple(range(n)))
    return PiecedTensor(dims, dtype, dtype, (piece,))


def slab(shape: Shape, dim: int, start: int, length: int) -> Box:
    """The box ``[start, start + length)`` along ``dim``, whole along every other dim."""
    return Box(tuple(start if d == dim else 0 for d in range(len(shape))),
               tuple(length if d == dim else s for d, s in enumerate(shape)))


def shift(pieces: Iterable[Piece], dim: int, delta: int) -> list[Piece]:
    """Move pieces by ``delta`` along view dim ``dim`` (concatenation)."""
    out = []
    for p in pieces:
        off = list(p.box.offset)
        off[dim] += delta
        out.append(Piece(Box(tuple(off), p.box.shape), p.key, p.src_offset, p.perm))
    return out


def restrict(pieces: Iterable[Piece], region: Box) -> list[Piece]:
    """The parts of ``pieces`` inside ``region``, re-based so ``region.offset`` is 0."""
    out = []
    for p in pieces:
        i = intersect(p.box, region)
        if i is None:
            continue
        src = list(p.src_offset)
        for d, e in enumerate(p.perm):
            src[e] += i.offset[d] - p.box.offset[d]
        rel = tuple(a - b for a, b in zip(i.offset, region.offset))
        out.append(Piece(Box(rel, i.shape), p.key, tuple(src), p.perm))
    return out


def permute(pieces: Iterable[Piece], dims: Shape) -> list[Piece]:
    """View dim ``d`` of the result is view dim ``dims[d]`` of the input."""
    return [
        Piece(
            Box(tuple(p.box.offset[d] for d in dims), tuple(p.box.shape[d] for d in dims)),
            p.key, p.src_offset, tuple(p.perm[d] for d in dims),
        )
        for p in pieces
    ]


def concat(parts: Sequence[PiecedTensor], dim: int) -> PiecedTensor:
    """``torch.cat(parts, dim)`` on pieces; dtypes and the other dims come from ``parts[0]``."""
    pieces: list[Piece] = []
    at = 0
    for t in parts:
        pieces.extend(shift(t.pieces, dim, at))
        at += t.shape[dim]
    first = parts[0]
    shape = first.shape[:dim] + (at,) + first.shape[dim + 1:]
    return PiecedTensor(shape, first.dtype, first.source_dtype, tuple(pieces))


def cut(t: PiecedTensor, dim: int, sizes: Sequence[int]) -> list[PiecedTensor]:
    """``t.split(sizes, dim)`` on pieces."""
    out = []
    at = 0
    for size in sizes:
        region = slab(t.shape, dim, at, size)
        out.append(PiecedTensor(region.shape, t.dtype, t.source_dtype, tuple(restrict(t.pieces, region))))
        at += size
    return out


def _try_merge(a: Piece, b: Piece) -> Piece | None:
    """``a`` and ``b`` as one piece if they are adjacent in the view and in the source."""
    if a.key != b.key or a.perm != b.perm:
        return None
    dim = None
    for d in range(len(a.perm)):
        if a.box.offset[d] == b.box.offset[d] and a.box.shape[d] == b.box.shape[d]:
            continue
        if dim is not None or a.box.offset[d] + a.box.shape[d] != b.box.offset[d]:
            return None
        dim = d
    if dim is None:
        return None
    e = a.perm[dim]
    expect = list(a.src_offset)
    expect[e] += a.box.shape[dim]
    if tuple(expect) != b.src_offset:
        return None
    shape = list(a.box.shape)
    shape[dim] += b.box.shape[dim]
    return Piece(Box(a.box.offset, tuple(shape)), a.key, a.src_offset, a.perm)


def normalize(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Drop empty pieces and merge neighbours that read one contiguous source box."""
    items = sorted((p for p in pieces if not p.box.is_empty()),
                   key=lambda p: (p.key, p.perm, p.box.offset))
    changed = True
    while changed and len(items) > 1:
        changed = False
        out: list[Piece] = []
        for p in items:
            if out:
                m = _try_merge(out[-1], p)
                if m is not None:
                    out[-1] = m
                    changed = True
                    continue
            out.append(p)
        items = out
    return tuple(sorted(items, key=lambda p: p.box.offset))


def slab_axis(shape: Shape, pieces: tuple[Piece, ...]) -> tuple[int | None, tuple[int, ...], tuple[Piece, ...]]:
    """One axis along which the pieces are slabs ``(axis, starts, ordered)``, so lookups can bisect."""
    if len(pieces) <= 4 or not shape:
        return None, (), pieces
    for k in range(len(shape)):
        if all(
            p.box.offset[d] == 0 and p.box.shape[d] == shape[d]
            for p in pieces for d in range(len(shape)) if d != k
        ):
            ordered = tuple(sorted(pieces, key=lambda p: p.box.offset[k]))
            return k, tuple(p.box.offset[k] for p in ordered), ordered
    return None, (), pieces
