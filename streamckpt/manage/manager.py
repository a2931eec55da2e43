"""``CheckpointManager``: a run's checkpoints under one root, from save to deletion."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeVar, overload

from ..comm import make_comm
from ..core.stateful import Stateful
from ..errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                      CorruptCheckpointError)
from ..saving.asyncsave import finish_at_exit
from ..storage import Storage
from ..storage.store import checked_uri
from .arguments import check_name, check_step, plain_metrics, warn_unranked
from .collective import on_one_rank, started_on_one_rank
from .compaction import compact_after_prune
from .deletion import delete_entries
from .garbage import collect
from .history import another_writer_error, candidates, clear_the_way, in_use_error
from .index import METRICS_KEY, STEP_KEY, Entry, Index, Listing
from . import writer
from .lease import DEFAULT_TTL, Lease
from .passthrough import check_names
from .preemption import Preemption
from .restored import Restored
from .restoring import restore_one
from .retention import Policy
from .tier import Background, Tier, same_tier
from .schedule import Schedule

if TYPE_CHECKING:
    from ..results import SaveResult
    from ..saving.asyncsave import SaveHandle

log = logging.getLogger(__name__)
S = TypeVar("S")  # the state a restore was given: Restored.state is that very object


@dataclass(frozen=True, slots=True)
class Calls:
    """The public calls a manager drives (bound by the wiring, ``streamckpt.api``)."""

    save: Callable[..., Any]
    async_save: Callable[..., Any]
    load: Callable[..., Any]
    load_state: Callable[..., Any]
    expand: Callable[..., Any]  # (state, for_load=) -> core.stateful.Expanded: the local tier's view of objects


class Manager:
    """The checkpoints of one run under ``root``: saved on schedule, kept by a policy,
    deleted safely, garbage-collected, restored past a broken newest.

    A context manager (leaving it waits for a pending async save). Collective like
    ``sc.save`` when torch.distributed is initialized (or ``process_group`` is given): every
    rank of the group makes the same calls; one rank lists, reads manifests and deletes,
    and every rank gets the same answers and the same errors. Steps and metrics live in
    each checkpoint's manifest (``metadata["step"]``, ``metadata["metrics"]``, shown by
    ``sc.inspect`` and ``streamckpt ls``), never in names. Retention runs after each commit,
    never before (after an async save commits: on a thread of the manager's own, on the
    rank that deletes).

    Args:
        root: The run's prefix (any fsspec URL or local path); each checkpoint is a child
            of it, ``root/<name>``.
        storage_options: Passed to fsspec unchanged. Default None: the environment's credentials.
        process_group: The torch.distributed group whose ranks save and load together.
            Default None: the default group when initialized, else this process alone.
        keep_last: Keep the N newest steps. Default None: no such rule.
        keep_every: Keep the steps divisible by K. Default None: no such rule.
        keep_best: ``(metric, "min" | "max", k)``: keep the k best steps by a metric given to
            ``save`` (steps without it are no candidates). Default None: no such rule.
            A checkpoint is kept when any rule keeps it; the newest step always is; with no
            rule at all, everything is.
        save_every: ``should_save(step)`` is true for the steps divisible by it. Default
            None: for every step.
        async_save: Save with ``sc.async_save`` (``save`` returns its ``SaveHandle``).
            Default False: ``sc.save``.
        incremental: Save each step incrementally (``sc.save(..., base=...)``) against the
            newest committed checkpoint under the root: shards equal to its are referenced,
            not uploaded again. Prune and ``collect_garbage`` keep an object while any
            committed checkpoint references it, and prune rewrites a pruned checkpoint's file that
            kept ones use only in part down to what they use (``manage/compaction.py``: stored
            bytes stay within 1.1x of the kept checkpoints' own). Default False: every save is
            self-contained.
        name: The child name of a step, a format string with ``{step}`` and no ``/``.
            Default ``"step-{step}"``.
        save_interval_s: ``should_save`` is also true once this many seconds have passed since
            the last save (alone without ``save_every``). Default None.
        keep_time_interval: Also keep one step per this many seconds of commit time. Default None.
        save_on_preemption: On SIGTERM (recorded by a handler chained to the one it replaces;
            main thread only; undone by ``close``) the next ``should_save`` is true, that ``save``
            returns once committed, and ``reached_preemption`` is true. Default False.
            With this or ``save_interval_s``, ``should_save`` is collective (``manage/schedule.py``).
        writer_lease: Seconds: the first save takes the run's writer lease, an object
            ``.streamckpt-writer.json`` at the root renewed every third of that, and a second
            manager saving into the root meanwhile gets ``CheckpointInUseError`` naming the
            holder (a holder silent that long, of the same launcher job, or a dead pid on this
            host is taken over at once: a requeued job is not held up). Readers (restore, steps,
            ls) never take it. Default 60; None: no lease (one writer per root is the caller's rule).
        local_dir: A node-local folder for the memory/peer tier (docs/resuming-from-peers.md): local
            steps (staged, then written in the background with ``async_save``), copied to ``replicas``
            partners on other nodes; ``restore`` takes the newest step the survivors hold. Default None.
        local_every: The steps divisible by it are saved locally (the bucket keeps ``save_every``;
            a step due for neither goes to the bucket). Default None: every step saved.
        local_keep: Local steps each rank keeps (default 2). replicas: partner copies (default 1).

    Raises:
        CheckpointError: a bad argument (a rule, ``save_every``, ``name``, a tier argument).
    """

    _calls: Calls | None = None

    def __init__(self, root: str, *, storage_options: dict[str, Any] | None = None, process_group: Any = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: tuple[str, str, int] | None = None, save_every: int | None = None,
                 async_save: bool = False, incremental: bool = False, name: str = "step-{step}",
                 save_interval_s: float | None = None, keep_time_interval: float | None = None,
                 save_on_preemption: bool = False, writer_lease: float | None = DEFAULT_TTL,
                 local_dir: Any = None, local_every: int | None = None, local_keep: int = 2,
                 replicas: int = 1) -> None:
        if save_every is not None and (not isinstance(save_every, int) or isinstance(save_every, bool)
                                       or save_every < 1):
            raise CheckpointError(f"save_every must be a positive int or None, got {save_every!r}")
        check_name(name)
        self.root = checked_uri(root).rstrip("/")
        self.storage_options = storage_options
        self.process_group = process_group
        self.policy = Policy(keep_last, keep_every, keep_best, keep_time_interval)
        self._schedule = Schedule(save_every, save_interval_s, Preemption() if save_on_preemption else None)
        self.save_every = save_every
        self.async_save = bool(async_save)
        self.incremental = bool(incremental)
        self.name = name
        self._tier = None if local_dir is None else Tier.make(local_dir, self.root, local_every, local_keep, replicas)
        self._comm = make_comm(process_group)
        self._index = Index()
        self._known: Listing | None = None
        self._storage: Storage | None = None
        self._lock = threading.RLock()
        self._pending: Any = None  # the SaveHandle in flight
        self._after: cf.Future[None] | None = None  # its retention, run once it commits
        self._worker: cf.ThreadPoolExecutor | None = None
        self._closed = False
        self._lease: Lease | None = None  # taken by the first save (rank 0), released by close()
        self._leased = self._tier_agreed = False  # every rank: the first save's lease, the first call's same_tier
        self._unreadable: set[str] = set()  # checkpoints restore passed over: a save of their step replaces them
        self._rolled_back: int | None = None  # the step restore(step=...) went back to
        self.writer_lease = writer_lease
        if writer_lease is not None:
            Lease.check_ttl(writer_lease)

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, {self.policy})"

    def close(self) -> None:
        """Wait for a pending async save (and the retention after it), then release the
        manager's storage client and thread. Idempotent.

        Raises:
            CheckpointError: the pending save's error, as ``wait`` raises it.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            if self._lease is not None:
                self._lease.release()
            if self._storage is not None:
                self._storage.close()
            self._schedule.close()  # the replaced SIGTERM handler is back

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is one to save: divisible by ``save_every``, due by ``save_interval_s``,
        or the first step after a preemption (every step when no rule is given), or with ``local_dir``,
        by ``local_every``. Collective with
        ``save_interval_s`` or ``save_on_preemption``: every rank calls it at every step.

        Args:
            step: The training step.

        Returns:
            bool: True when the step should be saved.
        """
        check_step(step)
        bucket = self._schedule.decide(step, self._comm).save
        return bucket or (self._tier is not None and self._tier.due(step))

    def reached_preemption(self, step: int) -> bool:
        """Whether SIGTERM has reached any rank by ``step`` (``save_on_preemption``; Orbax's name):
        the same on every rank, then stop the loop. Collective like ``should_save`` (reusing its
        answer for the same step).

        Args:
            step: The training step.

        Returns:
            bool: True from the step at which the ranks agreed on the preemption on.
        """
        check_step(step)
        return self._schedule.decide(step, self._comm).preempted

    def uri(self, step: int) -> str:
        """The URI a save of ``step`` writes: ``root/<name with the step>``.

        Args:
            step: The training step.

        Returns:
            str: the checkpoint's URI.
        """
        return f"{self.root}/{self.name.format(step=step)}"

    def save(self, step: int, state: Mapping[str, Any] | Stateful, *, metrics: Mapping[str, Any] | None = None,
             force: bool = False, **save_kwargs: Any) -> SaveResult | SaveHandle:
        """Save ``state`` as the checkpoint of ``step``, then apply retention once it commits.

        Collective like ``sc.save``. The manifest records ``step`` and ``metrics`` (in its
        metadata). Retention (``prune``) runs after the commit: here for a plain save, after
        the upload commits for an async one (a failure to prune is logged, never raised by
        the save: what it left is garbage ``collect_garbage`` removes).

        Args:
            step: The training step (an int >= 0).
            state: The state_dict, as ``sc.save`` takes it.
            metrics: JSON-serializable numbers and strings to record (``{"loss": 0.31}``; tensors
                with one element are turned into numbers, others refused; nan and inf are recorded as the strings
                ``'nan'``, ``'inf'``, ``'-inf'``); ``keep_best`` ranks by the numbers.
                Default None: none.
            force: Replace a committed checkpoint of ``step``, and delete the steps newer than
                ``step`` (the abandoned branch after ``restore(step=...)``, manifests first).
                Default False: refuse both, naming them.
            save_kwargs: More arguments of ``sc.save`` / ``sc.async_save`` (``compression``,
                ``metadata``, ``progress``, ``staging_budget``, ``base``: with ``incremental``, the
                newest committed checkpoint unless given); not ``overwrite`` (``force``).

        Returns:
            SaveResult | SaveHandle: ``sc.save``'s result, or ``sc.async_save``'s handle when
            the manager was made with ``async_save=True``.

        Raises:
            CheckpointExistsError: a committed checkpoint of ``step`` exists and ``force`` is False.
            CheckpointInUseError: the step's prefix holds bytes that other committed
                (incremental) checkpoints reference (writing there would break them).
            CheckpointError: a bad argument, or the errors ``sc.save`` raises.
        """
        self._check_open()
        calls = self._bound()
        own: CheckpointError | None = None
        metadata: dict[str, Any] = {}
        try:  # the caller's mistakes, agreed before any collective: one rank's must not leave the others waiting
            check_step(step)
            if "overwrite" in save_kwargs:
                raise CheckpointError("CheckpointManager.save takes force=True, not overwrite=, to replace a step")
            check_names("CheckpointManager.save", calls.async_save if self.async_save else calls.save, save_kwargs,
                        own=("storage_options", "process_group", "overwrite"))
            metadata = dict(save_kwargs.pop("metadata", None) or {})
            clash = sorted({STEP_KEY, METRICS_KEY} & set(metadata))
            if clash:
                raise CheckpointError(f"metadata keys {clash} are the manager's own (pass metrics= for metrics)")
            metadata[STEP_KEY] = step
            metadata[METRICS_KEY] = plain_metrics(metrics)
            if self._comm.rank == 0:
                warn_unranked(self.root, step, metadata[METRICS_KEY], self.policy.keep_best)
        except CheckpointError as e:
            own = e
        self._comm.agree(own)
        self._tier_agreed = self._tier_agreed or same_tier(self._comm, self._tier)
        self.wait()  # one save in flight: the previous one (and its retention) ends first
        self._leased = self._leased or on_one_rank(self._comm, self._hold_lease)
        if self._tier is not None and self._tier.due(step):  # the local tier first (staged only, when async)
            bucket = force or self.save_every is None or step % self.save_every == 0
            tree = calls.expand(state, for_load=False).tree  # modules, optimizers: their state dicts
            local = self._tier.save(self._comm, step, tree, metadata, save_kwargs.get("compression"), fallible=bucket,
                                    background=Background(self.process_group) if self.async_save else None)
            if not bucket:
                return local  # type: ignore[return-value]  # not fallible: a SaveResult or an error
        users = on_one_rank(self._comm, lambda: self._users_of(step))
        if users:
            raise in_use_error(step, self.uri(step), users)
        appeared = on_one_rank(self._comm, lambda: self._clear_the_way(step, force))
        existing = None if force else on_one_rank(self._comm, lambda: self._committed_name(step))
        if existing is not None and appeared:
            raise self._another_writer_error(step)
        if existing is not None:
            raise CheckpointExistsError(f"step {step} is already committed under {self.root} ({self.root}/{existing}): "
                                        f"pass force=True to replace it")
        if self.incremental and "base" not in save_kwargs:
            newest = on_one_rank(self._comm, lambda: self._base_name(step))
            save_kwargs["base"] = None if newest is None else f"{self.root}/{newest}"
        kwargs = dict(storage_options=self.storage_options, process_group=self.process_group,
                      metadata=metadata, overwrite=force, **save_kwargs)
        self._schedule.saved()
        if not self.async_save:
            with self._another_writer(step):
                result = calls.save(state, self.uri(step), **kwargs)
            self._retain_after_commit()
            return result
        with self._another_writer(step):
            handle = calls.async_save(state, self.uri(step), **kwargs)
        after: cf.Future[None] = cf.Future()
        self._pending, self._after = handle, after
        handle.add_done_callback(lambda h: self._on_async_end(h, after))
        finish_at_exit(handle, "mgr.wait() or mgr.close()", self.wait)  # a normal exit commits it
        if self._schedule.preempted:
            self.wait()  # the grace period is short: the loop may exit as soon as save returns
        return handle

    def wait(self) -> None:
        """Wait for the pending async save to commit and for the retention after it.

        Raises:
            CheckpointError: the save's error (``StorageError``, ``PeerError``, ...), on every rank.
        """
        handle, after = self._pending, self._after
        try:
            if handle is not None:
                handle.result()
        finally:
            self._pending = None
            if after is not None:
                after.result()
            self._after = None
            if self._tier is not None:
                self._tier.wait()  # the local save in flight beside it

    def _users_of(self, step: int) -> list[str]:
        """The other committed checkpoints that reference objects under ``step``'s prefix (a
        pruned base's shared files included), from the last listing."""
        known = self._known if self._known is not None else self._list_here()
        return known.users_of(self.name.format(step=step))

    def _base_name(self, step: int) -> str | None:
        """An incremental save's base: the newest committed checkpoint other than ``step``'s own."""
        own = self.name.format(step=step)
        found = [e.name for e in self._list_here().managed() if e.name != own]
        return found[-1] if found else None

    def _committed_name(self, step: int) -> str | None:
        """The child holding ``step``, from the last listing (listing once, on a manager's first save)."""
        known = self._known if self._known is not None else self._list_here()
        return next((e.name for e in known.managed() if e.step == step), None)

    def _on_async_end(self, handle: Any, after: cf.Future[None]) -> None:
        """From the upload thread: prune on this manager's own thread once the save committed."""
        try:
            handle.result(timeout=0)
        except BaseException:  # noqa: BLE001 - its owner sees the error through wait()/result()
            after.set_result(None)
            return
        if self._comm.rank != 0:  # retention is one rank's work; no collective off the training thread
            after.set_result(None)
            return
        with self._lock:
            if self._worker is None:
                self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="streamckpt-retention")
            worker = self._worker

        def job() -> None:
            try:
                self._prune_here(dry_run=False)
            except Exception as e:  # noqa: BLE001 - logged: the save itself committed
                log.warning("retention after the save of %s failed: %s", handle.uri, e)
            finally:
                after.set_result(None)

        worker.submit(job)

    def _retain_after_commit(self) -> None:
        if self.policy.keeps_all:
            self._listing()  # learn the new step (one LIST and one GET on the listing rank)
            return
        try:
            self.prune()
        except CheckpointError as e:
            log.warning("retention after a save under %s failed: %s", self.root, e)

    # ------------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """The committed steps under the root, ascending (read from the manifests).

        Returns:
            list[int]: the steps.

        Raises:
            StorageError: storage kept failing after retries.
        """
        return self._listing().steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the root holds none.

        Returns:
            int | None: the step.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded with ``step`` (``save(metrics=...)``).

        Args:
            step: A committed step.

        Returns:
            dict: metric name to value (empty when none were given).

        Raises:
            CheckpointNotFoundError: no committed checkpoint of that step.
        """
        return dict(self._entry(self._listing(), step).metrics)

    def checkpoints(self) -> list[Entry]:
        """Every committed checkpoint under the root (the manager's, others, unreadable ones),
        by name: what ``streamckpt ls`` shows.

        Returns:
            list: one entry each (``name``, ``step``, ``committed_ns``, ``metrics``, ``size``, ``error``).
        """
        return list(self._listing().entries)

    # ------------------------------------------------------------------ restoring

    @overload
    def restore(self, state_dict: None = None, *, step: int | None = None, max_fallbacks: int = 3,
                **load_kwargs: Any) -> Restored[Any] | None: ...

    @overload
    def restore(self, state_dict: S, *, step: int | None = None, max_fallbacks: int = 3,
                **load_kwargs: Any) -> Restored[S] | None: ...

    def restore(self, state_dict: Any = None, *, step: int | None = None, max_fallbacks: int = 3,
                **load_kwargs: Any) -> Restored[Any] | None:
        """Restore the newest committed step (or ``step``), falling back past a broken newest.

        With ``state_dict``, ``sc.load`` fills it in place (resharded to this job's layout, any
        world size; collective); without, ``sc.load_state`` rebuilds the saved tree on every
        rank. A checkpoint that cannot be read (a manifest that does not parse, a data object
        missing, a checksum failing again after the retry) is logged as a WARNING, recorded in
        ``skipped`` and the next newest is tried, up to ``max_fallbacks`` of them. The caller's
        own mistakes (shape or dtype mismatch, missing keys, a bad transform) raise at once.
        A pending async save is waited for first.

        Args:
            state_dict: The targets to fill in place, as ``sc.load`` takes them. Default None:
                return the saved tree (``sc.load_state``).
            step: Restore exactly this step, with no fallback. Default None: the newest.
            max_fallbacks: How many unreadable checkpoints may be passed over (default 3).
            load_kwargs: More arguments of ``sc.load`` (``transforms``, ``strict``, ...) or
                ``sc.load_state`` (``device``, ``keys``, ...).

        Returns:
            Restored | None: the step, URI, state and what was skipped; None when the root
            holds no committed checkpoint with a step (checkpoints written by ``sc.save``
            without the manager carry none: ``sc.latest`` finds those).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (or cannot be read).
            CorruptCheckpointError: ``step``'s checkpoint cannot be read, or more than
                ``max_fallbacks`` checkpoints could not (naming each and why).
            IncompatibleStateDictError, MissingKeysError, TransformError: the caller's own
                mistakes, at once.
            StorageError, PeerError: as ``sc.load`` raises them.
        """
        self._check_open()
        calls = self._bound()
        own: CheckpointError | None = None
        try:  # the caller's mistakes, agreed before any collective (see save)
            if not isinstance(max_fallbacks, int) or isinstance(max_fallbacks, bool) or max_fallbacks < 0:
                raise CheckpointError(f"max_fallbacks must be an int >= 0, got {max_fallbacks!r}")
            if step is not None:
                check_step(step)
            if state_dict is not None:
                check_names("CheckpointManager.restore", calls.load, load_kwargs,
                            own=("storage_options", "process_group"))
            else:
                check_names("CheckpointManager.restore", calls.load_state, load_kwargs, own=("storage_options",))
        except CheckpointError as e:
            own = e
        self._comm.agree(own)
        self._tier_agreed = self._tier_agreed or same_tier(self._comm, self._tier)
        self.wait()
        if self._tier is not None and state_dict is not None:  # the memory/peer tier first; None: the bucket's turn
            expanded = calls.expand(state_dict, for_load=True)  # objects in place: their state dicts, then theirs
            soon = started_on_one_rank(self._comm, self._list_here)  # rank 0 lists beside the tier's reports
            tier = self._tier.restore(self._comm, expanded.tree, bucket_uri=self.uri,
                                      bucket_steps=lambda: self._listing(soon).steps(),
                                      storage_options=self.storage_options, load_kwargs=load_kwargs, step=step)
            if tier is not None:
                expanded.finish()
                return Restored(tier.step, tier.uri, state_dict, tier.skipped, "local", tier.bytes_local,
                                tier.bytes_peers, tier.bytes_bucket, tier.bucket_bytes_read)
        listing = self._listing()
        if step is not None:
            self._rolled_back = step
            entry = self._entry(listing, step)
            return self._restore_one(entry, state_dict, load_kwargs, [], fallback=False)
        tried = candidates(listing)
        if not tried:
            return None
        skipped: list[tuple[str, str]] = []
        for entry in tried:
            if len(skipped) > max_fallbacks:
                break
            if entry.error is not None:
                self._skip(skipped, entry, entry.error)
                continue
            restored = self._restore_one(entry, state_dict, load_kwargs, skipped, fallback=True)
            if restored is not None:
                return restored
        raise CorruptCheckpointError(
            f"no checkpoint under {self.root} could be restored: passed over {len(skipped)} "
            f"({'; '.join(f'{u}: {why}' for u, why in skipped)})"
            + (f", more than max_fallbacks={max_fallbacks}" if len(skipped) > max_fallbacks else ""))

    def _restore_one(self, entry: Entry, state_dict: Any, load_kwargs: dict[str, Any],
                     skipped: list[tuple[str, str]], *, fallback: bool) -> Restored[Any] | None:
        got = restore_one(self._comm, self._bound(), f"{self.root}/{entry.name}", entry.step,  # type: ignore[arg-type]
                          state_dict, load_kwargs, storage_options=self.storage_options,
                          process_group=self.process_group, skipped=skipped, fallback=fallback)
        if isinstance(got, str):
            self._skip(skipped, entry, got)
            return None
        return got

    def _skip(self, skipped: list[tuple[str, str]], entry: Entry, why: str) -> None:
        self._unreadable.add(entry.name)  # the next save of its step replaces it
        uri = f"{self.root}/{entry.name}"
        log.warning("restore: passing over %s, which cannot be read: %s", uri, why)
        skipped.append((uri, why))

    # ------------------------------------------------------------------ deleting

    def prune(self, *, dry_run: bool = False) -> list[str]:
        """Delete the committed checkpoints no retention rule keeps (``save`` calls it after
        each commit). Each goes manifest first, then its data, so a prune cut short leaves
        every kept checkpoint whole and the rest as garbage.

        Args:
            dry_run: Only say what would be deleted. Default False.

        Returns:
            list[str]: the URIs of the checkpoints deleted (or that would be), oldest first.

        Raises:
            StorageError: a delete kept failing (what was left is garbage for ``collect_garbage``).
        """
        self._check_open()
        return on_one_rank(self._comm, lambda: self._prune_here(dry_run=dry_run))

    def _prune_here(self, *, dry_run: bool) -> list[str]:
        with self._lock:
            listing = self._list_here()
            doomed = self.policy.to_prune(listing.managed())
            uris = [f"{self.root}/{e.name}" for e in doomed]
            if dry_run or not doomed:
                return uris
            self._delete_entries(listing, doomed)
            log.info("pruned %d checkpoint(s) under %s: %s", len(doomed), self.root, ", ".join(e.name for e in doomed))
            self._compact()
            return uris

    def _compact(self) -> None:
        """After deletions (``manage.compaction``; a failure is logged, everything stays loadable)."""
        if compact_after_prune(self._store(), self._list_here(), self.root):
            self._list_here()  # the rewritten manifests name other files now

    def _delete_entries(self, listing: Listing, doomed: list[Entry]) -> None:
        """Delete checkpoints (each manifest first), keeping what the others still reference."""
        for e in doomed:
            self._index.forget(e.name)
        self._known = delete_entries(self._store(), listing, doomed)

    def _clear_the_way(self, step: int, force: bool) -> bool:
        """Rank 0, before a save of ``step``: ``history.clear_the_way``'s deletions. Returns
        whether the step was committed since this manager last looked (by another writer)."""
        with self._lock:
            name = self.uri(step).rpartition("/")[2]
            before = None if self._known is None else {e.name for e in self._known.managed()}
            listing = self._list_here()
            way = clear_the_way(listing, root=self.root, name=name, step=step, force=force, before=before,
                                unreadable=self._unreadable, rolled_back=self._rolled_back)
            self._unreadable.discard(name)
            if way.doomed:
                self._delete_entries(listing, way.doomed)
            return way.appeared

    def collect_garbage(self, *, older_than: float = 3600, dry_run: bool = False) -> list[str]:
        """Remove what no committed checkpoint under the root references and that is older
        than ``older_than`` seconds: the data objects of saves that died before their commit
        (or checkpoints half-deleted), and incomplete multipart uploads (S3; see
        docs/RELIABILITY.md for what each store lets us see). A save in progress younger than
        ``older_than`` is never touched; the objects of a checkpoint whose manifest cannot be
        read are left alone. Garbage changed less than 10 minutes ago is named in a WARNING
        (a save in progress elsewhere, which a grace that short destroys: it then fails its
        commit check instead of committing).

        Args:
            older_than: The grace period in seconds (default 3600): longer than any save takes.
            dry_run: Only say what would be removed. Default False.

        Returns:
            list[str]: each object's URI with its size (``".../data/00000-0000.safetensors (8.0 MiB)"``),
            or an upload's URI marked as such, in name order.

        Raises:
            StorageError: listing or deleting kept failing after retries.
        """
        self._check_open()
        if not isinstance(older_than, (int, float)) or isinstance(older_than, bool) or older_than < 0:
            raise CheckpointError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        return on_one_rank(self._comm, lambda: self._collect_here(float(older_than), dry_run))

    def _collect_here(self, older_than: float, dry_run: bool) -> list[str]:
        with self._lock:
            protected = set()
            if self._pending is not None and not self._pending.done():  # this manager's own save in flight
                protected.add(self._pending.uri.rstrip("/").rpartition("/")[2])
            found = collect(self._store(), self._list_here(), root=self.root, protected=protected, now=time.time(),
                            older_than=older_than, dry_run=dry_run)
            return found + writer.collect(self._store(), self.root, self._lease, dry_run)

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _another_writer(self, step: int) -> Iterator[None]:
        """A step committed after this manager looked (another manager or process on the root):
        the manager's words (force=True), not sc.save's (overwrite=True, which it refuses)."""
        try:
            yield
        except CheckpointExistsError as e:
            raise self._another_writer_error(step) from e

    def _another_writer_error(self, step: int) -> CheckpointExistsError:
        return another_writer_error(self.root, self.uri(step), step)

    def _hold_lease(self) -> bool:
        """Rank 0: the run's writer lease (``manage.writer``), taken by the first save."""
        if self._lease is None and self.writer_lease is not None:
            self._lease = writer.hold(self, self.root, self.storage_options, self.writer_lease)
        return True

    def _bound(self) -> Calls:
        if self._calls is None:
            raise CheckpointError("use streamckpt.CheckpointManager (this base class has no save/load calls bound)")
        return self._calls

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.root} is closed")

    def _store(self) -> Storage:
        if self._storage is None:
            self._storage = Storage(self.root, self.storage_options)
        return self._storage

    def _list_here(self) -> Listing:
        with self._lock:
            self._known = listing = self._index.list(self._store())
            return listing

    def _listing(self, here: Callable[[], Listing] | None = None) -> Listing:
        """The root now, the same on every rank (listed on rank 0, by ``here`` if given; broadcast)."""
        here = here or self._list_here
        if self._comm.world_size == 1:
            return here()
        data = on_one_rank(self._comm, lambda: here().to_json().decode())
        self._known = listing = Listing.from_json(data.encode()) if self._comm.rank != 0 else self._known
        return listing  # type: ignore[return-value]

    def _entry(self, listing: Listing, step: int) -> Entry:
        found = {e.step: e for e in listing.managed()}
        if step in found:
            return found[step]
        raise CheckpointNotFoundError(f"no committed checkpoint of step {step} under {self.root} "
                                      f"(committed steps: {', '.join(map(str, list(found)[-10:])) or 'none'})")


__all__ = ["Calls", "Manager", "Restored"]
