"""What a ``strict=False`` load says about the keys it left alone.

A mistyped key under ``strict=False`` would otherwise load nothing and say nothing: the
load logs one WARNING listing the state_dict's keys the checkpoint lacks (the first few,
and how many), each with the checkpoint's names spelled close to it, and a louder one when
not a single key matched (a wrong URI, a wrapper's prefix, another model's checkpoint).
"""

from __future__ import annotations

import logging
from typing import Iterable

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
