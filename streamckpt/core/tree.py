"""A state tree's structure as data: what ``sc.load_state`` rebuilds, without pickle.

``torch.save`` keeps a training state's nesting by pickling it. A manifest keeps it as a
JSON document (``tree``) of the same shape, whose leaves refer to what the checkpoint
stores under dotted keys:

* a dict with string keys (none starting with ``$``) is a JSON object, in order;
* any other dict (int keys, as a plain ``optimizer.state_dict()`` has them) is
  ``{"$items": [[key, node], ...]}``, keys as JSON strings or integers;
* a list that holds tensors is a JSON array, a tuple that does ``{"$tuple": [...]}``;
* a tensor leaf is ``{"$tensor": dotted_key}`` (an entry of the manifest's ``tensors``),
  any other leaf ``{"$value": dotted_key}`` (an entry of its ``values``).

Leaves are cut exactly where ``targets.iter_leaves`` cuts them, so ``sc.load`` (which
fills a caller's tree by dotted keys) and ``load_state`` (which builds the tree) agree.
Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import CorruptCheckpointError, MissingKeysError, close_to
from .targets import is_key, is_split, is_tensor_leaf
from .values import MAX_DEPTH

TENSOR, VALUE, ITEMS, TUPLE = "$tensor", "$value", "$items", "$tuple"


def describe(state_dict: Mapping[Any, Any]) -> dict[str, Any]:
    """The tree document of a state_dict (its keys checked by ``targets.collect`` first)."""
    return _mapping(state_dict, "")


def _node(value: Any, key: str) -> Any:
    if isinstance(value, Mapping):
        return _mapping(value, key + ".")
    if is_split(value):
        items = [_node(v, f"{key}.{i}") for i, v in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    return {TENSOR if is_tensor_leaf(value) else VALUE: key}


def _mapping(value: Mapping[Any, Any], prefix: str) -> dict[str, Any]:
    if all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: _node(v, f"{prefix}{k}") for k, v in value.items()}
    return {ITEMS: [[k, _node(v, f"{prefix}{k}")] for k, v in value.items()]}


def flat(tensors: Iterable[str], values: Iterable[str]) -> dict[str, Any]:
    """The tree of a checkpoint that recorded none (an older native one, a Hugging Face
    file, a DCP checkpoint without its planner's paths): one flat dict of dotted keys."""
    refs: dict[str, Any] = {k: {TENSOR: k} for k in tensors}
    refs.update({k: {VALUE: k} for k in values})
    if all(not k.startswith("$") for k in refs):
        return refs
    return {ITEMS: [[k, v] for k, v in refs.items()]}


def from_paths(paths: Mapping[str, Sequence[str | int]], tensors: Iterable[str], values: Iterable[str]) -> Any:
    """The tree of a DCP checkpoint from its planner's flattening (``fqn -> path``): a
    string component is a dict key, an int one a list index, as DCP's own unflattening
    rebuilds it (list slots no path names stay None)."""
    refs = {k: {TENSOR: k} for k in tensors} | {k: {VALUE: k} for k in values}
    root: dict[Any, Any] = {}
    for fqn, ref in refs.items():
        path = list(paths.get(fqn) or (fqn,))
        node: Any = root
        for here, there in zip(path, path[1:] + [None]):
            if there is None:
                _put(node, here, ref)
            else:
                node = _child(node, here, {} if isinstance(there, str) else [])
    return _as_doc(root)


def _child(node: Any, name: str | int, empty: Any) -> Any:
    if isinstance(node, list):
        node.extend([None] * (int(name) + 1 - len(node)))
        if node[int(name)] is None:
            node[int(name)] = empty
        return node[int(name)]
    return node.setdefault(name, empty)


def _put(node: Any, name: str | int, ref: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (int(name) + 1 - len(node)))
        node[int(name)] = ref
    else:
        node[name] = ref


def _as_doc(node: Any) -> Any:
    """Plain nested dicts and lists (with refs at the leaves) as a tree document."""
    if isinstance(node, list):
        return [_as_doc(v) for v in node]
    if isinstance(node, dict) and not (len(node) == 1 and next(iter(node)) in (TENSOR, VALUE)):
        if all(isinstance(k, str) and not k.startswith("$") for k in node):
            return {k: _as_doc(v) for k, v in node.items()}
        return {ITEMS: [[k, _as_doc(v)] for k, v in node.items()]}
    return node


def only(doc: Any, tensor_keys: set[str]) -> dict[str, Any]:
    """The part of a tree that reaches the tensors ``tensor_keys`` (containers above them kept)."""
    kept = _only(doc, tensor_keys)
    return kept if kept is not None else {}


def _only(node: Any, keys: set[str]) -> Any:
    ref = _ref(node)
    if ref is not None:
        return node if ref[0] == TENSOR and ref[1] in keys else None
    if node is None:
        return None
    if isinstance(node, list):
        kept = [_only(v, keys) for v in node]
        return kept if any(v is not None for v in kept) else None
    if len(node) == 1 and TUPLE in node:
        inner = _only(node[TUPLE], keys)
        return None if inner is None else {TUPLE: inner}
    if len(node) == 1 and ITEMS in node:
        items = [[k, v] for k, c in node[ITEMS] if (v := _only(c, keys)) is not None]
        return {ITEMS: items} if items else None
    out = {k: v for k, c in node.items() if (v := _only(c, keys)) is not None}
    return out or None


def merge(base: Any, extra: Any) -> Any:
    """``base`` with what ``extra`` (another rank's ``only``) adds; where both hold a
    node of different kinds, ``base`` wins."""
    if base is None:
        return extra
    if extra is None or _ref(base) is not None or _ref(extra) is not None:
        return base
    if isinstance(base, list) and isinstance(extra, list):
        longer = base + [None] * (len(extra) - len(base))
        return [merge(b, extra[i] if i < len(extra) else None) for i, b in enumerate(longer)]
    if not isinstance(base, dict) or not isinstance(extra, dict):
        return base
    for tag in (TUPLE, ITEMS):
        if (tag in base) != (tag in extra) and (len(base) == 1 or len(extra) == 1):
            return base
    if TUPLE in base and len(base) == 1:
        return {TUPLE: merge(base[TUPLE], extra[TUPLE])}
    if ITEMS in base and len(base) == 1:
        merged = dict((_hashable(k), [k, v]) for k, v in base[ITEMS])
        for k, v in extra[ITEMS]:
            old = merged.get(_hashable(k))
            merged[_hashable(k)] = [k, v if old is None else merge(old[1], v)]
        return {ITEMS: list(merged.values())}
    out = {k: merge(v, extra.get(k)) for k, v in base.items()}
    out.update({k: v for k, v in extra.items() if k not in base})
    return out


def _hashable(key: str | int) -> tuple[str, str | int]:
    return (type(key).__name__, key)  # 0 and "0" are different keys


# ------------------------------------------------------------------- reading


def check(doc: Any, tensors: Mapping[str, Any], values: Mapping[str, Any], *, where: str) -> None:
    """A tree read from a manifest: well formed, every reference to something stored."""
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: tree must be a JSON object")
    for path, kind, key in _refs(doc, "tree", 0, where):
        if key not in (tensors if kind == TENSOR else values):
            raise CorruptCheckpointError(f"{where}: {path} refers to {key!r}, which the checkpoint does not store")


def _refs(node: Any, path: str, depth: int, where: str) -> Iterator[tuple[str, str, str]]:
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: {path} is nested deeper than {MAX_DEPTH} levels")
    for child_path, child in _children(node, path, where):
        if child is None:
            continue
        ref = _ref(child)
        if ref is not None:
            yield child_path, ref[0], ref[1]
        else:
            yield from _refs(child, child_path, depth + 1, where)


def _ref(node: Any) -> tuple[str, str] | None:
    if isinstance(node, dict) and len(node) == 1:
        kind, key = next(iter(node.items()))
        if kind in (TENSOR, VALUE) and isinstance(key, str):
            return kind, key
    return None


def _children(node: Any, path: str, where: str) -> list[tuple[str, Any]]:
    if isinstance(node, list):
        return [(f"{path}[{i}]", v) for i, v in enumerate(node)]
    if isinstance(node, dict) and len(node) == 1 and TUPLE in node and isinstance(node[TUPLE], list):
        return [(f"{path}[{i}]", v) for i, v in enumerate(node[TUPLE])]
    if isinstance(node, dict) and len(node) == 1 and ITEMS in node:
        items = node[ITEMS]
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 and is_key(i[0]) for i in items):
            raise CorruptCheckpointError(f"{where}: {path} has a malformed {ITEMS} list")
        return [(f"{path}[{k!r}]", v) for k, v in items]
    if isinstance(node, dict):
        return [(f"{path}.{k}", v) for k, v in node.items()]
    raise CorruptCheckpointError(f"{where}: {path} is a {type(node).__name__}, not a tree node")


