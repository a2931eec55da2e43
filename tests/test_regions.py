"""Property tests for the pure geometry in streamckpt.core.regions."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamckpt.core.regions import (
    Box, CoalesceOptions, coalesce, flat_range_bounding_box, flat_range_boxes, intersect, max_gap,
    cut_pieces, runs, span, split_for_span,
)


@st.composite
def frame_and_sub(draw, max_ndim=4, max_dim=7):
    ndim = draw(st.integers(1, max_ndim))
    shape = tuple(draw(st.integers(1, max_dim)) for _ in range(ndim))
    offset = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    frame = Box(offset, shape)
    sub_off, sub_shape = [], []
    for o, s in zip(offset, shape):
        lo = draw(st.integers(0, s - 1))
        hi = draw(st.integers(lo + 1, s))
        sub_off.append(o + lo)
        sub_shape.append(hi - lo)
    return frame, Box(tuple(sub_off), tuple(sub_shape))


def _frame_tensor(frame: Box) -> torch.Tensor:
    return torch.arange(frame.numel).reshape(frame.shape)


@settings(max_examples=200, deadline=None)
@given(frame_and_sub(), st.data())
def test_flat_range_boxes_tile_the_range_in_order(fs, data):
    frame, _ = fs
    n = frame.numel
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    parts = flat_range_boxes(frame, a, b)
    assert len(parts) <= 2 * frame.ndim - 1 if frame.ndim else 1
    ref = _frame_tensor(frame)
    got = []
    expected_start = a
    for flat_start, box in parts:
        assert flat_start == expected_start
        rel = box.relative_to(frame)
        vals = ref[rel.slices()].reshape(-1)
        # each part is contiguous in row-major order and starts where claimed
        assert vals.tolist() == list(range(flat_start, flat_start + box.numel))
        expected_start += box.numel
        got.extend(vals.tolist())
    assert got == list(range(a, b))
    if b > a:
        bb = flat_range_bounding_box(frame, a, b)
        assert all(bb.contains(box) for _, box in parts)


@settings(max_examples=200, deadline=None)
@given(frame_and_sub())
def test_runs_and_span_match_tensor_indexing(fs):
    frame, sub = fs
    ref = _frame_tensor(frame)
    expected = ref[sub.relative_to(frame).slices()].reshape(-1).tolist()
    got = [i for start, n in runs(frame, sub) for i in range(start, start + n)]
    assert got == expected
    lo, hi = span(frame, sub)
    assert lo == expected[0] and hi == expected[-1] + 1
    # as_strided over the span reproduces the sub-box (what the pipeline does)
    flat = ref.reshape(-1)[lo:hi]
    strided = flat.as_strided(sub.shape, ref.stride(), flat.storage_offset())
    assert strided.reshape(-1).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(frame_and_sub(), st.integers(0, 3), st.integers(1, 60))
def test_cut_and_split_pieces_tile_the_sub_box(fs, cut, max_elems):
    frame, sub = fs
    cut = min(cut, sub.ndim - 1)
    seen = torch.zeros(frame.shape, dtype=torch.int32)
    for piece in cut_pieces(frame, sub, cut):
        assert max_gap(frame, piece, 0) <= max_gap(frame, sub, 0)
        for p in split_for_span(frame, piece, max_elems):
            lo, hi = span(frame, p)
            assert hi - lo <= max_elems or all(s == 1 for s in p.shape[:-1])
            seen[p.relative_to(frame).slices()] += 1
    mask = torch.zeros_like(seen)
    mask[sub.relative_to(frame).slices()] = 1
    assert torch.equal(seen, mask)


def _joins(ranges, members):
    """``(gap, end)`` of every place a request bridges a gap (its next range does not overlap).

    Overlapping ranges always merge whatever their size; only these joins are bound by
    the request cap and the gap limits.
    """
    ordered = sorted(ranges[i] for i in members)
    out = []
    ce = ordered[0][1]
    for s, e in ordered[1:]:
        if s >= ce:
            out.append((s - ce, e))
        ce = max(ce, e)
    return out


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 200)), min_size=1, max_size=30),
       st.integers(0, 100), st.integers(50, 500), st.integers(0, 64))
def test_coalesce_covers_every_range_once_within_limits(raw, gap, max_req, small_gap):
    ranges = [(s, s + n) for s, n in raw]
    opts = CoalesceOptions(max_gap_bytes=gap, max_request_bytes=max_req, small_gap_bytes=small_gap)
    out = coalesce(ranges, opts)
    members = sorted(i for _, _, m in out for i in m)
    assert members == list(range(len(ranges)))
    for start, stop, m in out:
        assert start == min(ranges[i][0] for i in m) and stop == max(ranges[i][1] for i in m)
        for bridged, end in _joins(ranges, m):
            # the request as it stood when it bridged the gap stays within the cap
            assert end - start <= max_req, (start, stop, [ranges[i] for i in m])
            assert bridged <= max(gap, small_gap)
    # requests never overlap each other
    spans = sorted((s, e) for s, e, _ in out)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_coalesce_caps_requests_but_never_cuts_a_range():
    opts = CoalesceOptions(max_gap_bytes=100, max_request_bytes=50)
    # touching ranges merge only while the request stays within 50 bytes
    assert coalesce([(0, 30), (30, 50), (50, 60)], opts) == [(0, 50, [0, 1]), (50, 60, [2])]
    assert coalesce([(0, 30), (35, 60)], opts) == [(0, 30, [0]), (35, 60, [1])]
    # one range longer than the cap is one request; overlapping ranges always merge
    assert coalesce([(0, 410)], opts) == [(0, 410, [0])]
    assert coalesce([(0, 40), (20, 90)], opts) == [(0, 90, [0, 1])]


def test_intersect_basic():
    assert intersect(Box((0, 0), (4, 4)), Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert intersect(Box((0,), (4,)), Box((4,), (2,))) is None
    assert math.prod(Box((), ()).shape) == 1
