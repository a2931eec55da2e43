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
        by_key.setdefault(key_of[m.copies[0].target], []).append(m.key in direct)
    assert set(by_key) == {"p0", "p1", "p2", "p3"}  # rank 1 read half of each
    assert all(by_key["p2"] + by_key["p3"]) and not any(by_key["p0"] + by_key["p1"])
    for m in recvs:
        buf = direct.get(m.key)
        if buf is not None:
            view = dest.target_view(m.copies[0])
            assert buf.dtype == torch.uint8 and buf.numel() == m.copies[0].length
            assert buf.data_ptr() == view.data_ptr()
    assert dest.tensors and receive_targets(schedule, dest, set(dest.tensors)) == {}  # GPU targets: never


def test_a_read_of_several_tensors_reaches_a_peer_as_one_message_per_large_piece(tmp_path: Any) -> None:
    """A read spanning several tensors (one data file read whole) goes to a peer as one
    message per contiguous piece of at least DIRECT_MESSAGE_BYTES, each received straight
    into its target, and one packed message of the small pieces; sender and receiver split
    alike, in the read's order."""
    from streamckpt.core.targets import collect
    from streamckpt.formats import read_manifest
    from streamckpt.loading.landing import receive_targets
    from streamckpt.loading.schedule import DIRECT_MESSAGE_BYTES, local_schedule
    from streamckpt.loading.scatter import Destinations
    from streamckpt.plan.data import is_packed
    from streamckpt.plan.planner import IdentityView, PlanOptions, build_plan, settle_rounds
    from streamckpt.storage import Storage

    big = DIRECT_MESSAGE_BYTES // 4  # float32 elements of a piece that goes alone
    state = {"a": torch.arange(big, dtype=torch.float32), "n1": torch.ones(8), "b": torch.full((big,), 2.0),
             "n2": torch.full((8,), 3.0)}
    uri = str(tmp_path / "ckpt")
    sc.save(state, uri)
    manifest = read_manifest(Storage(uri))
    plans, schedules, dests = [], [], []
    for rank in range(2):
        mine, _ = collect({k: torch.zeros_like(v) for k, v in state.items()})
        specs = [[t.spec for t in mine]] * 2
        plan = build_plan(manifest, specs, PlanOptions(), IdentityView(manifest), rank=rank)
        settle_rounds(plan, list)
        plans.append(plan)
        schedules.append(local_schedule(plan, rank))
        dests.append(Destinations({uid: t.tensor for uid, t in zip(plan.rank_targets[rank], mine) if uid >= 0}))
    assert len(plans[0].reads) == 1  # the one small file, read whole by one rank
    reader = plans[0].reads[0].reader
    sends = [m for rnd in schedules[reader] for m in rnd.sends]
    recvs = [m for rnd in schedules[1 - reader] for m in rnd.recvs]
    names = {uid: k for uid, k in zip(plans[0].rank_targets[0], state)}
    assert [[names[c.target] for c in m.copies] for m in sends] == [["a"], ["b"], ["n1", "n2"]]
    assert [(m.key, [c.target for c in m.copies]) for m in recvs] == \
        [((m.read_index, reader, m.part), [c.target for c in m.copies]) for m in sends]
    assert [is_packed(m.copies) for m in sends] == [False, False, True]
    direct = receive_targets(schedules[1 - reader], dests[1 - reader], set())
    assert set(direct) == {recvs[0].key, recvs[1].key}  # the two large pieces land in their targets
    assert direct[recvs[0].key].data_ptr() == dests[1 - reader].tensors[recvs[0].copies[0].target].data_ptr()


