"""Which bytes of a read land straight in their target's memory, and which are staged.

A copy whose source bytes are a contiguous run of one CPU target, in the target's own
dtype and element order (every full load, every row slice), needs no staging buffer:
the read's body is received into the target itself and verified there (``storage``
checks a read's CRC32C over the bytes wherever they landed and re-fetches on a
mismatch; ``load`` returns only once every read is verified). The rest of such a read
(bytes between tensors, the edges of a checksum chunk, copies that need a cast,
permute or strided write) lands in staging and is copied as before. Reads that feed
other ranks or need decompression are staged whole. No I/O.

Target memory is left to the kernel's default pages: asking for transparent huge pages
(``MADV_HUGEPAGE``, which loads asked for until December 2026) made fresh-target loads slower on this
project's machines (1 GiB: 2.36 vs 1.65 s, sys 2.27 vs 1.56 s; 256 MiB: 0.74 vs 0.54 s;
finding 2 MiB blocks costs more than the faults it saves there). Where THP is ``always``
the kernel does it anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from ..core import dtypes
from ..core.regions import row_major_strides
from ..plan.data import Copy, Read, message_size, packed_copy, wire_length
from .scatter import Destinations


@dataclass(slots=True)
class ReadLanding:
    """Where one read's bytes go: consecutive ``(lo, hi, memory)`` spans of the read,
    ``memory`` a target's bytes or None for staging; ``staged`` copies are scattered
    from the staged spans."""

    spans: list[tuple[int, int, memoryview | None]] = field(default_factory=list)
    staged: list[Copy] = field(default_factory=list)
    direct_bytes: int = 0


def _squeezed(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def target_memory(dest: Destinations, copy: Copy) -> memoryview | None:
    """The target bytes a copy fills, writable as raw bytes, when its source bytes are
    exactly those bytes in the same order (same dtype, contiguous both sides, no permute)."""
    if copy.perm is not None or copy.length <= 0 or copy.target not in dest.tensors:
        return None
    t = dest.tensors[copy.target]
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized:
        return None
    try:
        if dtypes.to_torch(copy.src_dtype) != t.dtype:
            return None
    except Exception:  # noqa: BLE001 - an unknown dtype is staged (and reported there)
        return None
    if copy.src_shape and tuple(copy.src_strides) != row_major_strides(copy.src_shape):
        return None
    dst = dest.target_view(copy)
    if not dst.is_contiguous() or dst.numel() * dst.element_size() != copy.length:
        return None
    if _squeezed(dst.shape) != _squeezed(copy.src_shape):
        return None
    mem = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
    return None if mem.readonly else mem


def shared_memory(tensors: dict[int, torch.Tensor]) -> set[int]:
    """Targets whose memory overlaps another target's (tied weights passed twice, views
    of one buffer that overlap): they are filled through staging, one copy after another,
    never by two concurrent reads."""
    spans = []
    for uid, t in tensors.items():
        if t.numel() == 0 or t.device.type != "cpu" or t.layout != torch.strided:
            continue
        lo = t.data_ptr()
        extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
        spans.append((lo, lo + extent * t.element_size(), uid))
    spans.sort()
    shared: set[int] = set()
    reach, owner = -1, -1
    for lo, hi, uid in spans:
        if lo < reach:
            shared.update((uid, owner))
        if hi > reach:
            reach, owner = hi, uid
    return shared


def plan_landing(r: Read, dest: Destinations, allowed: Callable[[int], bool]) -> ReadLanding | None:
    """The read's landing when at least one copy can land in its target, else None (staged whole).

    ``allowed(target)``: whether that target may be written by a read directly (a CPU
    tensor of this rank whose memory no other target shares). Only a read that feeds
    no other rank and needs no decoding may be passed here.
    """
    if r.zstd or r.length <= 0:
        return None
    order = sorted(r.copies, key=lambda c: c.offset)
    direct: list[tuple[Copy, memoryview]] = []
    staged: list[Copy] = []
    for j, c in enumerate(order):
        lo, hi = c.offset, c.offset + c.length
        alone = (j == 0 or order[j - 1].offset + order[j - 1].length <= lo) and (
            j + 1 == len(order) or hi <= order[j + 1].offset)
        mem = target_memory(dest, c) if alone and allowed(c.target) and 0 <= lo and hi <= r.length else None
        if mem is None:
            staged.append(c)
        else:
            direct.append((c, mem))
    if not direct:
        return None
    out = ReadLanding(staged=staged)
    pos = 0
    for c, mem in direct:
        if c.offset > pos:
            out.spans.append((pos, c.offset, None))
        out.spans.append((c.offset, c.offset + c.length, mem))
        out.direct_bytes += c.length
        pos = c.offset + c.length
    if pos < r.length:
        out.spans.append((pos, r.length, None))
    return out


def plan_landings(schedule: Sequence[Any], dest: Destinations, on_device: Collection[int]) -> dict[int, ReadLanding]:
    """This rank's reads (global index) whose bytes land, at least in part, straight in
    their targets: reads that feed no other rank (``schedule``: ``rounds.LocalRound``s),
    need no decoding, and fill only host targets whose memory no other target shares."""
    host = {uid: t for uid, t in dest.tensors.items() if uid not in on_device}
    shared = shared_memory(host)

    def allowed(uid: int) -> bool:
        return uid in host and uid not in shared

    out: dict[int, ReadLanding] = {}
    for rnd in schedule:
        sending = {m.read_index for m in rnd.sends}
        for i, r in rnd.reads:
            if i in sending or any(c.target in on_device for c in r.copies):
                continue
            land = plan_landing(r, dest, allowed)
            if land is not None:
                out[i] = land
    return out


def receive_targets(schedule: Sequence[Any], dest: Destinations, on_device: Collection[int]
                    ) -> dict[tuple[int, int, int], torch.Tensor]:
    """Messages this rank receives straight into a target's memory, by ``Message.key``:
    one piece whose bytes, as sent (a strided piece packed: its elements back to back), are its
    host target's bytes as they are (``target_memory``), in a target no other target shares.
    The rest are received into staging and scattered.

    Why: in a replicated load most of a rank's bytes come from peers (3/4 of them on 4
    ranks), and copying each from a staging arena into its target was the largest CPU cost
    of the exchange, which under a storage bandwidth cap decides whether it hides behind
    the fetch (issue 37 item 5). The sender verified the bytes before it sent them."""
    host = {uid: t for uid, t in dest.tensors.items() if uid not in on_device}
    shared = shared_memory(host)
    out: dict[tuple[int, int], torch.Tensor] = {}
    for rnd in schedule:
        for m in rnd.recvs:
            if len(m.copies) != 1:
                continue
            c = m.copies[0]
            if wire_length(c) != c.length:  # a strided piece, packed by its sender: contiguous as received
                c = packed_copy(c)
            if c.target not in host or c.target in shared or message_size(m.copies) != c.length:
                continue
            if target_memory(dest, c) is None:
                continue
            out[m.key] = dest.target_view(c).detach().reshape(-1).view(torch.uint8)
    return out
