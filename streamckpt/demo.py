"""The multi-rank part of ``streamckpt demo``: real gloo processes reshard a checkpoint.

4 ranks save a model-like state (row-parallel weights, a replicated norm, a ZeRO-flat
optimizer state) to ``s3://…``; then 2 ranks load it column-wise and 3 ranks load it
as uneven row blocks + other flat ranges. Every rank checks every element and reports
its LoadResult; the parent prints one row per rank.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

SHAPES = {"layers.0.w": (1536, 1024), "layers.1.w": (1536, 1024), "embed": (2048, 512)}


def _original(key: str) -> torch.Tensor:
    shape = SHAPES[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g)


def _norm() -> torch.Tensor:
    return torch.linspace(0.5, 1.5, 1024)


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven row blocks: the first ``n % world`` ranks get one more row."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _state(world: int, rank: int, layout: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's state_dict (to fill or to save) and the expected local tensors."""
    import streamckpt as sc

    sd: dict[str, Any] = {"model": {}, "optim": {}}
    expected: dict[str, torch.Tensor] = {}
    for key, shape in SHAPES.items():
        full = _original(key)
        if layout == "cols":
            lo, hi = _rows(shape[1], world, rank)
            local = full[:, lo:hi].contiguous()
            offset = (0, lo)
        else:
            lo, hi = _rows(shape[0], world, rank)
            local = full[lo:hi].contiguous()
            offset = (lo, 0)
        target = local.clone() if layout == "save" else torch.zeros_like(local)
        sd["model"][key] = sc.ShardedTensor(target, shape, offset)
        expected[f"model.{key}"] = local
        # ZeRO-1 style: the optimizer moment of the whole tensor, flat-partitioned over ranks
        numel = math.prod(shape)
        a, b = _rows(numel, world, rank)
        moment = (full * 0.01).reshape(-1)[a:b].contiguous()
        mt = moment.clone() if layout == "save" else torch.zeros_like(moment)
        sd["optim"][f"{key}.exp_avg"] = sc.ShardedTensor(mt, shape, (0, 0), local_shape=shape, flat_range=(a, b))
        expected[f"optim.{key}.exp_avg"] = moment
    norm = _norm() if layout == "save" else torch.zeros(1024)
    sd["model"]["norm"] = norm  # replicated on every rank: written once, read once and shared
    expected["model.norm"] = _norm()
    sd["step"] = 1000 if layout == "save" else 0
    return sd, expected


def _lookup(sd: dict[str, Any], dotted: str) -> torch.Tensor:
    head, _, rest = dotted.partition(".")
    v = sd[head][rest] if head in ("model", "optim") else sd[dotted]
    return v.local_tensor if hasattr(v, "local_tensor") else v


@dataclass
class RankReport:
    phase: str
    rank: int
    world: int
    ok: bool
    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    seconds: float = 0.0
    error: str = ""


def _worker(rank: int, world: int, port: int, phase: str, uri: str, opts: dict[str, Any], q: Any) -> None:
    import torch.distributed as dist

    import streamckpt as sc

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        if phase == "save":
            sd, _ = _state(world, rank, "save")
            res = sc.save(sd, uri, storage_options=opts, metadata={"demo": "multirank"}, overwrite=True)
            q.put(RankReport(phase, rank, world, True, seconds=res.seconds))
        else:
            sd, expected = _state(world, rank, phase)
            r = sc.load(sd, uri, storage_options=opts)
            ok = sd["step"] == 1000 and all(torch.equal(_lookup(sd, k), v) for k, v in expected.items())
            q.put(RankReport(phase, rank, world, ok, r.bytes_needed, r.bytes_read, r.bytes_sent,
                             r.bytes_received, r.requests, r.seconds))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(RankReport(phase, rank, world, False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_phase(phase: str, world: int, uri: str, opts: dict[str, Any], timeout: float = 300) -> list[RankReport]:
    """Run one phase in ``world`` fresh gloo processes; reports sorted by rank."""
    from .testing.s3server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, phase, uri, opts, q), daemon=True)
             for r in range(world)]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
        reports = [q.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    return sorted(reports, key=lambda r: r.rank)


def multirank_demo(uri: str, opts: dict[str, Any]) -> list[RankReport]:
    """Save with 4 ranks (rows), load with 2 (columns) and 3 (uneven rows, other flat ranges)."""
    out = run_phase("save", 4, uri, opts)
    if all(r.ok for r in out):
        out += run_phase("cols", 2, uri, opts)
        out += run_phase("rows", 3, uri, opts)
    return out


def format_reports(reports: list[RankReport]) -> str:
    head = f"{'phase':<6} {'rank':>4} {'needed':>10} {'read':>10} {'sent':>10} {'recv':>10} {'reqs':>5} {'sec':>6} {'MB/s':>7}  ok"
    lines = [head, "-" * len(head)]
    for r in reports:
        mbps = r.bytes_needed / r.seconds / 1e6 if r.seconds and r.bytes_needed else 0.0
        lines.append(
            f"{r.phase + '/' + str(r.world):<6} {r.rank:>4} {r.bytes_needed / 2**20:>8.2f}Mi {r.bytes_read / 2**20:>8.2f}Mi "
            f"{r.bytes_sent / 2**20:>8.2f}Mi {r.bytes_received / 2**20:>8.2f}Mi {r.requests:>5} {r.seconds:>6.2f} "
            f"{mbps:>7.1f}  {'yes' if r.ok else 'NO'}"
        )
        if r.error:
            lines.append("    " + r.error.strip().splitlines()[0])
    loads = [r for r in reports if r.phase != "save"]
    for phase in sorted({r.phase for r in loads}):
        rs = [r for r in loads if r.phase == phase]
        need = sum(r.bytes_needed for r in rs)
        read = sum(r.bytes_read for r in rs)
        lines.append(f"{phase}: all ranks read {read / 2**20:.2f} MiB for {need / 2**20:.2f} MiB needed "
                     f"(read once: the stored checkpoint is {_stored_mib(rs):.2f} MiB)")
    return "\n".join(lines)


def _stored_mib(rs: list[RankReport]) -> float:
    total = sum(math.prod(s) * 4 * 2 for s in SHAPES.values()) + 1024 * 4
    return total / 2**20
