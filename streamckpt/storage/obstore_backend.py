"""S3 through obstore (Rust ``object_store``): the default client of an ``s3://`` prefix
for deletes and uploads, and for every read where the ``http.client`` path (``httpget``,
a subclass that reads bodies straight into the buffers and does HEAD, LIST and whole
small objects itself) does not apply or ``STREAMCKPT_S3_BACKEND=obstore``. The s3fs / aiohttp /
botocore stack costs more CPU per byte than the reads themselves on a fast network;
obstore does the HTTP, signing and body handling in Rust.

Selection: ``STREAMCKPT_S3_BACKEND`` = ``auto`` (the default), ``http``, ``obstore`` or ``s3fs``.
``auto``, ``http`` and ``obstore`` use it whenever it is installed (a runtime dependency) and
every storage option maps onto it; otherwise s3fs reads, with a warning when ``obstore`` or
``http`` was asked for. ``auto`` and ``http`` then do every read with ``http.client``
(``httpget``: bodies read straight into the buffers) where that path reproduces the config,
obstore the writes and deletes. ``s3fs`` forces the fallback. A body is collected in Rust before its copy
into the buffer, so the bodies in flight are bounded (``holds_bodies``: the policy's
gate counts them against ``inflight_bytes``).

Every call is a blocking obstore call in a Python worker thread: obstore's ``*_async``
functions resolve their future from a Rust thread calling back into Python, and a
short-lived process reaching interpreter shutdown meanwhile died with SIGABRT (about 1
exit in 100 of a ``streamckpt inspect`` loop). Blocking calls are also cheaper here:
the body lands in the worker's allocator arena and is copied into the buffer there,
off the event loop.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from datetime import timedelta
from typing import Any, Sequence

from . import endpoint, httpstatus
from .backend import (Backend, BackendError, Fetched, NotFound, ObjectInfo, PartSink, Permanent, RangeNotSatisfiable,
                      Stalled, TooLarge, Transient, WorkerThreads, scatter_into)

log = logging.getLogger(__name__)

PIECE = 16 << 20  # reads larger than this become concurrent GETs (smaller for small batches: Reader.piece_for)

BACKEND_ENV = "STREAMCKPT_S3_BACKEND"
BACKENDS = ("auto", "http", "obstore", "s3fs")
AUTO_PICKS_OBSTORE = True  # see the module docstring

# s3fs options that change nothing about a ranged GET (caches, block sizes, s3fs's own retries).
_IGNORED_OPTIONS = frozenset({
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
    "default_fill_cache", "default_cache_type", "cache_regions", "asynchronous", "loop", "retries",
    "version_aware", "fixed_upload_size", "session", "max_concurrency",
})
CREDENTIAL_OPTIONS = {
    "key": "access_key_id", "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
    "token": "session_token", "aws_session_token": "session_token",
}
_CONFIG_KWARGS_OK = frozenset({"retries", "connect_timeout", "read_timeout", "max_pool_connections"})


class NotConfigurable(ValueError):
    """The storage options use something obstore cannot reproduce; use s3fs."""


def requested_backend() -> str:
    """The backend named by the environment (``auto`` when unset)."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


def available() -> bool:
    """Whether obstore is installed, without importing it: a load through the
    ``http.client`` path never does (the import alone costs a few ms of its first call)."""
    from importlib.util import find_spec

    try:
        return find_spec("obstore") is not None
    except (ImportError, ValueError):
        return False


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
        if name in CREDENTIAL_OPTIONS:
            if value is not None:
                config[CREDENTIAL_OPTIONS[name]] = str(value)
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
        if os.environ.get("AWS_ENDPOINT_URL_S3"):
            # object_store ranks that variable above ``endpoint``: an explicit endpoint_url must win, as in botocore
            config["aws_endpoint_url_s3"] = str(endpoint)
        config["virtual_hosted_style_request"] = s3_section.get("addressing_style") == "virtual"
    config["region"] = str(region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
                           or "us-east-1")
    return config


