"""A save uploads each rank's share as bounded data files, one request each, several at
once: requests and sizes counted through a proxy in front of the real moto server; a
data file that cannot be uploaded fails the save, which deletes the files it wrote and
commits nothing; the upload queue never holds more buffers than its bound."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import streamckpt as sc
from streamckpt.saving.writer import pack
from streamckpt.storage import Storage
from streamckpt.storage.uploads import ObjectQueue
from streamckpt.testing import FaultProxy, LocalS3

MiB = 1 << 20


@given(st.lists(st.integers(0, 5 * MiB), max_size=40), st.integers(1, 4 * MiB))
def test_pack_keeps_order_and_bounds_files(sizes: list[int], limit: int) -> None:
    groups = pack(sizes, limit)
    assert [i for g in groups for i in g] == list(range(len(sizes)))  # every item once, in order
    for g in groups:
        assert len(g) >= 1
        assert len(g) == 1 or sum(sizes[i] for i in g) <= limit  # only a lone item may exceed
    for a, b in zip(groups, groups[1:]):  # greedy: the next item did not fit
        assert sum(sizes[i] for i in a) + sizes[b[0]] > limit


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(768, 1024, generator=g),  # 3 MiB: cut into row blocks
        "flat": torch.randn(600_000, generator=g),  # 2.3 MiB, 1-D: cut into flat ranges
        "mid": torch.randn(128, 1024, generator=g).to(torch.bfloat16),
        "norm": torch.randn(1024, generator=g),
    }


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_is_bounded_files_one_put_each(compression: str | None, s3_uri: str, local_s3: LocalS3,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(MiB))
    state = _state()
    with FaultProxy(local_s3.endpoint_url, faults=["slowdown"], rate=0.0, methods=("PUT", "POST")) as proxy:
        res = sc.save(state, s3_uri, storage_options=proxy.storage_options, compression=compression)
        methods = Counter(m for m, _, _ in proxy.history)
    data = [f for f in res.files if f.startswith("data/")]
    ext = "zst" if compression else "safetensors"
    assert data == [f"data/00000-{i:04d}.{ext}" for i in range(len(data))]
    assert len(data) >= 6  # 5.9 MiB in files of at most 1 MiB
    assert methods["POST"] == 0  # no multipart upload
    assert methods["PUT"] == len(data) + 1  # one per data file, then the manifest
    info = sc.inspect(s3_uri, storage_options=local_s3.storage_options)
    for name in data:
        assert info.files[name] <= MiB + (64 << 10), (name, info.files[name])  # + header / zstd frames
    back = sc.load_full(s3_uri, storage_options=local_s3.storage_options)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_local_save_writes_the_same_files(tmp_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(MiB))
    state = _state()
    res = sc.save(state, tmp_uri)
    assert len([f for f in res.files if f.startswith("data/")]) >= 6
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    sc.load(back, tmp_uri)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_failed_data_file_deletes_the_rest_and_commits_nothing(s3_uri: str, local_s3: LocalS3,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(MiB))
    monkeypatch.setenv("STREAMCKPT_MAX_ATTEMPTS", "2")
    with FaultProxy(local_s3.endpoint_url, faults=["slowdown"], rate=1.0, methods=("PUT",), max_repeats=10**9,
                    match=lambda m, p: "/data/00000-0002." in p) as proxy:
        with pytest.raises(sc.StorageError) as ei:
            sc.save(_state(), s3_uri, storage_options=proxy.storage_options)
        faulted = proxy.injected
    assert "data/00000-0002.safetensors" in str(ei.value)
    assert faulted >= 2  # retried under the policy before giving up
    left = Storage(s3_uri, local_s3.storage_options).list("", recursive=True)
    assert left == [], left  # the files that did go up were deleted; no manifest
    assert sc.latest(s3_uri.rsplit("/", 1)[0], storage_options=local_s3.storage_options) != s3_uri


def test_object_queue_holds_at_most_its_buffers() -> None:
    """Uploads that take a while: the filler waits for the oldest, reusing its buffer."""
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    gate = threading.Semaphore(0)
    pool = cf.ThreadPoolExecutor(8)
    seen: list[bytes] = []

    def put(name: str, data: memoryview) -> "cf.Future[None]":
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])

        def send() -> None:
            gate.acquire()
            seen.append(bytes(data))
            with lock:
                state["now"] -= 1

        return pool.submit(send)

    q = ObjectQueue(put, lambda name: None, buffers=3, buffer_bytes=16)
    buffers: set[int] = set()
    releaser = threading.Thread(target=lambda: [gate.release() for _ in range(10)])
    for i in range(10):
        if i == 3:
            releaser.start()  # the fourth buffer() call can only return once an upload ends
        buf = q.buffer(16)
        buffers.add(id(buf))
        buf[:4] = i.to_bytes(4, "little")
        q.submit(f"o{i}", buf, 4)
    assert q.finish() == [f"o{i}" for i in range(10)]
    releaser.join()
    pool.shutdown()
    assert state["peak"] <= 3 and len(buffers) <= 3
    assert sorted(int.from_bytes(b, "little") for b in seen) == list(range(10))  # no buffer reused too early


def test_object_queue_failure_deletes_what_it_wrote() -> None:
    deleted: list[str] = []

    def put(name: str, data: memoryview) -> "cf.Future[None]":
        fut: cf.Future[None] = cf.Future()
        if name == "o2":
            fut.set_exception(sc.StorageError("writing o2 failed: 503"))
        else:
            fut.set_result(None)
        return fut

    q = ObjectQueue(put, deleted.append, buffers=2, buffer_bytes=8)
    with pytest.raises(sc.StorageError, match="o2"):
        for i in range(5):
            q.submit(f"o{i}", q.buffer(8), 8)
        q.finish()
    q.abort()
    assert sorted(deleted) == ["o0", "o1", "o3"]  # every object that did go up; o2 failed, o4 never went
