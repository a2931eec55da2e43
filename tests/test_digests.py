"""Content digests (xxh3-128 of each shard's raw bytes) in the manifest, and the format-v2
fields of an incremental checkpoint (``bases``, files referenced in sibling checkpoints):
what a valid manifest holds and what validation refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xxhash

import streamckpt as sc
from streamckpt.core.manifest import from_json, to_json
from streamckpt.errors import CorruptCheckpointError, UnsupportedVersionError

REF = "../step-1/data/00000-0000.safetensors"


def _manifest(path: str) -> dict[str, Any]:
    with open(f"{path}/manifest.json", "rb") as f:
        return json.load(f)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_shard_records_the_xxh3_128_of_its_raw_bytes(tmp_path: Any, compression: str | None) -> None:
    w = torch.arange(3000, dtype=torch.float32).reshape(30, 100)
    flat = torch.arange(100, dtype=torch.int64)
    sd = {"w": w, "half": w.to(torch.bfloat16),
          "z": sc.ShardedTensor(flat, (10, 10), (0, 0), local_shape=(10, 10), flat_range=(0, 100))}
    sc.save(sd, str(tmp_path), compression=compression)
    doc = _manifest(str(tmp_path))
    assert doc["version"] == 1 and "bases" not in doc  # a full checkpoint keeps format version 1

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16 else \
            t.view(torch.int16).numpy().tobytes()

    expected = {"w": raw(w), "half": raw(w.to(torch.bfloat16)), "z": raw(flat)}
    for key, data in expected.items():
        (shard,) = doc["tensors"][key]["shards"]
        assert shard["digest"] == xxhash.xxh3_128(data).hexdigest()
        assert len(shard["digest"]) == 32
    assert sc.load_full(str(tmp_path))["w"].equal(w)


def _v2() -> dict[str, Any]:
    return {
        "format": "streamckpt", "version": 2, "bases": ["step-1"],
        "files": {"data/00000-0000.safetensors": {"size": 100}, REF: {"size": 200}},
        "tensors": {"w": {"dtype": "F32", "shape": [4, 4], "shards": [
            {"offset": [0, 0], "shape": [2, 4], "file": "data/00000-0000.safetensors", "byte_offset": 8,
             "byte_length": 32, "codec": "raw", "chunk_size": 32, "crc32c": [1], "digest": "0" * 32},
            {"offset": [2, 0], "shape": [2, 4], "file": REF, "byte_offset": 64, "byte_length": 32,
             "codec": "raw", "chunk_size": 32, "crc32c": [2], "digest": "ab" * 16},
        ]}},
        "values": {}, "metadata": {},
    }


def test_a_manifest_with_references_is_version_2_and_round_trips() -> None:
    m = from_json(json.dumps(_v2()).encode())
    assert m.bases == ("step-1",)
    assert m.tensors["w"].shards[1].file == REF and m.tensors["w"].shards[1].digest == "ab" * 16
    again = json.loads(to_json(m))
    assert again["version"] == 2 and again["bases"] == ["step-1"] and REF in again["files"]


def _refuse(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("name", ["../../other/data/x", "../step-1/../../x", "../step-1/data/../../x",
                                  "../step-2/data/x", "../s3:/other-bucket/x", "..//data/x", "../step-1/"])
def test_references_outside_a_listed_sibling_are_refused(name: str) -> None:
    doc = _v2()
    doc["files"][name] = doc["files"].pop(REF)
    doc["tensors"]["w"]["shards"][1]["file"] = name
    _refuse(doc, "file")


def test_other_buckets_and_hostile_bases_are_refused() -> None:
    for bases in (["s3://other-bucket"], [".."], ["a/b"], [""], "step-1"):
        doc = _v2()
        doc["bases"] = bases
        _refuse(doc, "base")


def test_bases_need_version_2_and_digests_must_be_128_bit_hex() -> None:
    doc = _v2()
    doc["version"] = 1
    _refuse(doc, "'bases' needs format version 2")
    no_bases = _v2()
    del no_bases["bases"]
    no_bases["version"] = 1
    _refuse(no_bases, "not a sibling checkpoint listed")  # a v1 manifest never holds a reference
    for digest in ("AB" * 16, "ab" * 15, "xy" * 16, 7):
        doc = _v2()
        doc["tensors"]["w"]["shards"][0]["digest"] = digest
        _refuse(doc, "digest")


def test_versions_past_2_are_their_own_error() -> None:
    doc = _v2()
    doc["version"] = 3
    with pytest.raises(UnsupportedVersionError, match="versions 1, 2"):
        from_json(json.dumps(doc).encode())
