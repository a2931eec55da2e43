"""Transforms on load: rename / fuse / fuse_qkv / split / split_qkv / transpose / cast / drop.

A checkpoint rarely names or shapes its tensors the way the model does. Rules apply in
order to a *view* of the checkpoint (name -> shape, dtype); the state_dict is matched
against the final view. Every view tensor is kept as a list of *pieces*: rectangles of
the view tensor, each an affine image (offset shift + dimension permutation) of a box of
one source tensor. Concatenation and splits shift pieces, ``fuse_qkv`` reorders row
blocks, transpose permutes them. Mapping a target box back to the checkpoint is then
plain box arithmetic (:meth:`View.map_box`): nothing is materialized, so a transformed
load still reads only the bytes its targets need. Pure module: the only I/O is reading a
YAML rules file through fsspec in :meth:`Transforms.from_yaml`.

See docs/TRANSFORMS.md for the rule reference.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import yaml

from . import dtypes
from .errors import CheckpointError, TransformError
from .regions import Box, intersect, whole

log = logging.getLogger(__name__)

Shape = tuple[int, ...]
SourceSpec = Mapping[str, tuple[Sequence[int], str]]

__all__ = [
    "SourceSegment",
    "ViewTensor",
    "View",
    "Transforms",
    "as_transforms",
    "identity_view",
    "parse_dtype",
    "STATE_COMPONENT",
]

#: The dotted component that marks an optimizer-state name: ``<prefix>state.<param>.<leaf>``.
STATE_COMPONENT = "state"


# --------------------------------------------------------------------------- public data


@dataclass(frozen=True, slots=True)
class SourceSegment:
    """One rectangle of a target box and the source box it comes from.

    A source point ``s`` inside ``source_box`` lands at
    ``t[d] = target_box.offset[d] + (s[perm[d]] - source_box.offset[perm[d]])``;
    ``perm`` None means identity (else ``target_view = source_view.permute(perm)``).
    """

    source_key: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class ViewTensor:
    """Shape and dtypes of one name of the transformed view."""

    shape: Shape
    dtype: str          # dtype code after any cast rule
    source_dtype: str   # dtype code of the stored bytes


@dataclass(frozen=True, slots=True)
class _Piece:
    """A rectangle ``box`` of a view tensor that is an affine image of source ``key``.

    View point ``t`` in ``box`` comes from source point ``s`` with
    ``s[perm[d]] = src_offset[perm[d]] + t[d] - box.offset[d]``.
    """

    box: Box
    key: str
    src_offset: Shape
    perm: Shape

    @property
    def identity(self) -> bool:
        return all(p == d for d, p in enumerate(self.perm))


@dataclass(frozen=True, slots=True)
class _Tensor:
    """A view tensor while rules are being applied."""

    shape: Shape
    dtype: str
    source_dtype: str
    pieces: tuple[_Piece, ...]


@dataclass(frozen=True, slots=True)
class _Entry:
    """A final view tensor with a lookup index over its pieces (built once in apply)."""

    tensor: ViewTensor
    pieces: tuple[_Piece, ...]
    axis: int | None        # pieces tile along this single axis -> bisect on ``starts``
    starts: tuple[int, ...]


# --------------------------------------------------------------------------- piece algebra


def _leaf(key: str, shape: Shape) -> tuple[_Piece, ...]:
    n = len(shape)
    return (_Piece(whole(shape), key, (0,) * n, tuple(range(n))),)


def _shift(pieces: Iterable[_Piece], dim: int, delta: int) -> list[_Piece]:
    """Move pieces by ``delta`` along view dim ``dim`` (concatenation)."""
    out = []
    for p in pieces:
        off = list(p.box.offset)
        off[dim] += delta
        out.append(_Piece(Box(tuple(off), p.box.shape), p.key, p.src_offset, p.perm))
    return out


def _restrict(pieces: Iterable[_Piece], region: Box) -> list[_Piece]:
    """The parts of ``pieces`` inside ``region``, re-based so ``region.offset`` is 0."""
    out = []
    for p in pieces:
        i = intersect(p.box, region)
        if i is None:
            continue
        src = list(p.src_offset)
        for d, e in enumerate(p.perm):
            src[e] += i.offset[d] - p.box.offset[d]
        rel = tuple(a - b for a, b in zip(i.offset, region.offset))
        out.append(_Piece(Box(rel, i.shape), p.key, tuple(src), p.perm))
    return out


def _permute(pieces: Iterable[_Piece], dims: Shape) -> list[_Piece]:
    """View dim ``d`` of the result is view dim ``dims[d]`` of the input."""
    return [
        _Piece(
            Box(tuple(p.box.offset[d] for d in dims), tuple(p.box.shape[d] for d in dims)),
            p.key, p.src_offset, tuple(p.perm[d] for d in dims),
        )
        for p in pieces
    ]


def _try_merge(a: _Piece, b: _Piece) -> _Piece | None:
    """``a`` and ``b`` as one piece if they are adjacent in the view and in the source."""
    if a.key != b.key or a.perm != b.perm:
        return None
    dim = None
    for d in range(len(a.perm)):
        if a.box.offset[d] == b.box.offset[d] and a.box.shape[d] == b.box.shape[d]:
            continue
        if dim is not None or a.box.offset[d] + a.box.shape[d] != b.box.offset[d]:
            return None
        dim = d
    if dim is None:
        return None
    e = a.perm[dim]
    expect = list(a.src_offset)
    expect[e] += a.box.shape[dim]
    if tuple(expect) != b.src_offset:
        return None
    shape = list(a.box.shape)
    shape[dim] += b.box.shape[dim]
    return _Piece(Box(a.box.offset, tuple(shape)), a.key, a.src_offset, a.perm)


def _normalize(pieces: Iterable[_Piece]) -> tuple[_Piece, ...]:
    """Drop empty pieces and merge neighbours that read one contiguous source box."""
    items = sorted((p for p in pieces if not p.box.is_empty()),
                   key=lambda p: (p.key, p.perm, p.box.offset))
    changed = True
    while changed and len(items) > 1:
        changed = False
        out: list[_Piece] = []
        for p in items:
            if out:
                m = _try_merge(out[-1], p)
                if m is not None:
                    out[-1] = m
                    changed = True
                    continue
            out.append(p)
        items = out
    return tuple(sorted(items, key=lambda p: p.box.offset))


def _index(shape: Shape, pieces: tuple[_Piece, ...]) -> tuple[int | None, tuple[int, ...], tuple[_Piece, ...]]:
    """Find one axis along which the pieces are slabs, so map_box can bisect."""
    if len(pieces) <= 4 or not shape:
        return None, (), pieces
    for k in range(len(shape)):
        if all(
            p.box.offset[d] == 0 and p.box.shape[d] == shape[d]
            for p in pieces for d in range(len(shape)) if d != k
        ):
            ordered = tuple(sorted(pieces, key=lambda p: p.box.offset[k]))
            return k, tuple(p.box.offset[k] for p in ordered), ordered
    return None, (), pieces


# --------------------------------------------------------------------------- the view


class View:
    """The transformed view of a checkpoint: final names, shapes, dtypes and region maps."""

    def __init__(self, entries: Mapping[str, _Tensor], *, transformed: bool = True) -> None:
        #: the planner reports shape/dtype mismatches as TransformError when True
        self.transformed = transformed
        built: dict[str, _Entry] = {}
        for name, t in entries.items():
            pieces = _normalize(t.pieces)
            axis, starts, ordered = _index(t.shape, pieces)
            built[name] = _Entry(ViewTensor(t.shape, t.dtype, t.source_dtype), ordered, axis, starts)
        self._entries = built
        self.tensors: dict[str, ViewTensor] = {n: e.tensor for n, e in built.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"View({len(self._entries)} tensors)"

    def sources(self, name: str) -> list[str]:
        """Checkpoint names that tensor ``name`` of the view is built from (in order)."""
        seen: dict[str, None] = {}
        for p in self._entry(name).pieces:
            seen.setdefault(p.key, None)
        return list(seen)

    def is_identity(self, name: str) -> bool:
        """True when ``name`` is exactly one whole, unpermuted, uncast checkpoint tensor."""
        e = self._entry(name)
        if len(e.pieces) != 1 or e.tensor.dtype != e.tensor.source_dtype:
            return False
        p = e.pieces[0]
        return p.key == name and p.identity and p.box == whole(e.tensor.shape)

    def map_box(self, name: str, box: Box) -> list[SourceSegment]:
        """Source segments that exactly tile ``box`` of view tensor ``name`` (view coords)."""
        e = self._entry(name)
        shape = e.tensor.shape
        if len(box.shape) != len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(box.offset, box.shape, shape)
        ):
            raise TransformError(
                f"box offset={box.offset} shape={box.shape} lies outside view tensor "
                f"{name!r} of shape {shape}"
            )
        if box.is_empty():
            return []
        out: list[SourceSegment] = []
        for p in self._candidates(e, box):
            i = intersect(p.box, box)
            if i is None:
                continue
            src_off = list(p.src_offset)
            src_shape = [0] * len(src_off)
            for d, s in enumerate(p.perm):
                src_off[s] += i.offset[d] - p.box.offset[d]
                src_shape[s] = i.shape[d]
            out.append(SourceSegment(
                p.key, Box(tuple(src_off), tuple(src_shape)), i,
                None if p.identity else p.perm,
            ))
        return out

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise TransformError(f"{name!r} is not a name of the transformed view") from None

    @staticmethod
    def _candidates(e: _Entry, box: Box) -> Sequence[_Piece]:
        if e.axis is None:
            return e.pieces
        k = e.axis
        lo = max(bisect.bisect_right(e.starts, box.offset[k]) - 1, 0)
        hi = bisect.bisect_left(e.starts, box.offset[k] + box.shape[k])
        return e.pieces[lo:hi]


def identity_view(source: SourceSpec) -> View:
    """The view with every checkpoint name unchanged (``transforms=None``)."""
    return View({
        name: _Tensor(tuple(shape), dt, dt, _leaf(name, tuple(shape)))
        for name, (shape, dt) in source.items()
    }, transformed=False)


# --------------------------------------------------------------------------- dtypes


_DTYPE_ALIASES = {
    "fp64": "F64", "f64": "F64", "float64": "F64", "double": "F64",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "bf16": "BF16", "bfloat16": "BF16",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32",
    "int16": "I16", "short": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def parse_dtype(spec: Any) -> str:
    """A dtype code from ``"float32"``, ``"bf16"``, ``"torch.float16"``, ``"F32"`` or a torch.dtype."""
    if isinstance(spec, torch.dtype):
        return dtypes.to_code(spec)
    if not isinstance(spec, str):
        raise ValueError(f"dtype must be a string, got {spec!r}")
    text = spec.strip()
    if text.upper() in dtypes.SUPPORTED_CODES:
        return text.upper()
    low = text.lower().removeprefix("torch.")
    if low in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[low]
    attr = getattr(torch, low, None)
    if isinstance(attr, torch.dtype):
        try:
            return dtypes.to_code(attr)
        except CheckpointError:
            pass
    raise ValueError(f"unknown dtype {spec!r}")


# --------------------------------------------------------------------------- patterns


_TOKEN = re.compile(r"\{([^{}]*)\}|\*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class _Pattern:
    """A name pattern: ``{var}`` binds a run of digits, ``*`` a run within one component."""

    text: str
    regex: re.Pattern[str] | None   # None: a literal name
    variables: tuple[str, ...]
    stars: int

    @classmethod
    def parse(cls, text: str) -> "_Pattern":
        if not isinstance(text, str) or not text:
            raise ValueError(f"a name pattern must be a non-empty string, got {text!r}")
        parts: list[str] = []
        seen: list[str] = []
        stars = 0
        pos = 0
        for m in _TOKEN.finditer(text):
            parts.append(re.escape(text[pos:m.start()]))
            pos = m.end()
            if m.group(0) == "*":
                parts.append(f"(?P<_s{stars}>[^.]*)")
                stars += 1
                continue
            var = m.group(1)
            if not _IDENT.match(var):
                raise ValueError(f"bad placeholder {{{var}}} in {text!r} (use {{name}})")
            if var in seen:
                parts.append(f"(?P={var})")
            else:
                parts.append(f"(?P<{var}>[0-9]+)")
                seen.append(var)
        tail = text[pos:]
        if "{" in tail or "}" in tail:
            raise ValueError(f"unbalanced brace in pattern {text!r}")
        parts.append(re.escape(tail))
        if not seen and not stars:
            return cls(text, None, (), 0)
        return cls(text, re.compile("".join(parts)), tuple(seen), stars)

    def match(self, name: str) -> tuple[dict[str, str], list[str]] | None:
        if self.regex is None:
            return ({}, []) if name == self.text else None
        m = self.regex.fullmatch(name)
        if m is None:
            return None
        groups = m.groupdict()
        return ({v: groups[v] for v in self.variables},
                [groups[f"_s{k}"] for k in range(self.stars)])

    def substitute(self, binds: Mapping[str, str], stars: Sequence[str]) -> str:
        """Fill placeholders from ``binds`` and the k-th ``*`` with the k-th captured star."""
        count = 0

        def repl(m: re.Match[str]) -> str:
            nonlocal count
            if m.group(0) == "*":
                if count >= len(stars):
                    raise ValueError(
                        f"pattern {self.text!r} has more '*' than the first 'from' pattern"
                    )
                count += 1
                return stars[count - 1]
            var = m.group(1)
            if var not in binds:
                raise ValueError(
                    f"placeholder {{{var}}} in {self.text!r} is not bound by the first 'from' pattern"
                )
            return binds[var]

        return _TOKEN.sub(repl, self.text)


# --------------------------------------------------------------------------- rules


_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # kind: (required fields, optional fields); every rule may also say ``optional: true``
    "rename": (frozenset({"from", "to"}), frozenset()),
    "fuse": (frozenset({"from", "to"}), frozenset({"dim"})),
    "fuse_qkv": (frozenset({"from", "to", "num_heads", "num_kv_heads"}), frozenset({"dim"})),
    "split": (frozenset({"from", "to"}), frozenset({"dim", "sizes"})),
    "split_qkv": (frozenset({"from", "to", "num_heads", "num_kv_heads"}), frozenset({"dim"})),
    "transpose": (frozenset(), frozenset({"from", "key", "to", "dims"})),
    "cast": (frozenset({"dtype"}), frozenset({"key", "from", "to"})),
    "drop": (frozenset(), frozenset({"key", "from"})),
}
_MULTI_FROM = {"fuse", "fuse_qkv"}
_MULTI_TO = {"split", "split_qkv"}


@dataclass(frozen=True)
class _Rule:
    """One parsed rule; ``fail`` builds a TransformError that names it."""

    index: int
    kind: str
    text: str
    raw: dict[str, Any]
    src: tuple[_Pattern, ...]
    dst: tuple[_Pattern, ...]
    dim: int = 0
    sizes: tuple[int, ...] | None = None
    dims: tuple[int, ...] | None = None
    dtype: str | None = None
    num_heads: int = 0
    num_kv_heads: int = 0
    optional: bool = False

    def fail(self, message: str) -> TransformError:
        return TransformError(f"transform rule #{self.index} {self.text}: {message}")


def _rule_text(rule: Any) -> str:
    try:
        return yaml.safe_dump(rule, default_flow_style=True, sort_keys=False, width=10_000).strip()
    except yaml.YAMLError:
        return repr(rule)


def _as_int(rule_fail: Callable[[str], TransformError], key: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise rule_fail(f"'{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise rule_fail(f"'{key}' must be >= {minimum}, got {value}")
    return value


def _parse_rule(index: int, rule: Any) -> _Rule:
    text = _rule_text(rule)

    def fail(msg: str) -> TransformError:
        return TransformError(f"transform rule #{index} {text}: {msg}")

    if not isinstance(rule, Mapping) or len(rule) != 1:
        raise fail(f"a rule is a mapping with one key, one of {', '.join(_FIELDS)}")
    (kind, body), = rule.items()
    if kind not in _FIELDS:
        raise fail(f"unknown rule {kind!r}; known rules: {', '.join(_FIELDS)}")
    if not isinstance(body, Mapping):
        raise fail(f"the body of {kind!r} must be a mapping of fields")
    required, optional = _FIELDS[kind]
    allowed = required | optional | {"optional"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise fail(f"unknown field(s) {unknown}; {kind!r} takes {sorted(allowed)}")
    missing = sorted(required - set(body))
    if missing:
        raise fail(f"missing field(s) {missing}")
    if "key" in body and "from" in body:
        raise fail("give 'key' or 'from', not both")

    src_raw = body.get("from", body.get("key"))
    if src_raw is None:
        raise fail("missing field 'key' (or 'from')")
    if kind in _MULTI_FROM:
        if not isinstance(src_raw, list) or not src_raw:
            raise fail("'from' must be a non-empty list of names")
        if kind == "fuse_qkv" and len(src_raw) != 3:
            raise fail("'from' must list exactly three names: q, k, v")
        src_list = list(src_raw)
    else:
        if not isinstance(src_raw, str):
            raise fail("'from'/'key' must be one name (a string)")
        src_list = [src_raw]

    dst_raw = body.get("to")
    if kind in _MULTI_TO:
        if not isinstance(dst_raw, list) or not dst_raw:
            raise fail("'to' must be a non-empty list of names")
        if kind == "split_qkv" and len(dst_raw) != 3:
            raise fail("'to' must list exactly three names: q, k, v")
        dst_list = list(dst_raw)
    elif kind == "drop":
        dst_list = []
    elif dst_raw is None:
        dst_list = [src_list[0]]     # transpose / cast in place
    else:
        if not isinstance(dst_raw, str):
            raise fail("'to' must be one name (a string)")
        dst_list = [dst_raw]

    try:
        src = tuple(_Pattern.parse(s) for s in src_list)
        dst = tuple(_Pattern.parse(s) for s in dst_list)
    except ValueError as exc:
        raise fail(str(exc)) from None
    first = src[0]
    for p in src[1:] + dst:
        extra = sorted(set(p.variables) - set(first.variables))
        if extra:
            raise fail(f"placeholder(s) {extra} in {p.text!r} are not bound by {first.text!r}")
        if p.stars > first.stars:
            raise fail(f"{p.text!r} has more '*' than {first.text!r}")

    opt = body.get("optional", False)
    if not isinstance(opt, bool):
        raise fail(f"'optional' must be true or false, got {opt!r}")
    kw: dict[str, Any] = {"optional": opt}
    if "dim" in body:
        kw["dim"] = _as_int(fail, "dim", body["dim"])
    if kind in ("fuse_qkv", "split_qkv"):
        kw["num_heads"] = _as_int(fail, "num_heads", body["num_heads"], minimum=1)
        kw["num_kv_heads"] = _as_int(fail, "num_kv_heads", body["num_kv_heads"], minimum=1)
        if kw["num_heads"] % kw["num_kv_heads"]:
            raise fail(f"num_heads={kw['num_heads']} is not a multiple of "
                       f"num_kv_heads={kw['num_kv_heads']}")
    if body.get("sizes") is not None:
        sizes = body["sizes"]
        if not isinstance(sizes, list) or len(sizes) != len(dst_list):
            raise fail(f"'sizes' must list one size per 'to' name ({len(dst_list)})")
        kw["sizes"] = tuple(_as_int(fail, "sizes", s, minimum=0) for s in sizes)
    if body.get("dims") is not None:
        dims = body["dims"]
        if not isinstance(dims, list):
            raise fail("'dims' must be a list of dimension indices")
        kw["dims"] = tuple(_as_int(fail, "dims", d) for d in dims)
    if kind == "cast":
        try:
            kw["dtype"] = parse_dtype(body["dtype"])
        except (ValueError, CheckpointError) as exc:
            raise fail(str(exc)) from None
    return _Rule(index, kind, text, dict(rule), src, dst, **kw)


# --------------------------------------------------------------------------- geometric ops


def _norm_dim(rule: _Rule, dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise rule.fail(f"dim {dim} is out of range for {what} with {ndim} dims")
    return dim % ndim


def _check_same_dtype(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> None:
    kinds = {(t.dtype, t.source_dtype) for t in ts}
    if len(kinds) > 1:
        desc = ", ".join(f"{n!r}: {t.dtype}"
                         + (f" (stored {t.source_dtype})" if t.source_dtype != t.dtype else "")
                         for n, t in zip(names, ts))
        raise rule.fail(f"dtypes disagree within the fuse: {desc}")


def _op_fuse(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> list[_Tensor]:
    ref = ts[0].shape
    dim = _norm_dim(rule, rule.dim, len(ref), repr(names[0]))
    for n, t in zip(names, ts):
        if len(t.shape) != len(ref) or any(
            a != b for d, (a, b) in enumerate(zip(t.shape, ref)) if d != dim
        ):
            shapes = ", ".join(f"{m!r}: {list(u.shape)}" for m, u in zip(names, ts))
            raise rule.fail(f"shapes disagree off the fuse dim {dim}: {shapes}")
    _check_same_dtype(rule, names, ts)
    pieces: list[_Piece] = []
    at = 0
    for t in ts:
        pieces.extend(_shift(t.pieces, dim, at))
        at += t.shape[dim]
    shape = ref[:dim] + (at,) + ref[dim + 1:]
    return [_Tensor(shape, ts[0].dtype, ts[0].source_dtype, tuple(pieces))]


def _qkv_blocks(rule: _Rule, q_rows: int, k_rows: int, v_rows: int, where: str) -> tuple[int, int]:
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


def _op_fuse_qkv(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> list[_Tensor]:
    q, k, v = ts
    ref = q.shape
    dim = _norm_dim(rule, rule.dim, len(ref), repr(names[0]))
    for n, t in zip(names, ts):
        if len(t.shape) != len(ref) or any(
            a != b for d, (a, b) in enumerate(zip(t.shape, ref)) if d != dim
        ):
            shapes = ", ".join(f"{m!r}: {list(u.shape)}" for m, u in zip(names, ts))
            raise rule.fail(f"shapes disagree off the fuse dim {dim}: {shapes}")
    _check_same_dtype(rule, names, ts)
    hd, per = _qkv_blocks(rule, q.shape[dim], k.shape[dim], v.shape[dim], repr(names[0]))

    def slab(t: _Tensor, start: int, length: int) -> Box:
        return Box(tuple(start if d == dim else 0 for d in range(len(ref))),
                   tuple(length if d == dim else s for d, s in enumerate(t.shape)))

    pieces: list[_Piece] = []
    at = 0
    for grp in range(rule.num_kv_heads):
        for t, start, length in ((q, grp * per * hd, per * hd), (k, grp * hd, hd), (v, grp * hd, hd)):
            pieces.extend(_shift(_restrict(t.pieces, slab(t, start, length)), dim, at))
            at += length
    shape = ref[:dim] + (at,) + ref[dim + 1:]
    return [_Tensor(shape, q.dtype, q.source_dtype, tuple(pieces))]


def _cut(t: _Tensor, dim: int, sizes: Sequence[int]) -> list[_Tensor]:
    out = []
    at = 0
    for size in sizes:
        region = Box(tuple(at if d == dim else 0 for d in range(len(t.shape))),
                     tuple(size if d == dim else s for d, s in enumerate(t.shape)))
        out.append(_Tensor(region.shape, t.dtype, t.source_dtype, tuple(_restrict(t.pieces, region))))
        at += size
    return out


def _op_split(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor], parts: int) -> list[_Tensor]:
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
    return _cut(t, dim, sizes)


def _op_split_qkv(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> list[_Tensor]:
    (t,) = ts
    dim = _norm_dim(rule, rule.dim, len(t.shape), repr(names[0]))
    h, g = rule.num_heads, rule.num_kv_heads
    rows = t.shape[dim]
    if rows % (h + 2 * g):
        raise rule.fail(f"{names[0]!r} has {rows} rows on dim {dim}, not a multiple of "
                        f"num_heads + 2*num_kv_heads = {h + 2 * g}")
    hd = rows // (h + 2 * g)
    per = h // g
    blocks = _cut(t, dim, [per * hd, hd, hd] * g)
    outs = []
    for which in range(3):
        parts = blocks[which::3]
        pieces: list[_Piece] = []
        at = 0
        for p in parts:
            pieces.extend(_shift(p.pieces, dim, at))
            at += p.shape[dim]
        shape = t.shape[:dim] + (at,) + t.shape[dim + 1:]
        outs.append(_Tensor(shape, t.dtype, t.source_dtype, tuple(pieces)))
    return outs


def _op_transpose(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> list[_Tensor]:
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
    return [_Tensor(shape, t.dtype, t.source_dtype, tuple(_permute(t.pieces, dims)))]


def _op_cast(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor]) -> list[_Tensor]:
    (t,) = ts
    return [_Tensor(t.shape, rule.dtype or t.dtype, t.source_dtype, t.pieces)]


def _run_op(rule: _Rule, names: Sequence[str], ts: Sequence[_Tensor], n_out: int) -> list[_Tensor]:
    kind = rule.kind
    if kind == "rename":
        return list(ts)
    if kind == "fuse":
        return _op_fuse(rule, names, ts)
    if kind == "fuse_qkv":
        return _op_fuse_qkv(rule, names, ts)
    if kind == "split":
        return _op_split(rule, names, ts, n_out)
    if kind == "split_qkv":
        return _op_split_qkv(rule, names, ts)
    if kind == "transpose":
        return _op_transpose(rule, names, ts)
    if kind == "cast":
        return _op_cast(rule, names, ts)
    return []  # drop


# --------------------------------------------------------------------------- optimizer states


def _state_refs(name: str) -> list[tuple[str, str, str]]:
    """Every ``(param, prefix, leaf)`` with ``name == prefix + "state." + param + "." + leaf``.

    ``prefix`` is empty or ends with a dot; ``leaf`` is one dotted component.
    """
    marker = STATE_COMPONENT + "."
    cut = name.rfind(".")
    if cut <= 0:
        return []
    leaf = name[cut + 1:]
    out = []
    start = 0
    while True:
        i = name.find(marker, start)
        if i < 0 or i + len(marker) >= cut:
            break
        if i == 0 or name[i - 1] == ".":
            out.append((name[i + len(marker):cut], name[:i], leaf))
        start = i + 1
    return out


def _state_name(prefix: str, param: str, leaf: str) -> str:
    return f"{prefix}{STATE_COMPONENT}.{param}.{leaf}"


@dataclass
class _ViewState:
    """The view while rules apply, with an index of optimizer-state names by parameter."""

    tensors: dict[str, _Tensor]
    states: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.tensors:
            self._index(name)

    def _index(self, name: str) -> None:
        for param, prefix, leaf in _state_refs(name):
            self.states.setdefault(param, {})[name] = (prefix, leaf)

    def remove(self, name: str) -> None:
        del self.tensors[name]
        for param, _, _ in _state_refs(name):
            refs = self.states.get(param)
            if refs is not None:
                refs.pop(name, None)
                if not refs:
                    del self.states[param]

    def add(self, name: str, t: _Tensor) -> None:
        self.tensors[name] = t
        self._index(name)

    def states_of(self, param: str) -> dict[tuple[str, str], str]:
        return {pl: n for n, pl in self.states.get(param, {}).items()}


# --------------------------------------------------------------------------- applying rules


@dataclass(frozen=True)
class _Step:
    """One concrete application of a rule (for ``invert``)."""

    rule: _Rule
    src: tuple[str, ...]
    dst: tuple[str, ...]
    before: tuple[_Tensor, ...]


def _expand(rule: _Rule, view: _ViewState) -> list[tuple[list[str], list[str]]]:
    """Concrete (sources, destinations) for every match of the rule's first pattern."""
    first = rule.src[0]
    if first.regex is None:
        if first.text not in view.tensors:
            if rule.optional:
                return []
            raise rule.fail(f"source name {first.text!r} is not in the view")
        names: list[str] = [first.text]
        matches: list[tuple[dict[str, str], list[str]]] = [({}, [])]
    else:
        names, matches = [], []
        for name in sorted(view.tensors):
            m = first.match(name)
            if m is not None:
                names.append(name)
                matches.append(m)
        if not matches and not rule.optional:
            raise rule.fail(f"pattern {first.text!r} matches no name in the view")
    out = []
    for name, (binds, stars) in zip(names, matches):
        try:
            src = [name] + [p.substitute(binds, stars) for p in rule.src[1:]]
            dst = [p.substitute(binds, stars) for p in rule.dst]
        except ValueError as exc:
            raise rule.fail(str(exc)) from None
        for s in src[1:]:
            if s not in view.tensors:
                raise rule.fail(f"source name {s!r} (for {name!r}) is not in the view")
        out.append((src, dst))
    return out


