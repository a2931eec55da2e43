"""The mistakes users make reaching a store, on every client: each a CheckpointError that
names the endpoint or URI and says what to check (storage/endpoint.py).

Against the session's moto server, fake-gcs-server and a closed loopback port; the S3
client is chosen per test with STREAMCKPT_S3_BACKEND, as users choose it.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import torch

import streamckpt as sc
from conftest import BUCKET
from streamckpt.storage import endpoint
from streamckpt.storage.obstore_backend import BACKEND_ENV

S3_BACKENDS = ("auto", "http", "obstore", "s3fs")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(params=S3_BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(BACKEND_ENV, request.param)
    return request.param


@pytest.mark.parametrize("call", ["save", "load", "latest"])
def test_nothing_listening_fails_fast_and_names_the_endpoint(backend: str, call: str) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    opts = {"endpoint_url": url, "key": "testing", "secret": "hush-hush-secret"}
    t0 = time.monotonic()
    with pytest.raises(sc.StorageError) as e:
        if call == "save":
            sc.save({"a": torch.ones(1)}, f"s3://{BUCKET}/x", storage_options=opts)
        elif call == "load":
            sc.load({"a": torch.ones(1)}, f"s3://{BUCKET}/x", storage_options=opts)
        else:
            sc.latest(f"s3://{BUCKET}", storage_options=opts)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"nothing accepted a connection at {url}" in msg and "check endpoint_url" in msg
    assert "after 2 attempt(s)" in msg  # not the 8 a slow store gets
    assert "hush-hush-secret" not in msg
    assert took < 20, took  # a hang bound for a busy machine; measured 0.3-4.7 s


def test_an_endpoint_without_a_scheme_is_http_on_loopback(backend: str, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    bare = s3_opts["endpoint_url"].removeprefix("http://")
    opts = {**s3_opts, "endpoint_url": bare}
    sc.save({"a": torch.arange(4)}, s3_uri, storage_options=opts)
    assert torch.equal(sc.load_full(s3_uri, storage_options=opts)["a"], torch.arange(4))


def test_an_endpoint_without_a_scheme_elsewhere_is_refused_by_name(backend: str) -> None:
    with pytest.raises(sc.StorageError) as e:
        sc.load_full(f"s3://{BUCKET}/x", storage_options={"endpoint_url": "minio.example.com:9000"})
    assert "'minio.example.com:9000' has no scheme" in str(e.value) and "https://minio.example.com:9000" in str(e.value)


def test_no_credentials_names_what_supplies_them(backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                  s3_opts: dict[str, Any]) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(sc.StorageError) as e:
        sc.load_full(f"s3://{BUCKET}/x", storage_options={"endpoint_url": s3_opts["endpoint_url"]})
    msg = str(e.value)
    assert "no credentials found" in msg and "AWS_ACCESS_KEY_ID" in msg and "anon=True" in msg
    assert f"s3://{BUCKET}/x/manifest.json" in msg


def test_a_save_to_a_missing_bucket_names_the_uri(backend: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.save({"a": torch.ones(3)}, "s3://no-such-bucket-here/run/step-1", storage_options=s3_opts)
    msg = str(e.value)
    assert "bucket 'no-such-bucket-here' does not exist" in msg and "s3://no-such-bucket-here/run/step-1/" in msg


def test_gcs_save_to_a_missing_bucket_names_the_uri(gcs_opts: dict[str, Any]) -> None:
    with pytest.raises(sc.CheckpointNotFoundError) as e:
        sc.save({"a": torch.ones(3)}, "gs://no-such-bucket-here/run", storage_options=gcs_opts)
    assert "no-such-bucket-here" in str(e.value) and "gs://no-such-bucket-here/run" in str(e.value)


@pytest.mark.parametrize("text, expect", [
    ("PermissionDeniedError: AccessDenied: Access Denied (status: 403)", "access denied"),
    ("ClientError: An error occurred (InvalidAccessKeyId) when calling GetObject", "access denied"),
    ("NoCredentialsError: Unable to locate credentials", "no credentials found"),
    ("OSError: [Errno 111] Connection refused", "nothing accepted a connection at http://h:1"),
    ("ValueError: the shard is odd", ""),
])
def test_hints_by_what_the_clients_say(text: str, expect: str) -> None:
    got = endpoint.hint(RuntimeError(text), "http://h:1")
    assert (expect in got.render()) if expect else got is None


def test_a_native_panic_is_recognized() -> None:
    panic = type("PanicException", (BaseException,), {})("request valid: InvalidUri")
    assert endpoint.is_panic(panic) and not endpoint.is_panic(KeyboardInterrupt())
