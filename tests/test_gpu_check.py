"""The prepared GPU check (``benchmarks/gpu_check.sh``, issue 36), on this machine without a GPU.

* its time limits end a step's whole process group: a grandchild holding the output pipe (DCP's
  process-mode saver, a pytest worker) cannot keep a step, or the script, past its limit;
* it stops at the first failed set-up step (install, import, CUDA), with the reason in the summary:
  here, where there is no GPU, a dry run stops at the CUDA probe within seconds;
* its NCCL part on one GPU: ``SKIP nccl-exchange: 1 GPU`` and a world-1 group's load, the same code run
  on gloo with the CUDA stand-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks import timelimit
from streamckpt.comm import AGREE_EVERY_ON_CPU

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "benchmarks" / "gpu_check.sh"

# A child that starts a grandchild sharing its stdout (as DCP's process-mode saver does), says the
# grandchild's pid, and both sleep past the limit.
HOLDS_THE_PIPE = textwrap.dedent("""
    import subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    print(g.pid, flush=True)
    time.sleep(30)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) is gone too
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_limit_ends_the_whole_group_and_the_output_comes_back() -> None:
    t0 = time.monotonic()
    rc, out, _, timed_out = timelimit.run_captured([sys.executable, "-c", HOLDS_THE_PIPE], 2, grace=1)
    took = time.monotonic() - t0
    assert (rc, timed_out) == (timelimit.TIMED_OUT, True)
    assert took < 15, f"{took:.1f} s: the grandchild kept the pipe open"  # it would hold it for 30 s
    grandchild = int(out.split()[0])
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_the_command_line_form_exits_124_and_leaves_nothing(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    body = HOLDS_THE_PIPE.replace("print(g.pid, flush=True)", f"open({str(pidfile)!r}, 'w').write(str(g.pid))")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "timelimit.py"), "2", sys.executable, "-c", body],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124 and time.monotonic() - t0 < 20
    time.sleep(0.5)
    assert not _alive(int(pidfile.read_text()))


def test_an_outer_limit_ends_an_inner_session_too(tmp_path: Path) -> None:
    """gpu_check.sh's limit on benchmarks.gpu, whose stall part runs each saver in a session of its
    own: SIGTERM becomes SystemExit there, and the saver's group is ended on the way out (else it
    would run on, orphaned, after the step's group was killed)."""
    pidfile = tmp_path / "pid"
    inner = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    outer = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from benchmarks import timelimit
        timelimit.exit_on_sigterm()
        timelimit.run_captured([sys.executable, "-c", {inner!r}], 60)
    """)
    t0 = time.monotonic()
    assert timelimit.run([sys.executable, "-c", outer], 3, grace=5) == timelimit.TIMED_OUT
    assert time.monotonic() - t0 < 15
    deadline = time.monotonic() + 5
    while _alive(int(pidfile.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pidfile.read_text()))


def _check(tmp_path: Path, *args: str, **env: str) -> tuple[int, list[str], float]:
    out = tmp_path / "out"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, timeout=120,
                          env={**clean, "OUT": str(out), "WORK": str(tmp_path / "work"), **env})
    summary = (out / "gpu_summary.txt").read_text().splitlines()
    assert (out / "gpu_check.log").read_text().rstrip().endswith(summary[-1])  # the log ends with the summary
    return proc.returncode, summary, time.monotonic() - t0


def test_the_check_stops_when_the_install_fails(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    rc, summary, _ = _check(tmp_path, WHEELS=str(tmp_path / "wheels"), PYTHON=sys.executable)
    assert rc == 1
    assert summary == [f"FAIL install: no wheels in {tmp_path / 'wheels'} (run 'make gpu-wheels' here and carry .whl)",
                       summary[1]]
    assert summary[1].startswith("STOP install: the later parts need it, so none was run")


def test_the_check_stops_when_the_import_fails(tmp_path: Path) -> None:
    """A Python without torch (a bare venv): the import's exception is the reason, nothing runs after it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=60)
    rc, summary, _ = _check(tmp_path, "--no-install", PYTHON=str(tmp_path / "bare" / "bin" / "python"))
    assert rc == 1
    assert summary[0] == "FAIL import: ModuleNotFoundError: No module named 'torch'"
    assert summary[1].startswith("STOP import: ") and len(summary) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for a machine without a GPU")