def _follower_groups(
    rule: _Rule, view: _ViewState, src: Sequence[str], primary: set[str]
) -> list[tuple[str, str, list[str]]]:
    """Optimizer-state names that embed the sources: ``(prefix, leaf, names per source)``."""
    per_src = [view.states_of(s) for s in src]
    keys: dict[tuple[str, str], None] = {}
    for d in per_src:
        for k, n in d.items():
            if n not in primary:
                keys.setdefault(k, None)
    groups = []
    for prefix, leaf in keys:
        names = []
        for s, d in zip(src, per_src):
            n = d.get((prefix, leaf))
            if n is None:
                raise rule.fail(
                    f"optimizer state {_state_name(prefix, src[0], leaf)!r} follows the rule, "
                    f"but {_state_name(prefix, s, leaf)!r} is missing"
                )
            names.append(n)
        groups.append((prefix, leaf, names))
    return groups


def _apply_rule(rule: _Rule, view: _ViewState, trace: list[_Step] | None) -> None:
    """Apply one rule to the view in place (all matches first, then the view updates)."""
    consumed: dict[str, None] = {}
    added: dict[str, _Tensor] = {}
    matches = _expand(rule, view)
    primary = {s for src, _ in matches for s in src}

    def emit(name: str, t: _Tensor) -> None:
        if name in added:
            raise rule.fail(f"two matches produce the same name {name!r}")
        added[name] = t

    for src, dst in matches:
        ts = [view.tensors[s] for s in src]
        outs = _run_op(rule, src, ts, len(dst))
        for name, t in zip(dst, outs):
            emit(name, t)
        consumed.update(dict.fromkeys(src))
        if trace is not None:
            trace.append(_Step(rule, tuple(src), tuple(dst), tuple(ts)))
        if rule.kind == "cast" and list(dst) == list(src):
            continue    # an in-place cast moves nothing; optimizer states keep their dtype
        for prefix, leaf, names in _follower_groups(rule, view, src, primary):
            states = [view.tensors[n] for n in names]
            consumed.update(dict.fromkeys(names))
            if rule.kind == "drop":
                continue
            out_names = [_state_name(prefix, d, leaf) for d in dst]
            if rule.kind == "cast":
                outs = states   # renamed with their parameter, never cast
            elif all(s.shape == t.shape for s, t in zip(states, ts)):
                outs = _run_op(rule, names, states, len(dst))
            else:
                # e.g. a scalar ``step``: every destination takes the first source's value
                outs = [states[0]] * len(dst)
            for name, t in zip(out_names, outs):
                emit(name, t)

    for name in added:
        if name in view.tensors and name not in consumed:
            raise rule.fail(f"target name {name!r} already exists in the view")
    for name in consumed:
        view.remove(name)
    for name, t in added.items():
        view.add(name, t)


