"""``progress=`` on every public call that moves bytes, against a real S3 server (moto over HTTP).

The contract is ``load``'s: the callable gets the bytes done since its previous call
(so the running sum only grows), and ``add_total`` first when the callable has one. The
sums are checked against what the calls report: ``SaveResult.bytes_written``,
``LoadResult.bytes_read``, the tensors' bytes.
"""

from __future__ import annotations

from typing import Any

import contextlib
import io

import pytest
import torch

import streamckpt as sc
from streamckpt.results import human_bytes

from distributed import run_ranks


class Recorder:
    """A user's progress callable that also wants the total (as a progress bar does)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.total = 0

    def __call__(self, nbytes: int) -> None:
        self.calls.append(nbytes)

    def add_total(self, nbytes: int) -> None:
        self.total += nbytes

    @property
    def done(self) -> int:
        return sum(self.calls)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g)},
        "emb": torch.randn(3000, 256, generator=g).to(torch.bfloat16),
        "step": 12,
    }


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    return 0


def _assert_grows(calls: list[int]) -> None:
    assert calls and all(n > 0 for n in calls)  # each call adds: the running sum only grows


def test_save_reports_every_stored_byte(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    rec = Recorder()
    res = sc.save(_state(), s3_uri, storage_options=s3_opts, progress=rec)
    _assert_grows(rec.calls)
    assert rec.done == res.bytes_written
    assert rec.total == res.bytes_written  # uncompressed: every object's size is known up front
    assert len(rec.calls) == len(res.files)  # one call per object, once it is stored
    assert res.bytes_written == sum(sc.inspect(s3_uri, storage_options=s3_opts).files.values()) + rec.calls[-1]


def test_zstd_save_reports_compressed_bytes(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    calls: list[int] = []
    res = sc.save(_state(), s3_uri, storage_options=s3_opts, compression="zstd", progress=calls.append)
    _assert_grows(calls)
    assert sum(calls) == res.bytes_written
    assert sum(sc.inspect(s3_uri, storage_options=s3_opts).files.values()) == res.bytes_written - calls[-1]


def test_async_save_reports_from_its_upload(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    rec = Recorder()
    handle = sc.async_save(_state(), s3_uri, storage_options=s3_opts, progress=rec)
    res = handle.result(timeout=120)
    _assert_grows(rec.calls)
    assert rec.done == rec.total == res.bytes_written


def test_load_reports_bytes_read(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    state = _state()
    sc.save(state, s3_uri, storage_options=s3_opts)
    target = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(1024)}}
    rec = Recorder()
    res = sc.load(target, s3_uri, storage_options=s3_opts, progress=rec, strict=False)
    _assert_grows(rec.calls)
    assert rec.done == rec.total == res.bytes_read
    assert res.bytes_read == _tensor_bytes(target)  # whole tensors of an uncompressed file: no extra byte
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_load_state_and_load_full_report_bytes_read(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    state = _state()
    sc.save(state, s3_uri, storage_options=s3_opts)
    rec = Recorder()
    back = sc.load_state(s3_uri, storage_options=s3_opts, progress=rec)
    _assert_grows(rec.calls)
    assert rec.done == rec.total == _tensor_bytes(state)
    assert back["step"] == 12 and torch.equal(back["emb"], state["emb"])
    calls: list[int] = []
    full = sc.load_full(s3_uri, storage_options=s3_opts, keys=["emb"], progress=calls.append)
    _assert_grows(calls)
    assert sum(calls) == _tensor_bytes(state["emb"]) == 3000 * 256 * 2
    assert torch.equal(full["emb"], state["emb"])


def test_merge_reports_tensor_bytes_written(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save(_state(), s3_uri, storage_options=s3_opts)
    rec = Recorder()
    sc.merge(s3_uri, s3_uri + "-hf", storage_options=s3_opts, max_shard_bytes=2 << 20, progress=rec)
    _assert_grows(rec.calls)
    merged = sc.inspect(s3_uri + "-hf", storage_options=s3_opts)
    assert merged.kind == "safetensors" and len(merged.files) == 2
    assert rec.done == merged.total_bytes == _tensor_bytes(_state())


def test_progress_true_writes_lines_off_a_terminal(s3_uri: str, s3_opts: dict[str, Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    res = sc.save(_state(), s3_uri, storage_options=s3_opts, progress=True)
    target = {"emb": torch.zeros(3000, 256, dtype=torch.bfloat16)}
    got = sc.load(target, s3_uri, storage_options=s3_opts, progress=True, strict=False)
    handle = sc.async_save(_state(), s3_uri + "-b", storage_options=s3_opts, progress=True)
    again = handle.result(timeout=120)
    err = capsys.readouterr().err
    assert f"save: {human_bytes(res.bytes_written)} of {human_bytes(res.bytes_written)} (100%)" in err
    assert f"load: {human_bytes(got.bytes_read)} of {human_bytes(got.bytes_read)} (100%)" in err
    assert f"async_save: {human_bytes(again.bytes_written)} of {human_bytes(again.bytes_written)} (100%)" in err
    assert "\r" not in err  # not a terminal: plain lines, no bar


def test_progress_of_the_wrong_kind_is_refused(tmp_uri: str) -> None:
    with pytest.raises(sc.CheckpointError, match="progress must be a callable"):
        sc.save({"w": torch.ones(2)}, tmp_uri, progress="yes")  # type: ignore[arg-type]


def two_rank_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Save rows by rank and a replica, load the other rank's rows: each rank's callable
    sums to its own bytes; ``progress=True`` draws on rank 0 only."""
    full = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    mine = slice(32 * rank, 32 * (rank + 1))
    state = {"w": sc.ShardedTensor(full[mine].clone(), (64, 256), (32 * rank, 0)), "b": torch.arange(1000.0)}
    saved: list[int] = []
    res = sc.save(state, uri, storage_options=opts, progress=saved.append)
    other = slice(32 * (1 - rank), 32 * (2 - rank))
    target = {"w": sc.ShardedTensor(torch.zeros(32, 256), (64, 256), (other.start, 0)), "b": torch.zeros(1000)}
    read: list[int] = []
    got = sc.load(target, uri, storage_options=opts, progress=read.append)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sc.load(target, uri, storage_options=opts, progress=True)
    return {"written": res.bytes_written, "save_calls": saved, "read": got.bytes_read, "load_calls": read,
            "equal": torch.equal(target["w"].local_tensor, full[other]) and torch.equal(target["b"], state["b"]),
            "stderr": err.getvalue()}


def test_each_rank_reports_its_own_bytes(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    ranks = [r.unwrap() for r in run_ranks(2, two_rank_worker, kwargs={"uri": s3_uri, "opts": s3_opts},
                                           timeout=180, pg_timeout=60)]
    for r in ranks:
        assert r["equal"]
        assert r["save_calls"] and all(n > 0 for n in r["save_calls"]) and sum(r["save_calls"]) == r["written"]
        assert r["load_calls"] and all(n > 0 for n in r["load_calls"]) and sum(r["load_calls"]) == r["read"]
    # read_once: every byte of the checkpoint's tensors was fetched by exactly one rank
    assert sum(r["read"] for r in ranks) == 64 * 256 * 4 + 1000 * 4
    assert sum(r["written"] for r in ranks) == sum(sc.inspect(s3_uri, storage_options=s3_opts).files.values()) \
        + ranks[0]["save_calls"][-1]  # the data files, and rank 0's manifest
    assert ranks[0]["stderr"].startswith("load (rank 0 of 2): ") and ranks[1]["stderr"] == ""
