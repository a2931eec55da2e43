"""The soak: a 2-rank training job killed and requeued many times (slow; seeded, replayable).

Each cycle starts ``tests/soak_job.py`` under torchrun (2 gloo ranks, async incremental saves
of every step through the manager, through a fault proxy that slows and resets requests), lets
it run a random while, SIGKILLs the whole job (or lets it end), and sometimes collects garbage
between runs. After every cycle, as a user would check by hand:

* every committed step restores bit-exact (the state of step ``s`` is a function of ``s``);
* a step a rank journaled as durable (its ``result()`` returned) is still committed, unless
  retention removed it (keep_last 3, keep_every 10, always the newest);
* ``restore()`` returns the newest committed step, and the next life resumes right after it;
* no job hangs (each life has a deadline; a life left to end exits 0);
* after garbage collection only objects some committed manifest references remain.

``SOAK_SEED`` and ``SOAK_CYCLES`` replay or shorten it: ``SOAK_SEED=7 pytest -m slow tests/test_soak.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import streamckpt as sc
from streamckpt.testing import FaultProxy, LocalS3

from conftest import BUCKET

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_job import POLICY, expected  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOB = str(Path(__file__).resolve().parent / "soak_job.py")
LIFE_DEADLINE = 240.0  # a life that neither ends nor gets killed by then is a hang


def _torchrun() -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (torchrun starts its workers in sessions of their own,
    so a process group kill misses them)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        found += frontier
    return found


def _kill_tree(root: int) -> None:
    for pid in _tree(root):  # gathered first: a killed parent's children are re-parented at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _life(root: str, opts: dict[str, Any], journal: Path, steps: int, kill_after: float | None) -> tuple[str, str]:
    """One run of the job: killed (SIGKILL to torchrun and every worker at once) after ``kill_after`` seconds
    of training, or left to end. Returns ("killed" | "ended", its output)."""
    cmd = _torchrun() + [JOB, root, json.dumps(opts), str(journal), str(steps)]
    child = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    t0 = time.monotonic()
    try:
        out, _ = child.communicate(timeout=kill_after if kill_after is not None else LIFE_DEADLINE)
    except subprocess.TimeoutExpired:
        if kill_after is None or time.monotonic() - t0 > LIFE_DEADLINE:
            _kill_tree(child.pid)
            pytest.fail(f"a life of the job hung for {LIFE_DEADLINE} s: {child.communicate()[0][-3000:]}")
        _kill_tree(child.pid)
        out, _ = child.communicate(timeout=60)
        return "killed", out
    assert child.returncode == 0 and "DONE" in out, f"a life left to end failed (rc={child.returncode}): {out[-4000:]}"
    return "ended", out


def _durable(journal: Path) -> set[int]:
    """Steps that both ranks journaled as durable."""
    sets = []
    for rank in (0, 1):
        path = Path(f"{journal}.{rank}")
        sets.append({int(x) for x in path.read_text().split()} if path.exists() else set())
    return sets[0] & sets[1]


def _kept_by_policy(step: int, steps: list[int]) -> bool:
    return step in steps[-POLICY["keep_last"]:] or step % POLICY["keep_every"] == 0 or step == steps[-1]


def _check(root: str, opts: dict[str, Any], durable: set[int], ever: set[int]) -> list[int]:
    with sc.CheckpointManager(root, storage_options=opts) as mgr:
        steps = mgr.steps()
        for s in steps:
            back = sc.load_full(f"{root}/step-{s}", storage_options=opts)
            want = expected(s)
            assert set(back) == set(want), (s, sorted(back))
            for key, t in want.items():
                assert torch.equal(back[key], t), f"step {s}: {key} differs"
        seen = sorted(ever | durable | set(steps))  # every step known committed at some point
        lost = sorted(s for s in durable if s not in steps and _kept_by_policy(s, seen))
        assert not lost, f"durable steps {lost} are gone though retention keeps them (committed: {steps})"
        if steps:
            got = mgr.restore()
            assert got is not None and got.step == steps[-1] and got.skipped == [], (got, steps)
    return steps


def _collect(root: str, opts: dict[str, Any]) -> None:
    from streamckpt.storage import Storage

    with sc.CheckpointManager(root, storage_options=opts) as mgr:
        mgr.collect_garbage(older_than=0)
        referenced = set().union(*(e.objects for e in mgr.checkpoints())) if mgr.steps() else set()
    store = Storage(root, opts)
    try:
        left = set(store.list_info(""))
    finally:
        store.close()
    assert left <= referenced, f"after collect_garbage, unreferenced objects remain: {sorted(left - referenced)}"


@pytest.mark.slow
def test_kill_and_requeue_soak(local_s3: LocalS3, tmp_path: Path) -> None:
    seed = int(os.environ.get("SOAK_SEED", "20261205"))
    cycles = int(os.environ.get("SOAK_CYCLES", "50"))
    rng = random.Random(seed)
    root = f"s3://{BUCKET}/soak-{seed}-{uuid.uuid4().hex[:6]}"
    journal = tmp_path / "durable"
    ever: set[int] = set()
    with FaultProxy(local_s3.endpoint_url, faults={"slowdown": 1.0, "reset": 1.0}, rate=0.03, seed=seed,
                    methods=("GET", "HEAD", "PUT", "POST")) as proxy:
        opts = proxy.storage_options
        last = -1
        for cycle in range(cycles):
            proxy.rate = rng.choice([0.0, 0.03, 0.08])
            kill_after = None if rng.random() < 0.2 else rng.uniform(2.0, 7.0)
            how, out = _life(root, opts, journal, steps=rng.randint(4, 12), kill_after=kill_after)
            restored = [int(x) for x in re.findall(r"^RESTORED (-?\d+)$", out, re.M)]
            if restored:  # the life resumed from the newest committed step the previous checks saw
                assert restored[0] == last, f"cycle {cycle} (seed {seed}): restored {restored[0]}, newest was {last}"
            proxy.rate = 0.0
            durable = _durable(journal)
            steps = _check(root, local_s3.storage_options, durable, ever)
            ever |= set(steps) | durable
            last = steps[-1] if steps else -1
            if rng.random() < 0.3:
                _collect(root, local_s3.storage_options)
            print(f"cycle {cycle}: {how}, committed {steps}, durable so far {len(durable)}", flush=True)
    assert last >= 0 and len(ever) >= cycles // 2, f"the soak made little progress: {sorted(ever)}"
