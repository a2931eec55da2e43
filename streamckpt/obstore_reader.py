"""Ranged S3 GETs through obstore (Rust ``object_store``) for the bulk read path.

The s3fs/aiohttp/botocore stack costs more CPU per byte than the reads
themselves on a fast network; obstore does the HTTP, signing and body handling
in Rust. ``Storage`` uses it for every read of an ``s3://`` prefix: ranged
GETs, whole small objects, HEAD and LIST (so a load never starts s3fs's
botocore client, ~0.2 s); uploads and deletes stay on s3fs, and the
retry/length/checksum policy stays in ``storage.py`` — this module makes
exactly one attempt per call and reports failures as the exception types that
policy already classifies.

Selection: ``STREAMCKPT_S3_BACKEND`` = ``auto`` (the default), ``obstore`` or
``s3fs``. ``auto`` and ``obstore`` use it whenever it is installed (a runtime
dependency) and every storage option maps onto it; otherwise s3fs reads, with a
warning when ``obstore`` was asked for. ``s3fs`` forces the fallback.
``AUTO_PICKS_OBSTORE`` is the switch for ``auto``: on since the bodies that
obstore holds in Rust before their copy are bounded (``Storage.inflight_bytes``,
16 MiB unless a load reserves a share of its memory budget). Measured on the
256 MiB benchmark (medians of 3): full load 0.51 s vs s3fs's 0.75 s, peak RSS
growth 560 MiB vs 528 MiB, within the bound of targets + budget + 64 MiB (576
MiB); a TP rank's quarter 0.19 s vs 0.49 s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKEND_ENV = "STREAMCKPT_S3_BACKEND"
BACKENDS = ("auto", "obstore", "s3fs")
AUTO_PICKS_OBSTORE = True  # see the module docstring

# s3fs options that change nothing about a ranged GET (caches, block sizes, s3fs's own retries).
_IGNORED_OPTIONS = frozenset({
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
    "default_fill_cache", "default_cache_type", "cache_regions", "asynchronous", "loop", "retries",
    "version_aware", "fixed_upload_size", "session", "max_concurrency",
})
_CREDENTIAL_OPTIONS = {
    "key": "access_key_id", "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
    "token": "session_token", "aws_session_token": "session_token",
}
_CONFIG_KWARGS_OK = frozenset({"retries", "connect_timeout", "read_timeout", "max_pool_connections"})


class NotConfigurable(ValueError):
    """The storage options use something obstore cannot reproduce; use s3fs."""


class Transient(Exception):
    """An obstore failure worth another attempt (5xx, throttling, resets, timeouts)."""


class RangeProblem(Exception):
    """The server refused or shortened the range: the object may be truncated."""


class TooLarge(Exception):
    """A whole-object read refused from the object's size; the value is the size."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one ranged GET said about the object besides its bytes."""

    size: int | None  # the object's total size (from Content-Range), when the request asked for it
    etag: str | None
    got: int  # body bytes landed in the buffer


def requested_backend() -> str:
    """The backend named by the environment (``auto`` when unset)."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


def available() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def s3_config(options: dict[str, Any]) -> dict[str, Any]:
    """obstore ``S3Config`` equivalent to s3fs ``options``; ``NotConfigurable`` if some option has none."""
    config: dict[str, Any] = {}
    client_kwargs = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or client_kwargs.pop("endpoint_url", None) or _env_endpoint()
    region = client_kwargs.pop("region_name", None)
    if client_kwargs:
        raise NotConfigurable(f"client_kwargs {sorted(client_kwargs)}")
    config_kwargs = dict(options.get("config_kwargs") or {})
    s3_section = config_kwargs.pop("s3", None) or {}
    if set(s3_section) - {"addressing_style"} or set(config_kwargs) - _CONFIG_KWARGS_OK:
        raise NotConfigurable(f"config_kwargs {sorted(config_kwargs)} {sorted(s3_section)}")
    for name, value in options.items():
        if name in _CREDENTIAL_OPTIONS:
            if value is not None:
                config[_CREDENTIAL_OPTIONS[name]] = str(value)
        elif name == "anon":
            if value:
                config["skip_signature"] = True
        elif name == "use_ssl":
            if not value and endpoint is None:
                raise NotConfigurable("use_ssl=False without endpoint_url")
        elif name not in _IGNORED_OPTIONS and name not in ("endpoint_url", "client_kwargs", "config_kwargs"):
            raise NotConfigurable(f"option {name!r}")
    if not config.get("skip_signature") and "access_key_id" not in config and not os.environ.get(
        "AWS_ACCESS_KEY_ID"
    ):
        # botocore would look in ~/.aws profiles and other places object_store does not.
        raise NotConfigurable("no explicit credentials (key/secret or AWS_ACCESS_KEY_ID)")
    if endpoint:
        config["endpoint"] = str(endpoint)
        config["virtual_hosted_style_request"] = s3_section.get("addressing_style") == "virtual"
    config["region"] = str(region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
                           or "us-east-1")
    return config


def _env_endpoint() -> str | None:
    """The endpoint botocore would take from the environment (so s3fs and obstore reach the same server)."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@dataclass
