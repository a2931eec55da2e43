"""streamckpt: stream sharded PyTorch checkpoints from object storage into any layout."""

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateDictError,
    MissingKeysError,
    PeerError,
    StorageError,
    TransformError,
    UnsupportedVersionError,
)

__version__ = "0.1.0"
