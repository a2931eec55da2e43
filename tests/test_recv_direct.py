"""Messages received straight into their targets (loading/landing.receive_targets): a
replicated load on real gloo ranks fills every element, whether a message can land in its
target (same dtype, contiguous) or must be staged (a cast, a column slice, tied targets)."""

from __future__ import annotations

from typing import Any

import torch

import streamckpt as sc

from distributed import run_ranks


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "plain": torch.randn(96, 64, generator=g),
        "half": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "cols": torch.randn(32, 48, generator=g),
        "tied_a": torch.arange(640, dtype=torch.float32).view(40, 16),
        "tied_b": torch.arange(640, dtype=torch.float32).view(40, 16),
    }


def _worker(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    full = _full()
    tied = torch.zeros(40, 16)
    cols = torch.zeros(32, 48 // world_size)
    target = {
        "plain": torch.zeros(96, 64),  # lands in the target
        "half": torch.zeros(48, 32),  # stored bf16, loaded as fp32: a cast, staged
        "cols": sc.ShardedTensor(cols, (32, 48), (0, rank * cols.shape[1])),  # strided: staged
        "tied_a": tied,  # one tensor under two keys: its memory is shared, so staged
        "tied_b": tied,
    }
    res = sc.load(target, uri, storage_options=opts, transforms=[{"cast": {"key": "half", "dtype": "float32"}}])
    assert torch.equal(target["plain"], full["plain"])
    assert torch.equal(target["half"], full["half"].float())
    assert torch.equal(cols, full["cols"][:, rank * cols.shape[1]:(rank + 1) * cols.shape[1]])
    assert torch.equal(tied, full["tied_a"])
    return {"received": res.bytes_received, "read": res.bytes_read}


def test_replicated_load_fills_targets_received_direct_or_staged(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save(_full(), s3_uri, storage_options=s3_opts)
    out = [r.unwrap() for r in run_ranks(2, _worker, kwargs={"uri": s3_uri, "opts": s3_opts})]
    assert all(o["received"] > 0 for o in out)  # the ranks really exchanged
    full = _full()
    assert sum(o["read"] for o in out) < 2 * sum(t.numel() * t.element_size() for t in full.values())


def test_which_messages_land_in_their_targets(tmp_path: Any) -> None:
    """Rank 0's receives in a 2-rank replicated plan: a message that is one whole piece of a
    host target lands in it; targets whose memory is shared (one tensor under two keys) are
    staged."""
    from streamckpt.core.targets import collect
    from streamckpt.formats import read_manifest
    from streamckpt.loading.landing import receive_targets
    from streamckpt.loading.schedule import local_schedule
    from streamckpt.loading.scatter import Destinations
    from streamckpt.plan.planner import IdentityView, PlanOptions, build_plan, settle_rounds
    from streamckpt.storage import Storage

    uri = str(tmp_path / "ckpt")
    sc.save({f"p{i}": torch.full((64, 64), float(i)) for i in range(4)}, uri)
    manifest = read_manifest(Storage(uri))
    shared = torch.zeros(64, 64)
    mine, _ = collect({"p0": shared, "p1": shared, "p2": torch.zeros(64, 64), "p3": torch.zeros(64, 64)})
    other, _ = collect({f"p{i}": torch.zeros(64, 64) for i in range(4)})
    plan = build_plan(manifest, [[t.spec for t in mine], [t.spec for t in other]],
                      PlanOptions(max_request_bytes=8192), IdentityView(manifest), rank=0)
    settle_rounds(plan, list)  # one plan: its own round count
    dest = Destinations({uid: t.tensor for uid, t in zip(plan.rank_targets[0], mine) if uid >= 0})
    schedule = local_schedule(plan, 0)
    recvs = [m for rnd in schedule for m in rnd.recvs]
    direct = receive_targets(schedule, dest, set())
    key_of = {uid: t.spec.key for uid, t in zip(plan.rank_targets[0], mine) if uid >= 0}
    by_key: dict[str, list[bool]] = {}
    for m in recvs:
        assert len(m.copies) == 1
        by_key.setdefault(key_of[m.copies[0].target], []).append((m.read_index, m.peer) in direct)
    assert set(by_key) == {"p0", "p1", "p2", "p3"}  # rank 1 read half of each
    assert all(by_key["p2"] + by_key["p3"]) and not any(by_key["p0"] + by_key["p1"])
    for m in recvs:
        buf = direct.get((m.read_index, m.peer))
        if buf is not None:
            view = dest.target_view(m.copies[0])
            assert buf.dtype == torch.uint8 and buf.numel() == m.copies[0].length
            assert buf.data_ptr() == view.data_ptr()
    assert dest.tensors and receive_targets(schedule, dest, set(dest.tensors)) == {}  # GPU targets: never
