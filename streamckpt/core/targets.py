"""Turning a state_dict into plain target descriptions (and back for values).

A state_dict value is a plain tensor (a whole replica), a DTensor, a
``ShardedTensor``, a nested dict (str or int keys, joined with ``.``), a list or tuple
holding any of these, or plain data (``values.SAVABLE``). The
``TargetSpec`` of each tensor is plain data (gathered across ranks to plan);
the ``LocalTarget`` keeps the tensor that bytes are written into. No I/O.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch

from ..errors import IncompatibleStateDictError
from . import dtypes
from .regions import Box
from .sharded import ShardedTensor
from .values import SAVABLE, unsavable


class TargetSpec(NamedTuple):
    """What one rank holds of one tensor: a box (maybe a flat range of it).

    A tuple, so that deduplicating hundreds of thousands of them across ranks
    hashes at C speed.
    """

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat_range: tuple[int, int] | None = None

    @property
    def box(self) -> Box:
        return tuple.__new__(Box, (self.offset, self.shape))  # Box(...) at C speed: planners ask often

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        return [self.key, self.dtype, list(self.global_shape), list(self.offset), list(self.shape),
                list(self.flat_range) if self.flat_range else None]

    @staticmethod
    def from_json(v: list[Any]) -> "TargetSpec":
        return TargetSpec(v[0], v[1], tuple(v[2]), tuple(v[3]), tuple(v[4]),
                          tuple(v[5]) if v[5] else None)  # type: ignore[arg-type]


@dataclass(slots=True)
class LocalTarget:
    spec: TargetSpec
    tensor: torch.Tensor  # the rank's local tensor: box-shaped, or 1-D for flat ranges


@dataclass(slots=True)
class ValueSlot:
    """A non-tensor leaf: where to put the restored value."""

    key: str
    container: Any  # the dict (or the list, when a list holding tensors was split) holding it
    name: str | int
    value: Any


Leaf = tuple[str, Any, "str | int", Any]  # (dotted key, container, name or index in it, value)


def iter_leaves(state_dict: Mapping[Any, Any], prefix: str = "") -> Iterator[Leaf]:
    """``(dotted_key, container, name, value)`` for every leaf of a nested dict. Keys are
    strings or ints (a plain ``optimizer.state_dict()`` keys its state by parameter index),
    joined with ``.``. A list or tuple that holds tensors is split like torch DCP splits it,
    one key per element (``optim.param_groups.0.lr`` for a tensor learning rate); other
    lists and tuples are values."""
    for name, value in state_dict.items():
        if not is_key(name):
            raise IncompatibleStateDictError(
                f"state_dict key {name!r} under {prefix or '<root>'!r} is a {type(name).__name__}; "
                f"keys must be strings or ints"
            )
        yield from _leaves(f"{prefix}{name}", state_dict, name, value)


def is_key(name: Any) -> bool:
    """A key a checkpoint can record exactly: a str, or an int (not a bool)."""
    return isinstance(name, str) or (isinstance(name, int) and not isinstance(name, bool))


def _leaves(key: str, container: Any, name: str | int, value: Any) -> Iterator[Leaf]:
    if isinstance(value, Mapping):
        yield from iter_leaves(value, key + ".")
    elif is_split(value):
        for i, v in enumerate(value):
            yield from _leaves(f"{key}.{i}", value, i, v)
    else:
        yield key, container, name, value


def is_split(value: Any) -> bool:
    """A list or tuple stored element by element (it holds a tensor), not as one value."""
    return isinstance(value, (list, tuple)) and _holds_tensor(value)


def _holds_tensor(value: Any) -> bool:
    if is_tensor_like(value) or _is_dtensor(value):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, Mapping) and any(_holds_tensor(v) for v in value.values())


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


def is_tensor_leaf(value: Any) -> bool:
    """A leaf stored as a tensor: a plain tensor, a ``ShardedTensor`` or a DTensor."""
    return is_tensor_like(value) or _is_dtensor(value)


def _is_dtensor(value: Any) -> bool:
    """A DTensor can only exist once its module is imported: never import it here
    (``torch.distributed.tensor`` pulls in sympy, ~0.7 s on a load's hot path)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None) if mod is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def target_of(key: str, value: Any) -> LocalTarget | None:
    """The target for one leaf, or None when this rank holds nothing of it."""
    if isinstance(value, ShardedTensor):
        code = dtypes.to_code(value.dtype, where=key)
        return LocalTarget(
            TargetSpec(key, code, value.global_shape, value.global_offset,
                       tuple(value.local_shape or ()), value.flat_range),
            value.local_tensor,
        )
    if _is_dtensor(value):
        return _dtensor_target(key, value)
    if isinstance(value, torch.Tensor):
        code = dtypes.to_code(value.dtype, where=key)
        shape = tuple(value.shape)
        return LocalTarget(TargetSpec(key, code, shape, (0,) * len(shape), shape), value)
    return None


def _dtensor_target(key: str, value: Any) -> LocalTarget | None:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in value.placements):
        raise IncompatibleStateDictError(
            f"{key}: DTensor with a Partial placement cannot be saved or loaded; "
            f"redistribute it to Shard/Replicate first"
        )
    mesh = value.device_mesh
    if mesh.get_coordinate() is None:
        return None  # this rank is not in the tensor's mesh: it needs nothing
    global_shape = tuple(value.shape)
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, value.placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise IncompatibleStateDictError(
            f"{key}: DTensor local shape {list(local.shape)} differs from the layout's {list(local_shape)}"
        )
    code = dtypes.to_code(local.dtype, where=key)
    return LocalTarget(TargetSpec(key, code, global_shape, tuple(offset), tuple(local_shape)), local)


