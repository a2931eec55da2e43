"""Incremental saves on a real S3 server (moto over HTTP): a LoRA-style state whose frozen base
does not change uploads only the adapters; every checkpoint loads exactly like a full one
(also resharded, from 2 gloo ranks); bad bases and tampered references are refused; prune and
collect_garbage keep what a committed checkpoint references."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.manage import report
from streamckpt.storage import Storage

from conftest import BUCKET
from distributed import run_ranks

FROZEN = {f"layers.{i}.weight": (i + 1) * torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
          for i in range(4)}  # 4 x 64 KiB, never changed
FROZEN_BYTES = sum(t.numel() * 4 for t in FROZEN.values())


def _state(step: int) -> dict[str, Any]:
    lora = {f"layers.{i}.lora_a": torch.full((8, 256), float(step + i)) for i in range(4)}
    return {"model": {**FROZEN, **lora}, "step": step}


def _objects(uri: str, opts: dict[str, Any]) -> dict[str, int]:
    store = Storage(uri, opts)
    try:
        return {n: info.size for n, info in store.list_info("").items()}
    finally:
        store.close()


def _manifest(uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    store = Storage(uri, opts)
    try:
        return json.loads(store.read_bytes("manifest.json"))
    finally:
        store.close()


def _assert_state(got: dict[str, Any], step: int) -> None:
    want = _state(step)["model"]
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def test_unchanged_shards_are_referenced_not_uploaded(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    r1 = sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    r2 = sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/step-1")
    r3 = sc.save(_state(3), f"{s3_uri}/step-3", storage_options=s3_opts, base=f"{s3_uri}/step-2")
    assert r1.bytes_reused == 0 and r2.bytes_reused == FROZEN_BYTES == r3.bytes_reused
    lora_bytes = 4 * 8 * 256 * 4
    objects = _objects(s3_uri, s3_opts)
    for step, r in ((2, r2), (3, r3)):
        mine = {n: size for n, size in objects.items() if n.startswith(f"step-{step}/")}
        assert sorted(mine) == sorted(f"step-{step}/{f}" for f in r.files)  # the server holds what it reports
        assert r.bytes_written == sum(mine.values())
        data = sum(size for n, size in mine.items() if "/data/" in n)
        assert lora_bytes <= data < lora_bytes + 4096  # the adapters (and a safetensors header), nothing frozen
    doc3 = _manifest(f"{s3_uri}/step-3", s3_opts)
    assert doc3["version"] == 2 and doc3["bases"] == ["step-1"]  # resolved to the file holding the bytes: no chain
    assert {f for f in doc3["files"] if f.startswith("..")} == {"../step-1/data/00000-0000.safetensors"}
    assert _manifest(f"{s3_uri}/step-1", s3_opts)["version"] == 1
    for step in (1, 2, 3):
        uri = f"{s3_uri}/step-{step}"
        flat = sc.load_full(uri, storage_options=s3_opts)
        _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, step)
        state = sc.load_state(uri, storage_options=s3_opts)
        assert state["step"] == step
        _assert_state(state["model"], step)
        target = {"model": {k: torch.zeros_like(t) for k, t in _state(0)["model"].items()}, "step": 0}
        sc.load(target, uri, storage_options=s3_opts)
        _assert_state(target["model"], step)
        assert sc.inspect(uri, storage_options=s3_opts).total_bytes == FROZEN_BYTES + lora_bytes


def test_merge_verify_and_the_dcp_reader_read_an_incremental_checkpoint(s3_uri: str, s3_opts: dict[str, Any],
                                                                        tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from streamckpt.cli import main
    from streamckpt.dcp import StorageReader
    from test_cli import s3_flags

    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/step-1")
    sc.merge(f"{s3_uri}/step-2", str(tmp_path / "hf"), storage_options=s3_opts, out_storage_options={})
    merged = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        merged.update(load_file(str(f)))
    _assert_state({k.removeprefix("model."): t for k, t in merged.items()}, 2)
    assert main(["verify", f"{s3_uri}/step-2", *s3_flags(s3_opts)]) == 0
    target = {f"model.{k}": torch.zeros_like(t) for k, t in _state(0)["model"].items()}
    dcp.load(target, storage_reader=StorageReader(f"{s3_uri}/step-2", storage_options=s3_opts), no_dist=True)
    _assert_state({k.removeprefix("model."): t for k, t in target.items()}, 2)


def test_a_changed_dtype_or_compression_is_uploaded_again(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save(_state(1), f"{s3_uri}/a", storage_options=s3_opts)
    r = sc.save(_state(1), f"{s3_uri}/b", storage_options=s3_opts, base=f"{s3_uri}/a", compression="zstd")
    assert r.bytes_reused == 0  # another codec: nothing matches
    half = {"model": {k: t.to(torch.bfloat16) for k, t in _state(1)["model"].items()}, "step": 1}
    r = sc.save(half, f"{s3_uri}/c", storage_options=s3_opts, base=f"{s3_uri}/a")
    assert r.bytes_reused == 0
    back = sc.load_full(f"{s3_uri}/c", storage_options=s3_opts)
    assert all(torch.equal(back[f"model.{k}"], t) for k, t in half["model"].items())


def test_same_bytes_of_another_dtype_are_not_reused(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A zero float32 tensor and a zero int32 tensor of one shape have the same bytes and digest:
    only the dtype in the match tells them apart (the dtype test above uses bf16, whose bytes differ)."""
    sc.save({"w": torch.zeros(64, 32, dtype=torch.float32)}, f"{s3_uri}/a", storage_options=s3_opts)
    r = sc.save({"w": torch.zeros(64, 32, dtype=torch.int32)}, f"{s3_uri}/b", storage_options=s3_opts,
                base=f"{s3_uri}/a")
    assert r.bytes_reused == 0 and r.bytes_written >= 64 * 32 * 4
    m = _manifest(f"{s3_uri}/b", s3_opts)
    assert not m.get("bases") and all(not s["file"].startswith("../") for s in m["tensors"]["w"]["shards"])
    back = sc.load_full(f"{s3_uri}/b", storage_options=s3_opts)
    assert back["w"].dtype == torch.int32 and torch.equal(back["w"], torch.zeros(64, 32, dtype=torch.int32))


