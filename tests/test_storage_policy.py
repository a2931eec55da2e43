"""The fault policy, once for every backend: driven through ``Storage`` over a scripted
layer that wraps the in-memory backend (deterministic fault sequences, no network).
The real servers and clients are covered by test_storage / test_obstore / test_faultproxy."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest

from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.storage import Permanent, RangeRead, RetryPolicy, Stalled, Storage, Transient
from streamckpt.storage.backend import Backend, Fetched, ObjectInfo, PartSink
from streamckpt.storage.memory_backend import MemoryBackend

FAST = RetryPolicy(base_delay=0.0, max_delay=0.0, request_timeout=2.0)
DATA = random.Random(3).randbytes(100_000)
CHUNK = 4096


class Scripted(Backend):
    """Wraps a backend: each call first consumes the next scripted action for its kind
    (an exception to raise, a callable to alter the fetched bytes, or None), and is counted."""

    def __init__(self, inner: Backend, script: dict[str, list[Any]] | None = None, piece_size: int | None = None):
        self.inner = inner
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.calls: Counter[str] = Counter()
        self.piece_size = piece_size
        self.holds_bodies = True
        self.inflight = 0
        self.max_inflight = 0

    def _next(self, kind: str) -> Any:
        self.calls[kind] += 1
        queue = self.script.get(kind) or []
        action = queue.pop(0) if queue else None
        if isinstance(action, BaseException):
            raise action
        return action

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        action = self._next("fetch")
        self.inflight += len(buf)
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(0.001)
            got = await self.inner.fetch(path, start, buf, want_meta=want_meta)
        finally:
            self.inflight -= len(buf)
        return action(buf, got) if callable(action) else got

    async def head(self, path: str) -> ObjectInfo:
        self._next("head")
        return await self.inner.head(path)

    async def listing(self, path: str, recursive: bool) -> list[str]:
        self._next("listing")
        return await self.inner.listing(path, recursive)

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        action = self._next("get_whole")
        data, etag = await self.inner.get_whole(path, max_bytes)
        return (action(data), etag) if callable(action) else (data, etag)

    async def delete(self, path: str, recursive: bool) -> None:
        self._next("delete")
        await self.inner.delete(path, recursive)

    def sink(self, path: str) -> PartSink:
        return ScriptedSink(self, self.inner.sink(path))


class ScriptedSink(PartSink):
    concurrent = True
    min_part = 1

    def __init__(self, backend: Scripted, inner: PartSink) -> None:
        self.b, self.inner = backend, inner

    async def put_whole(self, data: memoryview) -> None:
        self.b._next("put_whole")
        await self.inner.put_whole(data)

    async def start(self) -> None:
        self.b._next("start")
        await self.inner.start()

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        self.b._next("put_part")
        self.b.inflight += 1
        self.b.max_inflight = max(self.b.max_inflight, self.b.inflight)
        try:
            await asyncio.sleep(0.005)
            return await self.inner.put_part(number, offset, data)
        finally:
            self.b.inflight -= 1

    async def complete(self, tokens: list[Any]) -> None:
        self.b._next("complete")
        await self.inner.complete(tokens)

    async def abort(self) -> None:
        self.b._next("abort")
        await self.inner.abort()


class _Flip:
    """A fetch action flipping one bit (number ``bit``) of the fetched bytes' first byte."""

    def __init__(self, bit: int) -> None:
        self.bit = bit

    def __call__(self, buf: memoryview, got: Fetched) -> Fetched:
        buf[0] ^= 1 << (self.bit % 8)
        return got


def make(script: dict[str, list[Any]] | None = None, *, policy: RetryPolicy = FAST, piece_size: int | None = None,
         buckets: tuple[str, ...] | None = None, options: dict[str, Any] | None = None) -> tuple[Storage, Scripted]:
    inner = MemoryBackend(buckets)
    if buckets is None or "b" in buckets:
        inner.put("b/ck/data/0.bin", DATA)
        inner.put("b/ck/manifest.json", b'{"format": "streamckpt"}')
    backend = Scripted(inner, script, piece_size)
    return Storage("mem://b/ck", options, policy=policy, backend=backend), backend


def checked(start: int, stop: int) -> RangeRead:
    checks = tuple((off, min(CHUNK, stop - start - off), crc32c(DATA[start + off:start + min(off + CHUNK, stop - start)]))
                   for off in range(0, stop - start, CHUNK))
    return RangeRead("data/0.bin", start, stop, checks)


