"""``Storage``: one checkpoint prefix on one store, the only storage object the rest of
streamckpt sees. It picks the backends for a URI, runs every call under the one fault
policy (``reads``, ``uploads``) on the storage event loop, and gives blocking methods
to callers plus ``read_into`` that returns a future, so a batch of range reads proceeds
while the caller's thread does other work.

Names are relative to the prefix; messages carry no credentials. A URI that names one
object standing for a whole checkpoint (a Hugging Face ``*.safetensors`` file or
``*.safetensors.index.json``) opens its directory, with ``entry`` naming that object.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures as cf
import logging
import os
import posixpath
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs

from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from . import azure_backend, endpoint, httpget, obstore_backend
from .backend import Backend, NotFound, ObjectInfo
from .fsspec_backend import FsspecBackend
from .local_backend import LocalBackend
from .obstore_backend import ObstoreBackend
from .optionnames import check_local_options, check_option_names
from .policy import Describer, RetryPolicy, not_found_message
from .reads import MIN_PIECE, Buffer, RangeRead, Reader
from .s3fs_backend import S3fsBackend, s3fs_options
from .uploads import ObjectQueue, Upload

log = logging.getLogger(__name__)

_S3_PROTOCOLS = ("s3", "s3a")
_LOCAL_PROTOCOLS = ("file", "local")
_OBJECT_STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")
INFLIGHT = 16 << 20  # bodies held by the client when the caller sets no memory budget
INFLIGHT_MAX = 64 << 20  # ... and at most this much of a budget (16 concurrent pieces, for high-latency stores)
PART_SIZE = 8 << 20  # upload part size (larger when an object's size hint needs it: S3 allows 10,000 parts)
PARTS_IN_FLIGHT = 4  # upload part buffers per object, the one being filled included (4 x 8 MiB = 32 MiB)
MAX_PARTS = 9_000
ENTRY_SUFFIXES = (".safetensors", ".safetensors.index.json")  # objects a URI may name for a checkpoint
METADATA_NAMES = ("manifest.json", ".metadata")  # a checkpoint's own metadata object: its prefix is the URI
_SECRET_OPTION = re.compile(r"(secret|token|password|passwd|key|credential|sas|signature|connection_string)", re.I)


class Storage:
    """One checkpoint prefix on one store; ``backend`` injects a client (tests, custom stores)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, *, policy: RetryPolicy | None = None,
                 max_concurrency: int = 32, backend: Backend | None = None) -> None:
        self.uri, self.entry = split_entry(checked_uri(uri))
        self.policy = policy or RetryPolicy.from_env()
        self.max_concurrency = max(1, int(max_concurrency))
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise CheckpointError(f"storage_options must be a dict of fsspec options (such as {{'endpoint_url': "
                               f"'http://127.0.0.1:9000'}}), not {type(storage_options).__name__}")
        opts = endpoint.normalize(dict(storage_options or {}))
        self._protocol = fsspec.core.split_protocol(self.uri)[0] or "file"
        azure = self._protocol in azure_backend.PROTOCOLS
        secrets = _secrets_of(opts, azure_backend.secrets_of(opts) if azure else [])
        self._describe = Describer(_public(self.uri), secrets, self.policy.request_timeout,
                                   endpoint.endpoint_of(opts), store="azure" if azure else "s3")
        self._fs_options = opts
        self._writer: Backend | None = None
        self._s3fs_backend: S3fsBackend | None = None
        reader, self.root = backend, self.uri.split("://", 1)[-1].rstrip("/")
        if reader is None:
            reader = self._open_reader(opts)
        else:
            self._writer = reader
        self._loop = getattr(getattr(reader, "fs", None), "loop", None) or fsspec.asyn.get_loop()
        self._reader = Reader(reader, self.policy, self._describe, self.root, self.max_concurrency,
                              INFLIGHT, reader.piece_size, random.Random())

    # ------------------------------------------------------------ backends

    def _open_reader(self, opts: dict[str, Any]) -> Backend:
        if "::" not in self.uri:  # a chained URL's options are per link
            check_option_names(self._protocol, opts, self._describe.public_uri)
        if self._protocol in _S3_PROTOCOLS:
            self._fs_options = s3fs_options(opts, self.policy.client_attempts, self.policy.request_timeout,
                                            self.max_concurrency)
            self.root = self.uri.split("://", 1)[1].strip("/")
            ob = self._pick_obstore(opts)
            if ob is not None:
                return ob  # s3fs and its botocore client (~0.2 s to start) are not needed
            self._writer = S3fsBackend(self._open_fs(), self.policy.request_timeout, self.max_concurrency)
            return self._writer
        if self._protocol in azure_backend.PROTOCOLS:
            return self._open_azure(opts)
        if self._protocol in _LOCAL_PROTOCOLS and "::" not in self.uri:
            check_local_options(self.uri, opts)
            self.root = fsspec.implementations.local.LocalFileSystem._strip_protocol(self.uri).rstrip("/")
            self._writer = LocalBackend(self.max_concurrency)
            return self._writer
        self._writer = FsspecBackend(self._open_fs(), self.policy.request_timeout, self.max_concurrency,
                                     self._describe.endpoint)
        return self._writer

    def _open_fs(self) -> Any:
        try:
            fs, root = url_to_fs(self.uri, **self._fs_options)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open {self._describe.public_uri}: {self._describe.scrub(str(e))}"
                               f"{_scheme_hint(self.uri)}") from None
        self.root = str(root).rstrip("/")
        return fs

    def _open_azure(self, opts: dict[str, Any]) -> Backend:
        """obstore's AzureStore when the options map onto it, else adlfs with the SDK's retries off."""
        try:
            wanted = azure_backend.requested_backend()
        except ValueError as e:
            raise StorageError(str(e)) from None
        self.root, account = azure_backend.split_root(self.uri.split("://", 1)[1].strip("/"))
        config = None
        if wanted != "adlfs" and "?" not in self.uri and "::" not in self.uri:
            try:
                config = azure_backend.azure_config(opts, account)
            except obstore_backend.NotConfigurable as e:
                (log.warning if wanted == "obstore" else log.debug)(
                    "%s goes through adlfs: obstore cannot reproduce %s", self._describe.public_uri, e)
        if config is not None:
            self._describe.endpoint = endpoint.public(config["endpoint"])
            return azure_backend.AzureBackend(
                config, self.policy.request_timeout, self.policy.client_attempts, self.max_concurrency,
                write_attempts=self.policy.max_attempts * self.policy.client_attempts,
                write_timeout=self.policy.total_timeout)
        self._fs_options = azure_backend.adlfs_options(opts)
        fs = self._open_fs()
        azure_backend.quiet_sdk_retries(fs)
        self.root = azure_backend.split_root(self.root)[0]
        self._describe.endpoint = azure_backend.endpoint_of(opts, account)
        self._writer = FsspecBackend(fs, self.policy.request_timeout, self.max_concurrency, self._describe.endpoint)
        return self._writer

    def _pick_obstore(self, opts: dict[str, Any]) -> ObstoreBackend | None:
        """The obstore client (or its ``http.client`` range reader) for these options, or None to read through s3fs."""
        try:
            wanted = obstore_backend.requested_backend()
        except ValueError as e:
            raise StorageError(str(e)) from None
        if wanted == "s3fs" or (wanted == "auto" and not obstore_backend.AUTO_PICKS_OBSTORE):
            return None
        if "?" in self.uri or "::" in self.uri:
            log.debug("reads of %s go through s3fs (query string or chained URL)", self._describe.public_uri)
            return None
        if not obstore_backend.available():
            if wanted in ("obstore", "http"):
                raise StorageError(
                    f"{obstore_backend.BACKEND_ENV}={wanted} but obstore is not installed (pip install obstore)")
            return None
        try:
            config = obstore_backend.s3_config(opts)
        except obstore_backend.NotConfigurable as e:
            (log.warning if wanted in ("obstore", "http") else log.debug)(
                "reads of %s go through s3fs: obstore cannot reproduce %s", self._describe.public_uri, e)
            return None
        args = (config, self.policy.request_timeout, self.policy.client_attempts, self.max_concurrency)
        kw = dict(write_attempts=self.policy.max_attempts * self.policy.client_attempts,
                  write_timeout=self.policy.total_timeout)
        if wanted == "http" or (wanted == "auto" and httpget.AUTO_PICKS_HTTP):
            try:
                return httpget.HttpGetBackend(*args, **kw)
            except obstore_backend.NotConfigurable as e:
                (log.warning if wanted == "http" else log.debug)(
                    "range reads of %s go through obstore: the http path cannot reproduce %s",
                    self._describe.public_uri, e)
        return ObstoreBackend(*args, **kw)

    @property
    def _write_backend(self) -> Backend:
        """Where uploads and deletes go: the reading backend (obstore writes too)."""
        if self._writer is None:
            self._writer = self._reader.backend
        return self._writer

    def _s3fs(self) -> S3fsBackend:
        """s3fs beside obstore, created on first use: aborting multipart uploads, ``fs``."""
        if not isinstance(self._writer, S3fsBackend):
            if self._s3fs_backend is None:
                self._s3fs_backend = S3fsBackend(self._open_fs(), self.policy.request_timeout, self.max_concurrency)
            return self._s3fs_backend
        return self._writer

    async def _abort_uploads(self, path: str) -> None:
        """Abort the unfinished multipart uploads of one key (obstore cannot)."""
        s3 = self._s3fs()
        for name, upload_id, _ in await s3.open_uploads(path):
            if name == path:
                await s3.abort_upload(path, upload_id)

    @property
    def is_s3(self) -> bool:
        """Whether the store speaks S3 (server-side range copies, ``storage.compose``)."""
        return self._protocol in _S3_PROTOCOLS and "::" not in self.uri

    @property
    def fs(self) -> Any:
        """An fsspec filesystem for this store (s3fs, gcsfs, local, ...), created on first use."""
        if self._protocol in _S3_PROTOCOLS:
            return self._s3fs().fs
        found = getattr(self._write_backend, "fs", None)
        if found is None and self._protocol in azure_backend.PROTOCOLS:
            fs, _ = url_to_fs(self.uri, **azure_backend.adlfs_options(self._fs_options))  # adlfs beside obstore
            return fs
        return found or fsspec.filesystem("file")

    @property
    def read_backend(self) -> str:
        """Which client does the range reads: ``http``, ``obstore``, ``s3fs``, ``local`` or ``fsspec``."""
        name = self._reader.backend.name
        return "fsspec" if name == "local" else name

    @property
    def clients_started(self) -> tuple[str, ...]:
        """The clients this Storage has created so far (a load on S3 never starts s3fs)."""
        names = [self._reader.backend.name]
        for extra in (self._writer, self._s3fs_backend):
            if extra is not None and extra is not self._reader.backend and extra.name not in names:
                names.append(extra.name)
        return tuple(names)

    # ------------------------------------------------------- budgets and names

    @property
    def throttled_responses(self) -> int:
        """Throttled responses (S3's 503 SlowDown, 429, Azure's ServerBusy) the read client has
        seen so far, each retried or failing its call. The default S3 client (``http``) counts
        every one; through obstore, s3fs and others only those that outlast the client's own
        retries are seen."""
        return self._reader.backend.throttled.count

    @property
    def piece_size(self) -> int | None:
        return self._reader.piece_size

    @piece_size.setter
    def piece_size(self, value: int | None) -> None:
        self._reader.piece_size = value

    @property
    def inflight_bytes(self) -> int:
        return self._reader.inflight_bytes

    @inflight_bytes.setter
    def inflight_bytes(self, value: int) -> None:
        self._reader.inflight_bytes = value

    def reserve_inflight(self, memory_budget: int) -> int:
        """Take a share of a load's ``memory_budget`` for response bodies that the client
        holds before copying them into their buffers; returns what is left for staging.

        Only a body-holding client (obstore) needs it: a quarter of the budget, between one
        piece and ``INFLIGHT_MAX``.
        """
        if not self._reader.backend.holds_bodies:
            return memory_budget
        piece = min(self.piece_size or INFLIGHT, MIN_PIECE)
        self.inflight_bytes = min(INFLIGHT_MAX, max(piece, memory_budget // 4))
        return max(memory_budget - self.inflight_bytes, memory_budget // 2)

    def __repr__(self) -> str:
        return f"Storage({self._describe.public_uri!r})"

    def path(self, name: str) -> str:
        return self._reader.path(name)

    def absent_hint(self) -> str:
        """Why nothing is here when the URI is a plain path that does not exist: most often
        a bucket written without its scheme (``bucket/prefix`` for ``s3://bucket/prefix``), or a
        URI pasted with a space around it."""
        if self.uri != self.uri.strip():
            return f" (the URI has spaces around it, which are part of the name: did you mean {self.uri.strip()!r}?)"
        head, _, base = self.uri.rstrip("/").rpartition("/")
        if base in METADATA_NAMES and head:
            return f" (that URI names the checkpoint's {base}: give its prefix, {_public(head)})"
        if "://" in self.uri or self._protocol not in _LOCAL_PROTOCOLS or os.path.exists(self.root):
            return ""
        hint = f" (a local path, and there is no {self.root!r} here"
        one_slash = re.match(r"([A-Za-z][\w+.-]*):/(?!/)(.*)", self.uri)  # s3:/bucket/x
        if one_slash:
            hint += f"; for a bucket, write two slashes after the scheme: {one_slash[1]}://{one_slash[2]}"
        elif not self.uri.startswith(("/", ".", "~")) and ("endpoint_url" in self._fs_options or "/" in self.uri):
            hint += f"; for a bucket, write its scheme: s3://{self.uri}"
            if re.fullmatch(r"[\w.-]+/[\w.-]+", self.uri):  # meta-llama/Llama-3.1-8B
                hint += (f"; for a Hugging Face Hub model id: streamckpt reads storage, not the Hub: download it "
                         f"first (huggingface-cli download {self.uri} --local-dir DIR) and pass DIR, or copy it "
                         f"to your bucket and pass that URI")
        return hint + ")"

    def describe(self, name: str) -> str:
        """A user-facing address for an object (no credentials)."""
        return self._describe.name(name)

    # ------------------------------------------------------------ small calls

    def _sync(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        return self._sync(self._reader.call(what, fn, *args))

    def _not_found(self, name: str, e: NotFound) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(not_found_message(self._describe, name, e))

    def size(self, name: str) -> int:
        return self.sizes([name])[name]

    def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """``size`` of every name, asked all at once (one round trip's wait, not one each)."""

        async def one(name: str) -> int:
            try:
                info = await self._reader.call(f"sizing {self.describe(name)}", self._reader.backend.head,
                                               self.path(name))
            except NotFound as e:
                raise self._not_found(name, e) from None
            return info.size

        async def every() -> list[int]:
            return list(await asyncio.gather(*(one(n) for n in names)))

        return dict(zip(names, self._sync(every()))) if names else {}

    def modified(self, name: str) -> float | None:
        """Last-modified time (POSIX seconds) of an object, or None if it does not exist."""
        try:
            info = self._call(f"checking {self.describe(name)}", self._reader.backend.head, self.path(name))
        except NotFound as e:
            if e.bucket is not None:
                raise self._not_found(name, e) from None
            return None
        return info.modified if info.modified is not None else 0.0

    def exists(self, name: str) -> bool:
        """Whether an object (or a prefix with objects under it) exists; a missing bucket raises."""
        try:
            return bool(self._call(f"checking {self.describe(name)}", self._reader.backend.exists, self.path(name)))
        except NotFound as e:
            raise self._not_found(name, e) from None

    def list(self, prefix: str = "", *, recursive: bool = False) -> list[str]:
        """Names (relative to the root) of objects under ``prefix``; a missing bucket raises."""
        base = self.path(prefix).rstrip("/")
        try:
            found = self._call(f"listing {self.describe(prefix)}", self._reader.backend.listing, base, recursive)
        except NotFound as e:
            if e.bucket is not None:
                raise self._not_found(prefix, e) from None
            return []
        root = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = p.rstrip("/")
            if p.startswith(root):
                out.append(p[len(root):])
            elif p != self.root:
                out.append(posixpath.relpath(p, self.root))
        return sorted(n for n in out if n and n != ".")

    def list_info(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (recursive), name relative to the root to its size and
        modification time: one request per page of the listing where the client's listing
        carries them (S3, GCS, Azure, local files); a missing bucket raises."""
        base = self.path(prefix).rstrip("/")
        try:
            found = self._call(f"listing {self.describe(prefix)}", self._reader.backend.listing_info, base)
        except NotFound as e:
            if e.bucket is not None:
                raise self._not_found(prefix, e) from None
            return {}
        root = self.root.rstrip("/") + "/"
        return {p[len(root):]: info for p, info in found if p.startswith(root) and len(p) > len(root)}

    def open_uploads(self, prefix: str = "") -> "builtins.list[OpenUpload]":
        """The incomplete multipart uploads under ``prefix`` (S3 only: the one store whose API
        lists them; elsewhere an empty list, see docs/RELIABILITY.md)."""
        if self._protocol not in _S3_PROTOCOLS:
            return []
        found = self._call(f"listing the open uploads under {self.describe(prefix)}", self._s3fs().open_uploads,
                           self.path(prefix))
        return [OpenUpload(posixpath.relpath(name, self.root), upload_id, when) for name, upload_id, when in found]

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one incomplete multipart upload (its parts stop being stored and billed)."""
        self._call(f"aborting the upload of {self.describe(upload.name)}", self._s3fs().abort_upload,
                   self.path(upload.name), upload.upload_id)

    def read_bytes(self, name: str, start: int | None = None, stop: int | None = None, *,
                   max_bytes: int | None = None) -> bytes:
        """Read a whole (small) object or one range of it, length-checked.

        A whole-object read refuses objects larger than ``max_bytes`` before fetching
        them, and checks the body against the ETag when it is an MD5.
        """
        if start is None:
            return self._sync(self._reader.read_whole(name, max_bytes))
        stop = start if stop is None else stop
        buf = bytearray(stop - start)
        self.read_into([RangeRead(name, start, stop)], [memoryview(buf)]).result()
        return bytes(buf)

    def read_into(self, reads: Sequence[RangeRead], buffers: Sequence[Buffer], *,
                  on_landed: Callable[[int], None] | None = None, inflight_bytes: int | None = None,
                  spread: int | None = None) -> cf.Future:
        """Start fetching every read into its buffer (``len == read.length``): a memoryview,
        or a ``Landing`` of consecutive buffers (e.g. target memory with staging between).

        Returns a future that resolves to the number of requests made, or raises
        ``StorageError`` / ``CorruptCheckpointError`` / ``CheckpointNotFoundError``
        naming object and range. ``on_landed(i)``, called on the storage event loop (keep
        it short), says that read ``i``'s bytes are in its buffer and passed their checks;
        until then (and after any failure) a buffer's contents are unspecified.
        ``inflight_bytes`` bounds the response bodies this batch holds at once (default
        ``self.inflight_bytes``): a caller running two batches side by side splits its budget.
        ``spread``: how many requests the batch is cut into at most (default half of
        ``max_concurrency``; pieces never under 4 MiB nor over the client's largest GET).
        """
        if len(reads) != len(buffers):
            raise ValueError(f"{len(reads)} reads but {len(buffers)} buffers")
        for r, b in zip(reads, buffers):
            if r.start < 0 or r.stop < r.start:
                raise ValueError(f"bad range [{r.start}, {r.stop}) of {r.name!r}")
            if len(b) != r.length:
                raise ValueError(f"buffer of {len(b)} bytes for a {r.length}-byte read")
        batch: dict[str, Any] = {}

        async def run() -> int:
            batch["task"] = asyncio.current_task()
            return await self._reader.read_all(reads, buffers, on_landed, inflight_bytes, spread)

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        fut.streamckpt_batch = batch  # type: ignore[attr-defined] - what ``stop`` cancels
        return fut

    def stop(self, fut: cf.Future, timeout: float = 60.0) -> None:
        """Cancel a ``read_into`` batch and return once none of its reads can write into a
        buffer any more (or after ``timeout``): a failed load must not see target memory
        change after it raised. Cancelling the future alone only stops waiting for it."""
        batch = getattr(fut, "streamckpt_batch", {})

        async def stop() -> None:
            # Scheduled after the batch's first step (the loop runs callbacks in order), so
            # the batch's task is known unless it never ran, and then it wrote nothing.
            task = batch.get("task")
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])  # reads wait for their client calls to end

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout)
        except Exception as e:  # noqa: BLE001 - already failing; say so and go on
            log.warning("stopping reads of %s: %s", self._describe.public_uri, e)
        fut.cancel()

    # ---------------------------------------------------------------- writes

    def open_write(self, name: str, *, block_size: int = PART_SIZE, parts_in_flight: int = PARTS_IN_FLIGHT,
                   size_hint: int | None = None) -> Upload:
        """A streaming upload that becomes visible only on ``commit``: parts of ``block_size``
        bytes (more when ``size_hint``, the expected object size, needs more than ``MAX_PARTS``),
        up to ``parts_in_flight`` part buffers at once, each part retried under the policy."""
        if size_hint:
            block_size = max(block_size, -(-size_hint // MAX_PARTS))
        sink = self._write_backend.sink(self.path(name))
        if hasattr(sink, "on_abort") and self._protocol in _S3_PROTOCOLS:
            sink.on_abort = self._abort_uploads  # Azure drops uncommitted blocks by itself
        return Upload(sink, name, self.describe(name), loop=self._loop,
                      call=self._reader.call, once=self._reader.once, part_size=block_size,
                      parts_in_flight=parts_in_flight)

    def write_bytes(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Write a small object whole (one request where the store allows it)."""
        self.write_bytes_async(name, data).result()

    def write_bytes_async(self, name: str, data: bytes | bytearray | memoryview) -> "cf.Future[None]":
        """``write_bytes`` in the background, retried under the policy: ``data`` must stay
        unchanged until the future is done."""
        sink = self._write_backend.sink(self.path(name))

        async def put() -> None:
            try:
                await self._reader.call(f"writing {self.describe(name)}", sink.put_whole, memoryview(data).cast("B"))
            except NotFound as e:  # a missing bucket: the caller's URI is wrong, not the store
                raise CheckpointNotFoundError(not_found_message(self._describe, name, e, "writing")) from None

        return asyncio.run_coroutine_threadsafe(put(), self._loop)

    def open_objects(self, *, buffers: int, buffer_bytes: int,
                     on_uploaded: Callable[[int], None] | None = None) -> ObjectQueue:
        """Whole objects uploaded several at once from ``buffers`` reused buffers (see ``ObjectQueue``)."""
        return ObjectQueue(self.write_bytes_async, self.delete, buffers=buffers, buffer_bytes=buffer_bytes,
                           on_uploaded=on_uploaded)

    def delete(self, name: str, *, recursive: bool = False) -> None:
        try:
            self._call(f"deleting {self.describe(name)}", self._write_backend.delete, self.path(name), recursive)
        except NotFound:
            pass
        except StorageError as e:
            if self._protocol not in _S3_PROTOCOLS or not _unimplemented(str(e)):
                raise
            log.info("%s: the server has no bulk delete (501); deleting one object at a time", self.describe(name))
            for one in [name] + (self.list(name, recursive=True) if recursive else []):
                self._call(f"deleting {self.describe(one)}", self._s3fs().delete_one, self.path(one))

    def remove_empty_dirs(self, prefix: str = "") -> None:
        """Best effort: on a file system, remove the directories under ``prefix`` that a
        deletion left empty (object stores have none)."""
        try:
            self._call(f"tidying {self.describe(prefix)}", self._write_backend.remove_empty_dirs,
                       self.path(prefix).rstrip("/"))
        except CheckpointError as e:
            log.info("could not remove empty directories under %s: %s", self.describe(prefix), e)

    def delete_many(self, names: Sequence[str]) -> "builtins.list[tuple[str, CheckpointError]]":
        """Delete objects, in bulk where the client can (S3: one request per 1000 keys);
        absent ones are fine. If the bulk request fails, each object is deleted on its own
        (``delete``, with its fallbacks). Returns ``(name, error)`` of each that could not be."""
        if not names:
            return []
        try:
            self._call(f"deleting {len(names)} objects under {self.describe('')}", self._write_backend.delete_many,
                       [self.path(n) for n in names])
            return []
        except NotFound:
            pass
        except CheckpointError as e:
            log.info("bulk delete under %s failed (%s): deleting one object at a time", self.describe(""), e)
        failed: builtins.list[tuple[str, CheckpointError]] = []
        for name in names:
            try:
                self.delete(name)
            except CheckpointError as e:
                failed.append((name, e))
        return failed

    def makedirs(self, name: str = "") -> None:
        self._sync(self._write_backend.makedirs(self.path(name)))

    def close(self) -> None:
        self._reader.backend.close()
        self._reader.verify_threads.close()
        for extra in {id(b): b for b in (self._writer, self._s3fs_backend) if b is not None}.values():
            if extra is not self._reader.backend:
                extra.close()


@dataclass(frozen=True, slots=True)
class OpenUpload:
    """An incomplete multipart upload: its object's name (relative to the root), id and start time."""

    name: str
    upload_id: str
    initiated: float | None  # POSIX seconds


def _unimplemented(text: str) -> bool:
    """Whether a failure says the server does not implement the request (HTTP 501; s3fs
    words it as ENOSYS's "... not implemented")."""
    low = text.lower()
    return "501" in low or "not implemented" in low


def checked_uri(uri: Any) -> str:
    """``uri`` as a string; None (``sc.latest``'s answer when nothing is committed, passed on
    unchecked) and other non-paths are refused by name instead of read as the path ``None``, and an
    empty one instead of taken as the current directory (``sc.save`` wrote manifest.json there)."""
    if uri is None:
        raise CheckpointNotFoundError(
            "the checkpoint URI is None (sc.latest returns None when no checkpoint is committed under "
            "its root; check for None and start fresh, or check the root URI)")
    if not isinstance(uri, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint URI is a str (s3://bucket/prefix, a local path), not a "
                              f"{type(uri).__name__} (storage options go in storage_options=)")
    uri = os.fspath(uri) if isinstance(uri, os.PathLike) else uri
    if not uri.strip():  # an unset variable, most often: not the current directory
        raise CheckpointError(f"the checkpoint URI is empty ({uri!r}): pass a URI (s3://bucket/prefix) or a "
                              f"directory path ('.' for the current directory)")
    _refuse_empty_segment(uri)
    return uri


def out_options(out_uri: str, storage_options: dict[str, Any] | None,
                out_storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The options of a copy's or an export's destination: ``out_storage_options`` when given,
    else the source's, except for a local destination (a store's options cannot apply to it:
    ``copy s3://b/run ./run`` writes to the disk without them)."""
    if out_storage_options is not None:
        return out_storage_options
    protocol = fsspec.core.split_protocol(checked_uri(out_uri))[0] or "file"
    return None if protocol in _LOCAL_PROTOCOLS else storage_options


def _refuse_empty_segment(uri: str) -> None:
    """``s3://bucket//x``: a key with an empty segment, which S3 keeps as written (``bucket/x`` and
    ``bucket//x`` are two prefixes; listings and other tools disagree on it), most often a root
    joined with a name that starts with ``/``. A local path's ``//`` is one separator."""
    scheme, sep, rest = uri.partition("://")
    if not sep or "::" in uri or scheme.lower() not in _OBJECT_STORE_PROTOCOLS:
        return
    path = rest.split("?", 1)[0].rstrip("/")
    if "//" in path or path.startswith("/"):
        fixed = f"{scheme}://" + "/".join(p for p in path.split("/") if p)
        raise CheckpointError(f"{uri!r} has an empty path segment ('//'): object stores keep it as part of the "
                              f"key, a prefix other than the one meant; write {fixed!r}")


def split_entry(uri: str) -> tuple[str, str | None]:
    """``(directory URI, object name)`` for a URI naming one of ``ENTRY_SUFFIXES``, else ``(uri, None)``."""
    if "?" in uri or "::" in uri:
        return uri, None
    head, sep, base = uri.rstrip("/").rpartition("/")
    if not base.endswith(ENTRY_SUFFIXES) or head.endswith(":/") or head.endswith(":"):
        return uri, None  # a bucket named like a file is still a bucket
    return (head if sep else "."), base


def _public(uri: str) -> str:
    """A URI without query string or user:password@ part."""
    uri = uri.split("?", 1)[0]
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", uri)


def _secrets_of(options: dict[str, Any], extra: Sequence[str] = ()) -> tuple[str, ...]:
    """String values of options that look like credentials (to scrub from messages), and ``extra``."""
    found: list[str] = list(extra)

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(str(k)):
                found.append(v)

    walk(options)
    return tuple(sorted(set(found), key=len, reverse=True))


def _scheme_hint(uri: str) -> str:
    """What was likely meant by a URI whose protocol fsspec does not know: one with spaces
    around it (pasted), or a scheme in capitals (``S3://``)."""
    meant = uri.strip()
    scheme, sep, rest = meant.partition("://")
    if sep and scheme != scheme.lower():
        meant = f"{scheme.lower()}://{rest}"
    if meant == uri:
        return ""
    return f" (did you mean {meant!r}? schemes are lower case, and the URI is taken as given, spaces included)"
