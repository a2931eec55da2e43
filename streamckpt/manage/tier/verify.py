"""Checking a rank's copy of a local file before any load trusts it: its size, every chunk's
CRC32C, and every shard's xxh3-128 digest, against the step's local manifest.

A local disk is no object store with its own end-to-end checks, and a copy that arrived
from a peer passed through another machine's memory: a file is held only when all of it
checks out. Reads go through the file system page by page; nothing holds a whole file.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Sequence

import xxhash
import zstandard

from ...core.checksum import crc32c
from ...core.manifest import Shard


def check_file(path: Path, size: int, shards: Sequence[tuple[str, int, Shard]]) -> str | None:
    """None when ``path`` holds ``size`` bytes and every shard in it passes; else why not."""
    try:
        actual = path.stat().st_size
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if actual != size:
        return f"{path} is {actual} bytes, the local manifest records {size}"
    dctx = zstandard.ZstdDecompressor()
    try:
        with open(path, "rb") as f:
            for key, itemsize, s in shards:
                why = _check_shard(f, key, itemsize, s, dctx)
                if why is not None:
                    return f"{path}: {why}"
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


def _check_shard(f: BinaryIO, key: str, itemsize: int, s: Shard, dctx: zstandard.ZstdDecompressor) -> str | None:
    if not s.chunk_size or s.crc32c is None or s.digest is None:
        return f"shard of {key!r} at {list(s.offset)} has no checksums or digest (not a tier file)"
    raw_total = s.numel * itemsize
    hasher = xxhash.xxh3_128()
    f.seek(s.byte_offset)
    for c, crc in enumerate(s.crc32c):
        raw = min(s.chunk_size, raw_total - c * s.chunk_size)
        n = s.frame_lengths[c] if s.frame_lengths is not None else raw
        data = f.read(n)
        if len(data) != n or crc32c(data) != crc:
            return f"chunk {c} of the shard of {key!r} at {list(s.offset)} fails its CRC32C"
        if s.codec == "zstd":
            try:
                data = dctx.decompress(data, max_output_size=raw)
            except zstandard.ZstdError as e:
                return f"chunk {c} of the shard of {key!r} does not decode ({e})"
        hasher.update(data)
    if hasher.hexdigest() != s.digest:
        return f"the shard of {key!r} at {list(s.offset)} does not match its digest"
    return None


__all__ = ["check_file"]
