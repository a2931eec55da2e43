"""CheckpointManager on gloo process groups (real processes, moto over HTTP): 2 ranks save
(async, pruned on one rank after each commit), 3 ranks agree on the steps, pass over the
same broken newest, restore resharded, and raise the same error for one rank's mistake."""

from __future__ import annotations

import uuid
from typing import Any

import torch

import streamckpt as sc
from streamckpt.storage import Storage

from conftest import BUCKET
from distributed import run_ranks

ROWS, COLS = 12, 8


def _full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step


def save2_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    rows = ROWS // world
    with sc.CheckpointManager(root, storage_options=opts, keep_last=2, async_save=True) as mgr:
        for step in (1, 2, 3):
            local = _full(step)[rows * rank: rows * (rank + 1)].clone()
            mgr.save(step, {"w": sc.ShardedTensor(local, (ROWS, COLS), (rows * rank, 0)), "step": step},
                     metrics={"loss": 1.0 / step})
            mgr.wait()
        return {"steps": mgr.steps(), "metrics": mgr.metrics(3)}


def restore3_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    rows = ROWS // world
    mgr = sc.CheckpointManager(root, storage_options=opts)
    target = {"w": sc.ShardedTensor(torch.zeros(rows, COLS), (ROWS, COLS), (rows * rank, 0)), "step": 0}
    got = mgr.restore(target)
    assert got is not None
    equal = torch.equal(target["w"].local_tensor, _full(got.step)[rows * rank: rows * (rank + 1)])
    tree = mgr.restore()  # sc.load_state on every rank: the whole tensor
    assert tree is not None
    wrong = (ROWS, COLS + 1) if rank == 2 else (ROWS, COLS)  # one rank's mistake
    try:
        mgr.restore({"w": sc.ShardedTensor(torch.zeros(rows, wrong[1]), wrong, (rows * rank, 0))})
        mistake = None
    except sc.CheckpointError as e:
        mistake = type(e).__name__
    return {"steps": mgr.steps(), "step": got.step, "skipped": [u for u, _ in got.skipped], "equal": equal,
            "tree_step": tree.step, "tree_equal": torch.equal(tree.state["w"], _full(tree.step)),
            "mistake": mistake}


def test_two_ranks_save_three_ranks_restore(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/manager-ranks-{uuid.uuid4().hex[:10]}"
    opts = local_s3.storage_options
    saved = [r.unwrap() for r in run_ranks(2, save2_worker, kwargs={"root": root, "opts": opts}, timeout=180)]
    assert saved == [{"steps": [2, 3], "metrics": {"loss": 1.0 / 3}}] * 2
    assert sorted({n.split("/")[0] for n in Storage(root, opts).list("", recursive=True)}) == ["step-2", "step-3"]
    # rank 1's data object of the newest step is deleted by hand: every rank must pass over it
    st = Storage(f"{root}/step-3", opts)
    assert st.list("data") == ["data/00000-0000.safetensors", "data/00001-0000.safetensors"]
    st.delete("data/00001-0000.safetensors")
    ranks = [r.unwrap() for r in run_ranks(3, restore3_worker, kwargs={"root": root, "opts": opts}, timeout=180)]
    assert ranks == [{"steps": [2, 3], "step": 2, "skipped": [f"{root}/step-3"], "equal": True, "tree_step": 2,
                      "tree_equal": True, "mistake": "IncompatibleStateDictError"}] * 3
