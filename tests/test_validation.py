"""Bad manifests and corrupted/truncated data objects -> the documented CheckpointError,
with a message naming the field (or object and range); nothing is read before validation."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable

import pytest
import torch

import streamckpt as sc
from streamckpt.core.manifest import MAX_MANIFEST_BYTES, from_json
from streamckpt.errors import CorruptCheckpointError, UnsupportedVersionError
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy, LocalS3

DATA = "data/00000-0000.safetensors"


def _doc() -> dict[str, Any]:
    """A small, valid format-v1 manifest: row shards, zstd frames and flat ranges."""
    return {
        "format": "streamckpt",
        "version": 1,
        "files": {DATA: {"size": 300}},
        "tensors": {
            "w": {"dtype": "F32", "shape": [4, 6], "shards": [
                {"offset": [0, 0], "shape": [2, 6], "file": DATA, "byte_offset": 8, "byte_length": 48,
                 "codec": "raw", "chunk_size": 32, "crc32c": [1, 2]},
                {"offset": [2, 0], "shape": [2, 6], "file": DATA, "byte_offset": 56, "byte_length": 48,
                 "codec": "raw", "chunk_size": 32, "crc32c": [3, 4]},
            ]},
            "z": {"dtype": "BF16", "shape": [10], "shards": [
                {"offset": [0], "shape": [10], "file": DATA, "byte_offset": 104, "byte_length": 16,
                 "codec": "zstd", "chunk_size": 16, "crc32c": [5, 6], "frame_lengths": [9, 7]},
            ]},
            "f": {"dtype": "I64", "shape": [3, 4], "shards": [
                {"offset": [0, 0], "shape": [3, 4], "flat_range": [0, 5], "file": DATA, "byte_offset": 120,
                 "byte_length": 40, "codec": "raw", "chunk_size": 64, "crc32c": [7]},
                {"offset": [0, 0], "shape": [3, 4], "flat_range": [5, 12], "file": DATA, "byte_offset": 160,
                 "byte_length": 56, "codec": "raw", "chunk_size": 64, "crc32c": [8]},
            ]},
        },
        "values": {"step": 3},
        "metadata": {"run": "x"},
    }


def _enc(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_the_baseline_manifest_is_valid() -> None:
    m = from_json(_enc(_doc()))
    assert set(m.tensors) == {"w", "z", "f"}
    assert m.files == {DATA: 300}
    assert m.values == {"step": 3}


# ------------------------------------------------------------- raw bytes


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"{not json", "JSON"),
        (b"\xff\xfe{}", "UTF-8"),
        (b"[]", "<root>"),
        (b'"streamckpt"', "<root>"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),  # nesting bomb
        (b'{"format": "streamckpt", "version": 1, "files": {"a": {"size": ' + b"9" * 5000 + b"}}}", "JSON"),
    ],
    ids=["empty", "blank", "not-json", "not-utf8", "list", "string", "deep-nesting", "huge-int-literal"],
)
def test_unreadable_manifests(data: bytes, needle: str) -> None:
    with pytest.raises(CorruptCheckpointError) as ei:
        from_json(data, where="s3://b/ck/manifest.json")
    assert "s3://b/ck/manifest.json" in str(ei.value)
    assert needle in str(ei.value)


def test_unknown_format_names_the_field() -> None:
    for fmt in ("pytorch", None, 1):
        doc = _doc()
        doc["format"] = fmt
        with pytest.raises(CorruptCheckpointError, match="'format'"):
            from_json(_enc(doc))


@pytest.mark.parametrize("version", [3, 0, "1", None, 1.5, True])
def test_unknown_version_is_its_own_error(version: Any) -> None:
    doc = _doc()
    doc["version"] = version
    if version is None:
        del doc["version"]
    with pytest.raises(UnsupportedVersionError, match="version"):
        from_json(_enc(doc))


# ------------------------------------------------------------- field mutations


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets ``doc[path]`` (dotted, list indices as numbers)."""

    def apply(doc: dict[str, Any]) -> None:
        parts = path.split(".")
        node: Any = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


_DELETE = object()
W0 = "tensors.w.shards.0"


def _rename_file(new: str) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc["files"] = {new: {"size": 300}}
        for t in doc["tensors"].values():
            for s in t["shards"]:
                s["file"] = new

    return apply


