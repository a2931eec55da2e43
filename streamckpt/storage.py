"""Bytes in and out of any fsspec URL: bounded-concurrency range reads with
retries, exact-length and checksum checks; streaming uploads.

This layer knows files and byte ranges, never tensors. Reads land in
caller-provided buffers (the staging buffers of the pipeline); asynchronous
filesystems (s3fs, gcsfs, http) run on fsspec's event loop thread, so a batch of
reads proceeds while the caller's thread does other work. Local files are read
with ``readinto`` from a small thread pool, straight into the buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import posixpath
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs

from .checksum import crc32c
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard to try before a read or write is declared failed.

    Attempts back off exponentially with full jitter; every attempt has its own
    timeout and the whole operation a deadline, so an outage fails in bounded time.
    """

    max_attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0
    request_timeout: float = 30.0
    total_timeout: float = 60.0
    checksum_retries: int = 2  # re-fetches after a checksum mismatch before it is called corruption

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Fetch ``[start, stop)`` of file ``name`` and verify ``checks``.

    Each check is ``(offset, length, crc32c)`` relative to ``start``.
    """

    name: str
    start: int
    stop: int
    checks: tuple[tuple[int, int, int], ...] = ()

    @property
    def length(self) -> int:
        return self.stop - self.start


class _Retryable(Exception):
    """An attempt failed in a way worth trying again."""


class _ChecksumMismatch(Exception):
    pass


_NOT_FOUND = (FileNotFoundError,)


def _is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, _NOT_FOUND)


def _transient(exc: BaseException) -> bool:
    """Errors worth retrying: network trouble, throttling, 5xx, timeouts."""
    if isinstance(exc, (_Retryable, asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and not _is_not_found(exc) and not isinstance(exc, PermissionError):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(
        word in text
        for word in ("slowdown", "503", "500", "internalerror", "serviceunavailable", "timeout",
                     "reset", "payload", "disconnect", "broken pipe", "incomplete", "throttl")
    )


def _safe_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    return dict(storage_options or {})


class Storage:
    """One checkpoint prefix on one filesystem; names are relative to the prefix."""

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        policy: RetryPolicy | None = None,
        max_concurrency: int = 32,
    ) -> None:
        self.uri = str(uri)
        opts = _safe_options(storage_options)
        self.policy = policy or RetryPolicy()
        protocol = fsspec.core.split_protocol(self.uri)[0] or "file"
        if protocol in ("s3", "s3a"):
            opts.setdefault("skip_instance_cache", True)
            ck = dict(opts.get("config_kwargs") or {})
            # The client's own retries stay small: our policy owns the total.
            ck.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
            ck.setdefault("connect_timeout", self.policy.request_timeout)
            ck.setdefault("read_timeout", self.policy.request_timeout)
            opts["config_kwargs"] = ck
        try:
            self.fs, root = url_to_fs(self.uri, **opts)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open {self._public_uri()}: {e}") from None
        if protocol in ("s3", "s3a"):
            self.fs.retries = 2  # s3fs's internal loop; ours bounds the total
        self.root = root.rstrip("/")
        self.max_concurrency = max(1, int(max_concurrency))
        self.is_async = bool(getattr(self.fs, "async_impl", False))
        self._rng = random.Random()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ naming

    def _public_uri(self) -> str:
        return self.uri.split("?", 1)[0]

    def path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def describe(self, name: str) -> str:
        """A user-facing address for an object (no credentials)."""
        return f"{self._public_uri().rstrip('/')}/{name}"

    # ------------------------------------------------------------ small calls

    def _retry_sync(self, what: str, fn: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self.policy.total_timeout
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_not_found(e):
                    raise
                attempt += 1
                if not _transient(e) or attempt >= self.policy.max_attempts or time.monotonic() >= deadline:
                    raise StorageError(f"{what}: {type(e).__name__}: {e} (after {attempt} attempts)") from None
                time.sleep(self.policy.delay(attempt, self._rng))

    def exists(self, name: str) -> bool:
        return bool(self._retry_sync(f"checking {self.describe(name)}", lambda: self.fs.exists(self.path(name))))

    def size(self, name: str) -> int:
        try:
            return int(self._retry_sync(f"sizing {self.describe(name)}", lambda: self.fs.size(self.path(name))))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.describe(name)} does not exist") from None

    def list(self, prefix: str = "", *, recursive: bool = False) -> list[str]:
        """Names (relative to the root) of objects under ``prefix``."""
        base = self.path(prefix).rstrip("/")
        try:
            if recursive:
                found = self._retry_sync(f"listing {self.describe(prefix)}", lambda: self.fs.find(base))
            else:
                found = self._retry_sync(
                    f"listing {self.describe(prefix)}", lambda: self.fs.ls(base, detail=False)
                )
        except FileNotFoundError:
            return []
        root = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = p.rstrip("/")
            if p.startswith(root):
                out.append(p[len(root):])
            elif p == self.root:
                continue
            else:
                out.append(posixpath.relpath(p, self.root))
        return sorted(out)

    def read_bytes(self, name: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Read a whole (small) object or one range of it, length-checked."""
        if start is None:
            try:
                data = self._retry_sync(f"reading {self.describe(name)}", lambda: self.fs.cat_file(self.path(name)))
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.describe(name)} does not exist") from None
            return bytes(data)
        stop = start if stop is None else stop
        buf = bytearray(stop - start)
        self.read_into([RangeRead(name, start, stop)], [memoryview(buf)]).result()
        return bytes(buf)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._retry_sync(f"writing {self.describe(name)}", lambda: self.fs.pipe_file(self.path(name), data))

    def delete(self, name: str, *, recursive: bool = False) -> None:
        try:
            self.fs.rm(self.path(name), recursive=recursive)
        except FileNotFoundError:
            pass

    def makedirs(self, name: str = "") -> None:
        try:
            self.fs.makedirs(self.path(name), exist_ok=True)
        except Exception:  # noqa: BLE001 - object stores have no directories
            pass

    # ----------------------------------------------------------- range reads

    def read_into(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> cf.Future:
        """Start fetching every read into its buffer (``len == read.length``).

        Returns a future that resolves to the number of requests made, or raises
        ``StorageError`` / ``CorruptCheckpointError`` naming object and range.
        """
        for r, b in zip(reads, buffers):
            if len(b) != r.length:
                raise ValueError(f"buffer of {len(b)} bytes for a {r.length}-byte read")
        if self.is_async:
            return asyncio.run_coroutine_threadsafe(self._read_all_async(reads, buffers), self.fs.loop)
        return self._thread_pool().submit(self._read_all_sync, reads, buffers)

    async def _read_all_async(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> int:
        sem = asyncio.Semaphore(self.max_concurrency)
        counter = [0]

        async def one(r: RangeRead, b: memoryview) -> None:
            async with sem:
                await self._read_one_async(r, b, counter)

        tasks = [asyncio.ensure_future(one(r, b)) for r, b in zip(reads, buffers)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return counter[0]

    async def _read_one_async(self, r: RangeRead, buf: memoryview, counter: list[int]) -> None:
        policy = self.policy
        deadline = time.monotonic() + policy.total_timeout
        attempt = 0
        bad_sums = 0
        path = self.path(r.name)
        while True:
            counter[0] += 1
            try:
                remaining = max(0.01, deadline - time.monotonic())
                data = await asyncio.wait_for(
                    self.fs._cat_file(path, start=r.start, end=r.stop),
                    timeout=min(policy.request_timeout, remaining),
                )
                self._land(r, data, buf)
                return
            except _ChecksumMismatch as e:
                bad_sums += 1
                if bad_sums > policy.checksum_retries:
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.describe(r.name)} bytes {e} "
                        f"(persisted over {bad_sums} reads): the stored object is corrupt"
                    ) from None
                log.warning("checksum mismatch in %s bytes %s; re-fetching", self.describe(r.name), e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_not_found(e):
                    raise CheckpointNotFoundError(f"{self.describe(r.name)} does not exist") from None
                attempt += 1
                if not _transient(e) or attempt >= policy.max_attempts or time.monotonic() >= deadline:
                    raise StorageError(
                        f"reading {self.describe(r.name)} bytes [{r.start}, {r.stop}) failed after "
                        f"{attempt} attempts: {type(e).__name__}: {e}"
                    ) from None
                log.debug("retrying %s [%d, %d): %s", self.describe(r.name), r.start, r.stop, e)
                await asyncio.sleep(policy.delay(attempt, self._rng))

    def _land(self, r: RangeRead, data: bytes | memoryview, buf: memoryview) -> None:
        """Length-check, copy into the staging buffer, verify checksums there."""
        if len(data) != r.length:
            raise _Retryable(f"short read: got {len(data)} of {r.length} bytes")
        buf[:] = data
        _verify(r, buf)

    def _thread_pool(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(
                    max_workers=min(self.max_concurrency, 16), thread_name_prefix="streamckpt-io"
                )
            return self._pool

    def _read_all_sync(self, reads: Sequence[RangeRead], buffers: Sequence[memoryview]) -> int:
        # Files are grouped so each is opened once per batch.
        counter = [0]
        by_file: dict[str, list[int]] = {}
        for i, r in enumerate(reads):
            by_file.setdefault(r.name, []).append(i)
        for name, idxs in by_file.items():
            try:
                f = self.fs.open(self.path(name), "rb", block_size=0) if not _is_local(self.fs) else open(
                    self.fs._strip_protocol(self.path(name)), "rb", buffering=0
                )
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.describe(name)} does not exist") from None
            with f:
                for i in idxs:
                    self._read_one_sync(f, reads[i], buffers[i], counter)
        return counter[0]

    def _read_one_sync(self, f: BinaryIO, r: RangeRead, buf: memoryview, counter: list[int]) -> None:
        bad_sums = 0
        attempt = 0
        while True:
            counter[0] += 1
            try:
                f.seek(r.start)
                got = 0
                while got < r.length:
                    n = f.readinto(buf[got:])  # type: ignore[attr-defined]
                    if not n:
                        break
                    got += n
                if got != r.length:
                    raise CorruptCheckpointError(
                        f"{self.describe(r.name)} is truncated: bytes [{r.start}, {r.stop}) requested, "
                        f"only {got} available"
                    )
                _verify(r, buf)
                return
            except _ChecksumMismatch as e:
                bad_sums += 1
                if bad_sums > self.policy.checksum_retries:
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.describe(r.name)} bytes {e}: the stored object is corrupt"
                    ) from None
            except OSError as e:
                attempt += 1
                if attempt >= self.policy.max_attempts:
                    raise StorageError(
                        f"reading {self.describe(r.name)} bytes [{r.start}, {r.stop}) failed: {e}"
                    ) from None

    # ---------------------------------------------------------------- writes

    def open_write(self, name: str, *, block_size: int = 16 << 20) -> "Upload":
        """A streaming upload (multipart on object stores); commit on ``close``."""
        return Upload(self, name, block_size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _verify(r: RangeRead, buf: memoryview) -> None:
    for off, length, expected in r.checks:
        if crc32c(buf[off:off + length]) != expected:
            raise _ChecksumMismatch(f"[{r.start + off}, {r.start + off + length})")


class Upload:
    """A write stream that either commits whole on ``commit`` or leaves nothing.

    Object stores: fsspec's buffered multipart upload (``block_size`` per part);
    an aborted upload is discarded. Local files: written under a temporary name
    and renamed on commit.
    """

    def __init__(self, storage: Storage, name: str, block_size: int) -> None:
        self.storage = storage
        self.name = name
        self.bytes_written = 0
        fs = storage.fs
        self._local = _is_local(fs)
        final = storage.path(name)
        self._final = final
        self._tmp = f"{final}.tmp-{random.getrandbits(48):012x}" if self._local else final
        parent = posixpath.dirname(self._tmp)
        if parent:
            try:
                fs.makedirs(parent, exist_ok=True)
            except Exception:  # noqa: BLE001 - object stores have no directories
                pass
        try:
            self._f = fs.open(self._tmp, "wb", block_size=block_size) if not self._local else fs.open(self._tmp, "wb")
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot open {storage.describe(name)} for writing: {e}") from None

    def write(self, data: bytes | memoryview) -> None:
        try:
            self._f.write(data)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"writing {self.storage.describe(self.name)} failed at byte {self.bytes_written}: {e}") from None
        self.bytes_written += len(data)

    def commit(self) -> None:
        try:
            self._f.close()
            if self._local:
                self.storage.fs.mv(self._tmp, self._final)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"committing {self.storage.describe(self.name)} failed: {e}") from None

    def abort(self) -> None:
        try:
            discard = getattr(self._f, "discard", None)
            if discard is not None and not self._local:
                discard()
            else:
                self._f.close()
        except Exception:  # noqa: BLE001 - best effort on an already failing path
            pass
        if self._local:
            try:
                self.storage.fs.rm(self._tmp)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def iter_chunks(data: memoryview, size: int) -> Iterator[memoryview]:
    for i in range(0, len(data), size):
        yield data[i:i + size]
