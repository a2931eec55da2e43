"""A failure on one rank becomes an error on every rank, through one agreement.

One spawn of 3 gloo ranks runs every case in sequence against moto S3 over HTTP
(the group is reused, which also checks that it stays usable after an agreed
failure: the last case loads successfully). Each case's outcome is recorded per
rank. The bound is structural, not a clock: every rank's error must come from the
agreement (its own, or ``rank N failed: ...``), never from a collective that failed or
timed out (``PeerError``); a hang shows up as the process group's timeout (30 s) turning
into such a PeerError, or the harness killing the ranks, never as a stuck test.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import streamckpt as sc

from conftest import BUCKET
from distributed import ScenarioResults, check_equal, original, result_dict, run_ranks, run_scenarios, sharded

WORLD = 3
PG_TIMEOUT = 30.0
BACKEND_FAILURE = "a peer rank died, was killed or timed out"  # comm's PeerError for a failed collective

W = ((64, 48), torch.float32)
B = ((10, 3), torch.int32)


def full(name: str) -> torch.Tensor:
    shape, dtype = {"w": W, "b": B}[name]
    return original(name, shape, dtype)


@dataclass(slots=True)
class Ctx:
    root: str
    opts: dict[str, Any]

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"


def targets(rank: int, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Columns of w (a layout other than the saved rows) and a whole replica of b."""
    w, ew = sharded(full("w"), 1, world, rank, fill=False)
    return {"w": w, "b": torch.zeros(B[0], dtype=B[1]), "step": None}, {"w": ew, "b": full("b")}


def check(sd: dict[str, Any], expect: dict[str, torch.Tensor]) -> None:
    check_equal("w", sd["w"].local_tensor, expect["w"])
    check_equal("b", sd["b"], expect["b"])


def save_good(ctx: Ctx, rank: int, world: int) -> dict[str, Any]:
    sd = {"w": sharded(full("w"), 0, world, rank)[0], "b": full("b").clone(), "step": 3}
    return result_dict(sc.save(sd, ctx.uri("good"), storage_options=ctx.opts))


def missing_key_on_one_rank(ctx: Ctx, rank: int, world: int) -> None:
    sd, _ = targets(rank, world)
    if rank == 1:
        sd["not_in_checkpoint"] = torch.zeros(4)
    sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)


def missing_key_on_one_rank_not_strict(ctx: Ctx, rank: int, world: int) -> dict[str, Any]:
    sd, expect = targets(rank, world)
    if rank == 1:
        sd["not_in_checkpoint"] = torch.zeros(4)
    res = sc.load(sd, ctx.uri("good"), storage_options=ctx.opts, strict=False)
    check(sd, expect)
    return result_dict(res)


def shape_mismatch_on_one_rank(ctx: Ctx, rank: int, world: int) -> None:
    sd, _ = targets(rank, world)
    if rank == 2:
        sd["b"] = torch.zeros((10, 4), dtype=B[1])
    sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)


def dtype_mismatch_on_one_rank(ctx: Ctx, rank: int, world: int) -> None:
    sd, _ = targets(rank, world)
    if rank == 0:
        sd["b"] = torch.zeros(B[0], dtype=torch.int64)
    sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)


def bad_state_dict_on_one_rank(ctx: Ctx, rank: int, world: int) -> None:
    """A DTensor-free invalid leaf: a key neither str nor int (int keys are valid), only on rank 2."""
    sd, _ = targets(rank, world)
    if rank == 2:
        sd[(7, 1)] = torch.zeros(1)  # type: ignore[index]
    sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)


def not_found(ctx: Ctx, rank: int, world: int) -> None:
    sd, _ = targets(rank, world)
    sc.load(sd, ctx.uri("does-not-exist"), storage_options=ctx.opts)


