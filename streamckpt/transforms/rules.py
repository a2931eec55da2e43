"""Parsing and validating one transform rule (``{kind: {fields}}``) into a :class:`Rule`.

Every error is a :class:`TransformError` that names the rule by index and text, so a
user can find the offending line of a YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import yaml

from ..core import dtypes
from ..errors import CheckpointError, TransformError
from .patterns import Pattern

FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
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
_QKV = {"fuse_qkv", "split_qkv"}

_DTYPE_ALIASES = {
    "fp64": "F64", "f64": "F64", "float64": "F64", "double": "F64",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "bf16": "BF16", "bfloat16": "BF16",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32",
    "int16": "I16", "short": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}

Fail = Callable[[str], TransformError]


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


def _failer(index: int, text: str) -> Fail:
    def fail(message: str) -> TransformError:
        return TransformError(f"transform rule #{index} {text}: {message}")
    return fail


@dataclass(frozen=True)
class Rule:
    """One parsed rule; ``fail`` builds a TransformError that names it."""

    index: int
    kind: str
    text: str
    raw: dict[str, Any]
    src: tuple[Pattern, ...]
    dst: tuple[Pattern, ...]
    dim: int = 0
    sizes: tuple[int, ...] | None = None
    dims: tuple[int, ...] | None = None
    dtype: str | None = None
    num_heads: int = 0
    num_kv_heads: int = 0
    optional: bool = False

    def fail(self, message: str) -> TransformError:
        return _failer(self.index, self.text)(message)


def _rule_text(rule: Any) -> str:
    try:
        return yaml.safe_dump(rule, default_flow_style=True, sort_keys=False, width=10_000).strip()
    except yaml.YAMLError:
        return repr(rule)


def _as_int(fail: Fail, key: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"'{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise fail(f"'{key}' must be >= {minimum}, got {value}")
    return value


def _check_fields(fail: Fail, rule: Any) -> tuple[str, Mapping[str, Any]]:
    """``(kind, body)`` of a rule whose kind and field names are known and complete."""
    if not isinstance(rule, Mapping) or len(rule) != 1:
        raise fail(f"a rule is a mapping with one key, one of {', '.join(FIELDS)}")
    (kind, body), = rule.items()
    if kind not in FIELDS:
        raise fail(f"unknown rule {kind!r}; known rules: {', '.join(FIELDS)}")
    if not isinstance(body, Mapping):
        raise fail(f"the body of {kind!r} must be a mapping of fields")
    required, optional = FIELDS[kind]
    allowed = required | optional | {"optional"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise fail(f"unknown field(s) {unknown}; {kind!r} takes {sorted(allowed)}")
    missing = sorted(required - set(body))
    if missing:
        raise fail(f"missing field(s) {missing}")
    if "key" in body and "from" in body:
        raise fail("give 'key' or 'from', not both")
    return kind, body


def _source_names(fail: Fail, kind: str, body: Mapping[str, Any]) -> list[str]:
    src_raw = body.get("from", body.get("key"))
    if src_raw is None:
        raise fail("missing field 'key' (or 'from')")
    if kind not in _MULTI_FROM:
        if not isinstance(src_raw, str):
            raise fail("'from'/'key' must be one name (a string)")
        return [src_raw]
    if not isinstance(src_raw, list) or not src_raw:
        raise fail("'from' must be a non-empty list of names")
    if kind == "fuse_qkv" and len(src_raw) != 3:
        raise fail("'from' must list exactly three names: q, k, v")
    return list(src_raw)


def _target_names(fail: Fail, kind: str, body: Mapping[str, Any], first_src: str) -> list[str]:
    dst_raw = body.get("to")
    if kind in _MULTI_TO:
        if not isinstance(dst_raw, list) or not dst_raw:
            raise fail("'to' must be a non-empty list of names")
        if kind == "split_qkv" and len(dst_raw) != 3:
            raise fail("'to' must list exactly three names: q, k, v")
        return list(dst_raw)
    if kind == "drop":
        return []
    if dst_raw is None:
        return [first_src]     # transpose / cast in place
    if not isinstance(dst_raw, str):
        raise fail("'to' must be one name (a string)")
    return [dst_raw]


def _patterns(fail: Fail, src_list: list[str], dst_list: list[str]) -> tuple[tuple[Pattern, ...], tuple[Pattern, ...]]:
    """Compiled patterns; every later pattern uses only what the first ``from`` binds."""
    try:
        src = tuple(Pattern.parse(s) for s in src_list)
        dst = tuple(Pattern.parse(s) for s in dst_list)
    except ValueError as exc:
        raise fail(str(exc)) from None
    first = src[0]
    for p in src[1:] + dst:
        extra = sorted(set(p.variables) - set(first.variables))
        if extra:
            raise fail(f"placeholder(s) {extra} in {p.text!r} are not bound by {first.text!r}")
        if p.stars > first.stars:
            raise fail(f"{p.text!r} has more '*' than {first.text!r}")
    return src, dst


def _options(fail: Fail, kind: str, body: Mapping[str, Any], n_dst: int) -> dict[str, Any]:
    """The rule's scalar fields (optional, dim, head counts, sizes, dims, dtype), validated."""
    opt = body.get("optional", False)
    if not isinstance(opt, bool):
        raise fail(f"'optional' must be true or false, got {opt!r}")
    kw: dict[str, Any] = {"optional": opt}
    if "dim" in body:
        kw["dim"] = _as_int(fail, "dim", body["dim"])
    if kind in _QKV:
        kw["num_heads"] = _as_int(fail, "num_heads", body["num_heads"], minimum=1)
        kw["num_kv_heads"] = _as_int(fail, "num_kv_heads", body["num_kv_heads"], minimum=1)
        if kw["num_heads"] % kw["num_kv_heads"]:
            raise fail(f"num_heads={kw['num_heads']} is not a multiple of "
                       f"num_kv_heads={kw['num_kv_heads']}")
    if body.get("sizes") is not None:
        sizes = body["sizes"]
        if not isinstance(sizes, list) or len(sizes) != n_dst:
            raise fail(f"'sizes' must list one size per 'to' name ({n_dst})")
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
    return kw


def parse_rule(index: int, rule: Any) -> Rule:
    """Rule number ``index`` of a list, validated; TransformError names it on bad input."""
    text = _rule_text(rule)
    fail = _failer(index, text)
    kind, body = _check_fields(fail, rule)
    src_list = _source_names(fail, kind, body)
    dst_list = _target_names(fail, kind, body, src_list[0])
    src, dst = _patterns(fail, src_list, dst_list)
    kw = _options(fail, kind, body, len(dst_list))
    return Rule(index, kind, text, dict(rule), src, dst, **kw)
