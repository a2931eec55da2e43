"""``streamckpt.dcp``: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through our
StorageWriter / StorageReader, on moto over HTTP and real gloo ranks.

* 2 FSDP2 ranks save model + optimizer + schedule (one with ``dcp.save``, the same
  state again with ``dcp.async_save``); 3 ranks read it back with ``dcp.load`` through
  our reader and with ``sc.load``, exact; a save where one rank fails commits nothing.
* 4 ranks ``dcp.load`` a DTensor ``Shard(0)`` from our writer's checkpoint and from one
  DCP's own ``FileSystemWriter`` left: each rank reads exactly its quarter of the bytes;
  ``Shard(1)`` columns of the latter, exact (the small gaps between rows read through).
* One process: a Hugging Face directory; a nested state of DCP's own layout and the
  ``planner_data`` that rebuilds it (as DCP's reader gives it); errors (missing checkpoint, a flipped data
  byte) arrive as streamckpt classes inside DCP's ``CheckpointException``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import streamckpt as sc
from streamckpt.dcp import MEMORY_BUDGET, StorageReader, StorageWriter
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from streamckpt.formats import dcp as dcpfmt, speculation
from streamckpt.storage import Storage

from distributed import check_equal, dtensor, original, run_ranks, run_scenarios
from fsdp_job import differences, example, full

ROWS, COLS = 256, 1024  # 1 MiB of fp32: quarters are whole 4 KiB checksum chunks


# ------------------------------------------------------------------ FSDP2 2 -> 3 ranks


def fsdp_save(rank: int, world: int, uri: str, opts: dict[str, Any], ref: str) -> dict[str, Any]:
    """Train the example's FSDP2 job, save it sync and async through our writer; then a
    save whose rank 1 holds a value that is not plain data must fail everywhere."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    job = example().Job.create(init_device_mesh("cpu", (world,)))
    for _ in range(3):
        job.train_step()
    state = job.state_dict()
    dcp.save(state, storage_writer=StorageWriter(f"{uri}/sync", storage_options=opts))
    pending = dcp.async_save(state, storage_writer=StorageWriter(f"{uri}/async", storage_options=opts))
    pending.result()
    want = full(state)
    if rank == 0:
        torch.save(want, ref)
    bad = dict(state, extra=datetime.date(2020, 1, 1) if rank == 1 else None)
    try:
        dcp.save(bad, storage_writer=StorageWriter(f"{uri}/bad", storage_options=opts))
        failed: list[str] = []
    except CheckpointException as e:
        failed = sorted({type(exc).__name__ for exc in _originals(e)})
    return {"failed": failed}


def fsdp_load(rank: int, world: int, uri: str, opts: dict[str, Any], ref: str) -> dict[str, Any]:
    """A fresh FSDP2 job on 3 ranks: ``dcp.load`` through our reader, and ``sc.load``."""
    from torch.distributed.device_mesh import init_device_mesh

    want = torch.load(ref)
    out: dict[str, Any] = {}
    for which in ("sync", "async"):
        job = example().Job.create(init_device_mesh("cpu", (world,)))
        state = job.state_dict()
        reader = StorageReader(f"{uri}/{which}", storage_options=opts)
        dcp.load(state, storage_reader=reader)
        out[which] = differences(full(state), want, which)
        out[f"{which}_read"] = reader.stats.bytes_read
    job = example().Job.create(init_device_mesh("cpu", (world,)))
    state = job.state_dict()
    res = sc.load(state, f"{uri}/sync", storage_options=opts)
    out["sc"] = differences(full(state), want, "sc.load")
    out["sc_kind"] = res.kind
    return out


