"""The view while rules apply, indexing optimizer-state names by the parameter they embed.

A rule that moves a parameter also moves ``<prefix>state.<param>.<leaf>`` names (Adam's
``exp_avg``, a ``step`` counter, ...), so the view keeps, per parameter, the state names
that follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .pieces import PiecedTensor

#: The dotted component that marks an optimizer-state name: ``<prefix>state.<param>.<leaf>``.
STATE_COMPONENT = "state"


def state_refs(name: str) -> list[tuple[str, str, str]]:
    """Every ``(param, prefix, leaf)`` with ``name == prefix + "state." + param + "." + leaf``.

    ``prefix`` is empty or ends with a dot; ``leaf`` is one dotted component.
    """
    marker = STATE_COMPONENT + "."
    cut = name.rfind(".")
    if cut <= 0:
        return []
    leaf = name[cut + 1:]
    out = []
    start = 0
    while True:
        i = name.find(marker, start)
        if i < 0 or i + len(marker) >= cut:
            break
        if i == 0 or name[i - 1] == ".":
            out.append((name[i + len(marker):cut], name[:i], leaf))
        start = i + 1
    return out


def state_name(prefix: str, param: str, leaf: str) -> str:
    """The optimizer-state name for ``param`` (the inverse of :func:`state_refs`)."""
    return f"{prefix}{STATE_COMPONENT}.{param}.{leaf}"


@dataclass
class ViewState:
    """The view while rules apply, with an index of optimizer-state names by parameter."""

    tensors: dict[str, PiecedTensor]
    states: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.tensors:
            self._index(name)

    def _index(self, name: str) -> None:
        for param, prefix, leaf in state_refs(name):
            self.states.setdefault(param, {})[name] = (prefix, leaf)

    def remove(self, name: str) -> None:
        del self.tensors[name]
        for param, _, _ in state_refs(name):
            refs = self.states.get(param)
            if refs is not None:
                refs.pop(name, None)
                if not refs:
                    del self.states[param]

    def add(self, name: str, t: PiecedTensor) -> None:
        self.tensors[name] = t
        self._index(name)

    def states_of(self, param: str) -> dict[tuple[str, str], str]:
        """``(prefix, leaf) -> state name`` for every state that embeds ``param``."""
        return {pl: n for n, pl in self.states.get(param, {}).items()}
