"""streamckpt's own format: ``manifest.json`` next to its data files."""

from __future__ import annotations

import logging
import posixpath

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
    """The name of the newest child prefix holding a committed checkpoint (by its
    manifest's modification time), or None. Prefixes without a manifest are uncommitted."""
    best: tuple[float, str] | None = None
    for name in storage.list(""):
        child = posixpath.basename(name.rstrip("/"))
        try:
            when = storage.modified(f"{child}/{MANIFEST_NAME}")
        except CheckpointError as e:  # a plain object, not a prefix, and the like
            log.debug("latest: skipping %s: %s", child, e)
            continue
        if when is not None and (best is None or (when, child) > best):
            best = (when, child)
    return None if best is None else best[1]
