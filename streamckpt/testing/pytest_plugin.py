"""pytest fixtures for testing your own checkpointing code against local buckets.

With the ``test`` extra installed (``pip install 'streamckpt[test]'``) pytest loads this
plugin by itself (entry point ``pytest11: streamckpt``); without the entry point, add
``-p streamckpt.testing.pytest_plugin`` or ``pytest_plugins = ["streamckpt.testing.pytest_plugin"]``.
``-p no:streamckpt`` switches it off.

* ``local_s3_server`` / ``local_gcs_server`` / ``local_azure_server`` (session): a ``LocalS3``
  (moto), a ``LocalGCS`` (fake-gcs-server) and a ``LocalAzure`` (Azurite, installed with npm
  on first use; tests using it skip when node/npm are missing) on 127.0.0.1, started on first use.
* ``s3_bucket`` / ``gcs_bucket`` / ``azure_container``: a fresh, empty bucket (container) for
  this test, deleted after it — a ``LocalBucket`` with ``uri`` (``s3://…`` / ``gs://…`` /
  ``az://…``) and ``storage_options`` ready to pass to ``sc.save`` / ``sc.load`` (and any fsspec call).
* ``fault_proxy``: ``fault_proxy(bucket, faults=..., rate=..., seed=...)`` starts a
  ``FaultProxy`` in front of the bucket's server (stopped after the test); reach the
  bucket through it with ``proxy.storage_options``.

gcsfs must be imported with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` to talk to an
emulator (it probes each bucket over gRPC for 60 s otherwise): the plugin sets it when
pytest starts unless it is already set.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

from .azureserver import ACCOUNT as AZURE_ACCOUNT
from .azureserver import AzuriteUnavailable, LocalAzure
from .azureserver import options_for as azure_options_for
from .faultproxy import FaultProxy
from .gcsserver import HNS_ENV, LocalGCS
from .gcsserver import options_for as gcs_options_for
from .s3server import LocalS3
from .s3server import options_for as s3_options_for

log = logging.getLogger(__name__)

_SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}


@dataclass(frozen=True, slots=True)
class LocalBucket:
    """One bucket on a local test server: where it is and how to reach it."""

    name: str
    api: str  # "s3", "gcs" or "azure"
    endpoint_url: str  # the server's origin (what a FaultProxy forwards to)

    @property
    def uri(self) -> str:
        """``s3://<name>``, ``gs://<name>`` or ``az://<name>``."""
        return f"{_SCHEMES[self.api]}://{self.name}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What to pass as ``storage_options=`` (a fresh dict each time)."""
        if self.api == "gcs":
            return gcs_options_for(self.endpoint_url)
        if self.api == "azure":
            return azure_options_for(f"{self.endpoint_url}/{AZURE_ACCOUNT}")
        return s3_options_for(self.endpoint_url)

    def __str__(self) -> str:
        return self.uri


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module can import gcsfs: no gRPC bucket probes against emulators."""
    os.environ.setdefault(HNS_ENV, "false")


def bucket_name(test_name: str) -> str:
    """A valid, unique S3 and GCS bucket (and Azure container) name that says which test made it."""
    slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-").replace("goog", "g-og")[:40].strip("-")
    return f"sc-{uuid.uuid4().hex[:12]}-{slug or 'test'}"


def _fresh_bucket(
    request: pytest.FixtureRequest, server: LocalS3 | LocalGCS | LocalAzure, api: str
) -> Iterator[LocalBucket]:
    name = bucket_name(request.node.name)
    server.make_bucket(name)
    yield LocalBucket(name, api, server.endpoint_url)
    try:
        server.remove_bucket(name)
    except Exception as e:  # noqa: BLE001 - cleanup must not turn a test's outcome into an error
        log.warning("could not remove test bucket %s: %s", name, e)


@pytest.fixture(scope="session")
def local_s3_server() -> Iterator[LocalS3]:
    """moto's S3 server on 127.0.0.1 for the whole session."""
    with LocalS3() as server:
        yield server


@pytest.fixture(scope="session")
def local_gcs_server() -> Iterator[LocalGCS]:
    """fake-gcs-server on 127.0.0.1 for the whole session."""
    with LocalGCS() as server:
        yield server


@pytest.fixture(scope="session")
def local_azure_server() -> Iterator[LocalAzure]:
    """Azurite's blob service on 127.0.0.1 for the whole session (skips without node/npm)."""
    server = LocalAzure()
    try:
        server.start()
    except AzuriteUnavailable as e:
        pytest.skip(f"no local Azure blob server: {e}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(request: pytest.FixtureRequest, local_s3_server: LocalS3) -> Iterator[LocalBucket]:
    """A fresh, empty S3 bucket for this test (deleted afterwards)."""
    yield from _fresh_bucket(request, local_s3_server, "s3")


@pytest.fixture
def gcs_bucket(request: pytest.FixtureRequest, local_gcs_server: LocalGCS) -> Iterator[LocalBucket]:
    """A fresh, empty GCS bucket for this test (deleted afterwards)."""
    yield from _fresh_bucket(request, local_gcs_server, "gcs")


@pytest.fixture
def azure_container(request: pytest.FixtureRequest, local_azure_server: LocalAzure) -> Iterator[LocalBucket]:
    """A fresh, empty Azure blob container for this test (deleted afterwards)."""
    yield from _fresh_bucket(request, local_azure_server, "azure")


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """``fault_proxy(bucket, **FaultProxy_options)``: a started fault-injecting proxy in front
    of ``bucket``'s server; every proxy it made is stopped after the test."""
    started: list[FaultProxy] = []

    def make(bucket: LocalBucket, **kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(bucket.endpoint_url, api=bucket.api, **kwargs).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()
