"""A run's history through a requeue loop (moto over HTTP; 2 gloo ranks where ranks matter): a
step restore passed over as unreadable is replaced by the next save of it, in this process and
in a requeued one; a rollback (``restore(step=k)``) asks for consent before the newer steps
go, and with it deletes them (manifest first); a save older than the newest raises."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.storage import Storage

from conftest import BUCKET
from distributed import run_ranks


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) * step, "step": step}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 32), "step": 0}


def test_a_step_passed_over_is_replaced_by_the_next_save_of_it(s3_uri: str, s3_opts: dict[str, Any],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (36, 37):
            mgr.save(step, _state(step))
    Storage(f"{s3_uri}/step-37", s3_opts).delete("data/00000-0000.safetensors")  # lost: unreadable
    for life in range(2):  # the first requeue crashes after restore; the second must go on too
        with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
            back = _target()
            got = mgr.restore(back)
            assert got is not None and got.step == 36 and [u for u, _ in got.skipped] == [f"{s3_uri}/step-37"]
            if life == 0:
                continue  # killed before it saved again
            with caplog.at_level(logging.WARNING, logger="streamckpt.manage"):
                mgr.save(37, _state(37))
            assert sum("passed over" in r.getMessage() and "step-37" in r.getMessage() for r in caplog.records) == 1
            assert mgr.steps() == [36, 37]
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        back = _target()
        got = mgr.restore(back)
        assert got is not None and got.step == 37 and got.skipped == [] and torch.equal(back["w"], _state(37)["w"])


def test_an_unparsable_manifest_passed_over_is_replaced_too(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    Storage(f"{s3_uri}/step-2", s3_opts).write_bytes("manifest.json", b"{truncated")
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        assert mgr.restore(_target()).step == 1  # type: ignore[union-attr]
        mgr.save(2, _state(2))
        back = _target()
        assert mgr.restore(back).step == 2 and torch.equal(back["w"], _state(2)["w"])  # type: ignore[union-attr]


def test_a_rollback_asks_for_consent_then_deletes_the_abandoned_steps(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, _state(step))
        back = _target()
        assert mgr.restore(back, step=20).step == 20  # type: ignore[union-attr]  # a loss spike: go back
        with pytest.raises(sc.CheckpointExistsError, match=r"restored step 20 .* steps 30, 40 are newer: the run's "
                                                          r"abandoned branch. Pass force=True"):
            mgr.save(21, _state(21))
        assert mgr.steps() == [10, 20, 30, 40]  # nothing deleted without consent
        mgr.save(21, _state(21), force=True)
        assert mgr.steps() == [10, 20, 21] and sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-21"
        names = Storage(s3_uri, s3_opts).list("", recursive=True)
        assert not any(n.startswith(("step-30/", "step-40/")) for n in names)
        got = mgr.restore(back)
        assert got is not None and got.step == 21 and torch.equal(back["w"], _state(21)["w"])


def test_a_save_older_than_the_newest_raises_instead_of_vanishing(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_last=2) as mgr:
        for step in (5, 6):
            mgr.save(step, _state(step))
        with pytest.raises(sc.CheckpointError, match="step 3 is older than the newest committed step 6"):
            mgr.save(3, _state(3))
        with pytest.raises(sc.CheckpointError, match="step 5 is older than the newest committed step 6"):
            mgr.save(5, _state(5), force=False)
        assert mgr.steps() == [5, 6]


def history_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    with sc.CheckpointManager(root, storage_options=opts) as mgr:
        got = mgr.restore({"w": torch.zeros(64, 32), "step": 0})
        assert got is not None
        mgr.save(got.step + 1, _state(got.step + 1))  # replaces the step passed over on rank 0, agreed
        back = {"w": torch.zeros(64, 32), "step": 0}
        again = mgr.restore(back)
        assert again is not None
        return {"first": got.step, "then": again.step, "equal": torch.equal(back["w"], _state(again.step)["w"])}


def test_two_ranks_replace_a_step_passed_over(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/history-{uuid.uuid4().hex[:10]}"
    opts = local_s3.storage_options
    with sc.CheckpointManager(root, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    Storage(f"{root}/step-2", opts).delete("data/00000-0000.safetensors")
    got = [r.unwrap() for r in run_ranks(2, history_worker, kwargs={"root": root, "opts": opts}, timeout=120)]
    assert got == [{"first": 1, "then": 2, "equal": True}] * 2


def _third_file_of_step_2(method: str, path: str) -> bool:
    """The first request of step 2's third data file (its upload's start): held while the first
    two are up, so garbage collection elsewhere can take them before the commit."""
    return "step-2/data/00000-0002" in path


def test_gc_beside_a_save_in_flight_cannot_make_it_commit_broken(s3_uri: str, s3_opts: dict[str, Any],
                                                                 proxy_factory: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """collect_garbage(older_than=0) run while an async save uploads: its own manager never marks
    the save's objects; another one (another process, the CLI) deletes them, and then the commit
    check fails the save instead of committing a checkpoint that cannot be loaded."""
    proxy = proxy_factory(faults=["stall"], rate=1.0, stall_seconds=4, methods=("PUT", "POST"), max_repeats=1,
                          match=_third_file_of_step_2)
    big = {"w": torch.randn(5 * 1024 * 1024, generator=torch.Generator().manual_seed(2))}  # 20 MiB: 3 data files
    with sc.CheckpointManager(s3_uri, storage_options=proxy.storage_options, async_save=True) as mgr:
        mgr.save(1, {"w": torch.zeros(8)})
        mgr.wait()
        handle = mgr.save(2, big)
        deadline = time.monotonic() + 60
        while proxy.stalled_now == 0:  # the third file's upload is held: the first two are up
            assert time.monotonic() < deadline and not handle.done(), "never reached the commit"
            time.sleep(0.02)
        assert mgr.collect_garbage(older_than=0) == []  # its own save in flight: never marked
        other = sc.CheckpointManager(s3_uri, storage_options=s3_opts)  # as another process would
        with caplog.at_level(logging.WARNING, logger="streamckpt.manage.garbage"):
            gone = other.collect_garbage(older_than=0)
        assert gone and all("/step-2/data/" in g for g in gone)
        warned = [r.getMessage() for r in caplog.records if "save still in progress" in r.getMessage()]
        assert len(warned) == 1 and f"{s3_uri}/step-2 changed" in warned[0] and "older_than=0 s" in warned[0], warned
        with pytest.raises(sc.CheckpointError, match=r"not committing .*step-2.*missing.*collect_garbage"):
            handle.result(timeout=60)
        with pytest.raises(sc.CheckpointError):
            mgr.wait()
    names = Storage(s3_uri, s3_opts).list("", recursive=True)
    assert "step-2/manifest.json" not in names and sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-1"


def test_recent_garbage_is_named_with_its_age() -> None:
    """The rule of the warning (issue 44 item 3 c): a child of the marked garbage changed less than
    RECENT_SECONDS ago may be another process's save in progress; older leftovers are not named."""
    from streamckpt.manage.garbage import RECENT_SECONDS, Garbage, recent
    from streamckpt.storage import ObjectInfo
    from streamckpt.storage.store import OpenUpload

    now = 10_000.0
    objects = {"step-3/data/a": ObjectInfo(4, modified=now - 5), "step-3/data/b": ObjectInfo(4, modified=now - 900),
               "step-1/data/a": ObjectInfo(4, modified=now - 2 * RECENT_SECONDS)}
    uploads = [OpenUpload("step-4/data/a", "u1", initiated=now - 30)]
    found = [Garbage(n, 4) for n in objects] + [Garbage("step-4/data/a", 0, uploads[0])]
    assert recent(found, objects, uploads, now=now) == {"step-3": 5.0, "step-4": 30.0}


def test_the_cli_gc_with_a_short_grace_warns_of_a_save_in_progress(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import subprocess
    import sys

    Storage(s3_uri, s3_opts).write_bytes("step-9/data/00000-0000.safetensors", b"x" * 100)  # no manifest yet
    flags = ["--endpoint-url", s3_opts["endpoint_url"], "--storage-option", f"key={s3_opts['key']}",
             "--storage-option", f"secret={s3_opts['secret']}"]
    p = subprocess.run([sys.executable, "-m", "streamckpt", "gc", s3_uri, "--older-than", "0", "--dry-run", *flags],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "would remove" in p.stdout, p
    assert f"{s3_uri}/step-9 changed" in p.stderr and "save still in progress" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "streamckpt", "gc", s3_uri, "--dry-run", *flags],
                       capture_output=True, text=True, timeout=120)  # the default grace: nothing, no warning
    assert p.returncode == 1 and "save still in progress" not in p.stderr, p
