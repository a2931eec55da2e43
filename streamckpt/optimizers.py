"""An optimizer's state through torch's ``torch.distributed.checkpoint.state_dict`` helpers.

A plain ``optimizer.state_dict()`` keys its state by parameter index and, for an optimizer
that has not stepped yet, holds no state at all: nothing for a load to fill. Where the
optimizer's model is in the same tree (``{"model": m, "optim": o}``), DCP's
``get_optimizer_state_dict(model, optim)`` keys the state by parameter name (FQN),
creates a fresh optimizer's state (a zero step at lr 0), and gives FSDP2/DTensor
parameters DTensor state sharded like them, so the state reshards like its parameters;
``set_optimizer_state_dict`` gives it back. This is how DCP users and torchtitan's
``OptimizersContainer`` do it. Other stateful objects use their own methods
(``stateful.plain_state``).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from .core.stateful import Restore, plain_state

log = logging.getLogger(__name__)


def state_of(obj: Any, objects: Sequence[Any], *, for_load: bool) -> tuple[Any, Restore]:
    """``core.stateful.StateOf`` for a tree that may hold optimizers."""
    if not isinstance(obj, torch.optim.Optimizer) or _custom(obj):
        return plain_state(obj, objects, for_load=for_load)
    model = owner(obj, objects)
    if model is None:
        if for_load:
            _fresh(obj)
        return plain_state(obj, objects, for_load=for_load)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def restore(state: Any) -> None:
        set_optimizer_state_dict(model, obj, state)

    return get_optimizer_state_dict(model, obj), restore


def _custom(optim: torch.optim.Optimizer) -> bool:
    """An optimizer with a state_dict of its own (torchtitan's ``OptimizersContainer`` calls
    the helpers itself): its methods are the contract, not the helpers'."""
    base = torch.optim.Optimizer
    return type(optim).state_dict is not base.state_dict or type(optim).load_state_dict is not base.load_state_dict


def owner(optim: torch.optim.Optimizer, objects: Sequence[Any]) -> torch.nn.Module | None:
    """The one module of the tree that holds every parameter ``optim`` updates, or None."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    found = [m for m in objects if isinstance(m, torch.nn.Module)
             and wanted <= {id(p) for p in m.parameters()}]
    if len(found) != 1:
        if len(found) > 1:
            log.debug("optimizer's parameters are in %d modules of the state: index-keyed state", len(found))
        return None
    return found[0]


def _fresh(optim: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state (as DCP does for its targets), so a
    load has tensors to fill; the checkpoint's values replace it."""
    from torch.distributed.checkpoint import state_dict as dsd

    init = getattr(dsd, "_init_optim_state", None)
    if init is not None:
        init(optim)
