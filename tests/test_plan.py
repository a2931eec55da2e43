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
    """Run each rank's schedule from its own plan; sends and receives must pair up
    exactly (round, peers, tag, size, order) as gloo would match them."""
    dests = []
    for r in range(world):
        tensors = {}
        for uid, spec in zip(plans[r].rank_targets[r], targets_by_rank[r]):
            shape = spec.shape if spec.flat_range is None else (spec.numel,)
            tensors[uid] = torch.full(shape, -7, dtype=dtype)
        dests.append(Destinations(tensors))
    sent = defaultdict(list)  # (round, src, dst) -> [(tag, size)]
    posted = defaultdict(list)
    fetched = []
    for r in range(world):
        for k, rnd in enumerate(local_schedule(plans[r], r)):
            for m in rnd.recvs:
                read = plans[r].reads[m.read_index]
                posted[(k, m.peer, r)].append((read.tag, message_size(m.copies)))
            for i, read in rnd.reads:
                data = files[read.file][read.start:read.stop]
                fetched.append((read.file, read.start, read.stop))
                staged = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                for c in read.copies:
                    if c.target in dests[r].tensors:
                        dests[r].apply(staged[c.offset:], c)
                for m in rnd.sends:
                    if m.read_index != i:
                        continue
                    msg = _message(staged, m.copies)
                    sent[(k, r, m.peer)].append((read.tag, msg.numel()))
                    unpack_message(msg, m.copies, dests[m.peer])
    assert dict(sent) == dict(posted)
    return dests, fetched


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
        unit = LocalRound(reads=[(i, r)], sends=[m for m in rnd.sends if m.read_index == i])
        out.append((ranks_of(r, plan.targets) if edge else None, unit))
    for m in rnd.recvs:
        r = plan.reads[m.read_index]
        out.append((ranks_of(r, plan.targets) if edge else None, LocalRound(recvs=[m])))
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
