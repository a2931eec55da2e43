"""S3 reads over plain ``http.client``: ranged GETs each read straight into the caller's
memory, and a load's metadata requests (HEAD, LIST, whole small objects) without obstore.

Why it exists: through obstore a body lands in Rust's buffer and is then copied into
our memoryviews with the GIL held (55% of a full load's CPU in scenario (a) of
BENCHMARKS.md). Here ``HTTPResponse.readinto`` on the target's own memoryview goes
nearly straight to ``recv_into`` with the GIL released: each byte crosses user memory
once, and no response body is held anywhere but in its target (``holds_bodies`` is
false, so the memory budget need not reserve room for bodies in flight). And a load's
first requests (GET manifest.json, a LIST of the prefix, GET of an index) are on its
critical path: building obstore's client for them made each first call slower (medians
in fresh processes, ``benchmarks/firstcall.py``: a first LIST 16 → 8 ms, a first small
GET 22 → 6 ms, HF metadata read 50 → 36 ms). A load never builds one.

``fetch`` / ``fetch_parts``, ``head``, ``get_whole`` and ``listing`` (ListObjectsV2,
``httplist``; ``exists`` is HEAD then LIST) take this path; deletes and writes stay on
obstore (``HttpGetBackend`` subclasses ``ObstoreBackend``), so the endpoint, region,
credentials and anonymous access come from the same ``s3_config`` mapping, and S3
Express buckets stay on obstore entirely. Requests are signed with SigV4 here (a few
HMACs with a cached signing key: cheaper per request than botocore's signer, and no
botocore import on the load path). Path-style addressing only; options this path does
not reproduce (virtual-hosted requests to a custom endpoint, AWS_* settings object_store
would read) leave reads on obstore (``http_target`` raises ``NotConfigurable``).

One attempt per call, like every backend (but for status-level errors, which it tries
``client_attempts`` times as the other S3 clients do; ``httpstatus`` classifies them): a
connection is kept alive in a shared pool only after a response was read to its end;
after any failure or a partly read body it is closed. The one exception is a reused idle
connection the server closed meanwhile (no response byte came): that request is sent
again once on a fresh connection, as HTTP clients do for idempotent requests.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import random
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar
from urllib.parse import quote, urlsplit

from .backend import Fetched, ObjectInfo, Stalled, TooLarge, Transient, throttling
from .httplist import list_keys
from .httpstatus import StatusFailure, classified, content_range, failure, http_date
from .obstore_backend import PIECE, NotConfigurable, ObstoreBackend

AUTO_PICKS_HTTP = True  # ``STREAMCKPT_S3_BACKEND=auto`` reads through this path (else obstore)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
SLICE = 1 << 20  # a body is read in slices of this much, checking the trickle backstop between them
T = TypeVar("T")
# object_store settings read from the environment that this path would not honour.
_ENV_NOT_REPRODUCED = ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_SKIP_SIGNATURE", "AWS_S3_EXPRESS",
                       "AWS_REQUEST_PAYER", "AWS_CONDITIONAL_PUT", "AWS_SSE_CUSTOMER_KEY_BASE64")


@dataclass(frozen=True)
class HttpTarget:
    """Where and how to send a bucket's GETs: the obstore config, resolved."""

    scheme: str  # http or https
    host: str
    port: int | None
    base_path: str  # a path prefix of the endpoint ("" usually)
    region: str
    access_key: str | None  # None: anonymous (no signature)
    secret_key: str | None
    token: str | None

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port in (None, default) else f"{self.host}:{self.port}"

    def path(self, bucket: str, key: str | None) -> str:
        """The URI-encoded path of an object (of the bucket itself when ``key`` is None)."""
        if key is None:
            return f"{self.base_path}/{quote(bucket, safe='')}"
        return f"{self.base_path}/{quote(bucket, safe='')}/{quote(key, safe='/~')}"


