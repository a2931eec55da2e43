"""The writer lease of a run's root (``manage.lease``), alone: on local files with a clock the
test moves, and two processes' worth of holders on one root."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.manage.lease import LEASE_NAME, Holder, Lease, gone
from streamckpt.storage import Storage


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s


def _holder(**over: Any) -> Holder:
    base = {"id": "x", "host": "elsewhere", "pid": 4242, "job": "", "started": 999_000.0, "heartbeat": 999_990.0}
    return Holder(**{**base, **over})


def _plant(root: Path, h: Holder) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_NAME).write_text(json.dumps(asdict(h)))


def test_a_lease_is_taken_renewed_and_released(tmp_path: Path) -> None:
    clock = Clock()
    lease = Lease(Storage(str(tmp_path)), ttl=30, clock=clock, sleep=clock.sleep)
    lease.acquire()
    doc = json.loads((tmp_path / LEASE_NAME).read_text())
    assert doc["pid"] == os.getpid() and doc["host"] == socket.gethostname() and doc["heartbeat"] == clock.now
    assert lease.held and clock.slept == 0
    lease.release()
    assert not (tmp_path / LEASE_NAME).exists() and not lease.held


def test_a_live_holder_elsewhere_is_refused_after_its_heartbeat_moves(tmp_path: Path) -> None:
    clock = Clock()
    other = _holder(heartbeat=clock.now - 5)
    _plant(tmp_path, other)
    storage = Storage(str(tmp_path))

    def sleep(s: float) -> None:  # the other writer beats while we wait
        clock.sleep(s)
        _plant(tmp_path, _holder(heartbeat=clock.now))

    with pytest.raises(sc.CheckpointInUseError, match=r"another CheckpointManager \(pid 4242 on elsewhere.*stop the "
                                                      r"other job, or give this one another root"):
        Lease(storage, ttl=30, clock=clock, sleep=sleep).acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["pid"] == 4242  # left alone


def test_a_silent_holder_is_waited_out_then_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    _plant(tmp_path, _holder(heartbeat=clock.now - 10))
    lease = Lease(Storage(str(tmp_path)), ttl=30, clock=clock, sleep=clock.sleep)
    lease.acquire()
    assert 20 <= clock.slept <= 22  # the rest of its ttl, and a second
    assert json.loads((tmp_path / LEASE_NAME).read_text())["id"] == lease.me.id
    assert "waiting up to 21 s" in caplog.text and "no heartbeat for" in caplog.text
    lease.release()


@pytest.mark.parametrize("case, over, why", [
    ("stale", {"heartbeat": 1_000_000.0 - 31}, "heartbeat is 31 s old"),
    ("same job", {"job": "SLURM_JOB_ID=77"}, "belongs to this launcher job"),
    ("same pid", {"host": socket.gethostname(), "pid": os.getpid()}, "this very pid"),
    ("dead pid", {"host": socket.gethostname(), "pid": 2**22 + 12345}, "no longer runs on this host"),
    ("alive here", {"host": socket.gethostname(), "pid": 1}, None),
    ("alive elsewhere", {}, None),
])
def test_when_a_holder_is_gone(case: str, over: dict[str, Any], why: str | None) -> None:
    me = _holder(id="me", host=socket.gethostname(), pid=os.getpid(), job="SLURM_JOB_ID=77")
    got = gone(_holder(**over), me, now=1_000_000.0, ttl=30)
    assert (got is None) if why is None else (got is not None and why in got), (case, got)


def test_a_requeued_job_takes_its_own_lease_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    clock = Clock()
    _plant(tmp_path, _holder(job="SLURM_JOB_ID=77", heartbeat=clock.now - 1))
    lease = Lease(Storage(str(tmp_path)), ttl=30, clock=clock, sleep=clock.sleep)
    lease.acquire()
    assert clock.slept == 0 and lease.me.job == "SLURM_JOB_ID=77"
    lease.release()


def test_an_unreadable_lease_is_replaced_and_a_bad_ttl_refused(tmp_path: Path) -> None:
    (tmp_path / LEASE_NAME).write_text("{not json")
    lease = Lease(Storage(str(tmp_path)), ttl=30)
    lease.acquire()
    assert json.loads((tmp_path / LEASE_NAME).read_text())["id"] == lease.me.id
    lease.release()
    for bad in (0, -1, "60", True):
        with pytest.raises(sc.CheckpointError, match="must be a number of seconds > 0"):
            Lease(Storage(str(tmp_path)), ttl=bad)  # type: ignore[arg-type]


def test_a_second_manager_writing_into_a_run_is_refused(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Through the manager, on moto: a second writer (another process's lease, alive) is refused at its
    first save; reading needs no lease; close() lets go and the next writer goes on."""
    import torch

    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, writer_lease=60) as first:
        first.save(1, {"w": torch.ones(4)})
        store = Storage(s3_uri, s3_opts)
        doc = json.loads(store.read_bytes(LEASE_NAME))
        assert doc["pid"] == os.getpid()
        doc.update(id="other", host="elsewhere", pid=4242)  # as another host's live job would hold it
        store.write_bytes(LEASE_NAME, json.dumps(doc).encode())
        clock = Clock()
        lease = Lease(Storage(s3_uri, s3_opts), ttl=60, clock=clock, sleep=lambda s: (
            clock.sleep(s), store.write_bytes(LEASE_NAME, json.dumps({**doc, "heartbeat": clock.now}).encode())))
        with pytest.raises(sc.CheckpointInUseError, match="pid 4242 on elsewhere"):
            lease.acquire()
        assert sc.CheckpointManager(s3_uri, storage_options=s3_opts).steps() == [1]  # a reader: no lease
        doc.update(id=first._lease.me.id, host=socket.gethostname(), pid=os.getpid())  # type: ignore[union-attr]
        store.write_bytes(LEASE_NAME, json.dumps(doc).encode())
    assert LEASE_NAME not in store.list_info("")  # released at close
    with pytest.raises(sc.CheckpointError, match="writer_lease"):
        sc.CheckpointManager(s3_uri, storage_options=s3_opts, writer_lease=0)


