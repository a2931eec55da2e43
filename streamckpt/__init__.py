"""streamckpt: stream sharded PyTorch checkpoints from object storage into any layout.

See docs/API.md (or ``help()`` of each name in ``__all__``) for the reference.
"""

from typing import TYPE_CHECKING

from .api import CheckpointManager, Restored, async_save, copy, inspect, latest, load, load_full, load_state, merge, save
from .saving.asyncsave import SaveHandle
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateDictError,
    MissingKeysError,
    PeerError,
    StagingMemoryError,
    StorageError,
    StorageOptionError,
    TransformError,
    UnsupportedVersionError,
)
from .core.sharded import ShardedTensor
from .results import CheckpointInfo, CopyResult, LoadResult, SaveResult, TensorInfo

if TYPE_CHECKING:  # imported on first use (``__getattr__``); type checkers see the class
    from .transforms import Transforms

__version__ = "0.1.0"

__all__ = [
    "save", "async_save", "SaveHandle", "load", "load_full", "load_state", "merge", "copy", "inspect", "latest",
    "CheckpointManager", "Restored",
    "ShardedTensor", "LoadResult", "SaveResult", "CopyResult", "CheckpointInfo", "TensorInfo",
    "CheckpointError", "CheckpointExistsError", "CheckpointInUseError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "IncompatibleStateDictError", "MissingKeysError", "PeerError", "StagingMemoryError", "StorageError", "StorageOptionError",
    "TransformError",
    "UnsupportedVersionError",
]


def _lazy_transforms() -> object:  # pragma: no cover - convenience
    from .transforms import Transforms

    return Transforms


def __getattr__(name: str) -> object:
    if name == "Transforms":
        return _lazy_transforms()
    raise AttributeError(f"module 'streamckpt' has no attribute {name!r}")
