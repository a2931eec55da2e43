"""Planner properties through a pure simulated executor (no storage, no processes).

Random source layouts (grids, flat-range shards, chunked checksums) and random
target layouts over several simulated ranks: every target element is written
with the right source element, with read_once every stored byte is fetched at
most once, and every round fits each rank's memory budget.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamckpt.core.manifest import Manifest, Shard, TensorMeta, validate
from streamckpt.loading.pipeline import Destinations, LocalRound, _layout, local_schedule, pack_message, unpack_message
from streamckpt.plan.planner import (ALIGN, PlanOptions, build_plan, costs_of, ranks_of, is_packed, message_layout, message_size, messages_of,
                             settle_all)
from streamckpt.plan.routes import grid_hops, grid_links, grid_shape, hops_of, node_grid, relay_hops, relay_links
from streamckpt.core.regions import Box
from streamckpt.core.targets import TargetSpec
from streamckpt.plan.gathered import GatheredSpecs


def _grid(shape, rng, max_cuts=3):
    cuts = []
    for s in shape:
        pts = sorted(rng.sample(range(1, s), min(s - 1, rng.randint(0, max_cuts)))) if s > 1 else []
        cuts.append([0] + pts + [s])
    boxes = [Box((), ())]
    for c in cuts:
        boxes = [Box(b.offset + (lo,), b.shape + (hi - lo,)) for b in boxes for lo, hi in zip(c, c[1:])]
    return boxes


def _make_checkpoint(rng, shape, dtype=torch.float32, keys=("w",)):
    """Tensors ``keys`` of ``shape`` (each its own values), shards interleaved in the same files."""
    files: dict[str, bytearray] = defaultdict(bytearray)
    chunk = rng.choice([0, 8, 24, 64])
    originals, shards = {}, {}
    jobs = []
    for j, key in enumerate(keys):
        originals[key] = (torch.arange(math.prod(shape), dtype=torch.float64) * 1.5 + 3 + 1000 * j).to(dtype).reshape(shape)
        shards[key] = []
        jobs += [(key, box) for box in _grid(shape, rng)]
    rng.shuffle(jobs)
    for key, box in jobs:
        _store_box(rng, files, shards[key], originals[key], box, chunk)
    code = {torch.float32: "F32", torch.int16: "I16"}[dtype]
    m = Manifest(tensors={k: TensorMeta(code, tuple(shape), tuple(shards[k])) for k in keys},
                 files={k: len(v) for k, v in files.items()})
    validate(m)
    files = {k: bytes(v) for k, v in files.items()}
    if keys == ("w",):
        return m, files, originals["w"]
    return m, files, originals


def _store_box(rng, files, shards, original, box, chunk):
    """Append one box (maybe as two flat-range shards) to a random file."""
    block = original[box.slices()].contiguous().reshape(-1)
    pieces = [(None, block)]
    if rng.random() < 0.4 and box.numel > 2:
        cut = rng.randint(1, box.numel - 1)
        pieces = [((0, cut), block[:cut]), ((cut, box.numel), block[cut:])]
    for fr, data in pieces:
        fname = f"data/{rng.randint(0, 2)}.bin"
        f = files[fname]
        f.extend(b"\0" * rng.randint(0, 9))  # unaligned padding between shards
        raw = data.view(torch.uint8).numpy().tobytes()
        n_chunks = -(-len(raw) // chunk) if chunk else 0
        shards.append(Shard(box.offset, box.shape, fname, len(f), len(raw), flat_range=fr,
                            chunk_size=chunk, crc32c=tuple([0] * n_chunks) if chunk else None))
        f.extend(raw)


def _make_targets(rng, shape, world, dtype_code, key="w"):
    specs = [[] for _ in range(world)]
    for box in _grid(shape, rng):
        holders = rng.sample(range(world), rng.randint(1, world))
        flat = None
        if rng.random() < 0.3 and box.numel > 1:
            a = rng.randint(0, box.numel - 1)
            flat = (a, rng.randint(a + 1, box.numel))
        for r in holders:
            specs[r].append(TargetSpec(key, dtype_code, tuple(shape), box.offset, box.shape, flat))
    return specs


def _expected(original, spec):
    block = original[spec.box.slices()]
    if spec.flat_range is None:
        return block
    return block.reshape(-1)[spec.flat_range[0]:spec.flat_range[1]]


def _message(staged, copies):
    """What the pipeline sends for ``copies`` of a staged read."""
    if not is_packed(copies):
        c = copies[0]
        return staged[c.offset:c.offset + c.length].clone()
    return pack_message(staged, copies, torch.zeros(message_layout(copies)[1], dtype=torch.uint8))


def simulate(plan, files, world, targets_by_rank, dtype):
    """Run every rank's schedule from the all-ranks plan; return tensors and fetch log."""
    return simulate_local([plan] * world, files, world, targets_by_rank, dtype)


