"""An HTTP proxy on 127.0.0.1 that injects storage faults in front of a real S3 or GCS server.

Point a client's ``endpoint_url`` at ``FaultProxy.endpoint_url`` instead of the
server's: every request is forwarded, and a seeded fraction of the eligible ones
(by default object GETs and HEADs) gets one fault:

``slowdown``  503 with an S3 ``SlowDown`` error body, without reaching the server;
``reset``     the head and half of the body, then a TCP reset;
``short``     a consistent but short body (Content-Length and Content-Range agree);
``flip``      one bit of the body flipped in transit, length unchanged;
``stall``     the reply held back for ``stall_seconds`` (then sent whole);
``rot``       the same bit of the same object flipped on every read (rot at rest as
              a reader sees it: the same wrong content every time, unlike ``flip``).

``methods`` and ``match(method, path)`` choose the eligible requests (object
requests only: ``/bucket/key``). ``max_repeats`` bounds how many times in a row the same request (method, path,
Range) is faulted, so faults stay transient and a client with enough retries is
guaranteed to get through; set it high to model an outage (or ``rate=1.0``).

    with LocalS3() as s3, FaultProxy(s3.endpoint_url, rate=0.2, seed=1) as proxy:
        sc.load(sd, uri, storage_options=proxy.storage_options)
        print(proxy.counts)   # {'slowdown': 7, 'reset': 5, ...}

``unsupported(method, path)`` picks requests the proxy answers ``501 NotImplemented`` itself,
always (not counted as faults: a server that lacks an API, as some S3-compatible servers lack
the bulk delete ``POST /bucket?delete``); ``refused`` counts them.

``deleted`` lists the objects the server was asked to delete, in order (``bucket/key``): each
``DELETE`` of an object and each key of a bulk delete (S3's ``POST /bucket?delete``), so a test
can check the order of a deletion whatever request shape the client chose.

``api="gcs"`` puts it in front of a GCS JSON-API server (``LocalGCS``): object
requests are then ``.../b/<bucket>/o/<object>`` (media downloads and metadata),
the body faults (``short``, ``flip``) touch only media bodies (a metadata reply
is GCS's HEAD), ``slowdown`` answers GCS's 503 JSON error, resumable-upload
``Location`` headers are pointed back at the proxy, and ``storage_options`` are
gcsfs options.

``api="azure"`` puts it in front of Azurite (``LocalAzure``; give it the server's origin,
``LocalAzure.endpoint_url``): object requests are ``/<account>/<container>/<blob>``
(container calls such as listings are not), ``slowdown`` answers Azure's 503
``ServerBusy``, and ``storage_options`` are a connection string for the development
account through the proxy.
"""

from __future__ import annotations

import html
import http.client
import logging
import random
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import unquote, urlsplit

from . import azureserver, gcsserver
from .s3server import options_for

log = logging.getLogger(__name__)

_HISTORY_LIMIT = 100_000
FAULT_KINDS = ("slowdown", "reset", "short", "flip", "stall", "rot")
_DEFAULT_KINDS = ("slowdown", "reset", "short", "flip")
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "expect",
}
_NOT_IMPLEMENTED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented</Message></Error>"
)
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>"
)
# What GCS answers when it sheds load (its JSON API error shape).
_GCS_503_BODY = (
    b'{"error": {"code": 503, "message": "Backend Error", "errors": '
    b'[{"message": "Backend Error", "domain": "global", "reason": "backendError"}]}}'
)
# What Azure Blob Storage answers when it sheds load.
_AZURE_503_BODY = (
    b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
    b"<Message>The server is busy.</Message></Error>"
)
APIS = ("s3", "gcs", "azure")
_SAS_PARAMS = frozenset({"sv", "ss", "srt", "sp", "se", "st", "spr", "sig", "sr", "si", "skoid", "sktid", "skt", "ske",
                         "sks", "skv", "sdd", "rscc", "rscd", "rsce", "rscl", "rsct"})


