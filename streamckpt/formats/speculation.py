"""Verifying a DCP manifest's predicted layout with bytes the load reads anyway.

A speculative DCP manifest (``formats.dcpguess``) gives each tensor chunk a
predicted byte offset: its item's head (every byte before the tensor data) was
not read. Before planning, the predictions to verify become internal ``uint8``
tensors of the manifest (*checks*), and each rank adds an internal target for the
checks of the chunks its own targets overlap. A check is one stretch of a file:

* a *pair*: one item's tail (every byte after its tensor data: the ZIP directory,
  whose offsets, sizes and CRC-32s pin the item's layout, ``dcplayout.tail_matches``)
  and the next item's head right after it, so one small read verifies two items.
  Both boundaries of a small item (≤ 16 KiB of tensor bytes, a norm) are pairs, since
  any read of it spans them; the other items pair up in offset order;
* a *head* alone, for an item left without a partner.

The planner reads each check in the same merged range read as neighbouring tensor
bytes where it can (a full load stays one read per run of items; a TP slice whose
rows start or end an item reads its check with them). After the load every part
of a check that covers a chunk this rank loads is compared with its prediction;
the ranks agree on the result, and on any difference the load locates every item
exactly and runs again, so no call returns data from an unverified offset.
Wiring only: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch

from ..core.manifest import Manifest, Shard, TensorMeta
from ..core.regions import Box, intersect
from ..core.targets import LocalTarget, TargetSpec
from ..errors import CheckpointError
from ..plan.data import Segment
from . import dcplayout
from .dcp import SPECULATION_KEY

PREFIX = "__streamckpt_dcp_head__/"  # internal tensor names: never a user's key, never reported
U8 = "U8"
MAX_TAIL = 4096  # torch's tails are ~900 bytes; a longer gap is not one item's tail
SMALL_ITEM = 16 << 10  # tensor bytes: a read of any of them spans both of the item's boundaries


@dataclass(frozen=True, slots=True)
class Tail:
    """The tail of the chunk ``key``/``box`` (``length`` bytes), checked against ``template``."""

    key: str
    box: Box
    dtype: str
    shape: tuple[int, ...]
    length: int
    template: dcplayout.Template


@dataclass(frozen=True, slots=True)
class Head:
    """A check at ``[start, start + length)`` of ``file``: optionally the previous
    item's ``tail``, then the predicted head ``expected`` of chunk ``key``/``box``."""

    name: str
    key: str
    box: Box
    file: str
    start: int
    expected: bytes
    tail: Tail | None = None

    @property
    def length(self) -> int:
        return len(self.expected) + (self.tail.length if self.tail is not None else 0)

    def chunks(self) -> list[tuple[str, Box]]:
        return [(self.key, self.box)] + ([(self.tail.key, self.tail.box)] if self.tail is not None else [])


def is_speculative(manifest: Manifest) -> bool:
    return SPECULATION_KEY in manifest.metadata


@dataclass(slots=True)
class _Chunk:
    key: str
    index: int
    dtype: str
    shard: Shard
    head: bytes


def all_checks(manifest: Manifest) -> list[Head]:
    """Every check of the manifest, alike on every rank (derived from the shared
    manifest alone). A speculative manifest whose template is unreadable (never one
    rank 0 wrote) raises."""
    doc = manifest.metadata.get(SPECULATION_KEY)
    if doc is None:
        return []
    template = dcplayout.Template.from_json(doc.get("template") if isinstance(doc, dict) else None)
    if template is None:
        raise CheckpointError(f"internal: manifest metadata {SPECULATION_KEY!r} is not a layout template")
    memo: dict[tuple[str, tuple[int, ...]], bytes | None] = {}
    by_file: dict[str, list[_Chunk]] = {}
    for key, t in manifest.tensors.items():
        for i, sh in enumerate(t.shards):
            k = (t.dtype, sh.shape)
            if k not in memo:
                memo[k] = dcplayout.predict(template, t.dtype, sh.shape)
            head = memo[k]
            if head is not None:  # else the manifest reader located this chunk exactly
                by_file.setdefault(sh.file, []).append(_Chunk(key, i, t.dtype, sh, head))
    out: list[Head] = []
    for file in sorted(by_file):
        chunks = sorted(by_file[file], key=lambda c: (c.shard.byte_offset, c.key, c.index))
        out.extend(_pair(file, chunks, template))
    return out


def _pair(file: str, chunks: list[_Chunk], template: dcplayout.Template) -> Iterable[Head]:
    """Checks for one file's chunks (in offset order), as few as cover every chunk.

    A check at the boundary between two adjacent items verifies both (the first by
    its tail, the second by its head). Both boundaries of a small item are checks:
    any read of the small item's bytes spans them, so it verifies its neighbours
    too (a norm between two matrices). The rest pair up left to right; a chunk left
    over gets a check of its head alone."""
    m = len(chunks)
    starts = [c.shard.byte_offset - len(c.head) for c in chunks]

    def tail_len(i: int) -> int:
        """The tail of chunk i - 1 when it ends right before chunk i's item, else 0."""
        p = chunks[i - 1].shard
        gap = starts[i] - (p.byte_offset + p.byte_length)
        return gap if p.byte_length > 0 and 0 < gap <= MAX_TAIL else 0

    tails = [0] + [tail_len(i) for i in range(1, m)]
    small = [c.shard.byte_length <= SMALL_ITEM for c in chunks]
    chosen = {i for i in range(1, m) if tails[i] and (small[i - 1] or small[i])}
    covered = [False] * m
    for i in chosen:
        covered[i - 1] = covered[i] = True
    for i in range(m):
        if not covered[i] and i + 1 < m and tails[i + 1]:
            chosen.add(i + 1)
            covered[i] = covered[i + 1] = True
    for i, c in enumerate(chunks):
        if i in chosen:
            p = chunks[i - 1]
            yield _head(file, c, Tail(p.key, p.shard.box, p.dtype, p.shard.shape, tails[i], template))
        elif not covered[i]:
            yield _head(file, c, None)


