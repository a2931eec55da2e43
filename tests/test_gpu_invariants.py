"""The GPU path's ordering rules, checked on CPU against a recording stand-in for CUDA.

The real planner plans hypothesis-drawn checkpoints and layouts, and the real
``Executor`` runs every rank's schedule (world sizes 1-8: real gloo processes for 2+)
with ``fakecuda.FakeCuda`` as its CUDA — the only thing faked. The fake runs device
work as late as the recorded waits allow, so any missing wait corrupts the targets,
and it records every rule broken (see its module doc). For every rank:

* no arena write (fetch, decode, pack or receive) before that arena's last event was
  waited on (``host-write``), including rounds in which the rank only receives;
* every target write ordered after the caller's stream (its pending init kernels), and
  the caller's stream ordered after every target write at the end;
* every device buffer read on another stream than its allocation stream is recorded
  on that stream;
* every stream, event, buffer and copy on the targets' GPU (never the current device);
* every target holds the checkpoint's values, element by element.

``data_on_device`` cases run the NCCL data plane (device send/recv buffers, NCCL's
stream semantics from the fake) with the bytes carried by the real gloo group.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distributed import run_ranks
from fakecuda import FakeCuda
from gpu_cases import Case, cases, run_rank, write_checkpoint

import streamckpt as sc
from streamckpt.comm import GroupComm, SoloComm
from streamckpt.cuda.device import DeviceToHost
from streamckpt.loading.loader import LoadRequest, run_load
from streamckpt.plan.planner import PlanOptions
from streamckpt.saving.saver import run_save
from streamckpt.storage import Storage

def slow_ok(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_report(case: Case, rank: int, rep: dict[str, Any]) -> None:
    where = f"rank {rank} of {case}"
    assert "error" not in rep, f"{where}: {rep.get('error')}"
    assert rep["violations"] == [], f"{where}:\n" + "\n".join(rep["violations"][:20])
    assert rep["wrong"] == [], f"{where}: targets {rep['wrong']} do not hold the checkpoint's values"
    if rep["on_gpu"] or rep["placement"]["data_on_device"]:
        assert rep["devices"] == [rep["device"]], f"{where}: CUDA objects on {rep['devices']}"
        assert rep["placement"]["device"] == rep["device"]
    else:
        assert rep["devices"] == [], f"{where}: a host-only load touched CUDA"


# ----------------------------------------------------------------------------- one process


@slow_ok(40)
@given(cases(1, 1))
def test_single_rank_schedule_keeps_the_rules(case: Case) -> None:
    with tempfile.TemporaryDirectory(prefix="sc-gpuinv-") as d:
        write_checkpoint(case, d)
        rep = run_rank(case, 0, SoloComm(), d)
    check_report(case, 0, rep)
    assert rep["target_writes"] > 0


# ----------------------------------------------------------------------------- real gloo ranks


def invariants_worker(rank: int, world: int, cases_: list[dict[str, Any]], roots: list[str]) -> list[Any]:
    """Every case on ranks < its world size, through sub-groups of the 8-rank world."""
    import torch.distributed as dist

    groups = {w: dist.new_group(list(range(w))) for w in range(2, world + 1)}
    out: list[Any] = []
    for doc, root in zip(cases_, roots):
        case = Case(**doc)
        rep: Any = None
        if rank < case.world:
            comm = SoloComm() if case.world == 1 else GroupComm(groups[case.world])
            try:
                rep = run_rank(case, rank, comm, root)
            except Exception as e:  # noqa: BLE001 - reported per case
                rep = {"error": f"{type(e).__name__}: {e}"}
        out.append(rep)
        dist.barrier()
    return out


def _run_cases(batch: list[Case], corrupt: bool = False) -> list[list[Any]]:
    with tempfile.TemporaryDirectory(prefix="sc-gpuinv-") as d:
        roots = []
        for i, case in enumerate(batch):
            root = str(Path(d) / f"c{i}")
            write_checkpoint(case, root)
            roots.append(root)
            if corrupt:  # the last byte of every data file: some rank's read fails its checksum
                for f in Path(root, "data").iterdir():
                    raw = bytearray(f.read_bytes())
                    raw[-1] ^= 0xFF
                    f.write_bytes(bytes(raw))
        world = max(c.world for c in batch)
        ranks = run_ranks(world, invariants_worker, kwargs={"cases_": [c.doc() for c in batch], "roots": roots},
                          timeout=240, pg_timeout=60)
        return [r.unwrap() for r in ranks]


@slow_ok(3)
@given(st.lists(cases(2, 8), min_size=4, max_size=4).filter(lambda b: max(c.world for c in b) >= 5))
def test_every_rank_schedule_keeps_the_rules(batch: list[Case]) -> None:
    per_rank = _run_cases(batch)
    for i, case in enumerate(batch):
        for rank in range(case.world):
            check_report(case, rank, per_rank[rank][i])


def test_receive_only_rounds_and_the_nccl_plane_are_covered() -> None:
    """Fixed cases that the rules must hold on: 8 ranks, read once, a tiny budget (many rounds
    in which most ranks only receive), host and device data planes, agreement every 1 and 3 rounds;
    and NCCL-plane cases with send-only rounds (3 and 2 ranks), where only ``release()`` orders
    the side stream after the send copies (the fake's NCCL runs late, so a missing wait there
    or in ``received()`` is a ``host-write``, a ``race`` and poisoned targets)."""
    base = dict(world=8, budget=1024, read_once=True, zstd=False, chunk=64, current_device=0,
                transform=True, cpu_targets=False)
    small = {**base, "transform": False}
    batch = [Case(seed=11, data_on_device=False, agree_every=1, **base),
             Case(seed=12, data_on_device=True, agree_every=3, **base),
             Case(seed=13, data_on_device=True, agree_every=1, **{**base, "zstd": True, "cpu_targets": True}),
             Case(seed=53, data_on_device=True, agree_every=1, **{**small, "world": 3}),
             Case(seed=40, data_on_device=True, agree_every=1, **{**small, "world": 2, "zstd": True})]
    per_rank = _run_cases(batch)
    split = 0  # messages sent in parts (split_message) on the NCCL plane
    for i, case in enumerate(batch):
        reps = [per_rank[r][i] for r in range(case.world)]
        for rank, rep in enumerate(reps):
            check_report(case, rank, rep)
        assert sum(r["received_bytes"] for r in reps) > 0
        split += sum(r["split_sends"] for r in reps) if case.data_on_device else 0
        if case.world == 8:
            assert sum(r["recv_only_rounds"] for r in reps) > 0, "no rank had a receive-only round"
        else:
            assert sum(r["send_only_rounds"] for r in reps) >= 2, "too few send-only rounds"
    assert split > 0, "no message went in parts on the NCCL plane"


def test_relays_keep_the_rules_on_both_data_planes() -> None:
    """Relayed reads (``max_peers`` 2: pieces 4 and 5 ranks hold go over a grid or a tree): a
    rank sends in round k + 1 what it received (a device buffer on the NCCL plane, copied on the
    device into the next round's send buffer) or sent in round k; the rules hold and every target is right."""
    base = dict(budget=4096, read_once=True, zstd=False, chunk=64, current_device=0, transform=False,
                cpu_targets=False, max_peers=2)
    batch = [Case(seed=61, world=4, data_on_device=True, agree_every=1, **base),
             Case(seed=62, world=5, data_on_device=True, agree_every=3, **base),
             Case(seed=63, world=4, data_on_device=False, agree_every=1, **{**base, "zstd": True})]
    per_rank = _run_cases(batch)
    for i, case in enumerate(batch):
        reps = [per_rank[r][i] for r in range(case.world)]
        for rank, rep in enumerate(reps):
            check_report(case, rank, rep)
        assert sum(r["relay_sends"] for r in reps) > 0, f"no relay in {case}"


def test_failures_agreed_every_k_rounds_raise_on_every_rank() -> None:
    """A failed rank keeps exchanging until the next agreement: with agreement every 1 or 3
    rounds, on host and device data planes, every rank raises the same error and none hangs."""
    base = dict(budget=1024, read_once=True, zstd=False, chunk=64, current_device=1, transform=False,
                cpu_targets=False)
    batch = [Case(seed=21, world=4, data_on_device=False, agree_every=3, **base),
             Case(seed=22, world=5, data_on_device=True, agree_every=3, **base),
             Case(seed=23, world=3, data_on_device=False, agree_every=1, **{**base, "zstd": True})]
    per_rank = _run_cases(batch, corrupt=True)
    for i, case in enumerate(batch):
        errors = [per_rank[r][i].get("error", "") for r in range(case.world)]
        assert all(e.startswith("CorruptCheckpointError: ") for e in errors), (case, errors)
        assert all("checksum" in e or "CRC" in e or "zstd" in e for e in errors), errors


# ----------------------------------------------------------------------------- wiring and saves


def test_load_through_run_load_uses_the_targets_gpu(tmp_path: Path) -> None:
    """sc's own loader picks the targets' GPU (not the current device) and keeps the rules."""
    case = Case(seed=5, world=1, budget=4096, read_once=True, zstd=True, chunk=256, data_on_device=False,
                agree_every=1, current_device=0, transform=False, cpu_targets=False)
    write_checkpoint(case, str(tmp_path))
    full = sc.load_full(str(tmp_path))
    fake = FakeCuda(current_device=0)
    dev = torch.device("cuda", 6)
    fake.expect_device(dev)
    sd = {}
    for k, v in full.items():
        sd[k] = fake.place(torch.zeros_like(v), dev)
        fake.launch(dev, lambda t=sd[k]: t.fill_(5), writes=[sd[k]])
    mark = fake.mark(dev)
    storage = Storage(str(tmp_path))
    try:
        req = LoadRequest(state_dict=sd, strict=True, options=PlanOptions(memory_budget=4096), transforms=None, cuda=fake)
        res = run_load(SoloComm(), storage, req)
    finally:
        storage.close()
    fake.synchronize()
    assert fake.violations + fake.check_ordering(dev, mark) + fake.check_record_stream() == []
    assert fake.devices_used == {dev}
    assert res.rounds > 1
    for k, v in full.items():
        assert torch.equal(sd[k], v), k


def test_save_stages_gpu_tensors_after_the_callers_kernels(tmp_path: Path) -> None:
    """A CUDA save sees what the caller's pending kernels write, through the pinned blocks."""
    fake = FakeCuda(current_device=2)
    dev = torch.device("cuda", 4)
    fake.expect_device(dev)
    want = {"w": torch.arange(3000, dtype=torch.float32).reshape(60, 50),
            "h": torch.arange(777, dtype=torch.int16)}
    sd: dict[str, Any] = {}
    for k, v in want.items():
        t = fake.place(torch.zeros_like(v), dev)
        fake.launch(dev, lambda t=t, v=v: t.copy_(v), writes=[t], label=f"caller writes {k}")
        sd[k] = t
    t = fake.place(torch.zeros(50, 60), dev)  # a non-contiguous view of a GPU tensor
    fake.launch(dev, lambda: t.copy_(want["w"].t()), writes=[t])
    sd["wt"] = t.t()
    want["wt"] = want["w"]
    storage = Storage(str(tmp_path))
    try:
        run_save(SoloComm(), storage, sd, compression="zstd", metadata=None, overwrite=False, chunk_size=1024, cuda=fake)
    finally:
        storage.close()
    assert fake.violations + fake.check_record_stream() == []
    assert fake.devices_used == {dev}
    got = sc.load_full(str(tmp_path))
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("nbytes,block,step", [(10_000, 4096, 1024), (4096, 4096, 4096), (5, 4096, 4096), (0, 64, 64)])
def test_device_to_host_blocks(nbytes: int, block: int, step: int) -> None:
    """Every span the host reads holds its bytes, block after block, with two pinned blocks."""
    fake = FakeCuda(current_device=0)
    dev = torch.device("cuda", 1)
    fake.expect_device(dev)
    src = fake.place(torch.zeros(nbytes, dtype=torch.uint8), dev)
    want = (torch.arange(nbytes) % 251).to(torch.uint8)
    fake.launch(dev, lambda: src.copy_(want), writes=[src])
    d2h = DeviceToHost(fake, dev, block_bytes=block)
    got = []
    for span in d2h.spans(src, step):
        got.append(span.clone())  # the host reads the span now, before asking for the next
    d2h.close()
    assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=torch.uint8), want)
    assert [g.numel() for g in got] == [min(step, nbytes - lo) for lo in range(0, nbytes, step)]
    assert fake.counts.get("pinned", 0) <= 2
    assert fake.violations == []
