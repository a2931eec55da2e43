"""Who references a checkpoint's files: the guard that keeps a save from replacing a base.

An incremental checkpoint's manifest points at files of its base (a sibling under the same
root). Before a save replaces a committed checkpoint (``overwrite=True``), rank 0 asks here
whether a committed sibling references its files, from the manager's listing of the root
(``index``). The saving layer sits below this one: the wiring (``streamckpt.api``,
``streamckpt.dcp``) hands this check to the save.
"""

from __future__ import annotations

from ..errors import CheckpointInUseError
from ..saving.incremental import norm_uri
from ..storage import Storage
from .index import Index


def check_unreferenced(uri: str, storage_options: dict | None) -> None:
    """Rank 0, before a save replaces the committed checkpoint at ``uri``: refuse when a
    committed sibling (an incremental save that used it as base) references its files.

    Costs a recursive LIST of the parent prefix and a read of each sibling's manifest (the
    manager's listing, ``manage.index``), paid only when a committed checkpoint is being
    overwritten. A checkpoint at the top of its bucket or store has no siblings.

    Raises:
        CheckpointInUseError: names the referencing checkpoints and what to do.
    """
    here = norm_uri(uri)
    parent, _, own = here.rpartition("/")
    if not parent or not own or parent.endswith(":/") or parent.endswith(":"):
        return
    storage = Storage(parent, storage_options)
    try:
        users = Index().list(storage).users_of(own)
    finally:
        storage.close()
    if users:
        more = f" and {len(users) - 5} more" if len(users) > 5 else ""
        named = ", ".join(f"{parent}/{u}" for u in users[:5]) + more
        raise CheckpointInUseError(
            f"{uri} holds bytes that the committed incremental checkpoint(s) {named} reference (saved with it as "
            f"base): overwriting it would break them, so nothing was written or deleted. Save under another name; or "
            f"first make each of them self-contained (sc.copy(src, dst), or 'streamckpt copy SRC DST') and delete "
            f"it, or delete them")
