"""Bytes land where they belong: a read that serves only this rank is received straight
into its CPU targets and verified there; corrupted bodies are fetched again until the
target holds the stored bytes, and a load whose bytes cannot be verified raises.

Everything talks HTTP to the session's moto server (through FaultProxy where faults are
injected); ``LoadResult.bytes_direct`` counts the bytes that landed in targets."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.core.checksum import crc32c
from streamckpt.errors import CorruptCheckpointError
from streamckpt.storage import Landing, RangeRead, RetryPolicy, Storage

MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(512, 640, generator=g),  # 1.25 MiB: several 256 KiB checksum chunks
        "emb": torch.randn(1000, 96, generator=g).to(torch.bfloat16),
        "norm": torch.randn(640, generator=g),
        "ids": torch.arange(333, dtype=torch.int64),
    }


def _nbytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.fixture
def saved(s3_uri: str, s3_opts: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
    src = _state()
    sc.save(src, s3_uri, storage_options=s3_opts)
    return s3_uri, src


def _data_gets(method: str, path: str) -> bool:
    return method == "GET" and "/data/" in path


@pytest.mark.parametrize("client", ["http", "obstore", "s3fs"])
def test_full_load_lands_every_byte_in_its_target(
    saved: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any], client: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMCKPT_S3_BACKEND", client)
    uri, src = saved
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    res = sc.load(dst, uri, storage_options=s3_opts)
    for k in src:
        assert torch.equal(dst[k], src[k]), k
    assert res.bytes_needed == _nbytes(src.values())
    assert res.bytes_direct == res.bytes_needed == res.bytes_read
    assert res.staging_bytes <= 64 * res.rounds * 2  # only the arenas' alignment tails


def test_row_slice_lands_in_target_and_chunk_edges_are_staged(
    saved: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any]
) -> None:
    uri, src = saved
    rows = torch.empty(200, 640)
    dst = {"w": sc.ShardedTensor(rows, (512, 640), (150, 0))}
    res = sc.load(dst, uri, storage_options=s3_opts, strict=False)
    assert torch.equal(rows, src["w"][150:350])
    assert res.bytes_direct == res.bytes_needed == 200 * 640 * 4
    # whole checksum chunks are read: the bytes around the rows land in staging
    assert res.bytes_read > res.bytes_needed and res.staging_bytes > 0


def test_targets_that_cannot_take_raw_bytes_are_staged(
    saved: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any]
) -> None:
    """A transposed (non-contiguous) target and two keys sharing one tensor's memory are
    filled from staging; the others still land directly."""
    uri, src = saved
    w_t = torch.empty(640, 512).t()  # the right shape, column-major memory
    shared = torch.empty(640)
    dst = {"w": w_t, "emb": torch.empty(1000, 96, dtype=torch.bfloat16), "norm": shared,
           "ids": torch.empty(333, dtype=torch.int64)}
    res = sc.load(dst, uri, storage_options=s3_opts)
    assert torch.equal(w_t, src["w"]) and torch.equal(dst["emb"], src["emb"]) and torch.equal(shared, src["norm"])
    assert res.bytes_direct == _nbytes([src["emb"], src["norm"], src["ids"]])

    alias = {"norm": shared, "w": torch.empty(512, 640)}
    alias["w2"] = alias["w"]  # the same memory under two keys: never two reads into it at once
    uri2 = uri + "-alias"
    sc.save({"norm": src["norm"], "w": src["w"], "w2": src["w"]}, uri2, storage_options=s3_opts)
    res = sc.load(alias, uri2, storage_options=s3_opts)
    assert torch.equal(alias["w"], src["w"]) and torch.equal(shared, src["norm"])
    assert res.bytes_direct == _nbytes([src["norm"]])


@pytest.mark.parametrize("client", ["http", "obstore", "s3fs"])
def test_flipped_bodies_are_fetched_again_into_the_target(
    saved: tuple[str, dict[str, torch.Tensor]], proxy_factory: Any, client: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every data GET is corrupted once (a bit flipped in transit): the checks over the
    bytes in the target fail, the range is fetched again, the target ends exact."""
    monkeypatch.setenv("STREAMCKPT_S3_BACKEND", client)
    uri, src = saved
    proxy = proxy_factory(faults=["flip"], rate=1.0, max_repeats=1, match=_data_gets)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    rows = torch.zeros(200, 640)
    dst["w"] = sc.ShardedTensor(rows, (512, 640), (150, 0))
    res = sc.load(dst, uri, storage_options=proxy.storage_options)
    assert torch.equal(rows, src["w"][150:350])
    for k in ("emb", "norm", "ids"):
        assert torch.equal(dst[k], src[k]), k
    assert res.bytes_direct == res.bytes_needed
    assert proxy.counts["flip"] >= 1
    assert res.requests >= 2 * proxy.counts["flip"]  # each flipped range came again


