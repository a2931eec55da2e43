"""A training loop that handles preemption, run under torchrun by tests/test_preemption.py.

    torchrun --nproc-per-node 2 tests/preempt_job.py ROOT OPTS_JSON

Each rank saves ``rank{r}.marker`` (``full(1024, step)``) every 4 steps (async) and, with
``save_on_preemption=True``, once more at the step after SIGTERM, then stops. Rank 0 prints
``STEP s`` after each step; every rank prints ``PREEMPTED r s`` when it stops and ``DONE``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import streamckpt as sc


def main() -> None:
    root, opts = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with sc.CheckpointManager(root, storage_options=opts, save_every=4, async_save=True,
                              save_on_preemption=True) as mgr:
        for step in range(1, 2000):
            time.sleep(0.05)  # a training step
            if mgr.should_save(step):
                mgr.save(step, {f"rank{rank}": {"marker": torch.full((1024,), float(step))}})
            if rank == 0:
                print(f"STEP {step}", flush=True)
            if mgr.reached_preemption(step):
                print(f"PREEMPTED {rank} {step}", flush=True)
                break
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
