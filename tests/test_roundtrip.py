"""Single-process save/load through a real moto S3 server (HTTP via s3fs), and local paths."""

from __future__ import annotations

import json
import math

import pytest
import torch

import streamckpt as sc
from streamckpt.core import dtypes
from streamckpt.storage import Storage


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for code in dtypes.SUPPORTED_CODES:
        dt = dtypes.to_torch(code)
        base = torch.randint(0, 100, (5, 7), generator=g)
        if dt.is_floating_point and dt.itemsize >= 2:
            t = (torch.randn(5, 7, generator=g) * 10).to(dt)
        elif dt.is_complex:
            t = torch.randn(5, 7, dtype=dt, generator=g)
        elif dt == torch.bool:
            t = base % 2 == 0
        else:
            try:
                t = base.to(dt)
            except (RuntimeError, TypeError):
                t = torch.empty(5, 7, dtype=torch.uint8).random_(0, 255, generator=g).view(dt)
        out[code] = t
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def test_every_dtype_0d_empty_nested_and_values_round_trip(s3_uri, s3_opts):
    sd = {
        "dt": _all_dtype_tensors(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "model": {"layer": {"w": torch.randn(4, 3), "b": torch.arange(3, dtype=torch.int64)}},
        "step": 1234,
        "name": "run-7",
        "lrs": [0.1, 0.01],
        "cfg": {"flag": True, "nothing": None},
    }
    res = sc.save(sd, s3_uri, storage_options=s3_opts, metadata={"note": "hi"})
    assert res.files[-1] == "manifest.json" and res.bytes_written > 0

    out = {
        "dt": {k: torch.zeros_like(v) for k, v in sd["dt"].items()},
        "scalar": torch.tensor(0.0, dtype=torch.float64),
        "empty": torch.ones(0, 3),
        "model": {"layer": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.int64)}},
        "step": 0, "name": "", "lrs": [], "cfg": {"flag": False, "nothing": 1},
    }
    r = sc.load(out, s3_uri, storage_options=s3_opts)
    assert r.missing_keys == [] and r.unexpected_keys == []
    for k, v in sd["dt"].items():
        assert _bitwise_equal(out["dt"][k], v), k
    assert out["scalar"].item() == 2.5
    assert torch.equal(out["model"]["layer"]["w"], sd["model"]["layer"]["w"])
    assert torch.equal(out["model"]["layer"]["b"], sd["model"]["layer"]["b"])
    assert (out["step"], out["name"], out["lrs"], out["cfg"]) == (1234, "run-7", [0.1, 0.01], {"flag": True, "nothing": None})
    needed = sum(v.numel() * v.element_size() for v in sd["dt"].values()) + 8 + 4 * 12 + 24
    assert r.bytes_needed == needed
    info = sc.inspect(s3_uri, storage_options=s3_opts)
    assert info.kind == "streamckpt" and info.metadata == {"note": "hi"}
    assert info.tensors["model.layer.w"].shape == (4, 3) and info.tensors["dt.BF16"].dtype == "BF16"
    assert info.total_bytes == needed
    assert "model.layer.w" in str(info)


@pytest.fixture
def big(s3_uri, s3_opts):
    t = torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024)
    sc.save({"w": t}, s3_uri, storage_options=s3_opts)
    return t


def _manifest_bytes(uri, opts) -> int:
    return Storage(uri, opts).size("manifest.json")


def test_row_slice_reads_only_needed_bytes(big, s3_uri, s3_opts):
    out = torch.zeros(512, 1024)
    r = sc.load({"w": sc.ShardedTensor(out, (4096, 1024), (1024, 0))}, s3_uri, storage_options=s3_opts)
    assert torch.equal(out, big[1024:1536])
    assert r.bytes_needed == 512 * 1024 * 4
    assert r.bytes_read <= 1.05 * r.bytes_needed
    assert r.requests <= 2