def _drop_shard(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["shards"].pop()


def _duplicate_shard(doc: dict[str, Any]) -> None:
    s = copy.deepcopy(doc["tensors"]["w"]["shards"][0])
    doc["tensors"]["w"]["shards"][1] = s  # rows 0-1 twice, rows 2-3 never


def _overlap_flat(doc: dict[str, Any]) -> None:
    a, b = doc["tensors"]["f"]["shards"]
    a.update(flat_range=[0, 6], byte_length=48)
    b.update(flat_range=[5, 11], byte_offset=168, byte_length=48)  # same count: element 5 twice, 11 never


def _file_entry(entry: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc["files"][DATA] = entry

    return apply


BAD_FIELDS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # names that leave the prefix
    ("dotdot", _rename_file("../outside.bin"), "../outside.bin"),
    ("dotdot-inner", _rename_file("data/../../x.bin"), "data/../../x.bin"),
    ("absolute", _rename_file("/etc/passwd"), "/etc/passwd"),
    ("url", _rename_file("s3://other-bucket/x.bin"), "other-bucket"),
    ("http-url", _rename_file("http://127.0.0.1:9/x"), "127.0.0.1"),
    ("double-slash", _rename_file("//other-bucket/x.bin"), "other-bucket"),
    ("backslash", _rename_file("data\\..\\x"), "data"),
    ("home", _rename_file("~/x.bin"), "~/x.bin"),
    ("nul", _rename_file("data/x\x00.bin"), "data/x"),
    ("empty-name", _rename_file(""), "file name"),
    ("dot-segment", _rename_file("./x.bin"), "./x.bin"),
    ("drive", _rename_file("C:x.bin"), "C:x.bin"),
    ("unlisted-file", _set(f"{W0}.file", "data/other.bin"), "is not listed"),
    # numbers
    ("negative-offset", _set(f"{W0}.byte_offset", -8), "byte_offset"),
    ("float-offset", _set(f"{W0}.byte_offset", 8.5), "byte_offset"),
    ("bool-offset", _set(f"{W0}.byte_offset", True), "byte_offset"),
    ("string-length", _set(f"{W0}.byte_length", "48"), "byte_length"),
    ("past-file-end", _set(f"{W0}.byte_offset", 290), "past"),
    ("file-size-negative", _file_entry({"size": -1}), "size"),
    ("file-size-small", _file_entry({"size": 100}), "past"),
    ("file-size-missing", _file_entry({}), "size"),
    ("file-size-float", _file_entry({"size": 3e2}), "size"),
    ("length-vs-shape", _set(f"{W0}.byte_length", 40), "byte_length"),
    ("length-vs-dtype", _set("tensors.w.dtype", "F64"), "byte_length"),
    # shapes and tiling
    ("shard-ndim", _set(f"{W0}.shape", [2, 6, 1]), "shards[0].shape"),
    ("shard-offset-ndim", _set(f"{W0}.offset", [0]), "dims"),
    ("shard-outside", _set(f"{W0}.offset", [3, 0]), "outside"),
    ("negative-dim", _set("tensors.w.shape", [-4, 6]), "shape"),
    ("holes", _drop_shard, "holes"),
    ("overlap", _duplicate_shard, "overlap"),
    ("flat-overlap", _overlap_flat, "overlap"),
    ("flat-range-outside", _set("tensors.f.shards.1.flat_range", [5, 13]), "flat_range"),
    ("flat-range-short", _set("tensors.f.shards.1.flat_range", [5]), "flat_range"),
    ("absurd-shape", _set("tensors.w.shape", [2**62, 2**62]), "absurdly large"),
    ("too-many-dims", _set("tensors.w.shape", [1] * 65), "shape"),
    ("shape-not-list", _set("tensors.w.shape", "4x6"), "shape"),
    # dtypes, codecs, checksums, frames
    ("unknown-dtype", _set("tensors.w.dtype", "F128"), "F128"),
    ("dtype-not-string", _set("tensors.w.dtype", 4), "dtype"),
    ("unknown-codec", _set(f"{W0}.codec", "lz4"), "codec"),
    ("crc-count", _set(f"{W0}.crc32c", [1]), "crc32c"),
    ("crc-wide", _set(f"{W0}.crc32c", [1, 2**32]), "crc32c"),
    ("crc-negative", _set(f"{W0}.crc32c", [1, -2]), "crc32c"),
    ("frames-sum", _set("tensors.z.shards.0.frame_lengths", [9, 8]), "frame_lengths"),
    ("frames-count", _set("tensors.z.shards.0.frame_lengths", [16]), "frame_lengths"),
    ("frames-on-raw", _set(f"{W0}.frame_lengths", [32, 16]), "frame_lengths"),
    # structure
    ("tensors-not-object", _set("tensors", []), "tensors"),
    ("shards-not-list", _set("tensors.w.shards", {}), "shards"),
    ("shard-not-object", _set(f"{W0}", 7), "shards[0]"),
    ("files-missing", _set("files", _DELETE), "files"),
    ("values-not-object", _set("values", [1]), "values"),
    ("metadata-not-object", _set("metadata", "x"), "metadata"),
]


@pytest.mark.parametrize("mutate,needle", [(m, n) for _, m, n in BAD_FIELDS], ids=[i for i, _, _ in BAD_FIELDS])
def test_bad_field_is_corrupt_checkpoint_naming_it(mutate: Callable[[dict[str, Any]], None], needle: str) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(CorruptCheckpointError) as ei:
        from_json(_enc(doc), where="s3://b/ck/manifest.json")
    msg = str(ei.value)
    assert needle in msg, msg
    assert "s3://b/ck/manifest.json" in msg


# ------------------------------------------------------------- through storage


@pytest.fixture
def saved(s3_uri: str, s3_opts: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(64, 128, generator=g), "b": torch.randn(1000, generator=g)}
    sc.save(sd, s3_uri, storage_options=s3_opts)
    return sd


def _targets(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def test_bad_manifest_fails_before_any_data_read(
    saved: dict[str, torch.Tensor], s3_uri: str, s3_opts: dict[str, Any], local_s3: LocalS3
) -> None:
    st = Storage(s3_uri, s3_opts)
    doc = json.loads(st.read_bytes("manifest.json"))
    data_file = next(iter(doc["files"]))
    doc["files"]["../../other-ckpt/data.bin"] = {"size": 10}
    st.write_bytes("manifest.json", _enc(doc))
    with FaultProxy(local_s3.endpoint_url, rate=0.0) as counter:
        with pytest.raises(CorruptCheckpointError, match="other-ckpt"):
            sc.load(_targets(saved), s3_uri, storage_options=counter.storage_options)
        touched = [path for _, path, _ in counter.history]
    assert touched, "the manifest was read through the proxy"
    assert not [p for p in touched if data_file in p], touched


def test_manifest_replaced_by_garbage(saved: dict[str, torch.Tensor], s3_uri: str, s3_opts: dict[str, Any]) -> None:
    Storage(s3_uri, s3_opts).write_bytes("manifest.json", b"\x00garbage")
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        sc.load(_targets(saved), s3_uri, storage_options=s3_opts)
    with pytest.raises(CorruptCheckpointError):
        sc.inspect(s3_uri, storage_options=s3_opts)


def test_oversized_manifest_is_refused_without_reading_it(tmp_path: Any) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    with open(ck / "manifest.json", "wb") as f:  # sparse: no disk space, no memory
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CorruptCheckpointError, match="limit"):
        sc.inspect(str(ck))
    assert os.path.getsize(ck / "manifest.json") == MAX_MANIFEST_BYTES + 1


def _data_name(st: Storage) -> str:
    return next(iter(json.loads(st.read_bytes("manifest.json"))["files"]))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_bit_flip_at_rest_is_corrupt_checkpoint_naming_object(
    compression: str | None, s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    g = torch.Generator().manual_seed(4)
    sd = {"w": torch.randn(64, 128, generator=g)}
    sc.save(sd, s3_uri, storage_options=s3_opts, compression=compression)
    st = Storage(s3_uri, s3_opts)
    name = _data_name(st)
    blob = bytearray(st.read_bytes(name))
    blob[len(blob) // 2] ^= 0x10  # inside the tensor's bytes
    st.write_bytes(name, bytes(blob))
    with pytest.raises(CorruptCheckpointError) as ei:
        sc.load(_targets(sd), s3_uri, storage_options=s3_opts)
    assert name in str(ei.value)
    assert "bytes [" in str(ei.value)


def test_truncated_data_object_is_corrupt_checkpoint(
    saved: dict[str, torch.Tensor], s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    st = Storage(s3_uri, s3_opts)
    name = _data_name(st)
    blob = st.read_bytes(name)
    st.write_bytes(name, blob[: len(blob) - 1000])
    with pytest.raises(CorruptCheckpointError) as ei:
        sc.load(_targets(saved), s3_uri, storage_options=s3_opts)
    assert name in str(ei.value)
    assert "truncated" in str(ei.value)


def test_missing_data_object_is_a_checkpoint_error(
    saved: dict[str, torch.Tensor], s3_uri: str, s3_opts: dict[str, Any]
) -> None:
    st = Storage(s3_uri, s3_opts)
    name = _data_name(st)
    st.delete(name)
    with pytest.raises(CorruptCheckpointError) as ei:
        sc.load(_targets(saved), s3_uri, storage_options=s3_opts)
    assert name in str(ei.value) and "manifest" in str(ei.value)