def check_value(key: str, value: Any) -> None:
    """A non-tensor leaf must be plain data the manifest can record exactly."""
    why = unsavable(value)
    if why is not None:
        raise IncompatibleStateDictError(
            f"{key}: {why} cannot be saved; a state_dict leaf is a tensor, a numpy array, an object with "
            f"state_dict() and load_state_dict(), or plain data ({SAVABLE}); {_todo(value)}"
        )


def _todo(value: Any) -> str:
    """What to pass instead of a value that cannot be saved."""
    if callable(getattr(value, "state_dict", None)):
        missing = "" if callable(getattr(value, "load_state_dict", None)) else \
            f" (a {type(value).__name__} has no load_state_dict() to restore it through)"
        return f"pass its .state_dict(){missing}"
    return "convert it first (e.g. str(value), list(value))"


def collect(state_dict: Mapping[Any, Any], *, for_save: bool = False) -> tuple[list[LocalTarget], list[ValueSlot]]:
    """Split a state_dict into tensor targets and non-tensor value slots."""
    if not isinstance(state_dict, Mapping):
        hint = " (pass its .state_dict())" if callable(getattr(state_dict, "state_dict", None)) else ""
        raise IncompatibleStateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}{hint}")
    targets: list[LocalTarget] = []
    values: list[ValueSlot] = []
    seen: set[str] = set()
    for key, container, name, value in iter_leaves(state_dict):
        if key in seen:
            raise IncompatibleStateDictError(f"state_dict key {key!r} appears twice after joining nested keys with '.'")
        seen.add(key)
        if is_tensor_leaf(value):
            t = target_of(key, value)
            if t is not None:
                check_memory(key, t.tensor, for_save)
                targets.append(t)
        else:
            if for_save:
                check_value(key, value)
            values.append(ValueSlot(key, container, name, value))  # type: ignore[arg-type]
    return targets, values


def check_memory(key: str, tensor: torch.Tensor, for_save: bool) -> None:
    """A tensor a save can read as plain row-major bytes and a load can write element by
    element: dense (strided), allocated, and for a load with one memory location per element."""
    if tensor.device.type == "meta":
        raise IncompatibleStateDictError(f"{key}: tensor is on the meta device; allocate it first")
    if tensor.layout != torch.strided:
        todo = "save its .to_dense() (or its indices and values as tensors)" if for_save else \
            "load into a dense tensor (torch.empty of its shape and dtype), then .to_sparse() it"
        raise IncompatibleStateDictError(f"{key}: a {tensor.layout} tensor is not supported (only dense "
                                         f"tensors are stored); {todo}")
    if not for_save and _overlaps(tensor):
        raise IncompatibleStateDictError(  # torch's own words come from deep inside the copy
            f"{key}: the target's elements share memory (a stride-0 view, as expand() makes), so it cannot "
            f"be filled in place: pass a tensor that owns its elements (.clone())")


def _overlaps(tensor: torch.Tensor) -> bool:
    """Several elements at one address (a zero stride over a dim of size > 1, or as_strided)."""
    if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape)):
        return True
    probe = getattr(torch, "_debug_has_internal_overlap", None)  # 1: yes, 2: too hard to tell
    return probe is not None and probe(tensor) == 1


def copy_in(fn: Callable[[], None]) -> None:
    """Run a tensor write without autograd tracking (targets may require grad)."""
    with torch.no_grad():
        fn()