def corrupt_manifest(ctx: Ctx, rank: int, world: int) -> None:
    import s3fs
    import torch.distributed as dist

    if rank == 0:
        sd = {"w": full("w").clone()}
        sc.save(sd, ctx.uri("badmanifest"), storage_options=ctx.opts, process_group=dist.new_group([0]))
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **ctx.opts)
        fs.pipe(f"{ctx.uri('badmanifest')}/manifest.json", b'{"format": "streamckpt", "version": 1, "tensors": 7}')
    else:
        dist.new_group([0])  # new_group is collective over the world
    dist.barrier()
    sc.load({"w": torch.zeros(W[0])}, ctx.uri("badmanifest"), storage_options=ctx.opts)


def _flip_byte(ctx: Ctx, name: str, file: str, key: str) -> None:
    """Flip one byte inside the stored bytes of the first shard of ``key`` in ``file``."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **ctx.opts)
    manifest = json.loads(fs.cat(f"{ctx.uri(name)}/manifest.json"))
    shard = next(s for s in manifest["tensors"][key]["shards"] if s["file"] == file)
    path = f"{ctx.uri(name)}/{file}"
    data = bytearray(fs.cat(path))
    pos = shard["byte_offset"] + shard["byte_length"] // 2
    data[pos] ^= 0x40
    fs.pipe(path, bytes(data))


def corrupt_data_object(ctx: Ctx, rank: int, world: int) -> dict[str, Any]:
    """Save, flip a byte of rank 1's data file in S3, load in another layout."""
    import torch.distributed as dist

    sd = {"w": sharded(full("w"), 0, world, rank)[0], "b": full("b").clone(), "step": 3}
    sc.save(sd, ctx.uri("corrupt"), storage_options=ctx.opts)
    if rank == 0:
        _flip_byte(ctx, "corrupt", "data/00001-0000.safetensors", "w")
    dist.barrier()
    sd, expect = targets(rank, world)
    sc.load(sd, ctx.uri("corrupt"), storage_options=ctx.opts)
    check(sd, expect)
    return {"loaded": True}


def data_file_deleted(ctx: Ctx, rank: int, world: int) -> dict[str, Any]:
    """A data object disappears after the commit (e.g. a lifecycle rule): every rank raises."""
    import s3fs
    import torch.distributed as dist

    sd = {"w": sharded(full("w"), 0, world, rank)[0], "b": full("b").clone()}
    sc.save(sd, ctx.uri("deleted"), storage_options=ctx.opts)
    if rank == 0:
        s3fs.S3FileSystem(skip_instance_cache=True, **ctx.opts).rm(f"{ctx.uri('deleted')}/data/00002-0000.safetensors")
    dist.barrier()
    sd, expect = targets(rank, world)
    sc.load(sd, ctx.uri("deleted"), storage_options=ctx.opts, strict=False)
    check(sd, expect)
    return {"loaded": True}


def save_bad_value_on_one_rank(ctx: Ctx, rank: int, world: int) -> None:
    sd: dict[str, Any] = {"w": sharded(full("w"), 0, world, rank)[0]}
    if rank == 1:
        sd["opt"] = object()  # neither a tensor nor JSON
    sc.save(sd, ctx.uri("badsave"), storage_options=ctx.opts)


def save_shape_disagreement(ctx: Ctx, rank: int, world: int) -> None:
    """Ranks disagree on a replicated tensor's shape: nothing may be committed."""
    shape = (10, 3) if rank != 2 else (10, 5)
    sc.save({"b": torch.zeros(shape)}, ctx.uri("disagree"), storage_options=ctx.opts)


def save_overlapping_shards(ctx: Ctx, rank: int, world: int) -> None:
    """Rank 2's rows overlap rank 1's without being the same box: not a valid checkpoint."""
    w = full("w")
    lo, hi = ((0, 20), (20, 44), (40, 64))[rank]
    sc.save({"w": sc.ShardedTensor(w[lo:hi].clone(), tuple(w.shape), (lo, 0))}, ctx.uri("overlap"),
            storage_options=ctx.opts)