def test_column_slice_reads_shard_at_most_once_with_few_requests(big, s3_uri, s3_opts):
    out = torch.zeros(4096, 256)
    r = sc.load({"w": sc.ShardedTensor(out, (4096, 1024), (0, 256))}, s3_uri, storage_options=s3_opts)
    assert torch.equal(out, big[:, 256:512])
    assert r.bytes_read <= big.numel() * 4
    assert r.requests < 64  # vs 4096 row runs


def test_flat_ranges_load(big, s3_uri, s3_opts):
    flat = big.reshape(-1)
    for a, b in [(5, 1029), (1000, 3_000_001), (0, flat.numel())]:
        out = torch.zeros(b - a)
        st = sc.ShardedTensor(out, (4096, 1024), (0, 0), local_shape=(4096, 1024), flat_range=(a, b))
        r = sc.load({"w": st}, s3_uri, storage_options=s3_opts)
        assert torch.equal(out, flat[a:b])
        assert r.bytes_read <= r.bytes_needed + 2 * (1 << 20)
    # a flat range of a sub-box (partial rows of rows 100..300)
    box = big[100:300, 8:1000]
    out = torch.zeros(50_000)
    st = sc.ShardedTensor(out, (4096, 1024), (100, 8), local_shape=(200, 992), flat_range=(777, 50_777))
    sc.load({"w": st}, s3_uri, storage_options=s3_opts)
    assert torch.equal(out, box.reshape(-1)[777:50_777])


def test_flat_range_shards_saved_and_loaded_as_boxes(s3_uri, s3_opts):
    t = torch.randn(37, 11)
    flat = t.reshape(-1)
    shards = {"w": sc.ShardedTensor(flat[0:407].clone(), (37, 11), (0, 0), local_shape=(37, 11), flat_range=(0, 407))}
    sc.save(shards, s3_uri, storage_options=s3_opts)
    out = torch.zeros(10, 11)
    sc.load({"w": sc.ShardedTensor(out, (37, 11), (20, 0))}, s3_uri, storage_options=s3_opts)
    assert torch.equal(out, t[20:30])