def _signature(read):
    return (read.file, read.start, read.stop, read.reader, read.round, read.tag,
            tuple((c.target, c.offset, c.length, c.dst_box, c.dst_base) for c in read.copies))


def local_plans(manifest, targets, opts, wire=False):
    """One plan per rank, each made as that rank makes it, rounds settled across them;
    with ``wire`` each from the specs it decodes after the specwire exchange (``GatheredSpecs``
    and its lazy rows, as a real load plans), not from the plain lists."""
    seen = test_specwire.simulate(targets)[0] if wire else [targets] * len(targets)
    if wire:
        assert all(isinstance(s, GatheredSpecs) and s == targets for s in seen)
    plans = [build_plan(manifest, seen[r], opts, rank=r) for r in range(len(targets))]
    settle_all(plans)
    return plans


def check_local_plans_match_full(plans, full):
    """The ranks' own plans are the full plan cut to what each rank takes part in."""
    union = {_signature(r) for p in plans for r in p.reads}
    assert union == {_signature(r) for r in full.reads}
    assert {p.num_rounds for p in plans} == {full.num_rounds}


def simulate_local(plans, files, world, targets_by_rank, dtype):
    """Run each rank's schedule from its own plan, round by round over all ranks; sends and
    receives must pair up exactly (round, peers, tag, size, order) as gloo would match them.
    A relayed send goes out from the bytes its rank received the round before, kept only
    where its receive said so (``Message.keep``), as the executor keeps them."""
    dests = []
    for r in range(world):
        tensors = {}
        for uid, spec in zip(plans[r].rank_targets[r], targets_by_rank[r]):
            shape = spec.shape if spec.flat_range is None else (spec.numel,)
            tensors[uid] = torch.full(shape, -7, dtype=dtype)
        dests.append(Destinations(tensors))
    # a small threshold: most contiguous pieces travel as messages of their own (split_message)
    schedules = [local_schedule(plans[r], r, direct_bytes=64) for r in range(world)]
    assert len({len(s) for s in schedules}) == 1
    sent = defaultdict(list)  # (round, src, dst) -> [(tag, size)]
    posted = defaultdict(list)
    fetched = []
    kept = {}  # (rank, read index) -> the message it received and sends on next round
    for k in range(len(schedules[0])):
        delivered = []
        carried = {}
        for r in range(world):
            rnd = schedules[r][k]
            for m in rnd.recvs:
                read = plans[r].reads[m.read_index]
                posted[(k, m.peer, r)].append((read.tag, message_size(m.copies)))
            staged = {}
            for i, read in rnd.reads:
                data = files[read.file][read.start:read.stop]
                fetched.append((read.file, read.start, read.stop))
                staged[i] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                for c in read.copies:
                    if c.target in dests[r].tensors:
                        dests[r].apply(staged[i][c.offset:], c)
            for m in rnd.sends:
                read = plans[r].reads[m.read_index]
                msg = kept[(r, m.read_index)] if m.relayed else _message(staged[m.read_index], m.copies)
                sent[(k, r, m.peer)].append((read.tag, msg.numel()))
                delivered.append((r, m, msg))
                if m.read_index in rnd.carry:  # sent again next round, from its relay buffer
                    carried[(r, m.read_index)] = msg
        waiting = defaultdict(list)  # (receiver, sender, tag) -> its receives, in order (its own read indices)
        for r in range(world):
            for m in schedules[r][k].recvs:
                waiting[(r, m.peer, plans[r].reads[m.read_index].tag)].append(m)
        kept = carried
        for src, m, msg in delivered:
            unpack_message(msg, m.copies, dests[m.peer])
            mine = waiting[(m.peer, src, plans[src].reads[m.read_index].tag)].pop(0)
            assert (mine.part, len(mine.copies)) == (m.part, len(m.copies))  # the receiver split alike
            assert all(a.target == b.target and a.length == b.length for a, b in zip(mine.copies, m.copies))
            if mine.keep:
                kept[(m.peer, mine.read_index)] = msg
    assert dict(sent) == dict(posted)
    return dests, fetched