def tensor_keys(doc: Any) -> list[str]:
    """The stored tensors a (checked) tree refers to, in tree order."""
    return [key for _, kind, key in _refs(doc, "tree", 0, "tree") if kind == TENSOR]


def build(doc: Any, tensors: Mapping[str, Any], values: Mapping[str, Any]) -> Any:
    """The state the tree describes, its leaves taken from ``tensors`` and ``values``."""
    ref = _ref(doc)
    if ref is not None:
        return tensors[ref[1]] if ref[0] == TENSOR else values[ref[1]]
    if isinstance(doc, list):
        return [None if v is None else build(v, tensors, values) for v in doc]
    if len(doc) == 1 and TUPLE in doc:
        return tuple(None if v is None else build(v, tensors, values) for v in doc[TUPLE])
    if len(doc) == 1 and ITEMS in doc:
        return {k: build(v, tensors, values) for k, v in doc[ITEMS]}
    return {k: build(v, tensors, values) for k, v in doc.items()}


def select(doc: Any, prefixes: Iterable[str] | None, *, where: str) -> Any:
    """Only the subtrees at the dotted ``prefixes`` (and the containers above them);
    a prefix that names nothing is a ``MissingKeysError``. List slots left out are None."""
    if prefixes is None:
        return doc
    wanted = list(prefixes)
    found: set[str] = set()
    out = _select(doc, "", wanted, found)
    absent = [p for p in wanted if p not in found]
    if absent:
        raise MissingKeysError(f"{len(absent)} key(s) not in {where}: {', '.join(absent[:10])}"
                               f"{close_to(absent, _dotted(doc, ''))}", missing_keys=absent)
    return out if out is not None else {}


