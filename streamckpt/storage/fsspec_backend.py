"""Any fsspec filesystem (gcsfs, http, memory, …): its coroutines on fsspec's loop when
it is asynchronous, its blocking calls in worker threads otherwise. s3fs gets a
faster subclass (``s3fs_backend``); local files have their own backend.

This module only translates the client's errors into the policy's kinds.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import http.client
import inspect
import re
from datetime import datetime
from typing import Any, Awaitable, TypeVar

from ..errors import close_to
from .backend import (Backend, BackendError, Fetched, NotFound, ObjectInfo, PartSink, Permanent, RangeNotSatisfiable,
                      Stalled, TooLarge, Transient, WorkerThreads)
from .endpoint import EndpointProbe

T = TypeVar("T")

_TRANSIENT_WORDS = (
    "slowdown", "slow down", "reduce your request rate", "serviceunavailable", "service unavailable",
    "internalerror", "internal error", "throttl", "requesttimeout", "timeout", "timed out", "reset",
    "payload", "disconnect", "broken pipe", "incomplete", "connection", "temporarily", "try again",
)
_FATAL_WORDS = ("credential", "accessdenied", "access denied", "forbidden", "paramvalidation", "invalidaccesskey",
                "signaturedoesnotmatch")
_MISSING_BUCKET_WORDS = ("nosuchbucket", "the specified bucket does not exist", "bucket does not exist")
_MISSING_CONTAINER_WORDS = ("containernotfound", "the specified container does not exist")  # Azure's SDK


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind a botocore/gcsfs/aiohttp error, if it carries one."""
    e: BaseException | None = exc
    for _ in range(5):
        if e is None:
            break
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        code = getattr(e, "code", None) or getattr(e, "status", None) or getattr(e, "status_code", None)
        if isinstance(code, int) and 100 <= code < 600:
            return code
        e = e.__cause__ or e.__context__
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the HTTP stacks that mean transport trouble (retryable)."""
    found: list[type[BaseException]] = [http.client.HTTPException, ConnectionError]
    try:
        from botocore.exceptions import HTTPClientError, ResponseStreamingError

        found += [HTTPClientError, ResponseStreamingError]
    except ImportError:  # pragma: no cover - s3fs not installed
        pass
    try:
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError

        found += [ServiceRequestError, ServiceResponseError]  # adlfs: no connection, or no (whole) response
    except ImportError:  # pragma: no cover - adlfs not installed
        pass
    try:
        import aiohttp

        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


_TRANSPORT_ERRORS = _transport_errors()


def missing_bucket(text: str, path: str) -> str | None:
    """The bucket of ``path`` when an error text says that the bucket itself does not exist."""
    low = text.lower()
    if any(w in low for w in _MISSING_BUCKET_WORDS):
        return path.split("/", 1)[0]
    return None


def classify(exc: BaseException, path: str) -> BackendError:
    """An fsspec client's exception as one of the policy's kinds."""
    if isinstance(exc, BackendError):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    option = _unknown_option(exc)
    if option is not None:
        s3_names = _option_names()
        if option in s3_names:  # s3fs takes it, so this client is another: an S3 server's URI without s3://
            return Permanent(f"{text}: storage_options has {option!r}, an option of s3:// URIs that this "
                             f"client ({path.split('://', 1)[0] if '://' in path else 'fsspec'}) does not take; "
                             f"for an S3-compatible server write the URI as s3://BUCKET/PREFIX, with "
                             f"endpoint_url in storage_options")
        return Permanent(f"{text}: storage_options has {option!r}, which the client does not take; check its "
                         f"name{close_to([option], s3_names)}")
    bucket = missing_bucket(text, path)
    if bucket is not None:
        return NotFound(text, bucket=bucket)
    if any(w in text.lower() for w in _MISSING_CONTAINER_WORDS):
        container = path.split("/", 1)[0]
        return NotFound(f"container {container!r} does not exist", bucket=container, kind="container")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Stalled(text)
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return NotFound(text)
    status = http_status(exc)
    low = text.lower()
    if status == 416 or "range is not satisfiable" in low or "invalidrange" in low:
        return RangeNotSatisfiable(text)
    if isinstance(exc, _TRANSPORT_ERRORS):
        return Transient(text)
    if isinstance(exc, (PermissionError, IsADirectoryError)) or isinstance(exc, OSError) and exc.errno == errno.ENOSYS:
        return Permanent(text)  # ENOSYS: s3fs's word for a 501, a request the server does not implement
    if status is not None:
        if status == 404:
            return NotFound(text)
        return Transient(text) if status >= 500 and status != 501 or status in (408, 429) else Permanent(text)
    if any(w in low for w in _FATAL_WORDS):
        return Permanent(text)
    if any(w in low for w in _TRANSIENT_WORDS):
        return Transient(text)
    # An OSError without an errno comes from a transport layer, not from the object.
    if isinstance(exc, OSError) and exc.errno is None:
        return Transient(text)
    return Permanent(text)


def _unknown_option(exc: BaseException) -> str | None:
    """The option name in a client constructor's "unexpected keyword argument" (s3fs hands
    options it does not know on to botocore's session, which refuses them at first use)."""
    if not isinstance(exc, TypeError):
        return None
    m = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
    return m.group(1) if m else None