def read(st: Storage, r: RangeRead) -> tuple[bytes, int]:
    buf = bytearray(r.length)
    n = st.read_into([r], [memoryview(buf)]).result(timeout=30)
    return bytes(buf), n


# ------------------------------------------------------------------ reads


def test_transient_failures_are_retried_to_exact_bytes() -> None:
    st, b = make({"fetch": [Transient("503 SlowDown"), Stalled("read timed out"), None]})
    got, n = read(st, checked(1000, 9000))
    assert got == DATA[1000:9000] and n == 3 and b.calls["fetch"] == 3


def test_persistent_transient_ends_in_storage_error_after_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=4, base_delay=0.0, max_delay=0.0)
    st, b = make({"fetch": [Transient("503 SlowDown secret-value-123")] * 100}, policy=policy,
                 options={"secret": "secret-value-123"})
    with pytest.raises(StorageError) as ei:
        read(st, checked(0, 500))
    msg = str(ei.value)
    assert "mem://b/ck/data/0.bin bytes [0, 500)" in msg and "after 4 attempt(s)" in msg
    assert "secret-value-123" not in msg and "***" in msg
    assert b.calls["fetch"] == 4


def test_stalls_say_stalled_in_one_vocabulary() -> None:
    st, b = make({"fetch": [Stalled("operation timed out")] * 100},
                 policy=RetryPolicy(max_attempts=2, base_delay=0.0, request_timeout=1.5))
    with pytest.raises(StorageError, match=r"no response for 1\.5 s \(stalled\)"):
        read(st, checked(0, 10))
    assert b.calls["fetch"] == 2


def test_permanent_failure_is_not_retried() -> None:
    st, b = make({"fetch": [Permanent("AccessDenied")] * 10})
    with pytest.raises(StorageError, match="after 1 attempt"):
        read(st, checked(0, 10))
    assert b.calls["fetch"] == 1


def test_missing_object_and_missing_bucket_are_not_found_at_once() -> None:
    st, b = make()
    with pytest.raises(CheckpointNotFoundError, match=r"data/absent\.bin does not exist"):
        read(st, RangeRead("data/absent.bin", 0, 10))
    assert b.calls["fetch"] == 1
    st, b = make(buckets=("other",))
    for call in (lambda: st.list(""), lambda: st.exists("manifest.json"), lambda: st.size("manifest.json"),
                 lambda: st.read_bytes("manifest.json"), lambda: read(st, RangeRead("data/0.bin", 0, 10))):
        with pytest.raises(CheckpointNotFoundError, match="bucket 'b' does not exist"):
            call()
    assert sum(b.calls.values()) == 5  # one call each, no retries


def test_only_the_failed_piece_is_fetched_again() -> None:
    st, b = make({"fetch": [None, Transient("reset"), None, None]}, piece_size=30_000)
    got, n = read(st, checked(0, 90_000))
    assert got == DATA[:90_000] and n == 4 and b.calls["fetch"] == 4


def test_short_body_is_retried_but_a_short_object_is_truncated() -> None:
    def short(buf: memoryview, got: Fetched) -> Fetched:
        return Fetched(got=got.got - 1)

    st, b = make({"fetch": [short, None]})
    assert read(st, checked(0, 5000))[0] == DATA[:5000] and b.calls["fetch"] == 2
    st, b = make()
    with pytest.raises(CorruptCheckpointError, match=r"truncated: bytes \[99990, 100010\) requested, the object has 100000"):
        read(st, RangeRead("data/0.bin", len(DATA) - 10, len(DATA) + 10))


def test_differing_mismatches_are_transit_same_mismatch_is_rot() -> None:
    # three different wrong contents, then the right one: the read succeeds
    st, b = make({"fetch": [_Flip(0), _Flip(1), _Flip(2), None]})
    assert read(st, checked(0, 4096))[0] == DATA[:4096] and b.calls["fetch"] == 4
    # always different: StorageError after the mismatch limit, saying what was compared
    policy = RetryPolicy(max_attempts=5, base_delay=0.0, max_delay=0.0, checksum_retries=2)
    st, b = make({"fetch": [_Flip(i) for i in range(100)]}, policy=policy)
    with pytest.raises(StorageError) as ei:
        read(st, checked(0, 4096))
    assert not isinstance(ei.value, CorruptCheckpointError) and "5 different wrong contents" in str(ei.value)
    assert b.calls["fetch"] == 5
    # different, then the same wrong content three times: corrupt at rest on the 4th read
    st, b = make({"fetch": [_Flip(1), _Flip(0), _Flip(0), _Flip(0), None]}, policy=policy)
    with pytest.raises(CorruptCheckpointError) as ei:
        read(st, checked(0, 4096))
    assert "bytes [0, 4096)" in str(ei.value) and "on 3 of 4 reads" in str(ei.value)
    assert b.calls["fetch"] == 4


