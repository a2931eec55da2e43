"""The scale model (benchmarks/scale_model.py) on a case small enough to count by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks import scale_model as sm
from streamckpt.core.manifest import Manifest, Shard, TensorMeta
from streamckpt.core.targets import TargetSpec

ROOT = Path(__file__).resolve().parents[1]
P5 = ROOT / "configs" / "scale" / "aws_p5.yaml"
N = 64 << 10  # one fp32 tensor of 64 KiB: one checksum chunk, so one read


def _one_tensor(per_node: int = 2, nodes: int = 2):
    """One stored tensor (one shard, one file) that each of nodes × per_node ranks needs whole."""
    shape = (N // 4,)
    shard = Shard((0,), shape, "data/0.safetensors", 0, N, None, "raw", sm.CHUNK, (0,))
    manifest = Manifest(tensors={"w": TensorMeta("F32", shape, (shard,))}, files={"data/0.safetensors": N})
    world = per_node * nodes
    targets = [[TargetSpec("w", "F32", shape, (0,), shape)] for _ in range(world)]
    return manifest, targets, list(range(world))


@pytest.fixture(scope="module")
def machine() -> sm.Machine:
    return dataclasses.replace(sm.load_machine(P5), gpus_per_node=2)


def test_one_tensor_all_need_it(machine: sm.Machine) -> None:
    manifest, targets, ranks = _one_tensor()
    counts = sm.plan_counts(manifest, targets, ranks, machine)
    ours = counts["streamckpt"]
    readers = [r for (r, _), c in ours.cells.items() if c.fetched]
    assert len(readers) == 1  # read once
    reader = readers[0]
    cells = list(ours.cells.values())
    assert sum(c.fetched for c in cells) == N and sum(c.requests for c in cells) == 1
    # the reader sends N to its node-mate and N to each of the other node's two ranks
    assert sum(c.sent_intra for c in cells) == N and sum(c.recv_intra for c in cells) == N
    assert sum(c.sent_inter for c in cells) == 2 * N and sum(c.recv_inter for c in cells) == 2 * N
    peers = {r: len(c.peers) for (r, _), c in ours.cells.items()}
    assert peers == {r: 3 if r == reader else 1 for r in ranks}
    p = sm.predict(ours, machine, "streamckpt")
    assert (p.max_peers_per_round, p.max_links, p.requests) == (3, 3, 1)
    assert p.nccl_GiB_per_rank == pytest.approx(3 * 16 / 1024)


def test_egress_ratio_by_hand(machine: sm.Machine) -> None:
    """One 64 KiB tensor on 4 ranks: an all-gather asks 3/4 × N of each rank. streamckpt's reader
    sends it straight to the 3 others (3N: 4×); Run:ai's ring sends N across and N within each
    node from the node's head (2N: 8/3×); DCP exchanges nothing."""
    manifest, targets, ranks = _one_tensor()
    counts = sm.plan_counts(manifest, targets, ranks, machine)
    assert counts["streamckpt"].share == {r: pytest.approx(3 * N / 4) for r in ranks}
    assert counts["streamckpt"].egress_ratio() == pytest.approx(4.0)
    assert counts["runai"].egress_ratio() == pytest.approx(8 / 3)
    assert counts["dcp"].egress_ratio() == 0.0
    assert sm.predict(counts["streamckpt"], machine, "streamckpt").egress_ratio == pytest.approx(4.0)


def test_peers_strategies_by_hand(machine: sm.Machine) -> None:
    manifest, targets, ranks = _one_tensor()
    counts = sm.plan_counts(manifest, targets, ranks, machine)
    dcp = list(counts["dcp"].cells.values())
    assert [c.fetched for c in dcp] == [N] * 4 and [c.requests for c in dcp] == [1] * 4  # each reads it
    assert not any(c.peers or c.sent_inter for c in dcp)
    runai = counts["runai"].cells
    assert sum(c.fetched for c in runai.values()) == N  # read once by rank 0, then a ring over 2 nodes
    assert runai[(0, 0)].sent_inter == N and runai[(2, 0)].recv_inter == N
    assert runai[(1, 0)].recv_intra == N and runai[(3, 0)].recv_intra == N


