"""examples/train_resume.py run as users run it, against a real S3 server (moto).

4 gloo ranks train an FSDP2 model with AdamW and a LinearLR schedule, saving with
``sc.save`` every 3 steps to the bucket; they record their whole state at the last
save and then train on, uninterrupted. 2 ranks build the same job, resume from
``sc.latest`` (a different FSDP2 sharding), and must hold exactly the saved state
(every tensor, ``param_groups`` with tuple ``betas``, scheduler, step) once
``set_state_dict`` has run; their next steps' parameters must match the
uninterrupted run within 1e-6 (only the gradient reduction order differs).
The slow variant runs the script itself under ``torchrun``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import streamckpt as sc

from distributed import REPO_DIR, run_ranks
from fsdp_job import EXAMPLE, differences, example, full, max_difference

SAVE_AT, SAVE_EVERY, MORE = 6, 3, 3


def train_and_save(rank: int, world: int, root: str, opts: dict[str, Any], ref: str) -> dict[str, Any]:
    """The first job: train to SAVE_AT with saves, record the state, then train on MORE steps."""
    import torch

    ex = example()
    args = ex.parse_args(["--ckpt", root, "--steps", str(SAVE_AT), "--save-every", str(SAVE_EVERY),
                          "--storage-options", json.dumps(opts)])
    job = ex.run(args)
    at_save = full(job.state_dict())
    for _ in range(MORE):
        job.train_step()
    after = full(job.state_dict()["model"])
    if rank == 0:
        torch.save({"at_save": at_save, "after": after}, ref)
    return {"step": job.step}


def resume_and_continue(rank: int, world: int, root: str, opts: dict[str, Any], ref: str) -> dict[str, Any]:
    """The second job, on another world size: resume from the newest checkpoint, train MORE steps."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    ex = example()
    job = ex.Job.create(init_device_mesh("cpu", (world,)))
    before = full(job.state_dict())
    uri = job.resume(root, opts)
    loaded = full(job.state_dict())  # what model, optimizer and schedule hold after set_state_dict
    want = torch.load(ref)
    exact = differences(loaded, want["at_save"], "state")
    untouched = [k for k in want["at_save"]["model"] if torch.equal(before["model"][k], loaded["model"][k])]
    for _ in range(MORE):
        job.train_step()
    after = full(job.state_dict()["model"])
    return {
        "uri": uri, "step": job.step, "exact": exact, "untouched": untouched,
        "continuation": differences(after, want["after"], "after", tol=1e-6),
        "max_diff": max_difference(after, want["after"]),
        "betas": type(loaded["optim"]["param_groups"][0]["betas"]).__name__,
    }


def test_resume_on_another_world_size(s3_uri: str, s3_opts: dict[str, Any], tmp_path: Path) -> None:
    ref = str(tmp_path / "ref.pt")
    kwargs = {"root": s3_uri, "opts": s3_opts, "ref": ref}
    first = [r.unwrap() for r in run_ranks(4, train_and_save, kwargs=kwargs, timeout=240)]
    assert [f["step"] for f in first] == [SAVE_AT + MORE] * 4
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-{SAVE_AT:06d}"
    assert sorted(sc.inspect(f"{s3_uri}/step-{SAVE_EVERY:06d}", storage_options=s3_opts).values) == [
        "optim.param_groups", "sched._get_lr_called_within_step", "sched._is_initial", "sched._last_lr",
        "sched._step_count", "sched.base_lrs", "sched.end_factor", "sched.last_epoch", "sched.start_factor",
        "sched.total_iters", "step",
    ]
    second = [r.unwrap() for r in run_ranks(2, resume_and_continue, kwargs=kwargs, timeout=240)]
    for r in second:
        assert r["uri"] == f"{s3_uri}/step-{SAVE_AT:06d}"
        assert r["exact"] == [], r["exact"]
        assert r["untouched"] == [], f"parameters equal to the fresh job's before resuming: {r['untouched']}"
        assert r["betas"] == "tuple"
        assert r["step"] == SAVE_AT + MORE
        assert r["continuation"] == [], (r["continuation"], r["max_diff"])
    assert second[0]["max_diff"] == second[1]["max_diff"]


def _torchrun(world: int, args: list[str], timeout: float = 300) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_DIR), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}",
           str(EXAMPLE), *args]
    p = subprocess.run(cmd, env=env, cwd=str(REPO_DIR), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    return out


@pytest.mark.slow
def test_the_script_under_torchrun(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The example as a user runs it: two torchrun launches, 4 processes then 2."""
    common = ["--ckpt", s3_uri, "--save-every", "3", "--storage-options", json.dumps(s3_opts)]
    _torchrun(4, ["--steps", "6", *common])
    out = _torchrun(2, ["--steps", "9", *common])
    assert f"resumed from {s3_uri}/step-000006 at step 6" in out
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-000009"
    assert sc.inspect(f"{s3_uri}/step-000009", storage_options=s3_opts).values["step"] == 9
