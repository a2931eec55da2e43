"""The ``http.client`` range-read path (``STREAMCKPT_S3_BACKEND=http``): the same bytes,
request counts and error kinds as obstore, against the real moto server (through
FaultProxy, which keeps connections alive, where connection reuse matters), and SigV4
signatures a signature-checking moto accepts."""

from __future__ import annotations

import datetime
import json
import random
from typing import Any, Iterator

import pytest
import torch

import streamckpt as sc
from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.storage.httpget import AUTO_PICKS_HTTP, SigV4, canonical_query, http_target
from streamckpt.storage.obstore_backend import AUTO_PICKS_OBSTORE, BACKEND_ENV, NotConfigurable
from streamckpt.storage.reads import Landing

from signing_moto import signing_moto

from conftest import STALL_SECONDS, fault_test_policy, put_random, storage_on

pytest.importorskip("obstore")

KiB = 1 << 10
MiB = 1 << 20
NAME = "data/00000.bin"


@pytest.fixture
def stored(s3_uri: str, s3_opts: dict[str, Any]) -> tuple[str, bytes]:
    return s3_uri, put_random(s3_uri, s3_opts, NAME, 9 * MiB + 321, seed=5)


def _http(monkeypatch: pytest.MonkeyPatch, uri: str, opts: dict[str, Any], **kw: Any) -> Storage:
    st = storage_on(monkeypatch, "http", uri, opts, **kw)
    assert st.read_backend == "http"
    return st


def _gets(proxy: Any) -> int:
    return sum(1 for method, path, _ in proxy.history if method == "GET" and NAME in path)


def test_reads_are_byte_exact_and_one_get_per_piece(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options)
    st.piece_size = piece = 2 * MiB  # below the batch's spread: every long read is cut in pieces of this
    rng = random.Random(2)
    reads = [RangeRead(NAME, a, min(len(data), a + rng.choice([1, 3, 4 * KiB, 300 * KiB, MiB])))
             for a in (rng.randrange(len(data) - 1) for _ in range(40))]
    reads += [RangeRead(NAME, 0, len(data)), RangeRead(NAME, 7, 7 + 2 * piece + 5), RangeRead(NAME, 11, 11)]
    bufs = [bytearray(r.length) for r in reads]
    n = st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    for r, b in zip(reads, bufs):
        assert b == data[r.start:r.stop], (r.start, r.stop)
    # one GET per read, except: the whole object stays one GET (checked against its ETag),
    # the long read from byte 7 is three pieces, the empty read none
    assert n == _gets(proxy) == 40 + 1 + 3
    assert st.read_bytes(NAME) == data


@pytest.mark.parametrize("concurrency, gets", [(32, 3), (8, 3), (2, 1)])
def test_request_size_grows_with_the_batch_up_to_the_piece_size(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any, concurrency: int, gets: int
) -> None:
    """A batch is cut into requests that fill half of ``max_concurrency`` and are at least
    4 MiB (issue 28: fewer, larger requests cost less CPU on both ends) and at most the
    backend's piece size (16 MiB): 9 MiB over 16 or 4 slots is three 4 MiB-or-less GETs,
    over one slot one GET; the bytes are the same."""
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options, max_concurrency=concurrency)
    assert st.piece_size == 16 * MiB
    buf = bytearray(len(data) - 1)
    n = st.read_into([RangeRead(NAME, 1, len(data))], [memoryview(buf)]).result(timeout=120)
    assert bytes(buf) == data[1:]
    assert n == _gets(proxy) == gets


def test_a_large_jobs_spread_keeps_a_read_whole(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    """``spread`` (a load of thousands of ranks: ``loading.requestrate.job_spread``) cuts the
    batch into fewer requests: the same 9 MiB read that is three GETs at 32 slots is one GET
    with ``spread=1``, two with ``spread=2``; the bytes are the same."""
    from streamckpt.loading.requestrate import job_spread

    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options, max_concurrency=32)
    for spread, gets in ((job_spread(4096, 32), 1), (2, 2)):
        before = _gets(proxy)
        buf = bytearray(len(data) - 1)
        n = st.read_into([RangeRead(NAME, 1, len(data))], [memoryview(buf)], spread=spread).result(timeout=120)
        assert bytes(buf) == data[1:]
        assert n == _gets(proxy) - before == gets


