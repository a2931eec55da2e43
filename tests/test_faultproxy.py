"""Reads and writes through FaultProxy (a fault-injecting HTTP proxy in front of the
real moto server) stay bit-exact; persistent faults end in the right error, in bounded time."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from streamckpt.core.checksum import crc32c
from streamckpt.errors import CorruptCheckpointError, StorageError
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.testing import FaultProxy, LocalS3

from conftest import STALL_SECONDS, STALL_TIMEOUT

MiB = 1 << 20
CHUNK = 16 << 10

# Short stall timeouts keep the stall cases fast; everything else is the default policy.
FAST_STALL = RetryPolicy(request_timeout=STALL_TIMEOUT)


@pytest.fixture
def stored(local_s3: LocalS3, s3_uri: str, s3_opts: dict[str, Any]) -> tuple[str, bytes]:
    """A 1 MiB object written straight to the server (no proxy)."""
    data = random.Random(11).randbytes(MiB)
    Storage(s3_uri, s3_opts).write_bytes("data/00000.bin", data)
    return s3_uri, data


def _reads(data: bytes, n: int, seed: int) -> list[RangeRead]:
    """``n`` random ranges, each covered by per-16-KiB CRC32C checks (as the format does)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(0, len(data) - 1)
        b = min(len(data), a + rng.randrange(1, 3 * CHUNK))
        checks = tuple(
            (off, min(CHUNK, b - a - off), crc32c(data[a + off:a + min(off + CHUNK, b - a)]))
            for off in range(0, b - a, CHUNK)
        )
        out.append(RangeRead("data/00000.bin", a, b, checks))
    return out


def _read_all(st: Storage, reads: list[RangeRead]) -> tuple[list[bytes], int]:
    bufs = [bytearray(r.length) for r in reads]
    requests = st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    return [bytes(b) for b in bufs], requests


@pytest.mark.parametrize(
    "kind,rate",
    [("slowdown", 0.3), ("reset", 0.2), ("short", 0.3), ("flip", 0.3), ("stall", 0.2)],
)
def test_each_fault_alone_reads_bit_exact(
    kind: str, rate: float, stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, data = stored
    proxy = proxy_factory(faults=[kind], rate=rate, seed=3, stall_seconds=STALL_SECONDS)
    st = Storage(uri, proxy.storage_options, policy=FAST_STALL if kind == "stall" else None)
    reads = _reads(data, 40, seed=4)
    got, requests = _read_all(st, reads)
    for r, b in zip(reads, got):
        assert b == data[r.start:r.stop], (r.start, r.stop)
    assert st.read_bytes("data/00000.bin") == data  # whole-object read (ETag-checked)
    counts = proxy.counts
    assert counts[kind] > 0
    assert sum(counts.values()) == counts[kind]  # nothing else was injected
    assert requests >= len(reads)
    assert proxy.requests > len(reads) + 1  # faults cost retries (some inside the S3 client)


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_mixed_faults_read_bit_exact(rate: float, stored: tuple[str, bytes], proxy_factory: Any) -> None:
    uri, data = stored
    proxy = proxy_factory(
        faults={"slowdown": 1, "reset": 1, "short": 1, "flip": 1, "stall": 0.3},
        rate=rate, seed=5, stall_seconds=STALL_SECONDS,
    )
    st = Storage(uri, proxy.storage_options, policy=FAST_STALL)
    reads = _reads(data, 80, seed=6)
    got, _ = _read_all(st, reads)
    assert all(b == data[r.start:r.stop] for r, b in zip(reads, got))
    counts = proxy.counts
    assert sum(counts.values()) >= 5
    assert sum(1 for k in ("slowdown", "reset", "short", "flip") if counts[k] > 0) >= 3, counts


def test_uploads_through_faults_land_whole(
    s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any
) -> None:
    proxy = proxy_factory(faults=["slowdown", "reset"], rate=0.5, seed=1, methods=("PUT",))
    st = Storage(s3_uri, proxy.storage_options)
    rng = random.Random(8)
    objects = {f"data/{i:05d}.safetensors": rng.randbytes(11 * MiB + i) for i in range(1)}
    for name, data in objects.items():
        with st.open_write(name, block_size=5 * MiB) as up:  # three parts each
            for i in range(0, len(data), MiB):
                up.write(data[i:i + MiB])
    st.write_bytes("manifest.json", b'{"format": "streamckpt"}')
    direct = Storage(s3_uri, s3_opts)
    for name, data in objects.items():
        assert direct.read_bytes(name) == data
    assert direct.read_bytes("manifest.json") == b'{"format": "streamckpt"}'
    assert proxy.injected > 0, proxy.counts


def test_persistent_outage_is_a_storage_error_in_bounded_time(
    stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["slowdown"], rate=1.0, max_repeats=10**9)
    policy = RetryPolicy(max_attempts=4, client_attempts=2, base_delay=0.05, total_timeout=3.0)
    st = Storage(uri, proxy.storage_options, policy=policy)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.read_into([RangeRead("data/00000.bin", 100, 200)], [memoryview(bytearray(100))]).result(timeout=60)
    elapsed = time.monotonic() - t0
    assert "data/00000.bin" in str(ei.value) and "[100, 200)" in str(ei.value)
    assert elapsed < policy.total_timeout + policy.request_timeout
    # Both layers together made a bounded number of requests.
    # Our attempts times the client's, with slack of one request per attempt: a size probe
    # (HEAD) where a failure could mean truncation, or the HTTP client resending a request it
    # had put on a pooled connection the server closed (hyper does that on its own; a CI run
    # under load saw 10 faulted requests for a bound of 8).
    bound = policy.max_attempts * policy.client_attempts
    assert proxy.counts["slowdown"] <= bound + policy.max_attempts, proxy.history


def test_persistent_stall_times_out_with_storage_error(stored: tuple[str, bytes], proxy_factory: Any) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["stall"], rate=1.0, max_repeats=10**9, stall_seconds=30)
    policy = RetryPolicy(request_timeout=0.3, total_timeout=1.5, client_attempts=1)
    st = Storage(uri, proxy.storage_options, policy=policy)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.read_bytes("data/00000.bin", 0, 10)
    assert time.monotonic() - t0 < policy.total_timeout + 2 * policy.request_timeout + 1
    assert "[0, 10)" in str(ei.value)


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_different_corruption_on_every_fetch_is_a_storage_error_not_rot(
    stored: tuple[str, bytes], proxy_factory: Any, seed: int
) -> None:
    """A path that flips a different bit on every read is a transit problem: re-fetched up
    to the policy's mismatch limit, then StorageError saying the contents differed."""
    uri, data = stored
    proxy = proxy_factory(faults=["flip"], rate=1.0, max_repeats=10**9, seed=seed)
    st = Storage(uri, proxy.storage_options)
    read = _reads(data, 1, seed=9)[0]  # < 4 MiB: one request per fetch
    with pytest.raises(StorageError) as ei:
        _read_all(st, [read])
    assert not isinstance(ei.value, CorruptCheckpointError)
    assert "data/00000.bin" in str(ei.value) and "different wrong contents" in str(ei.value)
    assert proxy.counts["flip"] == max(st.policy.max_attempts, st.policy.checksum_retries + 2)


