"""Byte progress of long operations, on stderr (or a stream the caller names).

The library reports progress through a plain ``Callable[[int], None]``: it is called
with the bytes done *since the previous call* (always positive, so the running sum only
grows), and ``add_total(nbytes)`` is called too when the callable has such a method
(the bytes the operation expects to report, once known). This module turns such calls
into a tqdm bar when the stream is a terminal, into one plain line every few seconds
(and a final one) when it is not (a log file, CI, a pipe: no ``\\r``), or into nothing
when the user asked for quiet. ``progress=True`` on a public call (``ByteProgress``
through ``reporting``/``reporter``) and the CLI both draw it.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TextIO, Union

from .results import human_bytes

LINE_INTERVAL = 5.0  # seconds between two plain lines

Progress = Union[Callable[[int], None], bool, None]
"""What the public calls take as ``progress=``: a callable, True (draw it) or None/False (nothing)."""


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a TTY (False for anything without a working ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _TqdmView:
    """The interactive bar: redrawn in place, cleared when done."""

    def __init__(self, desc: str, total: int | None, stream: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        file=stream, dynamic_ncols=True, leave=False, mininterval=0.2)

    def update(self, nbytes: int, done: int, total: int | None) -> None:
        self.bar.update(nbytes)

    def set_total(self, total: int) -> None:
        self.bar.total = total
        self.bar.refresh()

    def close(self, done: int, total: int | None, failed: bool) -> None:
        self.bar.close()


class _LineView:
    """Plain lines for a stream that is not a terminal: one at most every ``interval``
    seconds while bytes arrive, and a final one (so a log shows how far it got)."""

    def __init__(self, desc: str, stream: TextIO, interval: float, clock: Callable[[], float]) -> None:
        self.desc = desc
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.start = self.last = clock()

    def update(self, nbytes: int, done: int, total: int | None) -> None:
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._write(f"{self.desc}: {self._amount(done, total)}, {self._rate(done, now)}")

    def set_total(self, total: int) -> None:
        pass

    def close(self, done: int, total: int | None, failed: bool) -> None:
        if failed and not done:  # failed before a byte moved (no checkpoint there ...): the error says it all
            return
        now = self.clock()
        verb = "stopped at " if failed else ""
        self._write(f"{self.desc}: {verb}{self._amount(done, total)} in {now - self.start:.2f} s, "
                    f"{self._rate(done, now)}")

    @staticmethod
    def _amount(done: int, total: int | None) -> str:
        if total is None:
            return human_bytes(done)
        pct = 100.0 * done / total if total else 100.0
        return f"{human_bytes(done)} of {human_bytes(total)} ({pct:.0f}%)"

    def _rate(self, done: int, now: float) -> str:
        seconds = now - self.start
        return f"{done / seconds / 1e6 if seconds > 0 else 0.0:.1f} MB/s"

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class ByteProgress:
    """A thread-safe ``progress(nbytes)`` callable showing bytes done of the total, and rate.

    Use as a context manager; ``enabled=False`` makes every call a no-op. On a
    terminal (``tty=None``: ask ``stream``) it draws a tqdm bar; elsewhere it writes
    plain lines every ``interval`` seconds and one when it closes.
    """

    def __init__(self, desc: str, total: int | None = None, *, enabled: bool = True,
                 stream: TextIO | None = None, tty: bool | None = None, interval: float = LINE_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.done = 0
        self.total = total
        self._lock = threading.Lock()
        self._view: _TqdmView | _LineView | None = None
        if enabled:
            out = stream if stream is not None else sys.stderr
            terminal = is_terminal(out) if tty is None else tty
            self._view = _TqdmView(desc, total, out) if terminal else _LineView(desc, out, interval, clock)

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._view is not None:
                self._view.update(nbytes, self.done, self.total)

    def set_total(self, total: int) -> None:
        """Set (or change) the expected total once it is known."""
        with self._lock:
            self._retotal(total)

    def add_total(self, nbytes: int) -> None:
        """Expect ``nbytes`` more (a load calls this with the bytes its plan will read;
        once per attempt, so a retried plan adds its own)."""
        with self._lock:
            self._retotal((self.total or 0) + nbytes)

    def _retotal(self, total: int) -> None:
        self.total = total
        if self._view is not None:
            self._view.set_total(total)

    def close(self, failed: bool = False) -> None:
        """Clear the bar, or write the final line; later calls do nothing."""
        with self._lock:
            view, self._view = self._view, None
        if view is not None:
            view.close(self.done, self.total, failed)

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(failed=exc_type is not None)


def reporter(progress: Progress, desc: str, *, rank: int = 0, world_size: int = 1,
             ) -> tuple[Callable[[int], None] | None, ByteProgress | None]:
    """``progress=`` of a public call as ``(callback to pass down, display to close)``.

    A callable is passed down as it is (every rank calls its own); True makes a
    ``ByteProgress`` on stderr, on rank 0 only in a group of several ranks (its bytes are
    rank 0's share: the description says so), which the caller must ``close``; None or
    False: nothing. Anything else is a ``CheckpointError``."""
    if progress is None or progress is False:
        return None, None
    if progress is True:
        if rank != 0:
            return None, None
        bar = ByteProgress(desc if world_size == 1 else f"{desc} (rank 0 of {world_size})")
        return bar, bar
    if callable(progress):
        return progress, None
    from .errors import CheckpointError

    raise CheckpointError(f"progress must be a callable taking a byte count, True or None, got {progress!r}")


@contextmanager
def reporting(progress: Progress, desc: str, *, rank: int = 0, world_size: int = 1,
              ) -> Iterator[Callable[[int], None] | None]:
    """``reporter`` as a context manager: the display it made (if any) is closed on exit
    (its final line says how far it got when the block raised)."""
    callback, bar = reporter(progress, desc, rank=rank, world_size=world_size)
    if bar is None:
        yield callback
        return
    with bar:
        yield callback