class ObstoreReader:
    """One obstore client (per bucket) making single-attempt calls: ranged GETs into
    buffers, HEAD, LIST, whole small objects.

    Every call is a blocking obstore call made in a Python thread: by the caller for
    metadata, by this reader's worker threads (``run``) for the event loop. obstore's
    ``*_async`` functions were not used because their Rust threads call back into
    Python to resolve the asyncio future; a short-lived process could reach interpreter
    shutdown while one of them was still inside that callback, and the process then
    died with SIGABRT (about 1 exit in 100 in a loop of ``streamckpt inspect``). The
    blocking calls are also cheaper here: the body lands in the calling thread's
    allocator arena, and the copy into the buffer runs there, off the event loop.
    """

    config: dict[str, Any]
    request_timeout: float
    client_attempts: int
    max_concurrency: int
    _stores: dict[str, Any] = field(default_factory=dict)
    _pool: cf.ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self, bucket: str) -> Any:
        with self._lock:
            s = self._stores.get(bucket)
            if s is None:
                s = self._stores[bucket] = self._make_store(bucket)
            return s

    def _make_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        timeout = timedelta(seconds=self.request_timeout)
        client = {
            "allow_http": str(self.config.get("endpoint", "")).startswith("http://"),
            "connect_timeout": timeout,
            # A stalled response (head or between body chunks) fails after this, as with s3fs's read_timeout.
            "read_timeout": timeout,
            # A backstop for a body that trickles in: ~70 KB/s for a 4 MiB piece.
            "timeout": timedelta(seconds=max(60.0, 4 * self.request_timeout)),
            "pool_max_idle_per_host": str(max(10, self.max_concurrency)),
        }
        retry = {
            "max_retries": max(0, self.client_attempts - 1),
            "retry_timeout": timeout,
            "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                        "base": 2},
        }
        return S3Store(bucket, config=self.config, client_options=client, retry_config=retry)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread. A cancelled caller still waits for the call to
        end: it may be writing into a buffer that the caller is about to give back."""
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max(4, self.max_concurrency), thread_name_prefix="streamckpt-s3")
            pool = self._pool
        fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    continue
            raise

    def close(self) -> None:
        """Wait for the worker threads and drop the clients (their pooled connections end here)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._stores.clear()
        if pool is not None:
            pool.shutdown(wait=True)

    def fetch(self, bucket: str, key: str, start: int, buf: memoryview, want_meta: bool = False) -> Fetched:
        """One ranged GET of ``len(buf)`` bytes at ``start`` into ``buf``; no retries here.

        The body is collected in Rust (one allocation of the range's size) and copied
        once into ``buf``; ``want_meta`` streams it instead, to learn the object's size
        and ETag (a whole-object read checked against its MD5).
        """
        import obstore

        with _translated():
            if want_meta:
                return self._fetch_streamed(bucket, key, start, buf)
            data = obstore.get_range(self.store(bucket), key, start=start, end=start + len(buf))
            n = len(data)
            if n > len(buf):
                raise Transient(f"body of {n} bytes for a {len(buf)}-byte range")
            buf[:n] = memoryview(data)
            return Fetched(size=None, etag=None, got=n)

    def _fetch_streamed(self, bucket: str, key: str, start: int, buf: memoryview) -> Fetched:
        import obstore

        stop = start + len(buf)
        result = obstore.get(self.store(bucket), key, options={"range": (start, stop)})
        meta = result.meta
        lo, hi = result.range
        if lo != start or hi > stop:
            raise Transient(f"server sent bytes [{lo}, {hi}) for [{start}, {stop})")
        got = 0
        for data in result.stream(min_chunk_size=256 << 10):
            n = len(data)
            if got + n > len(buf):
                raise Transient(f"body longer than the {len(buf)}-byte range")
            buf[got:got + n] = memoryview(data)
            got += n
        return Fetched(size=int(meta["size"]), etag=meta.get("e_tag"), got=got)

    def head(self, bucket: str, key: str) -> dict[str, Any]:
        """The object's metadata (``size``, ``last_modified``, ``e_tag``); FileNotFoundError if absent."""
        import obstore

        with _translated():
            return dict(obstore.head(self.store(bucket), key))

    def listing(self, bucket: str, prefix: str, recursive: bool = False) -> list[str]:
        """Keys under ``prefix`` (a path: ``a/b`` lists ``a/b/...``); one level deep adds sub-prefixes."""
        import obstore

        store = self.store(bucket)
        with _translated():
            if recursive:
                return [m["path"] for m in obstore.list(store, prefix or None, chunk_size=1000).collect()]
            res = obstore.list_with_delimiter(store, prefix or None)
            return [*res["common_prefixes"], *(m["path"] for m in res["objects"])]

    def get_whole(self, bucket: str, key: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """A whole (small) object and its ETag; ``TooLarge`` before its body is read if it exceeds ``max_bytes``."""
        import obstore

        with _translated():
            result = obstore.get(self.store(bucket), key)
            size = int(result.meta["size"])
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(size)
            data = result.bytes()
            if len(data) != size:
                raise Transient(f"short body: {len(data)} of {size} bytes")
            return bytes(data), result.meta.get("e_tag")


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0]


class _translated:
    """obstore's exceptions, raised again as the types ``storage``'s retry policy classifies."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        from obstore import exceptions as ox

        if e is None or not isinstance(e, (ox.BaseError, FileNotFoundError)):
            return None
        text = _first_line(e)  # the rest is a Rust debug dump of the same error
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
            raise FileNotFoundError(text) from None
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)):
            raise PermissionError(text) from None
        if isinstance(e, (ox.InvalidPathError, ox.UnknownConfigurationKeyError, ox.NotSupportedError)):
            raise ValueError(text) from None
        low = text.lower()
        if "416" in text or "range not satisfiable" in low or "invalidrange" in low or "range" in low and (
            "invalid" in low or "start" in low
        ):
            raise RangeProblem(text) from None
        raise Transient(f"{type(e).__name__}: {text}") from None