def test_zstd_round_trip_and_partial_load(s3_uri, s3_opts):
    t = torch.arange(3000 * 700, dtype=torch.int32).reshape(3000, 700) % 97
    sc.save({"w": t, "v": torch.randn(10)}, s3_uri, storage_options=s3_opts, compression="zstd")
    info = sc.inspect(s3_uri, storage_options=s3_opts)
    assert info.stored_bytes < info.total_bytes / 3
    out = torch.zeros(100, 700, dtype=torch.int32)
    r = sc.load({"w": sc.ShardedTensor(out, (3000, 700), (1500, 0))}, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(out, t[1500:1600])
    assert r.bytes_read < info.stored_bytes / 2  # only the covering frames
    full = sc.load_full(s3_uri, storage_options=s3_opts)
    assert torch.equal(full["w"], t)


def test_memory_budget_rounds(big, s3_uri, s3_opts):
    out = torch.zeros(4096, 1024)
    r = sc.load({"w": out}, s3_uri, storage_options=s3_opts, memory_budget=8 << 20)
    assert torch.equal(out, big)
    assert r.rounds >= 4
    assert r.staging_bytes <= 8 << 20
    assert r.bytes_read == r.bytes_needed == big.numel() * 4


def test_latest_ignores_uncommitted(s3_uri, s3_opts):
    root = s3_uri
    sc.save({"x": torch.ones(3)}, f"{root}/step-1", storage_options=s3_opts)
    sc.save({"x": torch.ones(3) * 2}, f"{root}/step-2", storage_options=s3_opts)
    st = Storage(f"{root}/step-3", s3_opts)
    st.write_bytes("data/00000-0000.safetensors", b"partial upload")  # no manifest: uncommitted
    assert sc.latest(root, storage_options=s3_opts) == f"{root}/step-2"
    assert sc.latest(f"{root}/nothing-here", storage_options=s3_opts) is None


def test_missing_and_unexpected_keys(s3_uri, s3_opts):
    sc.save({"a": torch.ones(2), "b": torch.ones(3), "n": 5}, s3_uri, storage_options=s3_opts)
    sd = {"a": torch.zeros(2), "c": torch.zeros(4), "m": 0}
    with pytest.raises(sc.MissingKeysError) as ei:
        sc.load(sd, s3_uri, storage_options=s3_opts)
    assert sorted(ei.value.missing_keys) == ["c", "m"] and "c" in str(ei.value)
    r = sc.load(sd, s3_uri, storage_options=s3_opts, strict=False)
    assert sorted(r.missing_keys) == ["c", "m"] and sorted(r.unexpected_keys) == ["b", "n"]
    assert torch.equal(sd["a"], torch.ones(2)) and torch.equal(sd["c"], torch.zeros(4))
    # keys only in the checkpoint never raise
    r = sc.load({"a": torch.zeros(2)}, s3_uri, storage_options=s3_opts)
    assert r.unexpected_keys == ["b", "n"]


def test_shape_and_dtype_mismatch_are_incompatible(s3_uri, s3_opts):
    sc.save({"a": torch.ones(2, 3)}, s3_uri, storage_options=s3_opts)
    with pytest.raises(sc.IncompatibleStateDictError, match="shape"):
        sc.load({"a": torch.zeros(3, 2)}, s3_uri, storage_options=s3_opts)
    with pytest.raises(sc.IncompatibleStateDictError, match="dtype"):
        sc.load({"a": torch.zeros(2, 3, dtype=torch.float64)}, s3_uri, storage_options=s3_opts)


def test_sharded_tensor_outside_global_shape_is_incompatible():
    with pytest.raises(sc.IncompatibleStateDictError, match="outside"):
        sc.ShardedTensor(torch.zeros(4, 4), (8, 8), (6, 0))
    with pytest.raises(sc.IncompatibleStateDictError, match="flat_range"):
        sc.ShardedTensor(torch.zeros(10), (8, 8), (0, 0), local_shape=(2, 2), flat_range=(0, 10))


def test_not_found_and_overwrite(s3_uri, s3_opts):
    with pytest.raises(sc.CheckpointNotFoundError):
        sc.load({"a": torch.zeros(1)}, s3_uri, storage_options=s3_opts)
    sc.save({"a": torch.ones(1)}, s3_uri, storage_options=s3_opts)
    with pytest.raises(sc.CheckpointExistsError):
        sc.save({"a": torch.ones(1)}, s3_uri, storage_options=s3_opts)
    sc.save({"a": torch.full((1,), 9.0)}, s3_uri, storage_options=s3_opts, overwrite=True)
    assert sc.load_full(s3_uri, storage_options=s3_opts)["a"].item() == 9.0


def test_local_path_and_file_url_share_the_code_path(tmp_path):
    t = torch.randn(3000, 400)
    sc.save({"w": t}, str(tmp_path / "a"))
    out = torch.zeros(1000, 400)
    r = sc.load({"w": sc.ShardedTensor(out, (3000, 400), (1000, 0))}, f"file://{tmp_path}/a")
    assert torch.equal(out, t[1000:2000])
    assert r.bytes_needed <= r.bytes_read <= r.bytes_needed + 2 * (256 << 10)  # checksum chunk edges
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["format"] == "streamckpt" and manifest["version"] == 1
    assert math.prod(manifest["tensors"]["w"]["shape"]) == 1_200_000


def test_data_files_are_valid_safetensors(tmp_path):
    from safetensors.torch import load_file

    t = torch.randn(30, 4)
    sc.save({"w": t, "v": torch.arange(5)}, str(tmp_path / "c"))
    loaded = load_file(str(tmp_path / "c" / "data" / "00000-0000.safetensors"))
    assert torch.equal(loaded["w@0,0"], t) and torch.equal(loaded["v@0"], torch.arange(5))
