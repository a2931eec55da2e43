"""Preemption and time-based saving in CheckpointManager (issue 44 item 5).

A scheduler's SIGTERM reaches torchrun, which forwards it to its workers with a 30 s grace:
the ranks agree on it at their next step, save that step (after the save in flight), and
stop. The handler chains a user's own and is installed only from the main thread; time
rules are agreed across ranks whose clocks disagree; ``keep_time_interval`` thins by time.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.manage.index import Entry
from streamckpt.manage.retention import Policy
from streamckpt.manage.schedule import Schedule

from conftest import BUCKET
from distributed import REPO_DIR, run_ranks
from test_exit import _env, _torchrun, sc_opts

JOB = str(Path(__file__).with_name("preempt_job.py"))


def test_sigterm_to_torchrun_saves_the_step_after_it(s3_uri: str, s3_opts: dict[str, Any],
                                                     proxy_factory: Any) -> None:
    """SIGTERM to torchrun mid-loop, while an async save is uploading (PUTs held 0.3 s): both
    ranks save the same next step, after the one in flight, and stop; it is the newest
    committed step and holds each rank's values. Without the handler SIGTERM's default action
    killed the workers: the newest step was the last scheduled one."""
    proxy = proxy_factory(faults={"stall": 1.0}, rate=1.0, stall_seconds=0.3, methods=("PUT", "POST"))
    proc = subprocess.Popen(_torchrun(2) + [JOB, s3_uri, json.dumps(sc_opts(proxy.endpoint_url))], env=_env(),
                            cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = 0
    deadline = time.monotonic() + 120
    while seen < 6 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("STEP "):
            seen = int(line.split()[1])
        elif not line and proc.poll() is not None:
            break
    assert seen >= 6, proc.communicate(timeout=30)[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    stops = sorted(ln for ln in out.splitlines() if ln.startswith("PREEMPTED"))
    assert len(stops) == 2 and out.count("DONE") == 2, (out[-2000:], err[-3000:])
    stopped = {int(ln.split()[2]) for ln in stops}
    assert len(stopped) == 1, stops  # the ranks agreed on the step
    (step,) = stopped
    assert step > seen
    mgr = sc.CheckpointManager(s3_uri, storage_options=s3_opts)
    steps = mgr.steps()
    assert steps[-1] == step and all(s % 4 == 0 for s in steps[:-1]) and 4 in steps, steps
    full = sc.load_full(mgr.uri(step), storage_options=s3_opts)
    for rank in (0, 1):
        assert full[f"rank{rank}.marker"].tolist() == [float(step)] * 1024
    assert "preemption (SIGTERM) noticed by the ranks at step" in err, err[-3000:]


def one_rank_signalled_worker(rank: int, world: int, root: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Only rank 1 gets SIGTERM (at step 5): rank 0 must save and stop at the same step."""
    seen = []
    with sc.CheckpointManager(root, storage_options=opts, save_every=100, save_on_preemption=True) as mgr:
        for step in range(1, 30):
            if rank == 1 and step == 5:
                signal.raise_signal(signal.SIGTERM)
            if mgr.should_save(step):
                mgr.save(step, {"w": sc.ShardedTensor(torch.full((4,), float(step + rank)), (8,), (4 * rank,))})
                seen.append(step)
            if mgr.reached_preemption(step):
                break
        return {"stopped": step, "saved": seen, "steps": mgr.steps()}


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(local_s3: Any) -> None:
    root = f"s3://{BUCKET}/preempt-one-{uuid.uuid4().hex[:8]}"
    ranks = [r.unwrap() for r in run_ranks(2, one_rank_signalled_worker, timeout=120,
                                           kwargs={"root": root, "opts": local_s3.storage_options})]
    assert ranks == [{"stopped": 5, "saved": [5], "steps": [5]}] * 2
    assert sc.load_full(f"{root}/step-5", storage_options=local_s3.storage_options)["w"].tolist() == \
        [5.0] * 4 + [6.0] * 4