def test_a_body_holding_client_keeps_four_requests_within_what_it_may_hold(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    """obstore holds each body before its copy: with no memory budget told it may hold
    16 MiB, so its requests are at most 4 MiB however few slots there are (the http path
    makes the same 9 MiB read one GET over 2 slots, above)."""
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = storage_on(monkeypatch, "obstore", uri, proxy.storage_options, max_concurrency=2)
    assert (st.read_backend, st.piece_size, st.inflight_bytes) == ("obstore", 16 * MiB, 16 * MiB)
    buf = bytearray(len(data) - 1)
    n = st.read_into([RangeRead(NAME, 1, len(data))], [memoryview(buf)]).result(timeout=120)
    assert bytes(buf) == data[1:]
    assert n == _gets(proxy) == 3


def test_heads_go_over_http_and_agree_with_obstore(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any, s3_opts: dict[str, Any]
) -> None:
    """Sizes and modification times come from one HEAD each on the http path (kept-alive
    connections), equal to what obstore reports; a missing key is CheckpointNotFoundError."""
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options)
    pool = st._reader.backend.pool
    assert st.size(NAME) == len(data)
    assert pool.idle == 1  # the HEAD went over http.client, and its connection was kept
    assert st.sizes([NAME, NAME]) == {NAME: len(data)}
    when = st.modified(NAME)
    assert st.modified("absent.bin") is None
    with pytest.raises(CheckpointNotFoundError, match="absent.bin"):
        st.size("absent.bin")
    heads = [(m, p) for m, p, _ in proxy.history if m == "HEAD"]
    assert len(heads) == 6 and len(proxy.history) == 6, proxy.history  # no LIST, no GET, no retry
    monkeypatch.setenv(BACKEND_ENV, "obstore")
    ref = Storage(uri, s3_opts)
    assert ref.read_backend == "obstore"
    assert when is not None and when == ref.modified(NAME) and ref.size(NAME) == len(data)