@pytest.mark.parametrize("seed", [0, 5])
def test_same_wrong_content_on_every_fetch_is_corrupt_checkpoint(
    stored: tuple[str, bytes], proxy_factory: Any, seed: int
) -> None:
    """Rot at rest returns the same wrong bytes every time: CorruptCheckpointError after
    exactly checksum_retries + 1 equal reads, naming object, range and what was compared."""
    uri, data = stored
    proxy = proxy_factory(faults=["rot"], rate=1.0, max_repeats=10**9, seed=seed)
    st = Storage(uri, proxy.storage_options)
    read = RangeRead("data/00000.bin", 0, len(data), tuple(
        (off, CHUNK, crc32c(data[off:off + CHUNK])) for off in range(0, len(data), CHUNK)))
    with pytest.raises(CorruptCheckpointError) as ei:
        _read_all(st, [read])
    msg = str(ei.value)
    assert "data/00000.bin" in msg and "the same wrong content" in msg and "crc32c" in msg
    assert f"on {st.policy.checksum_retries + 1} of {st.policy.checksum_retries + 1} reads" in msg
    assert proxy.counts["rot"] == st.policy.checksum_retries + 1


def test_whole_object_corrupted_every_time_is_corrupt_checkpoint(
    stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["rot"], rate=1.0, max_repeats=10**9)
    st = Storage(uri, proxy.storage_options)
    with pytest.raises(CorruptCheckpointError) as ei:
        st.read_bytes("data/00000.bin")  # no range: checked against the ETag (MD5)
    assert "data/00000.bin" in str(ei.value) and "ETag" in str(ei.value)
    assert proxy.counts["rot"] == st.policy.checksum_retries + 1


def test_whole_object_flipped_differently_every_time_is_a_storage_error(
    stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["flip"], rate=1.0, max_repeats=10**9)
    st = Storage(uri, proxy.storage_options, policy=RetryPolicy(base_delay=0.01))
    with pytest.raises(StorageError) as ei:
        st.read_bytes("data/00000.bin")
    assert not isinstance(ei.value, CorruptCheckpointError) and "different wrong contents" in str(ei.value)


