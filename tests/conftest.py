"""Shared fixtures: a real S3 server (moto) and a real GCS emulator (fake-gcs-server) on
127.0.0.1, reached over HTTP by s3fs / obstore and gcsfs."""

from __future__ import annotations

import random
import re
import uuid
from typing import Any, Iterator

import pytest
from hypothesis import settings

from streamckpt.testing import FaultProxy, LocalGCS, LocalS3

BUCKET = "streamckpt-test"

# No hypothesis per-example deadline anywhere (its default is 200 ms): tests assert counts
# and values, not speed; a hang is caught by pytest-timeout. Loaded before any test module
# builds its own settings, which inherit it.
settings.register_profile("streamckpt", deadline=None)
settings.load_profile("streamckpt")


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    """One moto S3 server for the whole session, with bucket ``streamckpt-test``."""
    with LocalS3() as s3:
        s3.make_bucket(BUCKET)
        yield s3


@pytest.fixture
def s3_opts(local_s3: LocalS3) -> dict[str, Any]:
    """storage_options for the session's S3 server (a fresh dict per test)."""
    return local_s3.storage_options


def _slug(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")[:60]


@pytest.fixture
def s3_uri(request: pytest.FixtureRequest, local_s3: LocalS3) -> str:
    """A fresh, unique prefix in the test bucket: ``s3://streamckpt-test/<test>-<uuid>``."""
    return f"s3://{BUCKET}/{_slug(request)}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def local_gcs() -> Iterator[LocalGCS]:
    """One fake-gcs-server for the whole session, with bucket ``streamckpt-test``."""
    with LocalGCS() as gcs:
        gcs.make_bucket(BUCKET)
        yield gcs


@pytest.fixture
def gcs_opts(local_gcs: LocalGCS) -> dict[str, Any]:
    """storage_options (gcsfs) for the session's GCS server (a fresh dict per test)."""
    return local_gcs.storage_options


@pytest.fixture
def gcs_uri(request: pytest.FixtureRequest, local_gcs: LocalGCS) -> str:
    """A fresh, unique prefix in the test bucket: ``gs://streamckpt-test/<test>-<uuid>``."""
    return f"gs://{BUCKET}/{_slug(request)}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tmp_uri(tmp_path: Any) -> str:
    """A fresh local directory path (not yet created) for a checkpoint."""
    return str(tmp_path / "ckpt")


@pytest.fixture
def proxy_factory(local_s3: LocalS3) -> Iterator[Any]:
    """FaultProxy instances in front of the session's S3 server, stopped after the test."""
    started: list[FaultProxy] = []

    def make(**kw: Any) -> FaultProxy:
        p = FaultProxy(local_s3.endpoint_url, **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def put_random(uri: str, opts: dict[str, Any], name: str, size: int, seed: int) -> bytes:
    """Store ``size`` seeded random bytes as ``name`` under ``uri``; returns them."""
    from streamckpt.storage import Storage

    data = random.Random(seed).randbytes(size)
    Storage(uri, opts).write_bytes(name, data)
    return data


def storage_on(monkeypatch: pytest.MonkeyPatch, backend: str, uri: str, opts: dict[str, Any] | None,
               **kw: Any) -> Any:
    """A Storage whose reads go through ``backend`` (``STREAMCKPT_S3_BACKEND``)."""
    from streamckpt.storage import Storage
    from streamckpt.storage.obstore_backend import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, backend)
    return Storage(uri, opts, **kw)


# A fault test's stall must outlast the request timeout, and that timeout must outlast a
# busy 2-core machine's slow replies (moto and the proxy share this process): 0.4 s did not,
# at load average 3 every request of a round timed out and the retries piled on.
STALL_TIMEOUT = 1.0
STALL_SECONDS = 3.0


def fault_test_policy(kind: str) -> Any:
    """The retry policy for a run under one fault ``kind``: a short request timeout only for
    ``stall`` (so stalls are given up on); every other kind keeps a patient one."""
    from streamckpt.storage import RetryPolicy

    return RetryPolicy(request_timeout=STALL_TIMEOUT if kind == "stall" else 30.0, base_delay=0.01)
