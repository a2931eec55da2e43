"""Storage against a real S3 server (moto over HTTP via s3fs), local paths and file:// URLs."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.storage.httpget import AUTO_PICKS_HTTP
from streamckpt.storage.obstore_backend import BACKEND_ENV

MiB = 1 << 20


_S3_CLIENTS = {"s3": "auto", "s3-obstore": "obstore", "s3-s3fs": "s3fs"}


@pytest.fixture(params=["s3", "s3-obstore", "s3-s3fs", "local", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Storage:
    """The same tests over every kind of URI that shares the code path; on S3 through the
    default read client (``http.client`` range reads), obstore and the s3fs fallback."""
    if request.param.startswith("s3"):
        uri, opts = request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_opts")
        monkeypatch.setenv(BACKEND_ENV, _S3_CLIENTS[request.param])
    elif request.param == "local":
        uri, opts = str(tmp_path / "ckpt"), None
    else:
        uri, opts = (tmp_path / "ckpt").as_uri(), None
    st = Storage(uri, opts, policy=RetryPolicy(total_timeout=20.0))
    if request.param.startswith("s3"):
        wanted = _S3_CLIENTS[request.param]
        assert st.read_backend == (("http" if AUTO_PICKS_HTTP else "obstore") if wanted == "auto" else wanted)
    st.makedirs()
    return st


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_range_reads_land_exact_bytes(store: Storage) -> None:
    data = _payload(2 * MiB + 17)
    store.write_bytes("data/00000.bin", data)
    rng = random.Random(1)
    reads = []
    for _ in range(40):
        a = rng.randrange(0, len(data))
        b = rng.randrange(a, min(len(data), a + 300_000) + 1)
        reads.append(RangeRead("data/00000.bin", a, b))
    reads.append(RangeRead("data/00000.bin", 0, len(data)))  # the whole object
    reads.append(RangeRead("data/00000.bin", len(data) - 1, len(data)))  # the last byte
    bufs = [bytearray(r.length) for r in reads]
    requests = store.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=60)
    assert requests == len(reads)
    for r, b in zip(reads, bufs):
        assert bytes(b) == data[r.start:r.stop], (r.start, r.stop)


def test_read_bytes_whole_and_range(store: Storage) -> None:
    data = _payload(100_000, seed=2)
    store.write_bytes("obj", data)
    assert store.read_bytes("obj") == data
    assert store.read_bytes("obj", 1000, 1234) == data[1000:1234]
    assert store.read_bytes("obj", 5, 5) == b""


def test_checksums_verified_into_buffer(store: Storage) -> None:
    data = _payload(300_000, seed=3)
    store.write_bytes("obj", data)
    start, stop = 1000, 201_000
    chunk = 65_536
    checks = tuple(
        (off, min(chunk, stop - start - off), crc32c(data[start + off:start + min(off + chunk, stop - start)]))
        for off in range(0, stop - start, chunk)
    )
    buf = bytearray(stop - start)
    assert store.read_into([RangeRead("obj", start, stop, checks)], [memoryview(buf)]).result(timeout=60) == 1
    assert bytes(buf) == data[start:stop]


def test_checksum_mismatch_is_corruption_naming_object_and_range(store: Storage) -> None:
    data = _payload(200_000, seed=4)
    store.write_bytes("data/00001.bin", data)
    good = crc32c(data[4096:8192])
    checks = ((0, 4096, crc32c(data[0:4096])), (4096, 4096, good ^ 1))  # second chunk "corrupt"
    buf = bytearray(8192)
    with pytest.raises(CorruptCheckpointError) as ei:
        store.read_into([RangeRead("data/00001.bin", 0, 8192, checks)], [memoryview(buf)]).result(timeout=60)
    msg = str(ei.value)
    assert "data/00001.bin" in msg
    assert "[4096, 8192)" in msg


def test_reading_past_the_end_is_a_truncated_object(store: Storage) -> None:
    data = _payload(10_000, seed=5)
    store.write_bytes("short.bin", data)
    buf = bytearray(2000)
    with pytest.raises(CorruptCheckpointError) as ei:
        store.read_into([RangeRead("short.bin", 9000, 11_000)], [memoryview(buf)]).result(timeout=60)
    assert "short.bin" in str(ei.value)
    assert "9000" in str(ei.value) and "11000" in str(ei.value)
    with pytest.raises(CorruptCheckpointError):
        store.read_bytes("short.bin", 20_000, 20_010)


def test_buffer_length_must_match_the_read(store: Storage) -> None:
    store.write_bytes("obj", b"x" * 100)
    with pytest.raises(ValueError):
        store.read_into([RangeRead("obj", 0, 10)], [memoryview(bytearray(9))])


def test_missing_object_is_not_found(store: Storage) -> None:
    with pytest.raises(CheckpointNotFoundError) as ei:
        store.read_bytes("nope/manifest.json")
    assert "nope/manifest.json" in str(ei.value)
    with pytest.raises(CheckpointNotFoundError):
        store.read_bytes("nope.bin", 0, 10)
    with pytest.raises(CheckpointNotFoundError):
        store.read_into([RangeRead("nope.bin", 0, 4)], [memoryview(bytearray(4))]).result(timeout=60)
    with pytest.raises(CheckpointNotFoundError):
        store.size("nope.bin")
    assert not store.exists("nope.bin")


def test_list_exists_size_delete(store: Storage) -> None:
    store.write_bytes("manifest.json", b"{}")
    store.write_bytes("data/00000.bin", b"a" * 10)
    store.write_bytes("data/00001.bin", b"b" * 20)
    assert store.list(recursive=True) == ["data/00000.bin", "data/00001.bin", "manifest.json"]
    assert store.list("data", recursive=True) == ["data/00000.bin", "data/00001.bin"]
    assert set(store.list()) == {"data", "manifest.json"}
    assert store.list("absent", recursive=True) == []
    assert store.exists("manifest.json") and store.exists("data/00001.bin")
    assert store.size("data/00001.bin") == 20
    store.delete("data/00000.bin")
    assert not store.exists("data/00000.bin")
    store.delete("data/00000.bin")  # deleting what is gone is not an error
    store.write_bytes("manifest.json", b'{"v": 2}')  # overwrite
    assert store.read_bytes("manifest.json") == b'{"v": 2}'


def test_streaming_upload_commit(store: Storage) -> None:
    data = _payload(11 * MiB + 3, seed=6)  # three 5 MiB parts on S3
    view = memoryview(data)
    up = store.open_write("data/00000.safetensors", block_size=5 * MiB)
    for i in range(0, len(data), 1 * MiB + 7):
        up.write(view[i:i + 1 * MiB + 7])
    assert not store.exists("data/00000.safetensors")  # nothing visible before commit
    up.commit()
    assert up.bytes_written == len(data)
    assert store.size("data/00000.safetensors") == len(data)
    assert store.read_bytes("data/00000.safetensors") == data


def _leftovers(store: Storage) -> list[str]:
    """Objects, temp files and (on S3) pending multipart uploads left under the prefix."""
    names = store.list(recursive=True)
    if store.fs.protocol[0] in ("s3", "s3a"):
        bucket, _, key = store.root.partition("/")
        pending = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
        names += [f"multipart:{u['Key']}" for u in pending]
    return names


def test_streaming_upload_abort_leaves_nothing(store: Storage) -> None:
    up = store.open_write("data/00000.safetensors", block_size=5 * MiB)
    up.write(_payload(6 * MiB, seed=7))  # one part already sent on S3
    up.abort()
    assert not store.exists("data/00000.safetensors")
    assert _leftovers(store) == []


def test_upload_context_manager_aborts_on_error(store: Storage) -> None:
    with pytest.raises(RuntimeError):
        with store.open_write("x.bin", block_size=5 * MiB) as up:
            up.write(b"partial")
            raise RuntimeError("writer died")
    assert not store.exists("x.bin")
    assert _leftovers(store) == []
    with store.open_write("y.bin") as up:
        up.write(b"whole")
    assert store.read_bytes("y.bin") == b"whole"


def test_messages_and_reprs_carry_no_credentials(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    st = Storage(s3_uri, s3_opts, policy=RetryPolicy(total_timeout=5.0))
    secret, key = s3_opts["secret"], s3_opts["key"]
    texts = [repr(st), st.describe("manifest.json")]
    for call in (lambda: st.read_bytes("gone"), lambda: st.size("gone"), lambda: st.read_bytes("gone", 0, 3)):
        with pytest.raises(CheckpointNotFoundError) as ei:
            call()
        texts += [str(ei.value), repr(ei.value)]
    for t in texts:
        assert secret not in t and key not in t, t


def test_unreachable_endpoint_fails_fast_with_storage_error(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    from streamckpt.testing.s3server import free_port

    opts = dict(s3_opts, endpoint_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    st = Storage(s3_uri, opts, policy=RetryPolicy(max_attempts=3, client_attempts=1, base_delay=0.01,
                                                    total_timeout=10.0))
    with pytest.raises(StorageError) as ei:
        st.read_into([RangeRead("data/00000.bin", 0, 100)], [memoryview(bytearray(100))]).result(timeout=60)
    assert "data/00000.bin" in str(ei.value) and "[0, 100)" in str(ei.value)


def test_local_file_uri_and_plain_path_share_objects(tmp_path: Any) -> None:
    plain = Storage(str(tmp_path / "c"))
    plain.makedirs()
    plain.write_bytes("manifest.json", b"hello")
    via_url = Storage((tmp_path / "c").as_uri())
    assert via_url.read_bytes("manifest.json") == b"hello"
    assert os.path.exists(tmp_path / "c" / "manifest.json")


def test_credentials_never_logged_raised_or_stored(
    s3_uri: str, local_s3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A DEBUG-level save, faulty load and failing calls: the secret shows up nowhere;
    the access key id shows up in none of streamckpt's own logs or errors."""
    import logging

    import torch

    import streamckpt as sc
    from streamckpt.testing import FaultProxy

    key, secret = "AKIASTREAMCKPTKEY0001", "s3cr3t/StreamckptValue+Do-Not-Print"
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG), FaultProxy(
        local_s3.endpoint_url, faults=["reset", "short", "flip"], rate=0.3, seed=1
    ) as proxy:
        opts = {"endpoint_url": proxy.endpoint_url, "key": key, "secret": secret}
        sd = {"w": torch.arange(5000.0)}
        sc.save(sd, s3_uri, storage_options=opts)
        for _ in range(20):  # until the proxy has injected a fault (which request gets one depends on the sequence)
            out = {"w": torch.zeros(5000)}
            sc.load(out, s3_uri, storage_options=opts)
            assert torch.equal(out["w"], sd["w"])
            if proxy.injected:
                break
        st = Storage(s3_uri, opts)
        texts += [repr(st), str(sc.inspect(s3_uri, storage_options=opts))]
        for call in (lambda: sc.load(out, s3_uri + "-absent", storage_options=opts),
                     lambda: st.read_bytes("absent.bin", 0, 10),
                     lambda: Storage(s3_uri, dict(opts, endpoint_url="http://127.0.0.1:9"),
                                     policy=RetryPolicy(max_attempts=2, client_attempts=1,
                                                        total_timeout=3)).size("x")):
            with pytest.raises(sc.CheckpointError) as ei:
                call()
            texts += [str(ei.value), repr(ei.value)]
        texts.append(st.read_bytes("manifest.json").decode())
    assert proxy.injected > 0
    everything = "\n".join(texts + [r.getMessage() for r in caplog.records])
    assert secret not in everything
    ours = "\n".join(texts + [r.getMessage() for r in caplog.records if r.name.startswith("streamckpt")])
    assert key not in ours


