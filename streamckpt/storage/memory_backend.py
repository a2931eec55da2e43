"""Objects in a dict: a backend for tests and for wrapping (a scripted fault layer in the
policy tests wraps it), with S3's visible behaviour: MD5 ETags for whole PUTs, nothing
visible before a multipart upload completes, missing buckets as ``NotFound(bucket=...)``."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from .backend import Backend, Fetched, NotFound, ObjectInfo, PartSink, TooLarge


class MemoryBackend(Backend):
    """``buckets`` names the buckets that exist (paths are ``bucket/key``); all exist when None."""

    name = "memory"

    def __init__(self, buckets: tuple[str, ...] | None = None) -> None:
        self.objects: dict[str, tuple[bytes, str, float]] = {}
        self.buckets = buckets

    def _check_bucket(self, path: str) -> None:
        bucket = path.split("/", 1)[0]
        if self.buckets is not None and bucket not in self.buckets:
            raise NotFound(f"bucket {bucket!r} does not exist", bucket=bucket)

    def _get(self, path: str) -> tuple[bytes, str, float]:
        self._check_bucket(path)
        try:
            return self.objects[path]
        except KeyError:
            raise NotFound(f"{path}: no such object") from None

    def put(self, path: str, data: bytes, etag: str | None = None) -> None:
        self._check_bucket(path)
        self.objects[path] = (bytes(data), etag or hashlib.md5(data, usedforsecurity=False).hexdigest(), time.time())

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        data, etag, _ = self._get(path)
        part = data[start:start + len(buf)]
        buf[:len(part)] = part
        return Fetched(got=len(part), size=len(data) if want_meta or len(part) < len(buf) else None, etag=etag)

    async def head(self, path: str) -> ObjectInfo:
        data, etag, when = self._get(path)
        return ObjectInfo(size=len(data), etag=etag, modified=when)

    async def listing(self, path: str, recursive: bool) -> list[str]:
        self._check_bucket(path)
        prefix = path.rstrip("/") + "/"
        under = [p for p in self.objects if p.startswith(prefix)]
        if recursive:
            return sorted(under)
        return sorted({prefix + p[len(prefix):].split("/", 1)[0] for p in under})

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        data, etag, _ = self._get(path)
        if max_bytes is not None and len(data) > max_bytes:
            raise TooLarge(len(data))
        return data, etag

    async def delete(self, path: str, recursive: bool) -> None:
        self._check_bucket(path)
        self.objects.pop(path, None)
        if recursive:
            for p in [p for p in self.objects if p.startswith(path.rstrip("/") + "/")]:
                del self.objects[p]

    def sink(self, path: str) -> PartSink:
        return MemorySink(self, path)


class MemorySink(PartSink):
    """Parts kept aside until ``complete`` (multipart ETags are not plain MD5s, as on S3)."""

    concurrent = True

    def __init__(self, backend: MemoryBackend, path: str) -> None:
        self._backend = backend
        self._path = path
        self.parts: dict[int, bytes] = {}

    async def put_whole(self, data: memoryview) -> None:
        self._backend.put(self._path, bytes(data))

    async def start(self) -> None:
        self._backend._check_bucket(self._path)

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        self.parts[number] = bytes(data)
        return number

    async def complete(self, tokens: list[Any]) -> None:
        data = b"".join(self.parts[n] for n in tokens)
        self._backend.put(self._path, data, etag=f"{len(tokens)}-parts")

    async def abort(self) -> None:
        self.parts.clear()
