"""Jobs that use streamckpt end clean: exit status 0 and no fatal lines, in every way a job
ends (issue 33).

Before the fix, a process whose last ``async_save`` had committed could still abort at exit
("terminate called without an active exception", SIGABRT): the uploader was a daemon
thread that was often still closing its clients and dropping its staged tensors when the
interpreter finalized, and CPython stops such a thread with ``pthread_exit`` inside torch's
C++ GIL guard. These tests run whole jobs in fresh processes against the session's moto
server and check how they exit, what they print and what they leave in the bucket.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import streamckpt as sc
from streamckpt.manage.lease import LEASE_NAME
from streamckpt.storage import Storage

from distributed import REPO_DIR

JOB = str(Path(__file__).with_name("exit_job.py"))
FATAL = re.compile(r"terminate called|Fatal Python error|Aborted|Segmentation fault|core dumped|"
                   r"cannot schedule new futures|could not delete \S+ after")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(nproc: int) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]


def run_job(mode: str, root: str, opts: dict[str, Any], *, ranks: int = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = (_torchrun(ranks) if ranks else [sys.executable]) + [JOB, mode, root, json.dumps(opts)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)


def assert_clean(proc: subprocess.CompletedProcess, what: str) -> None:
    fatal = [ln for ln in proc.stderr.splitlines() if FATAL.search(ln)]
    assert proc.returncode == 0 and not fatal, (
        f"{what}: exit status {proc.returncode}, fatal lines {fatal}\n--- stderr ---\n{proc.stderr[-4000:]}")


def objects_under(root: str, opts: dict[str, Any]) -> list[str]:
    """Every checkpoint object under ``root`` (recursively), as names relative to it (not the
    writer lease a process that died left: the next writer takes it over, test_lease.py)."""
    storage = Storage(root, opts)
    try:
        return sorted(n for n in storage.list("", recursive=True) if n != LEASE_NAME)
    finally:
        storage.close()


# ----------------------------------------------------------------------------- clean ends

def test_async_save_job_exits_clean(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The single-process pattern of docs/quickstart.md: async_save every 2 steps, result() at the end."""
    proc = run_job("loop", s3_uri, s3_opts)
    assert_clean(proc, "the job")
    assert "DONE" in proc.stdout
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-8"
    assert objects_under(s3_uri, s3_opts) == [f"step-{s}/{name}" for s in (2, 4, 6, 8)
                                               for name in ("data/00000-0000.safetensors", "manifest.json")]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_async_save_job_exits_clean_30_times(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    failures = []
    for i in range(30):
        proc = run_job("loop", f"{s3_uri}/{i}", s3_opts)
        if proc.returncode != 0 or FATAL.search(proc.stderr):
            failures.append((i, proc.returncode, proc.stderr[-2000:]))
    assert not failures, f"{len(failures)} of 30 runs ended badly; first: {failures[0]}"


@pytest.mark.parametrize("mode", ["loop", pytest.param("loop-nodestroy", marks=pytest.mark.slow)])
def test_torchrun_async_save_job_exits_clean(mode: str, s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """2 gloo ranks under torchrun, with and without destroy_process_group() at the end."""
    proc = run_job(mode, s3_uri, s3_opts, ranks=2)
    assert_clean(proc, mode)
    assert proc.stdout.count("DONE") == 2
    info = sc.inspect(f"{s3_uri}/step-8", storage_options=s3_opts)
    assert {k.split(".")[0] for k in info.tensors} == {"rank0", "rank1"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_readme_torchrun_pair_exits_clean_10_times(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """The README's examples/train_resume.py pair (4 ranks to step 6, then 2 ranks to step 9),
    10 times on fresh prefixes: every launch exits 0 with no fatal line."""
    example = str(Path(REPO_DIR) / "examples" / "train_resume.py")
    failures = []
    for i in range(10):
        common = ["--ckpt", f"{s3_uri}/{i}", "--save-every", "3", "--storage-options", json.dumps(s3_opts)]
        for world, steps in ((4, 6), (2, 9)):
            proc = subprocess.run(_torchrun(world) + [example, "--steps", str(steps), *common], env=_env(),
                                  cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0 or FATAL.search(proc.stderr):
                failures.append((i, world, proc.returncode, proc.stderr[-2000:]))
        assert sc.latest(f"{s3_uri}/{i}", storage_options=s3_opts) == f"{s3_uri}/{i}/step-000009"
    assert not failures, f"{len(failures)} of 20 launches ended badly; first: {failures[0]}"


# ------------------------------------------------------------------ a save in flight at exit

def _stalled_puts(proxy_factory: Any, seconds: float) -> tuple[Any, dict[str, Any]]:
    """A proxy that holds back every PUT's reply ``seconds``: a save stays in flight."""
    proxy = proxy_factory(faults={"stall": 1.0}, rate=1.0, stall_seconds=seconds, methods=("PUT", "POST"))
    return proxy, sc_opts(proxy.endpoint_url)


def sc_opts(endpoint: str) -> dict[str, Any]:
    from streamckpt.testing import options_for

    return options_for(endpoint)


def _wait_for_line(proc: subprocess.Popen, word: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if word in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the job never printed {word}: {proc.communicate()[1][-3000:]}")


def _wait_for_upload(proxy: Any, timeout: float = 60) -> None:
    """Until an upload is under way (a PUT held back by the proxy)."""
    deadline = time.monotonic() + timeout
    while proxy.stalled_now == 0:
        assert time.monotonic() < deadline, "the save never started uploading"
        time.sleep(0.01)


def _start(mode: str, root: str, opts: dict[str, Any]) -> subprocess.Popen:
    env = _env()
    env["EXIT_JOB_WIDTH"] = "1024"  # 2 x 4 MiB weights + AdamW state: several data objects
    env["EXIT_JOB_LINGER"] = "1.0"  # the uploads have started when the script ends
    return subprocess.Popen([sys.executable, JOB, mode, root, json.dumps(opts)], env=env, cwd=REPO_DIR,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_end_of_script_with_a_save_in_flight(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    """The script ends without result(): the save is cancelled, nothing is committed, what it
    uploaded is deleted, one line says so, and the process exits 0."""
    proxy, opts = _stalled_puts(proxy_factory, 1.0)
    proc = _start("inflight", s3_uri, opts)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "STAGED" in out and "DONE" in out
    ours = [ln for ln in err.splitlines() if "in flight" in ln]
    assert len(ours) == 1 and "cancelling it, nothing is committed" in ours[0], err
    assert "Traceback" not in err and not FATAL.search(err), err
    assert proxy.counts.get("stall", 0) >= 1  # the save really was uploading when it was cancelled
    assert objects_under(s3_uri, s3_opts) == []
    assert sc.latest(s3_uri, storage_options=s3_opts) is None


def test_ctrl_c_during_async_save(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    """A real SIGINT while the upload runs: KeyboardInterrupt ends the script as Python does,
    the save is cancelled and deleted, and no line per object or traceback of ours follows."""
    proxy, opts = _stalled_puts(proxy_factory, 1.0)
    proc = _start("wait", s3_uri, opts)
    _wait_for_line(proc, "STAGED")
    _wait_for_upload(proxy)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), (proc.returncode, err)
    assert err.count("Traceback") == 1 and "KeyboardInterrupt" in err, err  # Python's own, for the user's loop
    assert "streamckpt" not in err.split("KeyboardInterrupt")[0].split("Traceback")[-1], err  # not raised in our code
    ours = [ln for ln in err.splitlines() if "in flight" in ln]
    assert len(ours) == 1, err
    assert not FATAL.search(err), err
    assert proxy.counts.get("stall", 0) >= 1
    assert objects_under(s3_uri, s3_opts) == []
    assert sc.latest(s3_uri, storage_options=s3_opts) is None


def test_sigterm_during_async_save(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    """SIGTERM's default action runs no Python: the process dies at once, nothing is
    committed, and what is left is data objects only (garbage collection's to remove)."""
    proxy, opts = _stalled_puts(proxy_factory, 1.0)
    proc = _start("wait", s3_uri, opts)
    _wait_for_line(proc, "STAGED")
    _wait_for_upload(proxy)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    left = objects_under(s3_uri, s3_opts)
    assert "step-1/manifest.json" not in left
    assert all(name.startswith("step-1/data/") for name in left), left
    assert sc.latest(s3_uri, storage_options=s3_opts) is None


@pytest.mark.parametrize("mode", ["inflight", "inflight-destroy"])
def test_torchrun_exit_with_a_save_in_flight(mode: str, s3_uri: str, s3_opts: dict[str, Any],
                                             proxy_factory: Any) -> None:
    """2 gloo ranks end their script with the save uploading (one also after
    destroy_process_group()): both exit 0, nothing is committed, nothing is left."""
    _, opts = _stalled_puts(proxy_factory, 1.0)
    env = {**_env(), "EXIT_JOB_WIDTH": "1024", "EXIT_JOB_LINGER": "1.0"}
    proc = subprocess.run(_torchrun(2) + [JOB, mode, s3_uri, json.dumps(opts)], env=env, cwd=REPO_DIR,
                          capture_output=True, text=True, timeout=180)
    assert_clean(proc, mode)
    assert proc.stdout.count("DONE") == 2
    ours = [ln for ln in proc.stderr.splitlines() if "in flight: cancelling it" in ln]
    assert len(ours) == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert objects_under(s3_uri, s3_opts) == []


def test_no_daemon_thread_of_ours_runs_torch_at_shutdown(s3_uri: str, proxy_factory: Any) -> None:
    """The root cause, checked directly: every thread streamckpt starts for a save is a
    non-daemon thread, so the interpreter joins it before it finalizes (a daemon thread still
    inside a torch call then is stopped by pthread_exit in a noexcept C++ frame: SIGABRT).
    With the old daemon uploader this fails every time, not only when the race is lost.
    Before the fix, a spy (an ``atexit`` hook listing live threads) found that uploader still
    alive after ``result()`` had returned, closing its clients, in 2 of 12 runs here."""
    import threading

    import torch

    _, opts = _stalled_puts(proxy_factory, 0.5)
    handle = sc.async_save({"w": torch.arange(1 << 20, dtype=torch.float32)}, s3_uri, storage_options=opts)
    try:
        deadline = time.monotonic() + 30
        ours: list[threading.Thread] = []
        while time.monotonic() < deadline and not any(t.name.startswith("streamckpt-s3") for t in ours):
            ours = [t for t in threading.enumerate() if t.name.startswith("streamckpt")]
            time.sleep(0.01)
        assert any(t.name == "streamckpt-async-save" for t in ours), [t.name for t in ours]
        # pool workers ("<prefix>_<n>") may inherit daemon from the event loop's thread that made
        # the pool: concurrent.futures joins them at shutdown whatever their flag
        plain = [t for t in ours if not re.search(r"_\d+$", t.name)]
        assert [t.name for t in plain if t.daemon] == []
    finally:
        handle.result(timeout=60)


# ------------------------------------------------- a CheckpointManager's save in flight at exit

def _marker(uri: str, opts: dict[str, Any], key: str) -> list[float]:
    return sc.load_full(uri, keys=[key], storage_options=opts)[key].tolist()


def test_end_of_script_finishes_a_managers_save(s3_uri: str, s3_opts: dict[str, Any], proxy_factory: Any) -> None:
    """Issue 44 item 4: the script ends with the manager's async save uploading and no
    mgr.wait(): a normal exit finishes and commits it (it was cancelled, losing the run's last
    checkpoint), with one line saying so that names mgr.wait() / mgr.close()."""
    proxy, opts = _stalled_puts(proxy_factory, 0.5)
    proc = _start("mgr-inflight", s3_uri, opts)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "STAGED" in out and "DONE" in out
    ours = [ln for ln in err.splitlines() if "in flight" in ln]
    assert len(ours) == 1 and "finishing it before the exit" in ours[0] and "mgr.wait() or mgr.close()" in ours[0], err
    assert "Traceback" not in err and not FATAL.search(err), err
    assert proxy.counts.get("stall", 0) >= 1  # it really was uploading when the script ended
    assert sc.latest(s3_uri, storage_options=s3_opts) == f"{s3_uri}/step-1"
    assert _marker(f"{s3_uri}/step-1", s3_opts, "rank0.marker") == [float(i) for i in range(4096)]


def test_an_exception_still_cancels_a_managers_save(s3_uri: str, s3_opts: dict[str, Any],
                                                    proxy_factory: Any) -> None:
    """The script dies on an uncaught exception: the manager's save is cancelled, as before,
    and the line names the manager's calls, not result()."""
    _, opts = _stalled_puts(proxy_factory, 0.5)
    proc = _start("mgr-inflight-raise", s3_uri, opts)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert err.count("Traceback") == 1 and "RuntimeError: the training loop failed" in err, err
    ours = [ln for ln in err.splitlines() if "in flight" in ln]
    assert len(ours) == 1 and "on an exception" in ours[0] and "cancelling it, nothing is committed" in ours[0], err
    assert "call mgr.wait() or mgr.close() before exiting" in ours[0], err
    assert not FATAL.search(err), err
    assert objects_under(s3_uri, s3_opts) == []


@pytest.mark.parametrize("mode", ["mgr-inflight", pytest.param("mgr-inflight-destroy", marks=pytest.mark.slow)])
def test_torchrun_end_of_script_finishes_a_managers_save(mode: str, s3_uri: str, s3_opts: dict[str, Any],
                                                         proxy_factory: Any) -> None:
    """2 gloo ranks end their script with the manager's save uploading (one also after
    destroy_process_group()): each rank's uploader still agrees on the commit at exit, and
    both ranks' shards are in it."""
    _, opts = _stalled_puts(proxy_factory, 0.5)
    env = {**_env(), "EXIT_JOB_WIDTH": "1024", "EXIT_JOB_LINGER": "0.5"}
    proc = subprocess.run(_torchrun(2) + [JOB, mode, s3_uri, json.dumps(opts)], env=env, cwd=REPO_DIR,
                          capture_output=True, text=True, timeout=180)
    assert_clean(proc, mode)
    ours = [ln for ln in proc.stderr.splitlines() if "finishing it before the exit" in ln]
    assert len(ours) == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    uri = f"{s3_uri}/step-1"
    assert sc.latest(s3_uri, storage_options=s3_opts) == uri
    for rank in (0, 1):
        assert _marker(uri, s3_opts, f"rank{rank}.marker") == [float(i) for i in range(4096)]


def test_a_rank_exiting_while_its_peer_died_does_not_hang(s3_uri: str, s3_opts: dict[str, Any],
                                                          proxy_factory: Any) -> None:
    """Rank 1 dies right after the save is staged; rank 0 ends normally and finishes its save:
    the commit's agreement fails at once (rank 1's connection is closed), rank 0 says so and
    exits 0 well inside the bound, and nothing is committed. Two plain processes, not torchrun
    (whose agent would SIGTERM rank 0 once rank 1 died)."""
    _, opts = _stalled_puts(proxy_factory, 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**_env(), "EXIT_JOB_WIDTH": "1024", "EXIT_JOB_LINGER": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, JOB, "mgr-peer-dies", s3_uri, json.dumps(opts)], env=env,
                                      cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (out0, err0), (_, err1) = (p.communicate(timeout=150) for p in procs)
    assert procs[1].returncode == 3, err1[-2000:]
    assert procs[0].returncode == 0, err0[-3000:]
    assert "DONE" in out0
    assert len([ln for ln in err0.splitlines() if "finishing it before the exit" in ln]) == 1, err0
    failed = [ln for ln in err0.splitlines() if "failed at exit, nothing was committed: PeerError" in ln]
    assert len(failed) == 1, err0
    assert not FATAL.search(err0), err0
    assert sc.latest(s3_uri, storage_options=s3_opts) is None