def test_gate_bounds_requests_and_bytes_first_come_first_served() -> None:
    """The obstore path's admission gate: never more than its bounds, in arrival order,
    a cancelled waiter leaves no hole, and one request always goes even if oversized."""
    import asyncio

    from streamckpt.storage.gate import Gate as _Gate

    async def scenario() -> list[tuple[str, int, int]]:
        gate = _Gate(count=2, nbytes=10)
        log: list[tuple[str, int, int]] = []

        async def job(name: str, n: int, hold: asyncio.Event) -> None:
            await gate.acquire(n)
            log.append((name, gate._requests, gate._used))
            await hold.wait()
            gate.release(n)

        holds = {k: asyncio.Event() for k in "abcdefg"}
        tasks = {k: asyncio.ensure_future(job(k, n, holds[k]))
                 for k, n in zip("abcdefg", [40, 3, 6, 4, 4, 1, 1])}
        await asyncio.sleep(0.01)
        assert [e[0] for e in log] == ["a"]  # 40 > 10 bytes, but alone it may go
        holds["a"].set()
        await asyncio.sleep(0.01)
        assert [e[0] for e in log] == ["a", "b", "c"]  # 3 + 6 fit; d (4) would not
        tasks["d"].cancel()  # waiting: leaves the queue without taking anything
        holds["b"].set()
        await asyncio.sleep(0.01)
        assert [e[0] for e in log] == ["a", "b", "c", "e"]  # e next in line; f waits behind it (2 requests)
        for k in "cefg":
            holds[k].set()
        await asyncio.gather(*(t for k, t in tasks.items() if k != "d"))
        assert (gate._requests, gate._used) == (0, 0)
        return log

    log = asyncio.run(scenario())
    assert [e[0] for e in log] == ["a", "b", "c", "e", "f", "g"]
    assert all(r <= 2 and (u <= 10 or r == 1) for _, r, u in log)