def http_target(config: dict[str, Any]) -> HttpTarget:
    """The GET target for an obstore ``config`` (from ``s3_config``); ``NotConfigurable``
    when this path cannot reproduce what obstore would do with it."""
    env = [name for name in _ENV_NOT_REPRODUCED if os.environ.get(name)]
    if env:
        raise NotConfigurable(f"environment {', '.join(env)}")
    region = str(config["region"])
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT") or f"https://s3.{region}.amazonaws.com"
    if config.get("virtual_hosted_style_request"):
        raise NotConfigurable("virtual-hosted requests to a custom endpoint")
    url = urlsplit(str(endpoint))
    if url.scheme not in ("http", "https") or not url.hostname or url.query:
        raise NotConfigurable(f"endpoint {url.scheme}://{url.hostname}")
    if config.get("skip_signature"):
        access = secret = token = None
    else:
        access = config.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = config.get("secret_access_key") or os.environ.get("AWS_SECRET_ACCESS_KEY")
        token = config.get("session_token") or (os.environ.get("AWS_SESSION_TOKEN") if "access_key_id" not in config
                                                else None)
        if not access or not secret:
            raise NotConfigurable("an access key without its secret")
    host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
    return HttpTarget(url.scheme, host, url.port, url.path.rstrip("/"), region, access, secret, token)


class SigV4:
    """AWS Signature Version 4 for GETs and HEADs, without a body (the signing key is cached per day)."""

    def __init__(self, target: HttpTarget) -> None:
        self._t = target
        self._day = ""
        self._key = b""
        self._lock = threading.Lock()

    def _signing_key(self, day: str) -> bytes:
        with self._lock:
            if day != self._day:
                k = hmac.digest(("AWS4" + str(self._t.secret_key)).encode(), day.encode(), "sha256")
                for part in (self._t.region, "s3", "aws4_request"):
                    k = hmac.digest(k, part.encode(), "sha256")
                self._day, self._key = day, k
            return self._key

    def headers(self, path: str, now: datetime.datetime | None = None, method: str = "GET",
                query: str = "") -> dict[str, str]:
        """The headers of a signed ``method`` of ``path`` (already URI-encoded) with the
        canonical ``query`` (``canonical_query``; the request sends that same string)."""
        t = self._t
        headers = {"host": t.host_header, "x-amz-content-sha256": EMPTY_SHA256}
        if t.access_key is None:
            return headers
        stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
        headers["x-amz-date"] = stamp
        if t.token:
            headers["x-amz-security-token"] = t.token
        names = ";".join(headers)  # already lower-case and in sorted order
        canonical = "\n".join([method, path, query, *(f"{k}:{v}" for k, v in headers.items()), "", names, EMPTY_SHA256])
        scope = f"{stamp[:8]}/{t.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        sig = hmac.new(self._signing_key(stamp[:8]), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={t.access_key}/{scope}, "
                                    f"SignedHeaders={names}, Signature={sig}")
        return headers


def canonical_query(params: dict[str, str]) -> str:
    """A query string as SigV4 signs it (and the request sends it): names and values
    URI-encoded the AWS way (RFC 3986 unreserved characters kept, every other byte of the
    UTF-8 ``%XX``, ``/`` included), sorted by encoded name."""
    pairs = sorted((quote(k, safe=""), quote(v, safe="")) for k, v in params.items())
    return "&".join(f"{k}={v}" for k, v in pairs)


class Connections:
    """Idle keep-alive connections to one endpoint, shared by the worker threads."""

    def __init__(self, target: HttpTarget, timeout: float, keep: int) -> None:
        self._t = target
        self._timeout = timeout
        self._keep = keep
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    @property
    def idle(self) -> int:
        """Connections kept for the next request."""
        with self._lock:
            return len(self._idle)

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it was used before."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self.new(), False

    def new(self) -> http.client.HTTPConnection:
        t = self._t
        if t.scheme == "https":
            with self._lock:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
            return http.client.HTTPSConnection(t.host.strip("[]"), t.port, timeout=self._timeout, context=self._ssl)
        return http.client.HTTPConnection(t.host.strip("[]"), t.port, timeout=self._timeout)

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        """Keep a connection whose last response was read to its end."""
        with self._lock:
            if not self._closed and len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