def _dotted(doc: Any, at: str) -> Iterator[str]:
    """Every dotted prefix in ``doc`` (the names ``select`` would find), for a did-you-mean."""
    items = doc[ITEMS] if isinstance(doc, dict) and ITEMS in doc else (doc.items() if isinstance(doc, dict) else ())
    for k, v in items:
        if k in (TENSOR, VALUE, TUPLE):
            continue
        name = f"{at}{k}"
        yield name
        yield from _dotted(v, f"{name}.")


def _select(node: Any, path: str, wanted: list[str], found: set[str]) -> Any:
    hits = [p for p in wanted if path and (path == p or path.startswith(p + "."))]
    if hits:
        found.update(hits)
        return node
    if _ref(node) is not None or (path and not any(p.startswith(path + ".") for p in wanted)):
        return None
    prefix = f"{path}." if path else ""
    if isinstance(node, list) or (isinstance(node, dict) and len(node) == 1 and TUPLE in node):
        items = node if isinstance(node, list) else node[TUPLE]
        kept = [None if v is None else _select(v, f"{prefix}{i}", wanted, found) for i, v in enumerate(items)]
        if all(v is None for v in kept):
            return None
        return kept if isinstance(node, list) else {TUPLE: kept}
    if isinstance(node, dict) and len(node) == 1 and ITEMS in node:
        kept_items = [[k, s] for k, v in node[ITEMS] if (s := _select(v, f"{prefix}{k}", wanted, found)) is not None]
        return {ITEMS: kept_items} if kept_items else None
    kept_map = {k: s for k, v in node.items() if (s := _select(v, f"{prefix}{k}", wanted, found)) is not None}
    return kept_map or None
