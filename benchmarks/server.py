"""The S3 server the benchmark reads from, with a request/byte counter.

Preferred: ``localbucket`` (PyPI) in its own process, serving a local folder as
buckets. Its handler is subclassed here for two things: object bodies go out with
``os.sendfile`` (zero-copy, so the server takes as little of this 2-core machine's
CPU as possible), and every request and body byte is counted, readable at
``GET /__bench__/stats`` (uploads: ``put_body_bytes``) and cleared by ``POST /__bench__/reset``. That gives
bytes read and request counts for every loader, peers included, from the
server's side. A total bandwidth cap (``--bandwidth-cap 200MB/s``, or at run time
``POST /__bench__/cap`` with ``{"bytes_per_s": N or null}``) paces GET and PUT bodies of
all connections together through one token bucket (benchmarks/throttle.py); with no
cap, bodies go out exactly as before. ``--latency 0.03`` holds each GET's response
30 ms, as a remote store's time to first byte (requests in flight wait side by side).

Fallback (``localbucket`` not installed, e.g. in the package's own venv): moto's
threaded server via ``streamckpt.testing``; it has no counters and slices the
whole object per ranged GET, so it is good for ``--quick`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .throttle import CHUNK, TokenBucket, format_rate, parse_rate

BUCKET = "bench"
KEY = "bench-key"
SECRET = "bench-secret"  # noqa: S105 - a dummy for a local server that checks nothing
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def have_localbucket() -> bool:
    from importlib.util import find_spec

    return find_spec("localbucket") is not None


@dataclass
class BenchServer:
    """A local S3 endpoint over ``root`` (bucket ``bench`` = ``root/bench``)."""

    root: Path
    kind: str = "auto"  # "localbucket" | "moto" | "auto"
    port: int = 0
    bandwidth_cap: float | None = None  # bytes/s for all connections together; None: no cap
    latency: float = 0.0  # seconds before each GET's response (S3's time to first byte is 10-50 ms)
    _proc: subprocess.Popen | None = None
    _moto: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}

    @property
    def counts(self) -> bool:
        return self.kind == "localbucket"

    def env(self) -> dict[str, str]:
        """Environment for children: every AWS client (boto, CRT, Rust) finds the server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> "BenchServer":
        if self.kind == "auto":
            self.kind = "localbucket" if have_localbucket() else "moto"
        if self.kind == "localbucket":
            self._start_localbucket()
        else:
            self._start_moto()
        os.environ.update(self.env())
        return self

    def _start_localbucket(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "benchmarks.server", "--root", str(self.root), "--port", str(self.port)]
        if self.bandwidth_cap:
            cmd += ["--bandwidth-cap", f"{self.bandwidth_cap:.0f}"]
        if self.latency:
            cmd += ["--latency", f"{self.latency:g}"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self._proc.poll() is not None:
                    raise RuntimeError("localbucket server exited at start")
                time.sleep(0.05)
        raise RuntimeError("localbucket server did not start in 30 s")

    def _start_moto(self) -> None:
        from streamckpt.testing import LocalS3

        self._moto = LocalS3().start()
        self.port = self._moto.port
        self.notes.append(
            "server: moto (localbucket not installed in this venv); moto reads the whole object "
            "per ranged GET, so throughput figures are not meaningful and server counters are n/a"
        )
        self._moto.make_bucket(BUCKET)
        self._upload_tree()

    def _upload_tree(self) -> None:
        """moto keeps objects in memory: copy the prepared bucket folder into it."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        src = self.root / BUCKET
        for path in sorted(src.rglob("*")):
            if path.is_file():
                rel = path.relative_to(src).as_posix()
                fs.put_file(str(path), f"{BUCKET}/{rel}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._moto is not None:
            self._moto.stop()
            self._moto = None

    def __enter__(self) -> "BenchServer":
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    # ------------------------------------------------------------- counters

    def reset(self) -> None:
        if self.counts:
            req = urllib.request.Request(f"{self.endpoint}/__bench__/reset", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10).read()

    def set_cap(self, bytes_per_s: float | None) -> bool:
        """Cap (or uncap, with None) the server's total body bandwidth now; False where it cannot (moto)."""
        if not self.counts:
            return False
        body = json.dumps({"bytes_per_s": bytes_per_s}).encode()
        req = urllib.request.Request(f"{self.endpoint}/__bench__/cap", method="POST", data=body)
        urllib.request.urlopen(req, timeout=10).read()
        self.bandwidth_cap = bytes_per_s
        return True

    def stats(self) -> dict[str, Any] | None:
        if not self.counts:
            return None
        with urllib.request.urlopen(f"{self.endpoint}/__bench__/stats", timeout=10) as r:
            return json.loads(r.read())

    def warm(self, names: list[str]) -> None:
        """One full GET per object: page cache warm and localbucket's ETag cache filled."""
        for name in names:
            url = f"{self.endpoint}/{BUCKET}/{name}"
            if self.kind == "moto":
                continue
            with urllib.request.urlopen(url, timeout=120) as r:
                while r.read(1 << 22):
                    pass


# ---------------------------------------------------------------- the server process


class _PacedReader:
    """A request body stream whose reads take tokens first (PUT bodies under the cap)."""

    def __init__(self, raw: Any, bucket: TokenBucket) -> None:
        self._raw = raw
        self._bucket = bucket

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            data = self._raw.read()
            self._bucket.take(len(data))
            return data
        parts = []
        while n > 0:
            step = min(n, CHUNK)
            self._bucket.take(step)
            got = self._raw.read(step)
            parts.append(got)
            if len(got) < step:
                break
            n -= step
        return b"".join(parts)

    def readline(self, *args: Any) -> bytes:  # chunk-size lines of a chunked body: tiny, charged after
        line = self._raw.readline(*args)
        self._bucket.take(len(line))
        return line


def _make_handler(bandwidth_cap: float | None = None, latency: float = 0.0):
    import localbucket

    # the cap in force: replaced whole by POST /__bench__/cap, read once per request
    pace: dict[str, TokenBucket | None] = {"bucket": TokenBucket(bandwidth_cap) if bandwidth_cap else None}
    lock = threading.Lock()
    stats: dict[str, Any] = {"requests": {}, "get_body_bytes": 0, "put_body_bytes": 0, "ranged_gets": 0,
                             "full_gets": 0}

    def reset() -> None:
        with lock:
            stats["requests"] = {}
            stats["get_body_bytes"] = 0
            stats["put_body_bytes"] = 0
            stats["ranged_gets"] = 0
            stats["full_gets"] = 0

    class Handler(localbucket.S3Handler):
        # TCP_NODELAY: localbucket writes the headers and a small body (LIST, a whole small
        # GET) as two segments; with Nagle on, the body waited for the client's delayed ACK
        # and every such request took 40 ms (real S3 has no such stall).
        disable_nagle_algorithm = True

        def _dispatch(self, action):  # noqa: ANN001 - localbucket's signature
            if self.path.startswith("/__bench__/"):
                return self._bench()
            with lock:
                stats["requests"][self.command] = stats["requests"].get(self.command, 0) + 1
            return super()._dispatch(action)

        def _bench(self) -> None:
            if self.path.startswith("/__bench__/reset"):
                reset()
                body = b"{}"
            elif self.path.startswith("/__bench__/cap"):
                length = int(self.headers.get("Content-Length") or 0)
                rate = json.loads(self.rfile.read(length) or b"{}").get("bytes_per_s")
                pace["bucket"] = TokenBucket(float(rate)) if rate else None
                body = json.dumps({"cap": format_rate(rate or None)}).encode()
            else:
                with lock:
                    body = json.dumps(stats).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes:
            bucket = pace["bucket"]
            if bucket is None or self.command != "PUT":
                body = super()._read_body()
            else:
                raw, self.rfile = self.rfile, _PacedReader(self.rfile, bucket)
                try:
                    body = super()._read_body()
                finally:
                    self.rfile = raw
            if self.command == "PUT":  # object and part bodies (POST bodies are multipart XML)
                with lock:
                    stats["put_body_bytes"] += len(body)
            return body

        def _send_file(self, status, file, start, length, headers, include_body):  # noqa: ANN001
            if latency:
                time.sleep(latency)  # a store's time to first byte (threads: requests wait side by side)
            self._send_headers(status, length, headers)
            if not include_body:
                return
            with lock:
                stats["get_body_bytes"] += length
                stats["ranged_gets" if status == 206 else "full_gets"] += 1
            self._sendfile(file, start, length, pace["bucket"])

        def _sendfile(self, file, start: int, length: int, bucket: TokenBucket | None) -> None:  # noqa: ANN001
            """Zero-copy ``sendfile``; under a cap, in CHUNK pieces, each after taking its
            tokens from the shared bucket (uncapped: one piece, no bucket)."""
            out = self.connection.fileno()
            step = length if bucket is None else CHUNK
            sent = 0
            while sent < length:
                stop = min(length, sent + step)
                if bucket is not None:
                    bucket.take(stop - sent)
                while sent < stop:
                    n = os.sendfile(out, file.fileno(), start + sent, stop - sent)
                    if n == 0:
                        self.close_connection = True
                        return
                    sent += n

    return Handler


def serve(root: Path, port: int, bandwidth_cap: float | None = None, latency: float = 0.0,
          host: str = "127.0.0.1") -> None:
    from http.server import ThreadingHTTPServer

    root = root.resolve()
    (root / BUCKET).mkdir(parents=True, exist_ok=True)
    Handler = _make_handler(bandwidth_cap, latency)
    Handler.data_root = root
    class Server(ThreadingHTTPServer):
        # socketserver's default listen backlog is 5: a burst of 32 concurrent connects
        # overflows it, dropped SYNs are retransmitted after ~1 s, and whichever loader
        # opens many connections at once pays a random extra second.
        request_queue_size = 1024

    server = Server((host, port), Handler)
    server.daemon_threads = True
    try:
        server.serve_forever()
    finally:
        server.server_close()


def main() -> None:
    ap = argparse.ArgumentParser(description="localbucket with counters and sendfile")
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (benchmarks/netns.py: the store namespace's); default 127.0.0.1")
    ap.add_argument("--bandwidth-cap", default="off",
                    help="total body bandwidth of all connections: 200MB/s, 100MiB/s, 200000000 (B/s); default off")
    ap.add_argument("--latency", type=float, default=0.0,
                    help="seconds each GET waits before its response (a store's time to first byte); default 0")
    args = ap.parse_args()
    serve(args.root, args.port, parse_rate(args.bandwidth_cap), args.latency, args.host)


if __name__ == "__main__":
    main()
