"""PyTorch DCP checkpoints written by torch's own ``dcp.save`` (one process, and a
2-rank DTensor save in real gloo subprocesses), read in place: the restricted
unpickler refuses hostile ``.metadata`` without running it, and every chunk's
located byte range holds exactly the tensor's bytes."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from streamckpt.core.manifest import Manifest
from streamckpt.errors import CorruptCheckpointError
from streamckpt.formats import dcp as dcpfmt, dcpitem, dcpmeta, safepickle
from streamckpt.formats.dcp import read_dcp_manifest
from streamckpt.storage import Storage

ROOT = Path(__file__).resolve().parents[1]


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _plain_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "idx": torch.arange(11, dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "view": torch.arange(40.0).reshape(8, 5)[2:5],  # a view: DCP clones it
        "step": 17,
        "cfg": {"lr": 0.001, "name": "adamw", "betas": [0.9, 0.95]},
        "blob": b"\x00\x01binary",
        "obj": {1, 2, 3},
    }


def chunk_tensor(storage: Storage, m: Manifest, key: str, index: int = 0) -> torch.Tensor:
    """The tensor bytes at a shard's address, read with one range read."""
    t = m.tensors[key]
    s = t.shards[index]
    raw = bytearray(storage.read_bytes(s.file, s.byte_offset, s.byte_offset + s.byte_length))
    from streamckpt.core import dtypes

    dt = dtypes.to_torch(t.dtype)
    return (torch.frombuffer(raw, dtype=dt) if raw else torch.empty(0, dtype=dt)).reshape(s.shape)


def assemble(storage: Storage, m: Manifest, key: str) -> torch.Tensor:
    """A whole tensor from all its chunks (checks the shards tile it)."""
    from streamckpt.core import dtypes

    t = m.tensors[key]
    out = torch.empty(t.shape, dtype=dtypes.to_torch(t.dtype))
    for i, s in enumerate(t.shards):
        sl = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))
        out[sl] = chunk_tensor(storage, m, key, i)
    return out


# --------------------------------------------------------------- one process


def test_plain_dcp_save_located_exactly(tmp_path: Path) -> None:
    state = _plain_state()
    _dcp_save(state, tmp_path / "ck")
    storage = Storage(str(tmp_path / "ck"))
    m = read_dcp_manifest(storage)
    assert m is not None and m.kind == "dcp"
    tensor_keys = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert set(m.tensors) == tensor_keys
    for k in tensor_keys:
        assert m.tensors[k].shape == tuple(state[k].shape)
        assert len(m.tensors[k].shards) == 1
        assert torch.equal(chunk_tensor(storage, m, k), state[k]), k
    assert m.values == {"step": 17, "cfg.lr": 0.001, "cfg.name": "adamw", "cfg.betas": [0.9, 0.95]}
    assert m.metadata["unloadable_keys"] == ["blob", "obj"]
    assert "not JSON-safe" in m.metadata["unloadable_reasons"]["obj"]
    assert m.metadata["dcp_version"]


def test_no_metadata_means_none(tmp_path: Path) -> None:
    assert read_dcp_manifest(Storage(str(tmp_path))) is None


def test_locating_is_coalesced(tmp_path: Path) -> None:
    """Locating N items costs about N+1 small range reads (an item's tail and the
    next one's head are one request), not N whole items."""
    n = 12
    state = {f"layer{i}": torch.randn(256, 256) for i in range(n)}  # 256 KiB each
    _dcp_save(state, tmp_path / "ck")
    storage = Storage(str(tmp_path / "ck"))
    md = dcpmeta.parse_metadata((tmp_path / "ck" / ".metadata").read_bytes(), where="t")
    cache = dcpitem.RangeCache(storage)
    cache.prefetch(dcpitem._locating_windows(md))
    for k, t in md.tensors.items():
        loc = dcpitem.locate_tensor(cache, t.chunks[0][2], where=k)
        assert loc.ref.size == (256, 256)
    assert cache.requests <= n + 1
    assert cache.bytes_read <= n * (dcpitem.HEAD_BYTES + dcpitem.TAIL_BYTES)