def _worker_split(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    from streamckpt.loading.schedule import DIRECT_MESSAGE_BYTES

    n = DIRECT_MESSAGE_BYTES // 4
    target = {f"w{i}": torch.zeros(n + i) for i in range(4)} | {f"n{i}": torch.zeros(16) for i in range(4)}
    res = sc.load(target, uri, storage_options=opts)
    for i in range(4):
        assert torch.equal(target[f"w{i}"], torch.arange(n + i, dtype=torch.float32) * (i + 1))
        assert torch.equal(target[f"n{i}"], torch.full((16,), float(i)))
    return {"received": res.bytes_received, "read": res.bytes_read}


def test_replicated_load_of_multi_tensor_reads_over_split_messages(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Every rank needs the whole of a checkpoint whose files hold large and small tensors
    interleaved: each large piece is its own message, the small ones one packed message."""
    from streamckpt.loading.schedule import DIRECT_MESSAGE_BYTES

    n = DIRECT_MESSAGE_BYTES // 4
    state = {}
    for i in range(4):
        state[f"w{i}"] = torch.arange(n + i, dtype=torch.float32) * (i + 1)
        state[f"n{i}"] = torch.full((16,), float(i))
    sc.save(state, s3_uri, storage_options=s3_opts)
    out = [r.unwrap() for r in run_ranks(3, _worker_split, kwargs={"uri": s3_uri, "opts": s3_opts})]
    total = sum(t.numel() * 4 for t in state.values())
    assert sum(o["read"] for o in out) < 1.1 * total  # read once, shared
    assert sum(o["received"] for o in out) >= total  # most bytes came from peers


def test_a_strided_piece_goes_alone_packed_and_lands_in_its_target(tmp_path: Any) -> None:
    """Row shards of two tensors in one file, loaded as column shards on 2 ranks: each column
    piece (strided in the read, contiguous in its target) of at least DIRECT_MESSAGE_BYTES is a
    packed message of its own, received straight into the receiver's target; together they
    would be one packed message, unpacked from a receive buffer (a copy per byte)."""
    from streamckpt.core.targets import collect
    from streamckpt.formats import read_manifest
    from streamckpt.loading.landing import receive_targets
    from streamckpt.loading.schedule import DIRECT_MESSAGE_BYTES, local_schedule
    from streamckpt.loading.scatter import Destinations
    from streamckpt.plan.data import is_packed
    from streamckpt.plan.planner import IdentityView, PlanOptions, build_plan, settle_rounds
    from streamckpt.storage import Storage

    rows, cols = 2 * DIRECT_MESSAGE_BYTES // (4 * 64), 128  # each rank's column half: 2 x DIRECT bytes
    state = {k: torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + i for i, k in enumerate("ab")}
    uri = str(tmp_path / "ckpt")
    sc.save(state, uri)
    manifest = read_manifest(Storage(uri))
    schedules, dests, specs, mine = [], [], [], []
    for rank in range(2):
        got, _ = collect({k: sc.ShardedTensor(torch.zeros(rows, cols // 2), (rows, cols), (0, rank * cols // 2))
                          for k in state})
        mine.append(got)
        specs.append([t.spec for t in got])
    for rank in range(2):
        plan = build_plan(manifest, specs, PlanOptions(), IdentityView(manifest), rank=rank)
        settle_rounds(plan, list)
        schedules.append(local_schedule(plan, rank))
        dests.append(Destinations({uid: t.tensor for uid, t in zip(plan.rank_targets[rank], mine[rank]) if uid >= 0}))
    reader = plan.reads[0].reader
    assert len(plan.reads) == 1 and len(plan.reads[0].copies) == 4  # one file, both tensors' two halves
    sends = [m for rnd in schedules[reader] for m in rnd.sends]
    recvs = [m for rnd in schedules[1 - reader] for m in rnd.recvs]
    assert [len(m.copies) for m in sends] == [1, 1] and all(is_packed(m.copies) for m in sends)
    direct = receive_targets(schedules[1 - reader], dests[1 - reader], set())
    assert set(direct) == {m.key for m in recvs}
    for m in recvs:
        target = dests[1 - reader].tensors[m.copies[0].target]
        assert direct[m.key].data_ptr() == target.data_ptr() and direct[m.key].numel() == target.numel() * 4


def _worker_columns(rank: int, world_size: int, uri: str, opts: dict[str, Any], rows: int, cols: int
                    ) -> dict[str, Any]:
    width = cols // world_size
    target = {k: sc.ShardedTensor(torch.zeros(rows, width), (rows, cols), (0, rank * width)) for k in "ab"}
    res = sc.load(target, uri, storage_options=opts)
    full = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    equal = [torch.equal(target[k].local_tensor, (full + i)[:, rank * width:(rank + 1) * width])
             for i, k in enumerate("ab")]
    return {"equal": equal, "received": res.bytes_received, "read": res.bytes_read}


def test_a_column_reshard_of_strided_pieces_fills_every_element(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The same reshard on 2 gloo ranks over moto: the piece that travels (each strided, packed
    alone, received into its target) fills every element, and the file is read once."""
    from streamckpt.loading.schedule import DIRECT_MESSAGE_BYTES

    rows, cols = 2 * DIRECT_MESSAGE_BYTES // (4 * 64), 128
    state = {k: torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + i for i, k in enumerate("ab")}
    sc.save(state, s3_uri, storage_options=s3_opts)
    out = [r.unwrap() for r in run_ranks(2, _worker_columns, kwargs={"uri": s3_uri, "opts": s3_opts, "rows": rows,
                                                                       "cols": cols})]
    assert [o["equal"] for o in out] == [[True, True]] * 2
    half = 2 * rows * cols * 4 // 2  # one rank's column halves of both tensors
    assert sorted(o["received"] for o in out) == [0, half]  # the reader sent the other rank its halves
    assert sum(o["read"] for o in out) < 1.1 * 2 * rows * cols * 4  # read once