def peers_per_round(plans, world):
    """Rank -> round -> the distinct ranks it sends to or receives from (each rank's own plan)."""
    out = defaultdict(lambda: defaultdict(set))
    for r in range(world):
        for k, rnd in enumerate(local_schedule(plans[r], r)):
            out[r][k].update(m.peer for m in rnd.sends)
            out[r][k].update(m.peer for m in rnd.recvs)
    return out


def check_per_rank_plans(manifest, files, targets, opts, full, dtype, expected, wire=False):
    """Plan per rank (``wire``: from the specs the exchange decodes), check the plans against
    the all-ranks one and their staging against the budget, run them, and check every target
    equals ``expected(spec)``; returns the fetch log."""
    world = len(targets)
    plans = local_plans(manifest, targets, opts, wire)
    check_local_plans_match_full(plans, full)
    check_staging_fits(plans, opts)
    dests, fetched = simulate_local(plans, files, world, targets, dtype)
    for r in range(world):
        for uid, spec in zip(full.rank_targets[r], targets[r]):
            assert torch.equal(dests[r].tensors[uid], expected(spec)), (r, spec)
    return fetched


def _units(plan, rnd, edge):
    """A rank's part of one round cut into what the planner places as one unit: a read
    with the messages it packs, or one received message; each as its own one-unit
    round, keyed by its group (in an edge round, the ranks its read serves)."""
    out = []
    for i, r in rnd.reads:
        unit = LocalRound(reads=[(i, r)], sends=[m for m in rnd.sends if m.read_index == i and not m.relayed])
        out.append((ranks_of(r, plan.targets) if edge else None, unit))
    for i in sorted({m.read_index for m in rnd.sends if m.relayed}):  # a relay buffer and its sends
        unit = LocalRound(sends=[m for m in rnd.sends if m.read_index == i and m.relayed])
        out.append((ranks_of(plan.reads[i], plan.targets) if edge else None, unit))
    received: dict[tuple[int, int], list] = {}
    for m in rnd.recvs:  # a read's message from one peer, however many parts it travels in
        received.setdefault((m.read_index, m.peer), []).append(m)
    for (i, _), parts in received.items():
        out.append((ranks_of(plan.reads[i], plan.targets) if edge else None, LocalRound(recvs=parts)))
    return out


def check_staging_fits(plans, opts):
    """Every round fits in one of the rank's two staging arenas, measured on what the
    executor lays out for that rank's part of the round (``pipeline._layout``: fetch,
    decode, pack and receive buffers, alignment and all), not on the planner's costs.

    The bound is half the memory budget (at most ``max_round_bytes``); a unit the
    planner places alone (one oversized read with its messages, or one received
    message) may exceed it. In an edge round each group of ranks has its share of the
    round, ``round_cap / edge_degree``, or one unit of any size.
    """
    limit = min(opts.memory_budget // 2, opts.max_round_bytes)
    for rank, plan in enumerate(plans):
        share = opts.round_cap // max(1, plan.edge_degree)
        for k, rnd in enumerate(local_schedule(plan, rank)):
            size = _layout(rnd).size
            groups = defaultdict(list)
            for group, unit in _units(plan, rnd, k >= plan.base_rounds):
                groups[group].append(_layout(unit).size - ALIGN)  # without the round's tail
            if None in groups:  # a base round
                assert size <= limit or len(groups[None]) == 1, (rank, k, size, limit)
                continue
            allowed = ALIGN + sum(max(share, sizes[0]) if len(sizes) == 1 else share
                                  for sizes in groups.values())
            assert size <= max(limit, allowed), (rank, k, size, limit, allowed)


def check_read_once(fetched):
    per_file = defaultdict(list)
    for f, s, e in fetched:
        per_file[f].append((s, e))
    for spans in per_file.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "a byte was fetched twice"


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 4), st.booleans(),
       st.sampled_from([256, 2048, 1 << 20]))
