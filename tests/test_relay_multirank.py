"""A replicated load relayed along trees: six real ranks over gloo, moto S3 over HTTP (issue #37, item 4).

Every rank needs the whole model. With ``max_peers=2`` a piece is not sent by its reader to
the five others in one round: the reader sends it to two ranks, and each of them passes it
on in the next round (``plan.data.relay_hops``), so the executor sends bytes it received the
round before from its relay buffer. The pieces are split over the ranks' reads
(``min_split_bytes``), each stored byte is fetched once, and every rank ends with every
element of every tensor.
"""

from __future__ import annotations

import uuid
from typing import Any

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


def relayed_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    import streamckpt as sc
    from streamckpt.comm import make_comm
    from streamckpt.loading.loader import LoadRequest, run_load
    from streamckpt.plan.planner import PlanOptions
    from streamckpt.storage import Storage

    model = _model()
    sc.save(model, root, storage_options=opts)  # replicated: stored once
    target = {k: torch.full_like(v, 7) for k, v in model.items()}
    storage = Storage(root, opts, max_concurrency=2)
    try:
        options = PlanOptions(memory_budget=4 << 20, max_peers=2, min_split_bytes=256 << 10)
        res = run_load(make_comm(None), storage, LoadRequest(target, True, options, None))
    finally:
        storage.close()
    for k, v in model.items():
        assert torch.equal(target[k], v), f"rank {rank}: {k} differs"
    return result_dict(res)


def test_replicated_load_relayed_with_two_peers(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/relay-{uuid.uuid4().hex[:10]}"
    ranks = run_ranks(WORLD, relayed_worker, kwargs={"root": root, "opts": local_s3.storage_options},
                      timeout=240, pg_timeout=60)
    results = [r.unwrap() for r in ranks]
    total = sum(v.numel() * v.element_size() for v in _model().values())
    assert all(r["bytes_needed"] == total for r in results)
    assert sum(r["bytes_read"] for r in results) == total  # every stored byte fetched once, by one rank
    assert sum(r["bytes_read"] > 0 for r in results) >= 4  # the 2.3 MiB are split over the ranks' reads
    for r in results:
        assert r["bytes_received"] >= total - r["bytes_read"]
    assert sum(r["bytes_sent"] for r in results) == sum(r["bytes_received"] for r in results)
    # a reader sends its pieces to two ranks only; whoever sends more passed on what it received
    assert any(r["bytes_sent"] > 2 * r["bytes_read"] + 4096 for r in results)
    assert all(r["rounds"] > 1 for r in results)
