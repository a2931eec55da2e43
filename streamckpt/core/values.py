"""Non-tensor state_dict values: how they travel between ranks and how they are put back.

A native checkpoint stores each non-tensor leaf of the state_dict (a leaf of the
nested dicts: a scalar, a string, a list) whole, under its dotted key. torch DCP
flattens further: a list that holds dicts, such as an optimizer's
``param_groups``, becomes one item per leaf (``optim.param_groups.0.lr``,
``optim.param_groups.0.params``). Restoring follows the structure the caller
passed, as DCP's own loader does: a key stored whole is taken whole (as a tuple
where the caller holds a tuple), and a list or dict the checkpoint split is
rebuilt element by element from the keys under it. Keys the caller asks for and
the checkpoint lacks are reported, never invented.

Values may hold tuples (``betas``), infinite floats (``ReduceLROnPlateau.best``) and
dicts keyed by ints, which JSON cannot carry; ``encode`` and ``decode`` tag them for
the manifest JSON (and the JSON that ranks exchange). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import CorruptCheckpointError

RESTORABLE = "dict with str keys, list, tuple, int, float, bool, str, None"
SAVABLE = "None, bool, int, float (inf and nan too), str, and lists, tuples and dicts (str or int keys) of them"
MAX_DEPTH = 100  # nesting a real optimizer or scheduler state never approaches

_SCALARS = (bool, int, str)
_FLOAT_TAGS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_TAGS = ("$tuple", "$float", "$dict", "$items")


def unrestorable(value: Any, depth: int = 0) -> str | None:
    """Why a value read from a foreign pickle cannot be restored, or None when it can."""
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if value is None or type(value) in _SCALARS or type(value) is float:
        return None
    if type(value) in (list, tuple):
        return next((r for r in (unrestorable(v, depth + 1) for v in value) if r), None)
    if type(value) is dict:
        if not all(type(k) is str for k in value):
            return "a dict with non-string keys"
        return next((r for r in (unrestorable(v, depth + 1) for v in value.values()) if r), None)
    return f"a {type(value).__name__} value"


def unsavable(value: Any, depth: int = 0) -> str | None:
    """Why a state_dict leaf cannot be recorded exactly as data, or None when it can.

    Subclasses of the containers are accepted (an ``OrderedDict``, a ``torch.Size``) and
    come back as the plain type; anything else names its type."""
    if depth > MAX_DEPTH:
        return f"a value nested deeper than {MAX_DEPTH} levels"
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        return next((r for r in (unsavable(v, depth + 1) for v in value) if r), None)
    if isinstance(value, Mapping):
        bad = next((k for k in value if not (isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)))),
                   _NO_KEY)
        if bad is not _NO_KEY:
            return f"a dict key {bad!r} of type {type(bad).__name__}"
        return next((r for r in (unsavable(v, depth + 1) for v in value.values()) if r), None)
    return f"a value of type {type(value).__name__}"


_NO_KEY = object()


# ----------------------------------------------------------------- JSON transport


def encode(value: Any) -> Any:
    """A savable value as JSON data: tuples, non-finite floats and int-keyed dicts tagged."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            return {"$items": [[k, encode(v)] for k, v in value.items()]}
        doc = {k: encode(v) for k, v in value.items()}
        return {"$dict": doc} if len(doc) == 1 and next(iter(doc)).startswith("$") else doc
    return next((base(value) for base in (bool, int, float, str) if isinstance(value, base)), value)  # IntEnum: int


def decode(doc: Any, *, where: str) -> Any:
    """The inverse of ``encode``; a malformed tag is a ``CorruptCheckpointError``."""
    try:
        return _decode(doc, where)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: value nested too deeply") from None


def _decode(doc: Any, where: str) -> Any:
    if isinstance(doc, list):
        return [_decode(v, where) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if len(doc) == 1 and (tag := next(iter(doc))) in _TAGS:
        body = doc[tag]
        if tag == "$tuple" and isinstance(body, list):
            return tuple(_decode(v, where) for v in body)
        if tag == "$float" and body in _FLOAT_TAGS:
            return _FLOAT_TAGS[body]
        if tag == "$dict" and isinstance(body, dict):
            return {k: _decode(v, where) for k, v in body.items()}
        if tag == "$items" and isinstance(body, list) and all(_is_item(i) for i in body):
            return {k: _decode(v, where) for k, v in body}
        raise CorruptCheckpointError(f"{where}: malformed {tag} value {body!r:.80}")
    return {k: _decode(v, where) for k, v in doc.items()}


def _is_item(item: Any) -> bool:
    return (isinstance(item, list) and len(item) == 2 and not isinstance(item[0], bool)
            and isinstance(item[0], (str, int)))


# ---------------------------------------------------------------- restoring


@dataclass(slots=True)
class ValuePlan:
    """What restoring the non-tensor leaves of a state_dict will do."""

    assign: list[tuple[Any, Any]] = field(default_factory=list)  # (targets.ValueSlot, value)
    missing: list[str] = field(default_factory=list)  # leaf keys asked for but not restorable
    used: set[str] = field(default_factory=set)  # stored keys consumed


def plan_values(slots: Iterable[Any], stored: Mapping[str, Any], unloadable: Iterable[str] = ()) -> ValuePlan:
    """Match each ``ValueSlot`` with the stored values (whole, or rebuilt from the
    flattened keys under it). ``unloadable`` keys exist but cannot be restored: they
    are reported missing at the precise leaf."""
    parents = _parents([*stored, *unloadable])
    plan = ValuePlan()
    for slot in slots:
        before = len(plan.missing)
        value = _rebuild(slot.key, slot.value, stored, parents, plan)
        if plan.missing[before:] != [slot.key]:  # something of it is stored
            plan.assign.append((slot, value))
    return plan


def _parents(keys: Iterable[str]) -> set[str]:
    """Every dotted prefix of the keys: ``a.b.c`` gives ``a`` and ``a.b``."""
    out: set[str] = set()
    for key in keys:
        dot = key.find(".")
        while dot >= 0:
            out.add(key[:dot])
            dot = key.find(".", dot + 1)
    return out


def _rebuild(key: str, like: Any, stored: Mapping[str, Any], parents: set[str], plan: ValuePlan) -> Any:
    if key in stored:
        plan.used.add(key)
        return conform(like, stored[key])
    if key in parents:
        if isinstance(like, Mapping):
            return {name: _rebuild(f"{key}.{name}", v, stored, parents, plan) for name, v in like.items()}
        if isinstance(like, (list, tuple)):
            items = [_rebuild(f"{key}.{i}", v, stored, parents, plan) for i, v in enumerate(like)]
            return tuple(items) if isinstance(like, tuple) else items
    plan.missing.append(key)
    return like


def conform(like: Any, stored: Any) -> Any:
    """``stored`` in the caller's container types where the two agree in shape: a
    JSON list comes back as a tuple where the caller holds a tuple (``betas``)."""
    if isinstance(like, tuple) and isinstance(stored, (list, tuple)):
        return tuple(conform(like[i] if i < len(like) else None, v) for i, v in enumerate(stored))
    if isinstance(like, list) and isinstance(stored, list) and len(like) == len(stored):
        return [conform(a, b) for a, b in zip(like, stored)]
    if isinstance(like, Mapping) and isinstance(stored, dict):
        return {k: conform(like.get(k), v) for k, v in stored.items()}
    return stored