def test_plan_writes_every_target_element_once_and_reads_once(seed, ndim, world, read_once, budget):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(ndim))
    dtype = rng.choice([torch.float32, torch.int16])
    manifest, files, original = _make_checkpoint(rng, shape, dtype)
    code = manifest.tensors["w"].dtype
    targets = _make_targets(rng, shape, world, code)
    opts = PlanOptions(memory_budget=budget, max_gap_bytes=rng.choice([0, 16, 1 << 20]), read_once=read_once)
    plan = build_plan(manifest, targets, opts)
    dests, fetched = simulate(plan, files, world, targets, dtype)
    for r in range(world):
        for uid, spec in zip(plan.rank_targets[r], targets[r]):
            assert torch.equal(dests[r].tensors[uid], _expected(original, spec)), (r, spec)
    if read_once:
        check_read_once(fetched)
    else:
        assert all(r.private and not messages_of(r, plan.targets) for r in plan.reads)
    check_staging_fits([plan] * world, opts)
    check_per_rank_plans(manifest, files, targets, opts, plan, dtype, lambda spec: _expected(original, spec))


def test_row_slice_reads_only_its_rows():
    shape = (64, 16)
    shards = (Shard((0, 0), shape, "f", 0, 64 * 16 * 4, chunk_size=256, crc32c=tuple([0] * 16)),)
    m = Manifest(tensors={"w": TensorMeta("F32", shape, shards)}, files={"f": 64 * 16 * 4})
    spec = TargetSpec("w", "F32", shape, (16, 0), (16, 16))
    plan = build_plan(m, [[spec]], PlanOptions())
    assert [(r.start, r.stop) for r in plan.reads] == [(16 * 64, 32 * 64)]
    assert len(plan.reads[0].checks) == 4


def test_replicated_target_is_read_once_and_split_across_ranks():
    shape = (1024, 1024)
    nbytes = 1024 * 1024 * 4
    shards = (Shard((0, 0), shape, "f", 0, nbytes),)
    m = Manifest(tensors={"w": TensorMeta("F32", shape, shards)}, files={"f": nbytes})
    spec = TargetSpec("w", "F32", shape, (0, 0), shape)
    world = 4
    plan = build_plan(m, [[spec]] * world, PlanOptions(max_request_bytes=256 << 10))
    per_rank = defaultdict(int)
    for r in plan.reads:
        per_rank[r.reader] += r.length
    assert sum(per_rank.values()) == nbytes
    assert sorted(per_rank) == [0, 1, 2, 3]
    assert max(per_rank.values()) <= nbytes // world + (256 << 10)


def test_missing_keys_and_mismatches():
    from streamckpt.errors import IncompatibleStateDictError

    shards = (Shard((0,), (4,), "f", 0, 16),)
    m = Manifest(tensors={"w": TensorMeta("F32", (4,), shards)}, files={"f": 16})
    plan = build_plan(m, [[TargetSpec("x", "F32", (4,), (0,), (4,))]])
    assert plan.missing == [["x"]] and plan.unexpected == ["w"]
    with pytest.raises(IncompatibleStateDictError, match="shape"):
        build_plan(m, [[TargetSpec("w", "F32", (5,), (0,), (5,))]])
    with pytest.raises(IncompatibleStateDictError, match="dtype"):
        build_plan(m, [[TargetSpec("w", "F16", (4,), (0,), (4,))]])


