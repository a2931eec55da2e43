"""Scattering staged bytes into targets: viewing a piece, packing and unpacking messages.

A piece is ``Copy.length`` bytes in a uint8 buffer, viewed as its source dtype with
the copy's shape and strides, maybe permuted, and copied into a box of its target
(casting on the way). The buffer is on the target's device: a host arena span for
CPU targets, the same bytes on the GPU for CUDA targets (``device.DeviceStage``
puts them there and runs the copy on its side stream). No I/O.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..core import dtypes
from ..cuda.device import Stage
from ..plan.data import Copy, is_packed, message_layout, packed_copy


class Destinations:
    """Target id -> the local tensor it fills (only this rank's targets)."""

    def __init__(self, tensors: dict[int, torch.Tensor]) -> None:
        self.tensors = tensors

    def apply(self, staged: torch.Tensor, copy: Copy, stage: Stage | None = None) -> None:
        """Copy one piece from a uint8 buffer (starting at the piece) into its target.

        ``staged`` is on the target's device; ``stage`` runs the copy (on the GPU's
        side stream for CUDA targets), a plain ``copy_`` without one.
        """
        if copy.target not in self.tensors:
            return
        src = source_view(staged, copy, stage.realign if stage is not None else None)
        if copy.perm is not None:
            src = src.permute(copy.perm)
        dst = self.target_view(copy)
        if stage is None:
            dst.copy_(src)
        else:
            stage.write(dst, src)

    def target_view(self, copy: Copy) -> torch.Tensor:
        """The part of its target tensor that a copy fills."""
        dest = self.tensors[copy.target]
        if copy.dst_base is None:
            return dest[copy.dst_box.slices()] if copy.dst_box.ndim else dest
        frame = copy.dst_frame or ()
        return dest.narrow(0, copy.dst_base, math.prod(frame)).view(frame)[copy.dst_box.slices()]


def source_view(
    staged: torch.Tensor, copy: Copy, realign: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The copy's source elements, viewed in a uint8 buffer that starts at the piece.

    A piece whose address is not a multiple of its element size is first moved to an
    aligned buffer by ``realign`` (on the buffer's device), a host clone without it.
    """
    dt = dtypes.to_torch(copy.src_dtype)
    raw = staged[: copy.length]
    if dt.itemsize > 1 and (raw.data_ptr() % dt.itemsize):
        raw = realign(raw) if realign is not None else raw.clone()
    if copy.src_shape:
        return raw.view(dt).as_strided(copy.src_shape, copy.src_strides)
    return raw.view(dt).reshape(())


def pack_message(staged: torch.Tensor, copies: Sequence[Copy], out: torch.Tensor) -> torch.Tensor:
    """Copy each piece's elements (no bytes between strided rows) into ``out``; return the message."""
    offs, size = message_layout(copies)
    for c, o in zip(copies, offs):
        src = source_view(staged[c.offset:], c)
        dst = out[o: o + src.numel() * src.element_size()].view(src.dtype)
        dst.view(src.shape).copy_(src)
    return out[:size]


def message_pieces(copies: Sequence[Copy]) -> list[tuple[int, Copy]]:
    """(offset in the message, copy as applied from there) of a message's pieces."""
    if not is_packed(copies):
        return [(0, copies[0])]
    offs, _ = message_layout(copies)
    return [(o, packed_copy(c)) for c, o in zip(copies, offs)]


def unpack_message(buf: torch.Tensor, copies: Sequence[Copy], dest: "Destinations", stage: Stage | None = None) -> None:
    """Apply a received message: a slice of the staged read as is, or a packed one."""
    for o, c in message_pieces(copies):
        dest.apply(buf[o:], c, stage)
