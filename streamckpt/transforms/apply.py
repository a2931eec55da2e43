"""Applying one rule to the view: expand its patterns, run its op, move optimizer states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .ops import run_op
from .pieces import PiecedTensor
from .rules import Rule
from .states import ViewState, state_name


@dataclass(frozen=True)
class Step:
    """One concrete application of a rule (what ``Transforms.invert`` undoes)."""

    rule: Rule
    src: tuple[str, ...]
    dst: tuple[str, ...]
    before: tuple[PiecedTensor, ...]


def _expand(rule: Rule, view: ViewState) -> list[tuple[list[str], list[str]]]:
    """Concrete (sources, destinations) for every match of the rule's first pattern."""
    first = rule.src[0]
    if first.regex is None:
        if first.text not in view.tensors:
            if rule.optional:
                return []
            raise rule.fail(f"source name {first.text!r} is not in the view")
        names: list[str] = [first.text]
        matches: list[tuple[dict[str, str], list[str]]] = [({}, [])]
    else:
        names, matches = [], []
        for name in sorted(view.tensors):
            m = first.match(name)
            if m is not None:
                names.append(name)
                matches.append(m)
        if not matches and not rule.optional:
            raise rule.fail(f"pattern {first.text!r} matches no name in the view")
    out = []
    for name, (binds, stars) in zip(names, matches):
        try:
            src = [name] + [p.substitute(binds, stars) for p in rule.src[1:]]
            dst = [p.substitute(binds, stars) for p in rule.dst]
        except ValueError as exc:
            raise rule.fail(str(exc)) from None
        for s in src[1:]:
            if s not in view.tensors:
                raise rule.fail(f"source name {s!r} (for {name!r}) is not in the view")
        out.append((src, dst))
    return out


def _follower_groups(
    rule: Rule, view: ViewState, src: Sequence[str], primary: set[str]
) -> list[tuple[str, str, list[str]]]:
    """Optimizer-state names that embed the sources: ``(prefix, leaf, names per source)``."""
    per_src = [view.states_of(s) for s in src]
    keys: dict[tuple[str, str], None] = {}
    for d in per_src:
        for k, n in d.items():
            if n not in primary:
                keys.setdefault(k, None)
    groups = []
    for prefix, leaf in keys:
        names = []
        for s, d in zip(src, per_src):
            n = d.get((prefix, leaf))
            if n is None:
                raise rule.fail(
                    f"optimizer state {state_name(prefix, src[0], leaf)!r} follows the rule, "
                    f"but {state_name(prefix, s, leaf)!r} is missing"
                )
            names.append(n)
        groups.append((prefix, leaf, names))
    return groups


def apply_rule(rule: Rule, view: ViewState, trace: list[Step] | None) -> None:
    """Apply one rule to the view in place (all matches first, then the view updates)."""
    consumed: dict[str, None] = {}
    added: dict[str, PiecedTensor] = {}
    matches = _expand(rule, view)
    primary = {s for src, _ in matches for s in src}

    def emit(name: str, t: PiecedTensor) -> None:
        if name in added:
            raise rule.fail(f"two matches produce the same name {name!r}")
        added[name] = t

    for src, dst in matches:
        ts = [view.tensors[s] for s in src]
        outs = run_op(rule, src, ts, len(dst))
        for name, t in zip(dst, outs):
            emit(name, t)
        consumed.update(dict.fromkeys(src))
        if trace is not None:
            trace.append(Step(rule, tuple(src), tuple(dst), tuple(ts)))
        if rule.kind == "cast" and list(dst) == list(src):
            continue    # an in-place cast moves nothing; optimizer states keep their dtype
        for prefix, leaf, names in _follower_groups(rule, view, src, primary):
            states = [view.tensors[n] for n in names]
            consumed.update(dict.fromkeys(names))
            if rule.kind == "drop":
                continue
            out_names = [state_name(prefix, d, leaf) for d in dst]
            if rule.kind == "cast":
                outs = states   # renamed with their parameter, never cast
            elif all(s.shape == t.shape for s, t in zip(states, ts)):
                outs = run_op(rule, names, states, len(dst))
            else:
                # e.g. a scalar ``step``: every destination takes the first source's value
                outs = [states[0]] * len(dst)
            for name, t in zip(out_names, outs):
                emit(name, t)

    for name in added:
        if name in view.tensors and name not in consumed:
            raise rule.fail(f"target name {name!r} already exists in the view")
    for name in consumed:
        view.remove(name)
    for name, t in added.items():
        view.add(name, t)
