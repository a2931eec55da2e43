"""One writer per run: a lease object at the root, renewed by a heartbeat.

Two training jobs saving into one root (a job launched twice, a stale job still alive beside
its requeued self) would prune each other's steps and interleave their histories. The first
save of a ``CheckpointManager`` (``writer_lease=ttl``, default 60 s) takes the lease: a small JSON object ``<root>/LEASE_NAME``
naming its holder (host, pid, a random id, the job id the launcher gave, start and heartbeat
times). A heartbeat thread rewrites it every ``ttl / 3`` seconds; ``close()`` deletes it.

Another writer finding a lease that is not its own:

* the holder is gone when its heartbeat is older than ``ttl``, or it ran on this host under a
  pid that no longer lives (or is this very process: a container restarted with the same pid),
  or it belonged to the same launcher job (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``): a
  requeued job takes its own lease over at once;
* otherwise it waits for the heartbeat to go stale (up to ``ttl``, saying so once); a holder
  whose heartbeat moves on in the meantime is alive: ``CheckpointInUseError`` naming it.

Objects directly at a root are not checkpoint data: listing, pruning and garbage collection
never see it. Readers (restore, ls, load) never take a lease. A race of two writers starting
within the same instant is narrowed (each reads the lease back after writing it) but not
closed: object stores offer no lock every backend supports.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from ..errors import CheckpointError, CheckpointInUseError, CheckpointNotFoundError
from ..storage import Storage

log = logging.getLogger(__name__)

LEASE_NAME = ".streamckpt-writer.json"
DEFAULT_TTL = 60.0  # seconds without a heartbeat after which a holder counts as gone
JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "JOB_ID", "KUBERNETES_JOB_NAME")


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a run's lease."""

    id: str
    host: str
    pid: int
    job: str
    started: float
    heartbeat: float

    def describe(self, now: float) -> str:
        job = f", job {self.job}" if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on {self.host}{job}, writing since {since}, last heartbeat " \
               f"{max(0.0, now - self.heartbeat):.0f} s ago"


def launcher_job() -> str:
    """The job id a launcher gave this process (empty when none or torchrun's default ``none``)."""
    for name in JOB_VARIABLES:
        value = os.environ.get(name, "")
        if value and value != "none":
            return f"{name}={value}"
    return ""


def gone(other: Holder, me: Holder, now: float, ttl: float) -> str | None:
    """Why ``other``'s lease may be taken over by ``me`` at once, or None (it may be alive)."""
    if now - other.heartbeat > ttl:
        return f"its last heartbeat is {now - other.heartbeat:.0f} s old (more than {ttl:.0f} s)"
    if other.job and other.job == me.job:
        return f"it belongs to this launcher job ({me.job}): a requeued or restarted run"
    if other.host == me.host:
        if other.pid == me.pid:
            return "it ran on this host under this very pid (a restarted container)"
        if not _alive(other.pid):
            return f"process {other.pid} no longer runs on this host"
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs here; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc (macOS): kill's answer stands
    return state != [b"Z"]


def abandoned(storage: Storage, now: float | None = None) -> tuple[Holder, str] | None:
    """The lease at ``storage``'s root when its writer is gone (heartbeat older than the ttl it
    recorded, or a pid that no longer runs on this host), with why; None when there is none or
    its writer may be alive. ``collect_garbage`` removes such a lease (a killed job's)."""
    try:
        raw = storage.read_bytes(LEASE_NAME, max_bytes=64 << 10)
        doc = json.loads(raw)
        other = Holder(str(doc["id"]), str(doc["host"]), int(doc["pid"]), str(doc.get("job", "")),
                       float(doc["started"]), float(doc["heartbeat"]))
        ttl = float(doc.get("ttl", DEFAULT_TTL))
    except CheckpointNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None  # not ours to judge: left alone
    now = time.time() if now is None else now
    if now - other.heartbeat > ttl:
        return other, f"its last heartbeat is {now - other.heartbeat:.0f} s old"
    if other.host == socket.gethostname() and other.pid != os.getpid() and not _alive(other.pid):
        return other, f"process {other.pid} no longer runs on this host"
    return None


