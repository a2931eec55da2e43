"""Transforms: every rule and chains of rules checked against a slow torch reference.

For each case the test builds real tensors, computes the transformed tensors with plain
torch ops (cat, split, permute, the q/k/v interleave), then for many random target boxes
assembles the box from the source segments that ``View.map_box`` returns and compares
element by element. Segments must tile the box exactly once.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamckpt.transforms
from streamckpt import TransformError
from streamckpt.core.dtypes import to_code, to_torch
from streamckpt.core.regions import Box
from streamckpt.transforms import (
    SourceSegment,
    Transforms,
    View,
    ViewTensor,
    as_transforms,
    identity_view,
    parse_dtype,
    presets,
)

CONFIGS = Path(streamckpt.transforms.__file__).resolve().parent / "presets"  # configs/transforms links here
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def spec(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(t.shape), to_code(t.dtype)) for n, t in tensors.items()}


def numbered(shape: tuple[int, ...], start: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose elements are distinct (so any misplaced element is caught)."""
    return (torch.arange(math.prod(shape), dtype=torch.float64) + start).reshape(shape).to(dtype)


def assemble(view: View, name: str, box: Box, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """Build ``box`` of view tensor ``name`` from the segments, checking exact tiling."""
    vt = view.tensors[name]
    segs = view.map_box(name, box)
    out = torch.zeros(box.shape, dtype=to_torch(vt.dtype))
    hits = torch.zeros(box.shape, dtype=torch.int32)
    for seg in segs:
        assert isinstance(seg, SourceSegment)
        src = sources[seg.source_key]
        assert to_code(src.dtype) == vt.source_dtype
        piece = src[seg.source_box.slices()]
        if seg.perm is not None:
            piece = piece.permute(seg.perm)
        assert tuple(piece.shape) == seg.target_box.shape
        rel = seg.target_box.relative_to(box).slices()
        out[rel] = piece.to(out.dtype)
        hits[rel] += 1
    if box.numel:
        assert bool((hits == 1).all()), f"segments of {name} do not tile {box} exactly once"
    else:
        assert segs == []
    return out


def check_view(view: View, reference: dict[str, torch.Tensor], sources: dict[str, torch.Tensor],
               boxes: int = 0, rng: random.Random | None = None) -> None:
    """The view's names/shapes/dtypes equal the reference; whole tensors and random boxes match."""
    assert set(view.tensors) == set(reference)
    for name, ref in reference.items():
        vt = view.tensors[name]
        assert vt.shape == tuple(ref.shape), name
        assert vt.dtype == to_code(ref.dtype), name
        full = Box((0,) * ref.dim(), tuple(ref.shape))
        assert torch.equal(assemble(view, name, full, sources), ref), name
        for _ in range(boxes):
            box = random_box(rng or random.Random(0), tuple(ref.shape))
            assert torch.equal(assemble(view, name, box, sources), ref[box.slices()]), (name, box)


def random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    off, shp = [], []
    for n in shape:
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        off.append(lo)
        shp.append(hi - lo)
    return Box(tuple(off), tuple(shp))


def boxes_of(shape: tuple[int, ...]) -> st.SearchStrategy[Box]:
    def dim(n: int) -> st.SearchStrategy[tuple[int, int]]:
        return st.integers(0, n).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(0, n - lo)))

    return st.tuples(*[dim(n) for n in shape]).map(
        lambda ds: Box(tuple(d[0] for d in ds), tuple(d[1] for d in ds))
    )


def qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, g: int, dim: int) -> torch.Tensor:
    """The grouped interleave [q-heads of group 0, k0, v0, q-heads of group 1, ...] with torch ops."""
    hd = q.shape[dim] // h
    per = h // g
    qs = q.split(per * hd, dim)
    ks = k.split(hd, dim)
    vs = v.split(hd, dim)
    return torch.cat([t for grp in range(g) for t in (qs[grp], ks[grp], vs[grp])], dim)


# --------------------------------------------------------------------------- a slow reference


def _ref_regex(pattern: str) -> tuple[re.Pattern[str], list[str]]:
    out, names, pos = "", [], 0
    for m in re.finditer(r"\{(\w+)\}|\*", pattern):
        out += re.escape(pattern[pos:m.start()])
        pos = m.end()
        if m.group(0) == "*":
            out += r"([^.]*)"
        elif m.group(1) in names:
            out += rf"(?P={m.group(1)})"
        else:
            out += rf"(?P<{m.group(1)}>\d+)"
            names.append(m.group(1))
    return re.compile(out + re.escape(pattern[pos:])), names


def _ref_fill(pattern: str, binds: dict[str, str], stars: list[str]) -> str:
    it = iter(stars)
    return re.sub(r"\{(\w+)\}|\*", lambda m: next(it) if m.group(0) == "*" else binds[m.group(1)], pattern)


