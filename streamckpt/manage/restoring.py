"""One checkpoint restored by every rank, or passed over by all of them when it cannot be read.

The ranks agree on the outcome (``gather_outcome``): a checkpoint that one rank cannot read
is passed over by every rank; the caller's own mistakes (a shape mismatch, a missing key)
raise on every rank at once instead of falling back.
"""

from __future__ import annotations

from typing import Any

from ..comm import raise_agreed
from ..errors import CheckpointError
from .collective import gather_outcome
from .restored import Restored

FALLBACK_ERRORS = ("CorruptCheckpointError", "UnsupportedVersionError", "CheckpointNotFoundError")


def restore_one(comm: Any, calls: Any, uri: str, step: int, state_dict: Any, load_kwargs: dict[str, Any], *,
                storage_options: Any, process_group: Any, skipped: list[tuple[str, str]],
                fallback: bool) -> Restored[Any] | str:
    """Load ``uri`` (``calls.load`` into ``state_dict``, or ``calls.load_state``): the
    ``Restored``, or why it cannot be read when ``fallback`` allows passing it over."""
    own: BaseException | None = None
    state: Any = None
    loaded: Any = None
    try:
        if state_dict is not None:
            loaded = calls.load(state_dict, uri, storage_options=storage_options, process_group=process_group,
                                **load_kwargs)
            state = state_dict
        else:
            state = calls.load_state(uri, storage_options=storage_options, **load_kwargs)
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks below
        own = e
    failures = gather_outcome(comm, own)
    if not failures:
        got: Restored[Any] = Restored(step, uri, state, skipped)
        if loaded is not None:
            got.bytes_bucket, got.bucket_bytes_read = loaded.bytes_needed, loaded.bytes_read
        return got
    if not fallback or any(f["cls"] not in FALLBACK_ERRORS for f in failures) or \
            (own is not None and not isinstance(own, CheckpointError)):
        raise_agreed(failures, own)
    first = failures[0]
    return f"{first['type']}: {first['msg']}"