class HttpGetBackend(ObstoreBackend):
    """``http.client`` for every read (range GETs into the buffers, HEADs, whole small
    objects, listings: a load builds no obstore client); obstore for writes and deletes."""

    name = "http"
    holds_bodies = False  # bodies go straight into their buffers
    piece_size = PIECE
    counts_throttling = True  # every 503 SlowDown, its own retries included (``_retrying``)
    list_page_keys: int | None = None  # ListObjectsV2 max-keys (None: the server's 1000)

    def __init__(self, config: dict[str, Any], request_timeout: float, client_attempts: int,
                 max_concurrency: int, **kw: Any) -> None:
        super().__init__(config, request_timeout, client_attempts, max_concurrency, **kw)
        self.target = http_target(config)
        self.signer = SigV4(self.target)
        self.pool = Connections(self.target, request_timeout, max(4, max_concurrency))
        self.backstop = max(60.0, 4 * request_timeout)  # a body that trickles in fails after this

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        if _express(path):
            return await super().fetch(path, start, buf, want_meta=want_meta)
        return await self.threads.run(self.get, path, start, [buf])

    async def fetch_parts(self, path: str, start: int, bufs: Sequence[memoryview], *,
                          want_meta: bool = False) -> Fetched:
        """The body is read into each part in turn: no copy."""
        if _express(path):
            return await super().fetch_parts(path, start, bufs, want_meta=want_meta)
        return await self.threads.run(self.get, path, start, list(bufs))

    async def head(self, path: str) -> ObjectInfo:
        if _express(path):
            return await super().head(path)
        return await self.threads.run(self._retrying, self._head_once, path)

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        if _express(path):
            return await super().get_whole(path, max_bytes)
        bucket, _, key = path.partition("/")
        return await self.threads.run(self._retrying, self._whole_once, bucket, self.target.path(bucket, key),
                                      "", max_bytes)

    async def listing(self, path: str, recursive: bool) -> list[str]:
        """ListObjectsV2 pages, each one signed GET (``httplist``): what obstore would list."""
        if _express(path):
            return await super().listing(path, recursive)
        bucket, _, key = path.rstrip("/").partition("/")
        url = self.target.path(bucket, None)

        def page(params: dict[str, str]) -> bytes:
            return self._retrying(self._whole_once, bucket, url, canonical_query(params), None)[0]

        keys = await self.threads.run(list_keys, page, key, recursive, self.list_page_keys)
        return [f"{bucket}/{k}" for k in keys]

    def get(self, path: str, start: int, bufs: list[memoryview]) -> Fetched:
        """One ranged GET of ``sum(len(b) for b in bufs)`` bytes at ``start`` into ``bufs``."""
        return self._retrying(self._get_once, path, start, bufs)

    def _retrying(self, once: Callable[..., T], *args: Any) -> T:
        """``once(*args)``, with status-level failures (an error status such as 503 SlowDown, a
        refused connection: no body byte written) sent again, ``client_attempts`` in all with
        50 ms–1 s jittered backoff, as obstore's and botocore's clients do
        (``RetryPolicy.client_attempts``). Each throttled response is counted (``throttled``)."""
        attempt = 1
        while True:
            try:
                return once(*args)
            except StatusFailure as e:
                if throttling(e):
                    self.throttled.add()
                if attempt >= self.client_attempts:
                    raise
            time.sleep(random.uniform(0, min(1.0, 0.05 * 2 ** attempt)))
            attempt += 1

    def _open(self, method: str, url: str, headers: dict[str, str]) -> tuple[http.client.HTTPConnection,
                                                                             http.client.HTTPResponse]:
        """A pooled connection and the response head of one request on it (the caller closes
        the connection if anything fails after this)."""
        conn, reused = self.pool.take()
        try:
            return conn, _send(conn, method, url, headers)
        except (ConnectionError, http.client.RemoteDisconnected):
            conn.close()
            if not reused:
                raise
        conn = self.pool.new()  # an idle connection the server had closed: once more on a fresh one
        try:
            return conn, _send(conn, method, url, headers)
        except BaseException:
            conn.close()
            raise

    def _head_once(self, path: str) -> ObjectInfo:
        bucket, _, key = path.partition("/")
        url = self.target.path(bucket, key)
        try:
            conn, resp = self._open("HEAD", url, self.signer.headers(url, method="HEAD"))
        except BaseException as e:
            raise classified(e, self.request_timeout) from None
        try:
            resp.read()  # a HEAD has no body: this only ends the response
            if resp.status != 200:
                raise failure(resp.status, b"", bucket)
            length = resp.getheader("Content-Length")
            if length is None or not length.isdigit():
                raise Transient(f"HEAD without a Content-Length ({length!r})")
        except BaseException as e:
            conn.close()
            raise classified(e, self.request_timeout) from None
        if resp.will_close:
            conn.close()
        else:
            self.pool.give_back(conn)
        return ObjectInfo(size=int(length), etag=resp.getheader("ETag"),
                          modified=http_date(resp.getheader("Last-Modified")))

    def _whole_once(self, bucket: str, url: str, query: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """One GET of a whole small object (or a listing page: ``query``), and its ETag."""
        headers = self.signer.headers(url, query=query)
        try:
            conn, resp = self._open("GET", f"{url}?{query}" if query else url, headers)
        except BaseException as e:
            raise classified(e, self.request_timeout) from None
        try:
            data = self._whole_body(resp, bucket, max_bytes)
        except BaseException as e:
            conn.close()  # a body over max_bytes is not read: its connection cannot serve another request
            raise classified(e, self.request_timeout) from None
        if resp.isclosed() and not resp.will_close:
            self.pool.give_back(conn)
        else:
            conn.close()
        return data, resp.getheader("ETag")

    def _whole_body(self, resp: http.client.HTTPResponse, bucket: str, max_bytes: int | None) -> bytes:
        """A 200's whole body; ``TooLarge`` before reading one whose Content-Length is over
        ``max_bytes``. A body without a length (chunked: S3 sends listings so) is read to its end."""
        if resp.status != 200:
            raise failure(resp.status, resp.read(1 << 16), bucket)
        size = resp.length
        if size is not None and max_bytes is not None and size > max_bytes:
            raise TooLarge(size)
        deadline = time.monotonic() + self.backstop
        limit = size if size is not None else max_bytes + 1 if max_bytes is not None else None
        chunks: list[bytes] = []
        got = 0
        while limit is None or got < limit:
            chunk = resp.read(SLICE if limit is None else min(SLICE, limit - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if time.monotonic() > deadline:
                raise Stalled(f"body still incomplete after {self.backstop:g} s")
        if size is None and max_bytes is not None and got > max_bytes:
            raise TooLarge(got)  # at least this many bytes: the server did not say how many
        if size is not None and got != size:
            raise Transient(f"short body: {got} of {size} bytes")
        return b"".join(chunks)

    def _get_once(self, path: str, start: int, bufs: list[memoryview]) -> Fetched:
        bucket, _, key = path.partition("/")
        total = sum(len(b) for b in bufs)
        url = self.target.path(bucket, key)
        headers = self.signer.headers(url)
        headers["range"] = f"bytes={start}-{start + total - 1}"
        try:
            conn, resp = self._open("GET", url, headers)
        except BaseException as e:
            raise classified(e, self.request_timeout) from None
        try:
            got, size, complete = self._body(resp, bucket, start, total, bufs)
        except BaseException as e:
            conn.close()
            raise classified(e, self.request_timeout) from None
        if complete and got == total and resp.isclosed() and not resp.will_close:  # a success, read to its end
            self.pool.give_back(conn)
        else:
            conn.close()
        return Fetched(got=got, size=size, etag=resp.getheader("ETag"))

    def _body(self, resp: http.client.HTTPResponse, bucket: str, start: int, total: int,
              bufs: list[memoryview]) -> tuple[int, int | None, bool]:
        """Read a 206/200 body into ``bufs``: (bytes read, the object's size if known, whether the
        whole body was read); other statuses raise."""
        status = resp.status
        if status == 206:
            first, size = content_range(resp.getheader("Content-Range"))
            if first != start:
                raise Transient(f"server sent bytes from {first} for a range from {start}")
        elif status == 200 and start == 0:  # the whole object: the server ignored the range
            size = resp.length
        elif status == 200:
            raise Transient(f"HTTP 200: the server ignored the range from byte {start}")
        else:
            raise failure(status, resp.read(1 << 16), bucket)
        length = resp.length
        if length is None or length > total or length < total and size is not None and size >= start + total:
            # a shorter body is read only when the object may end inside the range (a truncated object)
            raise Transient(f"response of {length} bytes for a {total}-byte range")
        deadline = time.monotonic() + self.backstop
        got = 0
        for b in bufs:
            want = min(len(b), length - got)
            pos = 0
            while pos < want:
                n = resp.readinto(b[pos:min(want, pos + SLICE)])
                if not n:
                    return got + pos, size, False  # short: the caller sees fewer bytes than asked
                pos += n
                if time.monotonic() > deadline:
                    raise Stalled(f"body still incomplete after {self.backstop:g} s")
            got += pos
            if got == length:
                break
        return got, size, got == length

    def close(self) -> None:
        super().close()
        self.pool.close()


def _express(path: str) -> bool:
    """An S3 Express One Zone bucket (its own session auth, which object_store does): obstore reads it."""
    return path.partition("/")[0].endswith("--x-s3")


def _send(conn: http.client.HTTPConnection, method: str, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    conn.request(method, url, headers=headers)
    return conn.getresponse()