# ------------------------------------------------------ hostile .metadata


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_malicious_metadata_refused_and_not_run(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    _dcp_save({"w": torch.ones(3)}, tmp_path / "ck")
    # The payload is live: an ordinary unpickler does create its marker file.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_Evil(str(live))))).planner_data.close()
    assert live.exists()
    marker = tmp_path / "pwned"
    md = Metadata(state_dict_metadata={}, planner_data=_Evil(str(marker)))
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"(io|builtins)\.open, which is not on the allow-list") as ei:
        read_dcp_manifest(Storage(str(tmp_path / "ck")))
    assert ".metadata" in str(ei.value)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    b"cos\nsystem\n(S'touch PWNED'\ntR.",                      # classic os.system
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04eval\x93.",
    b"cposix\nsystem\n.",
    b"ctorch\nload\n.",
])
def test_hostile_globals(tmp_path: Path, payload: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="not on the allow-list"):
        dcpmeta.parse_metadata(payload, where=".metadata")
    assert not (Path.cwd() / "PWNED").exists()


def test_build_on_a_class_cannot_patch_it() -> None:
    """BUILD with slot state on an allowed *class* would setattr on it; refused."""
    p = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
         b"N}X\x08\x00\x00\x00__init__K\x01s\x86b.")
    with pytest.raises(CorruptCheckpointError):
        dcpmeta.parse_metadata(p, where=".metadata")
    assert dcpmeta._MetadataIndex.__init__ is safepickle.Record.__init__


@pytest.mark.parametrize("payload, match", [
    (pickle.dumps({"not": "metadata"}), "not a DCP Metadata"),
    (b"\x80\x04garbage", "malformed pickle"),
    (b"", "malformed pickle"),
])
def test_malformed_metadata(payload: bytes, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        dcpmeta.parse_metadata(payload, where=".metadata")


def test_item_pickle_with_hostile_global(tmp_path: Path) -> None:
    """A tensor item whose data.pkl calls something else is refused, not run."""
    _dcp_save({"w": torch.arange(4.0)}, tmp_path / "ck")
    distcp = next((tmp_path / "ck").glob("*.distcp"))
    data = distcp.read_bytes()
    i = data.index(b"torch._utils\n_rebuild_tensor_v2")
    # Same length, so the ZIP stays consistent: only the global differs.
    evil = b"builtins\nexec".ljust(len(b"torch._utils\n_rebuild_tensor_v2"), b"_")
    distcp.write_bytes(data[:i] + evil + data[i + len(evil):])
    with pytest.raises(CorruptCheckpointError, match="allow-list"):
        read_dcp_manifest(Storage(str(tmp_path / "ck")))


def test_item_out_of_file(tmp_path: Path) -> None:
    _dcp_save({"w": torch.arange(4.0)}, tmp_path / "ck")
    distcp = next((tmp_path / "ck").glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="runs past the end"):
        read_dcp_manifest(Storage(str(tmp_path / "ck")))


def test_json_safe() -> None:
    assert dcpfmt.json_safe({"a": [1, 2.5, "x", None, True]})
    assert not dcpfmt.json_safe((1, 2))
    assert not dcpfmt.json_safe(float("nan"))
    assert not dcpfmt.json_safe({1: "a"})
    assert not dcpfmt.json_safe(b"x")


def test_tensor_pickle_parsing() -> None:
    buf = io.BytesIO()
    torch.save(torch.arange(24, dtype=torch.float16).reshape(4, 6)[1:3], buf)
    import zipfile

    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    ref = dcpitem.parse_tensor_pickle(pkl, where="t")
    assert (ref.dtype, ref.storage_offset, ref.size, ref.stride, ref.storage_numel) == (
        torch.float16, 6, (2, 6), (6, 1), 24)
    buf = io.BytesIO()
    torch.save(torch.zeros(3, dtype=torch.float8_e5m2), buf)  # _rebuild_tensor_v3 + UntypedStorage
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    ref = dcpitem.parse_tensor_pickle(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))), where="t")
    assert (ref.dtype, ref.size, ref.storage_numel) == (torch.float8_e5m2, (3,), 3)
    assert dcpitem.is_row_major((2, 6), (6, 1)) and not dcpitem.is_row_major((2, 6), (1, 2))


# --------------------------------------------------------- 2-rank DTensor