def reference(rules: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply rules to real tensors with torch ops (no optimizer-state following)."""
    view = dict(tensors)
    for rule in rules:
        (kind, body), = rule.items()
        first = body["from"] if "from" in body else body["key"]
        pats = first if isinstance(first, list) else [first]
        rx, _ = _ref_regex(pats[0])
        new: dict[str, torch.Tensor] = {}
        gone: set[str] = set()
        for name in sorted(view):
            m = rx.fullmatch(name)
            if not m:
                continue
            binds = {k: v for k, v in m.groupdict().items()}
            stars = [g for i, g in enumerate(m.groups(), 1) if i not in m.re.groupindex.values()]
            srcs = [_ref_fill(p, binds, stars) for p in pats]
            to = body.get("to", pats[0])
            dsts = [_ref_fill(p, binds, stars) for p in (to if isinstance(to, list) else [to])]
            ts = [view[s] for s in srcs]
            gone.update(srcs)
            dim = body.get("dim", 0)
            if kind == "rename":
                outs = ts
            elif kind == "fuse":
                outs = [torch.cat(ts, dim)]
            elif kind == "fuse_qkv":
                outs = [qkv_reference(*ts, body["num_heads"], body["num_kv_heads"], dim)]
            elif kind == "split":
                sizes = body.get("sizes") or [ts[0].shape[dim] // len(dsts)] * len(dsts)
                outs = list(ts[0].split(sizes, dim))
            elif kind == "split_qkv":
                h, g = body["num_heads"], body["num_kv_heads"]
                hd = ts[0].shape[dim] // (h + 2 * g)
                blocks = ts[0].split([(h // g) * hd, hd, hd] * g, dim)
                outs = [torch.cat(blocks[i::3], dim) for i in range(3)]
            elif kind == "transpose":
                outs = [ts[0].permute(body.get("dims", [1, 0])).contiguous()]
            elif kind == "cast":
                outs = [ts[0].to(to_torch(parse_dtype(body["dtype"])))]
            else:
                outs = []
            new.update(zip(dsts, outs))
        for g in gone:
            view.pop(g)
        view.update(new)
    return view


def run_case(rules: list[dict[str, Any]], tensors: dict[str, torch.Tensor], boxes: int = 25,
             seed: int = 0) -> View:
    view = Transforms.from_rules(rules).apply(spec(tensors))
    check_view(view, reference(rules, tensors), tensors, boxes, random.Random(seed))
    return view


# --------------------------------------------------------------------------- every rule


def test_identity_view_maps_boxes_to_themselves() -> None:
    tensors = {"a": numbered((5, 3)), "b": numbered((), 7), "c": numbered((4,), 9, torch.int64)}
    view = identity_view(spec(tensors))
    check_view(view, tensors, tensors, boxes=10)
    seg, = view.map_box("a", Box((1, 1), (3, 2)))
    assert seg == SourceSegment("a", Box((1, 1), (3, 2)), Box((1, 1), (3, 2)), None)
    assert view.is_identity("a") and view.sources("a") == ["a"]


def test_rename_with_layer_placeholder_over_several_layers() -> None:
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": numbered((4, 6), 100 * i) for i in range(12)}
    tensors["model.norm.weight"] = numbered((6,))
    rules = [{"rename": {"from": "model.layers.{i}.mlp.down_proj.weight", "to": "layers.{i}.ffn.w2.weight"}}]
    view = run_case(rules, tensors)
    assert "layers.11.ffn.w2.weight" in view.tensors and "model.norm.weight" in view.tensors
    assert view.sources("layers.11.ffn.w2.weight") == ["model.layers.11.mlp.down_proj.weight"]


def test_placeholder_binds_same_value_on_both_sides_and_twice_in_one_name() -> None:
    tensors = {"b.1.x.1": numbered((2,)), "b.1.x.2": numbered((2,), 5), "b.10.x.10": numbered((3,), 9)}
    view = Transforms.from_rules([{"rename": {"from": "b.{i}.x.{i}", "to": "c.{i}"}}]).apply(spec(tensors))
    assert set(view.tensors) == {"c.1", "c.10", "b.1.x.2"}
    assert view.sources("c.10") == ["b.10.x.10"]


def test_star_matches_within_one_component_and_carries_to_the_other_side() -> None:
    tensors = {"enc.attn.w": numbered((2, 2)), "enc.mlp.w": numbered((2, 2), 4),
               "enc.deep.mlp.w": numbered((2, 2), 8)}
    view = run_case([{"rename": {"from": "enc.*.w", "to": "dec.*.weight"}}], tensors)
    assert set(view.tensors) == {"dec.attn.weight", "dec.mlp.weight", "enc.deep.mlp.w"}


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_fuse_three_tensors(dim: int) -> None:
    shapes = [(3, 4), (5, 4), (2, 4)] if dim == 0 else [(4, 3), (4, 5), (4, 2)]
    tensors = {f"p{j}": numbered(s, 100 * j) for j, s in enumerate(shapes)}
    run_case([{"fuse": {"from": ["p0", "p1", "p2"], "to": "fused", "dim": dim}}], tensors, boxes=60)


@given(box=boxes_of((22, 3)))
@HYP
def test_fuse_hypothesis_boxes(box: Box) -> None:
    tensors = {"a": numbered((7, 3)), "b": numbered((11, 3), 50), "c": numbered((4, 3), 90)}
    rules = [{"fuse": {"from": ["a", "b", "c"], "to": "abc", "dim": 0}}]
    view = Transforms.from_rules(rules).apply(spec(tensors))
    ref = torch.cat([tensors["a"], tensors["b"], tensors["c"]], 0)
    assert torch.equal(assemble(view, "abc", box, tensors), ref[box.slices()])


@pytest.mark.parametrize("h,g,dim", [(8, 2, 0), (8, 8, 0), (8, 1, 0), (4, 2, 1), (6, 3, 0)])
def test_fuse_qkv_matches_torch_reference(h: int, g: int, dim: int) -> None:
    hd, hidden = 3, 5
    shape = (lambda rows: (rows, hidden)) if dim == 0 else (lambda rows: (hidden, rows))
    tensors = {"q": numbered(shape(h * hd)), "k": numbered(shape(g * hd), 1000),
               "v": numbered(shape(g * hd), 2000)}
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": h,
                           "num_kv_heads": g, "dim": dim}}]
    view = run_case(rules, tensors, boxes=60)
    assert view.tensors["wqkv"].shape == shape((h + 2 * g) * hd)


@given(box=boxes_of((24, 4)))
@HYP
def test_fuse_qkv_hypothesis_boxes(box: Box) -> None:
    # num_heads=8, num_kv_heads=2, head_dim=2 -> 16 + 4 + 4 rows
    tensors = {"q": numbered((16, 4)), "k": numbered((4, 4), 500), "v": numbered((4, 4), 900)}
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": 8, "num_kv_heads": 2}}]
    view = Transforms.from_rules(rules).apply(spec(tensors))
    ref = qkv_reference(tensors["q"], tensors["k"], tensors["v"], 8, 2, 0)
    assert torch.equal(assemble(view, "wqkv", box, tensors), ref[box.slices()])


def test_fuse_qkv_tp_slice_reads_only_its_rows_of_q_k_v() -> None:
    # 8 q heads, 2 kv groups, head_dim 2: a TP=2 rank holds one group = rows [12, 24)
    tensors = {"q": numbered((16, 4)), "k": numbered((4, 4), 500), "v": numbered((4, 4), 900)}
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": 8, "num_kv_heads": 2}}]
    view = Transforms.from_rules(rules).apply(spec(tensors))
    segs = view.map_box("wqkv", Box((12, 0), (12, 4)))
    assert [(s.source_key, s.source_box) for s in segs] == [
        ("q", Box((8, 0), (8, 4))), ("k", Box((2, 0), (2, 4))), ("v", Box((2, 0), (2, 4))),
    ]
    assert [s.target_box for s in segs] == [Box((12, 0), (8, 4)), Box((20, 0), (2, 4)), Box((22, 0), (2, 4))]


@pytest.mark.parametrize("sizes", [None, [1, 4, 2]])
def test_split_equal_and_sized(sizes: list[int] | None) -> None:
    tensors = {"w": numbered((6, 7) if sizes is None else (4, 7))}
    dim = 0 if sizes is None else 1
    body: dict[str, Any] = {"from": "w", "to": ["a", "b", "c"], "dim": dim}
    if sizes:
        body["sizes"] = sizes
    view = run_case([{"split": body}], tensors, boxes=40)
    assert view.sources("a") == ["w"]


def test_split_qkv_inverts_fuse_qkv() -> None:
    tensors = {"wqkv": numbered((24, 3))}
    rules = [{"split_qkv": {"from": "wqkv", "to": ["q", "k", "v"], "num_heads": 8, "num_kv_heads": 2}}]
    view = run_case(rules, tensors, boxes=30)
    assert view.tensors["q"].shape == (16, 3) and view.tensors["k"].shape == (4, 3)


@pytest.mark.parametrize("dims", [[1, 0], [2, 0, 1], [0, 2, 1]])
def test_transpose(dims: list[int]) -> None:
    tensors = {"w": numbered((3, 4) if len(dims) == 2 else (2, 3, 4))}
    view = run_case([{"transpose": {"from": "w", "to": "wt", "dims": dims}}], tensors, boxes=40)
    seg, = view.map_box("wt", Box((0,) * len(dims), view.tensors["wt"].shape))
    assert seg.perm == tuple(dims)


def test_transpose_key_in_place_defaults_to_swap_of_two_dims() -> None:
    tensors = {"lm_head.weight": numbered((3, 5))}
    run_case([{"transpose": {"key": "lm_head.weight"}}], tensors)


def test_cast_changes_dtype_not_source_dtype() -> None:
    tensors = {"a.norm.weight": numbered((4,), 0, torch.bfloat16), "b.norm.weight": numbered((4,), 4, torch.bfloat16),
               "c.other": numbered((4,), 0, torch.bfloat16)}
    view = run_case([{"cast": {"key": "*.norm.weight", "dtype": "float32"}}], tensors)
    assert view.tensors["a.norm.weight"] == ViewTensor((4,), "F32", "BF16")
    assert view.tensors["c.other"] == ViewTensor((4,), "BF16", "BF16")
    assert not view.is_identity("a.norm.weight") and view.is_identity("c.other")


def test_drop() -> None:
    tensors = {f"l.{i}.rotary_emb.inv_freq": numbered((4,)) for i in range(3)} | {"w": numbered((2,))}
    view = run_case([{"drop": {"key": "l.{i}.rotary_emb.inv_freq"}}], tensors)
    assert set(view.tensors) == {"w"}


#: Split ``w`` on dim 1 into ``a`` and ``b``, transpose both, cast both to fp32 (also used
#: end to end by test_transforms_e2e.py).
SPLIT_TRANSPOSE_CAST = [
    {"split": {"from": "w", "to": ["a", "b"], "dim": 1}},
    {"transpose": {"from": "a", "dims": [1, 0]}},
    {"transpose": {"from": "b", "dims": [1, 0]}},
    {"cast": {"key": "a", "dtype": "float32"}},
    {"cast": {"key": "b", "dtype": "float32"}},
]


def test_issue_example_split_transpose_cast() -> None:
    """2x2 fp16 [[0,1],[2,3]] split on dim 1, transposed to 1x2, cast to fp32: [[0,2]], [[1,3]]."""
    tensors = {"w": torch.tensor([[0, 1], [2, 3]], dtype=torch.float16)}
    view = Transforms.from_rules(SPLIT_TRANSPOSE_CAST).apply(spec(tensors))
    a = assemble(view, "a", Box((0, 0), (1, 2)), tensors)
    b = assemble(view, "b", Box((0, 0), (1, 2)), tensors)
    assert a.dtype == torch.float32 and a.tolist() == [[0.0, 2.0]] and b.tolist() == [[1.0, 3.0]]


# --------------------------------------------------------------------------- chains


def test_chain_fuse_transpose_resplit_cast() -> None:
    tensors = {"x": numbered((3, 5), 0, torch.float16), "y": numbered((4, 5), 100, torch.float16)}
    rules = [
        {"fuse": {"from": ["x", "y"], "to": "xy", "dim": 0}},            # (7, 5)
        {"transpose": {"from": "xy", "to": "xyt"}},                      # (5, 7)
        {"split": {"from": "xyt", "to": ["l", "r"], "dim": 1, "sizes": [2, 5]}},  # straddles x|y
        {"cast": {"key": "r", "dtype": "float32"}},
        {"fuse": {"from": ["r", "r"], "to": "rr", "dim": 0}},            # same source twice
    ]
    run_case(rules, tensors, boxes=60)


def _raise_dtype_mix(tensors: dict[str, torch.Tensor]) -> None:
    rules = [{"cast": {"key": "x", "dtype": "float32"}}, {"fuse": {"from": ["x", "y"], "to": "xy", "dim": 0}}]
    Transforms.from_rules(rules).apply(spec(tensors))


def test_chain_fuse_qkv_then_transpose_then_fuse_on_other_dim() -> None:
    tensors = {"q": numbered((8, 3)), "k": numbered((4, 3), 300), "v": numbered((4, 3), 600),
               "extra": numbered((3, 16), 900)}
    rules = [
        {"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": 4, "num_kv_heads": 2}},  # (16, 3)
        {"transpose": {"from": "wqkv", "to": "t"}},                                                 # (3, 16)
        {"fuse": {"from": ["t", "extra"], "to": "big", "dim": 0}},                                  # (6, 16)
        {"split": {"from": "big", "to": ["top", "bottom"], "dim": 0, "sizes": [4, 2]}},
        {"transpose": {"from": "top", "to": "top_t"}},                                              # (16, 4)
    ]
    run_case(rules, tensors, boxes=80)


def test_fuse_then_split_at_the_same_boundaries_gives_single_segments() -> None:
    tensors = {"a": numbered((3, 2)), "b": numbered((5, 2), 10)}
    rules = [{"fuse": {"from": ["a", "b"], "to": "ab", "dim": 0}},
             {"split": {"from": "ab", "to": ["a2", "b2"], "dim": 0, "sizes": [3, 5]}}]
    view = run_case(rules, tensors)
    seg, = view.map_box("b2", Box((0, 0), (5, 2)))
    assert seg == SourceSegment("b", Box((0, 0), (5, 2)), Box((0, 0), (5, 2)), None)


def test_fuse_qkv_then_split_qkv_merges_back_to_one_segment_per_tensor() -> None:
    tensors = {"q": numbered((16, 2)), "k": numbered((4, 2), 100), "v": numbered((4, 2), 200)}
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "w", "num_heads": 8, "num_kv_heads": 2}},
             {"split_qkv": {"from": "w", "to": ["q2", "k2", "v2"], "num_heads": 8, "num_kv_heads": 2}}]
    view = run_case(rules, tensors)
    assert len(view.map_box("q2", Box((0, 0), (16, 2)))) == 1


def _random_chain(seed: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random rules over random tensors, and the reference result tracked alongside."""
    rng = random.Random(seed)
    tensors: dict[str, torch.Tensor] = {}
    base = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
    for j in range(rng.randint(1, 4)):
        # tensors share all dims but one (often), so fuses are possible
        shape = list(base)
        shape[rng.randrange(len(shape))] = rng.randint(1, 5)
        tensors[f"s{j}"] = numbered(tuple(shape), 1000 * j)
    view = dict(tensors)
    rules: list[dict[str, Any]] = []
    fresh = iter(f"t{n}" for n in range(1000))
    for _ in range(rng.randint(1, 9)):
        if not view:
            break
        name = rng.choice(sorted(view))
        t = view[name]
        op = rng.choice(["rename", "transpose", "split", "fuse", "fuse", "fuse", "cast"])
        if op == "rename":
            new = next(fresh)
            rules.append({"rename": {"from": name, "to": new}})
            view[new] = view.pop(name)
        elif op == "transpose" and t.dim() >= 2:
            dims = list(range(t.dim()))
            rng.shuffle(dims)
            new = next(fresh)
            rules.append({"transpose": {"from": name, "to": new, "dims": dims}})
            view[new] = view.pop(name).permute(dims)
        elif op == "split" and t.dim() >= 1 and t.shape[0] >= 1:
            dim = rng.randrange(t.dim())
            n = t.shape[dim]
            cut = rng.randint(0, n)
            a, b = next(fresh), next(fresh)
            rules.append({"split": {"from": name, "to": [a, b], "dim": dim, "sizes": [cut, n - cut]}})
            view[a], view[b] = view.pop(name).split([cut, n - cut], dim)
        elif op == "fuse":
            pairs = [(a, b, d) for a in sorted(view) for b in sorted(view) if a != b
                     for d in range(view[a].dim())
                     if view[b].dim() == view[a].dim() and view[b].dtype == view[a].dtype
                     and all(view[a].shape[e] == view[b].shape[e] for e in range(view[a].dim()) if e != d)]
            if not pairs:
                continue
            a, b, dim = rng.choice(pairs)
            new = next(fresh)
            rules.append({"fuse": {"from": [a, b], "to": new, "dim": dim}})
            view[new] = torch.cat([view.pop(a), view.pop(b)], dim)
        elif op == "cast":
            rules.append({"cast": {"key": name, "dtype": "float64"}})
            view[name] = view[name].to(torch.float64)
    return rules, tensors, view


@given(seed=st.integers(0, 10**9))
@settings(max_examples=150, deadline=None)
def test_random_chains_of_rules(seed: int) -> None:
    rules, tensors, expected = _random_chain(seed)
    view = Transforms.from_rules(rules).apply(spec(tensors))
    check_view(view, expected, tensors, boxes=8, rng=random.Random(seed))


# --------------------------------------------------------------------------- optimizer states


def _with_adam(params: dict[str, torch.Tensor], prefix: str = "optim.") -> dict[str, torch.Tensor]:
    out = dict(params)
    for j, (name, t) in enumerate(params.items()):
        out[f"{prefix}state.{name}.exp_avg"] = t + 0.5
        out[f"{prefix}state.{name}.exp_avg_sq"] = t + 0.25
        out[f"{prefix}state.{name}.step"] = torch.tensor(float(10 + j))
    return out


def test_optimizer_states_follow_a_rename() -> None:
    tensors = _with_adam({f"model.layers.{i}.w": numbered((2, 3), 10 * i) for i in range(3)})
    tensors["optim.param_groups.0.lr"] = torch.tensor(0.1)
    view = Transforms.from_rules([{"rename": {"from": "model.layers.{i}.w", "to": "layers.{i}.w"}}]).apply(spec(tensors))
    expected = {n.replace("model.layers.", "layers."): t for n, t in tensors.items()}
    check_view(view, expected, tensors, boxes=5)


def test_optimizer_states_follow_fuse_qkv_split_transpose_drop() -> None:
    params = {"q": numbered((8, 2)), "k": numbered((4, 2), 100), "v": numbered((4, 2), 200),
              "w13": numbered((6, 2), 300), "lm": numbered((2, 5), 400), "inv_freq": numbered((2,), 500)}
    tensors = _with_adam(params)
    rules = [
        {"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": 4, "num_kv_heads": 2}},
        {"split": {"from": "w13", "to": ["w1", "w3"]}},
        {"transpose": {"from": "lm", "to": "lm_t"}},
        {"drop": {"key": "inv_freq"}},
    ]
    view = Transforms.from_rules(rules).apply(spec(tensors))
    expected: dict[str, torch.Tensor] = {}
    for leaf, add in (("", 0.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25)):
        def n(p: str) -> str:
            return f"optim.state.{p}.{leaf}" if leaf else p
        expected[n("wqkv")] = qkv_reference(params["q"] + add, params["k"] + add, params["v"] + add, 4, 2, 0)
        w1, w3 = (params["w13"] + add).split(3, 0)
        expected[n("w1")], expected[n("w3")] = w1, w3
        expected[n("lm_t")] = (params["lm"] + add).T
    # scalar states: a fuse keeps the first source's step, a split copies it to each part
    expected["optim.state.wqkv.step"] = tensors["optim.state.q.step"]
    expected["optim.state.w1.step"] = expected["optim.state.w3.step"] = tensors["optim.state.w13.step"]
    expected["optim.state.lm_t.step"] = tensors["optim.state.lm.step"]
    check_view(view, expected, tensors, boxes=5)


