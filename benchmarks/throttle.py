"""A total bandwidth cap for the benchmark S3 server: one token bucket for all its connections.

On loopback, storage bandwidth is free, so a loader that reads every byte once looks
no faster than one that reads it four times. In the cloud the ranks of a node share one
NIC and a bucket prefix's throughput; the cap models that: every body byte the server
sends (GET) or receives (PUT), on any connection, takes a token from one shared bucket
that refills at ``rate`` bytes/s.

The bucket lends: a taker reserves its bytes at once (the balance may go negative) and
waits until the refill has paid for them. Reservations are served in the order they were
made, so concurrent connections share the rate fairly and the total never exceeds it by
more than ``burst`` bytes. The accounting (:meth:`TokenBucket.reserve`) takes the time as
an argument so it can be checked without a clock.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable

CHUNK = 1 << 20  # bytes sent or received per token take: small enough to pace, large enough for sendfile
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_rate(text: str) -> float | None:
    """``"200MB/s"`` -> 2e8 bytes/s (``MiB/s`` are powers of 2); ``"off"``, ``"0"``, ``""`` -> None (no cap)."""
    t = text.strip().lower().replace(" ", "")
    if t in ("", "off", "none", "0"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmg]i?)?b?(/s)?", t)
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected e.g. 200MB/s, 1.5GB/s, 100MiB/s or off")
    rate = float(m.group(1)) * _UNITS[m.group(2) or ""]
    return rate or None


def format_rate(rate: float | None) -> str:
    return "off" if rate is None else f"{rate / 1e6:g} MB/s"


class TokenBucket:
    """``rate`` bytes/s shared by every thread that calls :meth:`take`; ``burst`` bytes may go at once."""

    def __init__(self, rate: float, burst: int = CHUNK, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)  # starts full
        self._last: float | None = None

    def reserve(self, n: int, now: float) -> float:
        """Take ``n`` tokens at time ``now``; returns how long the taker must wait before sending them."""
        with self._lock:
            if self._last is None or now > self._last:  # a thread that read the clock earlier adds nothing
                if self._last is not None:
                    self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may go."""
        wait = self.reserve(n, self._clock())
        if wait > 0:
            self._sleep(wait)
