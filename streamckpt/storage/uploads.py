"""The writer policy over every backend's ``PartSink``: part sizing, several parts in flight
under a bounded buffer, retries per part, and abort on any error — so an object is
either committed whole or leaves nothing behind.

``Upload`` is called from the saving thread (``write``/``commit``/``abort``); the parts
travel on the storage event loop. Memory: at most ``parts_in_flight`` part buffers of
``part_size`` bytes (the one being filled included), reused part after part.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
from typing import Any, Awaitable, Callable, Sequence

from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from .backend import NotFound, PartSink

log = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]  # Reader.call (retried under the policy) or Reader.once


class Upload:
    """A write stream that becomes visible only on ``commit`` (a context manager: an
    exception inside the block aborts)."""

    def __init__(self, sink: PartSink, name: str, where: str, *, loop: asyncio.AbstractEventLoop, call: Call,
                 once: Call, part_size: int, parts_in_flight: int) -> None:
        self.name = name
        self.where = where
        self.bytes_written = 0
        self.part_size = max(sink.min_part, int(part_size))
        self._sink = sink
        self._loop = loop
        # A sink that streams (no numbered parts) is not safe to retry part by part.
        self._call = call if sink.concurrent else once
        self._in_flight_max = max(1, parts_in_flight) if sink.concurrent else 1
        self._buf = bytearray(self.part_size)
        self._fill = 0
        self._free: list[bytearray] = []
        self._sending: collections.deque[tuple[cf.Future[Any], bytearray]] = collections.deque()
        self._tokens: list[Any] = []
        self._started = False
        self._done = False

    # ---------------------------------------------------------------- public

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise StorageError(f"{self.where}: write after commit/abort")
        mv = memoryview(data).cast("B")
        try:
            while len(mv):
                if self._fill == self.part_size:
                    self._send_part()
                n = min(len(mv), self.part_size - self._fill)
                self._buf[self._fill:self._fill + n] = mv[:n]
                self._fill += n
                self.bytes_written += n
                mv = mv[n:]
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        if self._done:
            return
        try:
            if not self._started:
                self._run(self._call(f"writing {self.where}", self._sink.put_whole,
                                     memoryview(self._buf)[:self._fill]))
            else:
                if self._fill:
                    self._send_part()
                self._drain(0)
                self._run(self._call(f"completing the upload of {self.where}", self._sink.complete, self._tokens))
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._release()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for fut, _ in self._sending:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the upload is being dropped anyway
                pass
        self._sending.clear()
        try:
            self._run(self._sink.abort())
        except CheckpointNotFoundError as e:  # no bucket, so no upload to abort: the caller's error says so
            log.debug("nothing to abort for %s: %s", self.where, e)
        except Exception as e:  # noqa: BLE001 - best effort on an already failing path
            log.warning("could not abort the upload of %s: %s", self.where, e)
        self._release()

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    # --------------------------------------------------------------- parts

    def _send_part(self) -> None:
        if not self._started:
            self._run(self._call(f"starting the upload of {self.where}", self._sink.start))
            self._started = True
        number = len(self._tokens) + len(self._sending) + 1
        offset = (number - 1) * self.part_size
        buf, n = self._buf, self._fill
        coro = self._call(f"uploading part {number} of {self.where}", self._sink.put_part, number, offset,
                          memoryview(buf)[:n])
        self._sending.append((asyncio.run_coroutine_threadsafe(coro, self._loop), buf))
        self._drain(self._in_flight_max - 1)
        self._buf = self._free.pop() if self._free else bytearray(self.part_size)
        self._fill = 0

    def _drain(self, keep: int) -> None:
        """Wait for the oldest parts until at most ``keep`` are in flight."""
        while len(self._sending) > keep:
            fut, buf = self._sending.popleft()
            self._tokens.append(self._result(fut))
            self._free.append(buf)

    def _run(self, coro: Any) -> Any:
        return self._result(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _result(self, fut: "cf.Future[Any]") -> Any:
        try:
            return fut.result()
        except CheckpointError:
            raise
        except NotFound as e:
            if e.bucket is not None:  # the caller's URI is wrong, not the store
                raise CheckpointNotFoundError(f"{e.kind} {e.bucket!r} does not exist (writing {self.where}): "
                                              f"check the URI, or create the {e.kind} first") from None
            raise StorageError(f"writing {self.where} failed: {e}") from None
        except Exception as e:  # noqa: BLE001 - a sink failing outside the policy's kinds
            raise StorageError(f"writing {self.where} failed: {type(e).__name__}: {e}") from None

    def _release(self) -> None:
        self._buf = bytearray()
        self._free.clear()


class ObjectQueue:
    """Whole objects uploaded in the background, several at once, from a bounded set of
    reused buffers: one request per object (no multipart round trips or server-side
    concatenation), each retried whole under the policy.

    The saving thread asks for a buffer (``buffer``), fills it and hands it back with
    ``submit``; when all ``buffers`` are busy, ``buffer`` waits for the oldest upload and
    reuses its buffer. Memory: at most ``buffers`` buffers of about ``buffer_bytes``.
    ``finish`` waits for every upload and raises the first failure; after a failure the
    objects already written are deleted (best effort), so a failed save leaves little behind.
    ``on_uploaded(nbytes)`` is called on the saving thread with each object's size once the
    store has it (a save's ``progress``).
    """

    def __init__(self, put: Callable[[str, memoryview], "cf.Future[Any]"], delete: Callable[[str], None], *,
                 buffers: int, buffer_bytes: int, on_uploaded: Callable[[int], None] | None = None) -> None:
        self._put = put
        self._delete = delete
        self._on_uploaded = on_uploaded
        self._sizes: dict[str, int] = {}
        self.buffers = max(1, buffers)
        self.buffer_bytes = max(1, buffer_bytes)
        self._sending: collections.deque[tuple[str, cf.Future[Any], bytearray]] = collections.deque()
        self._free: list[bytearray] = []
        self._made = 0
        self._written: list[str] = []

    def buffer(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` that no upload is reading."""
        if not self._free and self._made >= self.buffers:
            self._wait_oldest()
        buf = self._free.pop() if self._free else None
        if buf is None:
            self._made += 1
        if buf is None or len(buf) < nbytes:
            buf = bytearray(max(nbytes, self.buffer_bytes))  # a fresh one: the old may still be exported
        return buf

    def submit(self, name: str, buf: bytearray, nbytes: int) -> None:
        """Upload ``buf[:nbytes]`` as object ``name``; ``buf`` is the queue's until that ends."""
        self._sizes[name] = nbytes
        self._sending.append((name, self._put(name, memoryview(buf)[:nbytes]), buf))

    def finish(self) -> list[str]:
        """Wait for every upload; the names written (raises the first failure: then ``abort``)."""
        while self._sending:
            self._wait_oldest()
        self._free.clear()
        return list(self._written)

    def abort(self) -> None:
        """Wait for the uploads in flight, then delete what this queue wrote (best effort)."""
        for name, fut, _ in self._sending:
            try:
                fut.result()
                self._written.append(name)
            except BaseException:  # noqa: BLE001 - the save is failing anyway
                pass
        self._sending.clear()
        self._free.clear()
        delete_written(self._delete, self._written, "the save")
        self._written.clear()

    def _wait_oldest(self) -> None:
        name, fut, buf = self._sending.popleft()
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001 - a sink failing outside the policy's kinds is a StorageError
            self._sending.appendleft((name, fut, buf))  # abort() sees it as failed
            if isinstance(e, CheckpointError):
                raise
            raise StorageError(f"writing {name} failed: {type(e).__name__}: {e}") from None
        self._written.append(name)
        self._free.append(buf)
        nbytes = self._sizes.pop(name, 0)
        if self._on_uploaded is not None:
            self._on_uploaded(nbytes)


def delete_written(delete: Callable[[str], None], names: Sequence[str], where: str) -> None:
    """Best effort: delete the objects a failed save wrote. A store that cannot be reached
    fails every delete; one line then says how many are left for garbage collection."""
    failed: list[str] = []
    error: BaseException | None = None
    for name in names:
        try:
            delete(name)
        except Exception as e:  # noqa: BLE001 - best effort on an already failing path
            failed.append(name)
            error = error or e
    if failed:
        log.warning("could not delete %d of the %d objects %s wrote before failing (%s, ...): %s; they are "
                    "left for garbage collection", len(failed), len(names), where, failed[0], error)
