"""Deleting a checkpoint so that it is never half-seen as committed.

The manifest goes first: once it is gone the checkpoint is uncommitted (``latest``,
``steps`` and loads pass it over), then its data objects. A deletion cut short at any
point leaves every other checkpoint whole and the rest as garbage that
``collect_garbage`` finds. One routine for every caller (``CheckpointManager.prune``,
the Lightning plug-in's ``remove_checkpoint``).
"""

from __future__ import annotations

import logging
import posixpath
from typing import Collection, Iterable

from ..core.manifest import MANIFEST_NAME
from ..errors import StorageError
from ..storage import Storage
from .index import Entry, Listing

log = logging.getLogger(__name__)


def delete_checkpoint(storage: Storage, prefix: str = "", *, names: Iterable[str] | None = None,
                      keep: Collection[str] = ()) -> list[str]:
    """Delete the checkpoint at ``prefix`` (relative to ``storage``'s root; "" for the root
    itself): its manifest, then each of ``names`` (default: every object under the prefix)
    except those in ``keep`` (objects another committed checkpoint still references).

    Returns the names deleted, manifest first. A data object that cannot be deleted does not
    stop the others; the call then raises ``StorageError`` naming what is left (garbage:
    the manifest is already gone). A manifest that cannot be deleted raises at once, with
    nothing else deleted.
    """
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    manifest = base + MANIFEST_NAME
    if names is None:
        names = [n for n in storage.list(base.rstrip("/"), recursive=True) if _inside(n) and n.startswith(base)]
    data = [n for n in dict.fromkeys(names) if n != manifest and n not in keep]
    storage.delete(manifest)
    failed = dict(storage.delete_many(data))
    for name, e in failed.items():
        log.warning("could not delete %s: %s", storage.describe(name), e)
    deleted = [manifest] + [n for n in data if n not in failed]
    left = [n for n in data if n in failed]
    if left:
        raise StorageError(
            f"deleted the manifest of {storage.describe(base)} (it is no longer a checkpoint) but "
            f"{len(left)} of its objects could not be deleted ({', '.join(left[:5])}"
            f"{', ...' if len(left) > 5 else ''}): they are garbage now; collect_garbage (or "
            f"'streamckpt gc') removes them once storage accepts deletes again")
    if base:
        storage.remove_empty_dirs(base.rstrip("/"))  # a local run root would keep an empty folder per step
    log.info("deleted %s (%d objects, manifest first)", storage.describe(base), len(deleted))
    return deleted


def delete_entries(storage: Storage, listing: Listing, doomed: list[Entry]) -> Listing:
    """Delete checkpoints of a run's root (each manifest first), keeping what the others still
    reference; returns the listing without them."""
    gone: set[str] = set()
    for e in doomed:
        alive = [other for other in listing.entries if other.name != e.name and other.name not in gone]
        keep = {n for other in alive for n in other.objects}
        names = [n for n in listing.objects if n.startswith(e.name + "/")]
        names += orphaned_references(e, {other.name for other in alive}, listing)
        delete_checkpoint(storage, e.name, names=names, keep=keep)
        gone.add(e.name)
    return Listing([e for e in listing.entries if e.name not in gone], listing.objects)


def orphaned_references(entry: Entry, alive: set[str], listing: Listing) -> list[str]:
    """The files ``entry`` references in siblings that are no longer committed (pruned
    before it, their shared files kept for it): deleting ``entry`` deletes them too, unless
    a kept checkpoint references them (``delete_checkpoint``'s ``keep``)."""
    return [n for n in entry.objects if not n.startswith(entry.name + "/") and n in listing.objects
            and n.partition("/")[0] not in alive]


def _inside(name: str) -> bool:
    """Only names under the checkpoint's own prefix (never a sibling such as ``x.ckpt-v1/...``)."""
    return bool(name) and not name.startswith("..") and not posixpath.isabs(name)
