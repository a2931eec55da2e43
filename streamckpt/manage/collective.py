"""One rank does the storage work, every rank gets its answer or its error."""

from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Any, Callable, TypeVar

from ..comm import GroupComm, SoloComm, encode_error, raise_agreed

T = TypeVar("T")


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


def started_on_one_rank(comm: SoloComm | GroupComm, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` started now on rank 0 (a thread) and its answer when called there; ``fn`` itself
    elsewhere. Pass the result to a call that runs ``fn`` on rank 0 alone (``on_one_rank``):
    what rank 0 does until then runs beside ``fn``."""
    if comm.rank != 0:
        return fn
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="streamckpt-started")
    started = pool.submit(fn)
    pool.shutdown(wait=False)
    return started.result


def gather_outcome(comm: SoloComm | GroupComm, exc: BaseException | None) -> list[dict[str, Any]]:
    """Every rank's failure (``encode_error`` of it; empty when none failed), lowest rank first."""
    if comm.world_size == 1:
        return [] if exc is None else [encode_error(exc, 0) or {}]
    blobs = comm.all_gather_bytes(json.dumps(encode_error(exc, comm.rank)).encode())
    return [f for f in (json.loads(b) for b in blobs) if f]
