"""Train with FSDP2, checkpoint to a bucket every N steps, resume on another world size.

    # 4 processes train steps 0..5 and save step-000003 and step-000006 under the URI
    torchrun --nproc-per-node 4 examples/train_resume.py --ckpt s3://bucket/run --steps 6 --save-every 3
    # 2 processes pick up the newest committed checkpoint (step 6) and train on to step 9
    torchrun --nproc-per-node 2 examples/train_resume.py --ckpt s3://bucket/run --steps 9 --save-every 3

Runs on CPU with gloo (the default without a GPU) and on GPUs with nccl. Pass
``--storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'`` for an
S3-compatible server (moto, MinIO); AWS credentials come from the usual
environment variables. The model and data are toys; the checkpoint code is what
a real job writes:

* ``get_state_dict(model, optim)`` gives the model's and the optimizer's state as
  DTensors (each rank holds its FSDP2 shard) plus plain values (``param_groups``
  with their learning rates, the step);
* ``sc.save`` writes that state (each rank uploads its own shards) and commits it
  by writing ``manifest.json`` last; a job killed mid-save leaves no manifest;
* on restart ``sc.latest`` finds the newest committed checkpoint, ``sc.load`` fills
  a freshly built state_dict in place, each rank reading only the bytes of its own
  shards of the new layout, and ``set_state_dict`` puts it into model and optimizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import streamckpt as sc

log = logging.getLogger("train_resume")

GLOBAL_BATCH = 8  # samples per step, split evenly over the ranks (any world size dividing it)
DIM_IN, DIM_HIDDEN, DIM_OUT = 16, 32, 4


def build_model(mesh: DeviceMesh) -> torch.nn.Module:
    """The same initial weights on every rank, then sharded by FSDP2 (layer by layer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM_IN, DIM_HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(DIM_HIDDEN, DIM_HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(DIM_HIDDEN, DIM_OUT),
    ).to(mesh.device_type)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's global batch: the same data whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, DIM_OUT, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


@dataclass
class Job:
    """A model, its optimizer and LR schedule, and the step they have reached."""

    mesh: DeviceMesh
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    step: int = 0

    @classmethod
    def create(cls, mesh: DeviceMesh, lr: float = 1e-2) -> "Job":
        model = build_model(mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.25, total_iters=4)
        return cls(mesh, model, optim, sched)

    def train_step(self) -> float:
        rank, world = self.mesh.get_local_rank(), self.mesh.size()
        x, y = batch(self.step, rank, world, self.mesh.device_type)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()  # FSDP2 reduce-scatters the gradients: each rank keeps its shard's mean
        self.optim.step()
        self.optim.zero_grad()
        self.sched.step()
        self.step += 1
        return loss.detach().item()

    def state_dict(self) -> dict[str, Any]:
        """The whole training state, as streamckpt saves and loads it."""
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(), "step": self.step}

    def save(self, root: str, storage_options: dict[str, Any] | None = None) -> str:
        """Collective: every rank writes its shards; ``manifest.json`` commits the checkpoint."""
        uri = f"{root.rstrip('/')}/step-{self.step:06d}"  # zero-padded: names sort like steps
        res = sc.save(self.state_dict(), uri, storage_options=storage_options)
        log.info("saved %s: %d bytes from this rank in %.2f s", uri, res.bytes_written, res.seconds)
        return uri

    def resume(self, root: str, storage_options: dict[str, Any] | None = None) -> str | None:
        """Load the newest committed checkpoint under ``root`` into this (maybe differently
        sharded) job; returns its URI, or None when there is none yet."""
        uri = sc.latest(root, storage_options=storage_options)
        if uri is None:
            return None
        state = self.state_dict()  # this job's layout: the targets sc.load fills in place
        res = sc.load(state, uri, storage_options=storage_options)  # strict: every key must be there
        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]
        log.info("resumed from %s at step %d: read %d bytes for %d needed", uri, self.step,
                 res.bytes_read, res.bytes_needed)
        return uri


def run(args: argparse.Namespace) -> Job:
    """Resume if a checkpoint exists, train to ``args.steps``, saving every ``args.save_every``.
    Needs an initialized process group."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    job = Job.create(mesh, lr=args.lr)
    job.resume(args.ckpt, args.storage_options)
    while job.step < args.steps:
        loss = job.train_step()
        if dist.get_rank() == 0:
            log.info("step %d loss %.5f", job.step, loss)
        if args.save_every and job.step % args.save_every == 0:
            job.save(args.ckpt, args.storage_options)
    return job


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint root URI (s3://bucket/run, gs://..., a local path)")
    ap.add_argument("--steps", type=int, default=6, help="train until this step")
    ap.add_argument("--save-every", type=int, default=3, help="save every N steps (0: never)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--storage-options", type=json.loads, default=None,
                    help='fsspec storage options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ.get('RANK', '0')} %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
