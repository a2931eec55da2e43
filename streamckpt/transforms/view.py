"""The transformed view of a checkpoint and the mapping of target boxes to source boxes.

:meth:`View.map_box` is what the planner calls: it intersects a target box with the
pieces of a view tensor and returns the source boxes that tile it, so a transformed
load reads only the bytes its targets need.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..core.regions import Box, intersect, whole
from ..errors import TransformError
from .pieces import Piece, PiecedTensor, Shape, leaf_tensor, normalize, slab_axis

#: A checkpoint's tensors as the rules see them: name -> (shape, dtype code).
SourceSpec = Mapping[str, tuple[Sequence[int], str]]


@dataclass(frozen=True, slots=True)
class SourceSegment:
    """One rectangle of a target box and the source box it comes from.

    A source point ``s`` inside ``source_box`` lands at
    ``t[d] = target_box.offset[d] + (s[perm[d]] - source_box.offset[perm[d]])``;
    ``perm`` None means identity (else ``target_view = source_view.permute(perm)``).
    """

    source_key: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class ViewTensor:
    """Shape and dtypes of one name of the transformed view."""

    shape: Shape
    dtype: str          # dtype code after any cast rule
    source_dtype: str   # dtype code of the stored bytes


@dataclass(frozen=True, slots=True)
class _Entry:
    """A final view tensor with a lookup index over its pieces (built once per view)."""

    tensor: ViewTensor
    pieces: tuple[Piece, ...]
    axis: int | None        # pieces tile along this single axis -> bisect on ``starts``
    starts: tuple[int, ...]


class View:
    """The transformed view of a checkpoint: final names, shapes, dtypes and region maps."""

    def __init__(self, entries: Mapping[str, PiecedTensor], *, transformed: bool = True) -> None:
        #: the planner reports shape/dtype mismatches as TransformError when True
        self.transformed = transformed
        built: dict[str, _Entry] = {}
        for name, t in entries.items():
            axis, starts, ordered = slab_axis(t.shape, normalize(t.pieces))
            built[name] = _Entry(ViewTensor(t.shape, t.dtype, t.source_dtype), ordered, axis, starts)
        self._entries = built
        self.tensors: dict[str, ViewTensor] = {n: e.tensor for n, e in built.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"View({len(self._entries)} tensors)"

    def sources(self, name: str) -> list[str]:
        """Checkpoint names that tensor ``name`` of the view is built from (in order)."""
        seen: dict[str, None] = {}
        for p in self._entry(name).pieces:
            seen.setdefault(p.key, None)
        return list(seen)

    def is_identity(self, name: str) -> bool:
        """True when ``name`` is exactly one whole, unpermuted, uncast checkpoint tensor."""
        e = self._entry(name)
        if len(e.pieces) != 1 or e.tensor.dtype != e.tensor.source_dtype:
            return False
        p = e.pieces[0]
        return p.key == name and p.identity and p.box == whole(e.tensor.shape)

    def map_box(self, name: str, box: Box) -> list[SourceSegment]:
        """Source segments that exactly tile ``box`` of view tensor ``name`` (view coords)."""
        e = self._entry(name)
        shape = e.tensor.shape
        if len(box.shape) != len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(box.offset, box.shape, shape)
        ):
            raise TransformError(
                f"box offset={box.offset} shape={box.shape} lies outside view tensor "
                f"{name!r} of shape {shape}"
            )
        if box.is_empty():
            return []
        out: list[SourceSegment] = []
        for p in self._candidates(e, box):
            i = intersect(p.box, box)
            if i is None:
                continue
            src_off = list(p.src_offset)
            src_shape = [0] * len(src_off)
            for d, s in enumerate(p.perm):
                src_off[s] += i.offset[d] - p.box.offset[d]
                src_shape[s] = i.shape[d]
            out.append(SourceSegment(
                p.key, Box(tuple(src_off), tuple(src_shape)), i,
                None if p.identity else p.perm,
            ))
        return out

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise TransformError(f"{name!r} is not a name of the transformed view") from None

    @staticmethod
    def _candidates(e: _Entry, box: Box) -> Sequence[Piece]:
        if e.axis is None:
            return e.pieces
        k = e.axis
        lo = max(bisect.bisect_right(e.starts, box.offset[k]) - 1, 0)
        hi = bisect.bisect_left(e.starts, box.offset[k] + box.shape[k])
        return e.pieces[lo:hi]


def identity_view(source: SourceSpec) -> View:
    """The view with every checkpoint name unchanged (``transforms=None``)."""
    return View({name: leaf_tensor(name, shape, dt) for name, (shape, dt) in source.items()},
                transformed=False)