def test_fsdp2_save_two_ranks_load_three(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ref = str(tmp_path / "ref.pt")
    kw = {"uri": s3_uri, "opts": s3_opts, "ref": ref}
    saved = [r.unwrap() for r in run_ranks(2, fsdp_save, kwargs=kw, timeout=150)]
    assert all(s["failed"] == ["IncompatibleStateDictError"] for s in saved[1:]), saved
    assert "IncompatibleStateDictError" in saved[0]["failed"], saved
    fs = fsspec.filesystem("s3", **s3_opts)
    assert not fs.exists(f"{s3_uri}/bad/manifest.json")  # nothing committed
    for which in ("sync", "async"):
        assert fs.exists(f"{s3_uri}/{which}/manifest.json")
        assert not fs.exists(f"{s3_uri}/{which}/.metadata")  # a native checkpoint, no pickle stored
    loaded = [r.unwrap() for r in run_ranks(3, fsdp_load, kwargs=kw, timeout=150)]
    for r in loaded:
        assert (r["sync"], r["async"], r["sc"]) == ([], [], []), r
        assert r["sc_kind"] == "streamckpt"
        assert r["sync_read"] > 0
    # the whole state, single process, pickle-free, checksummed
    state = sc.load_state(f"{s3_uri}/sync", storage_options=s3_opts)
    assert differences(state, torch.load(ref)) == []


# ----------------------------------------------------------- Shard(0): 1/W bytes per rank


def shard0_save(rank: int, world: int, uri: str, opts: dict[str, Any]) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    w, _ = dtensor(original("w", (ROWS, COLS), torch.float32), mesh, [Shard(0)])
    b, _ = dtensor(original("b", (ROWS,), torch.float32), mesh, [Shard(0)])
    dcp.save({"w": w, "b": b, "note": "two ranks"}, storage_writer=StorageWriter(uri, storage_options=opts))
    return rank


def shard0_load(rank: int, world: int, ours: str, theirs: str, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))

    def case(uri: str) -> Any:
        def run(rank: int, world: int) -> dict[str, Any]:
            w, want_w = dtensor(original("w", (ROWS, COLS), torch.float32), mesh, [Shard(0)], fill=False)
            b, want_b = dtensor(original("b", (ROWS,), torch.float32), mesh, [Shard(0)], fill=False)
            sd = {"w": w, "b": b}
            reader = StorageReader(uri, storage_options=opts)
            dcp.load(sd, storage_reader=reader)
            check_equal("w", sd["w"].to_local(), want_w)
            check_equal("b", sd["b"].to_local(), want_b)
            return {"read": reader.stats.bytes_read, "needed": reader.stats.bytes_needed,
                    "requests": reader.stats.requests}
        return run

    def columns(rank: int, world: int) -> dict[str, Any]:  # Shard(1): a run per row, staged, not landed
        w, want_w = dtensor(original("w", (ROWS, COLS), torch.float32), mesh, [Shard(1)], fill=False)
        sd = {"w": w}
        reader = StorageReader(theirs, storage_options=opts)
        dcp.load(sd, storage_reader=reader)
        check_equal("w", sd["w"].to_local(), want_w)
        return {"read": reader.stats.bytes_read, "needed": reader.stats.bytes_needed,
                "requests": reader.stats.requests}

    return run_scenarios(rank, world, [("ours", case(ours)), ("theirs", case(theirs)), ("columns", columns)])


def test_shard0_load_reads_a_quarter_per_rank(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ours, theirs = f"{s3_uri}/ours", f"{s3_uri}/theirs"
    assert [r.unwrap() for r in run_ranks(2, shard0_save, kwargs={"uri": ours, "opts": s3_opts})] == [0, 1]
    local = tmp_path / "dcp"  # DCP's own layout (.metadata + .distcp), uploaded as is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": original("w", (ROWS, COLS), torch.float32), "b": original("b", (ROWS,), torch.float32)},
                 storage_writer=dcp.FileSystemWriter(str(local)))
    fs = fsspec.filesystem("s3", **s3_opts)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{theirs}/{p.name}")
    from distributed import ScenarioResults

    res = ScenarioResults(run_ranks(4, shard0_load, kwargs={"ours": ours, "theirs": theirs, "opts": s3_opts},
                                    timeout=150))
    quarter = (ROWS * COLS + ROWS) * 4 // 4
    # DCP's layout: w's predicted offset is verified by its tail (its ZIP directory), read with
    # b's head right after it: one check, read by every rank with its quarter of b (the rows of b
    # before it read through); rank 3's rows of w end where the check starts: one request.
    check, = speculation.heads_of(dcpfmt.read_dcp_manifest(Storage(theirs, s3_opts), speculative=True))
    assert (check.tail.key, check.key) == ("w", "b") and check.length < 2048, check
    for rank, v in enumerate(res.values("theirs")):
        assert v["needed"] == quarter, v
        assert v["read"] == quarter + check.length + rank * ROWS // 4 * 4, (rank, v)
        assert v["requests"] == (2 if rank < 3 else 1), (rank, v)
    # ours: w's quarter is 64 whole 4 KiB checksum chunks; b's 512-byte shard is one chunk, read
    # (and verified) whole for the rank's 256 bytes of it.
    for v in res.values("ours"):
        assert v["needed"] == quarter and v["read"] == quarter + ROWS // 2 * 4 - ROWS // 4 * 4, v
        assert v["requests"] == 2, v
    row = COLS * 4  # columns: each rank's 1 KiB per 4 KiB row; the 3 KiB gaps (and w's tail) read through
    for rank, v in enumerate(res.values("columns")):
        assert v["needed"] == ROWS * row // 4, v
        assert v["read"] == (ROWS - 1) * row + row // 4 + (3 - rank) * row // 4 + check.length, (rank, v)
        assert v["requests"] == 1, v


