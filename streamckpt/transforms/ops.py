"""What each rule kind does to the pieces of its source tensors (no data is touched)."""

from __future__ import annotations

from typing import Callable, Sequence

from .pieces import PiecedTensor, concat, cut, permute, restrict, slab
from .rules import Rule

Op = Callable[[Rule, Sequence[str], Sequence[PiecedTensor], int], list[PiecedTensor]]


def _norm_dim(rule: Rule, dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise rule.fail(f"dim {dim} is out of range for {what} with {ndim} dims")
    return dim % ndim


def _check_fusable(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor]) -> int:
    """The normalized fuse dim, once shapes agree off it and dtypes agree."""
    ref = ts[0].shape
    dim = _norm_dim(rule, rule.dim, len(ref), repr(names[0]))
    for t in ts:
        if len(t.shape) != len(ref) or any(
            a != b for d, (a, b) in enumerate(zip(t.shape, ref)) if d != dim
        ):
            shapes = ", ".join(f"{m!r}: {list(u.shape)}" for m, u in zip(names, ts))
            raise rule.fail(f"shapes disagree off the fuse dim {dim}: {shapes}")
    kinds = {(t.dtype, t.source_dtype) for t in ts}
    if len(kinds) > 1:
        desc = ", ".join(f"{n!r}: {t.dtype}"
                         + (f" (stored {t.source_dtype})" if t.source_dtype != t.dtype else "")
                         for n, t in zip(names, ts))
        raise rule.fail(f"dtypes disagree within the fuse: {desc}")
    return dim


def _op_rename(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    return list(ts)


def _op_drop(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    return []


def _op_fuse(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    return [concat(ts, _check_fusable(rule, names, ts))]


def _qkv_blocks(rule: Rule, q_rows: int, k_rows: int, v_rows: int, where: str) -> tuple[int, int]:
    """(head_dim, q heads per group), checking that the row counts fit the head counts."""
    h, g = rule.num_heads, rule.num_kv_heads
    if q_rows % h:
        raise rule.fail(f"{where}: q has {q_rows} rows on dim {rule.dim}, "
                        f"not a multiple of num_heads={h}")
    hd = q_rows // h
    if k_rows != g * hd or v_rows != g * hd:
        raise rule.fail(f"{where}: k and v need num_kv_heads*head_dim = {g}*{hd} = {g * hd} "
                        f"rows on dim {rule.dim}, got k={k_rows}, v={v_rows}")
    return hd, h // g


def _op_fuse_qkv(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    """Grouped-query interleave: ``[q-heads of group 0, k0, v0, q-heads of group 1, ...]``."""
    dim = _check_fusable(rule, names, ts)
    q, k, v = ts
    hd, per = _qkv_blocks(rule, q.shape[dim], k.shape[dim], v.shape[dim], repr(names[0]))
    blocks: list[PiecedTensor] = []
    for grp in range(rule.num_kv_heads):
        for t, start, length in ((q, grp * per * hd, per * hd), (k, grp * hd, hd), (v, grp * hd, hd)):
            region = slab(t.shape, dim, start, length)
            blocks.append(PiecedTensor(region.shape, t.dtype, t.source_dtype,
                                       tuple(restrict(t.pieces, region))))
    return [concat(blocks, dim)]


def _op_split(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    (t,) = ts
    dim = _norm_dim(rule, rule.dim, len(t.shape), repr(names[0]))
    n = t.shape[dim]
    if rule.sizes is None:
        if n % parts:
            raise rule.fail(f"{names[0]!r} has {n} on dim {dim}, which does not divide into "
                            f"{parts} equal parts")
        sizes: Sequence[int] = [n // parts] * parts
    else:
        sizes = rule.sizes
        if sum(sizes) != n:
            raise rule.fail(f"sizes {list(sizes)} sum to {sum(sizes)}, but {names[0]!r} has "
                            f"{n} on dim {dim}")
    return cut(t, dim, sizes)


def _op_split_qkv(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    (t,) = ts
    dim = _norm_dim(rule, rule.dim, len(t.shape), repr(names[0]))
    h, g = rule.num_heads, rule.num_kv_heads
    rows = t.shape[dim]
    if rows % (h + 2 * g):
        raise rule.fail(f"{names[0]!r} has {rows} rows on dim {dim}, not a multiple of "
                        f"num_heads + 2*num_kv_heads = {h + 2 * g}")
    hd = rows // (h + 2 * g)
    blocks = cut(t, dim, [(h // g) * hd, hd, hd] * g)
    return [concat(blocks[which::3], dim) for which in range(3)]


def _op_transpose(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    (t,) = ts
    nd = len(t.shape)
    dims = rule.dims
    if dims is None:
        if nd != 2:
            raise rule.fail(f"{names[0]!r} has {nd} dims: give 'dims' (a permutation)")
        dims = (1, 0)
    if sorted(d % nd if -nd <= d < nd else d for d in dims) != list(range(nd)):
        raise rule.fail(f"dims {list(dims)} are not a permutation of the {nd} dims of {names[0]!r}")
    dims = tuple(d % nd for d in dims)
    shape = tuple(t.shape[d] for d in dims)
    return [PiecedTensor(shape, t.dtype, t.source_dtype, tuple(permute(t.pieces, dims)))]


def _op_cast(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], parts: int) -> list[PiecedTensor]:
    (t,) = ts
    return [PiecedTensor(t.shape, rule.dtype or t.dtype, t.source_dtype, t.pieces)]


_OPS: dict[str, Op] = {
    "rename": _op_rename,
    "fuse": _op_fuse,
    "fuse_qkv": _op_fuse_qkv,
    "split": _op_split,
    "split_qkv": _op_split_qkv,
    "transpose": _op_transpose,
    "cast": _op_cast,
    "drop": _op_drop,
}


def run_op(rule: Rule, names: Sequence[str], ts: Sequence[PiecedTensor], n_out: int) -> list[PiecedTensor]:
    """The ``n_out`` tensors rule ``rule`` makes of ``ts`` (named ``names`` in the view)."""
    return _OPS[rule.kind](rule, names, ts, n_out)
