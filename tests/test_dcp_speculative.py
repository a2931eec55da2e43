"""DCP loads with predicted item layouts: one item located exactly, every other item's
head predicted (``formats.dcplayout``) and verified with the bytes the load reads
anyway (``streamckpt.formats.speculation``); any difference falls back to locating every
item exactly. Real ``torch.save`` / ``dcp.save`` output, the moto S3 server, a
request-counting proxy, real gloo ranks."""

from __future__ import annotations

import io
import logging
import math
import pickle
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import streamckpt as sc
from streamckpt.comm import SoloComm
from streamckpt.core import dtypes, manifest as mf
from streamckpt.errors import CorruptCheckpointError, MissingKeysError
from streamckpt.formats import dcp as dcpfmt, dcpitem, dcplayout, dcpmeta, read_manifest, speculation
from streamckpt.formats.zipdir import central_directory
from streamckpt.loading.loader import LoadRequest, run_load
from streamckpt.plan.planner import PlanOptions
from streamckpt.storage import Storage
from streamckpt.testing import FaultProxy

from distributed import run_ranks
from test_dcp_fast import _dcp_save, _model, _put_dir, _relayout_last_item


def _record(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _head(rec: bytes) -> tuple[bytes, dict[str, int]]:
    """A record's bytes before its tensor data, and its members' sizes."""
    entries = central_directory(rec, 0)
    assert entries is not None
    data = next(e for e in entries if e.filename.endswith("/data/0"))
    name_len, extra_len = int.from_bytes(rec[data.header_offset + 26:data.header_offset + 28], "little"), \
        int.from_bytes(rec[data.header_offset + 28:data.header_offset + 30], "little")
    return rec[:data.header_offset + 30 + name_len + extra_len], {e.filename: e.file_size for e in entries}


def _template() -> dcplayout.Template:
    head, sizes = _head(_record(torch.zeros(5, 7)))
    t = dcplayout.learn(head, sizes, "archive/data.pkl", "archive/data/0", torch.float32, (5, 7))
    assert t is not None
    return t


# ------------------------------------------------------------------ prediction (pure)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn]
_SHAPES = [(), (0,), (3,), (70000,), (5, 7), (0, 3), (3, 0), (300, 300), (2, 3, 4, 5), (1, 2, 1, 3, 2), (3, 100000)]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_predicted_head_is_torch_saves_bytes(dtype: torch.dtype) -> None:
    """Byte for byte what torch.save writes before the tensor data: data.pkl (1-, 2- and
    4-byte ints, v2 and v3 rebuilds), descriptors, local headers, alignment padding."""
    template = dcplayout.Template.from_json(_template().to_json())  # as shipped to other ranks
    assert template is not None
    for shape in _SHAPES:
        want, _ = _head(_record(torch.zeros(shape, dtype=dtype)))
        assert dcplayout.predict(template, dtypes.to_code(dtype), shape) == want, shape


def test_pickle_of_a_numel_past_32_bits_reads_back() -> None:
    """Numels of 2**31 and more (8-byte pickle ints): too big to torch.save here, so the
    pickle is read back by the reader's allow-list unpickler instead."""
    for shape in [(1 << 31,), (3, 1 << 33), (1 << 40, 2)]:
        ref = dcpitem.parse_tensor_pickle(dcplayout.tensor_pickle(torch.float16, shape), where="t")
        assert (ref.storage_numel, ref.size, ref.dtype, ref.storage_offset) == \
            (shape[0] * (shape[1] if len(shape) > 1 else 1), shape, torch.float16, 0)
        assert dcpitem.is_row_major(ref.size, ref.stride)
    assert not dcplayout.predictable("F16", (1 << 31,))  # a 4 GiB member needs ZIP64: located exactly


def test_unusual_template_predicts_nothing() -> None:
    head, sizes = _head(_record(torch.zeros(5, 7)))
    args = ("archive/data.pkl", "archive/data/0", torch.float32, (5, 7))
    assert dcplayout.learn(head, sizes, *args) is not None
    pad = head.index(b"FB")  # data.pkl's padding: another alignment than the writer's rule
    assert dcplayout.learn(head[:pad + 4] + b"Y" + head[pad + 5:], sizes, *args) is None
    assert dcplayout.learn(head, sizes, "archive/data.pkl", "archive/data/0", torch.float32, (7, 5)) is None
    assert dcplayout.learn(head[:-1], sizes, *args) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_tail_shows_the_predicted_layout(dtype: torch.dtype) -> None:
    """An item's tail (its ZIP directory) confirms the prediction for torch.save's own
    records, and refuses one with other strides, another member or shifted bytes."""
    template = _template()
    code = dtypes.to_code(dtype)
    for shape in [(1,), (3,), (5, 7), (300, 300), (2, 3, 4, 5)]:
        rec = _record(torch.zeros(shape, dtype=dtype))
        head, _ = _head(rec)
        data_end = len(head) + math.prod(shape) * dtype.itemsize
        tail = rec[data_end:]
        assert dcplayout.tail_matches(template, code, shape, tail), shape
        assert not dcplayout.tail_matches(template, code, shape, tail[1:] + b"\0")
        assert not dcplayout.tail_matches(template, code, shape, rec[data_end - 1:-1])
        if len(shape) > 1:  # the same shape, saved transposed: only data.pkl's strides (and CRC) differ
            t = torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))
            other = _record(t)
            assert len(other) == len(rec) and not dcplayout.tail_matches(template, code, shape, other[data_end:])
    rec = _record(torch.zeros(5, 7))
    data_end = len(_head(rec)[0]) + 5 * 7 * 4
    assert dcplayout.tail_matches(template, "F32", (5, 7), rec[data_end:])
    tail = rec[data_end:]
    for name in (b"archive/data.pkl", b"archive/byteorder"):  # another content: its CRC in the directory
        at = next(i for i in range(len(tail)) if tail.startswith(b"PK\x01\x02", i) and tail[i + 46:].startswith(name))
        other = tail[:at + 16] + bytes([tail[at + 16] ^ 1]) + tail[at + 17:]
        assert not dcplayout.tail_matches(template, "F32", (5, 7), other), name
    # the member after the tensor data listed one byte off: the data's end is not pinned
    at = next(i for i in range(len(tail)) if tail.startswith(b"PK\x01\x02", i) and tail[i + 46:].startswith(b"archive/version"))
    other = tail[:at + 42] + bytes([tail[at + 42] ^ 1]) + tail[at + 43:]
    assert not dcplayout.tail_matches(template, "F32", (5, 7), other)
    assert not dcplayout.tail_matches(template, "F32", (0, 7), rec[data_end:])  # empty: never by its tail