def test_optimizer_states_keep_dtype_under_an_in_place_cast() -> None:
    tensors = _with_adam({"w": numbered((2, 2), 0, torch.bfloat16)})
    view = Transforms.from_rules([{"cast": {"key": "w", "dtype": "float32"}}]).apply(spec(tensors))
    assert view.tensors["w"].dtype == "F32"
    assert view.tensors["optim.state.w.exp_avg"].dtype == "BF16"


def test_optimizer_state_missing_for_one_fused_source_is_an_error() -> None:
    tensors = _with_adam({"a": numbered((2, 2)), "b": numbered((2, 2))})
    del tensors["optim.state.b.exp_avg"]
    with pytest.raises(TransformError, match=r"rule #0 .*optim\.state\.b\.exp_avg' is missing"):
        Transforms.from_rules([{"fuse": {"from": ["a", "b"], "to": "ab"}}]).apply(spec(tensors))


def test_optimizer_states_under_other_prefixes_are_recognised() -> None:
    tensors = {"w": numbered((2,)), "state.w.momentum_buffer": numbered((2,), 3),
               "optimizer.0.state.w.exp_avg": numbered((2,), 6)}
    view = Transforms.from_rules([{"rename": {"from": "w", "to": "v"}}]).apply(spec(tensors))
    assert set(view.tensors) == {"v", "state.v.momentum_buffer", "optimizer.0.state.v.exp_avg"}


