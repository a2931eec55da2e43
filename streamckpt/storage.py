"""Bytes in and out of any fsspec URL: bounded-concurrency range reads with
retries, exact-length and checksum checks; streaming uploads.

This layer knows files and byte ranges, never tensors. Reads land in
caller-provided buffers (the staging buffers of the pipeline); asynchronous
filesystems (s3fs, gcsfs, http) run on fsspec's event loop thread, so a batch of
reads proceeds while the caller's thread does other work. Local files are read
with ``readinto`` from a small thread pool, straight into the buffer.

Fault policy (see docs/RELIABILITY.md). Two layers, one bound:

* the S3 client (botocore, "standard" retry mode) retries what it can see at the
  HTTP status level — 5xx, SlowDown/throttling, refused connections — a few
  times with its own jittered backoff; s3fs's own retry loop is switched off so
  the attempts do not multiply;
* this module retries what the client cannot see — short or reset bodies, bytes
  corrupted in transit (checksum), stalls — and anything the client gave up on,
  with full-jitter exponential backoff, ``max_attempts`` per read and a
  ``total_timeout`` after which no new attempt starts. A stall is detected per
  request (``request_timeout`` to the response head and between body chunks).

So a persistent outage ends in ``StorageError`` naming the object and byte range
after at most about ``total_timeout + request_timeout`` seconds.

Reads of ``s3://`` (ranges, whole objects, HEAD, LIST) can go through obstore
(Rust) instead of s3fs (``STREAMCKPT_S3_BACKEND``, see ``obstore_reader``); s3fs is
then created only if the Storage writes. The same policy applies, the
client's own attempts are ``client_attempts``, reads larger than ``piece_size``
become concurrent GETs, and at most ``max_concurrency`` GETs and ``inflight_bytes``
of bodies are in flight (each body is held once in Rust, then copied into its
buffer: that copy is the resident-memory cost of the faster client).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures as cf
import hashlib
import http.client
import logging
import os
import posixpath
import random
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs

from . import obstore_reader
from .checksum import crc32c
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .obstore_reader import ObstoreReader

log = logging.getLogger(__name__)

_S3_PROTOCOLS = ("s3", "s3a")
_MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)
# obstore path. A body is collected in Rust, then copied into its buffer, so GETs in flight
# cost resident memory besides the staging buffers. Measured on the benchmark's 256 MiB
# full load (2 cores, local server): 4 MiB pieces, 4 in flight: fastest and +16 MiB;
# 8 MiB pieces, 8 in flight: slower (more page faults) and +64 MiB.
_PIECE = 4 << 20  # larger reads are split into concurrent GETs of this size
_INFLIGHT = 16 << 20  # bodies in flight when the caller sets no memory budget
_INFLIGHT_MAX = 64 << 20  # ... and at most this much of a budget (16 concurrent pieces, for high-latency stores)
_CRC_OFFLOAD = 1 << 20  # a read with at least this many checked bytes is verified in a worker thread
_SECRET_OPTION = re.compile(r"(secret|token|password|passwd|key|credential|sas|signature)", re.I)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard to try before a read or write is declared failed.

    Attempts back off exponentially with full jitter; every request has a stall
    timeout and the whole operation a deadline, so an outage fails in bounded time.
    """

    max_attempts: int = 8  # requests per read/call made by this layer
    client_attempts: int = 3  # the S3 client's own attempts per request (status-level errors)
    base_delay: float = 0.1  # seconds; backoff before attempt k is uniform(0, base * 2**k)
    max_delay: float = 4.0
    request_timeout: float = 15.0  # to the response head, and between body chunks
    total_timeout: float = 45.0  # no new attempt starts after this many seconds
    checksum_retries: int = 2  # re-fetches after a checksum mismatch before it is called corruption

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.client_attempts < 1 or self.checksum_retries < 0:
            raise ValueError(f"RetryPolicy needs at least one attempt: {self}")
        if min(self.base_delay, self.max_delay) < 0 or min(self.request_timeout, self.total_timeout) <= 0:
            raise ValueError(f"RetryPolicy delays must be >= 0 and timeouts > 0: {self}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full-jitter backoff before retry number ``attempt`` (1-based)."""
        return rng.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Fetch ``[start, stop)`` of file ``name`` and verify ``checks``.

    Each check is ``(offset, length, crc32c)`` relative to ``start``.
    """

    name: str
    start: int
    stop: int
    checks: tuple[tuple[int, int, int], ...] = ()

    @property
    def length(self) -> int:
        return self.stop - self.start


# ----------------------------------------------------------------- failures


class _Retryable(Exception):
    """An attempt failed in a way worth trying again (short body, bad length)."""


class _ChecksumMismatch(Exception):
    """Bytes arrived but do not match their checksum; the text is the range."""


class _Truncated(Exception):
    """The object is shorter than the requested range; the value is its size."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


_TRANSIENT_WORDS = (
    "slowdown", "slow down", "reduce your request rate", "serviceunavailable", "service unavailable",
    "internalerror", "internal error", "throttl", "requesttimeout", "timeout", "timed out", "reset",
    "payload", "disconnect", "broken pipe", "incomplete", "connection", "temporarily", "try again",
)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind an s3fs/botocore error, if it carries one."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 5:
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError)