def test_time_by_hand(machine: sm.Machine) -> None:
    """Each rank's one GET: a first byte (150 ms), then 64 KiB at 88 MB/s (0.74 ms)."""
    manifest, targets, ranks = _one_tensor()
    counts = sm.plan_counts(manifest, targets, ranks, machine)
    p = sm.predict(counts["dcp"], machine, "dcp")
    assert p.seconds == pytest.approx(0.150 + N / 88e6) and p.bottleneck == "first-byte latency"
    assert p.requests == 4 and p.fetched_GB == pytest.approx(4 * N / 1e9)


def test_prefix_limit_decides_when_gets_pile_up(machine: sm.Machine) -> None:
    """64 ranks × 320 GETs: each rank's 32 connections wait 10 first bytes (1.5 s), but the
    prefix takes the job's 20,480 GETs in 20,480 / 5,500 = 3.72 s."""
    counts = sm.Counts(1)
    for r in range(64):
        counts.cell(r, 0).requests = 320
    p = sm.predict(counts, machine, "streamckpt")
    assert p.terms == {"first-byte latency": pytest.approx(1.5)}
    assert p.bottleneck == "S3 prefix GET rate" and p.seconds == pytest.approx(20480 / 5500)


def test_every_parameter_has_a_source() -> None:
    import yaml

    leaves = sm.flatten(yaml.safe_load(P5.read_text()))
    assert len(leaves) >= 15
    for name, leaf in leaves.items():
        assert isinstance(leaf["value"], (int, float)), name
        src = str(leaf.get("source", ""))
        assert len(src) > 20, f"{name}: no source"
        assert src.startswith("assumption:") or "http" in src or "streamckpt" in src or "torch" in src, name


