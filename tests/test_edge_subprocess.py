"""A multi-rank load with edge reads whose ranks are fresh interpreters (issue #37, item 4).

The rest of the suite forks ranks from one server process, so they share one string-hash
seed: a planner that let ``hash()`` pick an edge read's reader or tag would plan alike on
every rank there and deadlock under torchrun, where each rank has its own seed. Here three
ranks started as fresh interpreters with random seeds (``PYTHONHASHSEED=random``) save a
tensor as even ZeRO slices and load it back cut at odd places inside checksum chunks, so
that the ranks at each seam share an edge read.
"""

from __future__ import annotations

import uuid
from typing import Any

from conftest import BUCKET
from distributed import flat_sharded, result_dict, run_ranks

SHAPE = (3 * 1024 + 7, 257)  # float32, about 3.1 MiB: a dozen 256 KiB checksum chunks
CUTS = (0, 100_003, 500_009)  # each rank's load slice starts here (the last ends at numel)


def _slice(cuts: tuple[int, ...], numel: int, rank: int) -> tuple[int, int]:
    ends = cuts[1:] + (numel,)
    return cuts[rank], ends[rank]


def zero_seams_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    import math

    import torch

    import streamckpt as sc

    full = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    numel = full.numel()
    even = tuple(numel * r // world for r in range(world))
    local, _ = flat_sharded(full, *_slice(even, numel, rank))
    sc.save({"w": local}, root, storage_options=opts)
    target, expected = flat_sharded(full, *_slice(CUTS, numel, rank), fill=False)
    res = sc.load({"w": target}, root, storage_options=opts, max_concurrency=2)
    assert torch.equal(target.local_tensor, expected), f"rank {rank}: wrong values"
    return result_dict(res)


def test_edge_reads_with_fresh_interpreters(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/edge-subprocess-{uuid.uuid4().hex[:10]}"
    ranks = run_ranks(3, zero_seams_worker, kwargs={"root": root, "opts": local_s3.storage_options},
                      timeout=240, pg_timeout=60, spawn="subprocess", env={"PYTHONHASHSEED": "random"})
    results = [r.unwrap() for r in ranks]
    assert all(r["requests"] > 0 for r in results)


def test_the_load_above_has_edge_reads() -> None:
    """The plan of that load (its manifest as the save writes it: one flat shard per rank,
    256 KiB checksum chunks) shares a chunk at each of the two seams."""
    import math

    from streamckpt.core.manifest import Manifest, Shard, TensorMeta
    from streamckpt.core.targets import TargetSpec
    from streamckpt.plan.planner import build_plan

    numel, chunk = math.prod(SHAPE), 256 << 10
    even = tuple(numel * r // 3 for r in range(3))
    shards, pos = [], 0
    for r in range(3):
        a, b = _slice(even, numel, r)
        n = (b - a) * 4
        shards.append(Shard((0, 0), SHAPE, f"data/{r}", 0, n, (a, b), "raw", chunk, (0,) * -(-n // chunk)))
    manifest = Manifest(tensors={"w": TensorMeta("F32", SHAPE, tuple(shards))}, files={f"data/{r}": s.byte_length
                                                                                       for r, s in enumerate(shards)})
    targets = [[TargetSpec("w", "F32", SHAPE, (0, 0), SHAPE, _slice(CUTS, numel, r))] for r in range(3)]
    assert len(build_plan(manifest, targets).edge_reads) == 2
