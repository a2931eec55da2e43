"""A self-contained copy of a streamckpt checkpoint (``sc.copy``, ``streamckpt copy``).

Every file the manifest lists is copied, the files an incremental checkpoint references in
sibling checkpoints included (renamed ``shared/<sibling>/...`` in the copy), then the
manifest, rewritten without references (format version 1), is written last: the copy
commits like a save. Each file is streamed in blocks of about ``BLOCK`` bytes cut at
checksum-chunk boundaries, and every chunk's CRC32C is checked as it passes, by the read
policy loads use (``Storage.read_into``: a mismatch is fetched again, the same wrong
content again is a ``CorruptCheckpointError``), so memory stays
bounded and the copy never holds bytes its source's checksums reject.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from ..core import manifest as mf
from ..errors import CheckpointError, CheckpointExistsError
from ..formats import read_manifest
from ..formats.native import read_native_bytes
from ..storage import RangeRead, Storage

log = logging.getLogger(__name__)

BLOCK = 8 << 20  # bytes read and written at a time (rounded up to whole checksum chunks)


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    stop: int
    crc: int


def _chunks(m: mf.Manifest) -> dict[str, list[_Chunk]]:
    """Every file's checksummed byte ranges, in file order."""
    out: dict[str, list[_Chunk]] = {name: [] for name in m.files}
    for t in m.tensors.values():
        for s in t.shards:
            if s.crc32c is None:
                continue
            offsets = s.frame_offsets()
            ends = offsets[1:] + [s.byte_offset + s.byte_length]
            out[s.file] += [_Chunk(a, b, c) for a, b, c in zip(offsets, ends, s.crc32c)]
    return {name: sorted(found, key=lambda c: c.start) for name, found in out.items()}


def _blocks(size: int, chunks: list[_Chunk]) -> list[tuple[int, int, list[_Chunk]]]:
    """``(start, stop, chunks inside)`` covering ``[0, size)``, each about ``BLOCK`` bytes (a
    block ends after the last chunk it starts, so no chunk is ever cut)."""
    out: list[tuple[int, int, list[_Chunk]]] = []
    pos, i = 0, 0
    while pos < size:
        end = min(size, pos + BLOCK)
        inside: list[_Chunk] = []
        while i < len(chunks) and chunks[i].start < end:
            inside.append(chunks[i])
            end = max(end, chunks[i].stop)
            i += 1
        out.append((pos, end, inside))
        pos = end
    return out


def _verified(src: Storage, name: str, start: int, stop: int, chunks: list[_Chunk]) -> bytearray:
    """Bytes ``[start, stop)`` of ``name``, each chunk checked against its CRC32C by the read
    policy every load uses (a mismatch is fetched again; the same wrong content again is a
    ``CorruptCheckpointError`` naming the object and range)."""
    buf = bytearray(stop - start)
    checks = tuple((c.start - start, c.stop - c.start, c.crc) for c in chunks)
    src.read_into([RangeRead(name, start, stop, checks)], [memoryview(buf)]).result()
    return buf


def _copy_name(name: str) -> str:
    ref = mf.split_reference(name)
    return name if ref is None else f"shared/{ref[0]}/{ref[1]}"


def copy_checkpoint(uri: str, out_uri: str, *, storage_options: dict[str, Any] | None = None,
                    out_storage_options: dict[str, Any] | None = None) -> mf.Manifest:
    """Copy the checkpoint at ``uri`` to ``out_uri`` self-contained; return the copy's manifest.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``uri``.
        CheckpointExistsError: a committed checkpoint is at ``out_uri``.
        CorruptCheckpointError: a source chunk fails its checksum again when fetched again, or a bad manifest.
        StorageError: storage kept failing after retries.
    """
    t0 = time.perf_counter()
    src = Storage(uri, storage_options)
    dst = Storage(out_uri, storage_options if out_storage_options is None else out_storage_options)
    try:
        if src.describe("") == dst.describe(""):
            raise CheckpointError(f"copy {uri} onto itself: pass another destination")
        m = mf.from_json(_native_manifest(src), where=src.describe(mf.MANIFEST_NAME))
        if dst.modified(mf.MANIFEST_NAME) is not None:
            raise CheckpointExistsError(f"{dst.describe(mf.MANIFEST_NAME)} exists: a committed checkpoint is there; "
                                        f"delete it first or copy elsewhere")
        chunks = _chunks(m)
        for name, size in m.files.items():
            with dst.open_write(_copy_name(name), size_hint=size) as up:
                for start, stop, inside in _blocks(size, chunks[name]):
                    up.write(_verified(src, name, start, stop, inside))
        tensors = {k: replace(t, shards=tuple(replace(s, file=_copy_name(s.file)) for s in t.shards))
                   for k, t in m.tensors.items()}
        out = replace(m, tensors=tensors, files={_copy_name(n): size for n, size in m.files.items()}, bases=())
        mf.validate(out, where=f"copy to {dst.describe('')}")
        dst.write_bytes(mf.MANIFEST_NAME, mf.to_json(out))
        log.info("copied %s to %s: %d files, %d bytes, %.2f s", src.describe(""), dst.describe(""), len(m.files),
                 sum(m.files.values()), time.perf_counter() - t0)
        return out
    finally:
        src.close()
        dst.close()


def _native_manifest(src: Storage) -> bytes:
    """The streamckpt manifest's bytes; without one, why: no checkpoint at all (the loader's
    words: a run prefix, a path that does not exist), or one of another kind."""
    raw = read_native_bytes(src)
    if raw is not None:
        return raw
    other = read_manifest(src)  # raises CheckpointNotFoundError, with what is there instead
    raise CheckpointError(
        f"{src.describe('')} holds a {other.kind} checkpoint, and copy copies streamckpt checkpoints (manifest.json): "
        f"sc.merge(uri, out_uri) writes any checkpoint as Hugging Face safetensors; or copy its files with the "
        f"store's own tools")
