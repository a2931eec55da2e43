"""A load's request rate per key prefix (issue 37, item 4): the job's GETs and throttled
responses in ``LoadResult``, and one warning on rank 0 when the rate passed the limit
(``STREAMCKPT_GET_RATE_LIMIT``). Real moto S3 over HTTP; the multi-rank case on gloo."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.loading import requestrate

from distributed import run_ranks

LOGGER = "streamckpt.loading.loader"


def _state(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(n)}


def _rate_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
            and "range GETs" in r.getMessage()]


def test_key_prefix() -> None:
    assert requestrate.key_prefix(["b/c/data/00000.st", "b/c/data/00001.st"]) == "b/c/data/"
    assert requestrate.key_prefix(["b/c/data/00000.st"]) == "b/c/data/"
    assert requestrate.key_prefix(["b/c/data/0.st", "b/d/data/0.st"]) == "b/"  # siblings: the common root
    assert requestrate.key_prefix([]) == ""


def test_over_limit_text() -> None:
    job = requestrate.JobRequests(requests=12000, throttled=3, seconds=2.0, prefix="s3://b/c/data/")
    assert job.per_second == 6000
    text = requestrate.over_limit(job, 5500)
    assert text is not None
    assert "12000 range GETs in 2.00 s: 6,000 per second on the key prefix s3://b/c/data/" in text
    assert "above the 5,500/s" in text and "3 requests with SlowDown" in text
    assert "max_concurrency" in text and "memory_budget" in text and "prefixes" in text
    assert requestrate.over_limit(job, 6000) is None  # at the limit: not above it
    assert requestrate.over_limit(job, 0) is None  # 0: off


def test_limit_from_env(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(requestrate.LIMIT_ENV, raising=False)
    assert requestrate.get_limit() == 5500
    monkeypatch.setenv(requestrate.LIMIT_ENV, "250")
    assert requestrate.get_limit() == 250
    monkeypatch.setenv(requestrate.LIMIT_ENV, "lots")
    with caplog.at_level(logging.WARNING):
        assert requestrate.get_limit() == 5500
    assert "STREAMCKPT_GET_RATE_LIMIT='lots'" in caplog.text


def test_load_over_a_low_limit_warns_once(s3_uri: str, s3_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    sc.save(state, s3_uri, storage_options=s3_opts)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    monkeypatch.setenv(requestrate.LIMIT_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, s3_uri, storage_options=s3_opts)
    for k in state:
        assert torch.equal(target[k], state[k])
    assert res.requests >= 1
    assert res.job_requests == res.requests  # one process: the job is this rank
    assert res.throttled_requests == res.job_throttled_requests == 0
    assert res.request_prefix == s3_uri + "/data/"
    assert 0 < res.job_requests_per_s
    assert res.job_requests / res.job_requests_per_s <= res.seconds  # the data phase is within the call
    warned = _rate_warnings(caplog)
    assert len(warned) == 1
    msg = warned[0].getMessage()
    assert f"the load made {res.job_requests} range GETs" in msg
    assert f"{res.job_requests_per_s:,.0f} per second on the key prefix {s3_uri}/data/" in msg
    assert "above the 1/s" in msg


def test_load_under_the_limit_is_quiet(s3_uri: str, s3_opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    sc.save(state, s3_uri, storage_options=s3_opts)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    monkeypatch.delenv(requestrate.LIMIT_ENV, raising=False)  # the default, 5,500/s: far above this load
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        res = sc.load(target, s3_uri, storage_options=s3_opts)
    assert res.job_requests == res.requests >= 1
    assert res.job_requests_per_s < 5500
    assert _rate_warnings(caplog) == []


def test_slowdown_responses_are_counted(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 503 SlowDown the default S3 client saw on the load's data GETs, retried, is in the stats."""
    state = _state(8)
    sc.save(state, s3_uri, storage_options=s3_opts)
    proxy = proxy_factory(faults=["slowdown"], rate=1.0, seed=3, max_repeats=1,
                          match=lambda method, path: "/data/" in path)
    monkeypatch.setenv("STREAMCKPT_S3_BACKEND", "http")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    res = sc.load(target, s3_uri, storage_options=proxy.storage_options, max_concurrency=4)
    for k in state:
        assert torch.equal(target[k], state[k])
    assert proxy.counts["slowdown"] >= 1
    assert res.throttled_requests == res.job_throttled_requests == proxy.counts["slowdown"]


def _ranks_load(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Each rank loads its quarter of the rows of every tensor; rank 0 records the rate warnings."""
    import os

    os.environ[requestrate.LIMIT_ENV] = "1"
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING and "range GETs" in record.getMessage():
                seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger(LOGGER).addHandler(handler)
    try:
        full = _state()
        target = {}
        for k, v in full.items():
            rows = v.shape[0] // world_size
            target[k] = sc.ShardedTensor(torch.zeros(rows, v.shape[1]), tuple(v.shape), (rank * rows, 0))
        res = sc.load(target, uri, storage_options=opts)
        for k, v in full.items():
            rows = v.shape[0] // world_size
            assert torch.equal(target[k].local_tensor, v[rank * rows:(rank + 1) * rows])
    finally:
        logging.getLogger(LOGGER).removeHandler(handler)
    return {"requests": res.requests, "job_requests": res.job_requests, "per_s": res.job_requests_per_s,
            "prefix": res.request_prefix, "job_throttled": res.job_throttled_requests, "warnings": seen}


def test_job_totals_agree_across_ranks(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save(_state(), s3_uri, storage_options=s3_opts)
    out = run_ranks(4, _ranks_load, kwargs={"uri": s3_uri, "opts": s3_opts})
    vals = [r.unwrap() for r in out]
    total = sum(v["requests"] for v in vals)
    assert total >= 4
    assert {v["job_requests"] for v in vals} == {total}
    assert len({v["per_s"] for v in vals}) == 1 and vals[0]["per_s"] > 0
    assert {v["prefix"] for v in vals} == {s3_uri + "/data/"}
    assert {v["job_throttled"] for v in vals} == {0}
    assert len(vals[0]["warnings"]) == 1 and f"the load made {total} range GETs" in vals[0]["warnings"][0]
    assert all(v["warnings"] == [] for v in vals[1:])
