"""A real Azure Blob Storage emulator on loopback for demos and tests: Azurite.

Azurite (Microsoft's emulator, a Node.js server from the npm registry) speaks the Blob
service's REST API over plain HTTP; obstore's ``AzureStore`` and adlfs reach it like the
real service through a connection string whose ``BlobEndpoint`` is
``http://127.0.0.1:PORT/devstoreaccount1`` and the documented development account.

It runs as a child process, in memory (``--inMemoryPersistence``), on a free port of
127.0.0.1, and is stopped by its own PID. The first use installs it with
``npm install azurite@VERSION`` into a cache folder (``~/.cache/streamckpt/azurite-VERSION``,
or ``$STREAMCKPT_AZURITE_DIR``; about a minute, once per machine); ``$STREAMCKPT_AZURITE``
names an ``azurite-blob`` executable to use instead. Without node and npm, ``start`` raises
``AzuriteUnavailable`` (the pytest fixtures skip with its message).
"""

from __future__ import annotations

import base64
import email.utils
import hmac
import logging
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .childserver import ChildServer, urlopen

log = logging.getLogger(__name__)

VERSION = "3.37.0"
BINARY_ENV = "STREAMCKPT_AZURITE"  # an azurite-blob executable to use instead of the cached install
DIR_ENV = "STREAMCKPT_AZURITE_DIR"  # where npm installs it (default: ~/.cache/streamckpt/azurite-VERSION)
ACCOUNT = "devstoreaccount1"
# Azurite's documented development key: public, the same on every machine, never a real secret.
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # noqa: S105
API_VERSION = "2023-11-03"
_INSTALL_TIMEOUT = 600.0


class AzuriteUnavailable(RuntimeError):
    """Azurite cannot be installed or run here (no node/npm, or npm failed)."""


def install_dir() -> Path:
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "streamckpt" / f"azurite-{VERSION}"


def find_binary(install: bool = True) -> str:
    """The ``azurite-blob`` executable: ``$STREAMCKPT_AZURITE``, the cached install (made with
    npm on first use when ``install``), or ``azurite-blob`` on ``PATH``."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise AzuriteUnavailable(f"{BINARY_ENV}={explicit!r} is not an executable file")
        return explicit
    cached = install_dir() / "node_modules" / ".bin" / "azurite-blob"
    if os.access(cached, os.X_OK):
        return str(cached)
    on_path = shutil.which("azurite-blob")
    if on_path:
        return on_path
    if not install:
        raise AzuriteUnavailable(f"azurite-blob is not installed under {install_dir()}")
    return _npm_install()


def _npm_install() -> str:
    """``npm install azurite@VERSION`` into ``install_dir()`` (atomically: a half-done install is never used)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        raise AzuriteUnavailable("Azurite needs node and npm on PATH (apt-get install nodejs npm), or set "
                                 f"{BINARY_ENV} to an azurite-blob executable")
    target = install_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    log.warning("installing Azurite %s with npm into %s (once per machine, about a minute)", VERSION, target)
    try:
        run = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(staging),
             f"azurite@{VERSION}"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT,
        )
        if run.returncode != 0:
            raise AzuriteUnavailable(f"npm install azurite@{VERSION} failed: {(run.stderr or run.stdout)[-1500:]}")
        try:
            staging.rename(target)
        except OSError:
            if not (target / "node_modules" / ".bin" / "azurite-blob").exists():  # another process won: use its
                raise
    except subprocess.TimeoutExpired:
        raise AzuriteUnavailable(f"npm install azurite@{VERSION} took more than {_INSTALL_TIMEOUT:g} s") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target / "node_modules" / ".bin" / "azurite-blob")


def connection_string(blob_endpoint: str) -> str:
    """A connection string for Azurite's development account at ``blob_endpoint``."""
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={blob_endpoint.rstrip('/')};")


def options_for(blob_endpoint: str) -> dict[str, Any]:
    """Storage options (obstore and adlfs alike) for Azurite's development account.

    Args:
        blob_endpoint: The account's blob endpoint, ``http://127.0.0.1:PORT/devstoreaccount1``.

    Returns:
        dict: ``{"connection_string": ...}``, for ``storage_options=``.
    """
    return {"connection_string": connection_string(blob_endpoint)}