def _env_endpoint() -> str | None:
    """The endpoint botocore would take from the environment (so s3fs and obstore reach the same server)."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class ObstoreBackend(Backend):
    """One obstore client per bucket; single-attempt calls in worker threads."""

    name = "obstore"
    holds_bodies = True
    piece_size = PIECE
    client_label = "the S3 client"  # for the message of a panic
    bulk_delete = True  # S3's DeleteObjects

    def __init__(self, config: dict[str, Any], request_timeout: float, client_attempts: int,
                 max_concurrency: int, write_attempts: int = 24, write_timeout: float = 45.0) -> None:
        self.config = config
        self.request_timeout = request_timeout
        self.client_attempts = client_attempts
        self.max_concurrency = max_concurrency
        self.write_attempts = write_attempts  # obstore's writer retries its parts itself: the policy's whole budget
        self.write_timeout = write_timeout
        self.threads = WorkerThreads(max(4, max_concurrency), "streamckpt-s3")
        self._stores: dict[tuple[str, bool], Any] = {}
        self._lock = threading.Lock()

    def store(self, bucket: str, writes: bool = False) -> Any:
        with self._lock:
            s = self._stores.get((bucket, writes))
            if s is None:
                s = self._stores[(bucket, writes)] = self._make_store(bucket, writes)
            return s

    def client_options(self) -> dict[str, Any]:
        """obstore client options: the policy's stall timeout, a trickle backstop, a pool per host."""
        timeout = timedelta(seconds=self.request_timeout)
        return {
            "allow_http": str(self.config.get("endpoint", "")).startswith("http://"),
            "connect_timeout": timeout,
            # A stalled response (head or between body chunks) fails after this, as with s3fs's read_timeout.
            "read_timeout": timeout,
            # A backstop for a body that trickles in: ~70 KB/s for a 4 MiB piece.
            "timeout": timedelta(seconds=max(60.0, 4 * self.request_timeout)),
            "pool_max_idle_per_host": str(max(10, self.max_concurrency)),
        }

    def retry_config(self, writes: bool) -> dict[str, Any]:
        """obstore's own retries: ``client_attempts`` per read; the policy's whole budget for a writer's parts."""
        return {
            "max_retries": max(0, (self.write_attempts if writes else self.client_attempts) - 1),
            "retry_timeout": timedelta(seconds=self.write_timeout if writes else self.request_timeout),
            "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                        "base": 2},
        }

    def _make_store(self, bucket: str, writes: bool = False) -> Any:
        from obstore.store import S3Store

        client = self.client_options()
        config = dict(self.config)
        if writes and not client["allow_http"]:
            # Over TLS the transport already protects the body (and the manifest's CRC32C checks it at
            # load): skip SigV4's SHA-256 of every upload, as the AWS SDKs do over HTTPS.
            config["unsigned_payload"] = True
        return S3Store(bucket, config=config, client_options=client, retry_config=self.retry_config(writes))

    def translate(self, e: BaseException, bucket: str) -> BackendError:
        """This client's exceptions as the policy's kinds."""
        return translate(e, bucket)

    async def _run(self, path: str, fn: Any, *args: Any) -> Any:
        bucket, _, key = path.partition("/")
        return await self.in_thread(bucket, lambda: fn(self.store(bucket), key, *args))

    async def in_thread(self, bucket: str, thunk: Any) -> Any:
        """``thunk()`` on a worker thread, its errors (a Rust panic too) as the policy's kinds."""

        def call() -> Any:
            try:
                return thunk()
            except BackendError:
                raise
            except Exception as e:  # noqa: BLE001 - classified
                raise self.translate(e, bucket) from None
            except BaseException as e:  # a Rust panic is a BaseException: never let it out
                if endpoint.is_panic(e):
                    raise Permanent(f"{self.client_label} failed: {str(e).splitlines()[0]}") from None
                raise

        return await self.threads.run(call)

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        return await self._run(path, _fetch_streamed if want_meta else _fetch, start, [buf])

    async def fetch_parts(self, path: str, start: int, bufs: Sequence[memoryview], *,
                          want_meta: bool = False) -> Fetched:
        """The body is copied from Rust's buffer straight into each part (no extra copy)."""
        return await self._run(path, _fetch_streamed if want_meta else _fetch, start, list(bufs))

    async def head(self, path: str) -> ObjectInfo:
        return await self._run(path, _head)

    async def listing(self, path: str, recursive: bool) -> list[str]:
        bucket = path.partition("/")[0]
        keys = await self._run(path.rstrip("/"), _listing, recursive)
        return [f"{bucket}/{k}" for k in keys]

    async def listing_info(self, path: str) -> list[tuple[str, ObjectInfo]]:
        bucket = path.partition("/")[0]
        found = await self._run(path.rstrip("/"), _listing_info)
        return [(f"{bucket}/{k}", info) for k, info in found]

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        return await self._run(path, _get_whole, max_bytes)

    async def delete(self, path: str, recursive: bool) -> None:
        await self._run(path, _delete, recursive)

    async def delete_many(self, paths: Sequence[str]) -> None:
        """S3's DeleteObjects (obstore batches up to 1000 keys a request), per bucket."""
        if not self.bulk_delete:
            return await super().delete_many(paths)
        buckets: dict[str, list[str]] = {}
        for p in paths:
            bucket, _, key = p.partition("/")
            buckets.setdefault(bucket, []).append(key)
        for bucket, keys in buckets.items():
            await self.in_thread(bucket, lambda: _delete_keys(self.store(bucket), keys))

    def sink(self, path: str) -> PartSink:
        return ObstoreSink(self, path)

    def close(self) -> None:
        """Wait for the worker threads and drop the clients (their pooled connections end here)."""
        self.threads.close()
        with self._lock:
            self._stores.clear()