def save_with_gap(ctx: Ctx, rank: int, world: int) -> None:
    """Rows 60-63 are held by no rank: the checkpoint would not cover the tensor."""
    w = full("w")
    lo, hi = ((0, 20), (20, 40), (40, 60))[rank]
    sc.save({"w": sc.ShardedTensor(w[lo:hi].clone(), tuple(w.shape), (lo, 0))}, ctx.uri("gap"),
            storage_options=ctx.opts)


def save_exists(ctx: Ctx, rank: int, world: int) -> None:
    sd = {"w": sharded(full("w"), 0, world, rank)[0]}
    sc.save(sd, ctx.uri("good"), storage_options=ctx.opts)


def good_load_after_failures(ctx: Ctx, rank: int, world: int) -> dict[str, Any]:
    sd, expect = targets(rank, world)
    res = sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)
    check(sd, expect)
    if sd["step"] != 3:
        raise AssertionError(f"step: got {sd['step']!r}")
    return result_dict(res)


SCENARIOS: list[tuple[str, Callable[..., Any]]] = [
    ("save_good", save_good),
    ("missing_key_on_one_rank", missing_key_on_one_rank),
    ("missing_key_on_one_rank_not_strict", missing_key_on_one_rank_not_strict),
    ("shape_mismatch_on_one_rank", shape_mismatch_on_one_rank),
    ("dtype_mismatch_on_one_rank", dtype_mismatch_on_one_rank),
    ("bad_state_dict_on_one_rank", bad_state_dict_on_one_rank),
    ("not_found", not_found),
    ("corrupt_manifest", corrupt_manifest),
    ("corrupt_data_object", corrupt_data_object),
    ("data_file_deleted", data_file_deleted),
    ("save_bad_value_on_one_rank", save_bad_value_on_one_rank),
    ("save_shape_disagreement", save_shape_disagreement),
    ("save_overlapping_shards", save_overlapping_shards),
    ("save_with_gap", save_with_gap),
    ("save_exists", save_exists),
    ("good_load_after_failures", good_load_after_failures),
]


def worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    ctx = Ctx(root, opts)
    return run_scenarios(rank, world, [(n, functools.partial(f, ctx)) for n, f in SCENARIOS])


@pytest.fixture(scope="module")
def root(local_s3: Any) -> str:
    return f"s3://{BUCKET}/failures-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def opts(local_s3: Any) -> dict[str, Any]:
    return local_s3.storage_options


@pytest.fixture(scope="module")
def runs(root: str, opts: dict[str, Any]) -> ScenarioResults:
    ranks = run_ranks(WORLD, worker, kwargs={"root": root, "opts": opts}, timeout=240, pg_timeout=PG_TIMEOUT)
    results = ScenarioResults(ranks, [n for n, _ in SCENARIOS])
    results.values("save_good")
    return results


def assert_all_raise(runs: ScenarioResults, name: str, *, own: dict[int, str], others: str = "CheckpointError") -> list[sc.CheckpointError]:
    """Every rank raised: rank r in ``own`` exactly that class, the rest a subclass of ``others``."""
    errs = runs.errors(name)
    summary = [str(e) if e else "returned normally" for e in errs]
    assert all(e is not None for e in errs), f"{name}: some rank did not raise: {summary}"
    for rank, e in enumerate(errs):
        assert e is not None
        assert e.isa("CheckpointError"), f"{name}: rank {rank} raised {e}\n{e.tb}"
        if rank in own:
            assert e.cls == own[rank], f"{name}: rank {rank} raised {e}, expected {own[rank]}"
        else:
            assert e.isa(others), f"{name}: rank {rank} raised {e}, expected a {others}"
        # agreed, not learnt from a collective that broke or timed out
        assert e.cls != "PeerError" and BACKEND_FAILURE not in e.msg, f"{name}: rank {rank} raised {e}"
    return errs  # type: ignore[return-value]


