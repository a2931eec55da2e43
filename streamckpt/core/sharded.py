"""``ShardedTensor``: this rank's box (or flat slice of a box) of a global tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import IncompatibleStateDictError
from .regions import Box


@dataclass(eq=False)
class ShardedTensor:
    """This rank's piece of a global tensor, as a value of a state_dict for ``save`` and ``load``.

    Without ``flat_range`` the local tensor is the box ``local_shape`` at
    ``global_offset``. With ``flat_range=(start, stop)`` the local tensor is the
    1-D slice ``[start, stop)`` of the row-major flattening of that box (ZeRO /
    FSDP flat-parameter shards). Across the ranks of a save, the distinct pieces must
    tile the global tensor exactly once (replicas may repeat a piece).

    Args:
        local_tensor: This rank's elements (CPU or CUDA); a load fills it in place.
        global_shape: The whole tensor's shape.
        global_offset: Where the box starts in the whole tensor, one index per dimension.
        local_shape: The box's shape. Default None: the local tensor's shape (required
            with ``flat_range``).
        flat_range: ``(start, stop)``: the local tensor is that 1-D slice of the box's
            row-major flattening. Default None: the local tensor is the whole box.

    Raises:
        IncompatibleStateDictError: the geometry is inconsistent (the box leaves the global
            shape, the ranks differ, the local tensor does not hold the box or the slice).

    Example:
        >>> import torch, streamckpt as sc
        >>> rows = sc.ShardedTensor(torch.zeros(2, 4), global_shape=(8, 4), global_offset=(2, 0))
        >>> flat = sc.ShardedTensor(torch.zeros(3), (8, 4), (0, 0), local_shape=(8, 4), flat_range=(5, 8))
    """

    local_tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None

    def __init__(
        self,
        local_tensor: torch.Tensor,
        global_shape: Sequence[int],
        global_offset: Sequence[int],
        *,
        local_shape: Sequence[int] | None = None,
        flat_range: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(local_tensor, torch.Tensor):
            raise IncompatibleStateDictError(
                f"ShardedTensor needs a torch.Tensor, got {type(local_tensor).__name__}"
            )
        self.local_tensor = local_tensor
        self.global_shape = tuple(int(d) for d in global_shape)
        self.global_offset = tuple(int(d) for d in global_offset)
        if flat_range is None:
            shape = tuple(local_tensor.shape) if local_shape is None else tuple(int(d) for d in local_shape)
            if shape != tuple(local_tensor.shape):
                raise IncompatibleStateDictError(
                    f"ShardedTensor: local_shape {list(shape)} differs from the local tensor's "
                    f"shape {list(local_tensor.shape)}"
                )
            self.flat_range = None
        else:
            if local_shape is None:
                raise IncompatibleStateDictError("ShardedTensor: flat_range needs local_shape (the box)")
            shape = tuple(int(d) for d in local_shape)
            start, stop = (int(flat_range[0]), int(flat_range[1]))
            if not 0 <= start <= stop <= math.prod(shape):
                raise IncompatibleStateDictError(
                    f"ShardedTensor: flat_range [{start}, {stop}) outside its box of "
                    f"{math.prod(shape)} elements"
                )
            if local_tensor.dim() != 1 or local_tensor.numel() != stop - start:
                raise IncompatibleStateDictError(
                    f"ShardedTensor: flat_range [{start}, {stop}) needs a 1-D local tensor of "
                    f"{stop - start} elements, got shape {list(local_tensor.shape)}"
                )
            self.flat_range = (start, stop)
        self.local_shape = shape
        if not (len(self.global_offset) == len(self.global_shape) == len(shape)):
            raise IncompatibleStateDictError(
                f"ShardedTensor: global_shape {list(self.global_shape)}, global_offset "
                f"{list(self.global_offset)} and local shape {list(shape)} differ in rank"
            )
        for d, (o, s, g) in enumerate(zip(self.global_offset, shape, self.global_shape)):
            if o < 0 or s < 0 or o + s > g:
                raise IncompatibleStateDictError(
                    f"ShardedTensor: box offset {list(self.global_offset)} shape {list(shape)} "
                    f"falls outside global shape {list(self.global_shape)} (dim {d})"
                )

    @property
    def box(self) -> Box:
        """The box (``global_offset``, ``local_shape``) this piece covers."""
        return Box(self.global_offset, tuple(self.local_shape or ()))

    @property
    def dtype(self) -> torch.dtype:
        """The local tensor's dtype."""
        return self.local_tensor.dtype

    def __repr__(self) -> str:
        fr = f", flat_range={self.flat_range}" if self.flat_range else ""
        return (
            f"ShardedTensor(global_shape={list(self.global_shape)}, offset={list(self.global_offset)}, "
            f"local_shape={list(self.local_shape or ())}{fr}, dtype={self.dtype})"
        )
