"""One new object made of byte ranges of others, copied inside the store where it can.

Compaction (``manage.compaction``) keeps the bytes of a file that kept checkpoints still
reference and drops the rest. On S3 the ranges are copied by the server (a multipart upload
whose parts are ``UploadPartCopy`` requests with ``CopySourceRange``: no byte passes through
this process). S3 wants every part but the last to hold at least 5 MiB, so ranges shorter
than that are read and uploaded by this process, gathered into parts of their own at the end
of the object. Other stores (local files, GCS, whose rewrite/compose calls copy whole objects
only, Azure) get every range through this process, one range in memory at a time.

The result says how many bytes went through this process, so callers can report it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import StorageError
from .store import Storage

log = logging.getLogger(__name__)

MIN_PART = 5 << 20  # S3's smallest part but the last


@dataclass(frozen=True, slots=True)
class Range:
    """Bytes ``[start, stop)`` of object ``name`` (relative to the storage's root)."""

    name: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Composed:
    """Where each range landed in the new object (same order as given), and what it cost."""

    offsets: list[int]
    size: int
    client_bytes: int  # bytes read and written by this process (0: all copied by the server)
    server_bytes: int  # bytes the store copied itself


def layout(ranges: Sequence[Range], server_side: bool) -> tuple[list[int], list[int]]:
    """The order ranges are written in (indices) and each range's offset in the new object.
    With a server-side copy, ranges of at least ``MIN_PART`` come first (each its own part), the
    shorter ones after them (gathered into parts this process uploads); else the given order."""
    order = list(range(len(ranges)))
    if server_side:
        order = [i for i in order if ranges[i].length >= MIN_PART] + [i for i in order if ranges[i].length < MIN_PART]
    offsets = [0] * len(ranges)
    at = 0
    for i in order:
        offsets[i] = at
        at += ranges[i].length
    return order, offsets


def compose(storage: Storage, out: str, ranges: Sequence[Range]) -> Composed:
    """Write ``out`` as the concatenation of ``ranges`` (see the module docstring)."""
    s3 = storage.is_s3
    order, offsets = layout(ranges, s3)
    size = sum(r.length for r in ranges)
    if s3 and any(r.length >= MIN_PART for r in ranges):
        client = _compose_s3(storage, out, [ranges[i] for i in order])
    else:
        client = _compose_through(storage, out, [ranges[i] for i in order])
    log.info("composed %s from %d range(s): %d bytes, %d through this process", storage.describe(out), len(ranges),
             size, client)
    return Composed(offsets, size, client, size - client)


def _compose_through(storage: Storage, out: str, ranges: Sequence[Range]) -> int:
    """Every range read here and streamed into ``out``; returns the bytes moved."""
    with storage.open_write(out, size_hint=sum(r.length for r in ranges)) as up:
        for r in ranges:
            up.write(storage.read_bytes(r.name, r.start, r.stop))  # committed on leaving the block
    return sum(r.length for r in ranges)


def _compose_s3(storage: Storage, out: str, ranges: Sequence[Range]) -> int:
    """A multipart upload: ranges of ``MIN_PART`` or more copied by S3 (UploadPartCopy), the
    shorter ones (at the end, see ``layout``) read here and uploaded as parts of ``MIN_PART`` or
    more (the last one shorter): one part in memory at a time. Aborted on any failure: no
    partial object is ever visible."""
    from fsspec.asyn import sync

    fs = storage.fs
    bucket, _, key = storage.path(out).partition("/")

    def call(method: str, **kw: Any) -> Any:
        return sync(fs.loop, fs._call_s3, method, Bucket=bucket, Key=key, **kw)

    try:
        uid = call("create_multipart_upload")["UploadId"]
    except OSError as e:  # s3fs's translation of the service's errors
        raise StorageError(f"starting the upload of {storage.describe(out)} failed: {e}") from e
    parts: list[dict[str, Any]] = []
    client = 0
    try:
        pending = bytearray()
        for r in ranges:
            if r.length >= MIN_PART:
                src_bucket, _, src_key = storage.path(r.name).partition("/")
                got = call("upload_part_copy", UploadId=uid, PartNumber=len(parts) + 1,
                           CopySource={"Bucket": src_bucket, "Key": src_key},
                           CopySourceRange=f"bytes={r.start}-{r.stop - 1}")
                parts.append({"PartNumber": len(parts) + 1, "ETag": got["CopyPartResult"]["ETag"]})
                continue
            pending += storage.read_bytes(r.name, r.start, r.stop)
            client += r.length
            if len(pending) >= MIN_PART:
                got = call("upload_part", UploadId=uid, PartNumber=len(parts) + 1, Body=bytes(pending))
                parts.append({"PartNumber": len(parts) + 1, "ETag": got["ETag"]})
                pending.clear()
        if pending:
            got = call("upload_part", UploadId=uid, PartNumber=len(parts) + 1, Body=bytes(pending))
            parts.append({"PartNumber": len(parts) + 1, "ETag": got["ETag"]})
        call("complete_multipart_upload", UploadId=uid, MultipartUpload={"Parts": parts})
        return client
    except BaseException as e:
        try:
            call("abort_multipart_upload", UploadId=uid)
        except Exception as abort_error:  # noqa: BLE001 - the first error is the one to raise
            log.warning("could not abort the upload of %s: %s", storage.describe(out), abort_error)
        if isinstance(e, OSError):
            raise StorageError(f"copying ranges into {storage.describe(out)} failed: {e}") from e
        raise
