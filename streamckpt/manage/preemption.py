"""Noticing a preemption: SIGTERM sets a flag that the training loop reads at its next step.

Cloud schedulers end a job with SIGTERM and a grace period before SIGKILL (30 s by default
on Kubernetes/GKE; from 30 s to 2 min on spot and preemptible VMs). Its default action kills the process at once,
losing everything since the last checkpoint. The handler here only records that the signal
came: nothing is saved from inside a signal handler (it can run between any two bytecodes
of the main thread, in the middle of a collective or of the save itself); the manager acts
at the next step, when every rank agrees on it (``schedule.Schedule``).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Preemption:
    """A SIGTERM handler that records the signal and then calls the one it replaced.

    Chaining keeps a user's own handler (or a framework's) working: it still runs, after the
    flag is set. A handler of the default action is not called (that would kill the process,
    which is what the grace period is for) and neither is ``SIG_IGN``. Python only lets the
    main thread install handlers: made elsewhere, nothing is installed and one warning says so.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self._noticed = threading.Event()
        self._previous: dict[int, Any] = {}

    @property
    def noticed(self) -> bool:
        """Whether a preemption signal has arrived in this process."""
        return self._noticed.is_set()

    def install(self) -> bool:
        """Install the handler (chained to the current one); False when not in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("CheckpointManager(save_on_preemption=True) made outside the main thread: Python lets only "
                        "the main thread handle signals, so SIGTERM is not watched here (make the manager in the "
                        "main thread)")
            return False
        for sig in self.signals:
            previous = signal.getsignal(sig)
            signal.signal(sig, self._handle)
            self._previous[sig] = previous
        return True

    def uninstall(self) -> None:
        """Put the replaced handlers back (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(self._previous.items()):
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del self._previous[sig]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._noticed.set()  # no logging here: the handler may interrupt a logging call holding its lock
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)


__all__ = ["Preemption"]
