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


def started_worker(rank: int, world: int) -> dict[str, Any]:
    import threading
    import time

    from streamckpt.comm import make_comm
    from streamckpt.errors import StorageError
    from streamckpt.manage.collective import on_one_rank, started_on_one_rank

    comm = make_comm(None)
    ran: list[tuple[str, float]] = []

    def listing() -> list[int]:
        ran.append((threading.current_thread().name, time.perf_counter()))
        time.sleep(0.3)
        return [1, 2]

    t0 = time.perf_counter()
    soon = started_on_one_rank(comm, listing)
    time.sleep(0.3)  # the rank's own work, beside the listing on rank 0
    got = on_one_rank(comm, soon)

    def failing() -> list[int]:
        raise StorageError("the bucket cannot be listed")

    try:
        on_one_rank(comm, started_on_one_rank(comm, failing))
        error = ""
    except StorageError as e:
        error = str(e)
    return {"got": got, "ran": [name for name, _ in ran], "started_after": [t - t0 for _, t in ran],
            "error": error}


def test_started_on_one_rank_runs_beside_the_ranks_work_and_shares_its_answer_or_error() -> None:
    """A tier restore starts the bucket's listing on rank 0 and shares it after the ranks'
    reports: the listing runs on a thread of rank 0 alone, from the start, and its answer or its
    error reaches every rank."""
    out = [r.unwrap() for r in run_ranks(2, started_worker)]
    assert [o["got"] for o in out] == [[1, 2], [1, 2]]
    assert out[0]["ran"][0].startswith("streamckpt-started") and out[1]["ran"] == []  # rank 0 alone, on a thread
    assert out[0]["started_after"][0] < 0.2  # before the rank's own 0.3 s of work, not after it
    assert all("the bucket cannot be listed" in o["error"] for o in out)
