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
    ("gaierror: [Errno -2] Name or service not known", "could not resolve the host name of http://h:1"),
    ("SSLError: [SSL: WRONG_VERSION_NUMBER] wrong version number", "http://h:1 does not speak TLS"),
    ("ValueError: the shard is odd", ""),
])
def test_hints_by_what_the_clients_say(text: str, expect: str) -> None:
    got = endpoint.hint(RuntimeError(text), "http://h:1")
    assert (expect in got.render()) if expect else got is None


def test_a_native_panic_is_recognized() -> None:
    panic = type("PanicException", (BaseException,), {})("request valid: InvalidUri")
    assert endpoint.is_panic(panic) and not endpoint.is_panic(KeyboardInterrupt())


def test_an_unknown_host_is_named_and_not_retried(backend: str) -> None:
    """A typo'd host (``.invalid`` never resolves) fails after 2 attempts, saying to check the host name."""
    url = "http://no-such-host.invalid:9000"
    with pytest.raises(sc.StorageError) as e:
        sc.load_full(f"s3://{BUCKET}/x", storage_options={"endpoint_url": url, "key": "k", "secret": "hush-hush"})
    msg = str(e.value)
    assert f"could not resolve the host name of {url}: check endpoint_url (its host name)" in msg, msg
    assert "after 2 attempt(s)" in msg and "hush-hush" not in msg


@pytest.mark.parametrize("backend", ["auto", "http", "s3fs"], indirect=True)
def test_https_to_a_plain_http_server_says_to_write_http(backend: str, s3_opts: dict[str, Any]) -> None:
    """moto speaks plain HTTP: an https:// endpoint fails the TLS handshake, and the message says why
    (not "nothing accepted a connection"). obstore words this failure without its cause: not covered."""
    https = s3_opts["endpoint_url"].replace("http://", "https://")
    with pytest.raises(sc.StorageError) as e:
        sc.load_full(f"s3://{BUCKET}/x", storage_options={**s3_opts, "endpoint_url": https})
    msg = str(e.value)
    plain = s3_opts["endpoint_url"]
    assert f"the server at {https} does not speak TLS: for a server without TLS write '{plain}' in endpoint_url" in msg
    assert "nothing accepted a connection" not in msg and "after 2 attempt(s)" in msg


def test_no_endpoint_and_no_dns_names_aws_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    got = endpoint.hint(OSError("gaierror: [Errno -2] Name or service not known"), None, uri="s3://b/run")
    assert got is not None and "with no endpoint_url (nor AWS_ENDPOINT_URL) this is AWS S3" in got.render()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    got = endpoint.hint(OSError("gaierror: [Errno -2] Name or service not known"), None, uri="s3://b/run")
    assert got is not None and "could not resolve the host name of http://minio.internal:9000" in got.render()
    gs = endpoint.hint(OSError("gaierror: [Errno -2] Name or service not known"), None, uri="gs://b/run")
    assert gs is not None and "AWS" not in gs.render()