def test_bad_bases_are_refused_with_a_clear_error(s3_uri: str, s3_opts: dict[str, Any], tmp_path: Any) -> None:
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    cases = {
        f"{s3_uri}/step-9": "not a committed streamckpt checkpoint",  # never saved (or deleted)
        f"{s3_uri}-other/step-1": "not a sibling",  # another root
        f"s3://{BUCKET}/elsewhere/step-1": "not a sibling",
        f"{s3_uri}/step-2": "is the checkpoint being written",
    }
    for base, match in cases.items():
        with pytest.raises(sc.CheckpointError, match=match):
            sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=base)
    hf = Storage(f"{s3_uri}/hf", s3_opts)  # a Hugging Face directory: another format
    hf.write_bytes("model.safetensors", b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    hf.close()
    with pytest.raises(sc.CheckpointError, match="not a committed streamckpt checkpoint"):
        sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/hf")
    assert not any(n.startswith("step-2/") for n in _objects(s3_uri, s3_opts))  # nothing uploaded


@pytest.mark.parametrize("name", ["../../elsewhere/data/00000-0000.safetensors",
                                  "../step-1/../../x/data/00000-0000.safetensors"])
def test_tampered_references_are_refused_on_load(s3_uri: str, s3_opts: dict[str, Any], name: str) -> None:
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/step-1")
    raw = json.dumps(_manifest(f"{s3_uri}/step-2", s3_opts)).replace("../step-1/data/00000-0000.safetensors", name)
    store = Storage(f"{s3_uri}/step-2", s3_opts)
    store.write_bytes("manifest.json", raw.encode())
    store.close()
    with pytest.raises(sc.CorruptCheckpointError, match="file"):
        sc.load_full(f"{s3_uri}/step-2", storage_options=s3_opts)


def test_a_reference_from_a_bucket_root_checkpoint_is_refused(local_s3: Any, s3_opts: dict[str, Any]) -> None:
    """A checkpoint at the top of a bucket has no siblings: '../x' would leave the bucket."""
    bucket = f"incr-top-{uuid.uuid4().hex[:8]}"
    local_s3.make_bucket(bucket)
    sc.save(_state(1), f"s3://{bucket}", storage_options=s3_opts)
    doc = _manifest(f"s3://{bucket}", s3_opts)
    doc["version"], doc["bases"] = 2, [BUCKET]
    shard = doc["tensors"]["model.layers.0.weight"]["shards"][0]
    ref = f"../{BUCKET}/{shard['file']}"
    doc["files"][ref] = doc["files"][shard["file"]]
    shard["file"] = ref
    store = Storage(f"s3://{bucket}", s3_opts)
    store.write_bytes("manifest.json", json.dumps(doc).encode())
    store.close()
    with pytest.raises(sc.CorruptCheckpointError, match="no siblings"):
        sc.load_full(f"s3://{bucket}", storage_options=s3_opts)


def _infos(uri: str, opts: dict[str, Any]) -> dict[str, tuple[int, Any]]:
    store = Storage(uri, opts)
    try:
        return {n: (info.size, info.etag) for n, info in store.list_info("").items()}
    finally:
        store.close()


def test_overwriting_a_checkpoint_that_later_incremental_saves_reference_is_refused(
        s3_uri: str, s3_opts: dict[str, Any], tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from streamckpt.dcp import StorageWriter

    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/step-1")
    sc.save(_state(3), f"{s3_uri}/step-3", storage_options=s3_opts, base=f"{s3_uri}/step-2")  # refs step-1 too
    before = _infos(s3_uri, s3_opts)
    other = {"model": {k: t + 7 for k, t in _state(9)["model"].items()}, "step": 9}
    users = f"{s3_uri}/step-2, {s3_uri}/step-3"
    with pytest.raises(sc.CheckpointInUseError, match=f"{s3_uri}/step-1 holds bytes .*{users} reference.*sc.copy"):
        sc.save(other, f"{s3_uri}/step-1", storage_options=s3_opts, overwrite=True)
    with pytest.raises(sc.CheckpointInUseError, match=users):
        sc.async_save(other, f"{s3_uri}/step-1", storage_options=s3_opts, overwrite=True)
    with pytest.raises(dcp.api.CheckpointException, match="CheckpointInUseError"):
        dcp.save({f"model.{k}": t for k, t in other["model"].items()}, no_dist=True,
                 storage_writer=StorageWriter(f"{s3_uri}/step-1", storage_options=s3_opts, overwrite=True))
    assert _infos(s3_uri, s3_opts) == before  # nothing deleted, nothing uploaded: same objects, same ETags
    for step in (1, 2, 3):  # the referencing checkpoints (and the base) still load bit-exact
        flat = sc.load_full(f"{s3_uri}/step-{step}", storage_options=s3_opts)
        _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, step)
    sc.save(_state(4), f"{s3_uri}/step-3", storage_options=s3_opts, overwrite=True)  # no one references step-3
    sc.copy(f"{s3_uri}/step-2", f"{s3_uri}-kept/step-2", storage_options=s3_opts)  # what the error says to do
    store = Storage(s3_uri, s3_opts)
    store.delete_many([n for n in store.list_info("") if n.startswith(("step-2/", "step-3/"))])
    store.close()
    r = sc.save(other, f"{s3_uri}/step-1", storage_options=s3_opts, overwrite=True)  # no users left: replaced
    assert r.bytes_written > FROZEN_BYTES
    flat = sc.load_full(f"{s3_uri}-kept/step-2", storage_options=s3_opts)
    _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, 2)