# ------------------------------------------------------------------ through S3


def _saved(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any], model: dict[str, torch.Tensor]) -> Path:
    _dcp_save(model, tmp_path / "ck")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    return tmp_path / "ck"


def _rows(model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rows [n/4, n/2) of every tensor: a TP rank's slice."""
    out = {}
    for k, v in model.items():
        n = v.shape[0]
        out[k] = sc.ShardedTensor(torch.empty((n // 4,) + tuple(v.shape[1:]), dtype=v.dtype), tuple(v.shape),
                                  (n // 4,) + (0,) * (v.dim() - 1))
    return out


def _spread_model() -> dict[str, torch.Tensor]:
    """Items more than 64 KiB apart: exact locating costs one read per item (+1)."""
    g = torch.Generator().manual_seed(3)
    out = {f"l{i}.w": torch.randn(256, 128, generator=g) for i in range(4)}
    out["emb"] = torch.randn(1024, 64, generator=g).to(torch.bfloat16)
    out["idx"] = torch.arange(40 * 1024, dtype=torch.int64).reshape(40, 1024)
    out["norm"] = torch.randn(128, generator=g)  # small: the template, its head and tail one read
    return out


def _exact_load(state: dict[str, Any], uri: str, opts: dict[str, Any]) -> sc.LoadResult:
    """The load as it was before predictions: the manifest located item by item."""
    storage = Storage(uri, opts)
    try:
        manifest = read_manifest(storage)  # as sc.load looks: manifest.json, *.safetensors, then DCP
        req = LoadRequest(state, strict=True, options=PlanOptions(), transforms=None, manifest=manifest)
        return run_load(SoloComm(), storage, req)
    finally:
        storage.close()


def test_full_and_row_loads_skip_the_locating_batch(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    model = _spread_model()
    _saved(tmp_path, s3_uri, s3_opts, model)
    items = len(model)
    exact_manifest = dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts))
    with FaultProxy(s3_opts["endpoint_url"], rate=0.0) as proxy:  # counts requests, injects nothing
        opts = proxy.storage_options
        # before any data: .metadata, the file's size, the template item (head and tail in one read)
        guessed = dcpfmt.read_dcp_manifest(Storage(s3_uri, opts), speculative=True)
        assert proxy.requests == 3, proxy.history
        before = proxy.requests
        dcpfmt.read_dcp_manifest(Storage(s3_uri, opts))
        locating = proxy.requests - before - 2
        assert locating == len(dcpitem._coalesce(dcpitem._locating_windows(
            dcpmeta.parse_metadata((tmp_path / "ck" / ".metadata").read_bytes(), where="m")))) >= items
        # the predictions are the exact offsets
        assert {k: t.shards for k, t in guessed.tensors.items()} == {k: t.shards for k, t in exact_manifest.tensors.items()}
        heads = speculation.heads_of(guessed)
        # a check is an item's tail and the next item's head: both boundaries of the small
        # "norm" (last: only one), then the rest in pairs, left to right
        assert {(h.tail.key if h.tail else None, h.key) for h in heads} == {
            ("l0.w", "l1.w"), ("l2.w", "l3.w"), ("emb", "idx"), ("idx", "norm")}
        assert {k for h in heads for k, _ in h.chunks()} == set(model) and len(heads) == (items + 1) // 2

        before = proxy.requests
        full = {k: torch.empty_like(v) for k, v in model.items()}
        res = sc.load(full, s3_uri, storage_options=opts)
        for k, v in model.items():
            assert torch.equal(full[k], v), k
        # one read from the first tensor byte to the last: the checks verified on the way
        shards = [s for t in guessed.tensors.values() for s in t.shards]
        last = max(s.byte_offset + s.byte_length for s in shards)
        first = min(s.byte_offset for s in shards)
        assert min(h.start for h in heads) > first  # the first item is checked by its tail
        assert res.requests == 1 and res.bytes_read == last - first
        spec_total = proxy.requests - before
        before = proxy.requests
        exact_full = {k: torch.empty_like(v) for k, v in model.items()}
        exact = _exact_load(exact_full, s3_uri, opts)
        assert exact.requests == res.requests and exact.bytes_read == res.bytes_read
        assert (proxy.requests - before) - spec_total == locating - 1  # one small read instead of the batch
        before = proxy.requests
        sliced = _rows(model)
        res = sc.load(sliced, s3_uri, storage_options=opts)
        for k, v in model.items():
            n = v.shape[0]
            assert torch.equal(sliced[k].local_tensor, v[n // 4:n // 2]), k
        spec_total = proxy.requests - before
        before = proxy.requests
        exact_res = _exact_load(_rows(model), s3_uri, opts)
        exact_total = proxy.requests - before
        # every check is read (alone or with rows near it), concurrently with the data: one
        # request per pair of items beside the slices, not one per item
        assert res.requests <= items + len(heads) < 2 * items
        assert res.bytes_read >= res.bytes_needed + sum(h.length for h in heads)
        assert exact_res.requests == items and exact_total - exact_res.requests == 2 + 2 + locating
        assert spec_total - res.requests == 2 + 3  # manifest.json, a listing for *.safetensors, then as above
        assert res.bytes_needed == exact_res.bytes_needed and res.missing_keys == [] == res.unexpected_keys


def test_a_relaid_item_falls_back_to_exact_locating(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An item written by another ZIP writer (no padding, another order): the prediction
    misses, the load says so and locates every item exactly; the values are right."""
    model = _model()
    _dcp_save(model, tmp_path / "ck")
    _relayout_last_item(tmp_path / "ck", "l1.wq")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    full = {k: torch.empty_like(v) for k, v in model.items()}
    with caplog.at_level(logging.INFO, logger="streamckpt.loading.loader"):
        res = sc.load(full, s3_uri, storage_options=s3_opts)
    for k, v in model.items():
        assert torch.equal(full[k], v), k
    assert "'l1.wq' chunk at [0, 0]" in caplog.text and "locating every item exactly" in caplog.text
    assert res.missing_keys == [] == res.unexpected_keys
    # a slice of another tensor reads no head of the relaid item: no fallback
    caplog.clear()
    part = torch.empty(12, 48)
    with caplog.at_level(logging.INFO, logger="streamckpt.loading.loader"):
        sc.load({"l0.wq": sc.ShardedTensor(part, (48, 48), (12, 0))}, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(part, model["l0.wq"][12:24]) and "locating every item" not in caplog.text


def _corrupt_head(ck: Path, key: str, old: bytes, new: bytes) -> None:
    md = pickle.loads((ck / ".metadata").read_bytes())  # our own test file: plain pickle is fine here
    info = next(s for i, s in md.storage_data.items() if i.fqn == key)
    path = ck / info.relative_path
    data = bytearray(path.read_bytes())
    at = data.index(old, info.offset, info.offset + 2048)
    data[at:at + len(new)] = new  # same length: only the first bytes change
    path.write_bytes(bytes(data))


def test_a_corrupt_head_raises_after_the_fallback(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    model = _model()
    _dcp_save(model, tmp_path / "ck")
    _corrupt_head(tmp_path / "ck", "l2.w1", b"PK\x03\x04\x00\x00\x08\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
                  b"\x00\x00\x00\x00\x00\x00\x00\x00\x0e\x00", b"XX")  # the storage record's local header
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    full = {k: torch.empty_like(v) for k, v in model.items()}
    with pytest.raises(CorruptCheckpointError, match=r"'l2\.w1'.*bad local header"):
        sc.load(full, s3_uri, storage_options=s3_opts)


def test_a_transposed_item_is_never_read_as_row_major(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """DCP keeps a transposed tensor's strides: the predicted contiguous pickle differs, the
    load falls back, and exact locating refuses the view as before (no wrong values)."""
    t = torch.arange(12.0).reshape(3, 4)
    _saved(tmp_path, s3_uri, s3_opts, {"a": torch.randn(4, 4), "t": t.t()})
    with pytest.raises(CorruptCheckpointError, match=r"'t'.*stride \[1, 4\].*not a row-major"):
        sc.load({"a": torch.empty(4, 4), "t": torch.empty(4, 3)}, s3_uri, storage_options=s3_opts)


def test_a_transposed_item_checked_by_its_tail_falls_back(tmp_path: Path, s3_uri: str,
                                                          s3_opts: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A square tensor saved transposed, first of a pair: its prediction is checked by its
    tail (the next item's head is in the same check). The directory's data.pkl CRC differs,
    the load falls back, and exact locating refuses the view; a load of the other item
    alone does not verify that tail and needs no fallback."""
    t = torch.arange(16.0).reshape(4, 4)
    other = torch.randn(4, 4)
    _saved(tmp_path, s3_uri, s3_opts, {"t": t.t(), "b": other, "tiny": torch.randn(1)})
    guessed = dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True)
    pair = next(h for h in speculation.heads_of(guessed, {"t"}))
    assert pair.tail is not None and pair.tail.key == "t" and pair.key == "b", pair
    with pytest.raises(CorruptCheckpointError, match=r"'t'.*stride \[1, 4\].*not a row-major"):
        sc.load({"t": torch.empty(4, 4), "b": torch.empty(4, 4)}, s3_uri, storage_options=s3_opts, strict=False)
    with pytest.raises(CorruptCheckpointError, match=r"'t'.*not a row-major"):
        sc.load({"t": sc.ShardedTensor(torch.empty(1, 4), (4, 4), (1, 0))}, s3_uri, storage_options=s3_opts,
                strict=False)
    got = torch.empty(4, 4)
    with caplog.at_level(logging.INFO, logger="streamckpt.loading.loader"):
        res = sc.load({"b": got}, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(got, other) and "locating every item" not in caplog.text
    # b is small: both its boundaries are checks, one read with its data (t's tail unverified)
    around = speculation.heads_of(guessed, {"b"})
    assert [(h.tail.key, h.key) for h in around] == [("t", "b"), ("b", "tiny")]
    assert res.requests == 1 and res.bytes_read == sum(h.length for h in around) + 4 * 4 * 4


def test_inspect_and_key_checks_see_no_heads(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    model = _model()
    _saved(tmp_path, s3_uri, s3_opts, model)
    info = sc.inspect(s3_uri, storage_options=s3_opts)
    assert set(info.tensors) == set(model) and dcpfmt.SPECULATION_KEY not in info.metadata
    with pytest.raises(MissingKeysError) as e:
        sc.load({"embed": torch.empty(64, 48), "nope": torch.empty(2)}, s3_uri, storage_options=s3_opts)
    assert e.value.missing_keys == ["nope"]
    res = sc.load({"embed": (embed := torch.empty(64, 48)), "nope": torch.empty(2)}, s3_uri,
                  storage_options=s3_opts, strict=False)
    assert torch.equal(embed, model["embed"])
    assert res.missing_keys == ["nope"] and res.unexpected_keys == sorted(set(model) - {"embed"})
    assert res.bytes_needed == 64 * 48 * 4
    # the predicted layout survives the JSON a multi-rank load ships
    m = dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True)
    back = mf.from_json(mf.to_json(m))
    assert speculation.heads_of(back) == speculation.heads_of(m) and back.tensors == m.tensors


def load_one_key(rank: int, world: int, uri: str, opts: dict[str, Any], keys: list[str],
                 shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Each rank loads one tensor, whole; the caller compares."""
    key = keys[rank]
    out = {key: torch.empty(shapes[key], dtype=torch.float32)}
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.INFO)
    lg = logging.getLogger("streamckpt.loading.loader")
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        sc.load(out, uri, storage_options=opts)
    finally:
        lg.removeHandler(handler)
    return {"values": out[key].flatten().tolist(), "fell_back": any("locating every item" in r for r in records)}


def test_two_ranks_fall_back_together(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Only rank 1's item was relaid: rank 1's check fails, both ranks reload exactly."""
    model = {"a": torch.randn(8, 6), "b": torch.randn(5, 6), "tiny": torch.randn(1)}  # "tiny": the template
    _dcp_save(model, tmp_path / "ck")
    _relayout_last_item(tmp_path / "ck", "b")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    fs = fsspec.filesystem("s3", **s3_opts)
    assert fs.exists(f"{s3_uri}/.metadata")
    ranks = run_ranks(2, load_one_key, kwargs={"uri": s3_uri, "opts": s3_opts, "keys": ["a", "b"],
                                              "shapes": {k: list(v.shape) for k, v in model.items()}}, timeout=180)
    values = [r.unwrap() for r in ranks]
    assert values[0]["values"] == model["a"].flatten().tolist()
    assert values[1]["values"] == model["b"].flatten().tolist()
    assert values[0]["fell_back"] and values[1]["fell_back"], values


def test_transforms_with_a_predicted_manifest_verify_every_head(tmp_path: Path, s3_uri: str,
                                                                s3_opts: dict[str, Any]) -> None:
    """A rank with transforms may get a predicted manifest from a rank 0 without them:
    it verifies every item's head (it cannot map its targets to chunks cheaply), through
    the transformed view; a relaid item still falls back and loads right."""
    from streamckpt.transforms import as_transforms

    model = {"p0": torch.randn(6, 4), "p1": torch.randn(2, 4), "tiny": torch.randn(1)}
    _dcp_save(model, tmp_path / "ck")
    _relayout_last_item(tmp_path / "ck", "p1")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    storage = Storage(s3_uri, s3_opts)
    guessed = dcpfmt.read_dcp_manifest(storage, speculative=True)
    assert dcpfmt.SPECULATION_KEY in guessed.metadata
    rules = as_transforms([{"fuse": {"from": ["p0", "p1"], "to": "fused", "dim": 0}}])
    out = {"fused": torch.zeros(8, 4)}
    req = LoadRequest(out, strict=False, options=PlanOptions(), transforms=rules, manifest=guessed)
    res = run_load(SoloComm(), storage, req)
    assert torch.equal(out["fused"], torch.cat([model["p0"], model["p1"]]))
    assert res.unexpected_keys == ["tiny"] and res.missing_keys == []
    # and where every prediction holds, the transformed load takes it
    whole = {"fused": torch.zeros(6 + 2, 4)}
    _dcp_save(model, tmp_path / "ck2")
    _put_dir(tmp_path / "ck2", s3_uri + "-2", s3_opts)
    storage2 = Storage(s3_uri + "-2", s3_opts)
    req = LoadRequest(whole, strict=False, options=PlanOptions(), transforms=rules,
                      manifest=dcpfmt.read_dcp_manifest(storage2, speculative=True))
    res = run_load(SoloComm(), storage2, req)
    assert torch.equal(whole["fused"], torch.cat([model["p0"], model["p1"]]))
    assert res.bytes_read >= res.bytes_needed + sum(len(h.expected) for h in speculation.heads_of(req.manifest))