def test_checksum_retries_zero_calls_the_first_mismatch_corrupt() -> None:
    st, b = make({"fetch": [_Flip(0)]}, policy=RetryPolicy(checksum_retries=0, base_delay=0.0))
    with pytest.raises(CorruptCheckpointError):
        read(st, checked(0, 100))
    assert b.calls["fetch"] == 1


def test_whole_object_is_checked_against_its_md5_etag() -> None:
    def rot(data: bytes) -> bytes:
        return b"X" + data[1:]

    st, b = make({"get_whole": [rot, None]})
    assert st.read_bytes("data/0.bin") == DATA and b.calls["get_whole"] == 2
    st, b = make({"get_whole": [rot] * 10})
    with pytest.raises(CorruptCheckpointError, match="ETag"):
        st.read_bytes("data/0.bin")
    assert b.calls["get_whole"] == FAST.checksum_retries + 1
    with pytest.raises(CorruptCheckpointError, match="more than the 10-byte limit"):
        st.read_bytes("manifest.json", max_bytes=10)


def test_body_bytes_in_flight_stay_under_the_gate() -> None:
    st, b = make(piece_size=10_000)
    st.inflight_bytes = 25_000
    reads = [checked(a, a + 20_000) for a in range(0, 80_000, 20_000)]
    bufs = [bytearray(r.length) for r in reads]
    assert st.read_into(reads, [memoryview(x) for x in bufs]).result(timeout=30) == 8
    assert all(bytes(x) == DATA[r.start:r.stop] for r, x in zip(reads, bufs))
    assert 10_000 <= b.max_inflight <= 25_000


def test_metadata_calls_retry_transients() -> None:
    st, b = make({"head": [Transient("503")] * 2, "listing": [Transient("reset")]})
    assert st.size("data/0.bin") == len(DATA) and b.calls["head"] == 3
    assert st.list("") == ["data", "manifest.json"] and b.calls["listing"] == 2


def test_deadline_stops_new_attempts() -> None:
    policy = RetryPolicy(max_attempts=1000, base_delay=0.05, max_delay=0.05, total_timeout=0.3)
    st, b = make({"fetch": [Transient("503")] * 10_000}, policy=policy)
    with pytest.raises(StorageError):
        read(st, checked(0, 10))
    assert 2 <= b.calls["fetch"] < 100


# ------------------------------------------------------------------ uploads


def test_upload_parts_in_flight_are_bounded_and_retried() -> None:
    st, b = make({"put_part": [None, Transient("503"), None]})
    with st.open_write("data/1.bin", block_size=10_000, parts_in_flight=3) as up:
        for i in range(0, len(DATA), 7_000):
            up.write(DATA[i:i + 7_000])
    assert st.read_bytes("data/1.bin") == DATA
    assert b.calls["put_part"] == 11 and b.calls["start"] == 1 and b.calls["complete"] == 1
    assert 2 <= b.max_inflight <= 3  # never more than parts_in_flight at once (all part buffers)


def test_small_upload_is_one_put() -> None:
    st, b = make()
    with st.open_write("small.bin", block_size=1 << 20) as up:
        up.write(b"hello")
    assert st.read_bytes("small.bin") == b"hello" and b.calls["put_whole"] == 1 and b.calls["start"] == 0


def test_failed_part_aborts_and_leaves_nothing() -> None:
    st, b = make({"put_part": [None, Permanent("AccessDenied")]})
    up = st.open_write("data/2.bin", block_size=10_000, parts_in_flight=2)
    with pytest.raises(StorageError, match=r"part 2 of mem://b/ck/data/2\.bin"):
        up.write(DATA)
        up.commit()
    assert b.calls["abort"] == 1 and b.calls["complete"] == 0
    assert not st.exists("data/2.bin")
    with pytest.raises(StorageError, match="write after commit/abort"):
        up.write(b"x")
