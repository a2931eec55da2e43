"""One life of a training job in the soak (tests/test_soak.py): restore, then train and save.

    torchrun --nproc-per-node 2 tests/soak_job.py ROOT OPTS_JSON JOURNAL STEPS

Every step is saved (async, incremental, through the manager's retention). The state of step
``s`` is a function of ``s`` alone (``expected``), so any committed step can be checked against
it. A step is written to ``JOURNAL.<rank>`` (appended, flushed, fsynced) once its save is known
durable: its ``SaveHandle.result()`` returned. Rank 0 prints ``RESTORED <step>`` and ``DONE``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

import streamckpt as sc

ROWS, COLS = 64, 256
POLICY = {"keep_last": 3, "keep_every": 10}


def expected(step: int) -> dict[str, torch.Tensor]:
    """The whole state after ``step``: a frozen part (incremental saves reuse it) and a trained one."""
    frozen = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return {"frozen": frozen, "trained": frozen * 0.5 + float(step), "bias": torch.full((COLS,), float(-step))}


def local_state(step: int, rank: int, world: int) -> dict[str, object]:
    rows = ROWS // world
    out: dict[str, object] = {"step": step}
    for key, full in expected(step).items():
        if full.dim() == 2:  # row-sharded over the ranks
            out[key] = sc.ShardedTensor(full[rows * rank: rows * (rank + 1)].clone(), full.shape, (rows * rank, 0))
        else:
            out[key] = full.clone()  # replicated
    return out


def main() -> None:
    faulthandler.enable()
    root, opts, journal, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = open(f"{journal}.{rank}", "a")

    def durable(step: int) -> None:
        log.write(f"{step}\n")
        log.flush()
        os.fsync(log.fileno())

    with sc.CheckpointManager(root, storage_options=opts, async_save=True, incremental=True, **POLICY) as mgr:
        target = local_state(0, rank, world)
        got = mgr.restore(target)
        start = 0 if got is None else got.step + 1
        if got is not None:
            want = local_state(got.step, rank, world)
            for key in ("frozen", "trained", "bias"):
                mine = target[key].local_tensor if isinstance(target[key], sc.ShardedTensor) else target[key]
                ref = want[key].local_tensor if isinstance(want[key], sc.ShardedTensor) else want[key]
                if not torch.equal(mine, ref):
                    raise SystemExit(f"rank {rank}: restored step {got.step} differs in {key}")
        if rank == 0:
            print(f"RESTORED {-1 if got is None else got.step}", flush=True)
        pending: tuple[int, object] | None = None
        for step in range(start, start + steps):
            handle = mgr.save(step, local_state(step, rank, world), metrics={"loss": 1.0 / (step + 1)})
            if pending is not None:
                pending[1].result()  # type: ignore[attr-defined]
                durable(pending[0])
            pending = (step, handle)
        if pending is not None:
            pending[1].result()  # type: ignore[attr-defined]
            durable(pending[0])
    dist.destroy_process_group()
    if rank == 0:
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