# --------------------------------------------------------------------------- errors


def _err(rules: list[dict[str, Any]], tensors: dict[str, torch.Tensor], index: int, match: str) -> TransformError:
    with pytest.raises(TransformError) as info:
        Transforms.from_rules(rules).apply(spec(tensors))
    msg = str(info.value)
    assert f"transform rule #{index} " in msg, msg
    assert re.search(match, msg), msg
    # the rule's text is in the message
    kind = next(iter(rules[index]))
    assert "{" + kind + ":" in msg, msg
    return info.value


def test_error_unknown_rule() -> None:
    _err([{"rename": {"from": "a", "to": "b"}}, {"reshape": {"from": "b"}}], {"a": numbered((2,))}, 1,
         r"unknown rule 'reshape'")


def test_error_unknown_field_and_missing_field() -> None:
    _err([{"rename": {"from": "a", "too": "b"}}], {"a": numbered((2,))}, 0, r"unknown field")
    _err([{"fuse": {"from": ["a"]}}], {"a": numbered((2,))}, 0, r"missing field\(s\) \['to'\]")


def test_error_absent_source_name() -> None:
    tensors = {"a": numbered((2,)), "b": numbered((2,))}
    _err([{"rename": {"from": "a", "to": "c"}}, {"fuse": {"from": ["c", "zz"], "to": "d"}}], tensors, 1,
         r"source name 'zz' .*not in the view")
    _err([{"rename": {"from": "a", "to": "c"}}, {"rename": {"from": "a", "to": "d"}}], tensors, 1,
         r"source name 'a' is not in the view")


