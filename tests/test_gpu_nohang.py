"""No hang on a GPU rank's OOM, and which plane a mixed group's data rides — on CPU.

Real gloo processes; ``fakecuda.FakeCuda`` is the CUDA (the only thing faked), and on one
rank it makes an allocation raise ``torch.OutOfMemoryError`` as a nearly full GPU (or
host) would: the pinned staging arenas, the NCCL plane's device exchange arenas (both
allocated before the load's first collective), or GPU scratch in a later round. Every
rank must raise ``StagingMemoryError`` naming the failed rank and the bytes it asked for,
well inside the process group's timeout: a rank left behind would block in a collective
until gloo's timeout and raise ``PeerError`` instead (the test's timeout bounds the rest).

A mixed ``cpu:gloo,cuda:nccl`` group needs NCCL, which a CPU machine lacks: the mixed
tests run on a real gloo group whose backend map is set to the mixed one after
``GroupComm`` read it (what ``get_backend_config`` reports on a GPU build; its parsing is
``test_device.py::test_group_backends``). What they prove: the comm layer's choice of
data plane on such a group, agreed across ranks, and that a CPU-only load then runs its
exchanges over the CPU backend with host tensors (bytes checked). They do not prove
anything about NCCL itself.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from distributed import run_ranks, run_scenarios
from fakecuda import FakeCuda
from gpu_cases import Case, run_rank, write_checkpoint

import streamckpt as sc
from streamckpt.comm import GroupComm
from streamckpt.cuda import device as _device
from streamckpt.loading.loader import LoadRequest, run_load
from streamckpt.plan.planner import PlanOptions
from streamckpt.storage import Storage

CASE = dict(budget=1024, read_once=True, zstd=False, chunk=64, agree_every=1, current_device=0, transform=False,
            cpu_targets=False)


class _FailNth:
    """Fail the ``nth`` (0-based) allocation of ``kind`` with more than 0 bytes."""

    def __init__(self, kind: str, nth: int = 0) -> None:
        self.kind, self.nth, self.seen = kind, nth, 0

    def __call__(self, kind: str, nbytes: int) -> bool:
        if kind != self.kind or nbytes <= 0:
            return False
        self.seen += 1
        return self.seen - 1 == self.nth


OOMS = {  # scenario -> (allocation kind, which one fails, NCCL data plane, what the message names)
    "pinned arenas": ("pinned", 0, False, "pinned host memory for 2 staging arenas"),
    "exchange arenas": ("empty", 0, True, "GPU memory for 2 exchange arenas"),
    "scratch in a round": ("empty", 3, False, "GPU scratch"),
}


def _oom_scenario(root: str, kind: str, nth: int, data_on_device: bool) -> Callable[[int, int], Any]:
    def run(rank: int, world: int) -> Any:
        import torch.distributed as dist

        case = Case(seed=53, world=world, data_on_device=data_on_device, **CASE)
        fail = _FailNth(kind, nth) if rank == 1 else None
        return run_rank(case, rank, GroupComm(dist.group.WORLD), root, fail_alloc=fail)  # must raise
    return run


def oom_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every scenario in one spawn: after an agreed failure the group is in step for the next."""
    return run_scenarios(rank, world, [(name, _oom_scenario(root, kind, nth, dev))
                                       for name, (kind, nth, dev, _) in OOMS.items()])


