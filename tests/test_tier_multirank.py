"""The memory/peer tier on gloo process groups (real processes, moto over HTTP, one local
folder per simulated node): 4 ranks on 2 nodes save locally every step and to the bucket every
5th; restores on 4 ranks (a replaced, empty node), on 3 (a node lost, a stale folder of an
older step, a corrupted local file: the bucket serves exactly that file's bytes) and on 2 in a
flat layout (a corrupted file served by its copy on the other node, a local save that never
committed ignored) fill the state element by element with the newest local step."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import streamckpt as sc
from streamckpt.manage.tier.localdir import LocalDir
from streamckpt.manage.tier.localmanifest import LOCAL_MANIFEST

from conftest import BUCKET
from distributed import bounds, run_ranks

ROWS, COLS = 16, 8


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step + step


def bias(step: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) - step


def _node_env(rank: int, per_node: int) -> None:
    """What torchrun sets: the tier's partners come from LOCAL_WORLD_SIZE."""
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node), RANK=str(rank))


def _manager(root: str, opts: dict[str, Any], local_dir: str, async_save: bool = False) -> Any:
    return sc.CheckpointManager(root, storage_options=opts, save_every=5, local_dir=local_dir, local_every=1,
                                local_keep=2, replicas=1, async_save=async_save)


def save_worker(rank: int, world: int, root: str, opts: dict[str, Any], dirs: list[str], stale: str) -> dict[str, Any]:
    """Asynchronous saves: each returns once the state is staged; the training loop then
    overwrites its tensors at once (what the tier saved must be what was passed)."""
    _node_env(rank, 2)
    rows = ROWS // world
    kinds = []
    with _manager(root, opts, dirs[rank], async_save=True) as mgr:
        w = sc.ShardedTensor(torch.zeros(rows, COLS), (ROWS, COLS), (rows * rank, 0))
        b = torch.zeros(6, dtype=torch.float64)
        for step in range(1, 11):
            w.local_tensor.copy_(full(step)[rows * rank: rows * (rank + 1)])
            b.copy_(bias(step))
            handle = mgr.save(step, {"w": w, "b": b, "n": step})
            kinds.append(type(handle).__name__)
            w.local_tensor.fill_(-1.0)  # the next step's training changes the tensors while the save goes on
            b.fill_(-1.0)
            if step == 6:  # node 1's folder as it was at step 6: a stale one later (copied while no
                mgr.wait()  # rank of the node changes it: after every rank's commit and retention, before step 7)
                dist.barrier()
                if rank == 2:
                    shutil.copytree(dirs[rank], stale)
                dist.barrier()
        mgr.wait()
        return {"steps": mgr.steps(), "kinds": sorted(set(kinds))}


def killed_save_worker(rank: int, world: int, root: str, opts: dict[str, Any], dirs: list[str]) -> dict[str, Any]:
    """Step 11's local save (in the background), with rank 3 killed while it writes its first
    data file (a thread watching its folder ends the process): no rank may commit the step;
    the others' ``wait`` raises."""
    _node_env(rank, 2)
    rows = ROWS // world
    with _manager(root, opts, dirs[rank], async_save=True) as mgr:
        if rank == 3:
            threading.Thread(target=_die_when_writing, args=(LocalDir(dirs[rank], root).step_dir(11) / "data",),
                             daemon=True).start()
        w = sc.ShardedTensor(full(11)[rows * rank: rows * (rank + 1)].clone(), (ROWS, COLS), (rows * rank, 0))
        big = sc.ShardedTensor(torch.ones(1 << 21), (4 << 21,), (rank << 21,))  # 8 MiB a rank: writing takes a while
        try:
            mgr.save(11, {"w": w, "b": bias(11), "n": 11, "big": big})
            mgr.wait()
        except sc.CheckpointError as e:
            return {"error": type(e).__name__}
        return {"error": None}


def _die_when_writing(folder: Path) -> None:
    while True:
        if folder.exists() and any(folder.iterdir()):
            os._exit(17)
        time.sleep(0.0005)