def test_error_pattern_matches_nothing_unless_optional() -> None:
    tensors = {"a": numbered((2,))}
    _err([{"drop": {"key": "l.{i}.inv_freq"}}], tensors, 0, r"matches no name")
    view = Transforms.from_rules([{"drop": {"key": "l.{i}.inv_freq", "optional": True}},
                                  {"drop": {"key": "absent", "optional": True}}]).apply(spec(tensors))
    assert set(view.tensors) == {"a"}


def test_error_fused_shapes_disagree_off_the_fuse_dim() -> None:
    _err([{"fuse": {"from": ["a", "b"], "to": "c", "dim": 0}}],
         {"a": numbered((2, 3)), "b": numbered((2, 4))}, 0, r"shapes disagree off the fuse dim 0")
    _err([{"fuse": {"from": ["a", "b"], "to": "c", "dim": 2}}],
         {"a": numbered((2, 3)), "b": numbered((2, 3))}, 0, r"dim 2 is out of range")


def test_error_split_that_does_not_divide() -> None:
    _err([{"split": {"from": "a", "to": ["b", "c"], "dim": 0}}], {"a": numbered((5, 2))}, 0,
         r"5 on dim 0, which does not divide into 2 equal parts")
    _err([{"split": {"from": "a", "to": ["b", "c"], "dim": 0, "sizes": [1, 3]}}], {"a": numbered((5, 2))}, 0,
         r"sizes \[1, 3\] sum to 4")


