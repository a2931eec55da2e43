"""A save's PUT rate per key prefix (issue 37, item 4, the save side): the job's PUTs in
``SaveResult`` and one warning on rank 0 when the rate passed the limit
(``STREAMCKPT_PUT_RATE_LIMIT``). Real moto S3 over HTTP; the multi-rank case on gloo."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.saving import putrate
from streamckpt.saving.writer import UploadShape
from streamckpt.storage.ratelimit import JobRequests, PUT_LIMIT_ENV

from distributed import run_ranks

LOGGER = "streamckpt.saving.saver"
MiB = 1 << 20


def _state(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(n)}  # 64 KiB each


def _put_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.name == LOGGER and r.levelno == logging.WARNING
            and "PUTs in" in r.getMessage()]


def test_warning_text_names_rate_prefix_and_what_to_do() -> None:
    job = JobRequests(requests=9000, throttled=0, seconds=2.0, prefix="s3://b/run/step-9/data/")
    text = putrate.over_put_limit(job, 3500, UploadShape(object_bytes=8 * MiB, buffers=4))
    assert text is not None
    assert "the save made 9000 PUTs in 2.00 s: 4,500 per second on the key prefix s3://b/run/step-9/data/" in text
    assert "above the 3,500/s" in text and "STREAMCKPT_PUT_RATE_LIMIT" in text
    assert "STREAMCKPT_UPLOAD_OBJECT_BYTES (now 8 MiB)" in text and "STREAMCKPT_UPLOAD_BUFFERS (now 4)" in text
    assert putrate.over_put_limit(job, 4500, UploadShape()) is None  # at the limit: not above it
    assert putrate.over_put_limit(job, 0, UploadShape()) is None  # 0: off


def test_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PUT_LIMIT_ENV, raising=False)
    assert putrate.put_limit() == 3500
    monkeypatch.setenv(PUT_LIMIT_ENV, "20")
    assert putrate.put_limit() == 20
    monkeypatch.setenv(PUT_LIMIT_ENV, "-3")
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        assert putrate.put_limit() == 3500  # reported, not raised: one rank raising would hang the others
    assert "STREAMCKPT_PUT_RATE_LIMIT='-3'" in caplog.text


def test_save_over_a_low_limit_warns_once(s3_uri: str, s3_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(PUT_LIMIT_ENV, "1")
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(MiB))  # 6 × 64 KiB: one data file
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.save(_state(), s3_uri, storage_options=s3_opts)
    assert res.files == ["data/00000-0000.safetensors", "manifest.json"]
    assert res.requests == res.job_requests == 2  # the data file and the manifest, one PUT each
    assert res.request_prefix == s3_uri + "/data/"
    assert 0 < res.job_requests_per_s
    warned = _put_warnings(caplog.records)
    assert len(warned) == 1
    assert f"the save made 2 PUTs" in warned[0] and f"on the key prefix {s3_uri}/data/" in warned[0]
    assert "above the 1/s" in warned[0]


def test_save_under_the_limit_is_quiet(s3_uri: str, s3_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PUT_LIMIT_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.save(_state(), s3_uri, storage_options=s3_opts)
    assert res.job_requests == res.requests == len(res.files)
    assert res.job_requests_per_s < 3500
    assert _put_warnings(caplog.records) == []


def test_incremental_save_counts_only_what_it_uploads(s3_uri: str, s3_opts: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(MiB))
    state = _state()
    sc.save(state, s3_uri + "/a", storage_options=s3_opts)
    state["w0"] += 1  # one of six tensors changed
    res = sc.save(state, s3_uri + "/b", storage_options=s3_opts, base=s3_uri + "/a")
    assert res.requests == res.job_requests == 2  # a data file holding w0, and the manifest
    assert res.request_prefix == s3_uri + "/b/data/"


def _ranks_save(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Each rank saves its quarter of the rows of every tensor; rank 0 records the rate warnings."""
    import os

    os.environ[PUT_LIMIT_ENV] = "1"
    os.environ["STREAMCKPT_UPLOAD_OBJECT_BYTES"] = str(MiB)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    logging.getLogger(LOGGER).addHandler(handler)
    try:
        state = {}
        for k, v in _state().items():
            rows = v.shape[0] // world_size
            state[k] = sc.ShardedTensor(v[rank * rows:(rank + 1) * rows].clone(), tuple(v.shape), (rank * rows, 0))
        res = sc.save(state, uri, storage_options=opts)
    finally:
        logging.getLogger(LOGGER).removeHandler(handler)
    return {"files": res.files, "requests": res.requests, "job_requests": res.job_requests,
            "per_s": res.job_requests_per_s, "prefix": res.request_prefix, "warnings": _put_warnings(seen)}


def test_job_puts_agree_across_ranks(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    vals = [r.unwrap() for r in run_ranks(4, _ranks_save, kwargs={"uri": s3_uri, "opts": s3_opts})]
    assert [v["requests"] for v in vals] == [len(v["files"]) for v in vals]
    assert [v["requests"] for v in vals] == [2, 1, 1, 1]  # a data file each; rank 0 also the manifest
    assert {v["job_requests"] for v in vals} == {5}
    assert len({v["per_s"] for v in vals}) == 1 and vals[0]["per_s"] > 0
    assert {v["prefix"] for v in vals} == {s3_uri + "/data/"}
    assert len(vals[0]["warnings"]) == 1 and "the save made 5 PUTs" in vals[0]["warnings"][0]
    assert all(v["warnings"] == [] for v in vals[1:])
    loaded = {k: torch.zeros_like(v) for k, v in _state().items()}
    sc.load(loaded, s3_uri, storage_options=s3_opts)
    for k, v in _state().items():
        assert torch.equal(loaded[k], v)


def test_data_files_grow_with_the_saving_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB up to 255 ranks, then doubling at 256, 512 and 1,024 ranks to 64 MiB; the
    environment still decides when set."""
    from streamckpt.saving.writer import object_bytes_for

    sizes = {w: object_bytes_for(w) // MiB for w in (1, 8, 255, 256, 511, 512, 1023, 1024, 2048, 16384)}
    assert sizes == {1: 8, 8: 8, 255: 8, 256: 16, 511: 16, 512: 32, 1023: 32, 1024: 64, 2048: 64, 16384: 64}
    monkeypatch.delenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", raising=False)
    assert UploadShape.from_env(4).object_bytes == 8 * MiB
    assert UploadShape.from_env(2048) == UploadShape(object_bytes=64 * MiB, buffers=4)
    monkeypatch.setenv("STREAMCKPT_UPLOAD_OBJECT_BYTES", str(2 * MiB))
    assert UploadShape.from_env(2048).object_bytes == 2 * MiB
