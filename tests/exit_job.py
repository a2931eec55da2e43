"""A training job that async-saves, ended in the ways real jobs end (tests/test_exit.py).

    python tests/exit_job.py MODE ROOT OPTS_JSON        # one process
    torchrun --nproc-per-node 2 tests/exit_job.py MODE ROOT OPTS_JSON   # gloo ranks

MODE:
* ``loop``     — train 8 steps, ``async_save`` every 2 (waiting for the previous one first),
  ``result()`` of the last, then end; under torchrun also ``destroy_process_group()``.
* ``loop-nodestroy`` — the same, without ``destroy_process_group()``.
* ``inflight`` — start one ``async_save`` and end the script without waiting for it.
* ``inflight-destroy`` — start one, call ``destroy_process_group()``, end.
* ``wait``     — start one, print ``STAGED``, then keep "training" (sleep) until a signal.
* ``mgr-inflight`` — a ``CheckpointManager(async_save=True)`` saves step 1, the script ends
  without ``mgr.wait()`` / ``mgr.close()`` (a normal exit: the save is finished).
* ``mgr-inflight-raise`` — the same, but the script ends on an uncaught exception.
* ``mgr-inflight-destroy`` — as ``mgr-inflight``, with ``destroy_process_group()`` at the end.
* ``mgr-peer-dies`` — the same as ``mgr-inflight`` on rank 0, while rank 1 dies (``os._exit(3)``)
  right after the save is staged.

The manager's saves also hold ``marker``: ``arange(4096) * step`` under the rank's key.

Prints ``STAGED`` (flushed) once ``async_save`` has returned, ``DONE`` before a clean end.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import streamckpt as sc


def state(step: int, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}


def main() -> None:
    faulthandler.enable()
    mode, root, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ranks = "WORLD_SIZE" in os.environ
    if ranks:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranks else 0
    torch.manual_seed(rank)
    width = int(os.environ.get("EXIT_JOB_WIDTH", "512"))
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    optim = torch.optim.AdamW(model.parameters())
    # each rank saves its own model under its own key: replicas would be written once
    prefix = f"rank{rank}"

    def step_once() -> None:
        model(torch.randn(8, width)).sum().backward()
        optim.step()
        optim.zero_grad()

    if mode.startswith("loop"):
        handle = None
        for step in range(1, 9):
            step_once()
            if step % 2 == 0:
                if handle is not None:
                    handle.result()
                handle = sc.async_save({prefix: state(step, model, optim)}, f"{root}/step-{step}",
                                       storage_options=opts)
        assert handle is not None
        handle.result()
        if ranks and mode == "loop":
            dist.destroy_process_group()
        print("DONE", flush=True)
        return
    step_once()
    if mode.startswith("mgr-"):
        mgr = sc.CheckpointManager(root, storage_options=opts, async_save=True)
        mgr.save(1, {prefix: {**state(1, model, optim), "marker": torch.arange(4096.0)}})
        print("STAGED", flush=True)
        if mode == "mgr-peer-dies" and rank == 1:
            os._exit(3)
        time.sleep(float(os.environ.get("EXIT_JOB_LINGER", "0")))
        print("DONE", flush=True)
        if mode == "mgr-inflight-raise":
            raise RuntimeError("the training loop failed")
        if mode == "mgr-inflight-destroy" and ranks:
            dist.destroy_process_group()
        return
    sc.async_save({prefix: state(1, model, optim)}, f"{root}/step-1", storage_options=opts)
    print("STAGED", flush=True)
    if mode == "inflight":
        time.sleep(float(os.environ.get("EXIT_JOB_LINGER", "0")))  # a step or two of training
        print("DONE", flush=True)
        return
    if mode == "inflight-destroy":
        if ranks:
            dist.destroy_process_group()
        print("DONE", flush=True)
        return
    if mode == "wait":
        while True:
            time.sleep(0.05)
            step_once()
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