def test_error_dtype_disagreement_within_a_fuse() -> None:
    _err([{"fuse": {"from": ["a", "b"], "to": "c"}}],
         {"a": numbered((2,), 0, torch.float16), "b": numbered((2,))}, 0, r"dtypes disagree")
    with pytest.raises(TransformError, match=r"rule #1 .*dtypes disagree.*stored F16"):
        _raise_dtype_mix({"x": numbered((2, 2), 0, torch.float16), "y": numbered((2, 2))})


def test_error_fuse_qkv_rows_do_not_fit_heads() -> None:
    _err([{"fuse_qkv": {"from": ["q", "k", "v"], "to": "w", "num_heads": 4, "num_kv_heads": 2}}],
         {"q": numbered((8, 2)), "k": numbered((2, 2)), "v": numbered((4, 2))}, 0,
         r"k and v need num_kv_heads\*head_dim = 2\*2 = 4 rows")
    _err([{"fuse_qkv": {"from": ["q", "k", "v"], "to": "w", "num_heads": 4, "num_kv_heads": 3}}],
         {"q": numbered((8, 2))}, 0, r"not a multiple of num_kv_heads")


def test_error_transpose_dims_not_a_permutation() -> None:
    _err([{"transpose": {"from": "a", "dims": [0, 0]}}], {"a": numbered((2, 2))}, 0, r"not a permutation")
    _err([{"transpose": {"from": "a"}}], {"a": numbered((2, 2, 2))}, 0, r"give 'dims'")


def test_error_target_name_collision() -> None:
    _err([{"rename": {"from": "a", "to": "b"}}], {"a": numbered((2,)), "b": numbered((2,))}, 0,
         r"target name 'b' already exists")
    _err([{"rename": {"from": "*.w", "to": "w"}}], {"a.w": numbered((2,)), "b.w": numbered((2,))}, 0,
         r"two matches produce the same name 'w'")


def test_error_bad_patterns_and_values() -> None:
    a = {"a": numbered((2,))}
    _err([{"rename": {"from": "l.{i}", "to": "m.{j}"}}], a, 0, r"placeholder\(s\) \['j'\]")
    _err([{"rename": {"from": "l.{1x}", "to": "m"}}], a, 0, r"bad placeholder")
    _err([{"cast": {"key": "a", "dtype": "float7"}}], a, 0, r"unknown dtype 'float7'")
    _err([{"fuse": {"from": ["a"], "to": "b", "dim": "0"}}], a, 0, r"'dim' must be an integer")
    with pytest.raises(TransformError, match="list of rule"):
        Transforms.from_rules({"rename": {"from": "a", "to": "b"}})  # type: ignore[arg-type]


def test_map_box_outside_the_tensor_or_unknown_name() -> None:
    view = identity_view({"a": ((2, 3), "F32")})
    with pytest.raises(TransformError, match="outside view tensor 'a'"):
        view.map_box("a", Box((1, 0), (2, 3)))
    with pytest.raises(TransformError, match="'b' is not a name"):
        view.map_box("b", Box((0,), (1,)))


# --------------------------------------------------------------------------- loading rules


