"""streamckpt's own format: ``manifest.json`` next to its data files."""

from __future__ import annotations

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, from_json
from ..storage import Storage


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
