"""Garbage under a run's root: what no committed manifest references (mark and sweep).

Marked: every object inside a child of the root (``<root>/<child>/...``) that no committed
manifest under the root references (a save that died before its commit, a checkpoint
half-deleted), and every incomplete multipart upload under the root. A child is swept
only when everything unreferenced in it is older than the grace period (the newest object
or upload start counts), so a save in progress younger than the grace is never touched.
Children whose manifest cannot be read are left alone whole (their references are unknown).
Objects directly at the root are not checkpoint data and are never marked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from ..storage import ObjectInfo
from ..storage.store import OpenUpload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Garbage:
    """One thing to remove: an object (``size`` bytes) or an open upload (``upload``; size unknown: 0)."""

    name: str
    size: int
    upload: OpenUpload | None = None

    def describe(self) -> str:
        return f"{self.name} (incomplete upload {self.upload.upload_id})" if self.upload else self.name


def mark(objects: Mapping[str, ObjectInfo], uploads: Sequence[OpenUpload], referenced: Collection[str],
         protected: Collection[str], *, now: float, older_than: float) -> list[Garbage]:
    """What ``collect_garbage`` removes (see the module docstring), in name order."""
    groups: dict[str, list[Garbage]] = {}
    newest: dict[str, float] = {}
    for name, info in objects.items():
        child, sep, _ = name.partition("/")
        if not sep or name in referenced or child in protected:
            continue
        groups.setdefault(child, []).append(Garbage(name, info.size))
        newest[child] = max(newest.get(child, float("-inf")), info.modified if info.modified is not None else now)
    for up in uploads:
        child, sep, _ = up.name.partition("/")
        if not sep or child in protected:
            continue
        groups.setdefault(child, []).append(Garbage(up.name, 0, up))
        newest[child] = max(newest.get(child, float("-inf")), up.initiated if up.initiated is not None else now)
    out: list[Garbage] = []
    for child, found in groups.items():
        if now - newest[child] >= older_than:
            out += found
        else:
            log.debug("garbage: %s changed %.0f s ago (grace %.0f s): left alone", child, now - newest[child],
                      older_than)
    return sorted(out, key=lambda g: (g.name, g.upload is not None))