class FaultProxy:
    """A fault-injecting HTTP proxy for an S3-compatible ``upstream`` URL (or GCS, Azure).

    Use as a context manager and pass its ``storage_options``; the module docstring
    describes each fault kind.

    Args:
        upstream: The server's ``http://`` URL (``LocalS3.endpoint_url``).
        faults: Kinds to inject (``"slowdown"``, ``"reset"``, ``"short"``, ``"flip"``,
            ``"stall"``, ``"rot"``), as an iterable (equal weights) or a mapping kind to
            weight. Default None: slowdown, reset, short and flip.
        rate: The fraction of eligible requests that get a fault (default 0.2; may be
            changed while running).
        seed: Seed of the random choices (default 0): the same run faults the same requests.
        stall_seconds: How long a ``stall`` holds a reply back (default 2.0).
        max_repeats: How many times in a row the same request may be faulted (default 2),
            so that a client with enough retries gets through; set it high for an outage.
        methods: HTTP methods eligible for faults (default GET and HEAD).
        match: ``match(method, path) -> bool`` narrows the eligible requests further.
            Default None: every object request.
        host: The address to listen on (default ``"127.0.0.1"``).
        port: The port (default 0: a free one).
        api: The upstream's protocol, ``"s3"`` (default), ``"gcs"`` or ``"azure"``.
        unsupported: ``unsupported(method, path) -> bool`` picks requests answered ``501
            NotImplemented`` by the proxy itself (counted in ``refused``). Default None.

    Raises:
        ValueError: ``upstream`` is not an http URL, or ``api`` or a fault kind is unknown.
    """

    def __init__(
        self,
        upstream: str,
        faults: Iterable[str] | Mapping[str, float] | None = None,
        rate: float = 0.2,
        seed: int = 0,
        *,
        stall_seconds: float = 2.0,
        max_repeats: int = 2,
        methods: Iterable[str] = ("GET", "HEAD"),
        match: Callable[[str, str], bool] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api: str = "s3",
        unsupported: Callable[[str, str], bool] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy needs an http:// upstream, got {upstream!r}")
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; choose from {APIS}")
        self.api = api
        self.upstream_origin = f"http://{parts.netloc}"
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        weights = dict(faults) if isinstance(faults, Mapping) else {k: 1.0 for k in (faults or _DEFAULT_KINDS)}
        unknown = set(weights) - set(FAULT_KINDS)
        if unknown or not weights:
            raise ValueError(f"unknown or no fault kinds {sorted(unknown)}; choose from {FAULT_KINDS}")
        self.kinds = tuple(weights)
        self.weights = tuple(float(weights[k]) for k in self.kinds)
        self.rate = float(rate)
        self.stall_seconds = float(stall_seconds)
        self.max_repeats = int(max_repeats)
        self.methods = frozenset(m.upper() for m in methods)
        self.match = match
        self.unsupported = unsupported
        self.refused = 0
        self._stalled_now = 0
        self._host = host
        self._port = port
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FAULT_KINDS, 0)
        self._requests = 0
        self._streak: dict[tuple[str, str, str], int] = {}
        self._history: list[tuple[str, str, str | None]] = []
        self._deleted: list[str] = []
        self._sent: list[tuple[str, str, int, str | None]] = []
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "FaultProxy":
        """Start serving (idempotent); returns the proxy."""
        if self._server is not None:
            return self
        server = _Server((self._host, self._port), _Handler)
        server.proxy = self
        self._server = server
        self._stopping.clear()
        self._thread = threading.Thread(target=server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (stalled replies are released at once)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"FaultProxy(api={self.api!r}, rate={self.rate}, kinds={self.kinds}, counts={self.counts})"

    # ------------------------------------------------------------ reporting

    @property
    def endpoint_url(self) -> str:
        """The proxy's URL, ``http://127.0.0.1:PORT``; raises RuntimeError before ``start``."""
        if self._server is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://{self._host}:{self._server.server_address[1]}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Client options through this proxy: s3fs with the local test server's dummy
        credentials, gcsfs (anonymous) with ``api="gcs"``, Azurite's development account with ``api="azure"``."""
        if self.api == "gcs":
            return gcsserver.options_for(self.endpoint_url)
        if self.api == "azure":
            return azureserver.options_for(f"{self.endpoint_url}/{azureserver.ACCOUNT}")
        return options_for(self.endpoint_url)

    @property
    def counts(self) -> dict[str, int]:
        """Faults injected so far, by kind (a copy)."""
        with self._lock:
            return dict(self._counts)

    @property
    def injected(self) -> int:
        """Faults injected so far, all kinds together."""
        with self._lock:
            return sum(self._counts.values())

    @property
    def stalled_now(self) -> int:
        """Requests being held back by a stall at this moment."""
        with self._lock:
            return self._stalled_now

    def _stall(self) -> None:
        with self._lock:
            self._stalled_now += 1
        try:
            self._stopping.wait(self.stall_seconds)
        finally:
            with self._lock:
                self._stalled_now -= 1

    @property
    def history(self) -> list[tuple[str, str, str | None]]:
        """(method, path, fault or None) of each request, in order (the first 100 000)."""
        with self._lock:
            return list(self._history)

    @property
    def deleted(self) -> list[str]:
        """``bucket/key`` of each object the server was asked to delete, in order (the module docstring)."""
        with self._lock:
            return list(self._deleted)

    def _note_deletes(self, method: str, path: str, body: bytes | None) -> None:
        target, _, query = path.partition("?")
        keys: list[str] = []
        if method == "DELETE" and self._object_request(path):
            keys = [unquote(target.lstrip("/"))]
        elif method == "POST" and self.api == "s3" and "delete" in query.split("&") and body:
            bucket = target.strip("/")
            keys = [f"{bucket}/{html.unescape(k)}" for k in re.findall(r"<Key>(.*?)</Key>", body.decode("utf-8", "replace"))]
        if keys:
            with self._lock:
                self._deleted += keys

    def _note_sent(self, method: str, path: str, body: bytes | None, copy_source: str | None) -> None:
        with self._lock:
            self._sent.append((method, path.split("?", 1)[0], len(body or b""), copy_source))

    def sent(self, contains: str = "") -> list[tuple[str, str, int, str | None]]:
        """(method, path, request body bytes, ``x-amz-copy-source`` or None) of each request whose
        path contains ``contains``: what the client uploaded itself, and what it asked the server to copy."""
        with self._lock:
            return [s for s in self._sent if contains in s[1]]

    @property
    def requests(self) -> int:
        """Requests the proxy has seen (faulted or not)."""
        with self._lock:
            return self._requests

    # ------------------------------------------------------------ decisions

    def _eligible(self, method: str, path: str) -> bool:
        if method not in self.methods or not self._object_request(path):
            return False
        return self.match is None or bool(self.match(method, path))

    def _object_request(self, path: str) -> bool:
        segments = [s for s in path.split("?", 1)[0].split("/") if s]
        if self.api == "gcs":  # .../b/<bucket>/o/<object> (download, metadata) or an upload to /upload/.../o
            if segments[:1] == ["upload"]:
                return len(segments) >= 2 and segments[-1] == "o" and segments[-3] == "b"
            return any(segments[i] == "b" and segments[i + 2] == "o" for i in range(len(segments) - 3))
        if self.api == "azure":
            return len(segments) >= 3  # /account/container/blob
        return len(segments) >= 2  # /bucket/key

    def _has_body(self, method: str, path: str, status: int) -> bool:
        """Whether a reply carries object bytes (what ``short`` and ``flip`` may touch)."""
        if method == "HEAD" or status not in (200, 206):
            return False
        if self.api == "gcs":  # a media download; JSON metadata plays the part of S3's HEAD
            return "alt=media" in path.partition("?")[2].split("&")
        return True

    def _slowdown_reply(self) -> tuple[str, list[tuple[str, str]], bytes]:
        if self.api == "gcs":
            return "Service Unavailable", [("Content-Type", "application/json")], _GCS_503_BODY
        if self.api == "azure":
            return "Server Busy", [("Content-Type", "application/xml"), ("x-ms-error-code", "ServerBusy")], \
                _AZURE_503_BODY
        return "Slow Down", [("Content-Type", "application/xml")], _SLOWDOWN_BODY

    def _rewrite_reply_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """GCS resumable uploads continue at the ``Location`` they are given: keep them on the proxy."""
        if self.api != "gcs":
            return headers
        return [
            (k, self.endpoint_url + v[len(self.upstream_origin):])
            if k.lower() == "location" and v.startswith(self.upstream_origin + "/") else (k, v)
            for k, v in headers
        ]

    def _same_request(self, path: str) -> str:
        """What makes requests "the same" for ``max_repeats``: the path, less the parameters of an
        Azure SAS (a signed URL signs each request anew, so its query changes every time)."""
        if self.api != "azure" or "?" not in path:
            return path
        base, _, query = path.partition("?")
        kept = [p for p in query.split("&") if p.split("=", 1)[0] not in _SAS_PARAMS]
        return f"{base}?{'&'.join(kept)}" if kept else base

    def _decide(self, method: str, path: str, rng_range: str) -> tuple[str | None, tuple[str, str, str], random.Random]:
        key = (method, self._same_request(path), rng_range)
        with self._lock:
            self._requests += 1
            if not self._eligible(method, path) or self._streak.get(key, 0) >= self.max_repeats:
                self._streak.pop(key, None)
                return None, key, random.Random(self._rng.getrandbits(32))
            kind = None
            if self._rng.random() < self.rate:
                kind = self._rng.choices(self.kinds, self.weights)[0]
            return kind, key, random.Random(self._rng.getrandbits(32))

    def _record(self, key: tuple[str, str, str], applied: str | None) -> None:
        with self._lock:
            if len(self._history) < _HISTORY_LIMIT:
                self._history.append((key[0], key[1], applied))
            if applied is None:
                self._streak.pop(key, None)
            else:
                self._counts[applied] += 1
                self._streak[key] = self._streak.get(key, 0) + 1

    # ------------------------------------------------------------ forwarding

    def _forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None) -> tuple[
        int, str, list[tuple[str, str]], bytes
    ]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    # socketserver's listen backlog is 5; a client opens its whole pool at once (obstore: one
    # connection per concurrent GET, 32 by default), and a starved accept thread must not
    # turn that burst into dropped SYNs (a 1 s retransmit each).
    request_queue_size = 128
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("faultproxy: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("faultproxy: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _read_body(self) -> bytes | None:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else None

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        method = self.command
        if proxy.unsupported is not None and proxy.unsupported(method, self.path):
            with proxy._lock:
                proxy.refused += 1
            self._reply(501, "Not Implemented", [("Content-Type", "application/xml")], _NOT_IMPLEMENTED_BODY)
            return
        proxy._note_deletes(method, self.path, body)
        proxy._note_sent(method, self.path, body, self.headers.get("x-amz-copy-source"))
        kind, key, rng = proxy._decide(method, self.path, self.headers.get("Range") or "")
        if kind == "slowdown":
            proxy._record(key, kind)
            reason, slow_headers, slow_body = proxy._slowdown_reply()
            self._reply(503, reason, slow_headers, slow_body)
            return
        if kind == "stall":
            proxy._record(key, kind)  # counted as it starts: the client may give up before it ends
            proxy._stall()
            if proxy._stopping.is_set() or self._client_gone():
                # Nobody waits for the answer any more: a real server would not see the request.
                self.close_connection = True
                return
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        if body is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        try:
            status, reason, rheaders, data = proxy._forward(method, self.path, headers, body)
        except OSError as e:
            log.debug("faultproxy: upstream failed: %s", e)
            self._reply(502, "Bad Gateway", [], b"")
            proxy._record(key, None)
            return
        rheaders = [(k, v) for k, v in rheaders if k.lower() not in _HOP_BY_HOP | {"server", "date"}]
        rheaders = proxy._rewrite_reply_headers(rheaders)
        applied = None
        has_body = proxy._has_body(method, self.path, status)
        if kind == "reset":
            proxy._record(key, kind)
            self._reset(status, reason, rheaders, data if has_body else b"")
            return
        if kind == "short" and has_body and len(data) >= 2:
            data, rheaders = _shorten(data, rheaders, rng.randrange(1, len(data)))
            applied = kind
        elif kind == "flip" and has_body and data:
            buf = bytearray(data)
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            data, applied = bytes(buf), kind
        elif kind == "rot" and has_body and data:
            rotted = _rot(data, self.path.split("?", 1)[0], rheaders)
            data, applied = rotted, (kind if rotted is not data else None)
        if kind != "stall":
            proxy._record(key, applied)  # before replying: a client that gave up must not hide it
        self._reply(status, reason, rheaders, data, head=method == "HEAD")

    def _client_gone(self) -> bool:
        """True when the client closed its side of the connection (EOF or reset)."""
        try:
            self.connection.setblocking(False)
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            finally:
                self.connection.setblocking(True)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _reply(
        self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes, *, head: bool = False
    ) -> None:
        self.send_response(status, reason)
        has_length = False
        for k, v in headers:
            if k.lower() == "content-length":
                if head:
                    self.send_header(k, v)
                    has_length = True
                continue
            self.send_header(k, v)
        if not has_length:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head and data:
            self.wfile.write(data)
        self.wfile.flush()

    def _reset(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
        """Send the head and half the body, then abort the connection with a TCP RST."""
        try:
            if data:
                self.send_response(status, reason)
                for k, v in headers:
                    if k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass


def _rot(data: bytes, path: str, headers: list[tuple[str, str]]) -> bytes:
    """Flip the bit that one fixed position of the object holds (chosen from its path),
    when the body covers it: every read of those bytes sees the same wrong content."""
    start = 0
    for k, v in headers:
        if k.lower() == "content-range" and v.startswith("bytes "):
            start = int(v[6:].split("-", 1)[0])
    size = next((int(v.rsplit("/", 1)[1]) for k, v in headers
                 if k.lower() == "content-range" and v.rsplit("/", 1)[1].isdigit()), start + len(data))
    at = random.Random(path).randrange(max(1, size)) - start
    if not 0 <= at < len(data):
        return data
    buf = bytearray(data)
    buf[at] ^= 0x10
    return bytes(buf)


def _shorten(data: bytes, headers: list[tuple[str, str]], n: int) -> tuple[bytes, list[tuple[str, str]]]:
    """The first ``n`` bytes, with Content-Length and Content-Range telling the same story."""
    out = []
    for k, v in headers:
        low = k.lower()
        if low == "content-length":
            v = str(n)
        elif low == "content-range" and v.startswith("bytes ") and "-" in v:
            span, _, total = v[6:].partition("/")
            start = int(span.split("-", 1)[0])
            v = f"bytes {start}-{start + n - 1}/{total}"
        out.append((k, v))
    return data[:n], out
