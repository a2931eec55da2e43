"""Range reads and small calls under the fault policy, for any backend.

A read larger than the backend's piece size becomes concurrent requests (bounded in
count and held body bytes by a ``Gate``); each landed read is length-checked, its
CRC32C checks verified (large ones in a worker thread, off the event loop), a read
that may be a whole object without checksums of its own is checked against an MD5
ETag, and only the failed pieces come again. Errors name the object and byte range.

A read lands in one buffer or in a ``Landing``: consecutive buffers (a target's own
memory with staging between, so bytes land where they belong); checks run over the
landed bytes wherever they are, and a read counts as done only once they pass.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar, Union

from ..core.checksum import crc32c
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .backend import (Backend, Fetched, NotFound, RangeNotSatisfiable, TooLarge, Transient, WorkerThreads,
                      throttling)
from .gate import Gate
from .policy import (Attempts, ChecksumMismatch, Describer, Mismatches, RetryPolicy, mismatch_attempts, not_found_message,
                     retryable, sibling_path)

T = TypeVar("T")
MIN_PIECE = 4 << 20  # a batch is never cut into requests smaller than this (``Reader.piece_for``)
CRC_OFFLOAD = 1 << 20  # a read with at least this many checked bytes is verified in a worker thread


def piece_for(total: int, top: int | None, max_concurrency: int, held: int = 1 << 62,
              spread: int | None = None) -> int | None:
    """``Reader.piece_for`` as a pure function of the batch, so that a model of many ranks'
    requests (benchmarks/scale_model.py) counts the GETs the reader really makes. ``spread``:
    how many requests the batch should spread over (default half of ``max_concurrency``)."""
    if not top:
        return None
    top = min(top, max(MIN_PIECE, held // 4))
    ways = max(1, max_concurrency // 2 if spread is None else spread)
    return max(min(top, MIN_PIECE), min(top, -(-total // ways)))


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


class Landing:
    """Where one read's bytes go: consecutive byte buffers that together hold the range.

    A piece of the read may straddle buffers; the backend splits its body over them
    (``Backend.fetch_parts``) without an extra copy where its client allows.
    """

    __slots__ = ("parts", "starts", "length")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self.starts = []
        pos = 0
        for p in self.parts:
            self.starts.append(pos)
            pos += len(p)
        self.length = pos

    def __len__(self) -> int:
        return self.length

    def views(self, lo: int, hi: int) -> list[memoryview]:
        """The buffers' slices that hold bytes ``[lo, hi)`` of the read, in order."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.parts) and self.starts[i] < hi:
            s = self.starts[i]
            p = self.parts[i]
            a, b = max(lo, s) - s, min(hi, s + len(p)) - s
            if a < b:
                out.append(p[a:b])
            i += 1
        return out

    def crc(self, lo: int, n: int) -> int:
        value = 0
        for v in self.views(lo, lo + n):
            value = crc32c(v, value)
        return value

    def md5(self) -> str:
        h = hashlib.md5(usedforsecurity=False)
        for p in self.parts:
            h.update(p)
        return h.hexdigest()


Buffer = Union[memoryview, Landing]


def as_landing(buf: Buffer) -> Landing:
    return buf if isinstance(buf, Landing) else Landing([buf])


class ShortBody(Transient):
    """The response had fewer bytes than asked for (a reset or a short reply)."""


