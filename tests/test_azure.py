"""``az://`` end to end against a real Azure Blob emulator (Azurite, started once per session
by the plugin's ``local_azure_server``) over HTTP through obstore's AzureStore: round trips,
slice reads and their byte counts, zstd, ``latest``, ``inspect``, ``merge``, a 2-rank reshard
on gloo, faults through ``FaultProxy(api="azure")``, and the front-door errors (nothing
listening, a missing container, a wrong key, secrets kept out of messages and logs).

The adlfs fallback (``STREAMCKPT_AZURE_BACKEND=adlfs``) gets a round trip of its own.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import time
import uuid
from typing import Any, Iterator

import pytest
import torch

import streamckpt as sc
from streamckpt.core.checksum import crc32c
from streamckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from streamckpt.merging import INDEX_NAME, merge
from streamckpt.storage import RangeRead, RetryPolicy, Storage
from streamckpt.storage.azure_backend import AzureBackend, parse_connection_string, trimmed
from streamckpt.testing import FaultProxy, LocalAzure
from streamckpt.testing.azureserver import ACCOUNT, ACCOUNT_KEY, connection_string

from distributed import check_equal, original, result_dict, run_ranks, sentinel_like, sharded

MiB = 1 << 20
CONTAINER = "streamckpt-test"
# Not Azurite's key: a wrong one of the right shape, so that the service refuses it.
WRONG_KEY = base64.b64encode(b"not-the-development-account-key-0123456789abcdef" * 1 + bytes(16)).decode()


@pytest.fixture(scope="module")
def azure(local_azure_server: LocalAzure) -> LocalAzure:
    local_azure_server.make_container(CONTAINER)
    return local_azure_server


@pytest.fixture
def az_opts(azure: LocalAzure) -> dict[str, Any]:
    return azure.storage_options


@pytest.fixture
def az_uri(request: pytest.FixtureRequest, azure: LocalAzure) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in request.node.name)[:50]
    return f"az://{CONTAINER}/{slug}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------ round trips


def test_round_trip_reads_natively_with_exact_bytes(az_uri: str, az_opts: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(2)
    sd: dict[str, Any] = {"w": torch.randn(300, 70, generator=g), "bf": torch.randn(33, 5, generator=g).to(torch.bfloat16),
                          "i": torch.arange(1000, dtype=torch.int64), "empty": torch.zeros(0, 3), "step": 42,
                          "sched": {"lr": 0.5}}
    res = sc.save(sd, az_uri, storage_options=az_opts, metadata={"run": "azure"})
    assert res.files == ["data/00000-0000.safetensors", "manifest.json"]
    st = Storage(az_uri, az_opts)
    assert isinstance(st._reader.backend, AzureBackend) and st.read_backend == "obstore"
    out: dict[str, Any] = {"w": torch.zeros(300, 70), "bf": torch.zeros(33, 5, dtype=torch.bfloat16),
                           "i": torch.zeros(1000, dtype=torch.int64), "empty": torch.ones(0, 3), "step": None,
                           "sched": {"lr": None}}
    r = sc.load(out, az_uri, storage_options=az_opts)
    for k in ("w", "bf", "i"):
        assert torch.equal(out[k], sd[k]), k
    assert out["step"] == 42 and out["sched"] == {"lr": 0.5} and out["empty"].shape == (0, 3)
    assert r.bytes_read == r.bytes_needed == 300 * 70 * 4 + 33 * 5 * 2 + 1000 * 8
    info = sc.inspect(az_uri, storage_options=az_opts)
    assert info.kind == "streamckpt" and info.metadata == {"run": "azure"} and info.tensors["w"].shape == (300, 70)
    assert set(st.list("data")) == {"data/00000-0000.safetensors"}
    assert st.size("data/00000-0000.safetensors") == info.files["data/00000-0000.safetensors"]


def test_account_name_and_key_with_endpoint_url_reach_the_emulator(backend: str, azure: LocalAzure,
                                                                   az_uri: str) -> None:
    """adlfs could not (it forces https://{account}.blob.core.windows.net); both backends can now."""
    opts = {"account_name": ACCOUNT, "account_key": ACCOUNT_KEY, "endpoint_url": azure.blob_endpoint}
    t = torch.arange(24, dtype=torch.float32)
    sc.save({"t": t}, az_uri, storage_options=opts)
    assert torch.equal(sc.load_full(az_uri, storage_options=opts)["t"], t)
    via_host = {"account_name": ACCOUNT, "account_key": ACCOUNT_KEY, "account_host": azure.blob_endpoint}
    assert torch.equal(sc.load_full(az_uri, storage_options=via_host)["t"], t)
    via_cs = {"connection_string": azure.connection_string}
    assert torch.equal(sc.load_full(az_uri, storage_options=via_cs)["t"], t)
    native = backend == "obstore"
    assert isinstance(Storage(az_uri, opts)._reader.backend, AzureBackend) == native


def test_environment_connection_string_is_used(azure: LocalAzure, az_uri: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure.connection_string)
    sc.save({"x": torch.ones(5)}, az_uri)
    assert sc.load_full(az_uri)["x"].tolist() == [1.0] * 5
    assert isinstance(Storage(az_uri)._reader.backend, AzureBackend)


def test_adlfs_fallback_round_trip(az_uri: str, az_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("adlfs", reason="adlfs (the 'azure' extra) is missing")
    monkeypatch.setenv("STREAMCKPT_AZURE_BACKEND", "adlfs")
    st = Storage(az_uri, az_opts)
    assert st.read_backend == "fsspec"
    retry = st._reader.backend.fs.service_client._config.retry_policy
    assert retry.total_retries == 0  # the policy above is the only retry loop
    t = original("adlfs", (64, 32), torch.float32)
    sc.save({"w": t}, az_uri, storage_options=az_opts)
    out = torch.zeros(16, 32)
    r = sc.load({"w": sc.ShardedTensor(out, (64, 32), (16, 0))}, az_uri, storage_options=az_opts)
    assert torch.equal(out, t[16:32]) and r.bytes_needed == 16 * 32 * 4 <= r.bytes_read <= 64 * 32 * 4
    monkeypatch.delenv("STREAMCKPT_AZURE_BACKEND")
    assert torch.equal(sc.load_full(az_uri, storage_options=az_opts)["w"], t)  # native reads what adlfs wrote


# ------------------------------------------------------------------ slices and their bytes


@pytest.fixture
def big(az_uri: str, az_opts: dict[str, Any]) -> torch.Tensor:
    t = torch.arange(2048 * 512, dtype=torch.float32).reshape(2048, 512)  # 4 MiB
    sc.save({"w": t}, az_uri, storage_options=az_opts)
    return t


def test_row_slice_reads_only_its_bytes(big: torch.Tensor, az_uri: str, az_opts: dict[str, Any]) -> None:
    out = torch.zeros(256, 512)
    r = sc.load({"w": sc.ShardedTensor(out, (2048, 512), (1024, 0))}, az_uri, storage_options=az_opts)
    assert torch.equal(out, big[1024:1280])
    assert r.bytes_needed == r.bytes_read == 256 * 512 * 4 and r.requests == 1


def test_column_and_flat_slices(big: torch.Tensor, az_uri: str, az_opts: dict[str, Any]) -> None:
    out = torch.zeros(2048, 128)
    r = sc.load({"w": sc.ShardedTensor(out, (2048, 512), (0, 128))}, az_uri, storage_options=az_opts)
    assert torch.equal(out, big[:, 128:256])
    assert r.bytes_needed == 2048 * 128 * 4 <= r.bytes_read <= big.numel() * 4 and r.requests < 64
    flat = big.reshape(-1)
    a, b = 1000, 700_001
    out = torch.zeros(b - a)
    st = sc.ShardedTensor(out, (2048, 512), (0, 0), local_shape=(2048, 512), flat_range=(a, b))
    r = sc.load({"w": st}, az_uri, storage_options=az_opts)
    assert torch.equal(out, flat[a:b]) and (b - a) * 4 <= r.bytes_read <= (b - a) * 4 + 2 * MiB


def test_zstd_partial_load_reads_part_of_the_compressed_bytes(az_uri: str, az_opts: dict[str, Any]) -> None:
    t = (torch.arange(3000 * 200) % 97).to(torch.float32).reshape(3000, 200)
    sc.save({"w": t}, az_uri, storage_options=az_opts, compression="zstd")
    stored = sum(sc.inspect(az_uri, storage_options=az_opts).files.values())
    out = torch.zeros(300, 200)
    r = sc.load({"w": sc.ShardedTensor(out, (3000, 200), (1500, 0))}, az_uri, storage_options=az_opts)
    assert torch.equal(out, t[1500:1800])
    assert 0 < r.bytes_read < stored / 2


def test_multipart_upload_of_a_large_file(az_uri: str, az_opts: dict[str, Any]) -> None:
    """A 24 MiB data file goes up as staged blocks (three 8 MiB parts), then reads back exact."""
    t = original("blocks", (3 * 1024, 2048), torch.float32)  # 24 MiB
    res = sc.save({"w": t}, az_uri, storage_options=az_opts)
    assert res.bytes_written >= 24 * MiB
    check_equal("w", sc.load_full(az_uri, storage_options=az_opts)["w"], t)


# ------------------------------------------------------------------ latest, merge


def test_latest_returns_newest_committed(az_uri: str, az_opts: dict[str, Any]) -> None:
    sc.save({"x": torch.ones(3)}, f"{az_uri}/step-1", storage_options=az_opts)
    sc.save({"x": torch.ones(3) * 2}, f"{az_uri}/step-2", storage_options=az_opts)
    Storage(f"{az_uri}/step-3", az_opts).write_bytes("data/00000-0000.safetensors", b"partial")  # never committed
    newest = sc.latest(az_uri, storage_options=az_opts)
    assert newest == f"{az_uri}/step-2"
    assert sc.load_full(newest, storage_options=az_opts)["x"].tolist() == [2.0, 2.0, 2.0]
    assert sc.latest(f"{az_uri}/nothing-here", storage_options=az_opts) is None


def test_merge_to_hf_layout_on_azure(az_uri: str, az_opts: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(4)
    sd = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(50, generator=g).to(torch.bfloat16), "step": 3}
    sc.save(sd, f"{az_uri}/src", storage_options=az_opts)
    res = merge(f"{az_uri}/src", f"{az_uri}/hf", storage_options=az_opts, out_storage_options=az_opts,
                max_shard_bytes=3000)
    assert len(res.files) >= 2
    index = json.loads(Storage(f"{az_uri}/hf", az_opts).read_bytes(INDEX_NAME))
    assert set(index["weight_map"]) == {"a", "b"}
    got = sc.load_full(f"{az_uri}/hf", storage_options=az_opts)
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["b"], sd["b"])


# ------------------------------------------------------------------ 2 ranks on gloo


def save2_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    sd: dict[str, Any] = {"w": sharded(original("w", (64, 48), torch.float32), 0, world, rank)[0],
                          "rep": original("rep", (16, 16), torch.float32), "step": 5}
    return result_dict(sc.save(sd, uri, storage_options=opts))


def load2_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    w, expect = sharded(original("w", (64, 48), torch.float32), 1, world, rank, fill=False)
    rep = sentinel_like(original("rep", (16, 16), torch.float32))
    sd: dict[str, Any] = {"w": w, "rep": rep, "step": None}
    res = sc.load(sd, uri, storage_options=opts)
    check_equal("w", sd["w"].local_tensor, expect)
    check_equal("rep", sd["rep"], original("rep", (16, 16), torch.float32))
    if sd["step"] != 5:
        raise AssertionError(f"step {sd['step']}")
    return result_dict(res)


@pytest.mark.slow  # two gloo groups of 2 processes: ~20 s here
def test_saved_by_2_ranks_by_rows_loaded_by_2_by_columns(az_uri: str, az_opts: dict[str, Any]) -> None:
    saved = [r.unwrap() for r in run_ranks(2, save2_worker, kwargs={"uri": az_uri, "opts": az_opts}, timeout=180)]
    assert [[f for f in s["files"] if f.startswith("data/")] for s in saved] == [
        ["data/00000-0000.safetensors"], ["data/00001-0000.safetensors"]]
    info = sc.inspect(az_uri, storage_options=az_opts)
    assert info.tensors["w"].shards == 2 and info.tensors["rep"].shards == 1
    stats = [r.unwrap() for r in run_ranks(2, load2_worker, kwargs={"uri": az_uri, "opts": az_opts}, timeout=180)]
    unique = 64 * 48 * 4 + 16 * 16 * 4
    assert unique <= sum(s["bytes_read"] for s in stats) <= unique * 1.05  # each stored byte read once


# ------------------------------------------------------------------ faults through FaultProxy(api="azure")

CHUNK = 16 << 10


@pytest.fixture
def az_proxy(azure: LocalAzure) -> Iterator[Any]:
    started: list[FaultProxy] = []

    def make(**kw: Any) -> FaultProxy:
        p = FaultProxy(azure.endpoint_url, api="azure", **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def stored(az_uri: str, az_opts: dict[str, Any]) -> tuple[str, bytes]:
    data = random.Random(11).randbytes(MiB)
    Storage(az_uri, az_opts).write_bytes("data/00000.bin", data)
    return az_uri, data


def _reads(data: bytes, n: int, seed: int) -> list[RangeRead]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(0, len(data) - 1)
        b = min(len(data), a + rng.randrange(1, 3 * CHUNK))
        checks = tuple((off, min(CHUNK, b - a - off), crc32c(data[a + off:a + min(off + CHUNK, b - a)]))
                       for off in range(0, b - a, CHUNK))
        out.append(RangeRead("data/00000.bin", a, b, checks))
    return out


@pytest.mark.parametrize("kind", ["slowdown", "reset", "short", "flip"])
def test_each_fault_alone_range_reads_bit_exact(kind: str, stored: tuple[str, bytes], az_proxy: Any) -> None:
    uri, data = stored
    proxy = az_proxy(faults=[kind], rate=0.3, seed=3)
    st = Storage(uri, proxy.storage_options, policy=RetryPolicy(base_delay=0.01))
    reads = _reads(data, 20, seed=4)
    bufs = [bytearray(r.length) for r in reads]
    st.read_into(reads, [memoryview(b) for b in bufs]).result(timeout=120)
    for r, b in zip(reads, bufs):
        assert bytes(b) == data[r.start:r.stop], (r.start, r.stop)
    counts = proxy.counts
    assert counts[kind] > 0 and sum(counts.values()) == counts[kind]


def test_save_through_throttling_lands_whole(az_uri: str, az_opts: dict[str, Any], az_proxy: Any) -> None:
    """503 ServerBusy on the uploads (blocks, the block list, the manifest): retried, nothing lost."""
    proxy = az_proxy(faults=["slowdown"], rate=0.3, seed=1, methods=("PUT",))
    t = original("upload", (3 * 1024, 1024), torch.float32)  # 12 MiB: staged blocks
    sc.save({"w": t}, az_uri, storage_options=proxy.storage_options)
    assert proxy.counts["slowdown"] > 0
    check_equal("w", sc.load_full(az_uri, storage_options=az_opts)["w"], t)


@pytest.mark.parametrize("kind", ["flip", "short"])
def test_whole_object_read_is_checked_against_content_md5(kind: str, stored: tuple[str, bytes],
                                                          az_proxy: Any) -> None:
    """Azure ETags are not MD5s: the blob's Content-MD5 catches a flipped bit in a whole read."""
    uri, data = stored
    proxy = az_proxy(faults=[kind], rate=1.0, max_repeats=2)
    assert Storage(uri, proxy.storage_options, policy=RetryPolicy(base_delay=0.01)).read_bytes("data/00000.bin") == data
    assert proxy.counts[kind] == 2  # two bad replies, each noticed and read again


def test_rot_at_rest_in_a_whole_object_is_corrupt(stored: tuple[str, bytes], az_proxy: Any) -> None:
    uri, _ = stored
    proxy = az_proxy(faults=["rot"], rate=1.0, max_repeats=10**9)
    with pytest.raises(CorruptCheckpointError, match="data/00000.bin.*does not match|checksum mismatch"):
        Storage(uri, proxy.storage_options, policy=RetryPolicy(base_delay=0.01)).read_bytes("data/00000.bin")


def test_persistent_outage_is_a_storage_error(stored: tuple[str, bytes], az_proxy: Any) -> None:
    uri, _ = stored
    proxy = az_proxy(faults=["slowdown"], rate=1.0, max_repeats=10**9)
    policy = RetryPolicy(max_attempts=3, base_delay=0.05, request_timeout=2.0, total_timeout=10.0)
    st = Storage(uri, proxy.storage_options, policy=policy)
    with pytest.raises(StorageError) as ei:
        st.read_into([RangeRead("data/00000.bin", 100, 200)], [memoryview(bytearray(100))]).result(timeout=60)
    msg = str(ei.value)
    assert f"{uri}/data/00000.bin" in msg and "[100, 200)" in msg and "after 3 attempt(s)" in msg
    assert "ServerBusy" in msg and "<?xml" not in msg  # the service's code, not its whole body
    # 3 attempts of client_attempts requests each; once, in a fresh-clone CI run on 2 busy cores,
    # the proxy counted 12 (cause not found; it passed alone and in the file's run): bounded, not exact
    assert 3 * policy.client_attempts <= proxy.counts["slowdown"] <= 3 * (policy.client_attempts + 1)


# ------------------------------------------------------------------ front-door errors


def test_nothing_listening_fails_fast_and_named(azure: LocalAzure) -> None:
    from streamckpt.testing.s3server import free_port

    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}/{ACCOUNT}"
    opts = {"connection_string": connection_string(dead)}
    for call in (lambda: sc.load_full(f"az://{CONTAINER}/x", storage_options=opts),
                 lambda: sc.save({"a": torch.ones(2)}, f"az://{CONTAINER}/x", storage_options=opts)):
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            call()
        assert time.monotonic() - t0 < 20  # a hang bound for a busy machine; was 45.6 s through adlfs
        assert "after 2 attempt(s)" in str(ei.value)  # not the 8 a slow store gets
        assert f"nothing accepted a connection at {dead}" in str(ei.value)
        assert "BlobEndpoint of connection_string" in str(ei.value) and ACCOUNT_KEY not in str(ei.value)


@pytest.fixture(params=["obstore", "adlfs"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native backend and the adlfs fallback: the same verdicts from both."""
    if request.param == "adlfs":
        pytest.importorskip("adlfs", reason="adlfs (the 'azure' extra) is missing")
    monkeypatch.setenv("STREAMCKPT_AZURE_BACKEND", request.param)
    return str(request.param)


def test_missing_container_is_not_found_on_load_and_save(backend: str, azure: LocalAzure,
                                                         az_opts: dict[str, Any]) -> None:
    uri = "az://no-such-container-3f1c/ckpt"
    with pytest.raises(CheckpointNotFoundError, match="container 'no-such-container-3f1c' does not exist"):
        sc.load({"a": torch.zeros(1)}, uri, storage_options=az_opts)
    with pytest.raises(CheckpointNotFoundError, match="container 'no-such-container-3f1c' does not exist"):
        sc.latest("az://no-such-container-3f1c/runs", storage_options=az_opts)
    with pytest.raises(CheckpointNotFoundError) as ei:
        sc.save({"a": torch.ones(2)}, uri, storage_options=az_opts)
    assert "container 'no-such-container-3f1c' does not exist (writing az://no-such-container-3f1c/ckpt/" in str(ei.value)
    assert "create the container first" in str(ei.value) and "<?xml" not in str(ei.value)


def test_missing_checkpoint_and_object(az_uri: str, az_opts: dict[str, Any]) -> None:
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at {az_uri}"):
        sc.load({"a": torch.zeros(1)}, az_uri, storage_options=az_opts)
    st = Storage(az_uri, az_opts)
    with pytest.raises(CheckpointNotFoundError, match=f"{az_uri}/data/x.bin does not exist"):
        st.read_bytes("data/x.bin", 0, 10)
    with pytest.raises(CheckpointNotFoundError, match=f"{az_uri}/manifest.json does not exist"):
        st.read_bytes("manifest.json")


def test_wrong_key_is_explained_and_never_shown(backend: str, az_uri: str, az_opts: dict[str, Any],
                                                azure: LocalAzure, caplog: pytest.LogCaptureFixture) -> None:
    sc.save({"a": torch.ones(2)}, az_uri, storage_options=az_opts)
    caplog.set_level(logging.DEBUG)
    wrong = {"connection_string": azure.connection_string.replace(ACCOUNT_KEY, WRONG_KEY)}
    for call in (lambda: sc.load_full(az_uri, storage_options=wrong),
                 lambda: sc.save({"a": torch.ones(2)}, f"{az_uri}/2", storage_options=wrong)):
        with pytest.raises(StorageError) as ei:
            call()
        msg = str(ei.value)
        assert "after 1 attempt(s)" in msg and "access denied: check the credentials" in msg
        assert ("403" in msg or "failed to authenticate" in msg) and "<?xml" not in msg and "Debug source" not in msg
        assert WRONG_KEY not in msg and ACCOUNT_KEY not in msg
    sas_opts = {"account_name": ACCOUNT, "sas_token": "sv=2023-11-03&sp=r&sig=c2VjcmV0LXNhcy1zaWduYXR1cmU%3D",
                "endpoint_url": azure.blob_endpoint}
    with pytest.raises(StorageError) as ei:
        sc.load_full(az_uri, storage_options=sas_opts)
    assert "c2VjcmV0LXNhcy1zaWduYXR1cmU" not in str(ei.value) and "access denied" in str(ei.value)
    for rec in caplog.records:
        text = rec.getMessage() + (str(rec.exc_info[1]) if rec.exc_info else "")
        assert WRONG_KEY not in text and ACCOUNT_KEY not in text and "c2VjcmV0LXNhcy1zaWduYXR1cmU" not in text


# ------------------------------------------------------------------ bad inputs


def test_unknown_backend_name_is_refused(az_uri: str, az_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCKPT_AZURE_BACKEND", "blobfuse")
    with pytest.raises(StorageError, match="STREAMCKPT_AZURE_BACKEND='blobfuse': choose one of auto, obstore, adlfs"):
        Storage(az_uri, az_opts)


def test_options_obstore_cannot_reproduce_go_to_adlfs(azure: LocalAzure, az_uri: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("adlfs", reason="adlfs (the 'azure' extra) is missing")
    monkeypatch.setenv("STREAMCKPT_AZURE_BACKEND", "obstore")
    caplog.set_level(logging.WARNING)
    st = Storage(az_uri, {**azure.storage_options, "version_aware": True})
    assert st.read_backend == "fsspec"
    assert any("obstore cannot reproduce option 'version_aware'" in r.getMessage() for r in caplog.records)
    assert all(ACCOUNT_KEY not in r.getMessage() for r in caplog.records)


def test_connection_string_parsing_and_trimmed_bodies() -> None:
    parts = parse_connection_string("AccountName=a;AccountKey=abc==;SharedAccessSignature=sv=1&sig=x%3D;")
    assert parts == {"AccountName": "a", "AccountKey": "abc==", "SharedAccessSignature": "sv=1&sig=x%3D"}
    body = ("Generic error: Error performing GET http://h/a/c/b in 3ms - Server returned non-2xx status code: "
            "503 Service Unavailable: <?xml version=\"1.0\"?>\n<Error>\n  <Code>ServerBusy</Code>\n"
            "  <Message>The server is busy.\nRequestId:1</Message>\n</Error>\n\nDebug source:\nGeneric {...}")
    assert trimmed(body) == ("Generic error: Error performing GET http://h/a/c/b in 3ms - Server returned non-2xx "
                             "status code: 503 Service Unavailable: ServerBusy (The server is busy.)")


def test_nothing_listening_through_adlfs_fails_fast_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback's SDK retries are off and its endpoint is probed: no 45 s of hidden backoff."""
    pytest.importorskip("adlfs", reason="adlfs (the 'azure' extra) is missing")
    from streamckpt.testing.s3server import free_port

    monkeypatch.setenv("STREAMCKPT_AZURE_BACKEND", "adlfs")
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}/{ACCOUNT}"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        sc.load_full(f"az://{CONTAINER}/x", storage_options={"connection_string": connection_string(dead)})
    assert time.monotonic() - t0 < 20  # a hang bound for a busy machine
    assert "after 2 attempt(s)" in str(ei.value)
    assert f"nothing accepted a connection at {dead}" in str(ei.value) and ACCOUNT_KEY not in str(ei.value)


def test_nothing_listening_on_gs_fails_fast() -> None:
    """The same probe in front of gcsfs (which retries a refused connect for 45-65 s by itself)."""
    pytest.importorskip("gcsfs")
    from streamckpt.testing.gcsserver import options_for
    from streamckpt.testing.s3server import free_port

    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    for call in (lambda: sc.load_full("gs://bucket/x", storage_options=options_for(dead)),
                 lambda: sc.save({"a": torch.ones(2)}, "gs://bucket/x", storage_options=options_for(dead))):
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            call()
        assert time.monotonic() - t0 < 20  # a hang bound for a busy machine; was 45-65 s
        assert "after 2 attempt(s)" in str(ei.value)
        assert f"nothing accepted a connection at {dead}: check endpoint_url" in str(ei.value)