def test_a_fresh_save_into_a_pruned_base_prefix_keeps_its_shared_files(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A base whose manifest is gone (pruned by hand) leaves the files later checkpoints share
    under its prefix; a save there by hand, with no manifest to overwrite, would reuse their
    names. It is refused like an overwrite, and costs every other fresh save one LIST."""
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    sc.save(_state(2), f"{s3_uri}/step-2", storage_options=s3_opts, base=f"{s3_uri}/step-1")
    store = Storage(s3_uri, s3_opts)
    store.delete("step-1/manifest.json")  # what a by-hand prune of step 1 would leave
    store.close()
    before = _infos(s3_uri, s3_opts)
    with pytest.raises(sc.CheckpointInUseError, match=f"{s3_uri}/step-1 holds bytes .*{s3_uri}/step-2 reference"):
        sc.save(_state(5), f"{s3_uri}/step-1", storage_options=s3_opts)
    assert _infos(s3_uri, s3_opts) == before
    flat = sc.load_full(f"{s3_uri}/step-2", storage_options=s3_opts)
    _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, 2)
    sc.save(_state(5), f"{s3_uri}/step-5", storage_options=s3_opts)  # an empty prefix: saved as ever


class _CountingXxh3:
    """xxhash.xxh3_128 that counts the bytes it is given (the hash library's own entry point:
    no code path of streamckpt is replaced)."""

    hashed = 0

    def __init__(self, data: Any = b"") -> None:
        self._h = _REAL_XXH3()
        self.update(data)

    def update(self, data: Any) -> None:
        _CountingXxh3.hashed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


import xxhash  # noqa: E402

_REAL_XXH3 = xxhash.xxh3_128


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_incremental_save_hashes_each_byte_once(s3_uri: str, s3_opts: dict[str, Any], asynchronous: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    state = _state(2)  # every shard is a candidate; the adapters differ from the base's
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    monkeypatch.setattr(xxhash, "xxh3_128", _CountingXxh3)
    _CountingXxh3.hashed = 0
    uri, base = f"{s3_uri}/step-2", f"{s3_uri}/step-1"
    if asynchronous:
        r = sc.async_save(state, uri, storage_options=s3_opts, base=base).result(timeout=60)
    else:
        r = sc.save(state, uri, storage_options=s3_opts, base=base)
    assert r.bytes_reused == FROZEN_BYTES
    assert _CountingXxh3.hashed == total  # once each: the changed adapters are not hashed again on upload
    monkeypatch.undo()
    doc = _manifest(uri, s3_opts)
    for k, t in state["model"].items():  # the digests the writer recorded without hashing are the true ones
        (shard,) = doc["tensors"][f"model.{k}"]["shards"]
        assert shard["digest"] == xxhash.xxh3_128(t.numpy().tobytes()).hexdigest(), k
    flat = sc.load_full(uri, storage_options=s3_opts)
    _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, 2)


def test_manager_incremental_prune_and_gc_keep_shared_objects(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, incremental=True, keep_last=2) as mgr:
        results = [mgr.save(step, _state(step)) for step in (1, 2, 3)]
        assert [r.bytes_reused for r in results] == [0, FROZEN_BYTES, FROZEN_BYTES]
        assert mgr.steps() == [2, 3]  # step-1 pruned: its manifest gone, its shared data file kept
        objects = _objects(s3_uri, s3_opts)
        shared = [n for n in objects if n.startswith("step-1/")]  # the frozen bytes only (compaction)
        assert len(shared) == 1 and shared[0].startswith("step-1/data/compact-"), objects
        assert objects[shared[0]] == FROZEN_BYTES
        assert mgr.collect_garbage(older_than=0) == []  # referenced: not garbage
        with pytest.raises(sc.CheckpointInUseError, match="step 1 .* holds bytes that incremental checkpoints step-2, step-3"):
            mgr.save(1, _state(1))  # pruned, but its shared file is still in use: writing there would break them
        for step in (2, 3):
            back = mgr.restore(step=step)
            assert back is not None and back.step == step and back.skipped == []
            _assert_state(back.state["model"], step)
        found = report.rows(mgr.checkpoints())
        rows = {r["name"]: r for r in found}
        head, *lines = report.table(found).splitlines()
        assert head.split()[4:7] == ["size", "own", "shared"] and lines[1].split()[:2] == ["3", "step-3"]
        assert rows["step-3"]["shared_bytes"] == objects[shared[0]]
        assert rows["step-3"]["own_bytes"] == sum(n for k, n in objects.items() if k.startswith("step-3/"))
        for step in (4, 5):  # changed frozen weights: a full upload; step-1's file goes with its last user
            state = _state(step)
            state["model"] = {k: t + 1 for k, t in state["model"].items()}
            mgr.save(step, state)
        assert mgr.steps() == [4, 5]
        objects = _objects(s3_uri, s3_opts)
        assert not any(n.startswith(("step-1/", "step-2/", "step-3/")) for n in objects)
        assert mgr.collect_garbage(older_than=0) == []


ROWS, COLS = 16, 32


def _full(step: int, name: str) -> torch.Tensor:
    scale = 1.0 if name == "frozen" else float(step)
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * scale


def incremental2_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    rows = ROWS // world
    out = {}
    for step, base in ((1, None), (2, f"{root}/step-1")):
        state = {name: sc.ShardedTensor(_full(step, name)[rows * rank: rows * (rank + 1)].clone(), (ROWS, COLS),
                                        (rows * rank, 0)) for name in ("frozen", "adapter")}
        r = sc.save(state, f"{root}/step-{step}", storage_options=opts, base=base)
        out[f"reused{step}"] = r.bytes_reused
    handle = sc.async_save({name: sc.ShardedTensor(_full(3, name)[rows * rank: rows * (rank + 1)].clone(),
                                                   (ROWS, COLS), (rows * rank, 0)) for name in ("frozen", "adapter")},
                           f"{root}/step-3", storage_options=opts, base=f"{root}/step-2")
    out["reused3"] = handle.result(timeout=60).bytes_reused
    try:
        sc.save({"x": torch.ones(2)}, f"{root}/step-9", storage_options=opts,
                base=f"{root}/missing" if rank == 0 else f"{root}/step-1")
        out["error"] = None
    except sc.CheckpointError as e:
        out["error"] = type(e).__name__
    try:  # rank 0 finds that step-2 and step-3 reference step-1: every rank refuses, nothing deleted
        sc.save({name: sc.ShardedTensor(torch.zeros(rows, COLS), (ROWS, COLS), (rows * rank, 0))
                 for name in ("frozen", "adapter")}, f"{root}/step-1", storage_options=opts, overwrite=True)
        out["overwrite"] = None
    except sc.CheckpointError as e:
        out["overwrite"] = type(e).__name__
    return out


def test_two_ranks_save_incrementally_one_process_loads_resharded(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/incr-ranks-{uuid.uuid4().hex[:10]}"
    opts = local_s3.storage_options
    got = [r.unwrap() for r in run_ranks(2, incremental2_worker, kwargs={"root": root, "opts": opts}, timeout=180)]
    half = ROWS // 2 * COLS * 4
    assert [g["reused1"] for g in got] == [0, 0]
    assert [g["reused2"] for g in got] == [half, half]  # each rank decided for its own frozen rows
    assert [g["reused3"] for g in got] == [half, half]  # async_save too
    assert all(g["error"] is not None for g in got)  # a bad base on rank 0 fails the save on every rank
    assert [g["overwrite"] for g in got] == ["CheckpointInUseError"] * 2
    assert not any(n.startswith("step-9/") for n in _objects(root, opts))
    for step in (2, 3):
        back = sc.load_full(f"{root}/step-{step}", storage_options=opts)
        assert torch.equal(back["frozen"], _full(step, "frozen")) and torch.equal(back["adapter"], _full(step, "adapter"))
        target = {"frozen": sc.ShardedTensor(torch.zeros(ROWS, COLS // 4), (ROWS, COLS), (0, COLS // 4))}
        sc.load(target, f"{root}/step-{step}", storage_options=opts, strict=False)  # another layout: columns
        assert torch.equal(target["frozen"].local_tensor, _full(step, "frozen")[:, COLS // 4: COLS // 2])


def test_copy_is_self_contained_and_loads_after_the_root_is_gone(local_s3: Any, s3_uri: str, s3_opts: dict[str, Any],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from streamckpt.cli import main
    from test_cli import s3_flags

    for step in (1, 2):
        sc.save(_state(step), f"{s3_uri}/step-{step}", storage_options=s3_opts,
                base=None if step == 1 else f"{s3_uri}/step-1")
    bucket = f"incr-copy-{uuid.uuid4().hex[:8]}"
    local_s3.make_bucket(bucket)
    sc.copy(f"{s3_uri}/step-2", f"s3://{bucket}/api-copy", storage_options=s3_opts)
    assert main(["copy", f"{s3_uri}/step-2", f"s3://{bucket}/cli-copy", *s3_flags(s3_opts)]) == 0
    assert "self-contained" in capsys.readouterr().out
    with pytest.raises(sc.CheckpointExistsError, match="exists"):
        sc.copy(f"{s3_uri}/step-2", f"s3://{bucket}/api-copy", storage_options=s3_opts)
    store = Storage(s3_uri, s3_opts)
    store.delete_many(list(store.list_info("")))  # the original root, gone
    store.close()
    assert _objects(s3_uri, s3_opts) == {}
    for name in ("api-copy", "cli-copy"):
        uri = f"s3://{bucket}/{name}"
        doc = _manifest(uri, s3_opts)
        assert doc["version"] == 1 and "bases" not in doc and not any(f.startswith("..") for f in doc["files"])
        assert sorted(_objects(uri, s3_opts)) == sorted(["manifest.json", *doc["files"]])
        flat = sc.load_full(uri, storage_options=s3_opts)
        _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, 2)


def test_copy_of_a_run_keeps_its_references_shared(local_s3: Any, s3_uri: str, s3_opts: dict[str, Any],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run's root is copied whole: every committed checkpoint under its own name, the pruned base's
    file its successors reference included (once), manifests unchanged; then it loads from the copy alone."""
    from streamckpt.cli import main
    from test_cli import s3_flags

    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, incremental=True, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        assert mgr.steps() == [2, 3]
    source = _objects(s3_uri, s3_opts)
    bucket = f"run-copy-{uuid.uuid4().hex[:8]}"
    local_s3.make_bucket(bucket)
    res = sc.copy(s3_uri, f"s3://{bucket}/api", storage_options=s3_opts)
    assert isinstance(res, sc.CopyResult) and res.checkpoints == ["step-2", "step-3"] and res.skipped == []
    copied = _objects(f"s3://{bucket}/api", s3_opts)
    assert copied == source  # the same names and sizes: step-1's shared data file, no step-1 manifest
    assert "step-1/manifest.json" not in copied and [n for n in copied if n.startswith("step-1/data/compact-")]
    assert res.bytes_written == sum(source.values()) and sorted(res.files) == sorted(source)
    assert res.files[-2:] == ["step-2/manifest.json", "step-3/manifest.json"]  # the commits, last, oldest first
    for step in (2, 3):
        assert _manifest(f"s3://{bucket}/api/step-{step}", s3_opts) == _manifest(f"{s3_uri}/step-{step}", s3_opts)
    assert main(["copy", s3_uri, f"s3://{bucket}/cli", *s3_flags(s3_opts)]) == 0
    assert "(2 checkpoints of the run)" in capsys.readouterr().out
    with pytest.raises(sc.CheckpointExistsError, match="step-2, step-3"):
        sc.copy(s3_uri, f"s3://{bucket}/api", storage_options=s3_opts)
    with pytest.raises(sc.CheckpointError, match="inside it"):
        sc.copy(s3_uri, f"{s3_uri}/backup", storage_options=s3_opts)
    store = Storage(s3_uri, s3_opts)
    store.delete_many(list(store.list_info("")))  # the original run, gone
    store.close()
    for name in ("api", "cli"):
        with sc.CheckpointManager(f"s3://{bucket}/{name}", storage_options=s3_opts) as mgr:
            assert mgr.steps() == [2, 3] and mgr.collect_garbage(older_than=0) == []
            for step in (2, 3):
                back = mgr.restore(step=step)
                assert back is not None and back.skipped == []
                _assert_state(back.state["model"], step)


def test_copy_of_a_run_leaves_out_an_unreadable_checkpoint(s3_uri: str, s3_opts: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    for step in (1, 2):
        sc.save(_state(step), f"{s3_uri}/run/step-{step}", storage_options=s3_opts,
                metadata={"step": step})
    store = Storage(f"{s3_uri}/run", s3_opts)
    store.write_bytes("step-2/manifest.json", b"{not json")
    store.close()
    res = sc.copy(f"{s3_uri}/run", f"{s3_uri}/copy", storage_options=s3_opts)
    assert res.checkpoints == ["step-1"] and [name for name, _ in res.skipped] == ["step-2"]
    assert "leaves out step-2" in caplog.text
    assert sorted(_objects(f"{s3_uri}/copy", s3_opts)) == ["step-1/data/00000-0000.safetensors",
                                                           "step-1/manifest.json"]
    flat = sc.load_full(f"{s3_uri}/copy/step-1", storage_options=s3_opts)
    _assert_state({k.removeprefix("model."): t for k, t in flat.items()}, 1)


def test_copy_refuses_bytes_that_fail_their_checksum(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save(_state(1), f"{s3_uri}/step-1", storage_options=s3_opts)
    store = Storage(f"{s3_uri}/step-1", s3_opts)
    name = "data/00000-0000.safetensors"
    data = bytearray(store.read_bytes(name))
    data[-5] ^= 0xFF  # rot in the last tensor's bytes
    store.write_bytes(name, bytes(data))
    store.close()
    with pytest.raises(sc.CorruptCheckpointError, match="checksum mismatch .* the stored object is corrupt"):
        sc.copy(f"{s3_uri}/step-1", f"{s3_uri}/copy", storage_options=s3_opts)
    assert not any(n.startswith("copy/manifest") for n in _objects(s3_uri, s3_opts))


def test_copy_blocks_cover_a_file_and_never_cut_a_chunk() -> None:
    from streamckpt.manage.copying import BLOCK, _blocks, _Chunk

    step = 300_000
    chunks = [_Chunk(100 + i * step, 100 + (i + 1) * step, i) for i in range(60)]
    size = 100 + 60 * step + 50
    blocks = _blocks(size, chunks)
    assert blocks[0][0] == 0 and blocks[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert [c for _, _, inside in blocks for c in inside] == chunks
    assert all(start <= c.start and c.stop <= stop for start, stop, inside in blocks for c in inside)
    assert len(blocks) == 3 and all(stop - start <= BLOCK + step for start, stop, _ in blocks)
