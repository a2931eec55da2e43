"""A rank that waits long for its peers to enter ``sc.save`` / ``sc.load`` says why it may be
waiting: both are collective under torch.distributed, and ``if rank == 0: sc.save(...)`` (the
``torch.save`` habit) would otherwise block silently until the group's timeout.

Real gloo ranks against the session's moto server; rank 1 arrives late on purpose, so the
call completes and its values are checked, and rank 0's warning is read from its own log.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import pytest
import torch

import streamckpt as sc
from conftest import BUCKET
from distributed import run_ranks
from streamckpt.comm import PEER_WAIT_ENV, peer_wait_seconds


def late_peer_worker(rank: int, world_size: int, uri: str, opts: dict[str, Any], wait: str) -> dict[str, Any]:
    os.environ[PEER_WAIT_ENV] = wait
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("streamckpt").addHandler(Keep(logging.WARNING))
    full = torch.arange(8.0).reshape(4, 2)
    if rank == 1:
        time.sleep(3.0)  # rank 0 is already waiting in the save's first collective
    sc.save({"w": sc.ShardedTensor(full[2 * rank:2 * rank + 2].clone(), (4, 2), (2 * rank, 0))}, uri,
            storage_options=opts)
    saved = list(seen)
    if rank == 0:
        time.sleep(3.0)  # and now rank 1 waits in the load's
    out = torch.zeros(2, 2)
    sc.load({"w": sc.ShardedTensor(out, (4, 2), (2 * (1 - rank), 0))}, uri, storage_options=opts)
    return {"saved": saved, "loaded": seen[len(saved):], "ok": torch.equal(out, full[2 * (1 - rank):4 - 2 * rank])}


def _waits(messages: list[str], rank: int, call: str) -> list[str]:
    return [m for m in messages if m.startswith(f"rank {rank} of 2 has waited 0.5 s for the other ranks of its "
                                                f"group to enter {call}: under torch.distributed it is collective")]


def test_a_rank_waiting_for_late_peers_warns_and_names_the_rank0_only_mistake(local_s3: Any) -> None:
    uri = f"s3://{BUCKET}/peer-wait-{uuid.uuid4().hex[:8]}"
    r0, r1 = (r.unwrap() for r in run_ranks(2, late_peer_worker, timeout=120, kwargs={
        "uri": uri, "opts": local_s3.storage_options, "wait": "0.5"}))
    assert r0["ok"] and r1["ok"]
    assert len(_waits(r0["saved"], 0, "sc.save")) == 1, r0
    assert "wrapped in 'if rank == 0:'" in _waits(r0["saved"], 0, "sc.save")[0]
    assert len(_waits(r1["loaded"], 1, "sc.load")) == 1, r1


def test_the_warning_can_be_turned_off(local_s3: Any) -> None:
    uri = f"s3://{BUCKET}/peer-wait-off-{uuid.uuid4().hex[:8]}"
    r0, r1 = (r.unwrap() for r in run_ranks(2, late_peer_worker, timeout=120, kwargs={
        "uri": uri, "opts": local_s3.storage_options, "wait": "0"}))
    assert r0["ok"] and r1["ok"]
    assert not any("has waited" in m for m in r0["saved"] + r0["loaded"] + r1["saved"] + r1["loaded"])


def test_a_bad_setting_is_named_and_the_default_used(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Reported, not raised: a rank raising before the first collective would leave the others waiting."""
    monkeypatch.setenv(PEER_WAIT_ENV, "1m")
    with caplog.at_level("WARNING", logger="streamckpt"):
        assert peer_wait_seconds() == 60.0
    assert f"{PEER_WAIT_ENV}='1m' is not a number of seconds >= 0; using 60" in caplog.text
    monkeypatch.setenv(PEER_WAIT_ENV, "2.5")
    assert peer_wait_seconds() == 2.5
    monkeypatch.delenv(PEER_WAIT_ENV)
    assert peer_wait_seconds() == 60.0


def late_peer_async_worker(rank: int, world_size: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    os.environ[PEER_WAIT_ENV] = "0.5"
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("streamckpt").addHandler(Keep(logging.WARNING))
    full = torch.arange(8.0).reshape(4, 2)
    if rank == 1:
        time.sleep(3.0)  # rank 0 waits in its first async_save, where the save's own group is made
    sc.async_save({"w": sc.ShardedTensor(full[2 * rank:2 * rank + 2].clone(), (4, 2), (2 * rank, 0))}, uri,
                  storage_options=opts).result(timeout=60)
    return {"saved": seen}


def test_a_rank_waiting_in_its_first_async_save_warns(local_s3: Any) -> None:
    """The first async_save on a group waits for the other ranks while it makes its own group
    (before its first collective): that wait is where a rank-0-only async_save would sit until
    the group's timeout, so it warns there too (it said nothing before)."""
    uri = f"s3://{BUCKET}/peer-wait-async-{uuid.uuid4().hex[:8]}"
    r0, r1 = (r.unwrap() for r in run_ranks(2, late_peer_async_worker, timeout=120, kwargs={
        "uri": uri, "opts": local_s3.storage_options}))
    assert len(_waits(r0["saved"], 0, "sc.async_save")) == 1, r0
    assert not any("has waited" in m for m in r1["saved"]), r1
    back = sc.load_full(uri, storage_options=local_s3.storage_options)["w"]
    assert back.tolist() == torch.arange(8.0).reshape(4, 2).tolist()
