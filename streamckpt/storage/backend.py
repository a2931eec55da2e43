"""The one small interface every storage client sits behind.

A backend makes exactly one attempt per call and reports a failure as one of a few
kinds (``NotFound``, ``Transient``, ``Stalled``, ``RangeNotSatisfiable``, ``Permanent``);
everything else — retries, deadlines, piece splitting, length and checksum checks, the
corruption verdict, messages — is the policy above it (``policy``, ``reads``,
``uploads``), written once. Adding a client means writing one module of client calls.

Paths are full backend paths (``bucket/key`` on object stores, a filesystem path for
local files). Every call is a coroutine run on the storage event loop; a client with
blocking calls runs them in worker threads (``WorkerThreads``).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


# ------------------------------------------------------------------ failure kinds


class BackendError(Exception):
    """One attempt failed; the subclass says what the policy should do about it."""


class NotFound(BackendError):
    """The object (or, with ``bucket`` set, its whole bucket/container) does not exist;
    ``kind`` is what the store calls a bucket (Azure: ``container``), for messages."""

    def __init__(self, message: str, *, bucket: str | None = None, kind: str = "bucket") -> None:
        super().__init__(message)
        self.bucket = bucket
        self.kind = kind


class Transient(BackendError):
    """Worth another attempt: 5xx, throttling, resets, short bodies."""


class Stalled(Transient):
    """No response head or body bytes within the request timeout."""


class RangeNotSatisfiable(BackendError):
    """The server refused the range: the object may be shorter than the reader thinks."""


_THROTTLE_TEXT = re.compile(r"SlowDown|Slow Down|reduce your request rate|Throttl|ServerBusy|HTTP 503\b|HTTP 429\b"
                            r"|\b503 Service Unavailable|TooManyRequests", re.I)


def throttling(exc: BaseException) -> bool:
    """Whether a failed attempt was the store refusing the request rate (S3's 503 SlowDown,
    429, Azure's ServerBusy): what ``Backend.throttled`` counts."""
    return isinstance(exc, Transient) and bool(_THROTTLE_TEXT.search(str(exc)))


class ThrottleCount:
    """Throttled responses a client saw (each then retried, or the last of a failed call):
    how a load learns that its request rate passed the store's limit. Thread-safe: the
    blocking clients answer in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.count += n


class Permanent(BackendError):
    """Retrying cannot help: credentials, permissions, bad configuration."""


class TooLarge(BackendError):
    """A whole-object read refused (before its body was read) because of its size."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


# ------------------------------------------------------------------ plain data


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one ranged fetch landed, and what it learned about the object."""

    got: int  # body bytes written into the buffer
    size: int | None = None  # the object's total size, when the response said it
    etag: str | None = None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    etag: str | None = None
    modified: float | None = None  # POSIX seconds


# ------------------------------------------------------------------ interfaces


class PartSink(abc.ABC):
    """One object being written, in numbered parts; nothing is visible before ``complete``.

    All parts but the last are the same size, at least ``min_part`` bytes. When
    ``concurrent`` is true, parts may be sent at the same time and in any order.
    """

    min_part: int = 1
    concurrent: bool = True

    @abc.abstractmethod
    async def put_whole(self, data: memoryview) -> None:
        """Write the object in one request (it fits in one part); ``data`` is the caller's
        again once this returns (a sink keeps no reference to it)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin a multi-part write."""

    @abc.abstractmethod
    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        """Send part ``number`` (1-based) holding the object's bytes at ``offset``; returns its token."""

    @abc.abstractmethod
    async def complete(self, tokens: list[Any]) -> None:
        """Make the object visible from its parts' tokens, in part order."""

    @abc.abstractmethod
    async def abort(self) -> None:
        """Drop everything sent so far (best effort; must not raise for a part never sent)."""


class Backend(abc.ABC):
    """A storage client, one attempt per call."""

    name: str = "backend"
    holds_bodies: bool = False  # the client holds a response body before copying it into the buffer
    piece_size: int | None = None  # reads larger than this become concurrent requests (None: never)
    # True where the client counts every throttled response itself, its own retries included
    # (``httpget``); else the policy counts the throttled failures it sees (``reads``), and
    # those the client retried inside one call stay unseen.
    counts_throttling: bool = False

    @property
    def throttled(self) -> ThrottleCount:
        """Throttled responses seen through this client (see ``counts_throttling``)."""
        count = self.__dict__.get("_throttled")
        if count is None:
            count = self.__dict__.setdefault("_throttled", ThrottleCount())
        return count

    @abc.abstractmethod
    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        """Fetch ``len(buf)`` bytes at ``start`` into ``buf``; ``want_meta`` asks for the object's size/ETag."""

    async def fetch_parts(self, path: str, start: int, bufs: Sequence[memoryview], *,
                          want_meta: bool = False) -> Fetched:
        """``fetch`` of ``sum(len(b) for b in bufs)`` bytes at ``start``, split over ``bufs`` in
        order (a piece that lands partly in a target and partly in staging). This fallback
        fetches into one temporary buffer and copies out; a client that can split its
        body without that copy overrides it."""
        tmp = memoryview(bytearray(sum(len(b) for b in bufs)))
        got = await self.fetch(path, start, tmp, want_meta=want_meta)
        scatter_into(bufs, tmp[:got.got])
        return got

    @abc.abstractmethod
    async def head(self, path: str) -> ObjectInfo:
        """The object's size, ETag and modification time; ``NotFound`` if absent."""

    @abc.abstractmethod
    async def listing(self, path: str, recursive: bool) -> list[str]:
        """Full paths under the prefix ``path`` (one level adds sub-prefixes); ``NotFound(bucket=...)``
        only when the bucket itself is missing."""

    async def listing_info(self, path: str) -> list[tuple[str, ObjectInfo]]:
        """Every object under the prefix ``path`` (recursive) with its size and modification
        time. This fallback lists, then asks each object (a client whose listing carries both
        overrides it: one request per page)."""
        names = await self.listing(path, True)

        async def one(name: str) -> tuple[str, ObjectInfo] | None:
            try:
                return name, await self.head(name)
            except NotFound:  # removed since the listing
                return None

        found = await asyncio.gather(*(one(n) for n in names))
        return [f for f in found if f is not None]

    @abc.abstractmethod
    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """A whole small object and its ETag; ``TooLarge`` before reading a body over ``max_bytes``."""

    @abc.abstractmethod
    async def delete(self, path: str, recursive: bool) -> None:
        """Remove an object (or everything under a prefix); absent is fine."""

    async def remove_empty_dirs(self, path: str) -> None:
        """Remove the empty directories under ``path`` and ``path`` itself if it is left
        empty. Object stores have no directories (a prefix is gone with its last object):
        nothing to do here; a file system overrides it."""
        return None

    async def delete_many(self, paths: Sequence[str]) -> None:
        """Remove several objects (absent is fine): one request per object here; a client
        with a bulk delete overrides it (S3: up to 1000 keys a request)."""
        await asyncio.gather(*(self.delete(p, False) for p in paths))

    @abc.abstractmethod
    def sink(self, path: str) -> PartSink:
        """A writer for one object."""

    async def exists(self, path: str) -> bool:
        """An object, or a prefix with objects under it."""
        try:
            await self.head(path)
            return True
        except NotFound as e:
            if e.bucket is not None:
                raise
        return bool(await self.listing(path, False))

    async def makedirs(self, path: str) -> None:
        """Object stores have no directories."""

    def close(self) -> None:
        """Release clients and threads."""


def scatter_into(bufs: Sequence[memoryview], data: Any, at: int = 0) -> int:
    """Copy ``data`` (a byte buffer) into consecutive ``bufs`` from byte ``at`` of their
    concatenation; returns the bytes copied."""
    src = memoryview(data).cast("B")
    pos = 0
    for b in bufs:
        if at >= len(b):
            at -= len(b)
            continue
        n = min(len(b) - at, len(src) - pos)
        if n <= 0:
            break
        b[at:at + n] = src[pos:pos + n]
        pos += n
        at = 0
    return pos


class WorkerThreads:
    """Blocking client calls run in a private thread pool, awaited from the event loop.

    A cancelled caller still waits for its call to end: the call may be writing into
    a buffer that the caller is about to give back.
    """

    def __init__(self, max_workers: int, prefix: str) -> None:
        self._max = max(1, max_workers)
        self._prefix = prefix
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self._max, thread_name_prefix=self._prefix)
            pool = self._pool
        fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        try:
            await asyncio.wait([fut])  # unlike shield, leaves no second future to hold an error
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    continue
            if not fut.cancelled():
                fut.exception()  # the caller is gone: its error is not "never retrieved"
            raise
        return fut.result()

    def close(self) -> None:
        """Wait for the workers to finish their calls."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
