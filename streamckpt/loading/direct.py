"""Reads that land wholly in their targets, fetched as one sliding batch beside the rounds.

Such a read needs no staging, so the double-buffered rounds (which exist to bound
staging) would only hold it back: two rounds in flight drain together before the
next two start. Instead every one of them is started at once, in round order, as
one batch whose in-flight bodies are bounded by the budget the rounds leave unused;
a request starts as soon as an earlier one ends. The executor polls the batch
between rounds (progress, an early failure) and waits for it before the final
agreement, so ``load`` returns only after each of these reads is verified.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
from typing import Callable, Sequence

from ..plan.data import Read
from ..storage import Landing, RangeRead, Storage
from .landing import ReadLanding


class DirectBatch:
    """The batch of reads that land wholly in targets (``landings`` with no staged span)."""

    def __init__(self, reads: Sequence[tuple[int, Read]], landings: dict[int, ReadLanding],
                 progress: Callable[[int], None] | None = None) -> None:
        self.reads = list(reads)
        self.landings = landings
        self.progress = progress
        self.future: cf.Future | None = None
        self._landed: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def nbytes(self) -> int:
        return sum(r.length for _, r in self.reads)

    def start(self, storage: Storage, inflight_bytes: int, spread: int | None = None) -> None:
        if not self.reads:
            return
        reqs = [RangeRead(r.file, r.start, r.stop, r.checks) for _, r in self.reads]
        bufs = [Landing([mem for _, _, mem in self.landings[i].spans if mem is not None]) for i, _ in self.reads]
        self.future = storage.read_into(reqs, bufs, on_landed=self._landed.put, inflight_bytes=inflight_bytes,
                                        spread=spread)

    def poll(self) -> None:
        """Report what has landed; raise the batch's failure if it has failed already."""
        self._report()
        fut = self.future
        if fut is not None and fut.done():
            fut.result()

    def finish(self) -> int:
        """Wait for every read (verified); returns the requests made."""
        if self.future is None:
            return 0
        n = int(self.future.result())
        self._report()
        return n

    def _report(self) -> None:
        while True:
            try:
                j = self._landed.get_nowait()
            except queue.Empty:
                return
            if self.progress is not None:
                self.progress(self.reads[j][1].length)

    def drain(self, storage: Storage) -> None:
        """After a failure: stop the batch and wait until nothing writes into targets any more."""
        fut, self.future = self.future, None
        if fut is not None:
            storage.stop(fut)
