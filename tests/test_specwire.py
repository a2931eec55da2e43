"""The compact exchange of target specs (``streamckpt.plan.specwire``).

Pure tests simulate every rank of the two all-gathers on random layouts: the
decoded lists equal the originals exactly (field by field, types included), plans
built from them equal plans built from the originals, and the bytes each rank
receives follow the distinct blobs, not ranks × specs. One gloo spawn runs
``comm.gather_targets`` for real (replicas, ZeRO slices, distinct layouts, an
empty rank, failures on one rank).
"""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamckpt.core import dtypes
from streamckpt.core.targets import TargetSpec
from streamckpt.errors import IncompatibleStateDictError
from streamckpt.plan import specwire
from streamckpt.plan.planner import PlanOptions, build_plan
from streamckpt.plan.specwire import SpecWireError

from distributed import run_ranks, run_scenarios
from test_plan import _make_checkpoint, _make_targets, _zero_targets


def simulate(lists: list[list[TargetSpec]], ranks: tuple[int, ...] | None = None,
             ) -> tuple[list[list[list[TargetSpec]]], specwire.Routing, int]:
    """Run the exchange as ``ranks`` (default: all) would: (their decoded lists, the routing,
    the bytes each rank receives from the two all-gathers)."""
    encs = [specwire.encode(s) for s in lists]
    heads = [e.header() for e in encs]
    routing = specwire.route([specwire.parse_header(h, r) for r, h in enumerate(heads)])
    payloads = [specwire.payload(routing, r, e) for r, e in enumerate(encs)]
    out = []
    for r in range(len(lists)) if ranks is None else ranks:
        e = encs[r]

        def gather(mine: bytes, r: int = r) -> list[bytes]:
            assert mine == payloads[r]
            return payloads
        out.append(specwire.exchange(e, heads, r, gather))
    received = len(lists) * (max(map(len, heads)) + max(map(len, payloads)))
    return out, routing, received


def exact(a: list[list[TargetSpec]], b: list[list[TargetSpec]]) -> None:
    """Equal, and of the same Python types (ints stay ints, ranges tuples, None stays None)."""
    assert a == b
    for la, lb in zip(a, b):
        for x, y in zip(la, lb):
            assert type(x) is TargetSpec
            assert [type(v) for v in x] == [type(v) for v in y]
            for fa, fb in zip(x[2:5], y[2:5]):
                assert all(type(v) is int for v in fa) and len(fa) == len(fb)
            assert x.flat_range is None or all(type(v) is int for v in x.flat_range)


# ----------------------------------------------------------------------------- round trips

ints = st.one_of(st.integers(0, 300), st.integers(0, 1 << 40), st.integers(-(1 << 63), (1 << 63) - 1))
dtype_codes = st.one_of(st.sampled_from(sorted(dtypes._build())), st.text(min_size=1, max_size=6))


@st.composite
def spec(draw) -> TargetSpec:
    nd = draw(st.integers(0, 4))
    dims = st.lists(ints, min_size=nd, max_size=nd).map(tuple)
    flat = draw(st.one_of(st.none(), st.tuples(ints, ints)))
    key = draw(st.text(alphabet=st.characters(exclude_categories=()), max_size=24))
    return TargetSpec(key, draw(dtype_codes), draw(dims), draw(dims), draw(dims), flat)


@st.composite
def layouts(draw) -> list[list[TargetSpec]]:
    """A few distinct lists, each held by several ranks, some with per-rank flat ranges."""
    pool = draw(st.lists(st.lists(spec(), max_size=6), min_size=1, max_size=4))
    world = draw(st.integers(1, 9))
    out = []
    for r in range(world):
        base = pool[draw(st.integers(0, len(pool) - 1))]
        if draw(st.booleans()):  # ZeRO-like: this rank's own flat ranges
            base = [s._replace(flat_range=(r, r + i + 1)) if i % 2 == 0 else s for i, s in enumerate(base)]
        out.append(list(base))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_every_rank_decodes_every_list_exactly(lists):
    decoded, routing, _ = simulate(lists)
    for got in decoded:
        exact(got, lists)
    encs = [specwire.encode(s) for s in lists]
    assert routing.width <= max(e.size for e in encs)  # never more than a padded gather of the encodings
    distinct = {s for e in encs for s in e.sections}
    assert sorted(n for _, n in routing.blobs) == sorted(map(len, distinct))


def test_edge_values_round_trip():
    lists = [[
        TargetSpec("", "F32", (), (), ()),
        TargetSpec("lone \ud800 surrogate · ünï", "weird dtype", (0,), (0,), (0,), (0, 0)),
        TargetSpec("k", "BF16", ((1 << 63) - 1,), (-(1 << 63),), (255,), ((1 << 63) - 1, 0)),
        TargetSpec("k", "BF16", (256, 65536, 1 << 32), (0, 0, 0), (255, 65535, (1 << 32) - 1)),
    ], []]
    decoded, _, _ = simulate(lists)
    exact(decoded[0], lists)
    exact(decoded[1], lists)


