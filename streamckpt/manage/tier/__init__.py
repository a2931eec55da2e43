"""The memory/peer tier of a run's checkpoints (DESIGN.md §4c): frequent local saves into each
rank's node-local folder, copied to partner ranks on other nodes, and restores that read each
byte from the nearest rank that holds it, the bucket only for bytes no surviving rank holds.

* ``partners``      — which ranks keep copies of whose files (other nodes only);
* ``localmanifest`` — the step's commit: a manifest naming the run's root, step and keepers;
* ``localdir``      — the folder: step folders, what committed, retention and cleanup;
* ``verify``        — a local copy is trusted only after its CRC32Cs and digests pass;
* ``localsave``     — writing, replicating, checking and committing a local step;
* ``holdings``      — what the survivors hold and which step a restore takes;
* ``sources``       — per file, this rank's folder or the bucket;
* ``restore``       — one plan over all of it (``loading`` with the plan's holder constraint).

``Tier`` is what ``CheckpointManager`` holds when given ``local_dir``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...comm import GroupComm, SoloComm
from ...errors import CheckpointError, IncompatibleStateDictError, MissingKeysError, StorageError
from ...loading.loader import local_world_size
from ...results import SaveResult
from ...saving.asyncsave import SaveHandle, finish_at_exit
from .localdir import LocalDir
from .localsave import Background, save_local
from .partners import Topology, topology
from .restore import LOAD_OPTIONS, FromTier, restore_from_tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tier:
    """A manager's local tier: where (``local_dir``), how often (``every`` steps; None: every
    step the manager saves), how many steps each rank keeps (``keep``), how many partner
    copies (``replicas``)."""

    folder: LocalDir
    every: int | None
    keep: int
    replicas: int
    _topology: Topology | None = None
    _pending: tuple[SaveHandle, int, bool] | None = None  # a background local save: (handle, step, fallible)

    @classmethod
    def make(cls, local_dir: Any, root: str, local_every: Any, local_keep: Any, replicas: Any) -> "Tier":
        """Check the manager's tier arguments.

        Raises:
            CheckpointError: a bad argument.
        """
        if not isinstance(local_dir, (str, bytes)) and not hasattr(local_dir, "__fspath__"):
            raise CheckpointError(f"local_dir must be a local folder path, got {local_dir!r}")
        path = str(local_dir.__fspath__() if hasattr(local_dir, "__fspath__") else local_dir)
        if "://" in path and not path.startswith("file://"):
            raise CheckpointError(f"local_dir must be a node-local folder, not {path!r} (the bucket is the root)")
        path = path[len("file://"):] if path.startswith("file://") else path
        for name, value, low, none_ok in (("local_every", local_every, 1, True), ("local_keep", local_keep, 1, False),
                                          ("replicas", replicas, 0, False)):
            if value is None and none_ok:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise CheckpointError(f"{name} must be an int >= {low}{' or None' if none_ok else ''}, got {value!r}")
        return cls(LocalDir(path, root), local_every, local_keep, replicas)

    def due(self, step: int) -> bool:
        return self.every is None or step % self.every == 0

    def topology(self, comm: SoloComm | GroupComm) -> Topology:
        """The job's nodes (``LOCAL_WORLD_SIZE``, agreed by every rank; once, collective)."""
        if self._topology is None:
            per = local_world_size(comm.rank)
            top, neg = comm.max_ints([per, -per])
            agreed = top if top > 0 and top == -neg and comm.world_size % top == 0 else 0
            self._topology = topology(comm.world_size, agreed)
            if comm.rank == 0 and comm.world_size > 1 and self.replicas > self._topology.usable_replicas(self.replicas):
                log.warning(
                    "local tier: %s; replicas=%d asked for, %d kept: a local step survives a restart of the "
                    "processes on the same nodes, and the bucket (save_every) is what survives losing a node",
                    "one node (or no LOCAL_WORLD_SIZE that every rank agrees on): no partner on another node"
                    if self._topology.nodes == 1 else f"{self._topology.nodes} nodes",
                    self.replicas, self._topology.usable_replicas(self.replicas))
        return self._topology

    def save(self, comm: SoloComm | GroupComm, step: int, state: Mapping[str, Any], metadata: dict[str, Any],
             compression: str | None, fallible: bool = False,
             background: Background | None = None) -> SaveResult | SaveHandle | None:
        """The local save of ``step`` (collective). ``fallible``: the step also goes to the bucket,
        which must not be kept from it by a local failure (agreed on every rank): logged, None.
        ``background``: stage and return a ``SaveHandle`` (``save_local``); ``wait`` ends it."""
        self.wait()
        try:
            got = save_local(comm, self.folder, state, step=step, metadata=metadata, compression=compression,
                             topology=self.topology(comm), replicas=self.replicas, keep=self.keep,
                             background=background)
        except (IncompatibleStateDictError, MissingKeysError):
            raise  # the caller's state: the bucket save would refuse it too
        except CheckpointError as e:
            self._failed(step, e, fallible)
            return None
        if isinstance(got, SaveHandle):
            self._pending = (got, step, fallible)
            finish_at_exit(got, "mgr.wait() or mgr.close()", self.wait)  # a normal exit commits it
        return got

    def wait(self) -> None:
        """Wait for the local save in flight (if any) to commit.

        Raises:
            CheckpointError: its error, on every rank, when that step had no bucket save.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            handle, step, fallible = pending
            try:
                handle.result()
            except CheckpointError as e:
                self._failed(step, e, fallible)

    def _failed(self, step: int, error: CheckpointError, fallible: bool) -> None:
        if not fallible:
            raise error
        log.warning("local tier: the local save of step %d failed (%s: %s); the step still goes to the bucket", step,
                    type(error).__name__, error)

    def restore(self, comm: SoloComm | GroupComm, state_dict: Any, *, bucket_steps: Callable[[], list[int]],
                bucket_uri: Callable[[int], str], storage_options: dict[str, Any] | None,
                load_kwargs: Mapping[str, Any], step: int | None) -> FromTier | None:
        """Restore from the tier, or None: the bucket's turn (its newest step is newer, or the
        load takes options a tier load does not: ``transforms``, ``progress``). ``bucket_steps()``
        lists the bucket (collective, agreed; called once the ranks' reports are in, so a listing
        started before runs beside them): a bucket that cannot be listed leaves the tier alone to
        choose."""
        other = sorted(set(load_kwargs) - set(LOAD_OPTIONS))
        if comm.max_ints([1 if other else 0])[0]:  # agreed: progress=True on rank 0 alone must not split the ranks
            log.info("local tier: not used for a restore with %s (restoring from the bucket)",
                     ", ".join(other) or "options another rank passed")
            return None
        def steps() -> list[int]:
            try:
                return bucket_steps()
            except StorageError as e:  # agreed on every rank (one rank lists)
                log.warning("local tier: the bucket cannot be listed (%s); choosing among the local steps alone", e)
                return []

        try:
            return restore_from_tier(comm, self.folder, state_dict, bucket_steps=steps, bucket_uri=bucket_uri,
                                     storage_options=storage_options, load_kwargs=load_kwargs, step=step)
        except (IncompatibleStateDictError, MissingKeysError):
            raise  # the caller's own mistake: the bucket would say the same
        except CheckpointError as e:  # agreed on every rank: every rank turns to the bucket
            log.warning("local tier: the restore failed (%s: %s); restoring from the bucket", type(e).__name__, e)
            return None


def same_tier(comm: SoloComm | GroupComm, tier: Tier | None) -> bool:
    """Every rank has the same tier settings (one rank without ``local_dir`` would make other
    collective calls than the rest): one small all-reduce, before a manager's first collective
    of the tier (its settings never change: once per manager). True once they agree.

    Raises:
        CheckpointError: on every rank, when the ranks differ.
    """
    if isinstance(comm, SoloComm):
        return True
    mine = [0, 0, 0, 0] if tier is None else [1, tier.every or 0, tier.keep, tier.replicas]
    top = comm.max_ints(mine + [-v for v in mine])
    if top[:4] != [-v for v in top[4:]]:
        here = "no local_dir" if tier is None else \
            f"local_every={tier.every}, local_keep={tier.keep}, replicas={tier.replicas}"
        raise CheckpointError(
            f"CheckpointManager's local tier differs between ranks (rank {comm.rank}: {here}): every rank must "
            f"pass local_dir (each its node's folder), local_every, local_keep and replicas alike")
    return True


__all__ = ["Background", "FromTier", "Tier", "same_tier"]