def _head(file: str, c: _Chunk, tail: Tail | None) -> Head:
    start = c.shard.byte_offset - len(c.head) - (tail.length if tail is not None else 0)
    return Head(f"{PREFIX}{c.key}/{c.index}", c.key, c.shard.box, file, start, c.head, tail)


def covering(checks: Sequence[Head], keys: Iterable[str] | None) -> list[Head]:
    """The checks that cover a chunk of ``keys`` (None: every check)."""
    if keys is None:
        return list(checks)
    want = set(keys)
    return [h for h in checks if h.key in want or (h.tail is not None and h.tail.key in want)]


def heads_of(manifest: Manifest, keys: Iterable[str] | None = None) -> list[Head]:
    """``covering(all_checks(manifest), keys)``."""
    return covering(all_checks(manifest), keys)


def planned_heads(checks: Sequence[Head], all_specs: Sequence[Sequence[TargetSpec]]) -> list[Head]:
    """The checks some rank verifies (named in the gathered target specs): the only ones
    the plan needs to know, so planning grows with the chunks ranks touch."""
    names = {s.key for specs in all_specs for s in specs if s.key.startswith(PREFIX)}
    return [h for h in checks if h.name in names] if names else []


def augment(manifest: Manifest, heads: Sequence[Head]) -> Manifest:
    """``manifest`` plus one internal ``uint8`` tensor per head, for planning."""
    extra = {h.name: TensorMeta(U8, (h.length,), (Shard((0,), (h.length,), h.file, h.start, h.length),))
             for h in heads}
    return replace(manifest, tensors={**manifest.tensors, **extra})


@dataclass(frozen=True, slots=True)
class Checked:
    """A check this rank reads, and which of its parts cover chunks this rank loads."""

    head: Head
    target: LocalTarget
    check_head: bool
    check_tail: bool


def head_targets(heads: Sequence[Head], specs: Sequence[TargetSpec], everything: bool,
                 alloc: Callable[[int], torch.Tensor]) -> list[Checked]:
    """The checks this rank must verify: those covering chunks its targets overlap (a
    flat range counts as overlapping every chunk of its tensor), or all with ``everything``.
    ``alloc(n)`` makes a check's ``uint8`` target where the rank's targets live (its GPU's
    through the load's ``CudaApi``), so the checks ride the same path as the tensors."""
    boxes: dict[str, list[TargetSpec]] = {}
    for s in specs:
        if s.numel > 0:
            boxes.setdefault(s.key, []).append(s)

    def touched(key: str, box: Box) -> bool:
        return everything or any(s.flat_range is not None or intersect(s.box, box) is not None
                                 for s in boxes.get(key, ()))

    out = []
    for h in heads:
        on_head = touched(h.key, h.box)
        on_tail = h.tail is not None and touched(h.tail.key, h.tail.box)
        if on_head or on_tail:
            n = h.length
            target = LocalTarget(TargetSpec(h.name, U8, (n,), (0,), (n,)), alloc(n))
            out.append(Checked(h, target, on_head, on_tail))
    return out


def first_mismatch(checked: Sequence[Checked], to_host: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The first covered chunk whose bytes differ from their prediction, described, or None.
    ``to_host`` brings a check's bytes to the host (a download after the load's GPU work)."""
    layouts: dict[tuple[str, tuple[int, ...]], dcplayout.TailLayout | None] = {}  # one per dtype and shape
    for c in checked:
        h = c.head
        got = to_host(c.target.tensor).numpy().tobytes()
        cut = len(got) - len(h.expected)
        if c.check_head and got[cut:] != h.expected:
            return f"{h.key!r} chunk at {list(h.box.offset)} ({h.file} bytes [{h.start + cut}, {h.start + len(got)}))"
        t = h.tail
        if not c.check_tail or t is None:
            continue
        if (t.dtype, t.shape) not in layouts:
            layouts[t.dtype, t.shape] = dcplayout.tail_layout(t.template, t.dtype, t.shape)
        layout = layouts[t.dtype, t.shape]
        if layout is None or not layout.matches(got[:cut]):
            return (f"{t.key!r} chunk at {list(t.box.offset)} (its ZIP directory, {h.file} bytes "
                    f"[{h.start}, {h.start + cut}))")
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
        self.tensors = {**view.tensors, **{h.name: _HeadTensor((h.length,)) for h in heads}}

    def map_box(self, name: str, box: Box) -> Sequence[Segment]:
        if name in self._names:
            return [Segment(name, box, box, None)]
        return self._view.map_box(name, box)
