"""DCP loads at the cost of the HF path: items located from their central directory
(parsed directly, ``zipfile`` only as a fallback), ``.metadata`` in one GET, and a full
load's reads merged across the ZIP headers between items. Real ``dcp.save`` output
on the moto S3 server, counted by a request-counting proxy."""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import streamckpt as sc
from streamckpt.core.manifest import Manifest, Shard, TensorMeta
from streamckpt.core.targets import target_of
from streamckpt.errors import CorruptCheckpointError
from streamckpt.formats import dcp as dcpfmt, dcpitem, speculation
from streamckpt.formats.zipdir import central_directory
from streamckpt.plan.planner import build_plan
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _put_dir(local: Path, uri: str, opts: dict[str, Any]) -> None:
    fs = fsspec.filesystem("s3", **opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{uri}/{p.name}")


def _model() -> dict[str, torch.Tensor]:
    """A small llama-like state: matrices, norms, mixed dtypes, every row count a multiple of 4."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {"embed": torch.randn(64, 48, generator=g)}
    for i in range(3):
        out[f"l{i}.norm"] = torch.randn(48, generator=g).to(torch.bfloat16).repeat(4).reshape(4, 48)
        out[f"l{i}.wq"] = torch.randn(48, 48, generator=g)
        out[f"l{i}.w1"] = torch.randn(128, 48, generator=g).to(torch.bfloat16)
        out[f"l{i}.idx"] = torch.arange(4 * 9, dtype=torch.int64).reshape(4, 9) + i
    return out


def _torch_save_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


# ------------------------------------------------------------- through the proxy


def test_full_and_sliced_loads_are_exact_with_few_requests(tmp_path: Path, s3_uri: str,
                                                          s3_opts: dict[str, Any]) -> None:
    model = _model()
    _dcp_save(model, tmp_path / "ck")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    items = len(model)
    with FaultProxy(s3_opts["endpoint_url"], rate=0.0) as proxy:  # counts requests, injects nothing
        opts = proxy.storage_options
        full = {k: torch.empty_like(v) for k, v in model.items()}
        res = sc.load(full, s3_uri, storage_options=opts)
        for k, v in model.items():
            assert torch.equal(full[k], v), k
        history = proxy.history
        # .metadata: one GET, no HEAD or listing of it first
        assert [m for m, p, _ in history if p.endswith("/.metadata")] == ["GET"], history
        # the data: every item is in one file of < 100 KiB, so one read from the first tensor
        # byte to the last, merged across the ZIP headers between items, not one per item
        # (from the first item's head: the predicted heads are verified with the same read)
        guessed = dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True)
        shards = [s for t in guessed.tensors.values() for s in t.shards]
        heads = speculation.heads_of(guessed)
        first = min(min(s.byte_offset for s in shards), min(h.start for h in heads))
        last = max(s.byte_offset + s.byte_length for s in shards)
        assert res.requests == 1, res
        assert res.bytes_read == last - first
        # every tensor byte (and every check) landed in its target
        assert res.bytes_direct == res.bytes_needed + sum(h.length for h in heads)
        # locating: one item (head and tail in one read); the others are predicted
        distcp_gets = [p for m, p, _ in history if m == "GET" and p.endswith(".distcp")]
        assert len(distcp_gets) - res.requests == 1, history

        before = proxy.requests
        sliced = {}
        for k, v in model.items():  # rows [n/4, n/2): a TP rank's slice of every tensor
            n = v.shape[0]
            sliced[k] = sc.ShardedTensor(torch.empty((n // 4,) + tuple(v.shape[1:]), dtype=v.dtype),
                                         tuple(v.shape), (n // 4,) + (0,) * (v.dim() - 1))
        res = sc.load(sliced, s3_uri, storage_options=opts)
        for k, v in model.items():
            n = v.shape[0]
            assert torch.equal(sliced[k].local_tensor, v[n // 4:n // 2]), k
        # the items are small: the gaps between slices and checks (rows of the same items,
        # ZIP records) are far cheaper to read through than a request each, so one read
        # spans them all (it would be one request per slice and per check otherwise)
        spans = [(h.start, h.start + h.length) for h in heads]
        for k, v in model.items():
            s0 = guessed.tensors[k].shards[0]
            row = s0.byte_length // v.shape[0]
            spans.append((s0.byte_offset + v.shape[0] // 4 * row, s0.byte_offset + v.shape[0] // 2 * row))
        assert res.requests == 1 and res.bytes_read == max(b for _, b in spans) - min(a for a, _ in spans), res
        assert res.bytes_read < 8 * (res.bytes_needed + sum(h.length for h in heads))
        assert proxy.requests - before == 2 + 1 + 1 + 1 + res.requests


# ------------------------------------------------------- the direct ZIP directory


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 7), torch.arange(10, dtype=torch.int16), torch.tensor(2.5, dtype=torch.float64),
    torch.zeros(0, 3), torch.ones(300, 300).to(torch.bfloat16), torch.tensor([True, False]),
])
def test_direct_directory_matches_zipfile(tensor: torch.Tensor) -> None:
    """For records as torch.save writes them, the direct parse finds what zipfile finds."""
    rec = _torch_save_bytes(tensor)
    want = [(z.filename, z.compress_type, z.file_size, z.header_offset)
            for z in zipfile.ZipFile(io.BytesIO(rec)).infolist()]
    for tail_len in (len(rec), dcpitem.TAIL_BYTES):
        start = max(0, len(rec) - tail_len)
        got = central_directory(rec[start:], start)
        assert got is not None
        assert [(e.filename, e.compress_type, e.file_size, e.header_offset) for e in got] == want


def _mutated(rec: bytes, kind: str) -> bytes:
    b = bytearray(rec)
    eocd = len(b) - 22
    if kind == "comment":
        b[eocd + 20:eocd + 22] = (1).to_bytes(2, "little")
        b += b"x"
    elif kind == "disagreeing end records":  # the 32-bit record names another directory offset
        off = struct.unpack("<I", b[eocd + 16:eocd + 20])[0]
        b[eocd + 16:eocd + 20] = struct.pack("<I", off + 46)
    elif kind == "directory outside the tail":
        z64 = b.rindex(b"PK\x06\x06")
        b[z64 + 48:z64 + 56] = (0).to_bytes(8, "little")
    elif kind == "compressed member":
        cd = b.index(b"PK\x01\x02")
        b[cd + 10:cd + 12] = (8).to_bytes(2, "little")
    elif kind == "not a zip":
        b[eocd:eocd + 4] = b"XXXX"
    return bytes(b)


@pytest.mark.parametrize("kind", ["comment", "disagreeing end records", "directory outside the tail",
                                  "compressed member", "not a zip"])
def test_direct_directory_declines_what_it_does_not_know(kind: str) -> None:
    """Anything but the plain layout goes to zipfile, which loads it or names the fault."""
    rec = _torch_save_bytes(torch.randn(1000))
    bad = _mutated(rec, kind)
    start = len(bad) - dcpitem.TAIL_BYTES
    assert central_directory(bad[start:], start) is None


def _relayout_last_item(ck: Path, key: str) -> None:
    """Rewrite ``key``'s item as a ZIP made by Python's zipfile (no alignment padding,
    no ZIP64 records, an archive comment) appended to its file, and point .metadata at it:
    the direct parse declines it and the zipfile path must locate the tensor."""
    md = pickle.loads((ck / ".metadata").read_bytes())  # our own test file: plain pickle is fine here
    (idx, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == key]
    path = ck / info.relative_path
    data = path.read_bytes()
    old = zipfile.ZipFile(io.BytesIO(data[info.offset:info.offset + info.length]))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for zi in old.infolist():
            z.writestr(zi.filename, old.read(zi.filename))
        z.comment = b"rewritten"
    path.write_bytes(data + buf.getvalue())
    md.storage_data[idx] = dataclasses.replace(info, offset=len(data), length=len(buf.getvalue()))
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def test_record_in_another_layout_still_loads(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    model = _model()
    _dcp_save(model, tmp_path / "ck")
    _relayout_last_item(tmp_path / "ck", "l1.wq")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    full = {k: torch.empty_like(v) for k, v in model.items()}
    sc.load(full, s3_uri, storage_options=s3_opts)
    for k, v in model.items():
        assert torch.equal(full[k], v), k
    part = torch.empty(12, 48)
    sc.load({"l1.wq": sc.ShardedTensor(part, (48, 48), (12, 0))}, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(part, model["l1.wq"][12:24])


def test_hostile_end_records_are_refused_clearly(tmp_path: Path) -> None:
    """A record whose end records disagree is not guessed at: zipfile's reading of it
    either locates a valid tensor or the load names the item."""
    _dcp_save({"w": torch.randn(64, 64)}, tmp_path / "ck")
    distcp = next((tmp_path / "ck").glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    z64 = data.rindex(b"PK\x06\x06")
    data[z64 + 48:z64 + 56] = (7).to_bytes(8, "little")  # the directory "starts" inside the tensor bytes
    distcp.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp.*'w'"):
        dcpfmt.read_dcp_manifest(Storage(str(tmp_path / "ck")))


# ----------------------------------------------------------- planning across gaps


def _gapped_manifest() -> Manifest:
    """Three 4 KiB tensors in one file: a 100-byte header before each (as between DCP items)."""
    shards = {}
    for i, k in enumerate("abc"):
        shards[k] = TensorMeta("F32", (1024,), (Shard(offset=(0,), shape=(1024,), file="f", byte_offset=100 + i * 4196,
                                                            byte_length=4096, codec="raw", chunk_size=0),))
    return Manifest(tensors=shards, files={"f": 3 * 4196}, kind="dcp")


def _reads(m: Manifest, keys: str) -> list[tuple[int, int]]:
    specs = [target_of(k, torch.empty(1024)).spec for k in keys]
    return [(r.start, r.stop) for r in build_plan(m, [specs], rank=0).reads]


def test_reads_merge_across_gaps_without_tensor_bytes() -> None:
    m = _gapped_manifest()
    assert _reads(m, "abc") == [(100, 3 * 4196)]  # one read: the headers between are bare
    assert _reads(m, "ab") == [(100, 100 + 4196 + 4096)]
    # never through another tensor's bytes: b lies between a and c
    assert sorted(_reads(m, "ac")) == [(100, 4196), (100 + 2 * 4196, 3 * 4196)]
