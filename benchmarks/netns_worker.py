"""One rank inside a node namespace: ``python -m benchmarks.netns_worker SPEC.json``.

Started by benchmarks/scale_check.py (and tests/test_netns.py) with ``ip netns exec``,
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=fab`` (the
node's fabric link). The model is ``tensors`` fp32 matrices of random numbers, each from its
own seed, so every rank can rebuild what it should hold. Modes:

- ``save`` (one rank): saves the whole model to ``uri`` (used where the store is moto);
- ``load``: builds its targets (``full``: every tensor whole; ``cols``: its block of columns,
  as an ``sc.ShardedTensor``), then ``reps`` times: barrier, ``sc.load``, barrier, timed
  between the barriers; then checks every element bit for bit against the rebuilt tensors
  (outside the clock) and writes ``<out>.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any


def tensor(seed: int, i: int, rows: int, cols: int):  # -> torch.Tensor
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + i)
    return torch.randn((rows, cols), generator=g, dtype=torch.float32)


def cols_of(cols: int, rank: int, world: int) -> tuple[int, int]:
    step = -(-cols // world)
    return min(cols, rank * step), min(cols, (rank + 1) * step)


def rows_of(rows: int, rank: int, world: int) -> tuple[int, int]:
    return cols_of(rows, rank, world)


def targets(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import torch

    import streamckpt as sc

    out: dict[str, Any] = {}
    for i, (name, rows, cols) in enumerate(spec["tensors"]):
        if spec["layout"] == "full":
            out[name] = torch.empty((rows, cols), dtype=torch.float32)
        else:
            c0, c1 = cols_of(cols, rank, world)
            out[name] = sc.ShardedTensor(torch.empty((rows, c1 - c0), dtype=torch.float32), (rows, cols), (0, c0))
    return out


def check(spec: dict[str, Any], sd: dict[str, Any], rank: int, world: int) -> int:
    """Elements compared bit for bit; raises on the first tensor that differs."""
    import torch

    n = 0
    for i, (name, rows, cols) in enumerate(spec["tensors"]):
        want = tensor(spec["seed"], i, rows, cols)
        got = sd[name]
        if spec["layout"] != "full":
            c0, c1 = cols_of(cols, rank, world)
            want, got = want[:, c0:c1], got.local_tensor
        if not torch.equal(want.contiguous().view(torch.int32), got.contiguous().view(torch.int32)):
            raise SystemExit(f"rank {rank}: {name} differs from what was saved")
        n += want.numel()
    return n


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def save(spec: dict[str, Any]) -> None:
    import streamckpt as sc

    sd = {name: tensor(spec["seed"], i, rows, cols) for i, (name, rows, cols) in enumerate(spec["tensors"])}
    sc.save(sd, spec["uri"], storage_options=spec["storage_options"], overwrite=True)


def load(spec: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import streamckpt as sc

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    sd = targets(spec, rank, world)
    reps = []
    for _ in range(spec.get("reps", 1)):
        dist.barrier()
        marks: list[tuple[float, int]] = []
        t0, c0, e0 = time.perf_counter(), _cpu(), time.time()
        res = sc.load(sd, spec["uri"], storage_options=spec["storage_options"], read_once=spec["read_once"],
                      progress=lambda n: marks.append((time.perf_counter() - t0, n)))
        mine = time.perf_counter() - t0
        dist.barrier()
        reps.append({"seconds": time.perf_counter() - t0, "own_seconds": mine, "cpu_seconds": _cpu() - c0,
                     "start": e0, "end": time.time(), "bytes_read": int(res.bytes_read),
                     "requests": int(res.requests), "bytes_sent": int(getattr(res, "bytes_sent", 0)),
                     "bytes_received": int(getattr(res, "bytes_received", 0)), "rounds": int(res.rounds),
                     "first_progress_s": marks[0][0] if marks else None,
                     "last_progress_s": marks[-1][0] if marks else None})
    checked = check(spec, sd, rank, world)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "reps": reps, "elements_checked": checked}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if spec["mode"] == "save":
        save(spec)
        return
    out = load(spec)
    with open(f"{spec['out']}.{out['rank']}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
