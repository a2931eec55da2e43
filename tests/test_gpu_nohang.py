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
from typing import Any

import pytest
import torch

from distributed import run_ranks
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


def oom_worker(rank: int, world: int, root: str, fail_rank: int, kind: str, nth: int,
               data_on_device: bool) -> dict[str, Any]:
    import torch.distributed as dist

    case = Case(seed=53, world=world, data_on_device=data_on_device, **CASE)
    fail = _FailNth(kind, nth) if rank == fail_rank else None
    rep = run_rank(case, rank, GroupComm(dist.group.WORLD), root, fail_alloc=fail)
    return {"finished": rep}  # not reached when the load raises, as it must


def _oom_run(kind: str, nth: int, data_on_device: bool) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="sc-oom-") as d:
        write_checkpoint(Case(seed=53, world=3, data_on_device=data_on_device, **CASE), d)
        return run_ranks(3, oom_worker, kwargs={"root": d, "fail_rank": 1, "kind": kind, "nth": nth,
                                                "data_on_device": data_on_device},
                         timeout=100, pg_timeout=45)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind,nth,data_on_device,what", [
    ("pinned", 0, False, "pinned host memory for 2 staging arenas"),
    ("empty", 0, True, "GPU memory for 2 exchange arenas"),
    ("empty", 3, False, "GPU scratch"),
])
def test_an_oom_on_one_rank_raises_on_every_rank(kind: str, nth: int, data_on_device: bool, what: str) -> None:
    """Staging arenas (host data plane), the NCCL plane's exchange arenas (both before the first
    collective), GPU scratch in a later round: every rank raises StagingMemoryError naming rank 1."""
    results = _oom_run(kind, nth, data_on_device)
    errors = [r.error for r in results]
    assert all(e is not None for e in errors), [r.value for r in results]
    assert [e.cls for e in errors] == ["StagingMemoryError"] * 3, [str(e) for e in errors]
    own = errors[1].msg
    m = re.match(rf"rank 1 could not allocate (\d+) bytes of {what}", own)
    assert m is not None, own
    nbytes = int(m.group(1))
    assert nbytes > 0
    assert f"Tried to allocate {nbytes} bytes ({kind}, fake)" in own  # the bytes the allocator was asked for
    assert "lower memory_budget" in own
    for peer in (0, 2):
        assert errors[peer].msg == f"rank 1 failed: {own}", errors[peer].msg


# ----------------------------------------------------------------------------- mixed cpu:gloo,cuda:nccl


def _mixed(fake: FakeCuda) -> GroupComm:
    comm = GroupComm(None, cuda=fake)
    comm.backends = _device.parse_backends("cpu:gloo,cuda:nccl")  # see the module doc
    return comm


def plane_worker(rank: int, world: int, cuda_ranks: list[int]) -> list[str]:
    """Which data device each rank's comm picks when ``cuda_ranks`` load into CUDA tensors."""
    fake = FakeCuda(current_device=0)
    comm = _mixed(fake)
    out = []
    for flag in (rank in cuda_ranks, False):
        comm.choose_data_plane(flag)
        out.append(str(comm.data_device))
    return out


@pytest.mark.timeout(120)
def test_mixed_group_data_plane_is_agreed() -> None:
    """NCCL (this rank's GPU) for the data as soon as one rank has CUDA targets, on every rank;
    host tensors for a load in which none has."""
    ranks = run_ranks(3, plane_worker, kwargs={"cuda_ranks": [2]}, timeout=60, pg_timeout=30)
    assert [r.unwrap() for r in ranks] == [["cuda:0", "cpu"]] * 3


def mixed_load_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """A load into CPU tensors on the mixed group: every exchange rides gloo with host tensors."""
    fake = FakeCuda(current_device=0)
    comm = _mixed(fake)
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
    wrong = [k for k, v in full.items() if not torch.equal(sd[k].local_tensor, v[rank * rows[k]: (rank + 1) * rows[k]])]
    return {"wrong": wrong, "received": res.bytes_received, "data": str(comm.data_device),
            "fake_calls": dict(fake.counts), "devices": sorted(map(str, fake.devices_used))}


@pytest.mark.timeout(120)
def test_cpu_targets_on_a_mixed_group_ride_gloo(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    sc.save({"w": torch.randn(48, 40, generator=g), "e": torch.randn(96, 8, generator=g)}, str(tmp_path))
    ranks = run_ranks(3, mixed_load_worker, kwargs={"root": str(tmp_path)}, timeout=90, pg_timeout=30)
    reps = [r.unwrap() for r in ranks]
    for rep in reps:
        assert rep["wrong"] == []
        assert rep["data"] == "cpu"
        assert rep["fake_calls"] == {} and rep["devices"] == []  # no pinned, device buffer or copy at all
    assert sum(rep["received"] for rep in reps) > 0  # read once: bytes did cross ranks, over gloo
