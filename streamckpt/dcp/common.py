"""What the DCP reader and writer share: their defaults and the URI check DCP asks of a plug-in."""

from __future__ import annotations

import os

import fsspec

MEMORY_BUDGET = 256 << 20  # bytes fetched per batch of read items
GAP_BYTES = 16 << 10  # an unchecked gap this small is read through rather than costing a request


def valid_uri(checkpoint_id: str | os.PathLike) -> bool:
    """A path or a URL whose protocol fsspec knows."""
    try:
        proto = fsspec.core.split_protocol(os.fspath(checkpoint_id))[0]
    except TypeError:
        return False
    return proto is None or proto in fsspec.available_protocols()