def test_a_manager_dropped_without_close_lets_its_lease_go_even_on_the_storage_thread(
        s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The lease's finalizer runs on whatever thread drops the manager last, the storage's event
    loop included: the release's I/O went through that very loop and the loop hung for good
    (seen in a full run: a test's garbage collection on the loop thread). Now it runs on a thread
    of its own, and the lease object goes."""
    import asyncio
    import gc

    import fsspec.asyn

    from streamckpt.manage.lease import LEASE_NAME
    from streamckpt.storage import Storage

    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    mgr.save(1, {"w": torch.ones(4)})
    storage = Storage(s3_uri, s3_opts)
    assert storage.exists(LEASE_NAME)
    holder = [mgr]
    del mgr

    async def drop() -> None:
        holder.clear()
        gc.collect()

    asyncio.run_coroutine_threadsafe(drop(), fsspec.asyn.get_loop()).result(timeout=30)
    deadline = time.monotonic() + 30
    while storage.exists(LEASE_NAME):
        assert time.monotonic() < deadline, "the dropped manager's lease was never released"
        time.sleep(0.05)


def test_collect_garbage_removes_the_lease_of_a_gone_writer_only(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A job SIGKILLed (or ended without close()) leaves its lease: after garbage collection only
    referenced objects remain (the soak's invariant), so a lease whose writer is gone (a dead pid
    on this host, a heartbeat older than its ttl) is removed; a live writer's never is."""
    import subprocess
    import sys

    from streamckpt.storage import Storage

    storage = Storage(s3_uri, s3_opts)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now = time.time()

    def lease(**kw: Any) -> None:
        doc = {"id": "x", "host": socket.gethostname(), "pid": os.getpid(), "job": "", "started": now,
               "heartbeat": now, "ttl": 60.0, **kw}
        storage.write_bytes(LEASE_NAME, json.dumps(doc).encode())

    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts, writer_lease=None)
    lease(pid=int(dead.stdout))  # a writer killed on this host
    assert mgr.collect_garbage(older_than=0, dry_run=True) == [
        f"{s3_uri}/{LEASE_NAME} (the writer lease of pid {int(dead.stdout)} on {socket.gethostname()}: "
        f"process {int(dead.stdout)} no longer runs on this host)"]
    assert storage.exists(LEASE_NAME)  # a dry run
    assert len(mgr.collect_garbage(older_than=0)) == 1 and not storage.exists(LEASE_NAME)
    lease(host="elsewhere", heartbeat=now - 120)  # silent for longer than its ttl
    assert "heartbeat is 120 s old" in mgr.collect_garbage(older_than=0)[0] and not storage.exists(LEASE_NAME)
    lease(host="elsewhere")  # alive, as far as anyone here can tell
    assert mgr.collect_garbage(older_than=0) == [] and storage.exists(LEASE_NAME)
    lease()  # this very process (another manager of it)
    assert mgr.collect_garbage(older_than=0) == [] and storage.exists(LEASE_NAME)
    storage.delete(LEASE_NAME)
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts) as own:
        own.save(1, {"w": torch.ones(2)})
        assert own.collect_garbage(older_than=0) == [] and storage.exists(LEASE_NAME)  # its own: kept
    assert not storage.exists(LEASE_NAME)  # released at close


def test_a_script_that_ends_without_close_releases_its_lease(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    import subprocess
    import sys

    from streamckpt.storage import Storage

    script = ("import json, sys, torch, streamckpt as sc\n"
              "mgr = sc.CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]), async_save=True)\n"
              "mgr.save(1, {'w': torch.ones(4)})\n")  # no wait(), no close(): the exit commits, then lets go
    p = subprocess.run([sys.executable, "-c", script, s3_uri, json.dumps(s3_opts)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    storage = Storage(s3_uri, s3_opts)
    assert storage.exists("step-1/manifest.json") and not storage.exists(LEASE_NAME), storage.list("", recursive=True)