class Lease:
    """A run's writer lease (see the module docstring); ``acquire`` once, ``release`` at close."""

    def __init__(self, storage: Storage, *, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """``storage``: the run's root, a ``Storage`` of the lease's own (its heartbeat thread uses it)."""
        self.check_ttl(ttl)
        self.storage, self.ttl, self._clock, self._sleep = storage, float(ttl), clock, sleep
        now = clock()
        self.me = Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), launcher_job(), now, now)
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def check_ttl(ttl: object) -> None:
        """Raises CheckpointError unless ``ttl`` is a number of seconds > 0."""
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
            raise CheckpointError(f"writer_lease (the lease's ttl) must be a number of seconds > 0, got {ttl!r}")

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        """Take the lease (waiting up to ``ttl`` for a silent holder); start the heartbeat.

        Raises:
            CheckpointInUseError: another writer holds it and is alive.
        """
        if self._held:
            return
        other = self._read()
        if other is not None and other.id != self.me.id:
            self._wait_out(other)
        self._write()
        back = self._read()
        if back is None or back.id != self.me.id:  # lost a race with a writer that started at the same time
            raise self._refusal(back) if back is not None else CheckpointError(
                f"{self.storage.describe(LEASE_NAME)}: the writer lease vanished right after it was written; "
                f"another process is deleting under this root")
        self._held = True
        self._thread = threading.Thread(target=self._beat, name="streamckpt-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat, delete the lease if it is still ours (best effort), close the storage."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self._held:
            return
        self._held = False
        try:
            back = self._read()
            if back is not None and back.id == self.me.id:
                self.storage.delete(LEASE_NAME)
        except CheckpointError as e:
            log.warning("could not release the writer lease %s: %s", self.storage.describe(LEASE_NAME), e)
        finally:
            self.storage.close()

    # ------------------------------------------------------------------ internals

    def _wait_out(self, other: Holder) -> None:
        now = self._clock()
        why = gone(other, self.me, now, self.ttl)
        if why is not None:
            log.warning("taking over the writer lease of %s: %s (%s)", self.storage.describe(""), why,
                        other.describe(now))
            return
        deadline = now + self.ttl - (now - other.heartbeat) + 1.0
        log.warning("%s: another writer holds the lease (%s); waiting up to %.0f s for its heartbeat to stop "
                    "(a job just killed and requeued)", self.storage.describe(""), other.describe(now), deadline - now)
        while self._clock() < deadline:
            self._sleep(min(self.ttl / 6, max(0.05, deadline - self._clock())))
            latest = self._read()
            if latest is None:
                return
            if latest.heartbeat != other.heartbeat or latest.id != other.id:
                raise self._refusal(latest)
        log.warning("taking over the writer lease of %s: no heartbeat for %.0f s", self.storage.describe(""),
                    self._clock() - other.heartbeat)

    def _refusal(self, other: Holder) -> CheckpointInUseError:
        holder = other.describe(self._clock())
        return CheckpointInUseError(
            f"{self.storage.describe('')} is being written by another CheckpointManager ({holder}). "
            f"Two writers on one run would prune each other's steps: stop the other job, or give this one another "
            f"root. Reading (restore, ls, sc.load) needs no lease. If that process is gone, its lease expires "
            f"{self.ttl:.0f} s after its last heartbeat, or delete {self.storage.describe(LEASE_NAME)}")

    def _read(self) -> Holder | None:
        try:
            raw = self.storage.read_bytes(LEASE_NAME, max_bytes=64 << 10)
        except CheckpointNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            return Holder(str(doc["id"]), str(doc["host"]), int(doc["pid"]), str(doc.get("job", "")),
                          float(doc["started"]), float(doc["heartbeat"]))
        except (ValueError, KeyError, TypeError):
            log.warning("%s is not a writer lease this version reads: replaced", self.storage.describe(LEASE_NAME))
            return None

    def _write(self) -> None:
        self.me = Holder(**{**asdict(self.me), "heartbeat": self._clock()})
        self.storage.write_bytes(LEASE_NAME, json.dumps({**asdict(self.me), "ttl": self.ttl}).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                other = self._read()
                if other is not None and other.id != self.me.id:
                    log.error("the writer lease of %s was taken by %s: this manager's saves now race with it",
                              self.storage.describe(""), other.describe(self._clock()))
                    return
                self._write()
            except CheckpointError as e:  # a heartbeat missed is retried at the next beat
                log.warning("writer lease heartbeat to %s failed: %s", self.storage.describe(LEASE_NAME), e)