def _option_names() -> list[str]:
    """s3fs's own option names (for a did-you-mean); none when s3fs is absent."""
    try:
        import s3fs
    except ImportError:  # pragma: no cover
        return []
    return [p for p in inspect.signature(s3fs.S3FileSystem.__init__).parameters if p not in ("self", "kwargs")]


_BUCKET_STORES = frozenset({"gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def _md5_etag(info: dict[str, Any]) -> str | None:
    """The object's MD5 as hex when the listing gives it (S3-style ETag, GCS base64 md5Hash)."""
    md5 = info.get("md5Hash")
    if isinstance(md5, str):
        try:
            raw = base64.b64decode(md5, validate=True)
        except ValueError:
            raw = b""
        if len(raw) == 16:
            return raw.hex()
    tag = info.get("ETag") or info.get("etag")
    return tag if isinstance(tag, str) else None


async def classified(path: str, call: Awaitable[T], timeout: float | None = None) -> T:
    """Await a client call (stall-bounded by ``timeout``), its failure as a policy kind."""
    try:
        return await (asyncio.wait_for(call, timeout) if timeout else call)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - classified
        raise classify(e, path) from None


def mtime(info: dict[str, Any]) -> float | None:
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
    return None


class FsspecBackend(Backend):
    """One fsspec filesystem instance; paths are its paths (``bucket/key`` for object stores)."""

    name = "fsspec"

    def __init__(self, fs: Any, request_timeout: float, max_concurrency: int, endpoint: str | None = None) -> None:
        self.fs = fs
        self.request_timeout = request_timeout
        self.is_async = bool(getattr(fs, "async_impl", False))
        self.threads = WorkerThreads(min(max_concurrency, 16), "streamckpt-io")
        # An explicit endpoint is probed beside the client's calls until it answers: a refused
        # connection then fails at once, not after the client's own retries (gcsfs: 30 s and more).
        self.probe = EndpointProbe(endpoint, request_timeout)

    async def _do(self, path: str, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``fs.<name>`` (the coroutine ``fs._<name>`` on an async filesystem), errors classified."""
        if self.is_async:
            return await classified(path, self.probe.guard(getattr(self.fs, f"_{name}")(*args, **kwargs)), timeout)
        return await classified(path, self.threads.run(lambda: getattr(self.fs, name)(*args, **kwargs)))

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        n = len(buf)
        data = await self._do(path, "cat_file", path, start=start, end=start + n,
                              timeout=self.request_timeout + n / (1 << 20))
        if len(data) > n:
            raise Transient(f"body of {len(data)} bytes for a {n}-byte range")
        buf[:len(data)] = data
        size = None
        if len(data) < n or want_meta:
            size = (await self.head(path)).size
        return Fetched(got=len(data), size=size)

    async def head(self, path: str) -> ObjectInfo:
        self.fs.invalidate_cache(path)
        info = await self._do(path, "info", path, timeout=self.request_timeout)
        if info.get("type") == "directory":
            raise NotFound(f"{path} is a directory")
        return ObjectInfo(size=int(info["size"]), etag=_md5_etag(info), modified=mtime(info))

    async def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(await self._do(path, "exists", path))

    async def listing(self, path: str, recursive: bool) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            if recursive:
                found = list(await self._do(path, "find", path))
            else:
                found = list(await self._do(path, "ls", path, detail=False))
        except NotFound as e:
            if e.bucket is not None:
                raise
            found = []
        if not found and set(_protocols(self.fs)) & _BUCKET_STORES:
            bucket = path.split("/", 1)[0]  # gcsfs and adlfs list a missing bucket as empty: ask it
            if not await self._do(bucket, "exists", bucket):
                kind = "container" if set(_protocols(self.fs)) & {"az", "abfs", "abfss"} else "bucket"
                raise NotFound(f"{kind} {bucket!r} does not exist", bucket=bucket, kind=kind)
        return found

    async def listing_info(self, path: str) -> list[tuple[str, ObjectInfo]]:
        self.fs.invalidate_cache(path)
        try:
            found = await self._do(path, "find", path, detail=True)
        except NotFound as e:
            if e.bucket is not None:
                raise
            return []
        return [(p, ObjectInfo(size=int(i.get("size") or 0), etag=_md5_etag(i), modified=mtime(i)))
                for p, i in found.items() if i.get("type") != "directory"]

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        info = await self.head(path)
        if max_bytes is not None and info.size > max_bytes:
            raise TooLarge(info.size)
        data = await self._do(path, "cat_file", path)
        if len(data) != info.size:
            raise Transient(f"short body: {len(data)} of {info.size} bytes")
        return bytes(data), info.etag

    async def delete(self, path: str, recursive: bool) -> None:
        try:
            await self._do(path, "rm", path, recursive=recursive)
        except NotFound:
            pass

    async def makedirs(self, path: str) -> None:
        try:
            await self._do(path, "makedirs", path, exist_ok=True)
        except BackendError:
            pass  # object stores have no directories

    def sink(self, path: str) -> PartSink:
        return StreamSink(self, path)

    def close(self) -> None:
        self.threads.close()


class StreamSink(PartSink):
    """fsspec's own buffered writer, one part after another (it numbers nothing itself);
    ``abort`` discards what it buffered."""

    concurrent = False

    def __init__(self, backend: FsspecBackend, path: str) -> None:
        self._backend = backend
        self._path = path
        self._f: Any = None

    async def _blocking(self, fn: Any) -> Any:
        # fsspec's file objects drive the filesystem's loop themselves: never call them on it.
        return await classified(self._path, self._backend.threads.run(fn))

    async def put_whole(self, data: memoryview) -> None:
        await self._blocking(lambda: self._backend.fs.pipe_file(self._path, bytes(data)))

    async def start(self) -> None:
        self._f = await self._blocking(lambda: self._backend.fs.open(self._path, "wb"))

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        await self._blocking(lambda: self._f.write(data))
        return number

    async def complete(self, tokens: list[Any]) -> None:
        """Close the stream and check that the store holds every byte written (a writer that
        re-sent a chunk after a lost reply can otherwise leave a longer object)."""
        written = self._f.tell() if hasattr(self._f, "tell") else None
        await self._blocking(self._f.close)
        if written is not None:
            size = (await self._backend.head(self._path)).size
            if size != written:
                raise Permanent(f"{self._path} holds {size} bytes after writing {written}")

    async def abort(self) -> None:
        f, self._f = self._f, None
        if f is None:
            return

        def drop() -> None:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
                f.closed = True  # fsspec would otherwise flush the discarded buffer at exit
            else:
                f.close()

        try:
            await self._blocking(drop)
        except BackendError:
            pass