def test_the_handler_chains_the_users_and_is_put_back(tmp_path: Path) -> None:
    """A user's SIGTERM handler still runs (once per signal), the manager saves once at the
    step after it, and close() puts the user's handler back."""
    calls: list[int] = []

    def users(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, users)
    try:
        with sc.CheckpointManager(str(tmp_path), save_every=100, save_on_preemption=True) as mgr:
            assert signal.getsignal(signal.SIGTERM) != users
            saved = []
            for step in range(1, 20):
                if step == 7:
                    signal.raise_signal(signal.SIGTERM)
                if mgr.should_save(step):
                    mgr.save(step, {"w": torch.full((4,), float(step))})
                    saved.append(step)
                if mgr.reached_preemption(step):
                    break
            assert (step, saved, calls) == (7, [7], [signal.SIGTERM])
            assert mgr.steps() == [7]
            assert mgr.should_save(8) is False  # one save per preemption
            assert mgr.reached_preemption(8) is True
        assert signal.getsignal(signal.SIGTERM) is users
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sc.load_full(f"{tmp_path}/step-7")["w"].tolist() == [7.0] * 4


def test_outside_the_main_thread_nothing_is_installed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM)
    made: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="streamckpt"):
        t = threading.Thread(target=lambda: made.append(sc.CheckpointManager(str(tmp_path), save_on_preemption=True)))
        t.start()
        t.join()
    assert made and signal.getsignal(signal.SIGTERM) == before
    assert "made outside the main thread" in caplog.text
    made[0].close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_bad_time_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(sc.CheckpointError, match="save_interval_s must be a positive number"):
        sc.CheckpointManager(str(tmp_path), save_interval_s=0)
    with pytest.raises(sc.CheckpointError, match="keep_time_interval must be a positive number"):
        sc.CheckpointManager(str(tmp_path), keep_time_interval="1h")  # type: ignore[arg-type]


def agreed_clock_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's clock runs 3x fast: alone it would save at other steps than rank 0."""
    from streamckpt.comm import make_comm

    now = [0.0]
    sched = Schedule(None, 10.0, None, clock=lambda: now[0])
    comm = make_comm(None)
    agreed = []
    for step in range(1, 13):
        now[0] += 1.0 if rank == 0 else 3.0
        if sched.decide(step, comm).save:
            agreed.append(step)
            sched.saved()
    return {"agreed": agreed}


def test_time_rule_is_agreed_across_ranks_whose_clocks_disagree() -> None:
    r0, r1 = (r.unwrap() for r in run_ranks(2, agreed_clock_worker, timeout=90))
    assert r0["agreed"] == r1["agreed"] == [4, 8, 12]  # due on rank 1 every 4 steps (12 s), so on both


def test_schedule_by_steps_and_time_alone() -> None:
    from streamckpt.comm import SoloComm

    now = [0.0]
    both = Schedule(5, 2.5, None, clock=lambda: now[0])
    got = []
    for step in range(1, 11):
        now[0] += 1.0
        if both.decide(step, SoloComm()).save:
            got.append(step)
            both.saved()
    assert got == [3, 5, 8, 10]  # 3 s since the start; step 5; 3 s after 5; step 10
    assert [s for s in range(1, 11) if Schedule(5, None, None).decide(s, SoloComm()).save] == [5, 10]
    assert [s for s in range(1, 4) if Schedule(None, None, None).decide(s, SoloComm()).save] == [1, 2, 3]


def _entry(step: int, seconds: float) -> Entry:
    return Entry(name=f"step-{step}", step=step, committed_ns=int(seconds * 1e9))


def test_keep_time_interval_keeps_one_per_interval() -> None:
    # commits at 0, 40, 70, 130, 150, 200, 260 s; one per 60 s: 0, 70 (>= 60 after 0), 130, 200, 260
    entries = [_entry(s, t) for s, t in zip(range(1, 8), (0, 40, 70, 130, 150, 200, 260))]
    policy = Policy(keep_last=1, keep_time_interval=60)
    assert [e.step for e in policy.to_prune(entries)] == [2, 5]
    reasons = policy.reasons(entries)
    assert reasons[3] == ["time"] and reasons[7] == ["last", "time"]


def test_keep_time_interval_in_a_run(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """Saves seconds apart with a one-hour interval: the first is kept by time, the newest by
    keep_last, the rest pruned."""
    with sc.CheckpointManager(s3_uri, storage_options=s3_opts, keep_last=1, keep_time_interval=3600) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        assert mgr.steps() == [1, 3]
    assert sc.load_full(f"{s3_uri}/step-1", storage_options=s3_opts)["w"].tolist() == [1.0] * 8
