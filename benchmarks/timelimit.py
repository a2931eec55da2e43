"""Run a command with a time limit that ends its whole process group (issue 36).

    python3 benchmarks/timelimit.py SECONDS CMD [ARG...]     # exit status: CMD's, or 124 at the limit

The command runs in a session of its own (``start_new_session``). At the limit its whole process
group gets SIGTERM, then SIGKILL ``GRACE_S`` later; when the command ends by itself, whatever it
left running in its group is killed too. ``subprocess.run(timeout=...)`` kills only the child and
then reads its pipes to the end: a grandchild that holds them (DCP's process-mode saver, a pytest
worker) blocks the caller until the grandchild exits, past every limit. Standard library only, so
``gpu_check.sh`` can use it before anything is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Sequence

GRACE_S = 10.0
TIMED_OUT = 124  # what timeout(1) exits with


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def end_group(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace`` seconds, reap ``proc``."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # the leader may be gone while its children hold on
    proc.wait()


def run(cmd: Sequence[str], limit: float, grace: float = GRACE_S, **popen: Any) -> int:
    """``cmd``'s exit status, or ``TIMED_OUT`` once its process group was ended at ``limit`` seconds."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        end_group(proc, grace)
        return TIMED_OUT
    except BaseException:  # Ctrl-C, SIGTERM turned into an exception: take the group down too, quickly
        end_group(proc, min(grace, 2.0))
        raise
    _signal_group(proc.pid, signal.SIGKILL)  # leftovers of a command that ended by itself
    return rc


def run_captured(cmd: Sequence[str], limit: float, grace: float = GRACE_S,
                 **popen: Any) -> tuple[int, str, str, bool]:
    """``(status, stdout, stderr, timed_out)`` of ``cmd`` run with its output captured as text; at
    ``limit`` its whole process group is ended, so the pipes close and the output so far comes back."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        end_group(proc, grace)
        out, err = proc.communicate()
        return TIMED_OUT, out, err, True
    except BaseException:  # as in ``run``
        end_group(proc, min(grace, 2.0))
        raise
    _signal_group(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err, False


def exit_on_sigterm() -> None:
    """SIGTERM (an outer limit ending this process's group) raises ``SystemExit`` in the main thread,
    so that ``run``/``run_captured`` in progress end their own groups on the way out: a command run in
    a session of its own is outside the group that the outer limit ends."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: timelimit.py SECONDS CMD [ARG...]", file=sys.stderr)
        return 2
    exit_on_sigterm()
    return run(argv[1:], float(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