def _fetch(store: Any, key: str, start: int, bufs: list[memoryview]) -> Fetched:
    """One ranged GET into consecutive ``bufs``: the body is collected in Rust (one
    allocation) and copied once, straight into each buffer."""
    import obstore

    total = sum(len(b) for b in bufs)
    data = obstore.get_range(store, key, start=start, end=start + total)
    n = len(data)
    if n > total:
        raise Transient(f"body of {n} bytes for a {total}-byte range")
    if len(bufs) == 1:
        bufs[0][:n] = memoryview(data)
    else:
        scatter_into(bufs, data)
    return Fetched(got=n)


def _fetch_streamed(store: Any, key: str, start: int, bufs: list[memoryview]) -> Fetched:
    """A ranged GET streamed into consecutive ``bufs`` that also learns the object's size and ETag."""
    import obstore

    total = sum(len(b) for b in bufs)
    stop = start + total
    result = obstore.get(store, key, options={"range": (start, stop)})
    meta = result.meta
    lo, hi = result.range
    if lo != start or hi > stop:
        raise Transient(f"server sent bytes [{lo}, {hi}) for [{start}, {stop})")
    got = 0
    for data in result.stream(min_chunk_size=256 << 10):
        n = len(data)
        if got + n > total:
            raise Transient(f"body longer than the {total}-byte range")
        scatter_into(bufs, data, got)
        got += n
    return Fetched(got=got, size=int(meta["size"]), etag=meta.get("e_tag"))


def _head(store: Any, key: str) -> ObjectInfo:
    import obstore

    meta = obstore.head(store, key)
    when = meta.get("last_modified")
    return ObjectInfo(size=int(meta["size"]), etag=meta.get("e_tag"),
                      modified=when.timestamp() if when is not None else None)


def _listing(store: Any, prefix: str, recursive: bool) -> list[str]:
    """Keys under ``prefix`` (a path: ``a/b`` lists ``a/b/...``); one level deep adds sub-prefixes."""
    import obstore

    if recursive:
        return [m["path"] for m in obstore.list(store, prefix or None, chunk_size=1000).collect()]
    res = obstore.list_with_delimiter(store, prefix or None)
    return [*res["common_prefixes"], *(m["path"] for m in res["objects"])]


def _listing_info(store: Any, prefix: str) -> list[tuple[str, ObjectInfo]]:
    """Keys under ``prefix`` with their sizes and times: one LIST request per 1000 keys."""
    import obstore

    out = []
    for m in obstore.list(store, prefix or None, chunk_size=1000).collect():
        when = m.get("last_modified")
        out.append((m["path"], ObjectInfo(size=int(m["size"]), etag=m.get("e_tag"),
                                          modified=when.timestamp() if when is not None else None)))
    return out


def _get_whole(store: Any, key: str, max_bytes: int | None) -> tuple[bytes, str | None]:
    import obstore

    result = obstore.get(store, key)
    size = int(result.meta["size"])
    if max_bytes is not None and size > max_bytes:
        raise TooLarge(size)
    data = result.bytes()
    if len(data) != size:
        raise Transient(f"short body: {len(data)} of {size} bytes")
    return bytes(data), result.meta.get("e_tag")


def _delete(store: Any, key: str, recursive: bool) -> None:
    import obstore

    keys = [key]
    if recursive:
        keys += [m["path"] for m in obstore.list(store, key.rstrip("/") + "/", chunk_size=1000).collect()]
    for k in keys:
        try:
            obstore.delete(store, k)
        except FileNotFoundError:
            pass


