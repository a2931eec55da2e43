"""Reading every stored byte of a checkpoint and checking it (``streamckpt verify``).

Verification is independent of any state_dict: every shard of every tensor is read
in bounded batches (whole chunks, so every CRC32C is checked), every zstd frame is
decoded and its size checked, and every data object's size is compared with the
manifest. The first defect raises ``CorruptCheckpointError`` naming the object
and byte range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CorruptCheckpointError

VERIFY_BATCH_BYTES = 64 << 20
VERIFY_PIECE_BYTES = 16 << 20



@dataclass(slots=True)
class VerifyReport:
    """What ``verify`` read and checked."""

    uri: str
    kind: str
    files: int
    shards: int
    bytes_read: int
    requests: int
    checksums: int
    frames_decoded: int
    seconds: float


def _shard_reads(s: Any, itemsize: int) -> list[tuple[int, int, tuple[tuple[int, int, int], ...], list[int]]]:
    """(start, stop, checks, raw frame lengths) pieces covering one shard's stored bytes."""
    raw_total = s.numel * itemsize
    if s.chunk_size == 0:
        out = []
        for a in range(s.byte_offset, s.byte_offset + s.byte_length, VERIFY_PIECE_BYTES):
            out.append((a, min(a + VERIFY_PIECE_BYTES, s.byte_offset + s.byte_length), (), []))
        return out
    nchunks = len(s.crc32c or ())
    stored = list(s.frame_lengths) if s.frame_lengths is not None else [
        min(s.chunk_size, raw_total - c * s.chunk_size) for c in range(nchunks)]
    raws = [min(s.chunk_size, raw_total - c * s.chunk_size) for c in range(nchunks)]
    out, start, checks, frames, pos = [], s.byte_offset, [], [], s.byte_offset
    for c in range(nchunks):
        if checks and pos + stored[c] - start > VERIFY_PIECE_BYTES:
            out.append((start, pos, tuple(checks), frames))
            start, checks, frames = pos, [], []
        checks.append((pos - start, stored[c], s.crc32c[c]))
        frames.append(raws[c] if s.codec == "zstd" else -1)
        pos += stored[c]
    if checks or not out:
        out.append((start, pos, tuple(checks), frames))
    return out


def verify_checkpoint(uri: str, *, storage_options: dict[str, Any] | None = None,
                      progress: Callable[[int], None] | None = None,
                      on_total: Callable[[int], None] | None = None) -> VerifyReport:
    """Read every stored byte of every tensor and check every checksum (and that
    every zstd frame decodes to its size); raises on the first bad object."""
    import zstandard

    from ..formats import read_manifest
    from ..storage import RangeRead, Storage

    t0 = time.perf_counter()
    storage = Storage(uri, storage_options)
    try:
        m = read_manifest(storage)
        for name, size in m.files.items():
            actual = storage.size(name)
            if actual != size:
                raise CorruptCheckpointError(
                    f"{storage.describe(name)} is {actual} bytes, the checkpoint records {size} "
                    f"({'truncated' if actual < size else 'extended'})"
                )
        shards = sorted(((s, t.itemsize) for t in m.tensors.values() for s in t.shards),
                        key=lambda x: (x[0].file, x[0].byte_offset))
        pieces = [(s.file, *p) for s, size in shards for p in _shard_reads(s, size) if p[1] > p[0]]
        if on_total is not None:
            on_total(sum(p[2] - p[1] for p in pieces))
        dctx = zstandard.ZstdDecompressor()
        report = VerifyReport(storage.describe("").rstrip("/"), m.kind, len(m.files), len(shards), 0, 0, 0, 0, 0.0)
        batch: list[tuple[Any, ...]] = []
        for i, piece in enumerate(pieces):
            batch.append(piece)
            if sum(p[2] - p[1] for p in batch) >= VERIFY_BATCH_BYTES or i == len(pieces) - 1:
                _verify_batch(storage, batch, dctx, report, RangeRead)
                if progress is not None:
                    progress(sum(p[2] - p[1] for p in batch))
                batch = []
        report.seconds = time.perf_counter() - t0
        return report
    finally:
        storage.close()


def _verify_batch(storage: Any, batch: list[tuple[Any, ...]], dctx: Any, report: VerifyReport, RangeRead: Any) -> None:
    import zstandard

    reads = [RangeRead(f, a, b, checks) for f, a, b, checks, _ in batch]
    bufs = [bytearray(r.length) for r in reads]
    report.requests += storage.read_into(reads, [memoryview(b) for b in bufs]).result()
    for (f, a, _b, checks, frames), buf in zip(batch, bufs):
        report.bytes_read += len(buf)
        report.checksums += len(checks)
        for (off, length, _crc), raw_len in zip(checks, frames):
            if raw_len < 0:
                continue
            try:
                data = dctx.decompress(bytes(buf[off:off + length]), max_output_size=raw_len)
            except zstandard.ZstdError as e:
                raise CorruptCheckpointError(
                    f"{storage.describe(f)} bytes [{a + off}, {a + off + length}): zstd frame does not decode ({e})"
                ) from None
            if len(data) != raw_len:
                raise CorruptCheckpointError(
                    f"{storage.describe(f)} bytes [{a + off}, {a + off + length}): zstd frame decodes to "
                    f"{len(data)} bytes, expected {raw_len}"
                )
            report.frames_decoded += 1
