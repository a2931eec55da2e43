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

from ..errors import StorageError
from ..results import human_bytes
from ..storage import ObjectInfo, Storage
from ..storage.store import OpenUpload
from .index import Listing

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


RECENT_SECONDS = 600.0  # garbage younger than this may be a save in progress: collecting it is warned about


def recent(found: Sequence[Garbage], objects: Mapping[str, ObjectInfo], uploads: Sequence[OpenUpload], *,
           now: float, window: float = RECENT_SECONDS) -> dict[str, float]:
    """The children among ``found`` changed less than ``window`` seconds ago (their newest
    object or upload start), with that age: a grace shorter than a save let them be marked."""
    times: dict[str, list[float]] = {}
    started = {u.name: u.initiated for u in uploads}
    for g in found:
        when = started.get(g.name) if g.upload is not None else objects[g.name].modified
        times.setdefault(g.name.partition("/")[0], []).append(now if when is None else when)
    ages = {child: now - max(ts) for child, ts in times.items()}
    return {child: age for child, age in sorted(ages.items()) if age < window}


def collect(storage: Storage, listing: Listing, *, root: str, protected: Collection[str], now: float,
            older_than: float, dry_run: bool) -> list[str]:
    """Remove what ``mark`` finds under the root (``collect_garbage``); returns each item's URI
    with its size, or marked as an incomplete upload, in name order."""
    uploads = storage.open_uploads("")
    found = mark(listing.objects, uploads, listing.referenced(), {e.name for e in listing.entries if e.error}
                 | set(protected), now=now, older_than=older_than)
    out = [f"{root}/{g.name} (incomplete upload)" if g.upload else f"{root}/{g.name} ({human_bytes(g.size)})"
           for g in found]
    for child, age in recent(found, listing.objects, uploads, now=now).items():
        log.warning("collect_garbage under %s%s: %s/%s changed %.0f s ago and has no manifest: a save still in "
                    "progress (another process's) would be destroyed and fail its commit; older_than=%g s is shorter "
                    "than a save may take (the default is 3600 s)", root, " (dry run)" if dry_run else "", root,
                    child, age, older_than)
    if dry_run or not found:
        return out
    for g in found:
        if g.upload is not None:
            storage.abort_upload(g.upload)
    failed = storage.delete_many([g.name for g in found if g.upload is None])
    for folder in sorted({g.name.split("/", 1)[0] for g in found if "/" in g.name}):
        storage.remove_empty_dirs(folder)  # file systems: no empty folder per collected save
    if failed:
        raise StorageError(f"collect_garbage under {root}: {len(failed)} object(s) could not be deleted "
                           f"({'; '.join(f'{n}: {e}' for n, e in failed[:3])}); run it again later")
    log.info("collected %d garbage item(s) under %s (%s)", len(found), root, human_bytes(sum(g.size for g in found)))
    return out
