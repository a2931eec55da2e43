"""One rank does the storage work, every rank gets its answer or its error."""

from __future__ import annotations

import json
from typing import Any, Callable

from ..comm import GroupComm, SoloComm, encode_error, raise_agreed


def on_one_rank(comm: SoloComm | GroupComm, fn: Callable[[], Any]) -> Any:
    """``fn()`` (a JSON value) on rank 0, broadcast: every rank returns it, or raises rank 0's
    error (its own exception on rank 0, the same class elsewhere)."""
    if comm.world_size == 1:
        return fn()
    own: BaseException | None = None
    blob = None
    if comm.rank == 0:
        try:
            blob = json.dumps({"ok": fn()}).encode()
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised here below
            own = e
            blob = json.dumps({"error": encode_error(e, 0)}).encode()
    doc = json.loads(comm.broadcast_bytes(blob, 0))
    if "error" in doc:
        raise_agreed([doc["error"]], own)
    return doc["ok"]


def gather_outcome(comm: SoloComm | GroupComm, exc: BaseException | None) -> list[dict[str, Any]]:
    """Every rank's failure (``encode_error`` of it; empty when none failed), lowest rank first."""
    if comm.world_size == 1:
        return [] if exc is None else [encode_error(exc, 0) or {}]
    blobs = comm.all_gather_bytes(json.dumps(encode_error(exc, comm.rank)).encode())
    return [f for f in (json.loads(b) for b in blobs) if f]