class _Truncated(Exception):
    """The object is shorter than the requested range; the value is its size."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


@dataclass
class Reader:
    """The policy's read side over one backend and one prefix."""

    backend: Backend
    policy: RetryPolicy
    describe: Describer
    root: str
    max_concurrency: int
    inflight_bytes: int
    piece_size: int | None = None
    rng: random.Random = field(default_factory=random.Random)
    verify_threads: WorkerThreads = field(default_factory=lambda: WorkerThreads(2, "streamckpt-crc"))

    def path(self, name: str) -> str:
        return sibling_path(self.root, name, self.describe) if name.startswith("../") else (
            f"{self.root}/{name}" if name else self.root)

    def note_throttled(self, errors: Sequence[BaseException]) -> None:
        """Count the throttled failures among ``errors`` for a client that does not count its own."""
        if not self.backend.counts_throttling:
            n = sum(1 for e in errors if throttling(e))
            if n:
                self.backend.throttled.add(n)

    # ----------------------------------------------------------- small calls

    async def call(self, what: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """One metadata or write call with retries; ``NotFound`` passes through."""
        tries = Attempts(self.policy, self.rng, what, self.describe)
        while True:
            try:
                return await fn(*args)
            except (NotFound, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - classified by Attempts
                self.note_throttled([e])
                await tries.failed(e)

    async def once(self, what: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """One attempt, for calls that are not safe to repeat (a streaming writer's parts);
        ``NotFound`` passes through, as from ``call`` (a missing bucket is the caller's URI)."""
        try:
            return await fn(*args)
        except (CheckpointError, NotFound, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - reported as the storage failure it is
            raise self.describe.failure(f"{what} failed", e) from None

    async def read_whole(self, name: str, max_bytes: int | None) -> bytes:
        """A whole small object, checked against its ETag when that is a plain MD5."""
        where = self.describe.name(name)
        tries = Attempts(self.policy, self.rng, f"reading {where}", self.describe)
        wrong = Mismatches(self.policy)
        sums = mismatch_attempts(self.policy, self.rng, f"reading {where}", self.describe)
        while True:
            try:
                data, etag = await self.backend.get_whole(self.path(name), max_bytes)
            except NotFound as e:
                raise CheckpointNotFoundError(not_found_message(self.describe, name, e)) from None
            except TooLarge as e:
                raise CorruptCheckpointError(f"{where} is {e.size} bytes, more than the {max_bytes}-byte limit") from None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classified by Attempts
                self.note_throttled([e])
                await tries.failed(e)
                continue
            digest = _md5_mismatch(etag, data)
            if digest is None:
                return data
            wrong.record(where, (0, len(data)), digest, " (the whole object vs its ETag)")
            await sums.failed(ChecksumMismatch(f"{where} does not match its ETag{wrong.summary()}"))

    # ----------------------------------------------------------- range reads

    async def read_all(self, reads: Sequence[RangeRead], buffers: Sequence[Buffer],
                       on_landed: Callable[[int], None] | None = None, inflight_bytes: int | None = None,
                       spread: int | None = None) -> int:
        """Every read into its buffer; returns the number of requests made.

        ``on_landed(i)`` (on the event loop) says that read ``i`` is in its buffer and verified;
        ``inflight_bytes`` bounds the bodies this batch holds (default: the reader's);
        ``spread``: as ``piece_for``'s.
        """
        limit = (inflight_bytes or self.inflight_bytes) if self.backend.holds_bodies else 1 << 62
        gate = Gate(self.max_concurrency, limit)
        counter = [0]
        piece = self.piece_for(sum(max(0, r.length) for r in reads), limit, spread)
        await all_or_cancel([
            asyncio.ensure_future(self._landed(i, self._read_one(r, as_landing(b), gate, counter, piece), on_landed))
            for i, (r, b) in enumerate(zip(reads, buffers)) if r.length > 0
        ])
        return counter[0]

    def piece_for(self, total: int, held: int = 1 << 62, spread: int | None = None) -> int | None:
        """The request size for a batch of ``total`` bytes: as large as the backend allows
        (``piece_size``: fewer requests, less CPU per byte on both ends), but small enough
        that the batch still spreads over half of ``max_concurrency`` requests (or
        ``spread``: a large job's ranks spread less, ``loading.requestrate.job_spread``), and that
        four bodies fit in ``held`` (what a body-holding client may hold), never below
        ``MIN_PIECE`` (nor above ``piece_size``). None: reads are never split.

        Measured (issue 28, 1 GiB full load into resident targets on loopback, a fresh
        process per load): pieces of 4 → 8 → 16 MiB took 0.95 → 0.76 → 0.66 s, the client's
        user CPU 0.40 → 0.27 → 0.19 s; at 256 MiB (fresh targets) 8 → 16 MiB took 0.34 → 0.30 s. A small load keeps enough requests in
        flight for a store whose connections are each slower than the link (S3).
        """
        return piece_for(total, self.piece_size, self.max_concurrency, held, spread)

    @staticmethod
    async def _landed(i: int, read: Awaitable[None], on_landed: Callable[[int], None] | None) -> None:
        await read
        if on_landed is not None:
            on_landed(i)

    async def _read_one(self, r: RangeRead, buf: Landing, gate: Gate, counter: list[int],
                        piece: int | None) -> None:
        obj = self.describe.name(r.name)
        path = self.path(r.name)
        # A read that may be a whole object without checksums of its own is checked against
        # the ETag, which cannot say which piece was bad: keep it one request.
        whole = not r.checks and r.start == 0
        step = r.length if whole or not piece else max(1, piece)
        pieces = [(a, min(r.stop, a + step)) for a in range(r.start, r.stop, step)]
        tries = Attempts(self.policy, self.rng, f"reading {obj} bytes [{r.start}, {r.stop})", self.describe)
        wrong = Mismatches(self.policy)
        sums = mismatch_attempts(self.policy, self.rng, tries.what, self.describe)
        todo = pieces
        while True:
            outcomes = await asyncio.gather(
                *(self._piece(path, r, a, b, buf, gate, counter, whole) for a, b in todo), return_exceptions=True
            )
            failed = [(p, o) for p, o in zip(todo, outcomes) if isinstance(o, BaseException)]
            if not failed:
                meta = next((o for o in outcomes if isinstance(o, Fetched) and o.size is not None), None)
                bad = await self._bad_spans(r, buf, meta if whole else None)
                if not bad:
                    return
                for a, b, digest, what in bad:
                    wrong.record(obj, (a, b), digest, what)
                spans = ", ".join(f"[{a}, {b})" for a, b, _, _ in bad[:3])
                await sums.failed(ChecksumMismatch(f"checksum mismatch in bytes {spans}{wrong.summary()}"))
                todo = [(pa, pb) for pa, pb in pieces if any(pa < b and a < pb for a, b, _, _ in bad)]
                continue
            self.note_throttled([o for _, o in failed])
            e = _worst([o for _, o in failed])
            if isinstance(e, asyncio.CancelledError):
                raise e
            if isinstance(e, _Truncated):
                raise self.truncated(r, e.size) from None
            if isinstance(e, NotFound):
                raise CheckpointNotFoundError(not_found_message(self.describe, r.name, e)) from None
            if isinstance(e, (RangeNotSatisfiable, ShortBody)):
                size = await self._size_now(path)
                if size is not None and size < r.stop:
                    raise self.truncated(r, size) from None
            await tries.failed(e)
            todo = [p for p, _ in failed]

    async def _piece(
        self, path: str, r: RangeRead, a: int, b: int, buf: Landing, gate: Gate, counter: list[int], meta: bool
    ) -> Fetched:
        """One request for ``[a, b)`` of ``r`` into its slice of ``buf``, length-checked."""
        await gate.acquire(b - a)
        try:
            counter[0] += 1
            views = buf.views(a - r.start, b - r.start)
            if len(views) == 1:
                got = await self.backend.fetch(path, a, views[0], want_meta=meta)
            else:
                got = await self.backend.fetch_parts(path, a, views, want_meta=meta)
        finally:
            gate.release(b - a)
        if got.size is not None and got.size < b:
            raise _Truncated(got.size)
        if got.got != b - a:
            raise ShortBody(f"short body: got {got.got} of {b - a} bytes at {a}")
        return got

    async def _bad_spans(
        self, r: RangeRead, buf: Landing, meta: Fetched | None
    ) -> list[tuple[int, int, str, str]]:
        """``(start, stop, digest of what came, note)`` of every failed check, absolute offsets."""
        if r.checks:
            if sum(length for _, length, _ in r.checks) >= CRC_OFFLOAD:
                bad = await self.verify_threads.run(failed_checks, r, buf)
            else:
                bad = failed_checks(r, buf)
            return [(r.start + off, r.start + off + n, f"crc32c {crc:08x}", "") for off, n, crc in bad]
        if meta is not None and meta.size == r.stop:
            digest = _md5_mismatch(meta.etag, buf)
            if digest is not None:
                return [(r.start, r.stop, digest, " (the whole object vs its ETag)")]
        return []

    def truncated(self, r: RangeRead, size: int | None) -> CorruptCheckpointError:
        has = "fewer bytes" if size is None else f"{size} bytes"
        return CorruptCheckpointError(
            f"{self.describe.name(r.name)} is truncated: bytes [{r.start}, {r.stop}) requested, the object has {has}"
        )

    async def _size_now(self, path: str) -> int | None:
        """The object's size now (None if it cannot be found out): only a hint for the verdict."""
        try:
            return (await self.backend.head(path)).size
        except Exception:  # noqa: BLE001
            return None


def failed_checks(r: RangeRead, buf: Buffer) -> list[tuple[int, int, int]]:
    """``(offset, length, crc32c that came)`` of every check that fails, over the landed bytes."""
    land = as_landing(buf)
    if len(land.parts) == 1:  # most reads: one buffer, thousands of chunks
        single = land.parts[0]
        return [(off, n, got) for off, n, want in r.checks if (got := crc32c(single[off:off + n])) != want]
    return [(off, n, got) for off, n, want in r.checks if (got := land.crc(off, n)) != want]


def _md5_mismatch(etag: Any, data: bytes | bytearray | memoryview | Landing) -> str | None:
    """The MD5 of ``data`` when the ETag is a plain MD5 (single-part upload) and differs; else None."""
    tag = str(etag or "").strip('"')
    if not re.fullmatch(r"[0-9a-f]{32}", tag):
        return None
    got = data.md5() if isinstance(data, Landing) else hashlib.md5(data, usedforsecurity=False).hexdigest()
    return None if got == tag else f"md5 {got}"


def _worst(errors: Sequence[BaseException]) -> BaseException:
    """The failure that decides a read's fate: cancellation, truncation, missing, fatal, then transient."""

    def rank(e: BaseException) -> int:
        if isinstance(e, asyncio.CancelledError):
            return 0
        if isinstance(e, _Truncated):
            return 1
        if isinstance(e, NotFound):
            return 2
        return 4 if retryable(e) else 3

    return min(errors, key=rank)


async def all_or_cancel(tasks: list["asyncio.Future[Any]"]) -> None:
    """Await every task; on the first failure cancel the rest and wait for them to end
    (a read may be writing into a staging buffer) before raising."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
