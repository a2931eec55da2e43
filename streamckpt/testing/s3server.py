"""A real S3 server on loopback for demos, tests and benchmarks.

moto's ``ThreadedMotoServer`` runs in a thread of this process and speaks HTTP on
127.0.0.1 with a free port; clients (s3fs, boto, curl) reach it like any S3
endpoint, so the whole client stack (signing, ranged GETs, multipart uploads,
retries) is exercised for real. moto slices the whole object on each ranged GET,
so keep objects modest (a few MiB) when request counts matter.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

log = logging.getLogger(__name__)

# moto accepts any credentials; these are placeholders, never real secrets.
TEST_KEY = "streamckpt-test-key"
TEST_SECRET = "streamckpt-test-secret"  # noqa: S105 - a dummy for a local fake server


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _check_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming the port when it cannot be bound. Why: moto's server thread
    exits on a bind failure while ``ThreadedMotoServer.start`` waits for it forever."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror}): if it is a local S3 server "
                                   f"started earlier, use it or stop it; or pass another port (0: a free one) "
                                   f"and write that one in endpoint_url") from None


def _quiet_werkzeug() -> None:
    """werkzeug logs every request at INFO unless its logger is configured."""
    wlog = logging.getLogger("werkzeug")
    if wlog.level == logging.NOTSET:
        wlog.setLevel(logging.WARNING)


def _default_region() -> None:
    """s3fs needs a region to create buckets on moto; a region in
    ``client_kwargs`` makes ``mkdir`` fail there, so the environment carries it."""
    if not os.environ.get("AWS_DEFAULT_REGION") and not os.environ.get("AWS_REGION"):
        os.environ["AWS_DEFAULT_REGION"] = "us-east-1"


class LocalS3:
    """moto's S3 server on 127.0.0.1, in this process; use as a context manager.

    ``storage_options`` is what to pass as ``storage_options=`` to streamckpt
    (and fsspec/s3fs) to reach it.

    Args:
        host: The address to listen on (default ``"127.0.0.1"``).
        port: The port (default 0: a free one, in ``.port`` once started).

    Example:
        >>> import torch, streamckpt as sc
        >>> from streamckpt.testing import LocalS3
        >>> with LocalS3() as s3:
        ...     uri = s3.make_bucket("demo") + "/step-1"
        ...     _ = sc.save({"w": torch.ones(2)}, uri, storage_options=s3.storage_options)
        ...     sc.inspect(uri, storage_options=s3.storage_options).kind
        'streamckpt'
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self.port = 0
        self._server: Any = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "LocalS3":
        """Start the server (idempotent) and wait until it accepts connections."""
        if self._server is not None:
            return self
        from moto.server import ThreadedMotoServer  # optional test dependency

        _default_region()
        _quiet_werkzeug()
        if self._requested_port:
            _check_free(self.host, self._requested_port)
        server = ThreadedMotoServer(ip_address=self.host, port=self._requested_port, verbose=False)
        server.start()
        self._server = server
        self.port = int(server.get_host_and_port()[1])
        log.debug("local S3 server at %s", self.endpoint_url)
        return self

    def stop(self) -> None:
        """Stop the server; its buckets are kept by moto in this process."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self.endpoint_url if self._server is not None else "stopped"
        return f"LocalS3({state})"

    # ------------------------------------------------------------ clients

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``; raises RuntimeError before ``start``."""
        if self._server is None:
            raise RuntimeError("LocalS3 is not started; use it as a context manager or call start()")
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server (a fresh dict each time)."""
        return options_for(self.endpoint_url)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` if missing; returns ``s3://name``."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"

    def remove_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and every object in it (missing: nothing to do)."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        if fs.exists(name):
            if fs.find(name):
                fs.rm(name, recursive=True)  # s3fs removes the bucket with its objects
            if fs.exists(name):
                fs.rmdir(name)


def options_for(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for an S3-compatible endpoint with the dummy test credentials.

    Args:
        endpoint_url: The server's URL, e.g. ``LocalS3.endpoint_url``.

    Returns:
        dict: ``{"endpoint_url": ..., "key": ..., "secret": ...}``, for ``storage_options=``.
    """
    return {"endpoint_url": endpoint_url, "key": TEST_KEY, "secret": TEST_SECRET}


def main() -> None:
    """Run a local S3 server in the foreground (``python -m streamckpt.testing.s3server``)."""
    import argparse
    import threading

    ap = argparse.ArgumentParser(prog="python -m streamckpt.testing.s3server", description=main.__doc__)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one, printed)")
    ap.add_argument("--bucket", action="append", default=[], metavar="NAME",
                    help="a bucket to create; repeat it for more (--bucket a --bucket b)")
    args = ap.parse_args()
    try:
        s3 = LocalS3(host=args.host, port=args.port).start()
    except OSError as e:
        ap.exit(2, f"{ap.prog}: error: {e.strerror}\n")
    with s3:
        for b in args.bucket:
            s3.make_bucket(b)
        print(f"endpoint_url={s3.endpoint_url} key={TEST_KEY} secret={TEST_SECRET}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
