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
from typing import Any, Awaitable, Callable

from ..errors import CheckpointError, StorageError
from .backend import PartSink

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
        except Exception as e:  # noqa: BLE001 - a sink failing outside the policy's kinds
            raise StorageError(f"writing {self.where} failed: {type(e).__name__}: {e}") from None

    def _release(self) -> None:
        self._buf = bytearray()
        self._free.clear()