def _targets(layout: str, rank: int, world: int) -> tuple[dict[str, Any], Any]:
    """This rank's state in ``layout`` and how to compare it with a step's full tensor."""
    if layout == "rows":
        a, b = bounds(ROWS, world, rank)
        return {"w": sc.ShardedTensor(torch.zeros(b - a, COLS), (ROWS, COLS), (a, 0))}, lambda f: f[a:b]
    if layout == "cols":
        a, b = bounds(COLS, world, rank)
        return {"w": sc.ShardedTensor(torch.zeros(ROWS, b - a), (ROWS, COLS), (0, a))}, lambda f: f[:, a:b]
    a, b = bounds(ROWS * COLS, world, rank)  # "flat": ZeRO-style 1-D slices of the flattened tensor
    return ({"w": sc.ShardedTensor(torch.zeros(b - a), (ROWS, COLS), (0, 0), local_shape=(ROWS, COLS),
                                   flat_range=(a, b))}, lambda f: f.reshape(-1)[a:b])


def restore_worker(rank: int, world: int, root: str, opts: dict[str, Any], dirs: list[str], layout: str,
                   per_node: int) -> dict[str, Any]:
    _node_env(rank, per_node)
    state, expect = _targets(layout, rank, world)
    state.update(b=torch.zeros(6, dtype=torch.float64), n=-1)
    with _manager(root, opts, dirs[rank]) as mgr:
        got = mgr.restore(state)
    assert got is not None
    return {"step": got.step, "source": got.source, "n": state["n"],
            "w": torch.equal(state["w"].local_tensor, expect(full(got.step))),
            "b": torch.equal(state["b"], bias(got.step)),
            "local": got.bytes_local, "peers": got.bytes_peers, "bucket": got.bytes_bucket,
            "bucket_read": got.bucket_bytes_read, "needed": state["w"].local_tensor.nbytes + 6 * 8}


def _run(world: int, worker: Any, **kwargs: Any) -> list[dict[str, Any]]:
    return [r.unwrap() for r in run_ranks(world, worker, kwargs=kwargs, timeout=180)]




def _data_gets(proxy: Any) -> set[str]:
    """The data objects the bucket served through ``proxy`` (as the server saw the requests)."""
    return {path.split("?")[0] for method, path, _ in proxy.history if method == "GET" and "/data/" in path}