def test_bodies_split_over_buffers_land_in_place(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    """A read landing in several buffers (target memory with staging between): each piece's
    body is read into the parts it spans, checksums verified over them where they lie."""
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options)
    st.piece_size = 256 * KiB
    start, sizes = 1000, [5, 100 * KiB, 300 * KiB + 1, 1, 700 * KiB]
    parts = [bytearray(s) for s in sizes]
    total = sum(sizes)
    checks = tuple((o, min(64 * KiB, total - o), crc32c(data[start + o:start + min(o + 64 * KiB, total)]))
                   for o in range(0, total, 64 * KiB))
    n = st.read_into([RangeRead(NAME, start, start + total, checks)],
                     [Landing([memoryview(p) for p in parts])]).result(timeout=60)
    assert b"".join(parts) == data[start:start + total]
    assert n == _gets(proxy) == -(-total // (256 * KiB))


def test_connections_kept_only_after_a_success(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    """FaultProxy keeps connections alive: one connection serves one read after another; a
    failed response (404, a short body) leaves nothing in the pool."""
    uri, data = stored
    proxy = proxy_factory(faults=["short"], rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options, policy=RetryPolicy(max_attempts=2, base_delay=0.01))
    pool = st._reader.backend.pool
    for a in range(0, 20 * KiB, KiB):
        assert st.read_bytes(NAME, a, a + 100) == data[a:a + 100]
        assert pool.idle == 1
    with pytest.raises(CheckpointNotFoundError):
        st.read_bytes("missing.bin", 0, 10)
    assert pool.idle == 0
    assert st.read_bytes(NAME, 0, 10) == data[:10] and pool.idle == 1
    proxy.rate = 1.0  # every body short: each attempt's connection is dropped
    with pytest.raises(StorageError, match=r"2 attempt\(s\): response of \d+ bytes for a 1000-byte range"):
        st.read_bytes(NAME, 0, 1000)
    assert pool.idle == 0 and proxy.counts["short"] == 2


def test_loads_round_trip(monkeypatch: pytest.MonkeyPatch, s3_uri: str, s3_opts: dict[str, Any],
                          proxy_factory: Any) -> None:
    g = torch.Generator().manual_seed(3)
    full = {"w": torch.randn(1536, 1024, generator=g), "b": torch.randn(77, generator=g).to(torch.bfloat16),
            "i": torch.randint(-1000, 1000, (33, 5), generator=g)}
    sc.save(full, s3_uri, storage_options=s3_opts)
    proxy = proxy_factory(rate=0.0)
    monkeypatch.setenv(BACKEND_ENV, "http")
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    res = sc.load(out, s3_uri, storage_options=proxy.storage_options)
    for k in full:
        assert torch.equal(out[k], full[k]), k
    assert res.bytes_read == res.bytes_needed == sum(v.numel() * v.element_size() for v in full.values())
    data_gets = sum(1 for m, p, _ in proxy.history if m == "GET" and "/data/" in p)
    assert data_gets == res.requests
    rows = torch.zeros(500, 1024)
    cols = torch.zeros(1536, 300)
    sc.load({"w": sc.ShardedTensor(rows, (1536, 1024), (700, 0))}, s3_uri, storage_options=proxy.storage_options,
            strict=False)
    sc.load({"w": sc.ShardedTensor(cols, (1536, 1024), (0, 600))}, s3_uri, storage_options=proxy.storage_options,
            strict=False)
    assert torch.equal(rows, full["w"][700:1200]) and torch.equal(cols, full["w"][:, 600:900])


def test_error_kinds(monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], s3_opts: dict[str, Any],
                     proxy_factory: Any) -> None:
    uri, data = stored
    proxy = proxy_factory(rate=0.0)
    st = _http(monkeypatch, uri, proxy.storage_options, policy=RetryPolicy(max_attempts=2, base_delay=0.01))
    with pytest.raises(CheckpointNotFoundError, match="missing.bin does not exist"):
        st.read_bytes("missing.bin", 0, 10)
    with pytest.raises(CorruptCheckpointError, match=r"truncated: bytes \[%d, %d\)" % (len(data) - 5, len(data) + 5)):
        st.read_bytes(NAME, len(data) - 5, len(data) + 5)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        st.read_bytes(NAME, len(data) + 10, len(data) + 20)  # starts past the end: a 416
    bad = RangeRead(NAME, 0, 100, ((0, 100, crc32c(data[:100]) ^ 1),))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch .*\[0, 100\)"):
        st.read_into([bad], [memoryview(bytearray(100))]).result(timeout=60)
    assert st.read_bytes(NAME, 3, 9) == data[3:9]  # the connection after all those errors is a fresh one
    nobucket = _http(monkeypatch, "s3://no-such-bucket-here/x", proxy.storage_options)
    with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket-here' does not exist"):
        nobucket.read_bytes("a.bin", 0, 10)


@pytest.mark.parametrize("kind", ["slowdown", "short", "flip", "reset", "stall"])
def test_faults_never_give_wrong_bytes(
    kind: str, monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, data = stored
    proxy = proxy_factory(faults=[kind], rate=0.4, seed=7, stall_seconds=STALL_SECONDS)
    st = _http(monkeypatch, uri, proxy.storage_options, policy=fault_test_policy(kind))
    st.piece_size = 128 * KiB
    rng = random.Random(8)
    reads = []
    for _ in range(25):
        a = rng.randrange(len(data) - 1)
        b = min(len(data), a + rng.choice([1, 7, 4 * KiB, 100 * KiB, 700 * KiB]))
        checks = tuple((o, min(16 * KiB, b - a - o), crc32c(data[a + o:a + min(o + 16 * KiB, b - a)]))
                       for o in range(0, b - a, 16 * KiB))
        reads.append(RangeRead(NAME, a, b, checks))
    bufs = [bytearray(r.length) for r in reads]
    n = st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    assert all(b == data[r.start:r.stop] for r, b in zip(reads, bufs))
    assert st.read_bytes(NAME, 0, len(data)) == data  # no checks: the whole object vs its ETag
    assert proxy.counts[kind] > 0
    assert n > len(reads)  # the faulted pieces were fetched again


def test_persistent_slowdown_is_bounded_and_scrubbed(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    """503 SlowDown on every request: each of the policy's attempts is ``client_attempts``
    requests (the client's own status-level retries), then a StorageError without secrets."""
    uri, _ = stored
    proxy = proxy_factory(faults=["slowdown"], rate=1.0, max_repeats=10**9)
    policy = RetryPolicy(max_attempts=3, client_attempts=2, base_delay=0.02, total_timeout=20.0)
    st = _http(monkeypatch, uri, proxy.storage_options, policy=policy)
    with pytest.raises(StorageError, match=r"\[100, 200\) failed after 3 attempt\(s\): HTTP 503 SlowDown") as ei:
        st.read_bytes(NAME, 100, 200)
    assert NAME in str(ei.value) and proxy.storage_options["secret"] not in str(ei.value)
    assert proxy.counts["slowdown"] == 3 * 2


def test_persistent_stall_is_bounded(monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes],
                                     proxy_factory: Any) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["stall"], rate=1.0, max_repeats=10**9, stall_seconds=5.0)
    policy = RetryPolicy(max_attempts=2, request_timeout=0.3, base_delay=0.01, total_timeout=2.0)
    st = _http(monkeypatch, uri, proxy.storage_options, policy=policy)
    with pytest.raises(StorageError, match=r"failed after 2 attempt\(s\): no response for 0.3 s \(stalled\)"):
        st.read_bytes(NAME, 100, 200)
    assert proxy.counts["stall"] == 2


def test_signature_matches_botocore() -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    when = datetime.datetime(2026, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    for token in (None, "tok/en+=="):
        cfg = {"access_key_id": "AKID", "secret_access_key": "se/cr+et", "endpoint": "http://127.0.0.1:9000",
               "region": "eu-west-3", "virtual_hosted_style_request": False}
        if token:
            cfg["session_token"] = token
        target = http_target(cfg)
        path = target.path("bkt", "dir/a b+c~(1).safetensors")
        ours = SigV4(target).headers(path, now=when)
        req = AWSRequest(method="GET", url=f"http://127.0.0.1:9000{path}", headers={})
        auth = S3SigV4Auth(Credentials("AKID", "se/cr+et", token), "s3", "eu-west-3")
        req.context["timestamp"] = when.strftime("%Y%m%dT%H%M%SZ")
        auth._modify_request_before_signing(req)
        signature = auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)
        auth._inject_signature_to_request(req, signature)
        assert ours["authorization"] == req.headers["Authorization"]
        assert ours["x-amz-date"] == req.headers["X-Amz-Date"]
        assert ours.get("x-amz-security-token") == req.headers.get("X-Amz-Security-Token")
    anon = SigV4(http_target({"skip_signature": True, "region": "us-east-1"}))
    assert "authorization" not in anon.headers("/b/k")


def test_signature_with_a_query_matches_botocore() -> None:
    """A ListObjectsV2 page: names and values encoded the AWS way (``/`` too), sorted by name."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    when = datetime.datetime(2026, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    cfg = {"access_key_id": "AKID", "secret_access_key": "se/cr+et", "endpoint": "http://127.0.0.1:9000",
           "region": "eu-west-3", "virtual_hosted_style_request": False}
    target = http_target(cfg)
    params = {"list-type": "2", "prefix": "ck/a b+c%d~e(ü)&x=y;z*/", "delimiter": "/",
              "continuation-token": "1/ab+cd==", "max-keys": "7"}
    query = canonical_query(params)
    assert query == ("continuation-token=1%2Fab%2Bcd%3D%3D&delimiter=%2F&list-type=2&max-keys=7&"
                     "prefix=ck%2Fa%20b%2Bc%25d~e%28%C3%BC%29%26x%3Dy%3Bz%2A%2F")
    path = target.path("bkt", None)
    ours = SigV4(target).headers(path, now=when, query=query)
    req = AWSRequest(method="GET", url=f"http://127.0.0.1:9000{path}", params=params, headers={})
    auth = S3SigV4Auth(Credentials("AKID", "se/cr+et"), "s3", "eu-west-3")
    req.context["timestamp"] = when.strftime("%Y%m%dT%H%M%SZ")
    auth._modify_request_before_signing(req)
    assert auth.canonical_query_string(req) == query
    signature = auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)
    auth._inject_signature_to_request(req, signature)
    assert path == "/bkt" and ours["authorization"] == req.headers["Authorization"]


@pytest.fixture(scope="module")
def auth_s3() -> Iterator[tuple[str, dict[str, str]]]:
    """A moto server that checks signatures, holding ``signed/ck/obj.bin``."""
    with signing_moto({"ck/obj.bin": bytes(range(256)) * 64}) as server:
        yield server


def test_signed_requests_accepted_and_bad_credentials_permanent(
    monkeypatch: pytest.MonkeyPatch, auth_s3: tuple[str, dict[str, str]]
) -> None:
    _, opts = auth_s3
    body = bytes(range(256)) * 64
    policy = RetryPolicy(max_attempts=4, base_delay=0.01)
    st = _http(monkeypatch, "s3://signed/ck", opts, policy=policy)
    assert st.read_bytes("obj.bin", 5, 9000) == body[5:9000]
    for bad, code in (({**opts, "secret": "wrong"}, "SignatureDoesNotMatch"),
                      ({**opts, "key": "AKIANOSUCHKEY"}, "InvalidAccessKeyId")):
        st = _http(monkeypatch, "s3://signed/ck", bad, policy=policy)
        with pytest.raises(StorageError, match=f"failed after 1 attempt\\(s\\): HTTP 403 {code}") as ei:
            st.read_bytes("obj.bin", 5, 9000)
        assert "wrong" not in str(ei.value)


def test_signed_listings_and_whole_objects_accepted(
    monkeypatch: pytest.MonkeyPatch, auth_s3: tuple[str, dict[str, str]]
) -> None:
    """A signature-checking server accepts every page of a listing (prefixes and continuation
    tokens with special characters in the signed query) and whole-object GETs."""
    boto3 = pytest.importorskip("boto3")
    endpoint, opts = auth_s3
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=opts["key"],
                      aws_secret_access_key=opts["secret"], region_name="us-east-1")
    names = ["a b+c/1%.bin", "a b+c/ü é/2.bin", "a b+c/x=y&z;w.bin", "k~(1)*'!.bin", "q?r#s.json"]
    for n in names:
        s3.put_object(Bucket="signed", Key=f"lst/{n}", Body=n.encode())
    st = _http(monkeypatch, "s3://signed/lst", opts, policy=RetryPolicy(max_attempts=2, base_delay=0.01))
    st._reader.backend.list_page_keys = 2  # every continuation token goes through the signature
    assert st.list("", recursive=True) == sorted(names)
    assert st.list("") == ["a b+c", "k~(1)*'!.bin", "q?r#s.json"]
    assert st.list("a b+c") == ["a b+c/1%.bin", "a b+c/x=y&z;w.bin", "a b+c/ü é"]
    assert st.read_bytes("q?r#s.json") == b"q?r#s.json"
    assert st.read_bytes("a b+c/ü é/2.bin") == "a b+c/ü é/2.bin".encode()
    assert st.exists("a b+c/ü é") and not st.exists("a b")
    assert st._reader.backend._stores == {}
    bad = _http(monkeypatch, "s3://signed/lst", {**opts, "secret": "wrong"}, policy=RetryPolicy(max_attempts=2))
    with pytest.raises(StorageError, match=r"failed after 1 attempt\(s\): HTTP 403 SignatureDoesNotMatch"):
        bad.list("a b+c")
    with pytest.raises(StorageError, match=r"failed after 1 attempt\(s\): HTTP 403 SignatureDoesNotMatch"):
        bad.read_bytes("q?r#s.json")


def test_selection(monkeypatch: pytest.MonkeyPatch, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    monkeypatch.setenv(BACKEND_ENV, "auto")
    auto = "http" if AUTO_PICKS_HTTP else "obstore" if AUTO_PICKS_OBSTORE else "s3fs"
    assert Storage(s3_uri, s3_opts).read_backend == auto
    monkeypatch.setenv(BACKEND_ENV, "http")
    assert Storage(s3_uri, s3_opts).read_backend == "http"
    virtual = {**s3_opts, "config_kwargs": {"s3": {"addressing_style": "virtual"}}}
    assert Storage(s3_uri, virtual).read_backend == "obstore"  # obstore's reading of the endpoint stays
    assert Storage(s3_uri, {**s3_opts, "requester_pays": False}).read_backend == "s3fs"
    monkeypatch.setenv("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "true")
    assert Storage(s3_uri, s3_opts).read_backend == "obstore"


def test_target_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    t = http_target({"access_key_id": "k", "secret_access_key": "s", "region": "eu-west-3",
                     "endpoint": "https://minio.example:9443/prefix/"})
    assert (t.scheme, t.host, t.port, t.base_path, t.host_header) == ("https", "minio.example", 9443, "/prefix",
                                                                      "minio.example:9443")
    assert t.path("b", "a b/c") == "/prefix/b/a%20b/c"
    aws = http_target({"skip_signature": True, "region": "ap-south-1"})
    assert (aws.scheme, aws.host_header, aws.access_key) == ("https", "s3.ap-south-1.amazonaws.com", None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envk")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envs")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "envt")
    env = http_target({"region": "us-east-1"})
    assert (env.access_key, env.secret_key, env.token) == ("envk", "envs", "envt")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(NotConfigurable, match="secret"):
        http_target({"region": "us-east-1"})
