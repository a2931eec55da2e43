"""``streamckpt load-bench``: time loads of a checkpoint into a synthetic layout on N local ranks.

The targets come from the checkpoint's metadata alone: every tensor whole
(``full``, each rank a replica), row blocks (``rows``, dim 0 split over ranks),
column blocks (``cols``, the last dim split; 0-d and 1-d tensors whole) or
ZeRO-style flat ranges of each flattened tensor (``zero``). Each repetition
allocates fresh targets, then times ``load`` between two barriers; the report
gives per-rank bytes and requests, and GB/s of the bytes all ranks needed.
Values are not checked here (``streamckpt verify`` checks every checksum).
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .core import dtypes
from .errors import CheckpointError
from .results import plural

LAYOUTS = ("full", "rows", "cols", "zero")


def block(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s part of ``n`` items cut in ``world`` near-equal blocks."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def layout_state(tensors: Mapping[str, tuple[tuple[int, ...], str]], layout: str, world: int,
                 rank: int) -> dict[str, Any]:
    """This rank's (uninitialized) targets for every tensor, in ``layout``."""
    from .core.sharded import ShardedTensor

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    sd: dict[str, Any] = {}
    for name, (shape, code) in tensors.items():
        dt = dtypes.to_torch(code, where=name)
        ndim = len(shape)
        if layout == "full" or ndim == 0 or (layout == "cols" and ndim < 2):
            sd[name] = torch.empty(shape, dtype=dt)
        elif layout == "zero":
            a, b = block(math.prod(shape), world, rank)
            sd[name] = ShardedTensor(torch.empty(b - a, dtype=dt), shape, (0,) * ndim, local_shape=shape,
                                     flat_range=(a, b))
        else:
            dim = 0 if layout == "rows" else ndim - 1
            lo, hi = block(shape[dim], world, rank)
            local = list(shape)
            local[dim] = hi - lo
            offset = [0] * ndim
            offset[dim] = lo
            sd[name] = ShardedTensor(torch.empty(local, dtype=dt), shape, offset)
    return sd


@dataclass(slots=True)
class BenchRun:
    """One rank's figures for one repetition."""

    rank: int
    repetition: int
    seconds: float
    bytes_needed: int
    bytes_read: int
    bytes_sent: int
    bytes_received: int
    requests: int
    rounds: int
    staging_bytes: int
    peak_rss: int


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_rank(rank: int, world: int, uri: str, opts: dict[str, Any] | None, tensors: Mapping[str, Any],
               layout: str, memory_budget: int, read_once: bool, repeat: int) -> list[BenchRun]:
    """Run ``repeat`` timed loads on this rank (inside a process group when ``world`` > 1)."""
    from . import api

    dist = None
    if world > 1:
        import torch.distributed as dist
    out = []
    for rep in range(repeat):
        sd = layout_state(tensors, layout, world, rank)
        if dist is not None:
            dist.barrier()
        t0 = time.perf_counter()
        res = api.load(sd, uri, storage_options=opts, strict=False, memory_budget=memory_budget,
                       read_once=read_once)
        if dist is not None:
            dist.barrier()
        out.append(BenchRun(rank, rep, time.perf_counter() - t0, res.bytes_needed, res.bytes_read, res.bytes_sent,
                            res.bytes_received, res.requests, res.rounds, res.staging_bytes, _peak_rss()))
        del sd
    return out


def run(uri: str, opts: dict[str, Any] | None, processes: int, layout: str, memory_budget: int,
        read_once: bool = True, repeat: int = 1, timeout: float = 600) -> list[list[BenchRun]]:
    """Every repetition's runs (one per rank). Raises ``CheckpointError`` if a rank failed."""
    from .api import inspect

    info = inspect(uri, storage_options=opts)
    tensors = {k: (tuple(t.shape), str(t.dtype)) for k, t in info.tensors.items()}
    args = (uri, opts, tensors, layout, memory_budget, read_once, repeat)
    if processes == 1:
        per_rank = [bench_rank(0, 1, *args)]
    else:
        from .spawn import run_ranks

        outcomes = run_ranks(bench_rank, processes, args, timeout)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            first = failed[0].error.strip().splitlines()[0] if failed[0].error.strip() else "failed"
            raise CheckpointError(f"load-bench: rank {failed[0].rank} failed: {first}")
        per_rank = [o.value for o in outcomes]
    return [[runs[rep] for runs in per_rank] for rep in range(repeat)]


def format_runs(reps: list[list[BenchRun]]) -> str:
    """One line per rank and repetition, then the median over repetitions."""
    head = (f"{'rep':>3} {'rank':>4} {'needed':>10} {'read':>10} {'sent':>10} {'reqs':>5} {'rounds':>6} "
            f"{'staging':>9} {'peak RSS':>9} {'sec':>6}")
    lines = [head, "-" * len(head)]
    walls = []
    for runs in reps:
        for r in runs:
            lines.append(f"{r.repetition:>3} {r.rank:>4} {_mib(r.bytes_needed)} {_mib(r.bytes_read)} "
                         f"{_mib(r.bytes_sent)} {r.requests:>5} {r.rounds:>6} {_mib(r.staging_bytes, 7)} "
                         f"{_mib(r.peak_rss, 7)} {r.seconds:>6.2f}")
        walls.append(max(r.seconds for r in runs))
    needed = sum(r.bytes_needed for r in reps[0])
    read = sum(r.bytes_read for r in reps[0])
    wall = sorted(walls)[len(walls) // 2]
    lines.append(
        f"median wall {wall:.2f} s over {plural(len(walls), 'repetition')}: "
        f"{needed / wall / 1e9:.3f} GB/s of bytes needed; "
        f"all ranks read {read / 2**20:.2f} MiB for {needed / 2**20:.2f} MiB needed "
        f"({read / needed if needed else 0:.3f}×)"
    )
    return "\n".join(lines)


def _mib(n: int, width: int = 8) -> str:
    return f"{n / 2**20:>{width}.2f}Mi"
