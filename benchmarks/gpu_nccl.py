"""NCCL relays and message parts on lent GPUs (issue 42, item 2); ``benchmarks.gpu``'s nccl part.

The defaults never use them: relays start above ``max_peers + 1`` holders (9) and messages
split at ``direct_message_bytes`` (256 KiB), and ``sc.load`` takes no ``PlanOptions``. So every
rank here loads the whole of a small checkpoint (every piece has ``world`` holders) through the
real planner and ``Executor`` with ``max_peers=1`` (relays from 4 holders: 4 GPUs),
``direct_message_bytes=64`` (messages in parts from 2) and a 1 MiB budget, on the NCCL data
plane, checks every element and counts the relayed and split messages of its schedule, and the
device-to-host downloads its relay hops took (issue 42, item 5: none on the device plane).

``exchange_worker`` is one rank (its process group already up); ``tests/test_gpu_nccl.py`` runs
it on gloo with the CUDA stand-in (``fake=True``), and on NCCL where 2+ GPUs are lent;
``run_exchange`` spawns it on ``world`` GPUs for the GPU check.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MAX_PEERS, DIRECT_BYTES, BUDGET = 1, 64, 1 << 20


def model() -> dict[str, torch.Tensor]:
    """~1.3 MiB in four tensors of three dtypes, distinct values everywhere."""
    g = torch.Generator().manual_seed(42)
    return {"w": torch.randn(512, 512, generator=g), "b": torch.randn(4099, generator=g).to(torch.bfloat16),
            "e": torch.randn(96, 1024, generator=g), "i": torch.arange(3001, dtype=torch.int64) * 7}


def holds(key: str, rank: int, world: int) -> bool:
    """"w" and "b" on every rank (relayed from 4); "e" and "i" on the first and last rank only:
    sent straight, two tensors of one read, so their messages go in parts."""
    return key in ("w", "b") or rank in (0, world - 1)


class _Counting:
    """A ``CudaApi`` that counts ``download`` calls (device bytes to the host) of the one it wraps."""

    def __init__(self, api: Any) -> None:
        self._api, self.downloads = api, 0

    def download(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        self.downloads += 1
        return self._api.download(src, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)


def exchange_worker(rank: int, world: int, uri: str, fake: bool = False) -> dict[str, Any]:
    """One rank: the whole checkpoint at ``uri`` into this rank's GPU over the default group."""
    import torch.distributed as dist

    from streamckpt.comm import GroupComm
    from streamckpt.core.dtypes import to_code
    from streamckpt.core.targets import TargetSpec
    from streamckpt.cuda.device import place
    from streamckpt.cuda.runtime import TorchCuda
    from streamckpt.formats import read_manifest
    from streamckpt.loading.pipeline import Destinations, Executor
    from streamckpt.plan.planner import IdentityView, PlanOptions, build_plan, settle_rounds
    from streamckpt.storage import Storage

    want = model()
    if fake:
        import fakecuda  # tests/ on the path: the CUDA stand-in

        inner: Any = fakecuda.FakeCuda(current_device=rank, device_count=world)
        dev = torch.device("cuda", rank)
        inner.expect_device(dev)
    else:
        inner, dev = TorchCuda(), torch.device("cuda", torch.cuda.current_device())
    api = _Counting(inner)
    storage = Storage(uri)
    try:
        manifest = read_manifest(storage)
        specs = [[TargetSpec(k, to_code(v.dtype), tuple(v.shape), (0,) * v.dim(), tuple(v.shape), None)
                  for k, v in want.items() if holds(k, r, world)] for r in range(world)]
        opts = PlanOptions(memory_budget=BUDGET, max_peers=MAX_PEERS, direct_message_bytes=DIRECT_BYTES)
        plan = build_plan(manifest, specs, opts, IdentityView(manifest), rank=rank)
        comm = GroupComm(dist.group.WORLD, cuda=api)
        settle_rounds(plan, comm.max_ints)
        tensors: dict[int, torch.Tensor] = {}
        keys: dict[int, str] = {}
        for uid, spec in zip(plan.rank_targets[rank], specs[rank]):
            t = torch.full_like(want[spec.key], -1)
            tensors[uid], keys[uid] = (inner.place(t, dev) if fake else t.to(dev)), spec.key
        placement = place(api, list(tensors.values()), dev)
        t0 = time.perf_counter()
        ex = Executor(plan, comm, storage, Destinations(tensors), placement=placement)
        stats = ex.run()
        if fake:
            inner.synchronize()
        else:
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
    finally:
        storage.close()
    wrong = sorted(keys[u] for u, t in tensors.items() if not torch.equal(t.cpu(), want[keys[u]]))
    wrong += sorted(k for k in want if holds(k, rank, world) and k not in keys.values())
    return {"rank": rank, "wrong": wrong, "seconds": seconds, "rounds": stats.rounds,
            "data_on_device": placement.data_on_device, "bytes_received": stats.bytes_received,
            "relayed": sum(1 for r in ex.schedule for m in r.sends if m.relayed),
            "kept": sum(1 for r in ex.schedule for m in r.recvs if m.keep),
            "split": sum(1 for r in ex.schedule for m in [*r.sends, *r.recvs] if m.part),
            "downloads": api.downloads, "violations": list(inner.violations) if fake else []}


def verdict(reports: list[dict[str, Any]], world: int) -> tuple[bool, str]:
    """PASS when every element is right, messages went in parts and (from 4 ranks) were relayed,
    and no relay hop went through the host; the figure says what happened."""
    wrong = {r["rank"]: r["wrong"] for r in reports if r["wrong"]}
    relayed, split = sum(r["relayed"] for r in reports), sum(r["split"] for r in reports)
    kept, downloads = sum(r["kept"] for r in reports), sum(r["downloads"] for r in reports)
    violations = [v for r in reports for v in r["violations"]]
    relays_due = world > max(2, MAX_PEERS) + 1
    ok = (not wrong and split > 0 and (relayed > 0 or not relays_due) and all(r["data_on_device"] for r in reports)
          and downloads == 0 and not violations)
    slowest = max(r["seconds"] for r in reports)
    return ok, (f"{world} ranks, max_peers={MAX_PEERS}, direct_message_bytes={DIRECT_BYTES}, 1 MiB budget: "
                f"{split} message parts, {relayed} relayed sends ({kept} pieces kept for a next hop"
                f"{'' if relays_due else '; relays need 4 GPUs'}), {downloads} device-to-host downloads, "
                f"{max(r['rounds'] for r in reports)} rounds in {slowest:.2f} s, wrong: {wrong or 0}"
                f"{', violations: ' + violations[0] if violations else ''}")


def _spawned(rank: int, world: int, init: str, uri: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        rep = exchange_worker(rank, world, uri)
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(rep))


def run_exchange(world: int, root: Path) -> list[dict[str, Any]]:
    """``exchange_worker`` on GPUs 0..world-1 over NCCL, one process each."""
    import torch.multiprocessing as mp

    import streamckpt as sc

    uri = str(root / "nccl-exchange")
    sc.save(model(), uri, overwrite=True)
    with tempfile.TemporaryDirectory(prefix="sc-nccl-") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_spawned, args=(world, init, uri, tmp), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