def test_four_ranks_two_nodes_resume_from_peers(local_s3: Any, proxy_factory: Any, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/tier-{uuid.uuid4().hex[:10]}"
    opts = local_s3.storage_options
    node0, node1, stale = str(tmp_path / "node0"), str(tmp_path / "node1"), str(tmp_path / "stale")
    saved = _run(4, save_worker, root=root, opts=opts, dirs=[node0, node0, node1, node1], stale=stale)
    assert saved == [{"steps": [5, 10], "kinds": ["SaveHandle"]}] * 4
    tier0, tier1 = LocalDir(node0, root), LocalDir(node1, root)
    assert sorted(tier0.committed()) == sorted(tier1.committed()) == [9, 10]  # local_keep=2
    assert sorted(LocalDir(stale, root).committed()) == [5, 6]
    ten = tier0.committed()[10]
    files = sorted(ten.manifest.files)
    assert len(files) == 4 and ten.root == root and ten.step == 10
    for f in files:  # every file on both nodes: its writer's and its partner's
        assert (tier0.step_dir(10) / f).exists() and (tier1.step_dir(10) / f).exists()
    assert ten.keepers == {f: [int(f[5:10]), (int(f[5:10]) + 2) % 4] for f in files}
    # the bucket holds the same bytes for step 10: the same files, shard for shard
    bucket10 = sc.inspect(f"{root}/step-10", storage_options=opts)
    assert bucket10.total_bytes == ten.manifest.total_bytes

    # A: 4 ranks, node 1 replaced by an empty folder: all from node 0, ranks 2-3 over the exchange
    empty = str(tmp_path / "new1")
    proxy = proxy_factory(rate=0.0)  # no faults: it records what the bucket is asked for
    a = _run(4, restore_worker, root=root, opts=proxy.storage_options, dirs=[node0, node0, empty, empty],
             layout="rows", per_node=2)
    assert [(r["step"], r["source"], r["n"], r["w"], r["b"]) for r in a] == [(10, "local", 10, True, True)] * 4
    assert [r["bucket"] + r["bucket_read"] for r in a] == [0] * 4
    assert [r["local"] + r["peers"] for r in a] == [r["needed"] for r in a]
    assert a[2]["local"] == a[3]["local"] == 0 and a[2]["peers"] > 0 and a[0]["local"] > 0
    assert _data_gets(proxy) == set() and any(p.endswith("step-10/manifest.json") for _, p, _ in proxy.history)

    # B: corrupt node 0's copy of rank 0's file; 3 ranks: node 0, and a node with the stale
    # folder of step 6: the corrupt file's only other copy was on node 1 (gone): the bucket
    # serves exactly its bytes, nothing else
    lost = "data/00000-0000.safetensors"
    path = tier0.step_dir(10) / lost
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    lost_bytes = sum(s.byte_length for t in ten.manifest.tensors.values() for s in t.shards if s.file == lost)
    assert lost_bytes > 0
    proxy = proxy_factory(rate=0.0)
    b = _run(3, restore_worker, root=root, opts=proxy.storage_options, dirs=[node0, node0, stale], layout="cols",
             per_node=2)
    assert [(r["step"], r["source"], r["w"], r["b"]) for r in b] == [(10, "local", True, True)] * 3
    assert sum(r["bucket_read"] for r in b) == lost_bytes
    assert _data_gets(proxy) == {f"/{root[len('s3://'):]}/step-10/{lost}"}  # as the server saw it
    assert [r["local"] + r["peers"] + r["bucket"] for r in b] == [r["needed"] for r in b]
    assert all(r["bucket"] > 0 for r in b)  # rows 0-3 of every column block came from the bucket

    # C: 2 ranks in flat slices on nodes 0 and 1; a local save of step 11 that never committed
    # (its files, no local manifest: what a kill before the commit leaves) is not restored;
    # the corrupt file is read from its copy on node 1
    for tier in (tier0, tier1):
        shutil.copytree(tier.step_dir(10) / "data", tier.step_dir(11) / "data")
        assert not (tier.step_dir(11) / LOCAL_MANIFEST).exists()
    c = _run(2, restore_worker, root=root, opts=opts, dirs=[node0, node1], layout="flat", per_node=1)
    assert [(r["step"], r["source"], r["w"], r["b"]) for r in c] == [(10, "local", True, True)] * 2
    assert [r["bucket"] + r["bucket_read"] for r in c] == [0, 0]
    assert c[0]["peers"] > 0  # rank 0's first rows: from node 1's copy, not its corrupt own

    # D: a local save of step 11 killed on one rank mid-write; 6 ranks (a third, new node) restore
    # step 10 in rows of 6
    killed = run_ranks(4, killed_save_worker, kwargs={"root": root, "opts": opts, "dirs": [node0, node0, node1, node1]},
                       timeout=180)
    assert killed[3].error is not None and killed[3].error.cls == "NoResult"
    assert [k.unwrap()["error"] for k in killed[:3]] == ["PeerError"] * 3
    assert all(not (t.step_dir(11) / LOCAL_MANIFEST).exists() for t in (tier0, tier1))
    assert any((tier0.step_dir(11) / "data").iterdir())  # node 0 wrote its files: they are not restored
    new2 = str(tmp_path / "new2")
    d = _run(6, restore_worker, root=root, opts=opts, dirs=[node0, node0, node1, node1, new2, new2], layout="rows",
             per_node=2)
    assert [(r["step"], r["source"], r["n"], r["w"], r["b"]) for r in d] == [(10, "local", 10, True, True)] * 6
    assert [r["bucket"] + r["bucket_read"] for r in d] == [0] * 6 and d[4]["peers"] == d[4]["needed"]


def one_node_worker(rank: int, world: int, root: str, opts: dict[str, Any], node: str) -> dict[str, Any]:
    """Two ranks on one node sharing its folder: no partner on another node (a warning says
    what that means), each rank's files once in the shared folder; a restore reads them there."""
    _node_env(rank, 2)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("streamckpt").addHandler(handler)
    rows = ROWS // world
    mistake = None
    lone = _manager(root, opts, node) if rank == 0 else sc.CheckpointManager(root, storage_options=opts)
    try:  # rank 1 without local_dir: both ranks raise, neither waits in a collective the other never makes
        lone.save(0, {"n": 0})
    except sc.CheckpointError as e:
        mistake = str(e)
    lone.close()
    with _manager(root, opts, node) as mgr:
        # a load option the tier does not take, on rank 0 alone: every rank turns to the bucket (empty)
        skipped = mgr.restore({"n": -1}, **({"progress": False} if rank == 0 else {}))
        for step in (1, 2, 3):
            w = sc.ShardedTensor(full(step)[rows * rank: rows * (rank + 1)].clone(), (ROWS, COLS), (rows * rank, 0))
            mgr.save(step, {"w": w, "b": bias(step), "n": step})
    state, expect = _targets("cols", rank, world)
    state.update(b=torch.zeros(6, dtype=torch.float64), n=-1)
    with _manager(root, opts, node) as mgr:
        got = mgr.restore(state)
    return {"mistake": mistake is not None and "local tier differs between ranks" in mistake,
            "skipped": skipped, "warned": any("no partner on another node" in m and "0 kept" in m for m in seen),
            "step": got.step, "source": got.source, "w": torch.equal(state["w"].local_tensor, expect(full(3))),
            "bucket": got.bucket_bytes_read, "keepers": LocalDir(node, root).committed()[3].keepers}


def test_one_node_keeps_no_copies_and_says_so(local_s3: Any, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/tier-one-{uuid.uuid4().hex[:10]}"
    got = _run(2, one_node_worker, root=root, opts=local_s3.storage_options, node=str(tmp_path / "node"))
    files = {"data/00000-0000.safetensors": [0], "data/00001-0000.safetensors": [1]}
    assert [(r["mistake"], r["skipped"]) for r in got] == [(True, None)] * 2
    assert [(r["warned"], r["step"], r["source"], r["w"], r["bucket"], r["keepers"]) for r in got] == [
        (True, 3, "local", True, 0, files), (False, 3, "local", True, 0, files)]


def relay_save_worker(rank: int, world: int, root: str, opts: dict[str, Any], dirs: list[str]) -> dict[str, Any]:
    _node_env(rank, 1)  # 2 nodes of one rank: each keeps the other's file
    half = 64 // world
    emb = sc.ShardedTensor(_emb()[half * rank: half * (rank + 1)].clone(), (64, 32), (half * rank, 0))
    with _manager(root, opts, dirs[rank]) as mgr:
        mgr.save(1, {"emb": emb, "b": bias(1), "n": 1})
    return {}


def _emb() -> torch.Tensor:
    return torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 7


def relay_restore_worker(rank: int, world: int, root: str, opts: dict[str, Any], dirs: list[str]) -> dict[str, Any]:
    """Ranks 0-1 hold every file and need only ``b``; ranks 2-11 each need all of ``emb``
    (replicated): more ranks than one sends to directly, so its reads are relayed with the
    holders as the roots (``plan.holders``), through the executor's relay path."""
    _node_env(rank, 2)
    state: dict[str, Any] = {"b": torch.zeros(6, dtype=torch.float64), "n": -1}
    if rank >= 2:
        state["emb"] = torch.zeros(64, 32)
    with _manager(root, opts, dirs[rank]) as mgr:
        got = mgr.restore(state)
    return {"source": got.source, "step": got.step, "b": torch.equal(state["b"], bias(1)),
            "emb": rank < 2 or torch.equal(state["emb"], _emb()), "bucket": got.bucket_bytes_read,
            "peers": got.bytes_peers}


def test_holders_that_need_none_of_a_replicated_tensor_relay_it(local_s3: Any, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/tier-relay-{uuid.uuid4().hex[:10]}"
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    _run(2, relay_save_worker, root=root, opts=local_s3.storage_options, dirs=dirs)
    empty = [str(tmp_path / f"new{k}") for k in range(10)]
    got = _run(12, relay_restore_worker, root=root, opts=local_s3.storage_options, dirs=dirs + empty)
    assert [(r["source"], r["step"], r["b"], r["emb"], r["bucket"]) for r in got] == [("local", 1, True, True, 0)] * 12
    assert all(r["peers"] == 64 * 32 * 4 + 6 * 8 for r in got[2:])  # all of it from the holders, over the exchange
