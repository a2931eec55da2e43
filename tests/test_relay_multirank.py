"""A replicated load relayed along trees: six real ranks over gloo, moto S3 over HTTP (issue #37, item 4).

Every rank needs the whole model. With ``max_peers=2`` a piece is not sent by its reader to
the five others in one round: the reader sends it to two ranks, and each of them passes it
on in the next round (``plan.routes.relay_hops``), so the executor sends bytes it received the
round before from its relay buffer. The pieces are split over the ranks' reads
(``min_split_bytes``), each stored byte is fetched once, and every rank ends with every
element of every tensor.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from conftest import BUCKET
from distributed import result_dict, run_ranks

WORLD = 6
SHAPES = {"a": ((512, 512), "float32"), "b": ((256, 1024), "float32"), "c": ((300, 17), "bfloat16"),
          "d": ((1000,), "int64"), "e": ((64, 1024), "float32")}  # 1 MiB, 1 MiB, ~10 KiB, 8 KiB, 256 KiB


def _model() -> dict[str, Any]:
    import torch

    out = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        n = 1
        for s in shape:
            n *= s
        out[name] = (torch.arange(n, dtype=torch.float64) * 0.5 + 1000 * i).to(getattr(torch, dtype)).reshape(shape)
    return out


def relayed_worker(rank: int, world: int, root: str, opts: dict[str, Any], max_peers: int, per_node: int,
                   ) -> dict[str, Any]:
    import os

    import torch

    import streamckpt as sc
    from streamckpt.comm import make_comm
    from streamckpt.loading.loader import LoadRequest, run_load
    from streamckpt.plan.planner import PlanOptions
    from streamckpt.storage import Storage

    model = _model()
    sc.save(model, root, storage_options=opts)  # replicated: stored once
    target = {k: torch.full_like(v, 7) for k, v in model.items()}
    if per_node:  # as torchrun numbers ranks: node by node
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node))
    storage = Storage(root, opts, max_concurrency=2)
    try:
        options = PlanOptions(memory_budget=4 << 20, max_peers=max_peers, min_split_bytes=256 << 10)
        res = run_load(make_comm(None), storage, LoadRequest(target, True, options, None))
    finally:
        storage.close()
    for k, v in model.items():
        assert torch.equal(target[k], v), f"rank {rank}: {k} differs"
    from streamckpt.loading.loader import with_nodes

    return {**result_dict(res), "per_node": with_nodes(make_comm(None), options).ranks_per_node}


@pytest.mark.parametrize("max_peers,per_node", [(2, 0), (3, 2)])
def test_replicated_load_relayed(local_s3: Any, max_peers: int, per_node: int) -> None:
    """(2, 0): no node known, a grid of 3 x 2 ranks; (3, 2): three nodes of two ranks (torchrun's
    variables), each piece crosses into a node once and then to the node's other rank."""
    root = f"s3://{BUCKET}/relay-{uuid.uuid4().hex[:10]}"
    ranks = run_ranks(WORLD, relayed_worker, kwargs={"root": root, "opts": local_s3.storage_options,
                                                     "max_peers": max_peers, "per_node": per_node},
                      timeout=240, pg_timeout=60)
    results = [r.unwrap() for r in ranks]
    assert {r["per_node"] for r in results} == {per_node}
    total = sum(v.numel() * v.element_size() for v in _model().values())
    assert all(r["bytes_needed"] == total for r in results)
    assert sum(r["bytes_read"] for r in results) == total  # every stored byte fetched once, by one rank
    assert sum(r["bytes_read"] > 0 for r in results) >= 4  # the 2.3 MiB are split over the ranks' reads
    for r in results:
        assert r["bytes_received"] >= total - r["bytes_read"]
    assert sum(r["bytes_sent"] for r in results) == sum(r["bytes_received"] for r in results)
    # a reader sends its pieces to at most max_peers ranks in their first round; whoever sends
    # more than that passed on what it had received (or sends a piece again a round later)
    assert any(r["bytes_sent"] > max_peers * r["bytes_read"] + 4096 for r in results)
    assert all(r["rounds"] > 1 for r in results)
