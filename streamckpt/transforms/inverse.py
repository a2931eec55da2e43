"""Concrete rules that undo a traced sequence of rule applications (``Transforms.invert``)."""

from __future__ import annotations

from typing import Any, Sequence

from .apply import Step


def _undo(st: Step) -> dict[str, Any] | None:
    """The rule that undoes one step; None for a drop (a dropped tensor cannot come back)."""
    r = st.rule
    if r.kind == "rename":
        return {"rename": {"from": st.dst[0], "to": st.src[0]}}
    if r.kind == "fuse":
        dim = r.dim % len(st.before[0].shape)
        return {"split": {"from": st.dst[0], "to": list(st.src), "dim": dim,
                          "sizes": [t.shape[dim] for t in st.before]}}
    if r.kind == "split":
        dim = r.dim % len(st.before[0].shape)
        return {"fuse": {"from": list(st.dst), "to": st.src[0], "dim": dim}}
    heads = {"num_heads": r.num_heads, "num_kv_heads": r.num_kv_heads, "dim": r.dim}
    if r.kind == "fuse_qkv":
        return {"split_qkv": {"from": st.dst[0], "to": list(st.src), **heads}}
    if r.kind == "split_qkv":
        return {"fuse_qkv": {"from": list(st.dst), "to": st.src[0], **heads}}
    if r.kind == "transpose":
        nd = len(st.before[0].shape)
        dims = r.dims if r.dims is not None else (1, 0)
        inv = [0] * nd
        for d, s in enumerate(dims):
            inv[s % nd] = d
        return {"transpose": {"from": st.dst[0], "to": st.src[0], "dims": inv}}
    if r.kind == "cast":
        return {"cast": {"key": st.dst[0], "to": st.src[0], "dtype": st.before[0].dtype}}
    return None


def inverse_rules(steps: Sequence[Step]) -> list[dict[str, Any]]:
    """Concrete rules that undo ``steps`` (drops cannot be undone and are skipped)."""
    return [rule for rule in (_undo(st) for st in reversed(steps)) if rule is not None]
