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
``s3fs``. ``obstore`` uses it whenever it is installed and every storage option
maps onto it (else s3fs, with a warning). ``auto`` does the same only while
``AUTO_PICKS_OBSTORE`` is true: it is false for now because obstore's Rust
runtime and per-request buffers add resident memory (measured: +5 MiB peak in
tests/test_memory.py, which then sits at its 32 MiB bound; +66 MiB peak in the
256 MiB full-load benchmark), so it stays opt-in until that is budgeted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

BACKEND_ENV = "STREAMCKPT_S3_BACKEND"
BACKENDS = ("auto", "obstore", "s3fs")
AUTO_PICKS_OBSTORE = False  # see the module docstring

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
    endpoint = options.get("endpoint_url") or client_kwargs.pop("endpoint_url", None)
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


@dataclass
class ObstoreReader:
    """One obstore client (per bucket) making single-attempt ranged GETs into buffers."""

    config: dict[str, Any]
    request_timeout: float
    client_attempts: int
    max_concurrency: int
    _stores: dict[str, Any] = field(default_factory=dict)

    def store(self, bucket: str) -> Any:
        s = self._stores.get(bucket)
        if s is None:
            from obstore.store import S3Store

            timeout = timedelta(seconds=self.request_timeout)
            client = {
                "allow_http": str(self.config.get("endpoint", "")).startswith("http://"),
                "connect_timeout": timeout,
                # A stalled response (head or body) fails after this, as with s3fs's read_timeout.
                "read_timeout": timeout,
                # A backstop only: stalls are caught per chunk by the caller's own timeout.
                "timeout": timedelta(seconds=max(60.0, 4 * self.request_timeout)),
                "pool_max_idle_per_host": str(max(10, self.max_concurrency)),
            }
            retry = {
                "max_retries": max(0, self.client_attempts - 1),
                "retry_timeout": timeout,
                "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                            "base": 2},
            }
            s = S3Store(bucket, config=self.config, client_options=client, retry_config=retry)
            self._stores[bucket] = s
        return s

    async def fetch(self, bucket: str, key: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        """One ranged GET of ``len(buf)`` bytes at ``start`` into ``buf``; no retries here.

        The body is collected in Rust (one allocation of the range's size) and copied
        once into ``buf``; ``want_meta`` streams it instead, to learn the object's size
        and ETag (a whole-object read checked against its MD5).
        """
        import obstore

        stop = start + len(buf)
        with _translated():
            if want_meta:
                return await self._fetch_streamed(bucket, key, start, buf)
            # No per-chunk hook here: a stall is a deadline at a floor rate of 1 MiB/s.
            data = await asyncio.wait_for(
                obstore.get_range_async(self.store(bucket), key, start=start, end=stop),
                self.request_timeout + len(buf) / (1 << 20),
            )
            n = len(data)
            if n > len(buf):
                raise Transient(f"body of {n} bytes for a {len(buf)}-byte range")
            buf[:n] = memoryview(data)
            return Fetched(size=None, etag=None, got=n)

    async def head(self, bucket: str, key: str) -> dict[str, Any]:
        """The object's metadata (``size``, ``last_modified``, ``e_tag``); FileNotFoundError if absent."""
        import obstore

        with _translated():
            return dict(await asyncio.wait_for(obstore.head_async(self.store(bucket), key), self.request_timeout))

    async def listing(self, bucket: str, prefix: str, *, recursive: bool) -> list[str]:
        """Keys under ``prefix`` (a path: ``a/b`` lists ``a/b/...``); one level deep adds sub-prefixes."""
        import obstore

        store = self.store(bucket)
        with _translated():
            if recursive:
                stream = obstore.list(store, prefix or None, chunk_size=1000)
                metas = await asyncio.wait_for(stream.collect_async(), 4 * self.request_timeout)
                return [m["path"] for m in metas]
            res = await asyncio.wait_for(
                obstore.list_with_delimiter_async(store, prefix or None), 4 * self.request_timeout
            )
            return [*res["common_prefixes"], *(m["path"] for m in res["objects"])]

    async def get_whole(self, bucket: str, key: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """A whole (small) object and its ETag; ``TooLarge`` before its body is read if it exceeds ``max_bytes``."""
        import obstore

        with _translated():
            result = await asyncio.wait_for(obstore.get_async(self.store(bucket), key), self.request_timeout)
            size = int(result.meta["size"])
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(size)
            data = await asyncio.wait_for(result.bytes_async(), self.request_timeout + size / (1 << 20))
            if len(data) != size:
                raise Transient(f"short body: {len(data)} of {size} bytes")
            return bytes(data), result.meta.get("e_tag")

    async def _fetch_streamed(self, bucket: str, key: str, start: int, buf: memoryview) -> Fetched:
        import obstore

        stop = start + len(buf)
        result = await asyncio.wait_for(
            obstore.get_async(self.store(bucket), key, options={"range": (start, stop)}), self.request_timeout
        )
        meta = result.meta
        lo, hi = result.range
        if lo != start or hi > stop:
            raise Transient(f"server sent bytes [{lo}, {hi}) for [{start}, {stop})")
        stream = result.stream(min_chunk_size=256 << 10).__aiter__()
        got = 0
        while True:
            try:
                data = await asyncio.wait_for(stream.__anext__(), self.request_timeout)
            except StopAsyncIteration:
                break
            n = len(data)
            if got + n > len(buf):
                raise Transient(f"body longer than the {len(buf)}-byte range")
            buf[got:got + n] = memoryview(data)
            got += n
        return Fetched(size=int(meta["size"]), etag=meta.get("e_tag"), got=got)


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