def test_a_dry_run_without_a_gpu_stops_at_the_cuda_probe(tmp_path: Path) -> None:
    rc, summary, took = _check(tmp_path, "--no-install", PYTHON=sys.executable)
    assert rc == 1
    assert summary[0].startswith("PASS import: streamckpt ") and f"from {REPO}/streamckpt/__init__.py" in summary[0]
    assert summary[1] == (f"FAIL cuda: AssertionError: torch {torch.__version__} sees no CUDA device "
                          f"(torch.cuda.is_available() is False)")
    assert summary[2].startswith("STOP cuda: ") and len(summary) == 3
    assert took < 60  # seconds, where the whole check has 300
    assert not (tmp_path / "out" / "pytest_gpu.xml").exists()


# ----------------------------------------------------------------------------- the NCCL part on one GPU

NCCL_PART = textwrap.dedent("""
    import sys, tempfile
    from pathlib import Path
    import torch
    from fakecuda import FakeCuda
    from benchmarks.gpu import Summary, nccl_world1

    gpus = int(sys.argv[1])
    dev = torch.device("cuda", 0)
    fake = FakeCuda(current_device=0, device_count=gpus)
    fake.expect_device(dev)
    out = Summary("")

    def exchange(world, root):  # benchmarks.gpu_nccl's ranks on gloo with the stand-in
        import streamckpt as sc
        from benchmarks import gpu_nccl
        from distributed import run_ranks

        sc.save(gpu_nccl.model(), str(root / "x"))
        return [r.unwrap() for r in run_ranks(world, gpu_nccl.exchange_worker,
                                              kwargs={"uri": str(root / "x"), "fake": True}, timeout=120)]

    with tempfile.TemporaryDirectory() as d:
        nccl_world1(dev, Path(d), out, backend="gloo", cuda=fake, place=lambda t: fake.place(t, dev),
                    exchange=exchange)
    print("VIOLATIONS", fake.violations, fake.counts.get("copy", 0))
""")


