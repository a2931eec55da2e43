"""What ``CheckpointManager.restore`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

S = TypeVar("S")  # the state a restore was given: Restored.state is that very object


@dataclass(slots=True)
class Restored(Generic[S]):
    """What ``CheckpointManager.restore`` restored.

    Attributes:
        step: The step restored.
        uri: The checkpoint's URI (restored from the local tier: this rank's folder of the step).
        state: The filled ``state_dict`` (the one passed, filled in place), or the saved
            tree rebuilt by ``sc.load_state`` when none was passed.
        skipped: ``(uri, why)`` of each newer checkpoint passed over because it could not
            be read, newest first (from the local tier: this rank's folder of a step no rank held whole).
        source: ``"bucket"`` (the checkpoint under the root) or ``"local"`` (``local_dir``'s tier).
        bytes_local, bytes_peers, bytes_bucket: Bytes of this rank's state read by this rank from
            its ``local_dir``, by other ranks from theirs, from the bucket (by any rank).
        bucket_bytes_read: Bytes this rank fetched from the bucket (for others too).
    """

    step: int
    uri: str
    state: S
    skipped: list[tuple[str, str]] = field(default_factory=list)
    source: str = "bucket"
    bytes_local: int = 0
    bytes_peers: int = 0
    bytes_bucket: int = 0
    bucket_bytes_read: int = 0
