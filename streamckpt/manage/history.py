"""A run's history as a save and a restore see it: which steps a save must first delete,
which checkpoints a restore tries, and in what order.

Pure decisions over a ``Listing``; the manager deletes and loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection

from ..errors import CheckpointError, CheckpointExistsError, CheckpointInUseError
from .index import Entry, Listing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Way:
    """What a save of one step finds: checkpoints to delete first, and whether the step was
    committed since the manager last looked (by another writer)."""

    doomed: list[Entry]
    appeared: bool


def clear_the_way(listing: Listing, *, root: str, name: str, step: int, force: bool, before: Collection[str] | None,
                  unreadable: Collection[str], rolled_back: int | None) -> Way:
    """Before a save of ``step`` (child ``name``): a checkpoint of that step that a restore
    passed over as unreadable is replaced; a step older than the newest committed one is
    refused, or with ``force`` the newer steps (the abandoned branch after a rollback) are
    deleted. ``before``: the managed names the manager last saw (None: it never looked)."""
    appeared = before is not None and name not in before and any(e.name == name for e in listing.managed())
    doomed = [e for e in listing.entries if e.name == name and name in unreadable]
    if doomed:
        log.warning("%s/%s could not be read when this manager restored (it was passed over): replaced by "
                    "this save of step %d (its manifest deleted first)", root, name, step)
    newer = [e for e in listing.managed() if e.step is not None and e.step > step]
    if newer and not force:
        steps = ", ".join(str(e.step) for e in newer)
        if rolled_back is not None:
            raise CheckpointExistsError(
                f"this manager restored step {rolled_back} of {root}, and steps {steps} are newer: "
                f"the run's abandoned branch. Pass force=True to save() to delete them (each manifest first, "
                f"so latest never returns them) and go on from step {rolled_back}")
        raise CheckpointError(
            f"step {step} is older than the newest committed step {newer[-1].step} under {root}: "
            f"retention would prune it at once and restore would never return it. Save a step after "
            f"{newer[-1].step}; or to go back, restore(step=k) and save with force=True, which deletes "
            f"the newer steps ({steps})")
    if newer:
        log.warning("save of step %d with force=True under %s: deleting the newer steps %s (the abandoned "
                    "branch), each manifest first", step, root, ", ".join(str(e.step) for e in newer))
    return Way(doomed + newer, appeared)


def candidates(listing: Listing) -> list[Entry]:
    """What restore tries, newest first: the managed steps, with the unreadable checkpoints
    whose manifests are not older than the newest readable one's ahead of them (compared by
    the store's times, the only ones an unreadable manifest has)."""
    managed = listing.managed()[::-1]
    newest = managed[0].modified_ns if managed else -1
    broken = sorted((e for e in listing.entries if e.error is not None and e.modified_ns >= newest),
                    key=lambda e: e.modified_ns, reverse=True)
    return broken + managed


def in_use_error(step: int, uri: str, users: list[str]) -> CheckpointInUseError:
    """A save into a step whose prefix holds bytes other committed checkpoints reference."""
    return CheckpointInUseError(
        f"step {step} ({uri}) holds bytes that incremental checkpoints {', '.join(users[:5])} reference: replacing "
        f"it would break them; delete those first (or sc.copy them out), or save under another step")


def another_writer_error(root: str, uri: str, step: int) -> CheckpointExistsError:
    """A step committed after the manager looked: the manager's words (force=True), not sc.save's."""
    return CheckpointExistsError(
        f"step {step} is already committed under {root} ({uri}), by another writer since this manager looked "
        f"(a second CheckpointManager or process on this root?): pass force=True to replace it, or give each run a "
        f"root of its own")
