"""Copies of streamckpt checkpoints (``sc.copy``, ``streamckpt copy``): one checkpoint, or a run.

One checkpoint is copied self-contained:

Every file the manifest lists is copied, the files an incremental checkpoint references in
sibling checkpoints included (renamed ``shared/<sibling>/...`` in the copy), then the
manifest, rewritten without references (format version 1), is written last: the copy
commits like a save. Each file is streamed in blocks of about ``BLOCK`` bytes cut at
checksum-chunk boundaries, and every chunk's CRC32C is checked as it passes, by the read
policy loads use (``Storage.read_into``: a mismatch is fetched again, the same wrong
content again is a ``CorruptCheckpointError``), so memory stays
bounded and the copy never holds bytes its source's checksums reject.

A run's root (no manifest of its own, committed checkpoints under it) is copied whole: every
object a committed manifest lists, under the same names, so an incremental checkpoint's
references stay shared in the copy (a pruned base's files come along, its checkpoint does
not), checked the same way; then the manifests, unchanged, oldest step first. A checkpoint
whose manifest cannot be read is left out with a warning (``CopyResult.skipped``).
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
from ..results import CopyResult
from ..storage import RangeRead, Storage
from ..storage.store import out_options
from .index import Index

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
                    out_storage_options: dict[str, Any] | None = None) -> CopyResult:
    """Copy the checkpoint at ``uri`` to ``out_uri`` self-contained, or the run at ``uri`` whole.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``uri`` nor under it.
        CheckpointExistsError: a committed checkpoint is at ``out_uri`` (of a run: under it, by a name copied).
        CorruptCheckpointError: a source chunk fails its checksum again when fetched again, or a bad manifest.
        StorageError: storage kept failing after retries.
    """
    t0 = time.perf_counter()
    src = Storage(uri, storage_options)
    dst = Storage(out_uri, out_options(out_uri, storage_options, out_storage_options))
    try:
        here, there = src.describe(""), dst.describe("")
        if here == there or there.startswith(here.rstrip("/") + "/"):
            raise CheckpointError(f"copy {uri} into {out_uri}: the destination is the source or inside it; "
                                  f"pass a destination outside {uri}")
        raw = read_native_bytes(src)
        if raw is None:
            listing = Index().list(src)
            if listing.entries:
                return _copy_run(src, dst, listing, uri, out_uri, t0)
            raw = _native_manifest(src)  # raises: nothing there, or a checkpoint of another kind
        return _copy_one(src, dst, raw, uri, out_uri, t0)
    finally:
        src.close()
        dst.close()


def _copy_one(src: Storage, dst: Storage, raw: bytes, uri: str, out_uri: str, t0: float) -> CopyResult:
    m = mf.from_json(raw, where=src.describe(mf.MANIFEST_NAME))
    if dst.modified(mf.MANIFEST_NAME) is not None:
        raise CheckpointExistsError(f"{dst.describe(mf.MANIFEST_NAME)} exists: a committed checkpoint is there; "
                                    f"delete it first or copy elsewhere")
    chunks = _chunks(m)
    for name, size in m.files.items():
        _copy_file(src, dst, name, _copy_name(name), size, chunks[name])
    tensors = {k: replace(t, shards=tuple(replace(s, file=_copy_name(s.file)) for s in t.shards))
               for k, t in m.tensors.items()}
    out = replace(m, tensors=tensors, files={_copy_name(n): size for n, size in m.files.items()}, bases=())
    mf.validate(out, where=f"copy to {dst.describe('')}")
    data = mf.to_json(out)
    dst.write_bytes(mf.MANIFEST_NAME, data)
    files = sorted(out.files) + [mf.MANIFEST_NAME]
    return _done(src, dst, CopyResult(uri, out_uri, [""], files, sum(m.files.values()) + len(data),
                                      time.perf_counter() - t0))


def _copy_run(src: Storage, dst: Storage, listing: Any, uri: str, out_uri: str, t0: float) -> CopyResult:
    """Every committed checkpoint under the root (see the module docstring)."""
    readable = [e for e in listing.entries if e.error is None]
    skipped = [(e.name, e.error) for e in listing.entries if e.error is not None]
    for name, why in skipped:
        log.warning("copy of the run %s leaves out %s: its manifest cannot be read (%s)", src.describe(""), name, why)
    taken = [e.name for e in readable if dst.modified(f"{e.name}/{mf.MANIFEST_NAME}") is not None]
    if taken:
        raise CheckpointExistsError(f"{dst.describe('')} already holds committed checkpoints of the same names "
                                    f"({', '.join(taken)}); copy the run into an empty prefix")
    manifests: dict[str, bytes] = {}
    chunks: dict[str, dict[int, _Chunk]] = {}
    sizes: dict[str, int] = {}
    for e in readable:
        raw = src.read_bytes(f"{e.name}/{mf.MANIFEST_NAME}", max_bytes=mf.MAX_MANIFEST_BYTES)
        m = mf.from_json(raw, where=src.describe(f"{e.name}/{mf.MANIFEST_NAME}"))
        manifests[e.name] = raw
        for name, found in _chunks(m).items():
            at_root = _at_root(e.name, name)
            sizes[at_root] = m.files[name]
            chunks.setdefault(at_root, {}).update((c.start, c) for c in found)
    for name in sorted(sizes):
        _copy_file(src, dst, name, name, sizes[name], sorted(chunks[name].values(), key=lambda c: c.start))
    order = sorted(readable, key=lambda e: (e.step is None, e.step or 0, e.committed_ns))
    for e in order:  # the commits, last: oldest step first, so `latest` moves forward as they land
        dst.write_bytes(f"{e.name}/{mf.MANIFEST_NAME}", manifests[e.name])
    files = sorted(sizes) + [f"{e.name}/{mf.MANIFEST_NAME}" for e in order]
    total = sum(sizes.values()) + sum(len(b) for b in manifests.values())
    return _done(src, dst, CopyResult(uri, out_uri, [e.name for e in order], files, total, time.perf_counter() - t0,
                                      skipped))


def _at_root(child: str, name: str) -> str:
    """A manifest's file name as seen from the run's root (a reference resolved to its sibling)."""
    ref = mf.split_reference(name)
    return f"{child}/{name}" if ref is None else f"{ref[0]}/{ref[1]}"


def _copy_file(src: Storage, dst: Storage, name: str, out_name: str, size: int, chunks: list[_Chunk]) -> None:
    with dst.open_write(out_name, size_hint=size) as up:
        for start, stop, inside in _blocks(size, chunks):
            up.write(_verified(src, name, start, stop, inside))


def _done(src: Storage, dst: Storage, result: CopyResult) -> CopyResult:
    log.info("copied %s to %s: %d checkpoint(s), %d files, %d bytes, %.2f s", src.describe(""), dst.describe(""),
             len(result.checkpoints), len(result.files), result.bytes_written, result.seconds)
    return result


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