def test_missing_key_on_one_rank_raises_everywhere(runs: ScenarioResults) -> None:
    errs = assert_all_raise(runs, "missing_key_on_one_rank", own={1: "MissingKeysError"})
    assert "not_in_checkpoint" in errs[1].msg


def test_missing_key_on_one_rank_not_strict_is_reported_there_only(runs: ScenarioResults) -> None:
    stats = runs.values("missing_key_on_one_rank_not_strict")
    assert [s["missing_keys"] for s in stats] == [[], ["not_in_checkpoint"], []]


def test_shape_mismatch_on_one_rank_raises_incompatible_everywhere(runs: ScenarioResults) -> None:
    errs = assert_all_raise(runs, "shape_mismatch_on_one_rank", own={2: "IncompatibleStateDictError"},
                            others="IncompatibleStateDictError")
    assert "b" in errs[2].msg and "[10, 4]" in errs[2].msg


def test_dtype_mismatch_on_one_rank_raises_incompatible_everywhere(runs: ScenarioResults) -> None:
    assert_all_raise(runs, "dtype_mismatch_on_one_rank", own={0: "IncompatibleStateDictError"},
                     others="IncompatibleStateDictError")


def test_invalid_state_dict_on_one_rank_raises_everywhere(runs: ScenarioResults) -> None:
    errs = assert_all_raise(runs, "bad_state_dict_on_one_rank", own={2: "IncompatibleStateDictError"})
    assert "(7, 1)" in errs[2].msg and "strings or ints" in errs[2].msg


def test_checkpoint_not_found_on_all_ranks(runs: ScenarioResults) -> None:
    errs = assert_all_raise(runs, "not_found", own={}, others="CheckpointNotFoundError")
    assert all("does-not-exist" in e.msg for e in errs)


def test_corrupt_manifest_on_all_ranks(runs: ScenarioResults) -> None:
    assert_all_raise(runs, "corrupt_manifest", own={}, others="CorruptCheckpointError")


def test_corrupted_data_object_raises_corrupt_on_reader_and_error_everywhere(runs: ScenarioResults) -> None:
    errs = assert_all_raise(runs, "corrupt_data_object", own={})
    assert all(e.isa("CorruptCheckpointError") for e in errs), [str(e) for e in errs]
    # the reader of the flipped chunk raises its own error naming the object and byte range;
    # the others say which rank failed
    readers = [r for r, e in enumerate(errs) if not e.msg.startswith("rank ")]
    assert readers, [str(e) for e in errs]
    for r, e in enumerate(errs):
        assert "data/00001-0000.safetensors" in e.msg and "bytes [" in e.msg, e
        if r not in readers:
            assert e.msg.startswith(f"rank {readers[0]} failed"), e


def test_deleted_data_object_raises_everywhere(runs: ScenarioResults) -> None:
    # a committed checkpoint missing a listed object is corrupt (not "not found"), on every rank
    errs = assert_all_raise(runs, "data_file_deleted", own={}, others="CorruptCheckpointError")
    assert any("data/00002-0000.safetensors" in e.msg for e in errs), [str(e) for e in errs]


def test_save_with_bad_value_on_one_rank_raises_everywhere(runs: ScenarioResults, root: str, opts: dict[str, Any]) -> None:
    assert_all_raise(runs, "save_bad_value_on_one_rank", own={1: "IncompatibleStateDictError"})
    assert sc.latest(root, storage_options=opts) is not None  # "good" is there
    with pytest.raises(sc.CheckpointNotFoundError):
        sc.inspect(f"{root}/badsave", storage_options=opts)


def test_save_disagreeing_shapes_raises_everywhere_and_commits_nothing(
    runs: ScenarioResults, root: str, opts: dict[str, Any]
) -> None:
    assert_all_raise(runs, "save_shape_disagreement", own={}, others="IncompatibleStateDictError")
    with pytest.raises(sc.CheckpointNotFoundError):
        sc.inspect(f"{root}/disagree", storage_options=opts)


