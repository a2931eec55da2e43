"""The keyword arguments a manager passes on to ``sc.save`` / ``sc.load`` / ``sc.load_state``,
checked by name first: a misspelt one was a ``TypeError`` naming ``load()`` or ``save()``,
which the caller never called, raised from inside the manager."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Mapping

from ..errors import CheckpointError, near_names


def check_names(where: str, target: Callable[..., Any], kwargs: Mapping[str, Any], *,
                own: Iterable[str] = ()) -> None:
    """Refuse a name in ``kwargs`` that ``target`` does not take as a keyword, or that the
    manager sets itself (``own``), naming ``where`` (``CheckpointManager.restore``), the near
    spelling and the names it takes."""
    params = inspect.signature(target).parameters.values()
    mine = set(own)
    takes = sorted(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                   and p.default is not p.empty and p.name not in mine)
    for name in kwargs:
        if name in mine:
            raise CheckpointError(f"{where}: {name}= is set by the manager (from its own arguments); "
                                  f"pass it to CheckpointManager(...) instead")
        if name not in takes:
            near = near_names(name, takes, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise CheckpointError(f"{where}: unknown argument {name!r}{hint}; it passes on to "
                                  f"sc.{target.__name__} only {', '.join(takes)}")
