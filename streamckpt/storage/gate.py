"""Admission for concurrent requests: at most ``count`` in flight and ``nbytes`` of
bodies held, first come first served (one request always may go, whatever its size)."""

from __future__ import annotations

import asyncio
import collections


class Gate:
    """At most ``count`` requests and ``nbytes`` bytes in flight (one request always may go).

    First come, first served: a release wakes only the waiters at the head that now fit
    (a Condition's notify_all re-ran every waiter's test, O(n^2) wake-ups for n reads).
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self._count = count
        self._bytes = nbytes
        self._requests = 0
        self._used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self._requests == 0 or (self._requests < self._count and self._used + n <= self._bytes)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self._requests += 1
            self._used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted, then cancelled before it ran: give the slot back
            raise

    def release(self, n: int) -> None:
        self._requests -= 1
        self._used -= n
        while self._waiters:
            want, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._fits(want):
                break
            self._waiters.popleft()
            self._requests += 1
            self._used += want
            fut.set_result(None)
