"""A load's metadata requests on the ``http.client`` path (``STREAMCKPT_S3_BACKEND=http``):
whole small objects and ListObjectsV2 listings give exactly what obstore gives for the same
moto bucket (keys with spaces, ``+``, ``%``, unicode; nested prefixes; many pages), and a
whole load of an HF or a native checkpoint builds no obstore client at all."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qsl

import pytest
import torch

import streamckpt as sc
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.formats import read_manifest
from streamckpt.storage import RetryPolicy, Storage
from streamckpt.testing import LocalS3

from conftest import BUCKET, put_random, storage_on

pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Nested prefixes and URL-special characters, as a checkpoint's tree might name them.
NAMES = [
    "a.bin", "a b.bin", "x+y=z.bin", "100%.bin", "%41.bin", "ü/ñ é.bin", "q?r#s&t.bin", "semi;colon,at@.bin",
    "tilde~(1)!*'.bin", "brackets[1]{2}^|`.bin", "back\\slash.bin", "amp&lt;.bin", "<tag>\".bin",
    "d/e.bin", "d/f/g.bin", "d/f/h i/j+k.bin", "d/f/h i/l%20m.bin", "dir-marker/", "dir-marker/in.bin",
    "d/f2/x.bin", "d2/y.bin", "d 3/z.bin", "deep/" + "/".join(f"l{i}" for i in range(8)) + "/leaf.bin",
] + [f"many/{i:03d} item+{i}.bin" for i in range(40)]


def _put_exact(local_s3: LocalS3, uri: str, names: list[str]) -> None:
    """Objects named exactly ``names`` under ``uri`` (boto3: no client's idea of a path in between)."""
    boto3 = pytest.importorskip("boto3")
    opts = local_s3.storage_options
    client = boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    bucket, _, root = uri.removeprefix("s3://").partition("/")
    for i, n in enumerate(names):
        client.put_object(Bucket=bucket, Key=f"{root}/{n}", Body=f"{i}:{n}".encode())


def _delete_exact(local_s3: LocalS3, uri: str, names: list[str]) -> None:
    """Remove keys ``_put_exact`` made (a key with an empty segment makes every recursive
    listing above it fail: other tests list the bucket's root)."""
    boto3 = pytest.importorskip("boto3")
    opts = local_s3.storage_options
    client = boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    bucket, _, root = uri.removeprefix("s3://").partition("/")
    for n in names:
        client.delete_object(Bucket=bucket, Key=f"{root}/{n}")


def _listing(st: Storage, path: str, recursive: bool) -> Any:
    """The backend's own answer for a full path (or the exception it raised)."""
    try:
        return asyncio.run(st._reader.backend.listing(path, recursive))
    except Exception as e:  # noqa: BLE001 - compared between backends
        return type(e).__name__


def test_listings_equal_obstore_page_by_page(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3, s3_uri: str,
                                             s3_opts: dict[str, Any], proxy_factory: Any,
                                             request: pytest.FixtureRequest) -> None:
    _put_exact(local_s3, s3_uri, NAMES)
    bad = ["ok.bin", "sl//ash.bin"]  # an empty segment: object_store refuses it
    request.addfinalizer(lambda: _delete_exact(local_s3, s3_uri + "-bad", bad))
    _put_exact(local_s3, s3_uri + "-bad", bad)
    ref = storage_on(monkeypatch, "obstore", s3_uri, s3_opts)
    proxy = proxy_factory(rate=0.0)
    st = storage_on(monkeypatch, "http", s3_uri, proxy.storage_options)
    st._reader.backend.list_page_keys = 7  # ListObjectsV2 max-keys: many pages from a few keys
    root = st.path("")
    prefixes = ["", "d", "d/", "d/f", "d/f/h i", "ü", "d 3", "many", "dir-marker", "deep/l0/l1", "a", "absent",
                "x+y=z.bin", "100%.bin"]
    for prefix in prefixes:
        for recursive in (True, False):
            path = f"{root}/{prefix}" if prefix else root
            ours, theirs = _listing(st, path, recursive), _listing(ref, path, recursive)
            assert ours == theirs, (prefix, recursive)
            assert st.list(prefix, recursive=recursive) == ref.list(prefix, recursive=recursive)
    every = _listing(st, root, True)
    assert sorted(every) == sorted(f"{root}/{n.rstrip('/')}" for n in NAMES)
    assert _listing(st, root, False)[:7] == [f"{root}/{d}" for d in ("d", "d 3", "d2", "deep", "dir-marker",
                                                                       "many", "ü")]
    assert _listing(st, root + "-bad", True) == _listing(ref, root + "-bad", True) == "Permanent"
    assert _listing(st, root + "-bad/sl//x", False) == _listing(ref, root + "-bad/sl//x", False) == "Permanent"
    assert st._reader.backend._stores == {}  # no obstore client was built for any of it
    # the recursive listing of the root was one GET per 7 keys, each signed with its continuation token
    lists = [p for m, p, _ in proxy.history if m == "GET" and "list-type=2" in p]
    assert lists and all(p.startswith(f"/{BUCKET}?") for p in lists)
    queries = [dict(parse_qsl(p.partition("?")[2], keep_blank_values=True)) for p in lists]
    of_root = [q for q in queries if "delimiter" not in q and q["prefix"] == root.partition("/")[2] + "/"]
    pages = -(-len(NAMES) // 7)
    assert len(of_root) == 3 * pages  # asked three times: two listing() calls and one list()
    assert sum("continuation-token" in q for q in of_root) == 3 * (pages - 1)


def test_exists_matches_obstore(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3, s3_uri: str,
                                s3_opts: dict[str, Any]) -> None:
    """An object, or a prefix with objects under it; a missing bucket raises."""
    _put_exact(local_s3, s3_uri, ["p q/r+s.bin", "t.bin"])
    ref = storage_on(monkeypatch, "obstore", s3_uri, s3_opts)
    st = storage_on(monkeypatch, "http", s3_uri, s3_opts)
    for name, want in (("t.bin", True), ("p q", True), ("p q/", True), ("p q/r+s.bin", True), ("p", False),
                       ("t", False), ("absent/x", False)):
        assert st.exists(name) is ref.exists(name) is want, name
    for backend in ("http", "obstore"):
        missing = storage_on(monkeypatch, backend, "s3://no-such-bucket-here/x", s3_opts)
        with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket-here' does not exist"):
            missing.exists("a.bin")
        with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket-here' does not exist"):
            missing.list("")
    assert st._reader.backend._stores == {}


def test_whole_objects_and_their_errors(monkeypatch: pytest.MonkeyPatch, s3_uri: str, s3_opts: dict[str, Any],
                                        proxy_factory: Any) -> None:
    data = put_random(s3_uri, s3_opts, "m/manifest.json", 300_001, seed=11)
    put_random(s3_uri, s3_opts, "empty.json", 0, seed=1)
    proxy = proxy_factory(rate=0.0)
    st = storage_on(monkeypatch, "http", s3_uri, proxy.storage_options)
    ref = storage_on(monkeypatch, "obstore", s3_uri, s3_opts)
    pool = st._reader.backend.pool
    assert st.read_bytes("m/manifest.json") == data and pool.idle == 1  # read to its end: the connection kept
    assert st.read_bytes("m/manifest.json", max_bytes=len(data)) == data
    assert st.read_bytes("empty.json") == b""
    errors = []
    for s in (st, ref):
        with pytest.raises(CorruptCheckpointError) as too_large:
            s.read_bytes("m/manifest.json", max_bytes=len(data) - 1)
        if s is st:
            assert pool.idle == 0  # the refused body was never read: its connection was closed, not kept
        with pytest.raises(CheckpointNotFoundError) as missing:
            s.read_bytes("manifest.json")
        errors.append((str(too_large.value), str(missing.value)))
    assert errors[0] == errors[1]  # the same messages as through obstore
    assert errors[0][0].endswith(f"is {len(data)} bytes, more than the {len(data) - 1}-byte limit")
    gets = [p for m, p, _ in proxy.history if m == "GET"]
    assert len(gets) == 5 and not any("?" in p for p in gets)  # one GET per read: no retry, no LIST
    nobucket = storage_on(monkeypatch, "http", "s3://no-such-bucket-here/x", proxy.storage_options)
    with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket-here' does not exist"):
        nobucket.read_bytes("manifest.json")
    assert st._reader.backend._stores == {} and nobucket._reader.backend._stores == {}


@pytest.mark.parametrize("kind", ["slowdown", "short", "flip", "reset"])
def test_whole_object_faults_are_retried_to_exact_bytes(kind: str, monkeypatch: pytest.MonkeyPatch, s3_uri: str,
                                                        s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    """Each fault once: the bytes come out exact (a flipped bit, or a body cut short with a
    Content-Length to match, fails the ETag's MD5); every time: a StorageError naming it."""
    data = put_random(s3_uri, s3_opts, "index.json", 70_000, seed=4)
    proxy = proxy_factory(faults=[kind], rate=1.0, max_repeats=1)
    st = storage_on(monkeypatch, "http", s3_uri, proxy.storage_options,
                    policy=RetryPolicy(max_attempts=3, base_delay=0.01))
    assert st.read_bytes("index.json") == data
    assert proxy.counts[kind] == 1
    proxy.max_repeats = 10**9
    what = {"slowdown": "HTTP 503 SlowDown", "short": "does not match its ETag", "flip": "does not match its ETag",
            "reset": "Connection reset"}[kind]
    with pytest.raises(StorageError, match=f"index.json failed after [34] attempt.*{what}"):
        st.read_bytes("index.json")


def _hf_checkpoint(uri: str, opts: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An HF checkpoint: two safetensors files and their index."""
    g = torch.Generator().manual_seed(9)
    full = {"embed.weight": torch.randn(300, 64, generator=g), "layer.0.w": torch.randn(64, 64, generator=g),
            "layer.1.w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "head.bias": torch.randint(-9, 9, (300,), generator=g)}
    st = Storage(uri, opts)
    files = {"model-00001-of-00002.safetensors": ["embed.weight", "layer.0.w"],
             "model-00002-of-00002.safetensors": ["layer.1.w", "head.bias"]}
    for name, keys in files.items():
        st.write_bytes(name, safetensors_torch.save({k: full[k] for k in keys}))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    st.write_bytes("model.safetensors.index.json", json.dumps(index).encode())
    return full


class _S3StoreCount:
    """obstore's S3Store, counted: every obstore client built in this process."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.buckets: list[str] = []

    def __call__(self, bucket: str, *args: Any, **kw: Any) -> Any:
        self.buckets.append(bucket)
        return self.real(bucket, *args, **kw)


@pytest.mark.parametrize("fmt", ["hf", "native"])
def test_a_load_builds_no_obstore_client(fmt: str, monkeypatch: pytest.MonkeyPatch, s3_uri: str,
                                         s3_opts: dict[str, Any]) -> None:
    if fmt == "hf":
        full = _hf_checkpoint(s3_uri, s3_opts)
    else:
        g = torch.Generator().manual_seed(2)
        full = {"w": torch.randn(257, 33, generator=g), "b": torch.randn(9, generator=g).to(torch.float16)}
        sc.save(full, s3_uri, storage_options=s3_opts)
    import obstore.store

    count = _S3StoreCount(obstore.store.S3Store)
    monkeypatch.setattr(obstore.store, "S3Store", count)  # a spy: every call reaches the real class
    for backend in ("http", "obstore"):
        monkeypatch.setenv("STREAMCKPT_S3_BACKEND", backend)
        out = {k: torch.zeros_like(v) for k, v in full.items()}
        sc.load(out, s3_uri, storage_options=s3_opts)
        for k in full:
            assert torch.equal(out[k], full[k]), (backend, k)
        if backend == "http":
            assert count.buckets == []  # manifest/index GETs, the LIST, HEADs, data: all over http.client
    assert count.buckets == [BUCKET]  # the spy sees obstore's client when it is used
    st = storage_on(monkeypatch, "http", s3_uri, s3_opts)
    manifest = read_manifest(st)  # the load's metadata path, on a Storage whose backend we can look into
    assert sorted(manifest.tensors) == sorted(full)
    assert st._reader.backend._stores == {} and st.clients_started == ("http",)


class _ChunkedS3:
    """A minimal S3 on 127.0.0.1 that answers as AWS does where moto does not: listings (and
    here one object) with ``Transfer-Encoding: chunked``, pages with and without the XML
    namespace, a continuation token with characters to encode."""

    PAGES = {
        None: ('<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>true</IsTruncated>'
               '<Contents><Key>r/a &amp; b.bin</Key></Contents><CommonPrefixes><Prefix>r/d/</Prefix></CommonPrefixes>'
               '<NextContinuationToken>t/1+=</NextContinuationToken></ListBucketResult>'),
        "t/1+=": ('<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>r/ü.bin</Key></Contents>'
                  '<CommonPrefixes><Prefix>r/e/</Prefix></CommonPrefixes></ListBucketResult>'),
    }

    def __init__(self) -> None:
        import http.server
        import threading

        outer = self
        self.queries: list[dict[str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - stdlib naming
                path, _, query = self.path.partition("?")
                if path == "/bkt":
                    q = dict(parse_qsl(query))
                    outer.queries.append(q)
                    body = outer.PAGES[q.get("continuation-token")].encode()
                else:
                    body = bytes(range(256)) * 12
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(body), 700):
                    part = body[i:i + 700]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.server.server_address[1]}", "key": "k", "secret": "s"}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_chunked_listings_and_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _ChunkedS3()
    try:
        st = storage_on(monkeypatch, "http", "s3://bkt/r", server.options)
        assert asyncio.run(st._reader.backend.listing("bkt/r", False)) == [
            "bkt/r/d", "bkt/r/e", "bkt/r/a & b.bin", "bkt/r/ü.bin"]
        assert server.queries == [{"list-type": "2", "prefix": "r/", "delimiter": "/"},
                                  {"list-type": "2", "prefix": "r/", "delimiter": "/", "continuation-token": "t/1+="}]
        pool = st._reader.backend.pool
        assert st.read_bytes("x.bin") == bytes(range(256)) * 12  # no Content-Length: read to its end
        assert pool.idle == 1  # a chunked body read to its end: its connection kept
        with pytest.raises(CorruptCheckpointError, match="more than the 1000-byte limit"):
            st.read_bytes("x.bin", max_bytes=1000)  # no Content-Length: refused after max_bytes + 1
        assert pool.idle == 0 and st._reader.backend._stores == {}
    finally:
        server.stop()
