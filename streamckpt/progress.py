"""Byte progress bars for long CLI operations (tqdm on stderr).

The library reports progress through a plain ``Callable[[int], None]`` (bytes
done since the last call); this module turns such calls into a bar with bytes
and rate, or into nothing when the user asked for quiet.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class ByteProgress:
    """A thread-safe ``progress(nbytes)`` callable showing bytes and rate.

    Use as a context manager; ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, desc: str, total: int | None = None, *, enabled: bool = True) -> None:
        self.done = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, dynamic_ncols=True, leave=False, mininterval=0.2,
            )

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)

    def set_total(self, total: int) -> None:
        """Set (or change) the expected total once it is known."""
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
