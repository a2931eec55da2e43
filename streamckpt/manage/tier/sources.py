"""Where one rank reads each file of a restore from the tier: its own folder or the bucket.

The executor reads through one storage object; a restore from the tier names two kinds of
file in one manifest: the step's local files (read from this rank's step folder, and only by
ranks that hold them: the plan's holder constraint) and the bucket's files, for bytes no
surviving rank holds (named ``BUCKET + name``). ``Sources`` looks like a ``Storage`` to the
executor and sends each read to the storage its name says, counting the bytes of each.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
from typing import Any, Callable, Sequence

from ...storage import RangeRead, Storage

BUCKET = "bucket:"  # a file name's prefix: read from the bucket's checkpoint of the step


class Sources:
    """A ``Storage`` for the executor: local files from ``local``, ``BUCKET`` names from ``bucket``."""

    def __init__(self, local: Storage, bucket: Storage) -> None:
        self.local = local
        self.bucket = bucket
        self.bytes_local = 0  # bytes this rank requested from its own folder
        self.bytes_bucket = 0  # ... and from the bucket
        self._lock = threading.Lock()

    def _route(self, name: str) -> tuple[Storage, str]:
        if name.startswith(BUCKET):
            return self.bucket, name[len(BUCKET):]
        return self.local, name

    # what the loader and the executor ask of a Storage
    @property
    def uri(self) -> str:
        return self.bucket.uri

    @property
    def max_concurrency(self) -> int:
        return self.bucket.max_concurrency

    @property
    def inflight_bytes(self) -> int:
        return self.bucket.inflight_bytes

    @property
    def throttled_responses(self) -> int:
        return self.bucket.throttled_responses

    def describe(self, name: str) -> str:
        storage, rest = self._route(name)
        return storage.describe(rest)

    def path(self, name: str) -> str:
        storage, rest = self._route(name)
        return storage.path(rest)

    def read_into(self, reads: Sequence[RangeRead], buffers: Sequence[Any], *,
                  on_landed: Callable[[int], None] | None = None, inflight_bytes: int | None = None,
                  spread: int | None = None) -> cf.Future:
        """``Storage.read_into`` over both sources: one batch each, one future for both."""
        parts: dict[int, tuple[Storage, list[int], list[RangeRead]]] = {}
        for i, r in enumerate(reads):
            storage, rest = self._route(r.name)
            _, idx, mine = parts.setdefault(id(storage), (storage, [], []))
            idx.append(i)
            mine.append(dataclasses.replace(r, name=rest))
        with self._lock:
            for storage, _, mine in parts.values():
                n = sum(r.length for r in mine)
                if storage is self.bucket:
                    self.bytes_bucket += n
                else:
                    self.bytes_local += n
        subs = []
        for storage, idx, mine in parts.values():
            landed = None if on_landed is None else (lambda i, idx=idx: on_landed(idx[i]))
            subs.append((storage, storage.read_into(mine, [buffers[i] for i in idx], on_landed=landed,
                                                    inflight_bytes=inflight_bytes, spread=spread)))
        return _joined(subs)

    def stop(self, fut: cf.Future, timeout: float = 60.0) -> None:
        for storage, sub in getattr(fut, "streamckpt_parts", ()):
            storage.stop(sub, timeout)
        fut.cancel()


def _joined(subs: list[tuple[Storage, cf.Future]]) -> cf.Future:
    """One future for several batches: their requests added up, or the first error."""
    out: cf.Future = cf.Future()
    out.streamckpt_parts = subs  # type: ignore[attr-defined] - what ``stop`` stops
    if not subs:
        out.set_result(0)
        return out
    left = [len(subs)]
    lock = threading.Lock()

    def done(_: cf.Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] or out.done():
                return
        try:
            total = sum(f.result() for _, f in subs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            _settle(out, exception=e)
        else:
            _settle(out, result=total)

    for _, f in subs:
        f.add_done_callback(done)
    return out


def _settle(fut: cf.Future, *, result: int = 0, exception: BaseException | None = None) -> None:
    """Resolve ``fut`` unless ``Sources.stop`` cancelled it first."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


__all__ = ["BUCKET", "Sources"]
