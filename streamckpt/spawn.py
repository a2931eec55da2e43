"""Run a function on N local ranks: fresh spawned processes joined in a gloo group.

Used by ``streamckpt demo`` and ``streamckpt load-bench``. Each rank's return value (or
its error, as text) comes back to the parent, in rank order; a rank that neither
returns nor fails within ``timeout`` is killed and reported as such.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable


@dataclass(slots=True)
class RankOutcome:
    rank: int
    value: Any = None
    error: str = ""  # "" when the function returned

    @property
    def ok(self) -> bool:
        return not self.error


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], q: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        value = fn(rank, world, *args)
        dist.destroy_process_group()
        q.put(RankOutcome(rank, value))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(RankOutcome(rank, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world: int, args: tuple[Any, ...] = (), timeout: float = 300) -> list[RankOutcome]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks (``fn`` must be importable)."""
    from .testing.s3server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q), daemon=True) for r in range(world)]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # N ranks on shared cores: no thread oversubscription
    outcomes: dict[int, RankOutcome] = {}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            try:
                o = q.get(timeout=timeout)
            except queue.Empty:
                break
            outcomes[o.rank] = o
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return [outcomes.get(r, RankOutcome(r, error=f"rank {r} did not report within {timeout:.0f} s"))
            for r in range(world)]
