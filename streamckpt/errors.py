"""Error classes: every failure a user can see is a ``CheckpointError`` subclass.

Messages say what failed, where (key / object / byte range / field) and, where it
helps, what to do about it.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error streamckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint (manifest, safetensors or DCP metadata) at the given URI."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata are invalid: bad manifest, checksum mismatch,
    truncated object, offsets out of bounds, hostile header."""


class UnsupportedVersionError(CorruptCheckpointError):
    """The manifest declares a format version this library does not read."""


class IncompatibleStateDictError(CheckpointError):
    """The state_dict does not fit the checkpoint: shape, dtype or layout mismatch."""


class MissingKeysError(CheckpointError):
    """``strict=True`` and the checkpoint lacks keys the state_dict asks for."""

    def __init__(self, message: str, missing_keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys or [])


class StorageError(CheckpointError):
    """Storage kept failing after retries (names object and byte range)."""


class TransformError(CheckpointError):
    """A transform rule is invalid or does not fit the checkpoint (names the rule)."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint already exists at the URI and ``overwrite`` is False."""


class StagingMemoryError(CheckpointError):
    """A rank could not allocate the pinned or device memory a load stages through
    (names the rank, the memory and the bytes asked for)."""


class PeerError(CheckpointError):
    """Another rank of the process group failed; this rank stopped with it."""


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "UnsupportedVersionError",
    "IncompatibleStateDictError",
    "MissingKeysError",
    "StorageError",
    "TransformError",
    "CheckpointExistsError",
    "StagingMemoryError",
    "PeerError",
]