def _inverse_rules(steps: Sequence[_Step]) -> list[dict[str, Any]]:
    """Concrete rules that undo ``steps`` (drops cannot be undone and are skipped)."""
    out: list[dict[str, Any]] = []
    for st in reversed(steps):
        r = st.rule
        if r.kind == "rename":
            out.append({"rename": {"from": st.dst[0], "to": st.src[0]}})
        elif r.kind == "fuse":
            dim = r.dim % len(st.before[0].shape)
            out.append({"split": {"from": st.dst[0], "to": list(st.src), "dim": dim,
                                  "sizes": [t.shape[dim] for t in st.before]}})
        elif r.kind == "split":
            dim = r.dim % len(st.before[0].shape)
            out.append({"fuse": {"from": list(st.dst), "to": st.src[0], "dim": dim}})
        elif r.kind in ("fuse_qkv", "split_qkv"):
            kind = "split_qkv" if r.kind == "fuse_qkv" else "fuse_qkv"
            out.append({kind: {"from": list(st.dst) if kind == "fuse_qkv" else st.dst[0],
                               "to": st.src[0] if kind == "fuse_qkv" else list(st.src),
                               "num_heads": r.num_heads, "num_kv_heads": r.num_kv_heads,
                               "dim": r.dim}})
        elif r.kind == "transpose":
            nd = len(st.before[0].shape)
            dims = r.dims if r.dims is not None else (1, 0)
            inv = [0] * nd
            for d, s in enumerate(dims):
                inv[s % nd] = d
            out.append({"transpose": {"from": st.dst[0], "to": st.src[0], "dims": inv}})
        elif r.kind == "cast":
            out.append({"cast": {"key": st.dst[0], "to": st.src[0],
                                 "dtype": st.before[0].dtype}})
    return out