def test_as_transforms_accepts_every_form(tmp_path: Path) -> None:
    rules = [{"rename": {"from": "a", "to": "b"}}]
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"rules": rules}))
    assert as_transforms(None) is None
    t = Transforms.from_rules(rules)
    assert as_transforms(t) is t
    for obj in (rules, {"rules": rules}, str(path), path, f"file://{path}"):
        got = as_transforms(obj)
        assert got is not None and got.rules == rules
        assert set(got.apply({"a": ((1,), "F32")}).tensors) == {"b"}
    with pytest.raises(TransformError, match="got int"):
        as_transforms(3)


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [ {rename: {from: a, to: b}\n")
    with pytest.raises(TransformError, match="not valid YAML"):
        Transforms.from_yaml(str(bad))
    nolist = tmp_path / "nolist.yaml"
    nolist.write_text("- rename: {from: a, to: b}\n")
    with pytest.raises(TransformError, match="'rules' list"):
        Transforms.from_yaml(str(nolist))
    badrule = tmp_path / "badrule.yaml"
    badrule.write_text("rules:\n  - rename: {from: a}\n")
    with pytest.raises(TransformError, match=r"badrule\.yaml: transform rule #0"):
        Transforms.from_yaml(str(badrule))
    with pytest.raises(TransformError, match="cannot read transforms file"):
        Transforms.from_yaml(str(tmp_path / "absent.yaml"))


def test_presets_load_by_name_as_their_files_do() -> None:
    names = ["bf16_to_fp32_master", "gpt2_conv1d_to_linear", "hf_llama_to_megatron_gqa", "hf_llama_to_vllm"]
    assert presets() == names
    repo_configs = Path(__file__).resolve().parent.parent / "configs" / "transforms"
    for name in names:
        by_name = as_transforms(name)
        assert by_name.rules == Transforms.from_yaml(str(CONFIGS / f"{name}.yaml")).rules
        assert by_name.rules == Transforms.from_yaml(str(repo_configs / f"{name}.yaml")).rules  # the old path
    assert [list(r) for r in as_transforms("hf_llama_to_vllm").rules] == [["fuse"], ["fuse"], ["drop"]]


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(TransformError, match=r"no transforms preset named 'hf_llama_to_vlm' \(did you mean "
                                             r"'hf_llama_to_vllm'.*hf_llama_to_megatron_gqa, hf_llama_to_vllm;"):
        as_transforms("hf_llama_to_vlm")
    # a preset's file name, with no such file here: the error says to pass the bare name
    with pytest.raises(TransformError, match=r"cannot read transforms file 'hf_llama_to_vllm\.yaml'.*"
                                             r"named 'hf_llama_to_vllm': pass just that"):
        as_transforms("hf_llama_to_vllm.yaml")


def test_to_yaml_round_trips() -> None:
    t = Transforms.from_yaml(str(CONFIGS / "hf_llama_to_megatron_gqa.yaml"))
    again = Transforms.from_rules(yaml.safe_load(t.to_yaml())["rules"])
    assert again.rules == t.rules


@pytest.mark.parametrize("text,code", [("float32", "F32"), ("torch.bfloat16", "BF16"), ("fp16", "F16"),
                                       ("F64", "F64"), ("int8", "I8"), ("half", "F16")])
def test_parse_dtype(text: str, code: str) -> None:
    assert parse_dtype(text) == code
    assert parse_dtype(to_torch(code)) == code


# --------------------------------------------------------------------------- shipped configs


def hf_llama(layers: int = 2, h: int = 32, g: int = 8, hd: int = 2, hidden: int = 6, ffn: int = 5,
             vocab: int = 7, dtype: torch.dtype = torch.float32, inv_freq: bool = True) -> dict[str, torch.Tensor]:
    """An HF-Llama-named state dict with tiny dims (head counts as in the config)."""
    out: dict[str, torch.Tensor] = {}
    k = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal k
        out[name] = numbered(shape, k, dtype)
        k += 97

    add("model.embed_tokens.weight", (vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "self_attn.q_proj.weight", (h * hd, hidden))
        add(p + "self_attn.k_proj.weight", (g * hd, hidden))
        add(p + "self_attn.v_proj.weight", (g * hd, hidden))
        add(p + "self_attn.o_proj.weight", (hidden, h * hd))
        add(p + "mlp.gate_proj.weight", (ffn, hidden))
        add(p + "mlp.up_proj.weight", (ffn, hidden))
        add(p + "mlp.down_proj.weight", (hidden, ffn))
        add(p + "input_layernorm.weight", (hidden,))
        add(p + "post_attention_layernorm.weight", (hidden,))
        if inv_freq:
            add(p + "self_attn.rotary_emb.inv_freq", (hd // 2,))
    add("model.norm.weight", (hidden,))
    add("lm_head.weight", (vocab, hidden))
    return out


def _config_rules(name: str) -> list[dict[str, Any]]:
    return Transforms.from_yaml(str(CONFIGS / name)).rules


@pytest.mark.parametrize("inv_freq", [True, False])
def test_config_hf_llama_to_megatron_gqa(inv_freq: bool) -> None:
    tensors = hf_llama(inv_freq=inv_freq)
    rules = _config_rules("hf_llama_to_megatron_gqa.yaml")
    view = run_case(rules, tensors, boxes=10)
    assert set(view.tensors) == {
        "tok_embeddings.weight", "norm.weight", "output.weight",
        *(f"layers.{i}.{n}" for i in range(2) for n in (
            "attention.wqkv.weight", "attention.wo.weight", "feed_forward.w13.weight",
            "feed_forward.w2.weight", "attention_norm.weight", "ffn_norm.weight")),
    }
    wqkv = qkv_reference(tensors["model.layers.1.self_attn.q_proj.weight"],
                         tensors["model.layers.1.self_attn.k_proj.weight"],
                         tensors["model.layers.1.self_attn.v_proj.weight"], 32, 8, 0)
    full = Box((0, 0), wqkv.shape)
    assert torch.equal(assemble(view, "layers.1.attention.wqkv.weight", full, tensors), wqkv)
    # a TP=8 rank of wqkv holds exactly one KV group: 4 q heads, 1 k head, 1 v head (2 rows each)
    rows = wqkv.shape[0] // 8
    segs = view.map_box("layers.1.attention.wqkv.weight", Box((3 * rows, 0), (rows, 6)))
    assert [(s.source_key.split(".")[-2], s.source_box.offset[0], s.source_box.shape[0]) for s in segs] == [
        ("q_proj", 3 * 8, 8), ("k_proj", 3 * 2, 2), ("v_proj", 3 * 2, 2)]


def test_config_hf_llama_to_vllm() -> None:
    tensors = hf_llama(layers=3, h=4, g=2)
    view = run_case(_config_rules("hf_llama_to_vllm.yaml"), tensors, boxes=10)
    assert view.tensors["model.layers.2.self_attn.qkv_proj.weight"].shape == (16, 6)
    assert view.tensors["model.layers.2.mlp.gate_up_proj.weight"].shape == (10, 6)


def gpt2(layers: int = 2, hidden: int = 4, mask: bool = True) -> dict[str, torch.Tensor]:
    """GPT-2 names with Conv1D ([in, out]) projection weights and tiny dims."""
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"h.{i}."
        tensors[p + "attn.c_attn.weight"] = numbered((hidden, 3 * hidden), 1000 * i)
        tensors[p + "attn.c_attn.bias"] = numbered((3 * hidden,), 1000 * i + 100)
        tensors[p + "attn.c_proj.weight"] = numbered((hidden, hidden), 1000 * i + 200)
        tensors[p + "attn.c_proj.bias"] = numbered((hidden,), 1000 * i + 300)
        tensors[p + "mlp.c_fc.weight"] = numbered((hidden, 4 * hidden), 1000 * i + 400)
        tensors[p + "mlp.c_fc.bias"] = numbered((4 * hidden,), 1000 * i + 500)
        tensors[p + "mlp.c_proj.weight"] = numbered((4 * hidden, hidden), 1000 * i + 600)
        tensors[p + "mlp.c_proj.bias"] = numbered((hidden,), 1000 * i + 700)
        if mask:
            tensors[p + "attn.bias"] = numbered((1, 1, 3, 3))
    tensors["wte.weight"] = numbered((9, hidden))
    return tensors


def test_config_gpt2_conv1d_to_linear() -> None:
    tensors = gpt2()
    view = run_case(_config_rules("gpt2_conv1d_to_linear.yaml"), tensors, boxes=10)
    c_attn = tensors["h.1.attn.c_attn.weight"]
    assert torch.equal(assemble(view, "h.1.attn.k.weight", Box((0, 0), (4, 4)), tensors),
                       c_attn[:, 4:8].T)
    assert view.tensors["h.0.mlp.fc_in.weight"].shape == (16, 4)
    assert "h.0.attn.bias" not in view.tensors


def test_config_bf16_to_fp32_master() -> None:
    tensors = hf_llama(h=4, g=2, dtype=torch.bfloat16)
    view = run_case(_config_rules("bf16_to_fp32_master.yaml"), tensors, boxes=5)
    assert {vt.dtype for vt in view.tensors.values()} == {"F32"}
    assert {vt.source_dtype for vt in view.tensors.values()} == {"BF16"}
    assert len(view.tensors) == len(tensors) - 2   # inv_freq of two layers dropped


# --------------------------------------------------------------------------- invert


@pytest.mark.parametrize("config", ["hf_llama_to_megatron_gqa.yaml", "hf_llama_to_vllm.yaml",
                                    "gpt2_conv1d_to_linear.yaml", "bf16_to_fp32_master.yaml"])
def test_invert_maps_the_view_back_to_the_original_names(config: str) -> None:
    if config.startswith("gpt2"):
        tensors = gpt2(mask=False)
    else:
        tensors = hf_llama(inv_freq=False, dtype=torch.bfloat16 if config.startswith("bf16") else torch.float32)
    rules = _config_rules(config)
    forward = Transforms.from_rules(rules)
    transformed = reference(rules, tensors)
    inverse = forward.invert(spec(tensors))
    back = inverse.apply(spec(transformed))
    check_view(back, tensors, transformed, boxes=3)


def test_invert_carries_optimizer_states_back_and_skips_drops() -> None:
    params = {"q": numbered((8, 2)), "k": numbered((4, 2), 100), "v": numbered((4, 2), 200),
              "junk": numbered((1,))}
    tensors = _with_adam(params)
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "wqkv", "num_heads": 4, "num_kv_heads": 2}},
             {"transpose": {"from": "wqkv", "to": "wqkv_t"}},
             {"drop": {"key": "junk"}}]
    forward = Transforms.from_rules(rules)
    fview = forward.apply(spec(tensors))
    materialized = {n: assemble(fview, n, Box((0,) * len(vt.shape), vt.shape), tensors)
                    for n, vt in fview.tensors.items()}
    back = forward.invert(spec(tensors)).apply(spec(materialized))
    expected = {n: t for n, t in tensors.items() if "junk" not in n}
    for s in ("k", "v"):   # the fused step came from q's step; splitting copies it back
        expected[f"optim.state.{s}.step"] = tensors["optim.state.q.step"]
    check_view(back, expected, materialized, boxes=3)


# --------------------------------------------------------------------------- speed


def test_mapping_80_layers_10_rules_tp8_segments() -> None:
    """A 70B-like model under 10 rules, mapped for TP=8: the exact number of source
    segments (speed belongs in benchmarks/, never in a wall-time assert)."""
    layers, tp = 80, 8
    h, g, hd, hidden, ffn = 64, 8, 128, 8192, 28672
    source: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((128256, hidden), "BF16"), "model.norm.weight": ((hidden,), "BF16"),
        "lm_head.weight": ((128256, hidden), "BF16"),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        source |= {
            p + "self_attn.q_proj.weight": ((h * hd, hidden), "BF16"),
            p + "self_attn.k_proj.weight": ((g * hd, hidden), "BF16"),
            p + "self_attn.v_proj.weight": ((g * hd, hidden), "BF16"),
            p + "self_attn.o_proj.weight": ((hidden, h * hd), "BF16"),
            p + "mlp.gate_proj.weight": ((ffn, hidden), "BF16"),
            p + "mlp.up_proj.weight": ((ffn, hidden), "BF16"),
            p + "mlp.down_proj.weight": ((hidden, ffn), "BF16"),
            p + "input_layernorm.weight": ((hidden,), "BF16"),
            p + "post_attention_layernorm.weight": ((hidden,), "BF16"),
            p + "self_attn.rotary_emb.inv_freq": ((hd // 2,), "F32"),
        }
    rules = _config_rules("hf_llama_to_megatron_gqa.yaml")
    rules[0]["fuse_qkv"] = {**rules[0]["fuse_qkv"], "num_heads": h, "num_kv_heads": g}
    rules.append({"cast": {"key": "layers.{i}.*.weight", "dtype": "float32"}})
    view = Transforms.from_rules(rules).apply(source)
    segments = 0
    for name, vt in view.tensors.items():
        shape = vt.shape
        if len(shape) == 2:
            # row-parallel for the fused/column tensors, column-parallel for wo / w2
            dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
            step = shape[dim] // tp
            for r in range(tp):
                off = [0, 0]
                shp = list(shape)
                off[dim], shp[dim] = r * step, step
                segments += len(view.map_box(name, Box(tuple(off), tuple(shp))))
        else:
            segments += len(view.map_box(name, Box((0,), shape)))
    # wqkv: 3 per box (one KV group each); w13, wo, w2: 1 per box; 2 norms; embeddings 8+8, norm 1
    assert segments == 80 * (8 * 3 + 8 + 8 + 8 + 2) + 8 * 2 + 1
