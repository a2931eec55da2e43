"""Every rank's specs as gathered pieces (``streamckpt.plan.gathered``).

``GatheredSpecs.distinct`` (numpy over the pieces) must give exactly what the
plain ``dedupe`` gives on the decoded lists: the same ids in the same order, the
same holders, and the same sharing of holder lists (the planner compares them
by identity). Pure.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamckpt.core.targets import TargetSpec
from streamckpt.plan import specwire
from streamckpt.plan.gathered import GatheredSpecs, dedupe, distinct

from test_specwire import layouts, simulate


def same_distinct(a, b) -> None:
    assert a.specs == b.specs
    assert [type(s) for s in a.specs] == [type(s) for s in b.specs]
    assert a.needers == b.needers
    assert a.rank_targets == b.rank_targets
    assert sorted(a.several) == sorted(b.several)
    # holder lists shared alike: one object per equal list of several ranks, one per rank for single holders
    pairs = {}
    for x, y in zip(a.needers, b.needers):
        assert pairs.setdefault(id(x), id(y)) == id(y)
    assert len(set(pairs.values())) == len(pairs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.randoms())
def test_distinct_from_pieces_equals_dedupe_of_lists(lists, rnd):
    if lists and rnd.random() < 0.5:  # a rank holding a spec twice, and an empty rank
        r = rnd.randrange(len(lists))
        lists[r] = lists[r] + lists[r][:1]
        lists.append([])
    (got,), _, _ = simulate(lists, ranks=(0,))
    assert isinstance(got, GatheredSpecs)
    same_distinct(got.distinct(), dedupe(lists))
    same_distinct(distinct(got), distinct(lists))


def test_planner_bench_layout_distinct():
    from benchmarks.planner_bench import build_targets

    targets = build_targets(256, layers=3)
    (got,), _, _ = simulate(targets, ranks=(5,))
    d = got.distinct()
    same_distinct(d, dedupe(targets))
    assert len(d.specs) < sum(map(len, targets))


def test_gathered_specs_read_like_lists():
    base = [TargetSpec("a", "F32", (4,), (0,), (4,)), TargetSpec("b", "F32", (8,), (0,), (8,), (0, 4))]
    lists = [base, [base[0], base[1]._replace(flat_range=(4, 8))], []]
    (got,), _, _ = simulate(lists, ranks=(1,))
    assert len(got) == 3 and got == lists and list(got) == lists and got[-1] == [] and got[1:] == lists[1:]
    assert got != lists[:2] and got != [[], [], []]
    mine = got[0]
    mine.clear()  # a rank's list is the caller's own copy
    assert got[0] == base
    assert "3 ranks" in repr(got)
    empty = specwire.decode_all(specwire.route([]), [])
    assert len(empty) == 0 and empty.distinct().specs == []


class _Tensor:
    def __init__(self, spec: TargetSpec) -> None:
        self.shape, self.dtype = spec.global_shape, spec.dtype


class _View:
    """Some of the layouts' keys, each with the dtype and shape of one of its specs."""

    transformed = False

    def __init__(self, lists, rnd) -> None:
        specs = [s for specs in lists for s in specs]
        rnd.shuffle(specs)
        self.tensors = {s.key: _Tensor(s) for s in specs if rnd.random() < 0.8}
        for t in self.tensors.values():
            if rnd.random() < 0.2:
                t.dtype = "X"  # no spec of the key has it: the first of the key's kinds raises


def _census_or_error(distinct, view):
    from streamckpt.plan.planner import _census

    try:
        c = _census(distinct, view)
    except Exception as e:  # both must raise the same error
        return type(e).__name__, str(e)
    return c.by_key, list(c.by_key), c.dead, c.replicated


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.randoms())
def test_census_from_kinds_equals_census_of_lists(lists, rnd):
    names = {}  # few keys, so that keys repeat with other dtypes and shapes
    lists = [[s._replace(key=names.setdefault(s.key, rnd.choice("abc"))) for s in specs] for specs in lists]
    (got,), _, _ = simulate(lists, ranks=(0,))
    d = got.distinct()
    assert d.kinds is not None
    view = _View(lists, rnd)
    assert _census_or_error(d, view) == _census_or_error(dedupe(lists), view)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 3), min_size=1, max_size=40), st.randoms())
def test_equal_rows_groups_rows_like_numpy_unique(width, picks, rnd):
    import numpy as np

    from streamckpt.plan.gathered import _equal_rows

    pool = np.array([[rnd.randrange(-(1 << 62), 1 << 62) for _ in range(width)] for _ in range(4)], dtype=np.int64)
    rows = pool[picks]
    reps, which = _equal_rows(rows)
    assert (reps[which.reshape(-1)] == rows).all()
    assert len(reps) == len(np.unique(rows, axis=0))


@given(st.lists(st.integers(-5, 5), max_size=30))
def test_unique_is_numpy_unique(values):
    import numpy as np

    from streamckpt.plan.gathered import unique

    arr = np.array(values, dtype=np.int64)
    got = unique(arr)
    want = np.unique(arr, return_index=True, return_inverse=True)
    for g, w in zip(got, want):
        assert g.tolist() == w.reshape(-1).tolist()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.randoms())
def test_route_headers_equals_route_of_parsed_headers(lists, rnd):
    if rnd.random() < 0.3:  # a rank whose sections are equal blobs (empty names, boxes, flats alike)
        lists.append([])
    heads = [specwire.encode(s).header() for s in lists]
    want = specwire.route([specwire.parse_header(h, r) for r, h in enumerate(heads)])
    got = specwire.route_headers(heads)
    assert (got.blobs, got.of_rank, got.parts, got.sends) == (want.blobs, want.of_rank, want.parts, want.sends)
    assert all(type(p) is specwire.Part for ps in got.parts for p in ps)
    assert got.width == want.width


def test_route_headers_names_the_rank_of_a_bad_header():
    import pytest

    heads = [specwire.encode([TargetSpec("a", "F32", (4,), (0,), (4,))]).header()] * 3
    with pytest.raises(specwire.SpecWireError, match="header of rank 2") as short:
        specwire.route_headers(heads[:2] + [heads[2][:-1]])
    assert "61 bytes, expected 62" in str(short.value)
    with pytest.raises(specwire.SpecWireError, match="header of rank 1.*version 9"):
        specwire.route_headers([heads[0], heads[1][:1] + bytes([9]) + heads[1][2:], heads[2]])
    assert specwire.route_headers([]) == specwire.route([])


def test_lazy_holder_lists_are_the_iterated_ones():
    from benchmarks.planner_bench import build_targets

    targets = build_targets(128, layers=3)
    (got,), _, _ = simulate(targets, ranks=(0,))
    d = got.distinct()
    some = [0, 5, len(d.needers) - 1, -1, 17]
    picked = [d.needers[u] for u in some]  # made one by one, before any iteration
    every = list(d.needers)
    assert all(x is every[u] for x, u in zip(picked, some))
    assert d.needers[0:3] == every[0:3] and len(d.needers) == len(every)
    mine = d.rank_targets[3]
    assert mine is d.rank_targets[3] and mine == list(d.rank_targets)[3] == dedupe(targets).rank_targets[3]
    assert d.rank_targets[-1] == dedupe(targets).rank_targets[-1]
    assert sorted(d.rank_targets.ids_of([3, 1]).tolist()) == sorted(d.rank_targets[3] + d.rank_targets[1])
