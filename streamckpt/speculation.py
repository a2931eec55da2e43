"""Verifying a DCP manifest's predicted layout with bytes the load reads anyway.

A speculative DCP manifest (``formats.dcpguess``) gives each tensor chunk a
predicted byte offset: its item's head (every byte before the tensor data) was
not read. Before planning, each predicted head becomes an internal ``uint8``
tensor of the manifest, placed just before its chunk's bytes, and each rank
adds an internal target for the heads of the chunks its own targets overlap.
The planner then reads each head in the same merged range read as the tensor
bytes after it (a full load stays one read per run of items). After the load,
every head received is compared with its prediction; the ranks agree on the
result, and on any difference the load locates every item exactly and runs
again, so no call returns data from an unverified offset. Wiring only: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import torch

from .errors import CheckpointError
from .formats import dcplayout
from .formats.dcp import SPECULATION_KEY
from .manifest import Manifest, Shard, TensorMeta
from .plandata import Segment
from .regions import Box, intersect
from .targets import LocalTarget, TargetSpec

PREFIX = "__streamckpt_dcp_head__/"  # internal tensor names: never a user's key, never reported
U8 = "U8"


@dataclass(frozen=True, slots=True)
class Head:
    """The predicted head of one chunk's item: ``expected`` at ``[start, start + len)``."""

    name: str
    key: str
    box: Box
    file: str
    start: int
    expected: bytes


def is_speculative(manifest: Manifest) -> bool:
    return SPECULATION_KEY in manifest.metadata


def heads_of(manifest: Manifest, keys: Iterable[str] | None = None) -> list[Head]:
    """The predicted heads of the chunks of ``keys`` (None: of every tensor), alike on
    every rank: derived from the shared manifest. A speculative manifest whose template
    is unreadable (never one rank 0 wrote) raises."""
    doc = manifest.metadata.get(SPECULATION_KEY)
    if doc is None:
        return []
    template = dcplayout.Template.from_json(doc.get("template") if isinstance(doc, dict) else None)
    if template is None:
        raise CheckpointError(f"internal: manifest metadata {SPECULATION_KEY!r} is not a layout template")
    memo: dict[tuple[str, tuple[int, ...]], bytes | None] = {}
    out = []
    for key in manifest.tensors if keys is None else sorted(k for k in set(keys) if k in manifest.tensors):
        t = manifest.tensors[key]
        for i, sh in enumerate(t.shards):
            k = (t.dtype, sh.shape)
            if k not in memo:
                memo[k] = dcplayout.predict(template, t.dtype, sh.shape)
            head = memo[k]
            if head is not None:  # the manifest reader located this chunk exactly
                out.append(Head(f"{PREFIX}{key}/{i}", key, sh.box, sh.file, sh.byte_offset - len(head), head))
    return out


def planned_heads(manifest: Manifest, all_specs: Sequence[Sequence[TargetSpec]]) -> list[Head]:
    """The heads some rank verifies (named in the gathered target specs): the only ones
    the plan needs to know, so planning grows with the chunks ranks touch."""
    names = {s.key for specs in all_specs for s in specs if s.key.startswith(PREFIX)}
    keys = {n[len(PREFIX):].rsplit("/", 1)[0] for n in names}
    return [h for h in heads_of(manifest, keys) if h.name in names]


def augment(manifest: Manifest, heads: Sequence[Head]) -> Manifest:
    """``manifest`` plus one internal ``uint8`` tensor per head, for planning."""
    extra = {
        h.name: TensorMeta(U8, (len(h.expected),), (Shard((0,), (len(h.expected),), h.file, h.start,
                                                          len(h.expected)),))
        for h in heads
    }
    return replace(manifest, tensors={**manifest.tensors, **extra})


def head_targets(heads: Sequence[Head], specs: Sequence[TargetSpec], everything: bool,
                 device: torch.device) -> list[tuple[Head, LocalTarget]]:
    """The heads this rank must verify: those of the chunks its targets overlap (a flat
    range counts as overlapping every chunk of its tensor), or all with ``everything``."""
    boxes: dict[str, list[TargetSpec]] = {}
    for s in specs:
        if s.numel > 0:
            boxes.setdefault(s.key, []).append(s)
    out = []
    for h in heads:
        if everything or any(s.flat_range is not None or intersect(s.box, h.box) is not None
                             for s in boxes.get(h.key, ())):
            n = len(h.expected)
            out.append((h, LocalTarget(TargetSpec(h.name, U8, (n,), (0,), (n,)),
                                       torch.empty(n, dtype=torch.uint8, device=device))))
    return out


def first_mismatch(checked: Sequence[tuple[Head, LocalTarget]]) -> str | None:
    """The first head whose bytes differ from their prediction, described, or None."""
    for h, t in checked:
        if t.tensor.cpu().numpy().tobytes() != h.expected:
            return f"{h.key!r} chunk at {list(h.box.offset)} ({h.file} bytes [{h.start}, {h.start + len(h.expected)}))"
    return None


@dataclass(frozen=True, slots=True)
class _HeadTensor:
    shape: tuple[int, ...]
    dtype: str = U8
    source_dtype: str = U8


class HeadsView:
    """A transformed view that also maps the internal head tensors to themselves."""

    def __init__(self, view: Any, heads: Sequence[Head]) -> None:
        self._view = view
        self._names = {h.name for h in heads}
        self.tensors = {**view.tensors, **{h.name: _HeadTensor((len(h.expected),)) for h in heads}}

    def map_box(self, name: str, box: Box) -> Sequence[Segment]:
        if name in self._names:
            return [Segment(name, box, box, None)]
        return self._view.map_box(name, box)
