"""NCCL relays and message parts (issue 42, items 2 and 5): the load the GPU check runs with
``max_peers=1``, ``direct_message_bytes=64`` and a 1 MiB budget (``benchmarks/gpu_nccl.py``),
on the NCCL data plane — here over gloo with the CUDA stand-in, on 2+ lent GPUs over NCCL.
Every element is checked; messages went in parts, were relayed (4 ranks), and no relay hop went
through the host (a relayed piece kept on the device for its next NCCL hop)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed import run_ranks

import streamckpt as sc
from benchmarks import gpu_nccl


def _check(reports: list[dict], world: int) -> None:
    ok, figure = gpu_nccl.verdict(reports, world)
    assert all(r["wrong"] == [] for r in reports), figure
    assert all(r["violations"] == [] for r in reports), figure
    assert sum(r["split"] for r in reports) > 0, figure
    if world >= 4:
        assert sum(r["relayed"] for r in reports) > 0 and sum(r["kept"] for r in reports) > 0, figure
    assert sum(r["downloads"] for r in reports) == 0, figure  # no relay hop through the host
    assert ok, figure


def test_relays_and_parts_on_the_nccl_plane_with_the_stand_in(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    sc.save(gpu_nccl.model(), uri)
    ranks = run_ranks(4, gpu_nccl.exchange_worker, kwargs={"uri": uri, "fake": True}, timeout=180)
    _check([r.unwrap() for r in ranks], 4)


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for NCCL between ranks ({GPUS} here)")
def test_relays_and_parts_over_nccl_on_gpus(tmp_path: Path) -> None:
    world = min(GPUS, 4)
    uri = str(tmp_path / "ckpt")
    sc.save(gpu_nccl.model(), uri)
    ranks = run_ranks(world, gpu_nccl.exchange_worker, kwargs={"uri": uri}, backend="nccl", timeout=240)
    _check([r.unwrap() for r in ranks], world)
