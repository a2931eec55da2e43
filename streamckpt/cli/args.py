"""The command line's value parsers (argparse ``type=``): sizes, durations, key=value storage
options, retention rules. Each raises ``argparse.ArgumentTypeError`` so the error shows the
command's own usage."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Sequence


def key_value(pair: str) -> str:
    """argparse ``type`` of ``--storage-option``: refuses a pair without ``key=`` while
    the command's own parser reads it (so the error shows that command's usage)."""
    key, sep, _ = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expects key=value, got {pair!r}")
    return pair


def positive_int(text: str) -> int:
    """argparse ``type`` for counts (ranks, repetitions): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type`` for sizes given as a number (``--size-mb``): a float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def parse_storage_options(pairs: Sequence[str], endpoint_url: str | None = None,
                          flag: str = "--storage-option") -> dict[str, Any]:
    """``["a=1", "client_kwargs.region_name=x"]`` -> ``{"a": 1, "client_kwargs": {"region_name": "x"}}``."""
    opts: dict[str, Any] = {}
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{flag} expects key=value, got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = opts
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise argparse.ArgumentTypeError(f"{flag} {key!r}: {part!r} is already a value")
        node[parts[-1]] = value
    return opts


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500MB`` (10^6), ``5GiB`` (2^30), ``2G`` (2^30)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGT".index(unit) + 1 if unit else 0
    bare = unit and not binary and not text.strip().upper().endswith("B")
    base = 1024 if (binary or bare) else 1000
    value = int(number * base ** power)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_keep_best(text: str) -> tuple[str, str, int]:
    """argparse ``type`` for ``--keep-best``: ``METRIC:min|max:K``, as ``keep_best=(metric, mode, k)``."""
    metric, _, rest = text.rpartition(":")
    metric, _, mode = metric.rpartition(":")
    try:
        k = int(rest)
    except ValueError:
        k = 0
    if not metric or mode not in ("min", "max") or k < 1:
        raise argparse.ArgumentTypeError(f"not METRIC:min|max:K: {text!r} (e.g. loss:min:3, accuracy:max:1)")
    return metric, mode, k


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``1h``, ``2d``."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 30m, 1h, 2d)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[(m.group(2) or "s").lower()]