def _delete_keys(store: Any, keys: list[str]) -> None:
    import obstore

    obstore.delete(store, keys)


# "... Server returned non-2xx status code: 403 Forbidden: <?xml ...><Error><Code>...", then a debug dump
_STATUS = re.compile(r"non-2xx status code: (\d{3})[^:\n]*:?(.*?)(?:\n\nDebug source:|$)", re.S)


def translate(e: BaseException, bucket: str) -> BackendError:
    """obstore's exceptions as the policy's kinds (the first line: the rest is a Rust debug dump)."""
    from obstore import exceptions as ox

    text = str(e).split("\n", 1)[0]
    full = str(e).lower()
    if "nosuchbucket" in full or "bucket does not exist" in full:
        return NotFound(f"bucket {bucket!r} does not exist", bucket=bucket)
    if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
        return NotFound(text)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)):
        return Permanent(text)
    if isinstance(e, (ox.InvalidPathError, ox.UnknownConfigurationKeyError, ox.NotSupportedError, ValueError)):
        return Permanent(text)
    status = _STATUS.search(str(e))
    if status:  # a GenericError around an error response (a listing's 403): its status and S3 code decide
        return httpstatus.failure(int(status[1]), status[2].encode(), bucket)
    low = text.lower()
    if "501 not implemented" in low:  # a request this server does not serve (bulk delete on some S3 servers)
        return Permanent(f"{text} (the server does not implement this request)")
    if "416" in text or "range not satisfiable" in low or "invalidrange" in low or "range" in low and (
        "invalid" in low or "start" in low
    ):
        return RangeNotSatisfiable(text)
    if "timed out" in full:
        return Stalled(f"{type(e).__name__}: {text}")
    if endpoint.refused(e):
        return Transient(f"{type(e).__name__}: {text} (connection refused)")
    return Transient(f"{type(e).__name__}: {text}")


class ObstoreSink(PartSink):
    """obstore's buffered multipart writer: our parts are fed to it in order and it keeps
    ``WRITE_CONCURRENCY`` parts of ``PART`` bytes in flight, retrying each itself (its client
    has the policy's whole attempt budget for writes). On abort the writer is dropped
    without completing, and the multipart upload it began is aborted through s3fs
    (obstore has no abort call), so nothing is left behind."""

    concurrent = False  # one stream: obstore numbers and retries the parts itself
    min_part = 5 << 20
    PART = 8 << 20
    WRITE_CONCURRENCY = 4

    def __init__(self, backend: ObstoreBackend, path: str) -> None:
        self._b = backend
        self._path = path
        self._bucket, _, self._key = path.partition("/")
        self._writer: Any = None
        self.on_abort: Any = None  # set by Storage: aborts leftover multipart uploads of this key

    async def _call(self, fn: Any) -> Any:
        def call() -> Any:
            try:
                return fn()
            except BackendError:
                raise
            except Exception as e:  # noqa: BLE001 - classified
                raise self._b.translate(e, self._bucket) from None
            except BaseException as e:  # a Rust panic is a BaseException: never let it out
                if endpoint.is_panic(e):
                    raise Permanent(f"{self._b.client_label} failed: {str(e).splitlines()[0]}") from None
                raise

        return await self._b.threads.run(call)

    async def put_whole(self, data: memoryview) -> None:
        import obstore

        # No copy: ``put`` returns only once the request is done with the caller's buffer. The store
        # is looked up in the worker thread too: making one may connect (``AzureBackend``'s probe).
        await self._call(lambda: obstore.put(self._b.store(self._bucket, writes=True), self._key, data,
                                             use_multipart=False))

    async def start(self) -> None:
        import obstore

        self._writer = await self._call(lambda: obstore.open_writer(
            self._b.store(self._bucket, writes=True), self._key, buffer_size=self.PART,
            max_concurrency=self.WRITE_CONCURRENCY))

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        w = self._writer
        # obstore keeps a reference to what it is given until the part is sent: never the
        # caller's part buffer, which is refilled as soon as this returns.
        await self._call(lambda: w.write(bytes(data)))
        return number

    async def complete(self, tokens: list[Any]) -> None:
        w, self._writer = self._writer, None
        await self._call(w.close)

    async def abort(self) -> None:
        self._writer = None  # dropped unfinished: nothing becomes visible
        if self.on_abort is not None:
            await self.on_abort(self._path)
