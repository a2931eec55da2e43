"""Training objects as users pass them: torch DCP's ``Stateful`` convention.

``{"model": model, "optim": optimizer, "sched": scheduler, "step": 7}`` is what DCP,
torchtitan and Lightning users write. Any object with callable ``state_dict()`` and
``load_state_dict()`` (modules, optimizers, schedulers, data-loader states, the user's
own) stands for its state dict: a save stores what ``state_dict()`` returns under the
object's key; a load fills that state dict in place (resharded like any other), then
hands it back through ``load_state_dict()``. A numpy array stands for a tensor that
shares its memory, so a load fills the array itself.

``expand`` makes the tree the layers below already understand; ``Expanded.finish``
writes what the load put into the copies back to the caller's tree and restores each
object. How an object's state dict is taken and given back is the caller's ``StateOf``
(the torch.distributed.checkpoint helpers for optimizers live outside ``core``).
Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..errors import IncompatibleStateDictError

Restore = Callable[[Any], None]  # gives a filled state dict back to its object


class Stateful(Protocol):
    """What a state may hold besides tensors and data: DCP's ``Stateful`` (a module, an
    optimizer, a scheduler, a data loader, your own class) as a type checker sees it."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class StateOf(Protocol):
    """An object's state dict and how to give a filled one back. ``objects`` are all the
    stateful objects of the tree (an optimizer finds its model among them); ``for_load``
    asks for targets that have every entry a checkpoint may hold (a fresh optimizer's state)."""

    def __call__(self, obj: Any, objects: Sequence[Any], *, for_load: bool) -> tuple[Any, Restore]: ...


def is_stateful(value: Any) -> bool:
    """DCP's ``Stateful`` by duck typing: callable ``state_dict`` and ``load_state_dict``."""
    if isinstance(value, (Mapping, torch.Tensor, type)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def is_array(value: Any) -> bool:
    """A numpy array (numpy is never imported here: one that exists was imported by its owner)."""
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def plain_state(obj: Any, objects: Sequence[Any], *, for_load: bool) -> tuple[Any, Restore]:
    """The object's own ``state_dict()`` and ``load_state_dict()``."""
    return obj.state_dict(), obj.load_state_dict


@dataclass(slots=True)
class Expanded:
    """The tree handed to save or load, and what a load must do afterwards."""

    tree: Any
    copies: list[tuple[Any, Any]] = field(default_factory=list)  # (caller's dict or list, our copy)
    ours: set[int] = field(default_factory=set)  # ids of every container we made (tuples too), alive in tree
    restores: list[tuple[Restore, Any, str]] = field(default_factory=list)  # (restore, filled state dict, key)

    def finish(self) -> None:
        """After a load: plain values the load replaced go back into the caller's containers,
        then each object gets its filled state dict (in tree order)."""
        for original, copy in self.copies:
            for k in (original.keys() if isinstance(original, Mapping) else range(len(original))):
                if not (is_stateful(original[k]) or is_array(original[k]) or id(copy[k]) in self.ours):
                    original[k] = copy[k]
        for restore, state, key in self.restores:
            try:
                restore(state)
            except Exception as e:  # noqa: BLE001 - the object's own error, named
                raise IncompatibleStateDictError(
                    f"{key}: {type(e).__name__} from load_state_dict of the restored state: {e}") from e


def expand(state: Any, state_of: StateOf = plain_state, *, for_load: bool = False) -> Expanded:
    """``state`` with each stateful object replaced by its state dict and each numpy array
    by a tensor sharing its memory; containers on the way are copied, the caller's tree is
    never changed. A tree with neither comes back as it is."""
    objects: list[Any] = []
    if not _find(state, objects, 0):
        return Expanded(state)
    out = Expanded(state)
    out.tree = _expand(state, "", out, state_of, objects, for_load)
    return out


def _find(node: Any, objects: list[Any], depth: int) -> bool:
    """Collect the stateful objects; whether there is anything to expand at all. Runs on
    every save and load: tensors and containers, by far the most nodes, are told apart first."""
    if isinstance(node, torch.Tensor):
        return False
    if isinstance(node, (dict, list, tuple, Mapping)):
        if depth > 100:
            return False  # the layers below name a tree this deep
        found = False
        for v in node.values() if isinstance(node, Mapping) else node:
            found = _find(v, objects, depth + 1) or found  # on to the end: an optimizer looks for its model
        return found
    if is_stateful(node):
        objects.append(node)
        return True
    return is_array(node)


def _expand(node: Any, key: str, out: Expanded, state_of: StateOf, objects: Sequence[Any], for_load: bool) -> Any:
    if is_stateful(node):
        try:
            state, restore = state_of(node, objects, for_load=for_load)
        except Exception as e:  # noqa: BLE001 - the object's own error, named
            raise IncompatibleStateDictError(
                f"{key or '<root>'}: {type(e).__name__} from state_dict() of a {type(node).__name__}: {e}") from e
        if not isinstance(state, Mapping):
            raise IncompatibleStateDictError(
                f"{key or '<root>'}: {type(node).__name__}.state_dict() returned a {type(state).__name__}, not a dict")
        out.restores.append((restore, state, key or "<root>"))
        return state
    if is_array(node):
        return _tensor_of(node, key)
    if isinstance(node, Mapping) and not isinstance(node, dict):
        return node  # a read-only mapping: nothing of ours goes in, the layers below take it as is
    if isinstance(node, (dict, list, tuple)):
        pairs = node.items() if isinstance(node, dict) else enumerate(node)
        kids = {k: _expand(v, f"{key}.{k}" if key else str(k), out, state_of, objects, for_load) for k, v in pairs}
        if all(kids[k] is v for k, v in (node.items() if isinstance(node, dict) else enumerate(node))):
            return node
        copy: Any = kids if isinstance(node, dict) else list(kids.values())
        if isinstance(node, tuple):
            copy = tuple(copy)  # immutable: a load leaves its plain values as they were, as for any tuple
        else:
            out.copies.append((node, copy))
        out.ours.add(id(copy))
        return copy
    return node


def _tensor_of(array: Any, key: str) -> torch.Tensor:
    """A tensor sharing the array's memory (a load fills the array itself)."""
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError) as e:
        raise IncompatibleStateDictError(
            f"{key or '<root>'}: a numpy array of dtype {array.dtype} with strides {array.strides} cannot be "
            f"stored as a tensor ({e}); pass np.ascontiguousarray(a) of a numeric dtype, or a list") from None
