"""An emulator run as a child process on loopback: the part LocalGCS and LocalAzure share.

Start on a free port (again on another one if the port was taken meanwhile), log to a
file (an unread pipe would block the child), wait until it answers, and end it by its
own PID: on ``stop``, or when the object or the interpreter goes away.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any, Self

from .s3server import free_port

log = logging.getLogger(__name__)

START_TRIES = 3  # a free port can be taken between choosing it and the server binding it


class ChildServer:
    """A server binary on ``host``; subclasses say what to run and how to tell it is up."""

    name = "server"  # for messages
    start_timeout = 20.0  # seconds for one launch to answer

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._logdir: tempfile.TemporaryDirectory[str] | None = None
        self._reaper: weakref.finalize | None = None

    # ------------------------------------------------------------ what subclasses say

    def _binary(self) -> str:
        """The executable (found or installed now); raises when there is none."""
        raise NotImplementedError

    def _argv(self, binary: str, port: int) -> list[str]:
        raise NotImplementedError

    def _answers(self, port: int) -> bool:
        """One probe: True once the server serves requests."""
        raise NotImplementedError

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Start the server (idempotent) and wait until it answers."""
        if self._proc is not None:
            return self
        binary = self._binary()
        self._logdir = tempfile.TemporaryDirectory(prefix=f"streamckpt-{self.name}-")
        tries = 1 if self._requested_port else START_TRIES
        for attempt in range(1, tries + 1):
            port = self._requested_port or free_port(self.host)
            if self._launch(binary, port, Path(self._logdir.name)):
                self.port = port
                # A server that is never stopped still ends with this object or this interpreter.
                self._reaper = weakref.finalize(self, end_process, self._proc)
                log.debug("%s at %s:%d", self.name, self.host, port)
                return self
            log.debug("%s did not start on port %d (attempt %d)", self.name, port, attempt)
        why = self._log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} did not start on {self.host}: {why}")

    def _launch(self, binary: str, port: int, workdir: Path) -> bool:
        """Run the binary on ``port``; True once it answers, False if it exited or stayed silent."""
        logfile = open(workdir / "server.log", "ab")  # noqa: SIM115 - the child holds it from here
        try:
            self._proc = subprocess.Popen(self._argv(binary, port), stdin=subprocess.DEVNULL, stdout=logfile,
                                          stderr=subprocess.STDOUT, cwd=str(workdir))
        finally:
            logfile.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if self._answers(port):
                return True
            time.sleep(0.05)
        self._terminate()
        return False

    def stop(self) -> None:
        """Stop the server (what it holds lives in its memory and is gone)."""
        self._terminate()
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if self._reaper is not None:
            self._reaper.detach()
            self._reaper = None
        if proc is not None:
            end_process(proc)

    def _log_tail(self) -> str:
        if self._logdir is None:
            return "(no log)"
        path = Path(self._logdir.name) / "server.log"
        text = path.read_bytes()[-2000:].decode(errors="replace") if path.exists() else ""
        return text.strip() or "(empty log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def urlopen(req: "str | urllib.request.Request", timeout: float) -> Any:
    """urlopen that never goes through an ``http_proxy`` from the environment (the server is local)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout)


def end_process(proc: "subprocess.Popen[bytes]") -> None:
    """Terminate a server process (its own PID) and wait for it (kill it if it lingers)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
