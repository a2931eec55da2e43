"""streamckpt's own format: ``manifest.json`` next to its data files."""

from __future__ import annotations

import logging
import posixpath

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, from_json
from ..storage import Storage

log = logging.getLogger(__name__)


def read_native_manifest(storage: Storage) -> Manifest | None:
    """The manifest at the prefix, validated; None when there is none."""
    try:
        size = storage.size(MANIFEST_NAME)
    except CheckpointNotFoundError:
        return None
    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"{storage.describe(MANIFEST_NAME)}: {size} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit"
        )
    data = storage.read_bytes(MANIFEST_NAME, 0, size) if size else b""
    return from_json(data, where=storage.describe(MANIFEST_NAME))


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
