"""Hypothesis fuzzing of everything that parses untrusted metadata: format-v1 manifests,
safetensors headers, DCP metadata pickles. Only CheckpointError subclasses may come
out and no allocation tracks a claimed size (traced peak proportional to the input). No
per-example time limit: speed is not asserted here, and a hang is caught by the suite's
per-test timeout (pytest-timeout, pyproject.toml)."""

from __future__ import annotations

import copy
import json
import math
import pickle
import struct
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamckpt.core.manifest import FORMAT_VERSION, Manifest, from_json, to_json
from streamckpt.errors import CheckpointError
from streamckpt.formats import dcpmeta, hf, safepickle

FUZZ = settings(
    derandomize=True,  # seeded: CI sees the same examples every run
    max_examples=150,
    deadline=None,  # no wall-clock threshold: a loaded CI machine must not fail a correct parser
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I8": 1, "BOOL": 1, "F64": 8}


def _expect_checkpoint_error_or_value(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; anything raised must be a CheckpointError."""
    try:
        return fn()
    except CheckpointError as e:
        assert str(e), "errors carry a message"
        return None


def _bounded_memory(fn: Callable[[], Any], input_len: int) -> Any:
    """Run ``fn`` and check its peak traced allocation stays proportional to its input."""
    tracemalloc.start()
    try:
        out = _expect_checkpoint_error_or_value(fn)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * input_len + (8 << 20), f"{peak} bytes allocated for a {input_len}-byte input"
    return out


# ------------------------------------------------------------- valid manifests


@st.composite
def valid_docs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid manifest: tensors of random shape and dtype, split in rows (or flat ranges)."""
    files: dict[str, int] = {}
    tensors: dict[str, Any] = {}
    pos = 8
    fname = "data/00000-0000.safetensors"
    for ti in range(draw(st.integers(1, 3))):
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        code = draw(st.sampled_from(sorted(DTYPES)))
        size = DTYPES[code]
        numel = math.prod(shape)
        shards = []
        if shape and shape[0] > 1 and draw(st.booleans()):
            cut = draw(st.integers(1, shape[0] - 1))
            row = math.prod(shape[1:])
            for lo, hi in ((0, cut), (cut, shape[0])):
                n = (hi - lo) * row * size
                shards.append({"offset": [lo] + [0] * (len(shape) - 1), "shape": [hi - lo] + shape[1:],
                               "file": fname, "byte_offset": pos, "byte_length": n, "codec": "raw",
                               "chunk_size": 0})
                pos += n
        elif numel > 1 and draw(st.booleans()):
            cut = draw(st.integers(1, numel - 1))
            for a, b in ((0, cut), (cut, numel)):
                n = (b - a) * size
                shards.append({"offset": [0] * len(shape), "shape": list(shape), "flat_range": [a, b],
                               "file": fname, "byte_offset": pos, "byte_length": n, "codec": "raw",
                               "chunk_size": 0})
                pos += n
        else:
            n = numel * size
            chunk = draw(st.integers(1, 64))
            crcs = [draw(st.integers(0, 2**32 - 1)) for _ in range(-(-n // chunk))] if n else []
            shards.append({"offset": [0] * len(shape), "shape": list(shape), "file": fname,
                           "byte_offset": pos, "byte_length": n, "codec": "raw",
                           "chunk_size": chunk if n else 0, **({"crc32c": crcs} if n else {})})
            pos += n
        tensors[f"t{ti}"] = {"dtype": code, "shape": list(shape), "shards": shards}
    files[fname] = pos + draw(st.integers(0, 16))
    return {"format": "streamckpt", "version": FORMAT_VERSION, "files": {f: {"size": s} for f, s in files.items()},
            "tensors": tensors, "values": {"step": 1}, "metadata": {}}


@FUZZ
@given(valid_docs())
def test_generated_valid_manifests_parse_and_round_trip(doc: dict[str, Any]) -> None:
    m = from_json(json.dumps(doc).encode())
    again = from_json(to_json(m))
    assert again.tensors == m.tensors and again.files == m.files


# ------------------------------------------------------------- mutations

NASTY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2**31, 2**32, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "..", "../x", "/etc/passwd", "s3://other/x", "//b/x", "a/../../b", "F32", "zstd",
                     "raw", "C:x", "x\x00", "\u2025", "data/00000-0000.safetensors"]),
    st.text(max_size=8),
    st.lists(st.integers(-3, 2**40), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _leaves(v, path + (i,))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return doc


@FUZZ
@given(valid_docs(), st.lists(st.tuples(st.integers(0, 10**6), NASTY), min_size=1, max_size=4))
def test_mutated_manifests_raise_only_checkpoint_errors(
    doc: dict[str, Any], mutations: list[tuple[int, Any]]
) -> None:
    doc = copy.deepcopy(doc)
    for pick, value in mutations:
        paths = _leaves(doc)
        doc = _replace(doc, paths[pick % len(paths)], value)
    data = json.dumps(doc).encode()
    m = _bounded_memory(lambda: from_json(data), len(data))
    if m is not None:  # accepted: then its invariants really hold
        _check_invariants(m)


def _check_invariants(m: Manifest) -> None:
    for key, t in m.tensors.items():
        numel = math.prod(t.shape)
        assert sum(s.numel for s in t.shards) == numel, key
        for s in t.shards:
            assert s.file in m.files
            assert 0 <= s.byte_offset and s.byte_offset + s.byte_length <= m.files[s.file]
            assert ".." not in s.file.split("/") and not s.file.startswith("/") and "://" not in s.file
            assert all(0 <= o and o + n <= d for o, n, d in zip(s.offset, s.shape, t.shape)) or numel == 0


@FUZZ
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
))
def test_arbitrary_json_manifests(doc: Any) -> None:
    if isinstance(doc, dict) and doc:  # make the interesting branches reachable
        doc.setdefault("format", "streamckpt")
        doc.setdefault("version", FORMAT_VERSION)
    data = json.dumps(doc).encode()
    _expect_checkpoint_error_or_value(lambda: from_json(data))


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_manifests(data: bytes) -> None:
    _expect_checkpoint_error_or_value(lambda: from_json(data))


# ------------------------------------------------------------- safetensors headers


@FUZZ
@given(st.binary(min_size=0, max_size=16), st.integers(0, 2**64))
def test_safetensors_header_length_is_bounded(prefix: bytes, file_size: int) -> None:
    n = _expect_checkpoint_error_or_value(lambda: hf.header_length(prefix, file_size, where="f.safetensors"))
    if n is not None:
        assert 2 <= n <= hf.MAX_HEADER_BYTES and 8 + n <= file_size


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A safetensors JSON header (often almost valid) and a file size."""
    doc: dict[str, Any] = {}
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        code = draw(st.sampled_from(sorted(DTYPES) + ["F128", "", "f32"]))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        n = math.prod(shape) * DTYPES.get(code, 4)
        entry: dict[str, Any] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + n]}
        if draw(st.integers(0, 4)) == 0:
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(NASTY)
        doc[draw(st.text(max_size=6)) if draw(st.booleans()) else f"t{i}"] = entry
        pos += n
    if draw(st.booleans()):
        doc["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4)), NASTY))
    raw = json.dumps(doc).encode()
    return raw, 8 + len(raw) + pos + draw(st.integers(-8, 8))


@FUZZ
@given(headers())
def test_safetensors_headers_raise_only_checkpoint_errors(case: tuple[bytes, int]) -> None:
    raw, file_size = case
    parsed = _bounded_memory(lambda: hf.parse_header(raw, file_size, where="f.safetensors"), len(raw))
    if parsed is not None:
        spans = sorted((e.start, e.stop) for e in parsed.entries if e.stop > e.start)
        assert all(8 + len(raw) <= a <= b <= file_size for a, b in spans)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))  # no two tensors share bytes


@FUZZ
@given(st.binary(max_size=200))
def test_safetensors_header_garbage(raw: bytes) -> None:
    _expect_checkpoint_error_or_value(lambda: hf.parse_header(raw, 8 + len(raw) + 100, where="f.safetensors"))


# ------------------------------------------------------------- DCP metadata


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: Any) -> Path:
    """A real checkpoint written by torch.distributed.checkpoint (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp_api

    path = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp_api.save({"w": torch.arange(12.0).reshape(3, 4), "step": 3},
                     storage_writer=dcp_api.FileSystemWriter(str(path)))
    return path


@pytest.fixture(scope="module")
def dcp_metadata(dcp_dir: Path) -> bytes:
    """The real checkpoint's ``.metadata``."""
    return (dcp_dir / ".metadata").read_bytes()


def test_real_dcp_metadata_parses(dcp_dir: Path, dcp_metadata: bytes) -> None:
    import io

    import torch

    md = dcpmeta.parse_metadata(dcp_metadata, where=".metadata")
    assert set(md.tensors) == {"w"} and set(md.values) == {"step"}
    w = md.tensors["w"]
    assert (w.dtype, w.shape) == ("F32", (3, 4))
    assert [(off, size) for off, size, _ in w.chunks] == [((0, 0), (3, 4))]
    # every item's (file, offset, length) addresses exactly its torch.save record
    data = (dcp_dir / w.chunks[0][2].file).read_bytes()
    items = [w.chunks[0][2], md.values["step"]]
    assert all(i.file == items[0].file and 0 <= i.offset and i.offset + i.length <= len(data) for i in items)
    tensor, step = (torch.load(io.BytesIO(data[i.offset:i.offset + i.length]), weights_only=True) for i in items)
    assert torch.equal(tensor, torch.arange(12.0).reshape(3, 4))
    assert step == 3


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_corrupted_dcp_metadata_raises_only_checkpoint_errors(dcp_metadata: bytes, data: st.DataObject) -> None:
    blob = bytearray(dcp_metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    raw = bytes(blob)
    _bounded_memory(lambda: dcpmeta.parse_metadata(raw, where=".metadata"), len(raw))


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_dcp_metadata(raw: bytes) -> None:
    _bounded_memory(lambda: dcpmeta.parse_metadata(raw, where=".metadata"), len(raw))


# ------------------------------------------------------------- hostile sizes


def test_hostile_claimed_sizes_do_not_allocate() -> None:
    """Inputs that *claim* enormous sizes are refused without allocating them."""
    cases: list[tuple[Callable[[], Any], int]] = [
        (lambda: hf.header_length(struct.pack("<Q", 2**63), 2**64, where="f"), 8),
        (lambda: hf.header_length(struct.pack("<Q", 90 << 20), 1000, where="f"), 8),
        (lambda: hf.parse_header(b'{"x":{"dtype":"F32","shape":[4294967296,4294967296],'
                                 b'"data_offsets":[0,8]}}', 100, where="f"), 80),
    ]
    big_shape = json.dumps({
        "format": "streamckpt", "version": 1, "files": {"d": {"size": 8}},
        "tensors": {"x": {"dtype": "F32", "shape": [2**40], "shards": [
            {"offset": [0], "shape": [2**40], "file": "d", "byte_offset": 0, "byte_length": 4 * 2**40,
             "codec": "raw", "chunk_size": 1, "crc32c": []}]}},
    }).encode()
    cases.append((lambda: from_json(big_shape), len(big_shape)))
    for fn, n in cases:
        tracemalloc.start()
        try:
            with pytest.raises(CheckpointError):
                fn()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak


def test_dcp_memo_index_bomb_is_refused_without_allocating() -> None:
    """pickle's memo grows to the index a PUT names: 12 bytes could ask for GiBs."""
    bomb = b"\x80\x04N" + b"r" + struct.pack("<I", 2**22) + b"."  # LONG_BINPUT 4 Mi -> 64 MiB memo
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError):
            dcpmeta.parse_metadata(bomb, where=".metadata")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a {len(bomb)}-byte pickle"


def test_hostile_pickles_run_nothing(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    for payload in (pickle.dumps(Evil()), pickle.dumps({"a": Evil()}), pickle.dumps([1, Evil()], protocol=0)):
        with pytest.raises(CheckpointError):
            dcpmeta.parse_metadata(payload, where=".metadata")
    assert not marker.exists()


def _genops_memo_verdict(data: bytes) -> str:
    """The memo pre-scan as ``pickletools.genops`` walks the stream (the reference the
    direct walker in ``safepickle.check_memo`` must agree with): "ok", "memo" or "malformed"."""
    import pickletools

    filled: set[int] = set()
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name == "MEMOIZE":
                filled.add(len(filled))
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if not isinstance(arg, int) or arg < 0 or arg > len(filled):
                    return "memo"
                filled.add(arg)
            elif op.name in ("GET", "BINGET", "LONG_BINGET") and arg not in filled:
                return "memo"
    except Exception:  # noqa: BLE001
        return "malformed"
    return "ok"


def _direct_memo_verdict(data: bytes) -> str:
    try:
        safepickle.check_memo(data, where="p")
    except CheckpointError as e:
        return "malformed" if "malformed" in str(e) else "memo"
    return "ok"


_PICKLES = [pickle.dumps(obj, protocol=p) for p in range(6) for obj in (
    {"a": [1, 2.5, "x", b"yz", (3, 4)], "b": {"c": None, "d": True}, "big": 2**70, "neg": -5},
    [[1, 2]] * 3 + [{"k": "v"}] * 2, ("s" * 300, b"b" * 300, 10**30),
)]


@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_direct_memo_scan_agrees_with_genops(dcp_metadata: bytes, data: st.DataObject) -> None:
    """Same opcode boundaries, same verdict, on real pickles of every protocol and mutated ones
    (a walker that disagreed could be made to miss a PUT hidden in an argument)."""
    base = data.draw(st.sampled_from([dcp_metadata, *_PICKLES]))
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(0, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.sampled_from([0, 1, 10, 0x7F, 0x80, 0xFF, *b"pqrhjg\x94.(NK"]))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    raw = bytes(blob)
    want = _genops_memo_verdict(raw)
    got = _direct_memo_verdict(raw)
    # genops also stops at some argument *contents* (a STRING without quotes, a bad float) that
    # the unpickler refuses just the same, while the direct walker goes on (and may then find a
    # bad memo index): wherever genops walks the whole stream, the two must agree
    assert got == want or want == "malformed", (want, got, raw[:80])
