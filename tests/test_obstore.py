"""The obstore range-read backend: the same bytes, request counts and error classes as
the s3fs one, against the real moto server (and FaultProxy in front of it)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.storage.httpget import AUTO_PICKS_HTTP
from streamckpt.storage.obstore_backend import AUTO_PICKS_OBSTORE, BACKEND_ENV, NotConfigurable, ObstoreBackend, s3_config
from conftest import STALL_SECONDS, fault_test_policy, put_random, storage_on
from streamckpt.testing import FaultProxy, LocalS3

pytest.importorskip("obstore")

KiB = 1 << 10
MiB = 1 << 20
NAME = "data/00000.bin"


@pytest.fixture
def stored(s3_uri: str, s3_opts: dict[str, Any]) -> tuple[str, bytes]:
    return s3_uri, put_random(s3_uri, s3_opts, NAME, 3 * MiB + 123, seed=21)


_storage = storage_on


def _ranges(n: int, size: int, seed: int) -> list[RangeRead]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(0, size - 1)
        out.append(RangeRead(NAME, a, min(size, a + rng.choice([1, 7, 4 * KiB, 100 * KiB, 700 * KiB]))))
    return out


def _read(st: Storage, reads: list[RangeRead]) -> tuple[list[bytes], int]:
    bufs = [bytearray(r.length) for r in reads]
    n = st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    return [bytes(b) for b in bufs], n


def test_both_backends_read_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], s3_opts: dict[str, Any]
) -> None:
    uri, data = stored
    reads = _ranges(60, len(data), seed=1) + [RangeRead(NAME, 0, len(data)), RangeRead(NAME, 5, 5)]
    fast = _storage(monkeypatch, "obstore", uri, s3_opts)
    slow = _storage(monkeypatch, "s3fs", uri, s3_opts)
    assert (fast.read_backend, slow.read_backend) == ("obstore", "s3fs")
    got_fast, n_fast = _read(fast, reads)
    got_slow, n_slow = _read(slow, reads)
    for r, a, b in zip(reads, got_fast, got_slow):
        assert a == b == data[r.start:r.stop], (r.start, r.stop)
    assert n_fast == n_slow == len(reads) - 1  # one GET per non-empty read (pieces are 4 MiB)
    assert fast.read_bytes(NAME, 10, 20) == data[10:20]
    assert fast.read_bytes(NAME) == data


def test_large_reads_split_into_pieces_landing_in_place(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], s3_opts: dict[str, Any]
) -> None:
    uri, data = stored
    st = _storage(monkeypatch, "obstore", uri, s3_opts, max_concurrency=3)
    st.piece_size = 256 * KiB
    reads = [RangeRead(NAME, 1000, 1000 + MiB + 5), RangeRead(NAME, 0, 256 * KiB), RangeRead(NAME, 77, 78)]
    checks = tuple((off, min(64 * KiB, MiB + 5 - off), crc32c(data[1000 + off:1000 + min(off + 64 * KiB, MiB + 5)]))
                   for off in range(0, MiB + 5, 64 * KiB))
    reads[0] = RangeRead(NAME, 1000, 1000 + MiB + 5, checks)
    got, n = _read(st, reads)
    assert [g == data[r.start:r.stop] for r, g in zip(reads, got)] == [True, True, True]
    assert n == 5 + 1 + 1  # ceil((1 MiB + 5) / 256 KiB) pieces, then one each
    st.inflight_bytes = 300 * KiB  # one piece at a time: same bytes, same requests
    got, n = _read(st, reads)
    assert [g == data[r.start:r.stop] for r, g in zip(reads, got)] == [True, True, True] and n == 7


def test_error_classes_match_s3fs(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], s3_opts: dict[str, Any]
) -> None:
    uri, data = stored
    for backend in ("obstore", "s3fs"):
        st = _storage(monkeypatch, backend, uri, s3_opts, policy=RetryPolicy(max_attempts=2, base_delay=0.01))
        with pytest.raises(CheckpointNotFoundError, match="missing.bin"):
            st.read_bytes("missing.bin", 0, 10)
        with pytest.raises(CorruptCheckpointError, match=r"truncated: bytes \[%d, %d\)" % (len(data) - 5, len(data) + 5)):
            st.read_bytes(NAME, len(data) - 5, len(data) + 5)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            st.read_bytes(NAME, len(data) + 10, len(data) + 20)  # starts past the end: a 416
        bad = RangeRead(NAME, 0, 100, ((0, 100, crc32c(data[:100]) ^ 1),))
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch .*\[0, 100\)"):
            _read(st, [bad])


def test_persistent_outage_bounded_and_scrubbed(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], local_s3: LocalS3
) -> None:
    uri, _ = stored
    with FaultProxy(local_s3.endpoint_url, faults=["slowdown"], rate=1.0, max_repeats=10**9) as proxy:
        policy = RetryPolicy(max_attempts=3, client_attempts=2, base_delay=0.02, total_timeout=3.0)
        st = _storage(monkeypatch, "obstore", uri, proxy.storage_options, policy=policy)
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            st.read_bytes(NAME, 100, 200)
        assert time.monotonic() - t0 < policy.total_timeout + policy.request_timeout
        text = str(ei.value)
        assert NAME in text and "[100, 200)" in text and "attempt" in text
        assert proxy.storage_options["secret"] not in text
        assert proxy.counts["slowdown"] <= policy.max_attempts * policy.client_attempts


@pytest.mark.parametrize("kind", ["short", "flip", "reset", "stall"])
def test_faults_never_give_wrong_bytes(
    kind: str, monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], local_s3: LocalS3
) -> None:
    uri, data = stored
    with FaultProxy(local_s3.endpoint_url, faults=[kind], rate=0.4, seed=7, stall_seconds=STALL_SECONDS) as proxy:
        st = _storage(monkeypatch, "obstore", uri, proxy.storage_options, policy=fault_test_policy(kind))
        st.piece_size = 128 * KiB
        reads = []
        for r in _ranges(25, len(data), seed=8):
            checks = tuple((o, min(16 * KiB, r.length - o), crc32c(data[r.start + o:r.start + min(o + 16 * KiB, r.length)]))
                           for o in range(0, r.length, 16 * KiB))
            reads.append(RangeRead(NAME, r.start, r.stop, checks))
        got, n = _read(st, reads)
        assert all(g == data[r.start:r.stop] for r, g in zip(reads, got))
        assert st.read_bytes(NAME, 0, len(data)) == data  # no checks: the whole object vs its ETag
        assert proxy.counts[kind] > 0
        assert n > len(reads)  # the faulted pieces were fetched again


def test_metadata_calls_match_s3fs_and_never_create_it(
    monkeypatch: pytest.MonkeyPatch, stored: tuple[str, bytes], s3_opts: dict[str, Any]
) -> None:
    uri, data = stored
    writer = _storage(monkeypatch, "s3fs", uri, s3_opts)
    writer.write_bytes("manifest.json", b'{"a": 1}')
    writer.write_bytes("data/sub/deep.bin", b"d" * 7)
    fast = _storage(monkeypatch, "obstore", uri, s3_opts)
    slow = _storage(monkeypatch, "s3fs", uri, s3_opts)
    for st in (fast, slow):
        assert st.list() == ["data", "manifest.json"]
        assert st.list("data") == ["data/00000.bin", "data/sub"]
        assert st.list(recursive=True) == [NAME, "data/sub/deep.bin", "manifest.json"]
        assert st.list("data/sub", recursive=True) == ["data/sub/deep.bin"]
        assert st.list("absent") == st.list("absent", recursive=True) == []
        assert st.size(NAME) == len(data) and st.size("manifest.json") == 8
        assert st.exists(NAME) and st.exists("data/sub") and not st.exists("absent.bin")
        assert abs(st.modified("manifest.json") - time.time()) < 300 and st.modified("absent.bin") is None
        assert st.read_bytes("manifest.json") == b'{"a": 1}'
        with pytest.raises(CorruptCheckpointError, match="more than the 4-byte limit"):
            st.read_bytes("manifest.json", max_bytes=4)
        with pytest.raises(CheckpointNotFoundError, match="absent.bin"):
            st.size("absent.bin")
        with pytest.raises(CheckpointNotFoundError, match="absent.json"):
            st.read_bytes("absent.json")
    # the whole read path of a load ran without s3fs (its botocore client costs ~0.2 s to start)
    assert fast.clients_started == ("obstore",) and slow.clients_started == ("s3fs",)
    fast.write_bytes("late.bin", b"x")  # writes go through obstore too
    with fast.open_write("late-multi.bin", block_size=5 * MiB) as up:
        up.write(data * 12)
    assert fast.clients_started == ("obstore",) and fast.read_bytes("late.bin") == b"x"
    assert fast.read_bytes("late-multi.bin") == data * 12


def test_bodies_in_flight_are_reserved_from_the_memory_budget(
    monkeypatch: pytest.MonkeyPatch, s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    fast = _storage(monkeypatch, "obstore", s3_uri, s3_opts)
    assert (fast.piece_size, fast.inflight_bytes) == (16 * MiB, 16 * MiB)  # no budget told
    assert fast.reserve_inflight(256 * MiB) == 192 * MiB and fast.inflight_bytes == 64 * MiB
    assert fast.reserve_inflight(1024 * MiB) == 960 * MiB and fast.inflight_bytes == 64 * MiB
    assert fast.reserve_inflight(8 * MiB) == 4 * MiB and fast.inflight_bytes == 4 * MiB  # one piece at a time
    slow = _storage(monkeypatch, "s3fs", s3_uri, s3_opts)  # bodies land in the buffers: nothing to reserve
    assert slow.reserve_inflight(256 * MiB) == 256 * MiB


def test_a_cancelled_read_waits_for_its_worker(s3_opts: dict[str, Any]) -> None:
    """A blocking call may be writing into a staging buffer: a caller cancelled meanwhile
    (another read of its round failed) must not return before that call has ended."""
    import asyncio
    import threading

    before = set(threading.enumerate())  # other tests' unclosed Storages may still hold worker threads
    backend = ObstoreBackend(s3_config(s3_opts), 5.0, 1, 4)
    reader = backend.threads
    buf = bytearray(4)
    started = threading.Event()

    def slow_write() -> str:
        started.set()
        time.sleep(0.3)
        buf[:] = b"late"
        return "done"

    async def scenario() -> None:
        task = asyncio.ensure_future(reader.run(slow_write))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bytes(buf) == b"late"  # the write happened before the cancellation came back
        assert await reader.run(lambda: "again") == "again"

    asyncio.run(scenario())
    backend.close()
    mine = [t for t in threading.enumerate() if t.name.startswith("streamckpt-s3") and t not in before]
    assert not mine  # close joined this reader's workers


def test_selection(monkeypatch: pytest.MonkeyPatch, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    auto = ("http" if AUTO_PICKS_HTTP else "obstore") if AUTO_PICKS_OBSTORE else "s3fs"
    assert _storage(monkeypatch, "auto", s3_uri, s3_opts).read_backend == auto
    monkeypatch.delenv(BACKEND_ENV)
    assert Storage(s3_uri, s3_opts).read_backend == auto  # unset means auto
    assert _storage(monkeypatch, "obstore", s3_uri, s3_opts).read_backend == "obstore"
    assert _storage(monkeypatch, "s3fs", s3_uri, s3_opts).read_backend == "s3fs"
    # An option obstore cannot reproduce: s3fs for this Storage (and s3fs still gets the option).
    assert _storage(monkeypatch, "obstore", s3_uri, {**s3_opts, "requester_pays": False}).read_backend == "s3fs"
    assert _storage(monkeypatch, "auto", "/tmp/x", None).read_backend == "fsspec"
    with pytest.raises(StorageError, match=BACKEND_ENV):
        _storage(monkeypatch, "rust", s3_uri, s3_opts)


def test_option_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    cfg = s3_config({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "token": "t",
                     "skip_instance_cache": True, "config_kwargs": {"connect_timeout": 3}})
    assert cfg == {"access_key_id": "k", "secret_access_key": "s", "session_token": "t",
                   "endpoint": "http://127.0.0.1:9", "virtual_hosted_style_request": False, "region": "eu-west-3"}
    cfg = s3_config({"anon": True, "client_kwargs": {"region_name": "ap-south-1"}})
    assert cfg == {"skip_signature": True, "region": "ap-south-1"}
    # an endpoint from the environment, as botocore reads it, with http allowed when it says http
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8")
    assert s3_config({"key": "k", "secret": "s"})["endpoint"] == "http://127.0.0.1:8"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:7")
    assert s3_config({"key": "k", "secret": "s"})["endpoint"] == "http://127.0.0.1:7"
    assert s3_config({"key": "k", "secret": "s", "endpoint_url": "http://h:1"})["endpoint"] == "http://h:1"
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert "endpoint" not in s3_config({"key": "k", "secret": "s"})
    for bad in ({"key": "k", "profile": "p"}, {"key": "k", "client_kwargs": {"verify": False}}, {}):
        with pytest.raises(NotConfigurable):
            s3_config(bad)


def test_missing_bucket_is_not_found_at_once(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3) -> None:
    """A typo in a bucket name: CheckpointNotFoundError naming the bucket, on both clients,
    after a handful of requests (no retries of a 404 NoSuchBucket as if it were transient)."""
    import streamckpt as sc

    for backend in ("obstore", "s3fs"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        with FaultProxy(local_s3.endpoint_url, rate=0.0) as proxy:
            with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket' does not exist"):
                sc.load_full("s3://no-such-bucket/ckpt", storage_options=proxy.storage_options)
            with pytest.raises(CheckpointNotFoundError, match="bucket 'no-such-bucket' does not exist"):
                Storage("s3://no-such-bucket/ckpt", proxy.storage_options).read_bytes("manifest.json")
            assert proxy.requests <= 6, (backend, proxy.history)


@pytest.mark.parametrize("endpoint,unsigned", [("https://s3.example.com", True), ("http://127.0.0.1:9", False)])
def test_uploads_skip_the_payload_hash_only_over_tls(endpoint: str, unsigned: bool) -> None:
    """SigV4 hashes every body (SHA-256: ~0.15 s of CPU per 256 MiB here); over TLS the
    transport protects it, so writes skip the hash there, as the AWS SDKs do. No request is made."""
    backend = ObstoreBackend(s3_config({"endpoint_url": endpoint, "key": "k", "secret": "s"}), 5.0, 1, 4)
    try:
        writes = backend.store("bucket", writes=True).config
        reads = backend.store("bucket").config
        assert str(writes.get("unsigned_payload", False)).lower() == str(unsigned).lower()
        assert str(reads.get("unsigned_payload", False)).lower() == "false"
    finally:
        backend.close()
