"""S3 through s3fs/botocore: ranged GETs streamed straight into the caller's buffer,
whole small objects with their ETag, and multipart uploads whose parts may be in
flight at the same time (each with its Content-MD5, computed off the event loop).

botocore's own retries ("standard" mode, ``client_attempts``) handle status-level
errors; s3fs's retry loop is switched off so attempts do not multiply.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any, Sequence

from .backend import Fetched, NotFound, PartSink, TooLarge, Transient
from .fsspec_backend import FsspecBackend, classified

MIN_PART = 5 << 20  # S3's smallest multipart part (all but the last)


def s3fs_options(opts: dict[str, Any], client_attempts: int, request_timeout: float,
                 max_concurrency: int) -> dict[str, Any]:
    """A private s3fs instance whose client retries a little and times out on stalls."""
    opts = dict(opts)
    opts.setdefault("skip_instance_cache", True)
    ck = dict(opts.get("config_kwargs") or {})
    ck.setdefault("retries", {"total_max_attempts": client_attempts, "mode": "standard"})
    ck.setdefault("connect_timeout", request_timeout)
    ck.setdefault("read_timeout", request_timeout)
    ck.setdefault("max_pool_connections", max(10, max_concurrency))
    opts["config_kwargs"] = ck
    return opts


def _content_range_total(value: Any) -> int | None:
    """The total object size from a ``Content-Range: bytes a-b/total`` header."""
    if isinstance(value, str) and "/" in value:
        total = value.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    return None


class S3fsBackend(FsspecBackend):
    name = "s3fs"

    def __init__(self, fs: Any, request_timeout: float, max_concurrency: int) -> None:
        super().__init__(fs, request_timeout, max_concurrency)
        fs.retries = 1  # s3fs's own loop would multiply the client's attempts

    async def call_s3(self, path: str, method: str, **kwargs: Any) -> Any:
        bucket, key, _ = self.fs.split_path(path)
        return await classified(path, self.fs._call_s3(method, Bucket=bucket, Key=key, **kwargs), self.request_timeout)

    async def open_uploads(self, path: str) -> list[tuple[str, str, float | None]]:
        """``(bucket/key, upload id, initiated POSIX seconds)`` of every incomplete multipart
        upload under the prefix ``path`` (ListMultipartUploads, page by page)."""
        bucket, prefix, _ = self.fs.split_path(path)
        out: list[tuple[str, str, float | None]] = []
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            resp = await classified(path, self.fs._call_s3("list_multipart_uploads", **args), self.request_timeout)
            for up in resp.get("Uploads", []):
                when = up.get("Initiated")
                out.append((f"{bucket}/{up['Key']}", up["UploadId"], when.timestamp() if when is not None else None))
            if not resp.get("IsTruncated"):
                return out
            args.update(KeyMarker=resp.get("NextKeyMarker", ""), UploadIdMarker=resp.get("NextUploadIdMarker", ""))

    async def abort_upload(self, path: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload of the object ``path``."""
        await self.call_s3(path, "abort_multipart_upload", UploadId=upload_id)

    async def delete_one(self, path: str) -> None:
        """One DeleteObject (s3fs's ``rm`` posts a bulk delete, which some S3 servers lack)."""
        await self.call_s3(path, "delete_object")

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        """A ranged GET streamed straight into ``buf``; the client's chunks are the only copy."""
        return await self._get(path, start, [buf])

    async def fetch_parts(self, path: str, start: int, bufs: Sequence[memoryview], *,
                          want_meta: bool = False) -> Fetched:
        return await self._get(path, start, list(bufs))

    async def _get(self, path: str, start: int, bufs: list[memoryview]) -> Fetched:
        n = sum(len(b) for b in bufs)
        resp = await self.call_s3(path, "get_object", Range=f"bytes={start}-{start + n - 1}")
        body = resp["Body"]
        try:
            total = _content_range_total(resp.get("ContentRange"))
            if total is not None and total < start + n:
                return Fetched(got=0, size=total)
            length = resp.get("ContentLength")
            if length != n:
                raise Transient(f"response of {length} bytes for a {n}-byte range")
            got = 0
            for buf in bufs:
                k = await self._read_body(path, body, buf)
                got += k
                if k < len(buf):
                    break
        finally:
            body.close()
        return Fetched(got=got, size=total, etag=resp.get("ETag"))

    async def _read_body(self, path: str, body: Any, buf: memoryview) -> int:
        """Read a response body into ``buf`` (stall-checked per chunk); returns bytes read."""
        got = 0
        while got < len(buf):
            k = await classified(path, body.readinto(buf[got:]), self.request_timeout)
            if not k:
                break
            got += k
        return got

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        resp = await self.call_s3(path, "get_object")
        body = resp["Body"]
        try:
            n = resp.get("ContentLength")
            if not isinstance(n, int):
                raise Transient("response without a Content-Length")
            if max_bytes is not None and n > max_bytes:
                raise TooLarge(n)
            buf = bytearray(n)
            got = await self._read_body(path, body, memoryview(buf))
            if got != n:
                raise Transient(f"short body: {got} of {n} bytes")
        finally:
            body.close()
        return bytes(buf), resp.get("ETag")

    async def listing(self, path: str, recursive: bool) -> list[str]:
        found = await super().listing(path, recursive)
        if not found:
            await self._check_bucket(path)  # an empty prefix, or no bucket at all?
        return found

    async def _check_bucket(self, path: str) -> None:
        """s3fs lists a missing bucket as empty: ask the bucket itself."""
        bucket = path.split("/", 1)[0]
        try:
            await classified(path, self.fs._call_s3("head_bucket", Bucket=bucket), self.request_timeout)
        except NotFound as e:
            raise NotFound(str(e), bucket=bucket) from None

    def invalidate(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    def sink(self, path: str) -> PartSink:
        return S3Sink(self, path)


def _md5(data: memoryview) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


class S3Sink(PartSink):
    """An S3 multipart upload (one PUT when the object fits one part)."""

    min_part = MIN_PART
    concurrent = True

    def __init__(self, backend: S3fsBackend, path: str) -> None:
        self._b = backend
        self._path = path
        self._upload_id: str | None = None

    async def put_whole(self, data: memoryview) -> None:
        md5 = await asyncio.to_thread(_md5, data)
        await self._b.call_s3(self._path, "put_object", Body=bytes(data), ContentMD5=md5)
        self._b.invalidate(self._path)

    async def start(self) -> None:
        resp = await self._b.call_s3(self._path, "create_multipart_upload")
        self._upload_id = resp["UploadId"]

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        body, md5 = await asyncio.to_thread(lambda: (bytes(data), _md5(data)))
        resp = await self._b.call_s3(self._path, "upload_part", UploadId=self._upload_id, PartNumber=number,
                                     Body=body, ContentMD5=md5)
        return {"PartNumber": number, "ETag": resp["ETag"]}

    async def complete(self, tokens: list[Any]) -> None:
        await self._b.call_s3(self._path, "complete_multipart_upload", UploadId=self._upload_id,
                              MultipartUpload={"Parts": tokens})
        self._b.invalidate(self._path)

    async def abort(self) -> None:
        if self._upload_id is not None:
            await self._b.call_s3(self._path, "abort_multipart_upload", UploadId=self._upload_id)