def test_worker_threads_leave_no_unretrieved_error(caplog: pytest.LogCaptureFixture) -> None:
    """A caller cancelled just as its blocking call failed (a sibling read failed first) must not
    leave asyncio logging "Future exception was never retrieved" at ERROR for every such read.
    The race is timing-bound: with ``asyncio.shield`` this loop logged it 0-4 times in 300."""
    import asyncio
    import gc
    import logging
    import threading
    import time

    from streamckpt.storage.backend import WorkerThreads

    def fail(go: threading.Event) -> None:
        go.wait()
        raise ValueError("the call failed")

    async def main() -> list[Any]:
        threads = WorkerThreads(4, "test")
        outcomes = []
        try:
            for i in range(1000):
                go = threading.Event()
                task = asyncio.ensure_future(threads.run(fail, go))
                await asyncio.sleep(0)
                go.set()
                time.sleep(0.001)  # the call fails while the loop is busy
                for _ in range(i % 3):
                    await asyncio.sleep(0)
                task.cancel()
                outcomes.append((await asyncio.gather(task, return_exceptions=True))[0])
            go = threading.Event()
            go.set()
            outcomes.append((await asyncio.gather(threads.run(fail, go), return_exceptions=True))[0])
            outcomes.append(await threads.run(len, "abc"))
        finally:
            threads.close()
        return outcomes

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        outcomes = asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    raced = outcomes[:-2]  # cancelled, or (when it finished first) the call's own error
    assert all(isinstance(o, (asyncio.CancelledError, ValueError)) for o in raced)
    assert sum(isinstance(o, asyncio.CancelledError) for o in raced) > len(raced) // 2
    assert isinstance(outcomes[-2], ValueError) and outcomes[-1] == 3  # an awaited call still gets both