_DTENSOR_SAVE = textwrap.dedent("""
    import os, sys, warnings
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(7)
    full = {
        "rows": torch.randn(5, 4, generator=g),          # uneven Shard(0): 3 + 2 rows
        "cols": torch.randn(3, 6, generator=g),          # Shard(1)
        "rep": torch.randn(4, generator=g),              # Replicate: saved once
        "tiny": torch.randn(1, 3, generator=g),          # Shard(0) of 1 row: one empty chunk
    }
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "rep": [Replicate()], "tiny": [Shard(0)]}
    state = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    state["step"] = 5
    dcp.save(state, checkpoint_id=sys.argv[1])
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(sys.argv[2], "full.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo/DCP worker threads can abort() in C++
    # destructors at exit ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)
""")


def run_ranks(script: str, args: list[str], world: int = 2, timeout: float = 120) -> None:
    """Run ``script`` in ``world`` real processes joined by torch.distributed (gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out.decode(errors="replace"))
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def dtensor_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("dtensor")
    run_ranks(_DTENSOR_SAVE, [str(d / "ck"), str(d)])
    return d / "ck", torch.load(d / "full.pt")


def test_dtensor_two_ranks(dtensor_ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, full = dtensor_ckpt
    storage = Storage(str(path))
    m = read_dcp_manifest(storage)
    assert m is not None
    assert sorted(f for f in m.files) == ["__0_0.distcp", "__1_0.distcp"]
    assert [s.shape for s in m.tensors["rows"].shards] == [(3, 4), (2, 4)]
    assert [s.offset for s in m.tensors["cols"].shards] == [(0, 0), (0, 3)]
    assert len(m.tensors["rep"].shards) == 1
    for k, v in full.items():
        assert torch.equal(assemble(storage, m, k), v), k
    assert m.values == {"step": 5}


def _put_dir(local: Path, uri: str, opts: dict[str, Any]) -> None:
    fs = fsspec.filesystem("s3", **opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{uri}/{p.name}")


def test_dtensor_two_ranks_over_s3(dtensor_ckpt: tuple[Path, dict[str, torch.Tensor]], s3_uri: str,
                                   s3_opts: dict[str, Any]) -> None:
    path, full = dtensor_ckpt
    _put_dir(path, s3_uri, s3_opts)
    storage = Storage(s3_uri, s3_opts)
    m = read_dcp_manifest(storage)
    assert m is not None
    for k, v in full.items():
        assert torch.equal(assemble(storage, m, k), v), k


@pytest.mark.parametrize("module, name", [
    ("torch", "Size"), ("pathlib", "PosixPath"), ("torch", "FloatStorage"), ("collections", "OrderedDict"),
])
def test_build_cannot_patch_allowed_callables(module: str, name: str) -> None:
    """BUILD with slot state on an allowed callable/marker would change it for
    every later load in the process (e.g. a function's __defaults__); refused."""
    p = (b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
         b"N}X\x0c\x00\x00\x00__defaults__K\x01\x85s\x86b.")
    for allowed in (dcpmeta._METADATA_GLOBALS, dcpitem._ITEM_GLOBALS):
        if (module, name) in allowed:
            with pytest.raises(CorruptCheckpointError):
                safepickle.safe_unpickle(p, allowed=allowed, where="x")
    assert dcpmeta._size.__defaults__ == ((),)
    assert dcpitem._ITEM_GLOBALS[("torch", "FloatStorage")].value is torch.float32


# ------------------------------------------------ loads through the public API


def test_plain_dcp_loads_whole_and_sliced_over_s3(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import streamckpt as sc

    state = _plain_state()
    _dcp_save(state, tmp_path / "ck")
    _put_dir(tmp_path / "ck", s3_uri, s3_opts)
    got = sc.load_full(s3_uri, storage_options=s3_opts)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    local = torch.empty(2, 5)
    target = {"w": sc.ShardedTensor(local, (6, 5), (3, 0)), "step": 0, "cfg": {"lr": 0.0}}
    res = sc.load(target, s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(local, state["w"][3:5])
    assert target["step"] == 17 and target["cfg"]["lr"] == 0.001
    # a slice of an item and the check of its layout (its head, or its tail and the next
    # item's head: see test_dcp_speculative), a few hundred bytes apart: one exact read
    from streamckpt.formats import speculation

    guessed = read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True)
    (check,) = speculation.heads_of(guessed, {"w"})
    w = guessed.tensors["w"].shards[0]
    lo, hi = w.byte_offset + 3 * 5 * 4, w.byte_offset + 5 * 5 * 4
    span = max(hi, check.start + check.length) - min(lo, check.start)
    assert res.requests == 1 and res.bytes_needed == 2 * 5 * 4 and res.bytes_read == span
    assert res.kind == "dcp"


def test_dtensor_dcp_loads_across_chunks_over_s3(dtensor_ckpt: tuple[Path, dict[str, torch.Tensor]],
                                                 s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import streamckpt as sc

    path, full = dtensor_ckpt
    _put_dir(path, s3_uri, s3_opts)
    got = sc.load_full(s3_uri, storage_options=s3_opts)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    # Rows 2..4 straddle the two ranks' chunks (3 + 2 rows); columns 2..5 straddle "cols".
    rows, cols = torch.empty(2, 4), torch.empty(3, 3)
    res = sc.load({"rows": sc.ShardedTensor(rows, (5, 4), (2, 0)), "cols": sc.ShardedTensor(cols, (3, 6), (0, 2))},
                  s3_uri, storage_options=s3_opts, strict=False)
    assert torch.equal(rows, full["rows"][2:4]) and torch.equal(cols, full["cols"][:, 2:5])
    assert res.bytes_needed == (2 * 4 + 3 * 3) * 4


@pytest.mark.parametrize("bomb", [
    b"\x80\x04N" + b"r" + (2**30).to_bytes(4, "little") + b".",      # LONG_BINPUT 2**30 -> 16 GiB memo
    b"\x80\x02Nq\x05.",                                               # BINPUT 5 with nothing stored before
    b"(lp99999999999\n.",                                             # protocol-0 PUT of a huge index
    b"\x80\x02N\x94h\x07.",                                           # BINGET of an entry never stored
])
def test_memo_index_bombs_refused_without_allocating(bomb: bytes) -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="memo entry|malformed"):
            dcpmeta.parse_metadata(bomb, where=".metadata")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("get", [b"h\x01", b"j\x01\x00\x00\x00", b"g1\n"], ids=["BINGET", "LONG_BINGET", "GET"])
def test_memo_read_of_the_next_entry_is_refused(get: bytes) -> None:
    """Entry 0 stored, entry 1 read: the entry just past the stored ones is never there
    (the edge of the scan's count, for each GET spelling); entry 0 itself is fine."""
    stored = b"\x80\x04N\x94"  # PROTO 4, NONE, MEMOIZE (entry 0)
    with pytest.raises(CorruptCheckpointError, match=r"reads memo entry 1, never stored"):
        safepickle.check_memo(stored + get + b".", where="t")
    zero = get.replace(b"\x01", b"\x00").replace(b"1\n", b"0\n")
    safepickle.check_memo(stored + zero + b".", where="t")


def test_memo_prescan_accepts_real_pickles(tmp_path: Path) -> None:
    """Pickles as picklers write them (every protocol, shared references read back from
    the memo) pass the pre-scan and unpickle to the value they were made from."""
    _dcp_save({"w": torch.ones(3), "cfg": {"a": [1, 2]}}, tmp_path / "ck")
    md = dcpmeta.parse_metadata((tmp_path / "ck" / ".metadata").read_bytes(), where=".metadata")
    assert md.tensors["w"].shape == (3,) and set(md.values) == {"cfg.a"}  # DCP flattens nested dicts
    shared = {"y": "z"}
    for value in ({"x": [1, 2, shared, shared]}, [[1], [2]] * 3):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            data = pickle.dumps(value, protocol=protocol)
            safepickle.check_memo(data, where="t")
            got = safepickle.safe_unpickle(data, allowed={}, where="t")
            assert got == value, protocol
            if isinstance(value, dict):
                assert got["x"][2] is got["x"][3], protocol  # the memo kept the shared object


def test_hostile_central_directory_size_is_refused(tmp_path: Path) -> None:
    """An item whose ZIP end record claims a huge central directory is not read whole."""
    _dcp_save({"w": torch.zeros(20 << 20, dtype=torch.uint8)}, tmp_path / "ck")  # one 20 MiB item
    distcp = next((tmp_path / "ck").glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    z64 = data.rindex(b"PK\x06\x06")  # torch.save writes ZIP64 end records; zipfile trusts those
    data[z64 + 40:z64 + 48] = (len(data) - 200).to_bytes(8, "little")  # size of the central directory
    data[z64 + 48:z64 + 56] = (100).to_bytes(8, "little")  # its offset
    distcp.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="read of ZIP metadata"):
        read_dcp_manifest(Storage(str(tmp_path / "ck")))
