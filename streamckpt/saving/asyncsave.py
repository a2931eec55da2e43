"""``async_save``: block the training loop only for the staging copy.

The call does the save's first collective (validation, every rank's specs, who writes
what: errors here raise from ``async_save`` itself on every rank), then copies this
rank's share of the state into host buffers it owns and returns a ``SaveHandle``; the
caller may change or free its tensors at once. A background thread streams the staged
bytes to storage (starting while staging is still going on), gathers the shard records,
commits the manifest on rank 0 and agrees on the outcome — all on a gloo process group
of its own, so the training job's collectives (NCCL or gloo) never interleave with the
save's.

Memory: with ``staging_budget`` set, staged copies live in one block of that many bytes
(``staging``: a ring, pinned at exactly that size for CUDA tensors, kept for the next save
on the group until ``SaveHandle.release_staging()`` or until the group is garbage collected
after ``destroy_process_group``;
items larger than a quarter of it are cut into row blocks or flat ranges first; without
a budget the block is the share's size, kept for the next save that fits in it);
when this rank's share is larger, ``async_save`` returns only once the rest has been
staged, as buffers free up behind the upload — it then blocks for about the time it
takes to upload ``share - staging_budget`` bytes. Uploads hold their own buffers
besides: ``writer.UploadShape`` (4 × 8 MiB by default; up to 4 × 64 MiB in saves of 1,024
ranks and more, ``writer.object_bytes_for``).

Exit: the uploader is an ordinary (non-daemon) thread, so the interpreter waits for it
before it finalizes. A daemon thread still running then is stopped by CPython with
``pthread_exit`` the moment it next takes the GIL; inside torch that happens in a C++
destructor (pybind11's GIL release guard), and the forced unwind through a ``noexcept``
frame is ``std::terminate``: "terminate called without an active exception", SIGABRT,
after the checkpoint was already durable (the uploader was still closing its clients and
dropping the staged tensors). A process that exits with a save still in flight (the end of
the script, or Ctrl-C) cancels it first, from a hook that runs before the thread pools shut
down (``threading._register_atexit``): nothing is committed and what it uploaded is deleted.
A save marked by ``finish_at_exit`` (a ``CheckpointManager``'s) is finished and committed
instead when the script ended normally (no uncaught exception, no Ctrl-C).

Process state: creating a process group is itself a collective, so the save group made
for a training group is kept for the next save (``_SESSIONS``, keyed by that group and the
save's purpose: ``async_save``'s, or the local tier's, which may be in flight beside it), with
the handle of the save in flight: a second ``async_save`` on the group waits for the first
to finish. This is the one piece of module-level state in streamckpt.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..comm import GroupComm, SoloComm, group_timeout, make_comm, warn_if_peers_late
from ..core.targets import TargetSpec
from ..cuda.runtime import CudaApi, TorchCuda
from ..errors import CheckpointError, PeerError
from ..results import SaveResult
from ..storage import Storage
from . import writeplan
from .saver import CANCELLED, Guard, Prepared, fail_together, prepare, write_and_commit
from .staging import StagingArea, copy_all

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

EXIT_WAIT_SECONDS = 60.0  # how long an exiting process waits for a cancelled save to stop
EXIT_FINISH_SECONDS = 600.0  # how long it waits for a kept save (finish_at_exit) to commit, then cancels it


class SaveHandle:
    """An ``sc.async_save`` in flight: ``result()`` waits for the commit (or raises the save's
    error, on every rank); ``done()`` says whether it has finished.

    Made by ``async_save``; its constructor's ``future`` (of the ``SaveResult``), ``cancel``
    and ``release`` (what ``cancel()`` and ``release_staging()`` call) are internal.

    Attributes:
        uri: The checkpoint's URI.
    """

    def __init__(self, future: "cf.Future[SaveResult]", uri: str, cancel: Any = None,
                 release: Callable[[], None] | None = None) -> None:
        self._future = future
        self._cancel = cancel
        self._release = release
        self.uri = uri
        self._finish_at_exit = False  # finish_at_exit: a normal interpreter exit finishes it
        self._wait_hint = "result() on its handle"
        self._then: Callable[[], None] | None = None

    def release_staging(self) -> None:
        """Wait for this save to end, then free the host memory it staged through (page-locked
        for CUDA tensors), which its process group otherwise keeps for the next ``async_save``
        (that one then allocates it again). A no-op while a later save on the group is in flight
        (its own handle can release it), or when a later save has staged elsewhere.

        Raises nothing: the save's own error is ``result()``'s."""
        self.wait()
        if self._release is not None:
            self._release()

    def cancel(self, timeout: float = 60.0) -> bool:
        """Stop the save: no manifest is written (every rank's ``result()`` raises).

        Args:
            timeout: Seconds to wait for the upload to stop (default 60).

        Returns:
            bool: whether the save ended within ``timeout`` seconds.
        """
        if self._cancel is not None and not self.done():
            self._cancel()
        done, _ = cf.wait([self._future], timeout)
        return bool(done)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the commit and return this rank's ``SaveResult``.

        Args:
            timeout: Seconds to wait at most. Default None: as long as it takes.

        Returns:
            SaveResult: as ``sc.save`` returns it.

        Raises:
            TimeoutError: the save has not ended within ``timeout`` (it goes on).
            CheckpointError: the save's error (a ``StorageError``, ``PeerError``, ...), the
                same on every rank; nothing was committed.
        """
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:  # concurrent.futures' says nothing: say what and what to do
            raise TimeoutError(f"the async save has not committed within timeout={timeout!r} s; it goes on: call "
                               f"result() again to wait longer, or done() to poll") from None

    def done(self) -> bool:
        """Whether the save has ended (committed or failed); never waits."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[["SaveHandle"], None]) -> None:
        """Call ``fn(handle)`` once the save has ended (committed or failed), from the upload
        thread; at once, here, if it has ended already. ``fn`` may call ``result()``."""
        self._future.add_done_callback(lambda _: fn(self))

    def wait(self) -> None:
        """Wait for the save to end, whatever its outcome (its owner sees the error)."""
        cf.wait([self._future])

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SaveHandle({self.uri!r}, {state})"


class StagedShard:
    """One item to write, filled by the staging thread and read once by the uploader
    (``.tensor`` waits until it is staged)."""

    staged = True  # host memory: the writer asks for ``.tensor`` only when its bytes are due

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self._tensor: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()

    def set(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if not self._ready.is_set():
            self._error = error
            self._ready.set()

    @property
    def tensor(self) -> torch.Tensor:
        self._ready.wait()
        if self._tensor is None:
            raise self._error or RuntimeError("internal: staged shard released before it was written")
        return self._tensor

    def drop(self) -> None:
        """Forget the staged copy (its memory goes back to the staging area)."""
        self._tensor = None


@dataclass
class SaveSession:
    comm: SoloComm | GroupComm  # the save's own group
    last: SaveHandle | None = None
    area: StagingArea | None = None  # kept for the next save with the same budget
    keep: Any = None  # a training group that cannot be weakly referenced, kept so that its id is not reused

    def staging(self, budget: int | None, gpu: torch.device | None, share: int,
                cuda: CudaApi | None) -> StagingArea:
        """The staging area for a save of ``share`` bytes (``StagingArea.needed``), reused when it fits."""
        if self.area is None or not self.area.fits(budget, gpu, share, cuda):
            self.release()  # the old block goes before the new one is made
            self.area = StagingArea(budget, gpu, size=share if budget is None else None, cuda=cuda)
        self.area.reset()
        return self.area

    def settle(self) -> None:
        """Wait for the save in flight on this group, whatever its outcome (its owner sees it)."""
        if self.last is not None:
            self.last.wait()

    def release(self, area: StagingArea | None = None) -> None:
        """Free the kept staging area (only if it is still ``area``, when given, and no save uses it)."""
        if self.area is None or (area is not None and self.area is not area):
            return
        if self.last is not None and not self.last.done():
            return
        self.area.close()
        self.area = None


_SESSIONS: dict[tuple[int, str], SaveSession] = {}
_SESSIONS_LOCK = threading.Lock()


def _forget(key: tuple[int, str]) -> None:
    """The training group is gone (garbage collected): drop its session and free its staging."""
    with _SESSIONS_LOCK:
        session = _SESSIONS.pop(key, None)
    if session is not None:
        session.release()  # a save still in flight keeps its area; the area unpins when collected


def session_for(process_group: Any, purpose: str = "save") -> SaveSession:
    """The save group of ``process_group`` for ``purpose`` (created on first use: a collective
    of its ranks). ``purpose``: ``"save"`` (``async_save``) or another kind of background save
    that may be in flight beside it with its own group, thread and staging (the local tier's).

    Keyed by the training group's id; the session goes (and its staging is freed) when that
    group is garbage collected, so the id cannot be reused by a stale entry."""
    train = make_comm(process_group)
    key = (0 if isinstance(train, SoloComm) else id(train.group), purpose)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is not None:
            return session
    if isinstance(train, SoloComm):
        comm: SoloComm | GroupComm = SoloComm()
    else:
        dist = train.dist
        ranks = dist.get_process_group_ranks(train.group)
        with warn_if_peers_late(train, "sc.async_save"):  # its first wait for the others: a rank-0-only call waits here
            comm = GroupComm(_new_save_group(dist, train.group, ranks))
    with _SESSIONS_LOCK:
        session = _SESSIONS.setdefault(key, SaveSession(comm))
    if not isinstance(train, SoloComm) and session.comm is comm:
        try:
            weakref.finalize(train.group, _forget, key)
        except TypeError:
            session.keep = train.group
    return session


def _new_save_group(dist: Any, train_group: Any, ranks: list[int]) -> Any:
    """A gloo group over the training group's ranks, waiting for them no longer than the training
    group's timeout. ``new_group`` waits for every rank in the store: a peer that died after the
    last collective would hold this rank there for torch's default (30 min), where ``sc.save`` on
    the training group fails at once; a timeout alone surfaces a raw ``DistStoreError``."""
    timeout = group_timeout(dist, train_group)
    try:
        return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)
    except RuntimeError as e:  # DistStoreError, DistNetworkError: a peer is gone or never came
        within = f"within {timeout.total_seconds():g} s (the training group's timeout)" if timeout else \
            "within torch's default timeout"
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise PeerError(f"sc.async_save could not make its process group: rank {dist.get_rank()} waited for the "
                        f"other ranks {ranks} {within} and they did not all come ({type(e).__name__}: {first}); "
                        f"a peer rank died, was killed or is stuck before this save; this rank stops too") from None


def start_save(
    state_dict: Mapping[str, Any],
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    compression: str | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    staging_budget: int | None = None,
    cuda: CudaApi | None = None,
    progress: Callable[[int], None] | None = None,
    base: str | None = None,
    guard: Guard | None = None,
    failed: CheckpointError | None = None,
) -> SaveHandle:
    """What ``sc.async_save`` runs (its doc says what each argument does), with the CUDA runtime
    named (``cuda``: a test's stand-in; None: torch's). ``progress``: a callable, called from
    the upload thread with each object's size once stored. ``guard``: as ``saver.prepare``'s.
    ``failed``: the caller's own setup failed (a bad ``progress``): raised on every rank."""
    if cuda is None and torch.cuda.is_available():
        cuda = TorchCuda()
    session = session_for(process_group)  # a collective on first use: every rank comes here, even failing
    session.settle()  # at most one save in flight per group
    try:  # a mistake here on one rank fails the save on every rank, in its first collective
        if failed is not None:
            raise failed
        if staging_budget is not None and (not isinstance(staging_budget, (int, float))
                                           or isinstance(staging_budget, bool) or not staging_budget > 0):
            raise CheckpointError(f"staging_budget must be a positive number of bytes or None, "
                                  f"got {staging_budget!r}")
        storage = Storage(uri, storage_options)
    except CheckpointError as e:
        fail_together(session.comm, e, "sc.async_save")
    try:
        max_item = None if staging_budget is None else max(1 << 20, staging_budget // 4)
        prep = prepare(session.comm, storage, state_dict, compression=compression, metadata=metadata,
                       overwrite=overwrite, max_item_bytes=max_item, cuda=cuda, base=base,
                       storage_options=storage_options, guard=guard, call="sc.async_save")
    except BaseException:
        storage.close()
        raise

    def work(shards: list[StagedShard], released: Callable[[int], None], cancelled: Callable[[], bool]) -> SaveResult:
        return write_and_commit(session.comm, storage, prep, shards,  # type: ignore[arg-type]
                                on_written=released, cuda=cuda, progress=progress, cancelled=cancelled)

    return start_staged(session, storage, prep, cuda, staging_budget, work)


Work = Callable[[list[StagedShard], Callable[[int], None], Callable[[], bool]], SaveResult]


def start_staged(session: SaveSession, storage: Storage, prep: Prepared, cuda: CudaApi | None,
                 staging_budget: int | None, work: Work) -> SaveHandle:
    """Stage ``prep``'s items in ``session``'s area (on this thread) and run
    ``work(shards, released, cancelled)`` on a background thread: it writes the staged shards
    (``released(i)`` once shard ``i`` is written, which frees its room), asks ``cancelled()``
    between steps, and does the save's remaining collectives on ``session.comm``. Closes
    ``storage`` when it ends."""
    devices = [cuda.device_of(t.tensor) if cuda is not None else t.tensor.device for t in prep.local]
    gpu = next((d for d in devices if d.type == "cuda"), None)
    share = StagingArea.needed(it.spec.nbytes for it in prep.items)
    area = session.staging(staging_budget, gpu, share, cuda)
    handle = _start(storage, prep, area, lambda: session.release(area), work)
    session.last = handle
    return handle


def _start(storage: Storage, prep: Prepared, area: StagingArea, release: Callable[[], None], work: Work) -> SaveHandle:
    shards = [StagedShard(it.spec) for it in prep.items]
    future: cf.Future[SaveResult] = cf.Future()
    cancelled = threading.Event()

    def released(i: int) -> None:
        shards[i].drop()
        area.release()

    def background() -> None:
        outcome: SaveResult | BaseException
        try:
            outcome = work(shards, released, cancelled.is_set)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the handle
            area.fail()
            outcome = e
        finally:
            storage.close()  # before the handle says done: result() returning means the clients are closed
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def cancel() -> None:
        cancelled.set()
        area.fail()
        for shard in shards:
            shard.fail(CheckpointError(CANCELLED))

    # Not a daemon: the interpreter joins it before finalizing (see the module doc).
    uploader = threading.Thread(target=background, name="streamckpt-async-save", daemon=False)
    tensors = {t.spec: t.tensor for t in prep.local}
    pieces = [writeplan.piece_of(item, tensors[item.source]) for item in prep.items]
    try:
        # When everything fits, stage first (on all cores: copy_all) and upload after: the
        # copies alone are memory-bound and ~3x faster without the uploader competing for
        # the cores (256 MiB: 0.07 s vs 0.22 s blocked). Otherwise the upload must free
        # room as staging goes.
        fits = area.budget is None or sum(it.spec.nbytes for it in prep.items) <= area.budget
        if fits:
            _stage_all(area, pieces, shards)
        else:
            if not fits:
                uploader.start()
            _stage_in_turn(area, pieces, shards)
    finally:
        if uploader.ident is None:
            uploader.start()
    for shard in shards:
        shard.fail(RuntimeError("staging stopped after the upload failed"))  # no-op for staged shards
    return SaveHandle(future, storage.describe("").rstrip("/"), cancel, release)


def _stage_in_turn(area: StagingArea, pieces: list[torch.Tensor], shards: list[StagedShard]) -> None:
    """Stage one item after the other, each as soon as there is room (the uploader frees it)."""
    for k, (piece, shard) in enumerate(zip(pieces, shards)):
        try:
            staged = area.copy(piece)
        except BaseException as e:
            _fail_from(shards, k, e)
            raise
        if staged is None:
            return  # the upload failed or was cancelled: the handle raises its error
        shard.set(staged)


def _stage_all(area: StagingArea, pieces: list[torch.Tensor], shards: list[StagedShard]) -> None:
    """Everything fits: take the room for every item, then copy them all at once on every core."""
    outs = [area.reserve(p) for p in pieces]  # never waits: the block holds the whole share
    pairs = [(o, p) for o, p in zip(outs, pieces) if o is not None]
    try:
        if area.gpu is not None:
            area.fill(pairs)  # device copies, one host wait
        else:
            copy_all(pairs, os.cpu_count() or 1)
    except BaseException as e:
        _fail_from(shards, 0, e)
        raise
    for out, shard in zip(outs, shards):
        if out is not None:
            shard.set(out)


def _fail_from(shards: list[StagedShard], k: int, error: BaseException) -> None:
    """Shards from ``k`` on will never be staged: the uploader raises ``error`` for them, and
    every rank learns of it through the agreement."""
    for rest in shards[k:]:
        rest.fail(error)


def finish_at_exit(handle: SaveHandle, hint: str, wait: Callable[[], None] | None = None) -> None:
    """Mark ``handle`` as a save its owner wants kept: at a normal interpreter exit with it in
    flight it is finished and committed, not cancelled (an exception or Ctrl-C still cancels
    it). ``hint`` names the owner's call that waits for it (``"mgr.wait() or mgr.close()"``);
    ``wait``, that call: run at exit once the save has ended, so that what the owner does after
    the commit (a manager's retention, on a thread pool) runs before the pools shut down."""
    handle._finish_at_exit = True
    handle._wait_hint = hint
    handle._then = wait


def _end_at_exit() -> None:
    """A process ending with a save in flight cancels it (its checkpoint stays uncommitted,
    what it uploaded is deleted) and waits for the uploader to stop; a save marked by
    ``finish_at_exit`` is finished instead when the script ended normally. Runs at the start of
    interpreter shutdown, before ``concurrent.futures`` refuses new work and before non-daemon
    threads are joined (``threading._register_atexit``)."""
    with _SESSIONS_LOCK:
        pending = [s.last for s in _SESSIONS.values() if s.last is not None and not s.last.done()]
    failing = _exiting_on_an_exception()
    for handle in pending:
        if handle._finish_at_exit and not failing and _finish(handle):
            continue
        log.warning("the process is exiting%s with the save to %s in flight: cancelling it, nothing is "
                    "committed (call %s before exiting to keep it)", " on an exception" if failing else "",
                    handle.uri, handle._wait_hint)
        if not handle.cancel(timeout=EXIT_WAIT_SECONDS):
            log.warning("the save to %s did not stop within %.0f s; waiting for it to end", handle.uri,
                        EXIT_WAIT_SECONDS)


def _finish(handle: SaveHandle) -> bool:
    """Wait for a kept save at exit; False when it is still running after ``EXIT_FINISH_SECONDS``
    (the caller cancels it). Each rank's uploader agrees on the commit as it would have without
    the exit; a peer that died fails that agreement at once (its connection closes), a peer
    that hangs fails it after the save group's timeout (the training group's)."""
    log.warning("the process is exiting with the save to %s in flight: finishing it before the exit, as the "
                "script ended normally (call %s before the end to say so)", handle.uri, handle._wait_hint)
    done, _ = cf.wait([handle._future], EXIT_FINISH_SECONDS)
    if not done:
        log.warning("the save to %s has not committed within %.0f s of the exit", handle.uri, EXIT_FINISH_SECONDS)
        return False
    try:
        (handle._then or handle.result)()
    except Exception as e:  # noqa: BLE001 - the process is ending: said, not raised
        log.warning("the save to %s failed at exit, nothing was committed: %s: %s", handle.uri, type(e).__name__, e)
    return True


def _exiting_on_an_exception() -> bool:
    """Whether the script ended on an uncaught exception (KeyboardInterrupt included): the
    interpreter prints it, and records it as ``sys.last_value`` (``last_exc`` from 3.12),
    before it shuts down."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def at_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the interpreter starts to shut down, before thread pools refuse work
    and non-daemon threads are joined (``atexit`` would run after both)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        atexit.register(hook)
    else:
        register(hook)


def settle_at_exit() -> None:
    """At shutdown, before a hook registered after this module's (hooks run last registered
    first): end the saves in flight as ``_end_at_exit`` does (again, later, it finds none)."""
    _end_at_exit()


at_shutdown(_end_at_exit)