class Transforms:
    """An ordered list of parsed rules; :meth:`apply` builds the :class:`View` of a checkpoint."""

    def __init__(self, rules: Sequence[_Rule]) -> None:
        self._rules = tuple(rules)

    @classmethod
    def from_rules(cls, rules: Sequence[Mapping[str, Any]]) -> "Transforms":
        """Parse and validate rule dicts (each ``{kind: {fields}}``)."""
        if isinstance(rules, Mapping) or not isinstance(rules, Sequence) or isinstance(rules, str):
            raise TransformError(f"transform rules must be a list of rule mappings, got {type(rules).__name__}")
        return cls([_parse_rule(i, r) for i, r in enumerate(rules)])

    @classmethod
    def from_yaml(cls, path_or_uri: str | os.PathLike[str],
                  storage_options: dict[str, Any] | None = None) -> "Transforms":
        """Read ``{rules: [...]}`` from a YAML file at a path or fsspec URI."""
        import fsspec  # local: keep the pure parts importable without touching fsspec

        where = os.fspath(path_or_uri)
        try:
            with fsspec.open(where, "rb", **(storage_options or {})) as fh:
                text = fh.read()
        except (OSError, ValueError) as exc:
            raise TransformError(f"cannot read transforms file {where!r}: {exc}") from exc
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TransformError(f"transforms file {where!r} is not valid YAML: {exc}") from None
        if not isinstance(doc, Mapping) or not isinstance(doc.get("rules"), list):
            raise TransformError(f"transforms file {where!r} must be a mapping with a 'rules' list")
        try:
            return cls.from_rules(doc["rules"])
        except TransformError as exc:
            raise TransformError(f"{where}: {exc}") from None

    @property
    def rules(self) -> list[dict[str, Any]]:
        """The rules as dicts (as given)."""
        return [dict(r.raw) for r in self._rules]

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"Transforms({len(self._rules)} rules)"

    def to_yaml(self) -> str:
        """The rules as a YAML document that :meth:`from_yaml` reads back."""
        return yaml.safe_dump({"rules": self.rules}, sort_keys=False, default_flow_style=None)

    def apply(self, source: SourceSpec) -> View:
        """The view of a checkpoint (name -> (shape, dtype code)) after every rule, in order."""
        return View(self._run(source, None).tensors)

    def invert(self, source: SourceSpec) -> "Transforms":
        """Concrete rules that map this transform's view back to the names of ``source``.

        Undoes rename, fuse, fuse_qkv, split, split_qkv, transpose and cast (back to the
        stored dtype); dropped tensors stay absent. Needs ``source`` for the split sizes.
        """
        trace: list[_Step] = []
        self._run(source, trace)
        return Transforms.from_rules(_inverse_rules(trace))

    def _run(self, source: SourceSpec, trace: list[_Step] | None) -> _ViewState:
        view = _ViewState({
            name: _Tensor(tuple(int(s) for s in shape), dt, dt, _leaf(name, tuple(int(s) for s in shape)))
            for name, (shape, dt) in source.items()
        })
        for rule in self._rules:
            _apply_rule(rule, view, trace)
        return view


def as_transforms(obj: Any, storage_options: dict[str, Any] | None = None) -> Transforms | None:
    """None | Transforms | list of rule dicts | ``{rules: [...]}`` | YAML path/URI -> Transforms or None."""
    if obj is None:
        return None
    if isinstance(obj, Transforms):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return Transforms.from_yaml(obj, storage_options)
    if isinstance(obj, Mapping):
        if not isinstance(obj.get("rules"), list):
            raise TransformError("a transforms mapping must have a 'rules' list")
        return Transforms.from_rules(obj["rules"])
    if isinstance(obj, (list, tuple)):
        return Transforms.from_rules(list(obj))
    raise TransformError(
        f"transforms must be None, sc.Transforms, a list of rules or a YAML path/URI; "
        f"got {type(obj).__name__}"
    )