def test_short_bodies_every_time_are_a_storage_error_not_corruption(
    stored: tuple[str, bytes], proxy_factory: Any
) -> None:
    uri, _ = stored
    proxy = proxy_factory(faults=["short"], rate=1.0, max_repeats=10**9)
    st = Storage(uri, proxy.storage_options, policy=RetryPolicy(max_attempts=3, base_delay=0.01))
    with pytest.raises(StorageError) as ei:
        st.read_bytes("data/00000.bin", 1000, 3000)
    assert "[1000, 3000)" in str(ei.value)
    assert not isinstance(ei.value, CorruptCheckpointError)


def test_proxy_is_seeded_and_counts(stored: tuple[str, bytes], local_s3: LocalS3) -> None:
    """Same seed, same sequential requests -> the same faults. (Faults that keep the
    connection: a reset lets the HTTP client's connection pool decide, by timing, whether a
    request is resent on its own, which changes the sequence the proxy sees.)"""
    uri, data = stored
    seen = []
    for _ in range(2):
        with FaultProxy(local_s3.endpoint_url, faults=["slowdown", "short", "flip"], rate=0.3, seed=42) as proxy:
            st = Storage(uri, proxy.storage_options, max_concurrency=1)
            for r in _reads(data, 10, seed=10):
                assert _read_all(st, [r])[0][0] == data[r.start:r.stop]
            seen.append(proxy.counts)
    assert seen[0] == seen[1] and sum(seen[0].values()) > 0


def test_proxy_rejects_bad_configuration(local_s3: LocalS3) -> None:
    with pytest.raises(ValueError):
        FaultProxy(local_s3.endpoint_url, faults=["meteor"])
    with pytest.raises(ValueError):
        FaultProxy("https://example.invalid", rate=0.1)


# ------------------------------------------------------------- end to end


def _state(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 512, generator=g),  # 512 KiB
        "emb": torch.randn(1000, 64, generator=g).to(torch.bfloat16),
        "layers": {"0": {"b": torch.arange(300, dtype=torch.int64)}},
        "step": 7,
    }


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_load_through_mixed_faults_is_bit_exact(
    compression: str | None, s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any
) -> None:
    import torch

    import streamckpt as sc

    src = _state(1)
    sc.save(src, s3_uri, storage_options=s3_opts, compression=compression)
    proxy = proxy_factory(
        faults={"slowdown": 1, "reset": 1, "short": 1, "flip": 1, "stall": 0.5},
        rate=0.25, seed=12, stall_seconds=0.3,
    )
    # A different layout: rows [64, 192) of w as a ShardedTensor, the rest whole.
    part = torch.zeros(128, 512)
    dst = {
        "w": sc.ShardedTensor(part, (256, 512), (64, 0)),
        "emb": torch.zeros(1000, 64, dtype=torch.bfloat16),
        "layers": {"0": {"b": torch.zeros(300, dtype=torch.int64)}},
        "step": 0,
    }
    res = sc.load(dst, s3_uri, storage_options=proxy.storage_options, memory_budget=256 << 10)
    assert torch.equal(part, src["w"][64:192])
    assert torch.equal(dst["emb"], src["emb"])
    assert torch.equal(dst["layers"]["0"]["b"], src["layers"]["0"]["b"])
    assert dst["step"] == 7
    assert res.bytes_needed == 128 * 512 * 4 + 1000 * 64 * 2 + 300 * 8
    assert proxy.injected > 0, proxy.counts
    full = sc.load_full(s3_uri, storage_options=proxy.storage_options)
    assert torch.equal(full["w"], src["w"])


@pytest.mark.parametrize("backend", ["auto", "s3fs"])
def test_a_server_without_bulk_delete_still_deletes(local_s3: Any, s3_uri: str, backend: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Some S3-compatible servers answer the bulk delete (``POST /bucket?delete``) with 501:
    an overwrite and a removal then delete one object at a time, after one refused request."""
    import torch

    import streamckpt as sc
    from streamckpt.storage import Storage

    def bulk(method: str, path: str) -> bool:
        return method == "POST" and path.partition("?")[2].split("&")[0] in ("delete", "delete=")

    monkeypatch.setenv("STREAMCKPT_S3_BACKEND", backend)
    with FaultProxy(local_s3.endpoint_url, rate=0.0, unsupported=bulk) as proxy:
        opts = proxy.storage_options
        sc.save({"w": torch.ones(10), "b": torch.ones(3)}, s3_uri, storage_options=opts)
        sc.save({"w": torch.zeros(10)}, s3_uri, storage_options=opts, overwrite=True)
        assert proxy.refused >= 1
        state = sc.load_state(s3_uri, storage_options=opts)
        assert list(state) == ["w"] and torch.equal(state["w"], torch.zeros(10))
        storage = Storage(s3_uri, opts)
        try:
            storage.delete("", recursive=True)
            assert storage.list("", recursive=True) == []
        finally:
            storage.close()