def test_replicas_send_once_and_received_bytes_follow_distinct_layouts():
    """DP replicas of one layout: each rank receives ~1/world of it per rank, plus headers."""
    layout = [TargetSpec(f"model.layers.{i}.mlp.w", "BF16", (4096, 1024), (0, 0), (4096, 1024)) for i in range(200)]
    one = specwire.encode(layout).size
    for world in (8, 64, 512):
        decoded, routing, received = simulate([layout] * world, ranks=(0, world - 1))
        assert decoded[0] == [layout] * world
        assert len(routing.blobs) == 3
        assert routing.width <= sum(-(-n // world) for _, n in routing.blobs)
        assert received <= one + world * (3 + len(specwire.encode(layout).header()))
        json_bytes = world * len(json.dumps({"targets": [s.to_json() for s in layout]}))
        assert received * 10 < json_bytes


def test_zero_slices_only_send_their_ranges():
    """ZeRO over DP: boxes and names are shared; each rank adds only its flat ranges."""
    world = 64
    base = [TargetSpec(f"optim.exp_avg.t{i}", "F32", (1000, 64), (0, 0), (1000, 64)) for i in range(50)]
    lists = []
    for r in range(world):
        step = math.ceil(64000 / world)
        lists.append([s._replace(flat_range=(r * step, (r + 1) * step)) for s in base])
    decoded, routing, received = simulate(lists)
    exact(decoded[5], lists)
    enc = specwire.encode(lists[0])
    names, boxes, flats = map(len, enc.sections)
    assert len(routing.blobs) == 2 + world
    assert routing.width <= flats + -(-names // world) + -(-boxes // world)
    assert received == world * (len(enc.header()) + routing.width)
    assert flats < 50 * 2 * 4 + 16  # two 4-byte integers per slice


def test_identical_lists_share_spec_objects():
    layout = [TargetSpec("a", "F32", (4,), (0,), (4,)), TargetSpec("b", "F32", (4,), (0,), (4,), (1, 3))]
    decoded, _, _ = simulate([layout, layout, list(layout)])
    got = decoded[0]
    assert got[0] is not got[1] and got[0][0] is got[1][0] and got[0][1] is got[2][1]


# ----------------------------------------------------------------------------- plans

def plan_signature(plan):
    reads = [(r.file, r.start, r.stop, r.reader, r.round, r.tag, r.private, r.staging,
              tuple((c.target, c.offset, c.length, c.src_dtype, c.src_shape, c.src_strides, c.dst_box, c.dst_base,
                     c.dst_frame, c.perm) for c in r.copies)) for r in plan.reads]
    return (reads, [(t.spec, t.needers) for t in plan.targets], plan.rank_targets, plan.missing, plan.unexpected,
            plan.num_rounds, plan.base_rounds, plan.edge_degree)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 5), st.sampled_from([64, 256, 1 << 20]), st.booleans())
def test_plans_from_decoded_specs_equal_plans_from_originals(seed, ndim, world, budget, zero):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 9) for _ in range(ndim))
    manifest, _, _ = _make_checkpoint(rng, shape)
    targets = (_zero_targets if zero else _make_targets)(rng, shape, world, "F32")
    decoded, _, _ = simulate(targets)
    opts = PlanOptions(memory_budget=budget)
    for ranks in decoded:
        assert ranks == targets
        for r in (None, *range(world)):
            assert plan_signature(build_plan(manifest, ranks, opts, rank=r)) == \
                plan_signature(build_plan(manifest, targets, opts, rank=r))


def test_planner_bench_layout_plans_equal():
    """The benchmark's 70B-like layout (2 layers, 128 ranks): TP × PP × DP with ZeRO slices."""
    from benchmarks.planner_bench import build_manifest, build_targets

    manifest = build_manifest(layers=2)
    targets = build_targets(128, layers=2)
    decoded, routing, received = simulate(targets)
    exact(decoded[77], targets)
    json_bytes = 128 * max(len(json.dumps({"targets": [s.to_json() for s in t]})) for t in targets)
    assert received * 4 < json_bytes
    for r in (0, 77, None):
        assert plan_signature(build_plan(manifest, decoded[0], rank=r)) == \
            plan_signature(build_plan(manifest, targets, rank=r))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad, match", [
    (TargetSpec("w", "F32", (4, 4), (0,), (4, 4)), "same number of dimensions"),
    (TargetSpec("w", "F32", (1 << 64,), (0,), (1,)), "64 bits"),
    (TargetSpec("w", "F32", (4.0,), (0,), (4,)), "integers"),
    (TargetSpec("w", "F32", (4,), (0,), (4,), (0, 1, 2)), "pair"),
])
def test_encode_rejects_specs_no_plan_can_use(bad, match):
    with pytest.raises(IncompatibleStateDictError, match=match):
        specwire.encode([TargetSpec("ok", "F32", (2,), (0,), (2,)), bad])