def _rotted_in(uri: str, opts: dict[str, Any], key: str) -> bool:
    """Whether FaultProxy's ``rot`` (one fixed bit per object, placed from its path) falls in
    ``key``'s stored bytes, which a load of ``key`` then reads."""
    from streamckpt.formats import read_manifest

    st = Storage(uri, opts)
    shard = read_manifest(st).tensors[key].shards[0]
    path = "/" + uri.split("://", 1)[1] + "/" + shard.file
    at = random.Random(path).randrange(st.size(shard.file))
    return shard.byte_offset <= at < shard.byte_offset + shard.byte_length


def test_rot_at_rest_raises_and_load_does_not_return(
    saved: tuple[str, dict[str, torch.Tensor]], s3_opts: dict[str, Any], proxy_factory: Any
) -> None:
    """The same wrong bytes on every read: CorruptCheckpointError naming the object; the
    load never returns with the unverified bytes that landed in the target."""
    base, src = saved
    uri = next(u for u in (f"{base}-{i}" for i in range(50))
               if sc.save(src, u, storage_options=s3_opts) is not None and _rotted_in(u, s3_opts, "w"))
    proxy = proxy_factory(faults=["rot"], rate=1.0, max_repeats=10**9, match=_data_gets)
    dst = {"w": torch.zeros(512, 640)}
    with pytest.raises(CorruptCheckpointError) as ei:
        sc.load(dst, uri, storage_options=proxy.storage_options, strict=False)
    msg = str(ei.value)
    assert "data/" in msg and "the same wrong content" in msg
    assert proxy.counts["rot"] >= RetryPolicy().checksum_retries + 1


# ------------------------------------------------------------------ storage: Landing


def _landing(sizes: list[int]) -> tuple[Landing, list[bytearray]]:
    bufs = [bytearray(n) for n in sizes]
    return Landing([memoryview(b) for b in bufs]), bufs


@pytest.fixture
def blob() -> bytes:
    return random.Random(3).randbytes(MiB + 777)


def _checked(data: bytes, start: int, stop: int, chunk: int) -> RangeRead:
    checks = tuple((off, min(chunk, stop - start - off), crc32c(data[start + off:start + min(off + chunk, stop - start)]))
                   for off in range(0, stop - start, chunk))
    return RangeRead("data/blob.bin", start, stop, checks)


@pytest.mark.parametrize("client", ["http", "obstore", "s3fs", "local"])
def test_a_read_lands_across_buffers_with_pieces_straddling_them(
    blob: bytes, s3_uri: str, s3_opts: dict[str, Any], tmp_path: Path, client: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces of 100 000 bytes over buffers of other sizes: every piece that straddles two
    buffers is split over them (``Backend.fetch_parts``), checks span buffers too."""
    if client == "local":
        uri, opts = str(tmp_path / "ck"), None
    else:
        monkeypatch.setenv("STREAMCKPT_S3_BACKEND", client)
        uri, opts = s3_uri, s3_opts
    Storage(uri, opts).write_bytes("data/blob.bin", blob)
    st = Storage(uri, opts)
    assert st.read_backend == ("fsspec" if client == "local" else client)
    st.piece_size = 100_000
    start, stop = 1234, len(blob) - 99
    sizes = [70_000, 1, 300_001, 5, stop - start - 370_007]
    land, bufs = _landing(sizes)
    landed: list[int] = []
    requests = st.read_into([_checked(blob, start, stop, 64 << 10)], [land], on_landed=landed.append).result(60)
    assert b"".join(bufs) == blob[start:stop]
    assert landed == [0]
    assert requests == -(-(stop - start) // 100_000)


def test_a_flipped_piece_across_buffers_is_fetched_again(
    blob: bytes, s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any
) -> None:
    Storage(s3_uri, s3_opts).write_bytes("data/blob.bin", blob)
    proxy = proxy_factory(faults=["flip"], rate=1.0, max_repeats=1, match=_data_gets)
    st = Storage(s3_uri, proxy.storage_options)
    land, bufs = _landing([100_000, 200_000, len(blob) - 300_000])
    st.read_into([_checked(blob, 0, len(blob), 32 << 10)], [land]).result(60)
    assert b"".join(bufs) == blob
    assert proxy.counts["flip"] >= 1


def test_stop_returns_once_no_read_writes_any_more(
    blob: bytes, s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any
) -> None:
    """``Storage.stop`` (what a failing load calls) waits for reads in flight: whatever a
    buffer holds when it returns stays so."""
    Storage(s3_uri, s3_opts).write_bytes("data/blob.bin", blob)
    proxy = proxy_factory(faults=["stall"], rate=1.0, max_repeats=10**9, match=_data_gets, stall_seconds=0.5)
    st = Storage(s3_uri, proxy.storage_options)
    buf = bytearray(len(blob))
    fut = st.read_into([RangeRead("data/blob.bin", 0, len(blob))], [memoryview(buf)])
    time.sleep(0.1)  # the request is out, its reply held back
    st.stop(fut)
    after = bytes(buf)
    time.sleep(0.8)  # past the stall: a read still running would write now
    assert bytes(buf) == after
    assert fut.done()