def _zero_targets(rng, shape, world, dtype_code, key="w"):
    """Every element held by exactly one rank: boxes of a grid, each whole or cut
    into flat ranges (ZeRO slices) given to random ranks."""
    specs = [[] for _ in range(world)]
    for box in _grid(shape, rng):
        n = box.numel
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
        if not cuts and rng.random() < 0.5:
            specs[rng.randrange(world)].append(TargetSpec(key, dtype_code, tuple(shape), box.offset, box.shape))
            continue
        for a, b in zip([0] + cuts, cuts + [n]):
            specs[rng.randrange(world)].append(TargetSpec(key, dtype_code, tuple(shape), box.offset, box.shape, (a, b)))
    return specs


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(2, 5), st.sampled_from([256, 1024, 1 << 20]))
def test_private_targets_planned_per_rank_read_once_and_match(seed, ndim, world, budget):
    """Single-holder targets (ZeRO slices) are planned by each rank near its own
    slices: seams inside a checksum chunk are read once and sent, every value lands."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(2, 12) for _ in range(ndim))
    dtype = rng.choice([torch.float32, torch.int16])
    manifest, files, original = _make_checkpoint(rng, shape, dtype)
    code = manifest.tensors["w"].dtype
    targets = _zero_targets(rng, shape, world, code)
    opts = PlanOptions(memory_budget=budget, max_gap_bytes=rng.choice([0, 16, 1 << 20]))
    full = build_plan(manifest, targets, opts)
    fetched = check_per_rank_plans(manifest, files, targets, opts, full, dtype, lambda spec: _expected(original, spec),
                                   wire=True)
    check_read_once(fetched)
    # an edge read carries at most the chunks its ranks share, never a whole slice
    for read in full.edge_reads:
        assert len({full.targets[c.target].needers[0] for c in read.copies}) > 1
    # budget: before the edge rounds every round fits each rank (a lone oversized read aside);
    # in an edge round each group of ranks keeps to its share of the round (or holds one read)
    usage, count = defaultdict(int), defaultdict(int)
    edges = {id(r) for r in full.edge_reads}
    share = max(1, opts.round_cap // max(1, full.edge_degree))
    for read in full.reads:
        for rank, cost in costs_of(read, full.targets).items():
            key = (read.round, rank, ranks_of(read, full.targets) if id(read) in edges else None)
            usage[key] += cost
            count[key] += 1
    for key, used in usage.items():
        cap = opts.round_cap if key[2] is None else share
        assert used <= cap or count[key] == 1, (key, used, cap)
        assert (key[2] is None) == (key[0] < full.base_rounds), key


def test_zero_slices_share_only_seam_chunks():
    """Four ranks hold quarter slices of a flattened 64 KiB tensor stored in 4 KiB
    chunks: each reads its own chunks; only the 3 chunks the seams cut are shared."""
    n = 16384  # fp32 elements, 64 KiB
    chunk = 4096
    shard = Shard((0,), (n,), "data/0.bin", 0, n * 4, chunk_size=chunk, crc32c=(0,) * (n * 4 // chunk))
    m = Manifest(tensors={"w": TensorMeta("F32", (n,), (shard,))}, files={"data/0.bin": n * 4})
    bounds = [0, 4000, 8100, 12300, n]  # not on chunk boundaries (1024 elements per chunk)
    specs = [[TargetSpec("w", "F32", (n,), (0,), (n,), (a, b))] for a, b in zip(bounds, bounds[1:])]
    plans = local_plans(m, specs, PlanOptions())
    full = build_plan(m, specs, PlanOptions())
    check_local_plans_match_full(plans, full)
    assert len(full.edge_reads) == 3
    assert all(r.length == chunk for r in full.edge_reads)
    assert sum(r.length for r in full.reads) == n * 4  # every byte once
    for r, p in enumerate(plans):
        mine = [x for x in p.reads if x.reader == r]
        assert sum(x.length for x in mine if x.private) >= (bounds[r + 1] - bounds[r]) * 4 - 2 * chunk
        assert len(p.edge_reads) == (1 if r in (0, 3) else 2)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(2, 4), st.sampled_from([512, 1 << 20]))
def test_shared_and_private_tensors_in_the_same_files(seed, ndim, world, budget):
    """A replicated tensor and a ZeRO-sliced one interleaved in the same files: the
    shared plan never reads through the private tensor's bytes (and vice versa)."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(2, 10) for _ in range(ndim))
    manifest, files, originals = _make_checkpoint(rng, shape, torch.float32, keys=("w", "m"))
    shared = _make_targets(rng, shape, world, "F32", key="w")
    private = _zero_targets(rng, shape, world, "F32", key="m")
    targets = [a + b for a, b in zip(shared, private)]
    opts = PlanOptions(memory_budget=budget, max_gap_bytes=rng.choice([16, 1 << 20]))
    full = build_plan(manifest, targets, opts)
    fetched = check_per_rank_plans(manifest, files, targets, opts, full, torch.float32,
                                   lambda spec: _expected(originals[spec.key], spec))
    check_read_once(fetched)


