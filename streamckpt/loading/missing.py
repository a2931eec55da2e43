"""What a ``strict=False`` load says about the keys it left alone.

A mistyped key under ``strict=False`` would otherwise load nothing and say nothing: the
load logs one WARNING listing the state_dict's keys the checkpoint lacks (the first few,
and how many), each with the checkpoint's names spelled close to it, and a louder one when
not a single key matched (a wrong URI, a wrapper's prefix, another model's checkpoint).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from ..errors import near_names, prefix_hint

log = logging.getLogger(__name__)

SHOWN = 10  # missing keys named in the warning


def describe_missing(missing: list[str], known: Iterable[str], shown: int = SHOWN) -> str:
    """``'a.wieght' (did you mean 'a.weight'?), 'b', ... and 3 more``: the first ``shown``
    of ``missing``, each with its near spellings among ``known``."""
    names = list(known)
    parts = []
    for key in missing[:shown]:
        near = near_names(key, names)
        parts.append(f"{key!r} (did you mean {' or '.join(map(repr, near))}?)" if near else repr(key))
    more = len(missing) - shown
    return ", ".join(parts) + (f", ... and {more} more" if more > 0 else "")


def warn_missing(where: str, missing: list[str], asked: set[str], known: set[str], why: str = "") -> None:
    """Log what a ``strict=False`` load left as it was (nothing when every key matched).

    ``missing``: this rank's keys the checkpoint lacks (sorted); ``asked``: every key of this
    rank's state_dict; ``known``: the checkpoint's names (after transforms); ``why``: why some
    stored entries could not be restored (``loader._why_unloadable``)."""
    if not missing:
        return
    hint = prefix_hint(missing, known)
    listing = describe_missing(missing, known)
    if asked and asked <= set(missing):
        sample = ", ".join(repr(k) for k in sorted(known)[:5]) or "none"
        log.warning(
            "streamckpt load %s (strict=False): no key of the state_dict was found in the checkpoint, so the "
            "load loaded nothing: all %d key(s) are missing: %s%s%s (the checkpoint has %d name(s), such as %s; "
            "check the URI and the key names)", where, len(missing), listing, why, hint, len(known), sample)
        return
    log.warning(
        "streamckpt load %s (strict=False): %d of the state_dict's %d key(s) are not in the checkpoint and "
        "were left as they were: %s%s%s", where, len(missing), len(asked), listing, why, hint)


def kind_clash(missing: Iterable[str], tensor_keys: set[str], tensors: Mapping[str, Any],
               values: Mapping[str, Any]) -> str | None:
    """Why a "missing" key is really a leaf of the wrong kind, or None: the checkpoint holds a
    tensor where the state_dict has plain data (``None``, a number, a list ...), or plain data
    where it has a tensor, at that key or at a dotted prefix of it. Such a key is not absent:
    naming it missing, with itself as the near spelling, sends the user looking for a typo.

    ``tensor_keys``: the keys this rank's state_dict holds tensors at; ``tensors``: the
    checkpoint's tensors (after transforms; each with ``shape`` and ``dtype``); ``values``:
    its stored plain values."""
    for key in missing:
        at = next((p for p in _self_and_prefixes(key) if p in tensors or p in values), None)
        if at is None:
            continue
        mine = (f"a dict or list (holding {key!r})" if at != key else "a tensor" if key in tensor_keys
                else "plain data (None, a number, a string, a list ...)")
        if at in tensors:
            t = tensors[at]
            theirs = f"a tensor (shape {list(t.shape)}, dtype {t.dtype})"
            todo = "put a tensor of that shape and dtype there to load into"
        else:
            theirs = f"a plain value ({type(values[at]).__name__})"
            todo = "put plain data there (it is replaced by the stored value)"
        return (f"{key}: the checkpoint holds {theirs} at {at!r}, where the state_dict has {mine}: {todo}, "
                f"or read the checkpoint as it was saved with sc.load_state")
    return None


def _self_and_prefixes(key: str) -> list[str]:
    """``a.b.c`` -> ``['a.b.c', 'a.b', 'a']``."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
