"""Non-tensor values as DCP's planner asks for them: flattened aliases, the order it rebuilds
them in, the ``.metadata`` of a DCP checkpoint and its value items, and planner paths."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..core import tree as trees
from ..errors import CheckpointNotFoundError
from ..formats.dcp import MAX_METADATA_BYTES, METADATA_NAME, restorable_values
from ..formats.dcpitem import MAX_VALUE_ITEM_BYTES, RangeCache
from ..formats.dcpmeta import DcpMetadata, parse_metadata
from ..storage import Storage


def dcp_values(values: dict[str, Any]) -> dict[str, Any]:
    """Values under their own keys and under the keys DCP's planner flattens them into
    (a native checkpoint keeps ``optim.param_groups`` whole; DCP asks for
    ``optim.param_groups.0.lr``)."""
    out = dict(values)
    for key, value in values.items():
        flat, _ = flatten_state_dict({key: value})
        for k, v in flat.items():
            out.setdefault(k, v)
    return out


def value_order(values: dict[str, Any]) -> list[str]:
    """Value keys for DCP's metadata: each value's flattened aliases (see ``dcp_values``)
    before the value itself, so that a planner rebuilding the state from the metadata in
    order (``_EmptyStateDictLoadPlanner``) ends with the whole value in its place."""
    out: list[str] = []
    for key, value in values.items():
        flat, _ = flatten_state_dict({key: value})
        out += [k for k in flat if k != key] + [key]
    return out


def dcp_metadata(storage: Storage) -> DcpMetadata | None:
    """The parsed ``.metadata`` at the prefix (one GET, no pickle code run), or None."""
    try:
        raw = storage.read_bytes(METADATA_NAME, max_bytes=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        return None
    return parse_metadata(raw, where=storage.describe(METADATA_NAME))


def dcp_item_values(cache: RangeCache, storage: Storage, md: DcpMetadata) -> tuple[dict[str, Any], dict[str, str]]:
    """``formats.dcp.restorable_values``, their bytes fetched together first."""
    cache.prefetch([(it.file, it.offset, it.offset + it.length) for it in md.values.values()
                    if it.length <= MAX_VALUE_ITEM_BYTES])
    return restorable_values(cache, storage, md)


def planner_paths(tree: Any, tensors: Any, values: dict[str, Any],
                   keys: Sequence[str]) -> dict[str, tuple[str | int, ...]]:
    """Every key's path in the saved state's nesting, as DCP's default planner records it in
    ``Metadata.planner_data`` (``_EmptyStateDictLoadPlanner``, hence ``dcp_to_torch_save``, and
    ``load_sharded_optimizer_state_dict`` rebuild the nesting from it); a key the tree does not
    place (a checkpoint without one) stays at the top level under its dotted name."""
    tree = tree if tree is not None else trees.flat(tensors, values)
    paths = dict(tree_paths(tree, ()))
    for key, value in values.items():  # the flattened aliases of dcp_values
        flat, mapping = flatten_state_dict({key: value})
        base = paths.get(key, (key,))
        for k in flat:
            paths.setdefault(k, base + tuple(mapping[k][1:]))
    return {k: paths.get(k, (k,)) for k in keys}


def tree_paths(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str, tuple[str | int, ...]]]:
    """(stored key, path) of every leaf of a (checked) tree document, see ``core.tree``."""
    if isinstance(node, list):
        for i, child in enumerate(node):
            if child is not None:
                yield from tree_paths(child, path + (i,))
        return
    if not isinstance(node, dict):
        return
    if len(node) == 1:
        kind, inner = next(iter(node.items()))
        if kind in (trees.TENSOR, trees.VALUE) and isinstance(inner, str):
            yield inner, path
            return
        if kind == trees.TUPLE:
            yield from tree_paths(inner, path)
            return
        if kind == trees.ITEMS:
            for name, child in inner:  # a dict key is a string in DCP's paths (it flattens with str(key))
                yield from tree_paths(child, path + (str(name),))
            return
    for name, child in node.items():
        yield from tree_paths(child, path + (name,))