def test_layouts_cover_the_model_once() -> None:
    """The small case's saved and loaded layouts each hold every weight exactly once per replica."""
    case = sm.Case("tiny", sm.Model("tiny", 2, 64, 128, 32, 256), sm.Layout(2, 2, 1), sm.Layout(2, 1, 2), optim=True)
    manifest = sm.build_manifest(case)
    targets = sm.build_targets(case)
    per_rank = [sum(_bytes(s) for s in t) for t in targets]
    weights = sum(4 * _numel(t.shape) // 2 for k, t in manifest.tensors.items() if not k.startswith("optim"))
    optim = sum(4 * _numel(t.shape) for k, t in manifest.tensors.items() if k.startswith("optim"))
    assert sum(manifest.files.values()) == weights + optim
    assert sum(per_rank) == 2 * weights + optim  # weights on both DP replicas, the state split


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _bytes(s: TargetSpec) -> int:
    size = 4 if s.dtype == "F32" else 2
    return size * ((s.flat_range[1] - s.flat_range[0]) if s.flat_range else _numel(s.shape))


def test_first_byte_adds_to_a_link_bound_round(machine: sm.Machine) -> None:
    """One round, each rank fetching 2 GB in 8 GETs. Two ranks on a node: each rank's 32
    connections (2 GB at 32 × 88 MB/s, 0.71 s) are slower than the node's 100 Gbps store link
    (4 GB at 12.5 GB/s, 0.32 s): 0.15 s first byte + 0.71 s. Eight ranks on a node: the link
    (16 GB, 1.28 s) is the limit, and it idles while the round's GETs wait for their first
    byte: 0.15 + 1.28 s (the first byte had been hidden behind the link; docs/SCALE.md,
    "Checked against measurement")."""
    counts = sm.Counts(1)
    for r in range(2):
        c = counts.cell(r, 0)
        c.fetched, c.requests = 2 * 10**9, 8
    p = sm.predict(counts, machine, "streamckpt")
    assert p.seconds == pytest.approx(0.150 + 2e9 / (32 * 88e6))
    many = dataclasses.replace(machine, gpus_per_node=8)
    counts = sm.Counts(1)
    for r in range(8):
        c = counts.cell(r, 0)
        c.fetched, c.requests = 2 * 10**9, 8
    p = sm.predict(counts, many, "streamckpt")
    assert p.seconds == pytest.approx(0.150 + 16e9 / 12.5e9) and p.bottleneck == "node store bandwidth"


def test_local_parameters_are_measured() -> None:
    """configs/scale/local_netns.yaml (written by benchmarks/scale_check.py) loads, and each
    figure says how it was measured or where it comes from."""
    path = ROOT / "configs" / "scale" / "local_netns.yaml"
    m = sm.load_machine(path)
    assert m.gpus_per_node == 2 and 0 < m.node_store_Bps < m.nic_Bps
    import yaml

    for name, leaf in sm.flatten(yaml.safe_load(path.read_text())).items():
        src = str(leaf["source"])
        assert "measured by benchmarks/scale_check.py" in src or "http" in src or "streamckpt" in src \
            or "torch" in src or "assumption:" in src or "local server" in src or "ranks per node" in src, name


def test_gets_are_counted_as_the_reader_cuts_them(machine: sm.Machine) -> None:
    """One 32 MiB tensor each of 2 ranks needs: the reader cuts its round into 4 MiB pieces in
    a small job, and sends each read whole in a job of thousands (``job_spread``), as
    ``storage.reads.piece_for`` does for the real reader."""
    from streamckpt.loading.requestrate import job_spread
    from streamckpt.plan.planner import PlanOptions, build_plan

    n = 32 << 20
    shape = (n // 4,)
    shard = Shard((0,), shape, "data/0.safetensors", 0, n, None, "raw", sm.CHUNK, (0,))
    manifest = Manifest(tensors={"w": TensorMeta("F32", shape, (shard,))}, files={"data/0.safetensors": n})
    targets = [[TargetSpec("w", "F32", shape, (0,), shape)] for _ in range(2)]
    plan = build_plan(manifest, targets, PlanOptions(ranks_per_node=2))
    lengths = [r.length for r in plan.reads]
    assert sum(lengths) == n and max(lengths) > 4 << 20  # reads larger than a piece
    small = sm.plan_counts(manifest, targets, [0, 1], machine)["streamckpt"]
    large = sm.plan_counts(manifest, targets, [0, 1], machine, world=4096)["streamckpt"]
    assert job_spread(2, 32) == 16 and job_spread(4096, 32) == 1
    assert sum(c.requests for c in small.cells.values()) == sum(-(-x // (4 << 20)) for x in lengths)
    assert sum(c.requests for c in large.cells.values()) == len(lengths)  # one GET per read


def test_a_tier_resume_reads_the_survivors_copies_and_no_bucket_byte(machine: sm.Machine) -> None:
    """benchmarks/tier_model.py: 4 saving ranks on 2 nodes, node 1 lost: each file's holder is
    its writer on node 0 or its partner there; the resume reads every byte from node 0's local
    copies (no GET), charged to its local read bandwidth, and sends the rest over the fabric."""
    from benchmarks import tier_model as tm

    case = sm.Case("tiny", sm.Model("tiny", 2, 64, 128, 32, 256), sm.Layout(2, 2, 1), sm.Layout(2, 1, 2))
    held = tm.holders(case, per_node=2, lost_node=1)
    assert held == {"data/00000.safetensors": [0], "data/00001.safetensors": [1],
                    "data/00002.safetensors": [0], "data/00003.safetensors": [1]}
    assert tm.holders(case, per_node=2, lost_node=0)["data/00000.safetensors"] == [2]
    m = dataclasses.replace(machine, local_Bps=1e9)
    bucket, tier, where = tm.predict_tier(case, m, lost_node=1)
    total = sum(sm.build_manifest(case).files.values())
    assert where == {"local_GB": total / 1e9, "bucket_GB": 0.0, "files_lost": 0}
    assert bucket.fetched_GB == pytest.approx(total / 1e9) and bucket.requests > 0
    assert tier.fetched_GB == 0 and tier.requests == 0
    assert tier.terms and set(tier.terms) <= {"node local read", "node NIC (exchange)", "NVLink"}