def test_malformed_headers_and_blobs_raise_clearly():
    enc = specwire.encode([TargetSpec("w", "F32", (4, 4), (0, 0), (2, 4), (1, 3))])
    head = enc.header()
    with pytest.raises(SpecWireError, match="header of rank 3 .*bytes, expected"):
        specwire.parse_header(head[:-1], 3)
    with pytest.raises(SpecWireError, match="version 9"):
        specwire.parse_header(head[:1] + bytes([9]) + head[2:], 1)
    routing = specwire.route([specwire.parse_header(head, 0)])
    good = specwire.payload(routing, 0, enc)
    bad = bytearray(good)
    bad[-1] ^= 1
    with pytest.raises(SpecWireError, match="digest differs"):
        specwire.assemble(routing, [bytes(bad)])
    names, boxes, flats = enc.sections
    for sections, match in [
        ((names[:-3], boxes, flats), "truncated"),
        ((names + b"\0", boxes, flats), "trailing"),
        ((names, boxes.replace(b"B", b"X", 1), flats), "section tag"),
        ((names, boxes, b"F" + bytes([2]) + flats[2:]), "wire version 2"),
        ((names, boxes, specwire.encode([]).sections[2]), "0 flat ranges for 1"),
    ]:
        forged = specwire.Encoded(sections)
        r = specwire.route([specwire.parse_header(forged.header(), 0)])
        with pytest.raises(SpecWireError, match=match):
            specwire.decode_all(r, specwire.assemble(r, [specwire.payload(r, 0, forged)]))


# ----------------------------------------------------------------------------- real ranks (gloo)

def _lists(world: int) -> dict[str, list[list[TargetSpec]]]:
    """Each scenario's spec list per rank, built alike on every rank and in the parent."""
    w = TargetSpec("w", "BF16", (64, 48), (0, 0), (64, 48))
    zero = [TargetSpec(f"opt.{i}", "F32", (10, 7), (0, 0), (10, 7)) for i in range(3)]
    return {
        "replicas": [[w, TargetSpec("b", "I64", (3,), (0,), (3,))] for _ in range(world)],
        "zero": [[w] + [z._replace(flat_range=(r * 18, min(70, (r + 1) * 18))) for z in zero] for r in range(world)],
        "distinct": [[TargetSpec("w", "F32", (64, 48), (r * 16, 0), (16, 48))] for r in range(world)],
        "empty_rank": [[w] if r != 1 else [] for r in range(world)],
    }


def _gather(rank: int, world: int, name: str, own: BaseException | None = None) -> list[list[list]]:
    from streamckpt.comm import make_comm
    from streamckpt.comm import gather_targets

    specs = _lists(world)[name][rank] if name in _lists(world) else [TargetSpec("w", "F32", (4, 4), (0,), (4, 4))]
    got = gather_targets(make_comm(None), specs, own)
    return [[s.to_json() for s in lst] for lst in got]


def gather_worker(rank: int, world: int) -> dict:
    from streamckpt.errors import MissingKeysError

    scenarios = [(n, lambda r, w, n=n: _gather(r, w, n)) for n in _lists(world)]
    scenarios += [
        ("own_error", lambda r, w: _gather(r, w, "replicas", MissingKeysError("no x here") if r == 2 else None)),
        ("encode_error", lambda r, w: _gather(r, w, "bad dims" if r == 1 else "zero")),
        ("after_errors", lambda r, w: _gather(r, w, "zero")),
    ]
    return run_scenarios(rank, world, scenarios)


def test_gather_targets_on_gloo_ranks():
    world = 4
    results = run_ranks(world, gather_worker, timeout=120, pg_timeout=30)
    by_rank = [r.unwrap() for r in results]
    expected = {n: [[s.to_json() for s in lst] for lst in v] for n, v in _lists(world).items()}
    expected["after_errors"] = expected["zero"]
    for name, want in expected.items():
        for r in range(world):
            assert by_rank[r][name].get("value") == want, (name, r, by_rank[r][name])
    for r in range(world):
        err = by_rank[r]["own_error"]["error"]
        assert err["cls"] == "MissingKeysError" and ("rank 2 failed: no x here" in err["msg"] or r == 2), err
        err = by_rank[r]["encode_error"]["error"]
        assert err["cls"] == "IncompatibleStateDictError", err
        assert "same number of dimensions" in err["msg"] and (r == 1 or "rank 1 failed" in err["msg"]), err