@pytest.mark.timeout(200)
def test_an_oom_on_one_rank_raises_on_every_rank() -> None:
    """Staging arenas (host data plane), the NCCL plane's exchange arenas (both before the first
    collective), GPU scratch in a later round: every rank raises StagingMemoryError naming rank 1,
    the memory and the bytes asked for."""
    with tempfile.TemporaryDirectory(prefix="sc-oom-") as d:
        write_checkpoint(Case(seed=53, world=3, data_on_device=False, **CASE), d)
        per_rank = [r.unwrap() for r in run_ranks(3, oom_worker, kwargs={"root": d}, timeout=150, pg_timeout=45)]
    for name, (kind, _, _, what) in OOMS.items():
        outcomes = [per_rank[r][name] for r in range(3)]
        assert all("error" in o for o in outcomes), (name, outcomes)
        errors = [o["error"] for o in outcomes]
        assert [e["cls"] for e in errors] == ["StagingMemoryError"] * 3, (name, [e["msg"] for e in errors])
        own = errors[1]["msg"]
        m = re.match(rf"rank 1 could not allocate (\d+) bytes of {what}", own)
        assert m is not None, (name, own)
        nbytes = int(m.group(1))
        assert nbytes > 0
        assert f"Tried to allocate {nbytes} bytes ({kind}, fake)" in own  # the bytes the allocator was asked for
        assert "lower memory_budget" in own
        for peer in (0, 2):
            assert errors[peer]["msg"] == f"rank 1 failed: {own}", (name, errors[peer]["msg"])


# ----------------------------------------------------------------------------- mixed cpu:gloo,cuda:nccl


def _mixed(fake: FakeCuda) -> GroupComm:
    comm = GroupComm(None, cuda=fake)
    comm.backends = _device.parse_backends("cpu:gloo,cuda:nccl")  # see the module doc
    return comm


def mixed_worker(rank: int, world: int, root: str, cuda_ranks: list[int]) -> dict[str, Any]:
    """Which data device each rank's comm picks when ``cuda_ranks`` load into CUDA tensors, then
    a load into CPU tensors on the mixed group: every exchange rides gloo with host tensors."""
    fake = FakeCuda(current_device=0)
    comm = _mixed(fake)
    planes = []
    for flag in (rank in cuda_ranks, False):
        comm.choose_data_plane(flag)
        planes.append(str(comm.data_device))
    full = sc.load_full(root)
    rows = {k: v.shape[0] // world for k, v in full.items()}
    sd = {k: sc.ShardedTensor(torch.zeros_like(v[: rows[k]]), tuple(v.shape), (rank * rows[k], *[0] * (v.dim() - 1)))
          for k, v in full.items()}
    storage = Storage(root)
    try:
        req = LoadRequest(state_dict=sd, strict=True, options=PlanOptions(memory_budget=64 << 10, read_once=True),
                          transforms=None, cuda=fake)
        res = run_load(comm, storage, req)
    finally:
        storage.close()
    wrong = [k for k, v in full.items()
             if not torch.equal(sd[k].local_tensor, v[rank * rows[k]: (rank + 1) * rows[k]])]
    return {"planes": planes, "wrong": wrong, "received": res.bytes_received, "data": str(comm.data_device),
            "fake_calls": dict(fake.counts), "devices": sorted(map(str, fake.devices_used))}


@pytest.mark.timeout(120)
def test_cpu_targets_on_a_mixed_group_ride_gloo(tmp_path: Path) -> None:
    """The data plane is agreed: NCCL (this rank's GPU) as soon as one rank has CUDA targets, on
    every rank, host tensors when none has; a CPU-only load then moves its bytes over gloo."""
    g = torch.Generator().manual_seed(3)
    sc.save({"w": torch.randn(48, 40, generator=g), "e": torch.randn(96, 8, generator=g)}, str(tmp_path))
    ranks = run_ranks(3, mixed_worker, kwargs={"root": str(tmp_path), "cuda_ranks": [2]}, timeout=90, pg_timeout=30)
    reps = [r.unwrap() for r in ranks]
    assert [rep["planes"] for rep in reps] == [["cuda:0", "cpu"]] * 3
    for rep in reps:
        assert rep["wrong"] == []
        assert rep["data"] == "cpu"
        assert rep["fake_calls"] == {} and rep["devices"] == []  # no pinned, device buffer or copy at all
    assert sum(rep["received"] for rep in reps) > 0  # read once: bytes did cross ranks, over gloo