# ------------------------------------------------------------- one process: HF, errors


def _quiet_load(sd: dict[str, Any], reader: StorageReader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, storage_reader=reader)


def _quiet_save(sd: dict[str, Any], writer: StorageWriter) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer)


def _originals(e: CheckpointException) -> list[BaseException]:
    """The exceptions DCP wrapped, one per failed rank (``failures[rank] = (exc, stack)``)."""
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def test_hugging_face_directory(s3_uri: str, s3_opts: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"embed.weight": original("e", (64, 32), torch.bfloat16), "norm.weight": original("n", (32,), torch.float32),
               "steps": original("s", (5,), torch.int64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fsspec.filesystem("s3", **s3_opts).put_file(str(tmp_path / "model.safetensors"), f"{s3_uri}/model.safetensors")
    sd = {k: torch.zeros_like(v) for k, v in tensors.items()}
    reader = StorageReader(s3_uri, storage_options=s3_opts)
    _quiet_load(sd, reader)
    for k, v in tensors.items():
        check_equal(k, sd[k], v)
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    assert reader.stats.bytes_needed == reader.stats.bytes_read == total


def test_dcp_load_of_writer_checkpoint_with_values_and_zstd(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """One process: a plain state (values, tuples, ints) through the zstd writer, back exactly."""
    w = original("w", (100, 70), torch.float32)
    saved = {"m": {"w": w, "i": original("i", (9,), torch.int32)}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
             "step": 12}
    _quiet_save(saved, StorageWriter(s3_uri, storage_options=s3_opts, compression="zstd"))
    got = {"m": {"w": torch.zeros_like(w), "i": torch.zeros(9, dtype=torch.int32)},
           "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}], "step": 0}
    _quiet_load(got, StorageReader(s3_uri, storage_options=s3_opts))
    check_equal("m.w", got["m"]["w"], w)
    check_equal("m.i", got["m"]["i"], saved["m"]["i"])
    assert got["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}] and got["step"] == 12
    assert sc.load_state(s3_uri, storage_options=s3_opts)["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    with pytest.raises(CheckpointException) as ei:  # committed: a second save must ask to overwrite
        _quiet_save(saved, StorageWriter(s3_uri, storage_options=s3_opts))
    assert "CheckpointExistsError" in {type(e).__name__ for e in _originals(ei.value)}


def _nested(w: torch.Tensor, scale: float) -> dict[str, Any]:
    moments = {0: {"exp_avg": w * 2 * scale, "step": torch.tensor(3.0 * scale)}}
    groups = [{"lr": 0.1 * scale, "params": [0]}]
    return {"model": {"w": w * scale}, "optim": {"state": moments, "param_groups": groups},
            "extra": [w + scale, {"k": int(5 * scale)}]}


def _rebuilt(reader: Any) -> dict[str, Any]:
    """The state rebuilt from the checkpoint alone, as ``dcp_to_torch_save`` does it."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def _same_tree(got: Any, want: Any, path: str = "") -> None:
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, dict):
        assert set(got) == set(want), (path, list(got), list(want))  # the order is tensors first, then values
        for k in want:
            _same_tree(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _same_tree(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        check_equal(path, got, want)
    else:
        assert got == want, (path, got, want)


def test_nested_state_of_a_dcp_checkpoint_and_its_planner_data(s3_uri: str, s3_opts: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """DCP's own layout, nested state: ``dcp.load`` fills it exactly, and the metadata's
    ``planner_data`` equals DCP's, so a state rebuilt from the checkpoint alone nests as with
    DCP's ``FileSystemReader``."""
    w = original("w", (12, 8), torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_nested(w, 1.0), storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    fs = fsspec.filesystem("s3", **s3_opts)
    for p in sorted(tmp_path.iterdir()):
        fs.put_file(str(p), f"{s3_uri}/{p.name}")
    got = _nested(w, 0.0)
    _quiet_load(got, StorageReader(s3_uri, storage_options=s3_opts))
    _same_tree(got, _nested(w, 1.0))
    theirs = dcp.FileSystemReader(str(tmp_path))
    want_paths = theirs.read_metadata().planner_data
    assert StorageReader(s3_uri, storage_options=s3_opts).read_metadata().planner_data == want_paths
    assert want_paths["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
    assert want_paths["extra.1.k"] == ("extra", 1, "k")
    _same_tree(_rebuilt(StorageReader(s3_uri, storage_options=s3_opts)), _rebuilt(theirs))


def test_state_rebuilt_from_a_native_checkpoint_keeps_whole_values(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """``sc.save`` keeps ``groups`` whole (DCP is also answered its flattened keys): rebuilt from
    the metadata alone, the state holds it whole, int dict keys as DCP's strings."""
    w = original("w", (6, 4), torch.float32)
    sc.save({"m": {"w": w}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "step": 3, "opt": {"state": {0: {"e": w}}}},
            s3_uri, storage_options=s3_opts)
    paths = StorageReader(s3_uri, storage_options=s3_opts).read_metadata().planner_data
    assert paths == {"m.w": ("m", "w"), "opt.state.0.e": ("opt", "state", "0", "e"), "groups.0.lr": ("groups", 0, "lr"),
                     "groups.0.betas": ("groups", 0, "betas"), "groups": ("groups",), "step": ("step",)}
    want = {"m": {"w": w}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "step": 3, "opt": {"state": {"0": {"e": w}}}}
    _same_tree(_rebuilt(StorageReader(s3_uri, storage_options=s3_opts)), want)


def test_missing_checkpoint_is_not_found(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with pytest.raises(CheckpointException) as ei:
        _quiet_load({"w": torch.zeros(3)}, StorageReader(f"{s3_uri}/nothing-here", storage_options=s3_opts))
    errs = _originals(ei.value)
    assert errs and all(isinstance(e, CheckpointNotFoundError) for e in errs), errs
    assert "nothing-here" in str(errs[0])


def test_flipped_data_byte_is_corrupt(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    w = original("w", (128, 128), torch.float32)
    _quiet_save({"w": w}, StorageWriter(s3_uri, storage_options=s3_opts))
    fs = fsspec.filesystem("s3", **s3_opts)
    name = next(p for p in fs.find(f"{s3_uri}/data"))
    blob = bytearray(fs.cat_file(name))
    blob[-1000] ^= 0x01  # inside the tensor's bytes (the safetensors header is at the front)
    fs.pipe_file(name, bytes(blob))
    with pytest.raises(CheckpointException) as ei:
        _quiet_load({"w": torch.zeros_like(w)}, StorageReader(s3_uri, storage_options=s3_opts))
    errs = _originals(ei.value)
    assert errs and all(isinstance(e, CorruptCheckpointError) for e in errs), errs


# ------------------------------------------- DCP checkpoints: predicted item layouts


def _dcp_dir(tmp_path: Path, uri: str, opts: dict[str, Any], model: dict[str, torch.Tensor],
             relaid: str | None = None) -> None:
    from test_dcp_fast import _dcp_save, _put_dir, _relayout_last_item

    _dcp_save(model, tmp_path / "ck")
    if relaid is not None:
        _relayout_last_item(tmp_path / "ck", relaid)
    _put_dir(tmp_path / "ck", uri, opts)


def test_dcp_load_makes_as_few_requests_as_sc_load(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A full load of DCP's own layout: one item located exactly (with the value items, one
    read), the others' offsets predicted; the data and every check are one range read, as
    ``sc.load`` reads it."""
    from streamckpt.testing import FaultProxy
    from test_dcp_speculative import _spread_model

    model = _spread_model()
    _dcp_dir(tmp_path, s3_uri, s3_opts, {**model, "step": 7})
    guessed = dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True)
    heads = speculation.heads_of(guessed)
    shards = [s for t in guessed.tensors.values() for s in t.shards]
    first, last = min(s.byte_offset for s in shards), max(s.byte_offset + s.byte_length for s in shards)
    with FaultProxy(s3_opts["endpoint_url"], rate=0.0) as proxy:  # counts requests, injects nothing
        opts = proxy.storage_options
        full = {k: torch.empty_like(v) for k, v in model.items()} | {"step": 0}
        reader = StorageReader(s3_uri, storage_options=opts)
        _quiet_load(full, reader)
        ours = proxy.requests
        for k, v in model.items():
            assert torch.equal(full[k], v), k
        assert full["step"] == 7
        assert (reader.stats.requests, reader.stats.bytes_read, reader.stats.fallbacks) == (1, last - first, 0)
        assert reader.stats.bytes_needed == sum(v.numel() * v.element_size() for v in model.values())
        # manifest.json and a listing for *.safetensors (absent), .metadata, template and value, the data
        res = sc.load({k: torch.empty_like(v) for k, v in model.items()}, s3_uri, storage_options=opts, strict=False)
        theirs = proxy.requests - ours
        # sc.load: the same reads, and a HEAD for the data file's size
        assert res.requests == 1 and theirs == ours + 1, proxy.history


@pytest.mark.parametrize("budget", [MEMORY_BUDGET, 1], ids=["one-batch", "batch-per-item"])
def test_a_wrong_prediction_falls_back_exactly(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any],
                                               caplog: pytest.LogCaptureFixture, budget: int) -> None:
    """An item rewritten by Python's zipfile (no padding, another order): its predicted head
    differs, the reader says so, locates the items exactly and reads the batch again; the
    values are exact (earlier batches kept, nothing from the wrong offsets delivered). A load
    of another tensor reads no check of that item and needs no fallback."""
    from test_dcp_fast import _model

    model = _model()
    _dcp_dir(tmp_path, s3_uri, s3_opts, model, relaid="l1.wq")
    full = {k: torch.empty_like(v).fill_(-1) for k, v in model.items()}
    reader = StorageReader(s3_uri, storage_options=s3_opts, memory_budget=budget)
    with caplog.at_level(logging.INFO, logger="streamckpt.dcp"):
        _quiet_load(full, reader)
    for k, v in model.items():
        check_equal(k, full[k], v)
    assert "'l1.wq' chunk at [0, 0]" in caplog.text and "locating the items exactly" in caplog.text
    assert reader.stats.fallbacks == 1
    assert reader.stats.bytes_needed == sum(v.numel() * v.element_size() for v in model.values())
    caplog.clear()
    part = {"l0.wq": torch.empty(48, 48)}
    reader = StorageReader(s3_uri, storage_options=s3_opts, memory_budget=budget)
    with caplog.at_level(logging.INFO, logger="streamckpt.dcp"):
        _quiet_load(part, reader)
    check_equal("l0.wq", part["l0.wq"], model["l0.wq"])
    assert reader.stats.fallbacks == 0 and "locating" not in caplog.text


def test_a_transposed_item_checked_by_its_tail_is_refused(tmp_path: Path, s3_uri: str, s3_opts: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A square tensor saved transposed: its predicted contiguous record differs only in
    data.pkl, caught by its tail (read with the next item's head); the reader falls back and
    exact locating refuses the view, as a CorruptCheckpointError through DCP. The next item
    alone reads its two checks with its data, one request, and needs no fallback."""
    t = torch.arange(16.0).reshape(4, 4)
    other = torch.randn(4, 4)
    _dcp_dir(tmp_path, s3_uri, s3_opts, {"t": t.t(), "b": other, "tiny": torch.randn(1)})
    with pytest.raises(CheckpointException) as ei:
        _quiet_load({"t": torch.empty(4, 4), "b": torch.empty(4, 4)}, StorageReader(s3_uri, storage_options=s3_opts))
    err, = _originals(ei.value)
    assert isinstance(err, CorruptCheckpointError) and "'t'" in str(err) and "not a row-major" in str(err), err
    got = {"b": torch.empty(4, 4)}
    reader = StorageReader(s3_uri, storage_options=s3_opts)
    with caplog.at_level(logging.INFO, logger="streamckpt.dcp"):
        _quiet_load(got, reader)
    check_equal("b", got["b"], other)
    around = speculation.heads_of(dcpfmt.read_dcp_manifest(Storage(s3_uri, s3_opts), speculative=True), {"b"})
    assert [(h.tail.key, h.key) for h in around] == [("t", "b"), ("b", "tiny")]
    assert (reader.stats.requests, reader.stats.fallbacks) == (1, 0) and "locating" not in caplog.text
    assert reader.stats.bytes_read == sum(h.length for h in around) + 4 * 4 * 4
