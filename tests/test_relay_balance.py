"""Relays stay balanced past 256 replicas (issue 46).

A 256 MiB model (32 tensors of 4096 × 1024 bf16, one file, checksum chunks of 1 MiB)
loaded whole on H ranks is cut into 256 pieces of 1 MiB (``min_split_bytes``) and relayed
over a grid of the H holders (a tree when H has a prime factor above ``max_peers + 1``).
Counted from the plan itself (every hop of every relayed read, ``routes.hops_of``): the busiest
rank sends at most 1.5× what a ring all-gather asks of each rank (the model less its own
share), and no rank exchanges with more than ``max_peers`` ranks in a round. With readers
picked by rank among ties, ranks 0-255 read every piece and the busiest rank sent 2× (512
ranks) to 9× (4,096) an all-gather's share.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from streamckpt.core.manifest import Manifest, Shard, TensorMeta
from streamckpt.core.targets import TargetSpec
from streamckpt.plan.balance import multiplier, reader_order
from streamckpt.plan.routes import hops_of
from streamckpt.plan.planner import PlanOptions, build_plan

TENSORS, ROWS, COLS = 32, 4096, 1024
CHUNK = 1 << 20


def _replicated_model(world: int) -> tuple[Manifest, list[list[TargetSpec]], int]:
    """The issue's model, saved by one writer, and every rank's targets (all of it)."""
    n = ROWS * COLS * 2
    shards = {f"t{j}": TensorMeta("BF16", (ROWS, COLS), (Shard((0, 0), (ROWS, COLS), "f", j * n, n, None, "raw",
                                                               CHUNK, (0,) * (n // CHUNK)),))
              for j in range(TENSORS)}
    manifest = Manifest(tensors=shards, files={"f": TENSORS * n})
    targets = [[TargetSpec(f"t{j}", "BF16", (ROWS, COLS), (0, 0), (ROWS, COLS)) for j in range(TENSORS)]
               for _ in range(world)]
    return manifest, targets, TENSORS * n


def relay_load(world: int, ranks_per_node: int = 0) -> tuple[float, int, int]:
    """(busiest rank's egress ÷ an all-gather's per-rank share, most peers of a rank in a
    round, distinct readers) of the replicated model's all-ranks plan."""
    manifest, targets, total = _replicated_model(world)
    plan = build_plan(manifest, targets, PlanOptions(ranks_per_node=ranks_per_node))
    sent = [0] * world
    peers: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r in plan.reads:
        assert r.relay, r  # every read is relayed: one holder set of more than max_peers + 1
        for d, a, b, copies in hops_of(r, plan.targets):
            sent[a] += r.length
            peers[(a, r.round + d)].add(b)
            peers[(b, r.round + d)].add(a)
    share = total * (world - 1) / world
    return max(sent) / share, max(len(p) for p in peers.values()), len({r.reader for r in plan.reads})


SLOW = pytest.mark.slow
CASES = [pytest.param(256, 0), pytest.param(512, 0), pytest.param(1024, 0), pytest.param(1031, 0),
         pytest.param(1024, 8), pytest.param(2048, 0, marks=SLOW), pytest.param(4096, 0, marks=SLOW),
         pytest.param(2048, 8, marks=SLOW), pytest.param(4096, 8, marks=SLOW), pytest.param(1031, 8, marks=SLOW)]


@pytest.mark.parametrize("world,ranks_per_node", CASES)
def test_busiest_rank_sends_about_an_all_gathers_share(world: int, ranks_per_node: int) -> None:
    """Every rank's egress within 1.5× an all-gather's share, at most ``max_peers`` (8) peers per
    rank and round, and the 256 pieces read by 256 distinct ranks (one GET each)."""
    ratio, peers, readers = relay_load(world, ranks_per_node)
    assert readers == 256
    assert peers <= PlanOptions().max_peers
    assert ratio <= 1.5, ratio


@pytest.mark.parametrize("n", [1, 2, 3, 16, 24, 512, 1031, 4096, 16384])
def test_reader_order_is_a_permutation_that_spreads_its_prefixes(n: int) -> None:
    """``reader_order`` ranks every holder position once, steps by a multiplier coprime to the
    count, and any prefix of its positions is spread evenly: each eighth of the holder list
    (the top digit of a grid of 8s) gets within 2 of its share of the first k picks."""
    key = reader_order(n)
    assert sorted(key) == list(range(n))
    m = multiplier(n)
    pos = [0] * n
    for p, k in enumerate(key):
        pos[k] = p
    assert all(pos[i] == i * m % n for i in range(n))
    if n >= 64:
        for k in (n // 16, n // 8, n // 4, n // 2, 3 * n // 4):
            bins = [0] * 8
            for p in pos[:k]:
                bins[p * 8 // n] += 1
            assert max(bins) - k / 8 <= 2 and k / 8 - min(bins) <= 2, (k, bins)
