"""streamckpt's own format: ``manifest.json`` next to its data files."""

from __future__ import annotations

import logging
import posixpath
import re

from ..core.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, from_json
from ..errors import CheckpointError, CheckpointNotFoundError
from ..storage import Storage

log = logging.getLogger(__name__)


def read_native_manifest(storage: Storage) -> Manifest | None:
    """The manifest at the prefix, validated; None when there is none."""
    data = read_native_bytes(storage)
    return None if data is None else from_json(data, where=storage.describe(MANIFEST_NAME))


def read_native_bytes(storage: Storage) -> bytes | None:
    """The manifest's bytes as stored (one GET, refused over ``MAX_MANIFEST_BYTES`` and
    checked against an MD5 ETag), unparsed; None when there is none. A group of ranks
    passes these on and parses them everywhere at once (``loader.share_manifest``)."""
    try:
        return storage.read_bytes(MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES)
    except CheckpointNotFoundError:
        return None


def latest_committed(storage: Storage) -> str | None:
    """The name of the newest committed checkpoint directly under the prefix, or None.

    Newest means the latest commit time its manifest records (``committed_ns``, nanoseconds,
    written by the committing rank just before the manifest), not the store's timestamps
    (S3 keeps whole seconds: two saves within a second would tie) nor names. The store's
    LastModified only narrows the candidates to those within ``CANDIDATE_WINDOW_S`` of the
    newest, so that only their manifests' first bytes are read. A manifest written before
    streamckpt recorded commit times counts at its LastModified. Ties go to the name that
    sorts last in natural order (``step-10`` after ``step-9``). Prefixes without a manifest
    are uncommitted and never chosen."""
    return newest_of(storage, committed_children(storage))


def committed_children(storage: Storage) -> list[tuple[float, str]]:
    """``(LastModified of its manifest, name)`` of each committed checkpoint directly under the prefix."""
    found: list[tuple[float, str]] = []
    for name in storage.list(""):
        child = posixpath.basename(name.rstrip("/"))
        try:
            when = storage.modified(f"{child}/{MANIFEST_NAME}")
        except CheckpointError as e:  # a plain object, not a prefix, and the like
            log.debug("latest: skipping %s: %s", child, e)
            continue
        if when is not None:
            found.append((when, child))
    return found


def newest_of(storage: Storage, found: list[tuple[float, str]]) -> str | None:
    """The newest of ``committed_children`` (see ``latest_committed``), or None."""
    if not found:
        return None
    newest = max(when for when, _ in found)
    candidates = [(_commit_ns(storage, child, when), natural_key(child), child)
                  for when, child in found if when >= newest - CANDIDATE_WINDOW_S]
    return max(candidates)[2]


CANDIDATE_WINDOW_S = 2.0  # LastModified rounds to seconds; commit and upload end differ by a request
HEAD_BYTES = 256  # committed_ns stands within a manifest's first bytes (manifest.to_json puts it there)
_COMMITTED = re.compile(rb'"committed_ns":(\d{1,20})[,}]')


def _commit_ns(storage: Storage, child: str, modified: float) -> int:
    name = f"{child}/{MANIFEST_NAME}"
    try:
        head = storage.read_bytes(name, 0, min(HEAD_BYTES, storage.size(name)))
    except CheckpointError as e:  # removed meanwhile, say: its LastModified stands
        log.debug("latest: %s: %s", name, e)
        head = b""
    m = _COMMITTED.search(head)
    return int(m.group(1)) if m else int(modified * 1e9)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Digit runs compare as numbers: ``step-9`` < ``step-10``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)