class LocalAzure(ChildServer):
    """Azurite's Blob service on 127.0.0.1 (a child process); use as a context manager.

    ``storage_options`` is what to pass as ``storage_options=`` to streamckpt (and adlfs).
    Needs node and npm: Azurite is installed on first use.

    Args:
        host: The address to listen on (default ``"127.0.0.1"``).
        port: The port (default 0: a free one, in ``.port`` once started).

    Raises:
        AzuriteUnavailable: from ``start``, when Azurite cannot be found or installed.
        RuntimeError: from ``start``, when the server does not start.
    """

    name = "azurite"
    start_timeout = 30.0

    def _binary(self) -> str:
        return find_binary()  # installs Azurite on first use

    def _argv(self, binary: str, port: int) -> list[str]:
        return [binary, "--silent", "--disableTelemetry", "--inMemoryPersistence", "--blobHost", self.host,
                "--blobPort", str(port), "--skipApiVersionCheck", "--loose"]

    def _answers(self, port: int) -> bool:
        try:
            with urlopen(f"http://{self.host}:{port}/{ACCOUNT}?comp=list", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (an unsigned list is refused): up
        except OSError:
            return False

    def __repr__(self) -> str:
        return f"LocalAzure({self.blob_endpoint if self._proc is not None else 'stopped'})"

    # ------------------------------------------------------------ clients

    @property
    def endpoint_url(self) -> str:
        """The server's origin, ``http://127.0.0.1:PORT`` (what a FaultProxy forwards to)."""
        if self._proc is None:
            raise RuntimeError("LocalAzure is not started; use it as a context manager or call start()")
        return f"http://{self.host}:{self.port}"

    @property
    def blob_endpoint(self) -> str:
        """The development account's blob endpoint, ``http://127.0.0.1:PORT/devstoreaccount1``."""
        return f"{self.endpoint_url}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """The development account's connection string for this server."""
        return connection_string(self.blob_endpoint)

    @property
    def storage_options(self) -> dict[str, Any]:
        """Storage options for this server (a fresh dict each time)."""
        return options_for(self.blob_endpoint)

    def make_container(self, name: str) -> str:
        """Create container ``name`` if missing; returns ``az://name``."""
        try:
            self._request("PUT", f"/{urllib.parse.quote(name)}?restype=container")
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists already
                detail = e.read().decode(errors="replace").strip()[:500]
                raise RuntimeError(f"creating container {name!r} on {self.blob_endpoint} failed: {e}: {detail}") from None
        return f"az://{name}"

    make_bucket = make_container  # the pytest plugin's name for it

    def remove_container(self, name: str) -> None:
        """Delete container ``name`` and every blob in it (missing: nothing to do)."""
        try:
            self._request("DELETE", f"/{urllib.parse.quote(name)}?restype=container")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    remove_bucket = remove_container

    def _request(self, method: str, path_query: str) -> None:
        with urlopen(signed_request(method, self.blob_endpoint + path_query), timeout=30):
            pass


def signed_request(method: str, url: str, account: str = ACCOUNT, key: str = ACCOUNT_KEY) -> urllib.request.Request:
    """A body-less request signed with Azure's Shared Key scheme (container admin calls only)."""
    parts = urllib.parse.urlsplit(url)
    headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": API_VERSION}
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    resource = f"/{account}{parts.path}"
    for name, value in sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True)):
        resource += f"\n{name.lower()}:{value}"
    to_sign = f"{method}\n" + "\n" * 11 + canonical_headers + resource
    sig = base64.b64encode(hmac.digest(base64.b64decode(key), to_sign.encode(), "sha256")).decode()
    headers["Authorization"] = f"SharedKey {account}:{sig}"
    headers["Content-Length"] = "0"
    return urllib.request.Request(url, method=method, headers=headers)  # no data: urllib would add a Content-Type


def main() -> None:
    """Run a local Azure blob server in the foreground (``python -m streamckpt.testing.azureserver``)."""
    import argparse
    import threading

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--container", action="append", default=[])
    ap.add_argument("--install", action="store_true",
                    help="only install Azurite (npm, into the cache folder) if missing, and print where it is")
    args = ap.parse_args()
    if args.install:
        try:
            print(find_binary(), flush=True)
        except AzuriteUnavailable as e:
            print(f"Azurite not installed ({e}): the az:// tests will skip", flush=True)
        return
    with LocalAzure(port=args.port) as az:
        for c in args.container:
            az.make_container(c)
        print(f"connection_string={az.connection_string}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