def _range_not_satisfiable(exc: BaseException) -> bool:
    return _http_status(exc) == 416 or "range is not satisfiable" in str(exc).lower() or "invalidrange" in str(
        exc
    ).lower()


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the HTTP stacks that mean transport trouble (retryable)."""
    found: list[type[BaseException]] = [http.client.HTTPException]
    try:
        from botocore.exceptions import HTTPClientError, ResponseStreamingError

        found += [HTTPClientError, ResponseStreamingError]
    except ImportError:  # pragma: no cover - s3fs not installed
        pass
    try:
        import aiohttp

        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


_TRANSPORT_ERRORS = _transport_errors()
_FATAL_WORDS = ("credential", "accessdenied", "access denied", "forbidden", "paramvalidation", "invalidaccesskey",
                "signaturedoesnotmatch", "nosuchbucket")


def _transient(exc: BaseException) -> bool:
    """Errors worth retrying: network trouble, throttling, 5xx, timeouts, bad bodies."""
    if isinstance(exc, (_Retryable, obstore_reader.Transient, obstore_reader.RangeProblem, asyncio.TimeoutError,
                        TimeoutError, ConnectionError, *_TRANSPORT_ERRORS)):
        return True
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    text = f"{type(exc).__name__} {exc}".lower()
    if any(word in text for word in _FATAL_WORDS):
        return False
    if any(word in text for word in _TRANSIENT_WORDS):
        return True
    # An OSError without an errno comes from a transport layer, not from the object.
    return isinstance(exc, OSError) and exc.errno is None


def _content_range_total(value: Any) -> int | None:
    """The total object size from a ``Content-Range: bytes a-b/total`` header."""
    if isinstance(value, str) and "/" in value:
        total = value.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    return None


def _public(uri: str) -> str:
    """A URI without query string or user:password@ part."""
    uri = uri.split("?", 1)[0]
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", uri)


def _secrets_of(options: dict[str, Any]) -> tuple[str, ...]:
    """String values of options that look like credentials (to scrub from messages)."""
    found: list[str] = []

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(str(k)):
                found.append(v)

    walk(options)
    return tuple(sorted(set(found), key=len, reverse=True))


# ------------------------------------------------------------------ storage



async def _all_or_cancel(tasks: list["asyncio.Future[Any]"]) -> None:
    """Await every task; on the first failure cancel the rest and wait for them to end
    (a read may be writing into a staging buffer) before raising."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Storage:
    """One checkpoint prefix on one filesystem; names are relative to the prefix."""

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        policy: RetryPolicy | None = None,
        max_concurrency: int = 32,
    ) -> None:
        self.uri = str(uri)
        self.policy = policy or RetryPolicy()
        self.max_concurrency = max(1, int(max_concurrency))
        opts = dict(storage_options or {})
        self._secrets = _secrets_of(opts)
        protocol = fsspec.core.split_protocol(self.uri)[0] or "file"
        self._is_s3 = protocol in _S3_PROTOCOLS
        self._obstore: ObstoreReader | None = None
        self.piece_size = _PIECE  # obstore path: reads larger than this become concurrent GETs
        self.inflight_bytes = _INFLIGHT  # obstore path: bytes of GETs in flight (each body is held once in Rust)
        self._fs: Any = None
        if self._is_s3:
            self._obstore = self._pick_obstore(opts)
            opts = self._s3_options(opts)
        self._fs_options = opts
        if self._obstore is not None:
            # Every read goes through obstore: s3fs (and its botocore client, ~0.1 s to import
            # and ~0.1 s to create) only comes up if this Storage writes or deletes.
            self.root = _s3_root(self.uri)
            self.is_async = True
            self._local = False
        else:
            self.root = self._open_fs()
            self.is_async = bool(getattr(self._fs, "async_impl", False))
            self._local = _is_local(self._fs)
        self._rng = random.Random()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _open_fs(self) -> str:
        """Create the fsspec filesystem; returns the root path it gives the URI."""
        try:
            self._fs, root = url_to_fs(self.uri, **self._fs_options)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open {self._public_uri()}: {self._scrub(str(e))}") from None
        if self._is_s3:
            self._fs.retries = 1  # s3fs's own loop would multiply the client's attempts
        return str(root).rstrip("/")

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (s3fs, local, ...), created on first use."""
        if self._fs is None:
            self._open_fs()
        return self._fs

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """fsspec's I/O event loop thread, where every asynchronous read runs."""
        return self._fs.loop if self._fs is not None else fsspec.asyn.get_loop()

    def _split(self, name: str) -> tuple[str, str]:
        """(bucket, key) of a name under an ``s3://`` root."""
        bucket, _, key = self.path(name).partition("/")
        return bucket, key

    def _ob(self) -> ObstoreReader:
        if self._obstore is None:
            raise RuntimeError("obstore reader used on a Storage without one")
        return self._obstore

    def reserve_inflight(self, memory_budget: int) -> int:
        """Take a share of a load's ``memory_budget`` for response bodies that the client
        holds before copying them into their buffers; returns what is left for staging.

        Only the obstore path holds bodies (s3fs, local and other fsspec reads land in the
        buffers directly): a quarter of the budget, between one piece and ``_INFLIGHT_MAX``.
        """
        if self._obstore is None:
            return memory_budget
        self.inflight_bytes = min(_INFLIGHT_MAX, max(self.piece_size, memory_budget // 4))
        return max(memory_budget - self.inflight_bytes, memory_budget // 2)

    @property
    def read_backend(self) -> str:
        """Which client does the bulk range reads: ``obstore``, ``s3fs`` or ``fsspec``."""
        if self._obstore is not None:
            return "obstore"
        return "s3fs" if self._is_s3 else "fsspec"

    def _pick_obstore(self, opts: dict[str, Any]) -> ObstoreReader | None:
        """The obstore reader for these options, or None to read through s3fs (see obstore_reader)."""
        try:
            wanted = obstore_reader.requested_backend()
        except ValueError as e:
            raise StorageError(str(e)) from None
        if wanted == "s3fs" or (wanted == "auto" and not obstore_reader.AUTO_PICKS_OBSTORE):
            return None
        if "?" in self.uri or "::" in self.uri:
            log.debug("range reads of %s go through s3fs (query string or chained URL)", self._public_uri())
            return None
        if not obstore_reader.available():
            if wanted == "obstore":
                raise StorageError(
                    f"{obstore_reader.BACKEND_ENV}=obstore but obstore is not installed (pip install obstore)"
                )
            return None
        try:
            config = obstore_reader.s3_config(opts)
        except obstore_reader.NotConfigurable as e:
            (log.warning if wanted == "obstore" else log.debug)(
                "range reads of %s go through s3fs: obstore cannot reproduce %s", self._public_uri(), e
            )
            return None
        return ObstoreReader(config, self.policy.request_timeout, self.policy.client_attempts, self.max_concurrency)

    def _s3_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """A private s3fs instance whose client retries a little and times out on stalls."""
        opts.setdefault("skip_instance_cache", True)
        ck = dict(opts.get("config_kwargs") or {})
        ck.setdefault("retries", {"total_max_attempts": self.policy.client_attempts, "mode": "standard"})
        ck.setdefault("connect_timeout", self.policy.request_timeout)
        ck.setdefault("read_timeout", self.policy.request_timeout)
        ck.setdefault("max_pool_connections", max(10, self.max_concurrency))
        opts["config_kwargs"] = ck
        return opts

    def __repr__(self) -> str:
        return f"Storage({self._public_uri()!r})"

    # ------------------------------------------------------------------ naming

    def _public_uri(self) -> str:
        return _public(self.uri)

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def describe(self, name: str) -> str:
        """A user-facing address for an object (no credentials)."""
        return f"{self._public_uri().rstrip('/')}/{name}"

    def _err(self, exc: BaseException) -> str:
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not str(exc):
            return f"no response for {self.policy.request_timeout:g} s (stalled)"
        return self._scrub(f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ small calls

    def _retry_sync(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a metadata/write call with this layer's retries; not-found passes through."""
        policy = self.policy
        deadline = time.monotonic() + policy.total_timeout
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_not_found(e):
                    raise
                attempt += 1
                if not _transient(e) or attempt >= policy.max_attempts or time.monotonic() >= deadline:
                    raise StorageError(f"{what} failed after {attempt} attempt(s): {self._err(e)}") from None
                log.debug("retrying %s: %s", what, self._err(e))
                time.sleep(min(policy.delay(attempt, self._rng), max(0.0, deadline - time.monotonic())))

    def modified(self, name: str) -> float | None:
        """Last-modified time (POSIX seconds) of an object, or None if it does not exist."""
        if self._obstore is not None:
            info = {"LastModified": self._head(name, f"checking {self.describe(name)}").get("last_modified")}
            return None if info["LastModified"] is None else _mtime(info)
        try:
            info = self._retry_sync(f"checking {self.describe(name)}", lambda: self.fs.info(self.path(name)))
        except FileNotFoundError:
            return None
        return _mtime(info)

    def _head(self, name: str, what: str) -> dict[str, Any]:
        """obstore HEAD of an object with retries; an empty dict when it does not exist."""
        try:
            return dict(self._retry_sync(what, lambda: self._ob().head(*self._split(name))))
        except FileNotFoundError:
            return {}

    def exists(self, name: str) -> bool:
        """Whether an object (or, as in s3fs, a prefix with objects under it) exists."""
        what = f"checking {self.describe(name)}"
        if self._obstore is not None:
            if self._head(name, what):
                return True
            bucket, key = self._split(name)
            return bool(self._retry_sync(what, lambda: self._ob().listing(bucket, key)))
        return bool(self._retry_sync(what, lambda: self.fs.exists(self.path(name))))

    def size(self, name: str) -> int:
        try:
            return int(self._retry_sync(f"sizing {self.describe(name)}", lambda: self._size(name)))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(name)} does not exist") from None

    def _size(self, name: str) -> int:
        if self._obstore is not None:
            return int(self._ob().head(*self._split(name))["size"])
        self.fs.invalidate_cache(self.path(name))
        return int(self.fs.size(self.path(name)))

    def list(self, prefix: str = "", *, recursive: bool = False) -> list[str]:
        """Names (relative to the root) of objects under ``prefix``."""
        base = self.path(prefix).rstrip("/")
        what = f"listing {self.describe(prefix)}"
        try:
            if self._obstore is not None:
                bucket, key = self._split(prefix.rstrip("/"))
                keys = self._retry_sync(what, lambda: self._ob().listing(bucket, key, recursive))
                found = [f"{bucket}/{k}" for k in keys]
            elif recursive:
                self.fs.invalidate_cache(base)
                found = self._retry_sync(what, lambda: self.fs.find(base))
            else:
                self.fs.invalidate_cache(base)
                found = self._retry_sync(what, lambda: self.fs.ls(base, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []
        root = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = p.rstrip("/")
            if p.startswith(root):
                out.append(p[len(root):])
            elif p != self.root:
                out.append(posixpath.relpath(p, self.root))
        return sorted(n for n in out if n and n != ".")

    def read_bytes(
        self, name: str, start: int | None = None, stop: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        """Read a whole (small) object or one range of it, length-checked.

        A whole-object read refuses objects larger than ``max_bytes`` before
        fetching them, and on S3 checks the body against the ETag when it is an MD5.
        """
        if start is None:
            return self._read_whole(name, max_bytes)
        stop = start if stop is None else stop
        buf = bytearray(stop - start)
        self.read_into([RangeRead(name, start, stop)], [memoryview(buf)]).result()
        return bytes(buf)

    def _read_whole(self, name: str, max_bytes: int | None) -> bytes:
        where = self.describe(name)
        try:
            if self._is_s3:
                return fsspec.asyn.sync(self._loop, self._read_whole_s3, name, max_bytes)
            if max_bytes is not None:
                n = self.size(name)
                if n > max_bytes:
                    raise CorruptCheckpointError(f"{where} is {n} bytes, more than the {max_bytes}-byte limit")
            return bytes(self._retry_sync(f"reading {where}", lambda: self.fs.cat_file(self.path(name))))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where} does not exist") from None

    async def _read_whole_s3(self, name: str, max_bytes: int | None) -> bytes:
        policy = self.policy
        where = self.describe(name)
        bucket, key = self._split(name)
        get = self._get_whole_obstore if self._obstore is not None else self._get_whole_s3
        deadline = time.monotonic() + policy.total_timeout
        attempt = 0
        bad_sums = 0
        while True:
            try:
                return await get(bucket, key, where, max_bytes)
            except (CheckpointNotFoundError, CorruptCheckpointError):
                raise
            except _ChecksumMismatch:
                bad_sums += 1
                if bad_sums > policy.checksum_retries:
                    raise CorruptCheckpointError(
                        f"{where} does not match its ETag (MD5) on {bad_sums} reads: the stored object is corrupt"
                    ) from None
                log.warning("%s does not match its ETag; re-fetching", where)
                continue
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_not_found(e):
                    raise CheckpointNotFoundError(f"{where} does not exist") from None
                attempt += 1
                if not _transient(e) or attempt >= policy.max_attempts or time.monotonic() >= deadline:
                    raise StorageError(f"reading {where} failed after {attempt} attempt(s): {self._err(e)}") from None
                log.debug("retrying %s: %s", where, self._err(e))
                await asyncio.sleep(min(policy.delay(attempt, self._rng), max(0.0, deadline - time.monotonic())))

    async def _get_whole_s3(self, bucket: str, key: str, where: str, max_bytes: int | None) -> bytes:
        timeout = self.policy.request_timeout
        resp = await asyncio.wait_for(self.fs._call_s3("get_object", Bucket=bucket, Key=key), timeout)
        body = resp["Body"]
        try:
            n = resp.get("ContentLength")
            if not isinstance(n, int):
                raise _Retryable("response without a Content-Length")
            if max_bytes is not None and n > max_bytes:
                raise CorruptCheckpointError(f"{where} is {n} bytes, more than the {max_bytes}-byte limit")
            buf = bytearray(n)
            got = await self._read_body(body, memoryview(buf))
            if got != n:
                raise _Retryable(f"short body: {got} of {n} bytes")
        finally:
            body.close()
        if not _etag_matches(resp.get("ETag"), buf):
            raise _ChecksumMismatch("whole object")
        return bytes(buf)

    async def _get_whole_obstore(self, bucket: str, key: str, where: str, max_bytes: int | None) -> bytes:
        try:
            reader = self._ob()
            data, etag = await reader.run(reader.get_whole, bucket, key, max_bytes)
        except obstore_reader.TooLarge as e:
            raise CorruptCheckpointError(f"{where} is {e.size} bytes, more than the {max_bytes}-byte limit") from None
        if not _etag_matches(etag, data):
            raise _ChecksumMismatch("whole object")
        return data

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a small object whole; on local disk via a temporary name and rename."""
        if self._local:
            with self.open_write(name) as up:
                up.write(data)
            return
        self._retry_sync(f"writing {self.describe(name)}", lambda: self.fs.pipe_file(self.path(name), data))

    def delete(self, name: str, *, recursive: bool = False) -> None:
        try:
            self._retry_sync(
                f"deleting {self.describe(name)}", lambda: self.fs.rm(self.path(name), recursive=recursive)
            )
        except FileNotFoundError:
            pass

    def makedirs(self, name: str = "") -> None:
        try:
            self.fs.makedirs(self.path(name), exist_ok=True)
        except Exception:  # noqa: BLE001 - object stores have no directories
            pass

    # ----------------------------------------------------------- range reads

    def read_into(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> cf.Future:
        """Start fetching every read into its buffer (``len == read.length``).

        Returns a future that resolves to the number of requests made, or raises
        ``StorageError`` / ``CorruptCheckpointError`` / ``CheckpointNotFoundError``
        naming object and range.
        """
        if len(reads) != len(buffers):
            raise ValueError(f"{len(reads)} reads but {len(buffers)} buffers")
        for r, b in zip(reads, buffers):
            if r.start < 0 or r.stop < r.start:
                raise ValueError(f"bad range [{r.start}, {r.stop}) of {r.name!r}")
            if len(b) != r.length:
                raise ValueError(f"buffer of {len(b)} bytes for a {r.length}-byte read")
        if self._obstore is not None:
            return asyncio.run_coroutine_threadsafe(self._read_all_obstore(reads, buffers), self._loop)
        if self.is_async:
            return asyncio.run_coroutine_threadsafe(self._read_all_async(reads, buffers), self.fs.loop)
        return self._thread_pool().submit(self._read_all_sync, reads, buffers)

    async def _read_all_async(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> int:
        sem = asyncio.Semaphore(self.max_concurrency)
        counter = [0]

        async def one(r: RangeRead, b: memoryview) -> None:
            async with sem:
                await self._read_one_async(r, b, counter)

        await _all_or_cancel([asyncio.ensure_future(one(r, b)) for r, b in zip(reads, buffers) if r.length > 0])
        return counter[0]

    async def _read_one_async(self, r: RangeRead, buf: memoryview, counter: list[int]) -> None:
        policy = self.policy
        where = f"{self.describe(r.name)} bytes [{r.start}, {r.stop})"
        deadline = time.monotonic() + policy.total_timeout
        attempt = 0
        bad_sums = 0
        while True:
            counter[0] += 1
            try:
                await self._fetch_async(r, buf)
                _verify(r, buf)
                return
            except _ChecksumMismatch as e:
                bad_sums += 1
                if bad_sums > policy.checksum_retries:
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.describe(r.name)} bytes {e} (same on {bad_sums} reads): "
                        "the stored object is corrupt"
                    ) from None
                log.warning("checksum mismatch in %s bytes %s; re-fetching", self.describe(r.name), e)
                continue
            except _Truncated as e:
                raise self._truncated(r, e.size) from None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_not_found(e):
                    raise CheckpointNotFoundError(f"{self.describe(r.name)} does not exist") from None
                if _range_not_satisfiable(e) or isinstance(e, _Retryable):
                    size = await self._size_async(r.name)
                    if size is not None and size < r.stop:
                        raise self._truncated(r, size) from None
                attempt += 1
                if not _transient(e) or attempt >= policy.max_attempts or time.monotonic() >= deadline:
                    raise StorageError(
                        f"reading {where} failed after {attempt} attempt(s): {self._err(e)}"
                    ) from None
                log.debug("retrying %s: %s", where, self._err(e))
                await asyncio.sleep(min(policy.delay(attempt, self._rng), max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------- obstore range reads

    async def _read_all_obstore(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> int:
        """Like ``_read_all_async``, but the gate bounds GETs (and their bytes), and reads split into pieces."""
        sem = _Gate(self.max_concurrency, self.inflight_bytes)
        counter = [0]
        await _all_or_cancel([
            asyncio.ensure_future(self._read_one_obstore(r, b, sem, counter))
            for r, b in zip(reads, buffers)
            if r.length > 0
        ])
        return counter[0]

    async def _read_one_obstore(
        self, r: RangeRead, buf: memoryview, sem: "_Gate", counter: list[int]
    ) -> None:
        """Fetch ``r`` as concurrent pieces; failed pieces are retried under this layer's policy."""
        policy = self.policy
        where = f"{self.describe(r.name)} bytes [{r.start}, {r.stop})"
        bucket, key = self._split(r.name)
        # A read that may be a whole object without checksums of its own is checked against
        # the ETag, which cannot say which piece was bad: keep it one GET.
        step = max(1, self.piece_size) if r.checks or r.start > 0 else max(1, r.length)
        pieces = [(a, min(r.stop, a + step)) for a in range(r.start, r.stop, step)]
        todo = pieces
        deadline = time.monotonic() + policy.total_timeout
        attempt = 0
        bad_sums: dict[int, int] = {}  # check offset (-1: the ETag) -> mismatches seen
        etag: str | None = None
        size: int | None = None
        while True:
            outcomes = await asyncio.gather(
                *(self._piece_obstore(r, a, b, bucket, key, buf, sem, counter) for a, b in todo),
                return_exceptions=True,
            )
            failed = [(p, o) for p, o in zip(todo, outcomes) if isinstance(o, BaseException)]
            for o in outcomes:
                if isinstance(o, obstore_reader.Fetched):
                    etag, size = o.etag, o.size
            if not failed:
                bad = await self._verify_obstore(r, buf)
                if not bad and not r.checks and r.start == 0 and size == r.stop and not _etag_matches(etag, buf):
                    bad = [(-1, 0, r.length)]
                if not bad:
                    return
                for off, _, _ in bad:
                    bad_sums[off] = bad_sums.get(off, 0) + 1
                off, a, b = max(bad, key=lambda c: bad_sums[c[0]])
                if bad_sums[off] > policy.checksum_retries:
                    what = " (the whole object vs its ETag)" if off < 0 else ""
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.describe(r.name)} bytes [{r.start + a}, {r.start + b}){what} "
                        f"(same on {bad_sums[off]} reads): the stored object is corrupt"
                    ) from None
                log.warning("checksum mismatch in %s bytes [%d, %d); re-fetching", self.describe(r.name),
                            r.start + a, r.start + b)
                # Only the pieces under a bad check come again (the others verified).
                todo = [(pa, pb) for pa, pb in pieces
                        if any(pa < r.start + cb and r.start + ca < pb for _, ca, cb in bad)]
                continue
            e = _worst([o for _, o in failed])
            if isinstance(e, asyncio.CancelledError):
                raise e
            if isinstance(e, _Truncated):
                raise self._truncated(r, e.size) from None
            if _is_not_found(e):
                raise CheckpointNotFoundError(f"{self.describe(r.name)} does not exist") from None
            if isinstance(e, (_Retryable, obstore_reader.RangeProblem)):
                now = await self._size_async(r.name)
                if now is not None and now < r.stop:
                    raise self._truncated(r, now) from None
            attempt += 1
            if not _transient(e) or attempt >= policy.max_attempts or time.monotonic() >= deadline:
                raise StorageError(f"reading {where} failed after {attempt} attempt(s): {self._err(e)}") from None
            log.debug("retrying %d piece(s) of %s: %s", len(failed), where, self._err(e))
            todo = [p for p, _ in failed]
            await asyncio.sleep(min(policy.delay(attempt, self._rng), max(0.0, deadline - time.monotonic())))

    async def _verify_obstore(self, r: RangeRead, buf: memoryview) -> list[tuple[int, int, int]]:
        """The failing checks of a landed read; large ones are verified off the I/O loop
        (crc32c releases the GIL), so the loop keeps copying other bodies meanwhile."""
        if sum(length for _, length, _ in r.checks) < _CRC_OFFLOAD:
            return _bad_checks(r, buf)
        return await asyncio.get_running_loop().run_in_executor(self._thread_pool(), _bad_checks, r, buf)

    async def _piece_obstore(
        self, r: RangeRead, a: int, b: int, bucket: str, key: str, buf: memoryview,
        sem: "_Gate", counter: list[int],
    ) -> obstore_reader.Fetched:
        """One GET of ``[a, b)`` of ``r`` into its slice of ``buf``, length-checked."""
        reader = self._ob()
        await sem.acquire(b - a)
        try:
            counter[0] += 1
            got = await reader.run(
                reader.fetch, bucket, key, a, buf[a - r.start:b - r.start], not r.checks and r.start == 0
            )
        finally:
            sem.release(b - a)
        if got.size is not None and got.size < b:
            raise _Truncated(got.size)
        if got.got != b - a:
            raise _Retryable(f"short body: got {got.got} of {b - a} bytes at {a}")
        return got

    def _truncated(self, r: RangeRead, size: int | None) -> CorruptCheckpointError:
        has = "fewer bytes" if size is None else f"{size} bytes"
        return CorruptCheckpointError(
            f"{self.describe(r.name)} is truncated: bytes [{r.start}, {r.stop}) requested, the object has {has}"
        )

    async def _size_async(self, name: str) -> int | None:
        """The object's size now (None if it cannot be found out)."""
        try:
            if self._obstore is not None:
                return int((await self._obstore.run(self._obstore.head, *self._split(name)))["size"])
            self.fs.invalidate_cache(self.path(name))
            return int(await asyncio.wait_for(self.fs._size(self.path(name)), self.policy.request_timeout))
        except Exception:  # noqa: BLE001 - only a hint for the message
            return None

    async def _fetch_async(self, r: RangeRead, buf: memoryview) -> None:
        """One attempt: fetch the range into ``buf`` with exact length (no checksum)."""
        if self._is_s3:
            await self._fetch_s3(r, buf)
            return
        data = await asyncio.wait_for(
            self.fs._cat_file(self.path(r.name), start=r.start, end=r.stop),
            self.policy.request_timeout + r.length / (1 << 20),
        )
        if len(data) != r.length:
            raise _Retryable(f"short read: got {len(data)} of {r.length} bytes")
        buf[:] = data

    async def _fetch_s3(self, r: RangeRead, buf: memoryview) -> None:
        """A ranged GET streamed straight into ``buf``; the client's chunks are the only copy."""
        bucket, key, _ = self.fs.split_path(self.path(r.name))
        resp = await asyncio.wait_for(
            self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={r.start}-{r.stop - 1}"),
            self.policy.request_timeout,
        )
        body = resp["Body"]
        try:
            total = _content_range_total(resp.get("ContentRange"))
            if total is not None and total < r.stop:
                raise _Truncated(total)
            n = resp.get("ContentLength")
            if n != r.length:
                raise _Retryable(f"response of {n} bytes for a {r.length}-byte range")
            got = await self._read_body(body, buf)
            if got != r.length:
                raise _Retryable(f"short body: got {got} of {r.length} bytes")
        finally:
            body.close()
        if not r.checks and r.start == 0 and total == r.stop and not _etag_matches(resp.get("ETag"), buf):
            # A read of a whole object without checksums of its own (a manifest, an index).
            raise _ChecksumMismatch(f"[{r.start}, {r.stop}) (the whole object vs its ETag)")

    async def _read_body(self, body: Any, buf: memoryview) -> int:
        """Read a response body into ``buf`` (stall-checked per chunk); returns bytes read."""
        got = 0
        while got < len(buf):
            n = await asyncio.wait_for(body.readinto(buf[got:]), self.policy.request_timeout)
            if not n:
                break
            got += n
        return got

    # ------------------------------------------------------ local range reads

    def _thread_pool(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(
                    max_workers=min(self.max_concurrency, 16), thread_name_prefix="streamckpt-io"
                )
            return self._pool

    def _read_all_sync(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> int:
        # Files are grouped so each is opened once per batch.
        counter = [0]
        by_file: dict[str, list[int]] = {}
        for i, r in enumerate(reads):
            if r.length > 0:
                by_file.setdefault(r.name, []).append(i)
        for name, idxs in by_file.items():
            try:
                if self._local:
                    f: BinaryIO = open(self.fs._strip_protocol(self.path(name)), "rb", buffering=0)
                else:
                    f = self.fs.open(self.path(name), "rb", block_size=0)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.describe(name)} does not exist") from None
            except OSError as e:
                raise StorageError(f"cannot open {self.describe(name)}: {self._err(e)}") from None
            with f:
                for i in idxs:
                    self._read_one_sync(f, reads[i], buffers[i], counter)
        return counter[0]

    def _read_one_sync(self, f: BinaryIO, r: RangeRead, buf: memoryview, counter: list[int]) -> None:
        bad_sums = 0
        attempt = 0
        while True:
            counter[0] += 1
            try:
                f.seek(r.start)
                got = 0
                while got < r.length:
                    n = f.readinto(buf[got:])  # type: ignore[attr-defined]
                    if not n:
                        break
                    got += n
                if got != r.length:
                    raise self._truncated(r, r.start + got if got else None)
                _verify(r, buf)
                return
            except _ChecksumMismatch as e:
                bad_sums += 1
                if bad_sums > self.policy.checksum_retries:
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.describe(r.name)} bytes {e} (same on {bad_sums} reads): "
                        "the stored object is corrupt"
                    ) from None
            except OSError as e:
                attempt += 1
                if attempt >= self.policy.max_attempts:
                    raise StorageError(
                        f"reading {self.describe(r.name)} bytes [{r.start}, {r.stop}) failed: {self._err(e)}"
                    ) from None
                time.sleep(self.policy.delay(attempt, self._rng))

    # ---------------------------------------------------------------- writes

    def open_write(self, name: str, *, block_size: int = 16 << 20) -> "Upload":
        """A streaming upload that becomes visible only on ``commit``.

        S3: a multipart upload (``block_size`` per part, each retried); local: a
        temporary file renamed on commit; elsewhere fsspec's buffered writer.
        """
        if self._is_s3:
            return _S3Upload(self, name, block_size)
        return Upload(self, name, block_size)

    def close(self) -> None:
        if self._obstore is not None:
            self._obstore.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class _Gate:
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


def _worst(errors: Sequence[BaseException]) -> BaseException:
    """The failure that decides a read's fate: cancellation, truncation, missing, fatal, then transient."""

    def rank(e: BaseException) -> int:
        if isinstance(e, asyncio.CancelledError):
            return 0
        if isinstance(e, _Truncated):
            return 1
        if _is_not_found(e):
            return 2
        return 4 if _transient(e) else 3

    return min(errors, key=rank)


def _etag_matches(etag: Any, data: bytes | bytearray | memoryview) -> bool:
    """False only when the ETag is a plain MD5 (single-part upload) and the bytes differ."""
    tag = str(etag or "").strip('"')
    if not re.fullmatch(r"[0-9a-f]{32}", tag):
        return True
    return hashlib.md5(data, usedforsecurity=False).hexdigest() == tag


def _s3_root(uri: str) -> str:
    """``bucket/prefix`` of an ``s3://`` or ``s3a://`` URI, as s3fs would give it."""
    return uri.split("://", 1)[1].strip("/")


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _bad_checks(r: RangeRead, buf: memoryview) -> list[tuple[int, int, int]]:
    """``(offset, start, stop)`` (relative to the read) of every check that fails."""
    return [(off, off, off + length) for off, length, expected in r.checks
            if crc32c(buf[off:off + length]) != expected]


def _verify(r: RangeRead, buf: memoryview) -> None:
    for off, length, expected in r.checks:
        if crc32c(buf[off:off + length]) != expected:
            raise _ChecksumMismatch(f"[{r.start + off}, {r.start + off + length})")


class Upload:
    """A write stream that either commits whole on ``commit`` or leaves nothing.

    Local files: written under a temporary name and renamed on commit. Other
    fsspec filesystems: fsspec's buffered writer, discarded on abort.
    """

    def __init__(self, storage: Storage, name: str, block_size: int) -> None:
        self.storage = storage
        self.name = name
        self.bytes_written = 0
        self._done = False
        fs = storage.fs
        self._local = _is_local(fs)
        final = storage.path(name)
        self._final = final
        self._tmp = f"{final}.tmp-{os.getpid()}-{random.getrandbits(40):010x}" if self._local else final
        parent = posixpath.dirname(self._tmp)
        if parent:
            try:
                fs.makedirs(parent, exist_ok=True)
            except Exception:  # noqa: BLE001 - object stores have no directories
                pass
        try:
            self._f = fs.open(self._tmp, "wb") if self._local else fs.open(self._tmp, "wb", block_size=block_size)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot open {storage.describe(name)} for writing: {storage._err(e)}") from None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._f.write(data)
        except Exception as e:  # noqa: BLE001
            raise StorageError(
                f"writing {self.storage.describe(self.name)} failed at byte {self.bytes_written}: "
                f"{self.storage._err(e)}"
            ) from None
        self.bytes_written += len(data)

    def commit(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
            if self._local:
                os.replace(self._tmp, self._final)
        except Exception as e:  # noqa: BLE001
            self._cleanup()
            raise StorageError(f"committing {self.storage.describe(self.name)} failed: {self.storage._err(e)}") from None

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            discard = getattr(self._f, "discard", None)
            if discard is not None and not self._local:
                discard()
                self._f.closed = True  # fsspec would otherwise flush the discarded buffer at exit
            else:
                self._f.close()
        except Exception:  # noqa: BLE001 - best effort on an already failing path
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        if self._local:
            try:
                os.remove(self._tmp)
            except OSError:
                pass

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class _S3Upload(Upload):
    """S3 multipart upload with per-part retries; at most one part buffered.

    Small objects (one part) are a single PUT at commit. Nothing is visible
    under the name before ``commit``; ``abort`` aborts the multipart upload.
    """

    def __init__(self, storage: Storage, name: str, block_size: int) -> None:  # noqa: D107
        self.storage = storage
        self.name = name
        self.bytes_written = 0
        self._done = False
        self._local = False
        self._block = max(_MIN_PART, int(block_size))
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self._bucket, self._key, _ = storage.fs.split_path(storage.path(name))

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        st = self.storage
        return st._retry_sync(
            f"{what} {st.describe(self.name)}",
            lambda: st.fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs),
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise StorageError(f"{self.storage.describe(self.name)}: write after commit/abort")
        self._buf += data
        self.bytes_written += len(data)
        while len(self._buf) >= self._block:
            part = bytes(self._buf[:self._block])
            del self._buf[:self._block]
            self._send(part)

    def _send(self, part: bytes) -> None:
        try:
            if self._upload_id is None:
                self._upload_id = self._call("starting upload of", "create_multipart_upload")["UploadId"]
            number = len(self._parts) + 1
            md5 = base64.b64encode(hashlib.md5(part, usedforsecurity=False).digest()).decode()
            resp = self._call(
                f"uploading part {number} of", "upload_part",
                UploadId=self._upload_id, PartNumber=number, Body=part, ContentMD5=md5,
            )
            self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        if self._done:
            return
        try:
            if self._upload_id is None:
                body = bytes(self._buf)
                md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
                self._call("writing", "put_object", Body=body, ContentMD5=md5)
            else:
                if self._buf or not self._parts:
                    self._send(bytes(self._buf))
                self._call(
                    "completing upload of", "complete_multipart_upload",
                    UploadId=self._upload_id, MultipartUpload={"Parts": self._parts},
                )
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._buf = bytearray()
        self.storage.fs.invalidate_cache(self.storage.path(self.name))

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        if self._upload_id is not None:
            try:
                self._call("aborting upload of", "abort_multipart_upload", UploadId=self._upload_id)
            except Exception as e:  # noqa: BLE001 - best effort on an already failing path
                log.warning("could not abort the multipart upload of %s: %s", self.storage.describe(self.name), e)


def iter_chunks(data: memoryview, size: int) -> Iterator[memoryview]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _mtime(info: Any) -> float:
    """The modification time in an fsspec ``info`` dict, whatever the backend calls it."""
    for key in ("LastModified", "mtime", "updated", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0