def test_small_replicated_tensor_rides_on_the_neighbouring_edge_read():
    """Column halves of two matrices (every stored row touched by both ranks: edge reads)
    with a replicated norm stored between them: the norm's few bytes come with the edge
    read that ends where it starts, not as a request of their own, on every rank alike,
    and each rank's reads cover each byte once."""
    rows, cols = 8, 16
    a = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    b = a + 1000
    norm = torch.arange(cols, dtype=torch.float32) - 50
    blob = a.numpy().tobytes() + norm.numpy().tobytes() + b.numpy().tobytes()
    row = cols * 4

    def shard(offset, nbytes, shape):
        return Shard((0,) * len(shape), shape, "f", offset, nbytes, chunk_size=row, crc32c=(0,) * (nbytes // row))

    m = Manifest(tensors={"a": TensorMeta("F32", (rows, cols), (shard(0, rows * row, (rows, cols)),)),
                          "n": TensorMeta("F32", (cols,), (shard(rows * row, row, (cols,)),)),
                          "b": TensorMeta("F32", (rows, cols), (shard(rows * row + row, rows * row, (rows, cols)),))},
                 files={"f": len(blob)})
    validate(m)
    originals = {"a": a, "n": norm, "b": b}
    half = cols // 2
    targets = [[TargetSpec("a", "F32", (rows, cols), (0, r * half), (rows, half)),
                TargetSpec("n", "F32", (cols,), (0,), (cols,)),
                TargetSpec("b", "F32", (rows, cols), (0, r * half), (rows, half))] for r in range(2)]
    opts = PlanOptions()
    full = build_plan(m, targets, opts)
    assert all(r.length > row for r in full.reads), [(r.start, r.stop) for r in full.reads]
    assert any(r.start < rows * row < r.stop for r in full.edge_reads)  # the norm's bytes inside an edge read
    fetched = check_per_rank_plans(m, {"f": blob}, targets, opts, full, torch.float32,
                                   lambda spec: _expected(originals[spec.key], spec))
    check_read_once(fetched)
    assert sum(stop - start for _, start, stop in fetched) == len(blob)


def _many_holder_targets(rng, shape, world, dtype_code, key, everyone):
    """Grid boxes each held by many ranks (every rank with ``everyone``), some small sets too."""
    specs = [[] for _ in range(world)]
    for box in _grid(shape, rng):
        n = world if everyone else rng.choice([world, world - 1, rng.randint(1, world)])
        holders = sorted(rng.sample(range(world), n))
        flat = None
        if rng.random() < 0.2 and box.numel > 1:
            a = rng.randint(0, box.numel - 1)
            flat = (a, rng.randint(a + 1, box.numel))
        for r in holders:
            specs[r].append(TargetSpec(key, dtype_code, tuple(shape), box.offset, box.shape, flat))
    return specs


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(4, 14), st.integers(2, 4), st.booleans(),
       st.sampled_from([1024, 4096, 1 << 20]))
def test_many_holders_are_relayed_within_max_peers(seed, ndim, world, max_peers, everyone, budget):
    """Targets many ranks hold travel along relay trees: every element lands, every byte is
    read once, each round fits, sends pair with receives (a forwarder sends the bytes it
    received the round before), the ranks' own plans are the all-ranks plan, and no rank
    exchanges with more than ``max_peers`` ranks in a round over the relayed reads of one
    holder set (over all of its reads when every target is held by every rank)."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(2, 24) for _ in range(ndim))
    dtype = rng.choice([torch.float32, torch.int16])
    manifest, files, originals = _make_checkpoint(rng, shape, dtype, keys=("w", "v"))
    code = manifest.tensors["w"].dtype
    targets = [a + b for a, b in zip(_many_holder_targets(rng, shape, world, code, "w", everyone),
                                     _many_holder_targets(rng, shape, world, code, "v", everyone))]
    opts = PlanOptions(memory_budget=budget, max_gap_bytes=rng.choice([0, 16, 1 << 20]), max_peers=max_peers,
                       min_split_bytes=rng.choice([8, 64, 1 << 20]), ranks_per_node=rng.choice([0, 2, 3, 4]))
    full = build_plan(manifest, targets, opts)
    dests, fetched = simulate(full, files, world, targets, dtype)
    for r in range(world):
        for uid, spec in zip(full.rank_targets[r], targets[r]):
            assert torch.equal(dests[r].tensors[uid], _expected(originals[spec.key], spec)), (r, spec)
    check_read_once(fetched)
    check_staging_fits([full] * world, opts)
    fetched = check_per_rank_plans(manifest, files, targets, opts, full, dtype,
                                   lambda spec: _expected(originals[spec.key], spec))
    check_read_once(fetched)
    relayed = [r for r in full.reads if r.relay]
    if world > opts.relay_above:
        assert everyone <= bool(relayed)
    peers = defaultdict(set)  # (holder set, rank, round) -> its peers there
    for r in relayed:
        hops = hops_of(r, full.targets)
        held = ranks_of(r, full.targets)
        assert sorted(x for _, _, x, _ in hops) == sorted(set(held) - {r.reader})
        for d, a, b, _ in hops:
            peers[(held, a, r.round + d)].add(b)
            peers[(held, b, r.round + d)].add(a)
        if r.grid_nodes:  # with nodes: the piece crosses into each other node once
            per = opts.ranks_per_node
            entered = [b // per for _, a, b, _ in hops if a // per != b // per]
            assert sorted(entered) == sorted({x // per for x in held} - {r.reader // per})
    assert all(len(p) <= max_peers for p in peers.values())
    if everyone:
        for per in peers_per_round([full] * world, world).values():
            assert all(len(p) <= max(max_peers, min(world - 1, opts.relay_above - 1)) for p in per.values())


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 80), st.integers(2, 9), st.data())
def test_relay_tree_links_are_its_hops(n, fan, data):
    """Each rank's own part of a relay tree (what its schedule posts) is the tree's hops: every
    holder but the reader receives once, one level after its parent, and no rank has more
    than ``fan`` peers."""
    holders = sorted(data.draw(st.sets(st.integers(0, 200), min_size=n, max_size=n)))
    reader = data.draw(st.sampled_from(holders))
    hops = relay_hops(holders, reader, fan)
    from_links = []
    for x in holders:
        got, send = relay_links(holders, reader, fan, x)
        assert (got is None) == (x == reader)
        if send is not None:
            from_links += [(send[0], x, y) for y in send[1]]
            assert got is None or got[0] + 1 == send[0]
        assert (0 if got is None else 1) + (len(send[1]) if send else 0) <= fan
    assert sorted(from_links) == sorted(hops)
    assert sorted(y for _, _, y in hops) == sorted(set(holders) - {reader})


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 300), st.integers(2, 9), st.integers(0, 7), st.data())
def test_relay_grid_links_are_its_hops(n, max_peers, start, data):
    """A relay grid: exact sizes within ``max_peers + 1`` (or none: a tree then), every holder
    but the reader receives once and then sends at every later depth, each rank's links are
    the grid's hops, and in each round a rank exchanges only with the line of that round's
    dimension (at most ``max_peers`` ranks), whatever the piece's reader."""
    sizes = grid_shape(n, max_peers)
    if not sizes:
        assert any(n % q == 0 and all(q % f for f in range(2, q)) for q in range(max_peers + 2, n + 1))
        return
    assert math.prod(sizes) == n and max(sizes) <= max_peers + 1
    holders = sorted(data.draw(st.sets(st.integers(0, 400), min_size=n, max_size=n)))
    hops = {}
    for reader in data.draw(st.lists(st.sampled_from(holders), min_size=1, max_size=3)):
        mine = grid_hops(holders, reader, sizes, start)
        assert sorted(y for _, _, y in mine) == sorted(set(holders) - {reader})
        from_links = []
        for x in holders:
            got, sends = grid_links(holders, reader, sizes, start, x)
            assert (got is None) == (x == reader)
            from_links += [(d, x, y) for d, ys in sends for y in ys]
            assert all(got is None or d > got[0] for d, _ in sends)
        assert sorted(from_links) == sorted(mine)
        for d, a, b in mine:
            hops.setdefault((a, d), set()).add(b)
            hops.setdefault((b, d), set()).add(a)
    assert max(len(v) for v in hops.values()) <= max_peers


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(2, 8), st.integers(2, 9), st.integers(0, 7), st.data())
def test_node_grid_enters_each_node_once(nodes, per_node, max_peers, start, data):
    """With nodes known, a piece crosses into each other node once and fans out inside it;
    each rank's links are the grid's hops; no rank exceeds ``max_peers`` peers in a round."""
    used = sorted(data.draw(st.sets(st.integers(0, 40), min_size=nodes, max_size=nodes)))
    g = data.draw(st.integers(1, per_node))
    holders = [n * per_node + i for n in used for i in range(g)]
    sizes = node_grid(holders, max_peers, per_node)
    if not sizes:
        assert g < 2 or nodes < 2 or g > max_peers or not grid_shape(nodes, max_peers - g + 1)
        return
    assert sizes[0] == g and math.prod(sizes) == len(holders)
    hops = {}
    for reader in data.draw(st.lists(st.sampled_from(holders), min_size=1, max_size=3)):
        mine = grid_hops(holders, reader, sizes, start, True)
        assert sorted(y for _, _, y in mine) == sorted(set(holders) - {reader})
        entered = defaultdict(int)
        for d, a, b in mine:
            if a // per_node != b // per_node:
                entered[b // per_node] += 1
            hops.setdefault((a, d), set()).add(b)
            hops.setdefault((b, d), set()).add(a)
        assert set(entered.values()) <= {1} and reader // per_node not in entered
        links = [(d, x, y) for x in holders for d, ys in grid_links(holders, reader, sizes, start, x, True)[1]
                 for y in ys]
        assert sorted(links) == sorted(mine)
    assert max(len(v) for v in hops.values()) <= max_peers


def test_replicated_model_on_many_ranks_is_split_and_relayed():
    """The issue's case, small: 4 tensors of 64 KiB loaded whole on 32 ranks (max_peers 4,
    pieces of at least 8 KiB): every rank reads one piece (no byte twice), no rank exchanges
    with more than 4 ranks in a round, and no rank sends much more than a ring all-gather
    asks of each (the model less its own piece)."""
    world, n, per = 32, 16384, 4
    blob = b"".join(torch.arange(n * j, n * (j + 1), dtype=torch.float32).numpy().tobytes() for j in range(per))
    m = Manifest(tensors={f"t{j}": TensorMeta("F32", (n,), (Shard((0,), (n,), "f", j * n * 4, n * 4),))
                          for j in range(per)}, files={"f": len(blob)})
    targets = [[TargetSpec(f"t{j}", "F32", (n,), (0,), (n,)) for j in range(per)] for _ in range(world)]
    opts = PlanOptions(max_peers=4, min_split_bytes=8192)
    full = build_plan(m, targets, opts)
    assert sorted(r.reader for r in full.reads) == list(range(world))  # 32 pieces of 8 KiB, one per rank
    assert all(r.relay == 4 and r.length == 8192 for r in full.reads)
    fetched = check_per_rank_plans(m, {"f": blob}, targets, opts, full, torch.float32,
                                   lambda spec: torch.arange(n * int(spec.key[1:]), n * (int(spec.key[1:]) + 1),
                                                             dtype=torch.float32))
    check_read_once(fetched)
    assert sum(b - a for _, a, b in fetched) == len(blob)
    peers = peers_per_round([full] * world, world)
    assert max(len(p) for per_rank in peers.values() for p in per_rank.values()) <= 4
    sent = defaultdict(int)
    for r in full.reads:
        for d, a, b, _ in hops_of(r, full.targets):
            sent[a] += r.length
    assert max(sent.values()) <= 2 * len(blob)  # an all-gather: len(blob) - 8192 each; today's plan: 31 × 64 KiB


def test_one_rank_plan_from_gathered_pieces_builds_only_its_pp_stage():
    """A one-rank plan plans its own component of shared tensors (here its PP stage) and
    the ZeRO slices near its own, and builds only those targets: the rest of the world's
    stay unbuilt. It is the plan made from the plain lists, field for field."""
    from benchmarks.plan_equiv import _through_wire, signature
    from benchmarks.planner_bench import _stage, _weights, build_manifest, build_targets

    layers, ranks, rank = 16, 256, 5  # TP=4 × PP=16 × DP=4; rank 5: TP rank 1 of stage 1, DP rank 0
    manifest, targets = build_manifest(layers=layers), build_targets(ranks, layers=layers)
    plan = build_plan(manifest, _through_wire(targets), PlanOptions(), rank=rank)
    built = [t for t in plan.targets._built if t is not None]
    stage_of = {name: _stage(layer, 16, layers) for name, _, _, layer in _weights(layers)}
    assert {stage_of[t.spec.key.removeprefix("optim.exp_avg.")] for t in built} == {1}
    assert 0 < len(built) < len(plan.targets) // 10
    assert signature(plan) == signature(build_plan(manifest, targets, PlanOptions(), rank=rank))


# last: test_specwire imports this module's layouts, and names are looked up when called
import test_specwire  # noqa: E402