@pytest.mark.parametrize("case", ["save_overlapping_shards", "save_with_gap"])
def test_save_with_invalid_tiling_raises_everywhere_and_commits_nothing(
    runs: ScenarioResults, root: str, opts: dict[str, Any], case: str
) -> None:
    errs = assert_all_raise(runs, case, own={}, others="IncompatibleStateDictError")
    assert all("w" in e.msg for e in errs)
    with pytest.raises(sc.CheckpointNotFoundError):
        sc.inspect(f"{root}/{ {'save_overlapping_shards': 'overlap', 'save_with_gap': 'gap'}[case]}",
                   storage_options=opts)


def test_save_over_committed_checkpoint_raises_exists_everywhere(
    runs: ScenarioResults, root: str, opts: dict[str, Any]
) -> None:
    assert_all_raise(runs, "save_exists", own={0: "CheckpointExistsError"}, others="CheckpointExistsError")
    got = sc.load_full(f"{root}/good", storage_options=opts)
    check_equal("w", got["w"], full("w"))


def test_group_still_works_after_agreed_failures(runs: ScenarioResults) -> None:
    stats = runs.values("good_load_after_failures")
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    assert all(s["missing_keys"] == [] for s in stats)


# ----------------------------------------------------------------------------- slow: a storage outage


def outage_on_one_rank(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 reaches S3 through a proxy that resets every GET: it gives up after its retries
    (StorageError) and every other rank raises too, well inside the group's timeout."""
    from streamckpt.testing import FaultProxy

    ctx = Ctx(root, opts)

    def save(rank: int, world: int) -> None:
        save_good(ctx, rank, world)

    def load(rank: int, world: int) -> None:
        sd, _ = targets(rank, world)
        if rank != 1:
            sc.load(sd, ctx.uri("good"), storage_options=ctx.opts)
            return
        with FaultProxy(opts["endpoint_url"], faults=["reset"], rate=1.0, max_repeats=10**6,
                        methods=("GET",)) as proxy:
            sc.load(sd, ctx.uri("good"), storage_options=proxy.storage_options)

    return run_scenarios(rank, world, [("save", save), ("load", load)])


@pytest.mark.slow
def test_storage_outage_on_one_rank_raises_everywhere(root: str, opts: dict[str, Any]) -> None:
    ranks = run_ranks(2, outage_on_one_rank, kwargs={"root": f"{root}-outage", "opts": opts},
                      timeout=240, pg_timeout=PG_TIMEOUT)
    runs = ScenarioResults(ranks, ["save", "load"])
    runs.values("save")
    errs = runs.errors("load")
    assert errs[1] is not None and errs[1].cls == "StorageError", errs
    # rank 1 gave up within its retry budget and the group agreed: rank 0 did not time out
    assert errs[0] is not None and errs[0].isa("CheckpointError") and errs[0].msg.startswith("rank 1 failed"), errs
    assert errs[0].cls != "PeerError" and BACKEND_FAILURE not in errs[0].msg, errs


# ----------------------------------------------------------------------------- the harness itself


def hang_or_crash(rank: int, world: int, mode: str) -> int:
    import os
    import time

    import torch.distributed as dist

    if rank == 1:
        if mode == "hang":
            time.sleep(3600)
        os._exit(3)
    dist.barrier()  # rank 1 never arrives: gloo must fail (peer gone) or the harness kill it
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hang", "crash"])
def test_harness_never_hangs(mode: str) -> None:
    ranks = run_ranks(2, hang_or_crash, kwargs={"mode": mode}, timeout=25, pg_timeout=10)
    assert ranks[1].error is not None and ranks[1].error.cls == "NoResult"
    assert ("killed" in ranks[1].error.msg) == (mode == "hang")
    assert ranks[0].error is not None  # the barrier failed or timed out; it did not return