def test_the_nccl_part_skips_the_exchange_and_loads_on_a_world_1_group() -> None:
    """On gloo with the stand-in (NCCL needs a GPU): the same function, a world-1 GroupComm, a real
    load through DeviceStage (copies through the stand-in), the values checked by the function."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.run([sys.executable, "-c", NCCL_PART, "1"], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith(">>> ")]
    assert lines[0] == "SKIP nccl-exchange: 1 GPU (NCCL refuses two ranks on one device: the exchange between ranks " \
                       "needs 2 GPUs)"
    assert lines[1].startswith("PASS nccl-world1: a world-1 gloo GroupComm (backends cpu:gloo,cuda:gloo, data plane "
                               f"cpu, agreement every {AGREE_EVERY_ON_CPU} rounds) loading 4104 KiB through DeviceStage "
                               "in "), lines
    assert lines[1].endswith("wrong tensors: 0")
    violations = next(ln for ln in proc.stdout.splitlines() if ln.startswith("VIOLATIONS"))
    assert violations.startswith("VIOLATIONS [] ") and int(violations.split()[-1]) > 2


@pytest.mark.parametrize("gpus", [2, 4])
def test_the_nccl_part_on_several_gpus_says_pass_with_parts_and_relays(gpus: int) -> None:
    """On 2+ GPUs the summary has an nccl-exchange PASS/FAIL line (it had none): message parts on
    2, relays on 4, no relay hop through the host (the ranks on gloo with the stand-in here)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.run([sys.executable, "-c", NCCL_PART, str(gpus)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith(">>> ")]
    assert lines[0].startswith(f"PASS nccl-exchange: {gpus} ranks, max_peers=1, direct_message_bytes=64, 1 MiB "
                               f"budget: "), lines
    assert " 0 device-to-host downloads, " in lines[0] and lines[0].endswith("wrong: 0")
    if gpus == 4:
        assert " 0 relayed sends" not in lines[0]
    else:
        assert "; relays need 4 GPUs" in lines[0]
    assert lines[1].startswith("PASS nccl-world1: ")


@pytest.mark.parametrize("refuse", [False, True])
def test_the_pin_probe(refuse: bool) -> None:
    """The check's first GPU part, through the stand-in: PASS with the bytes back, WARN on a refusal."""
    from fakecuda import FakeCuda

    from benchmarks.gpu import pin_probe

    dev = torch.device("cuda", 0)
    fake = FakeCuda(current_device=0)
    fake.expect_device(dev)
    fake.refuse_pin = refuse  # type: ignore[attr-defined]
    verdict, figure = pin_probe(dev, fake)
    if refuse:
        assert verdict == "WARN" and figure.startswith("pinning 1048576 bytes of host memory on cuda:0 failed")
        assert "staging falls back to torch's pinned allocator" in figure
        assert fake.pins.asked == []
    else:
        assert (verdict, figure.split("; ")[0]) == ("PASS", "1 MiB pinned: True, bytes from the GPU exact: True, "
                                                            "unpinned: True")
        assert fake.pins.asked == [1 << 20] and fake.pins.live == {}
    assert "kernel " in figure and fake.violations == []


# ----------------------------------------------------------------------------- out of time is TIMEOUT, not FAIL


def test_a_part_out_of_time_is_timeout_not_fail() -> None:
    """benchmarks.gpu's parts: an exception is FAIL; a part the check's limit ends (SIGTERM, which
    exit_on_sigterm makes SystemExit) is ``TIMEOUT <part> after N s``, and so is every part not started
    (budget spent, or the limit ended the benchmark); none of them counts as failed."""
    from benchmarks.gpu import Summary, run_parts

    def broken() -> None:
        raise ValueError("wrong bytes")

    def killed() -> None:
        raise SystemExit(143)

    out = Summary("")
    run_parts([("a", lambda: None), ("b", broken)], out, time.perf_counter(), 100.0, torch.device("cpu"))
    run_parts([("late", lambda: None)], out, time.perf_counter() - 10, 5.0, torch.device("cpu"))
    with pytest.raises(SystemExit):
        run_parts([("h2d", killed), ("stall", lambda: None)], out, time.perf_counter(), 100.0, torch.device("cpu"))
    assert [ln.split(":")[0] for ln in out.lines] == [
        "FAIL b", "TIMEOUT late after 10 s", "TIMEOUT h2d after 0 s", "TIMEOUT stall after 0 s"]
    assert out.lines[0] == "FAIL b: ValueError: wrong bytes"
    assert out.lines[1].endswith(": not started: the benchmark's 5 s were spent")
    assert out.lines[2].endswith(": ended by the check's time limit")
    assert out.failed == 1


def test_a_saver_out_of_time_is_timeout(tmp_path: Path) -> None:
    """benchmarks.stall: a saver not started for lack of time, or ended at its limit, is TIMEOUT in
    the report, the GPU summary and the exit status (broken only when it failed)."""
    from benchmarks import stall as st
    from benchmarks.gpu import Summary, stall

    reports = st.measure(1 << 20, "cpu", "file", ["streamckpt"], ["small"], tmp_path,
                         deadline=time.perf_counter() + 5)
    assert reports[0].timed_out and reports[0].error.startswith("TIMEOUT: not started, ")
    spec = {"saver": "streamckpt", "device": "cpu", "target": "file", "nbytes": 1 << 20, "loops": ["small"],
            "base": str(tmp_path / "x"), "storage_options": None}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = st.run_saver(spec, env, timeout=0.5)  # the child cannot even import torch in that time
    assert r.timed_out and r.error == "TIMEOUT after 0 s"
    assert not any("FAILED" in row for row in st.table([reports[0], r]))
    out, lines = Summary(""), []
    stall(1 << 20, "cpu", tmp_path, out, lines, deadline=time.perf_counter() + 5)
    assert [ln.split(": not started, ")[0] for ln in out.lines] == [f"TIMEOUT stall-{s}" for s in st.SAVERS]
    assert out.failed == 0
