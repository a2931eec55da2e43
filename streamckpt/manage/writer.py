"""The manager's side of the writer lease (``manage.lease``): taking it for a manager, letting
it go however the manager ends, and collecting the lease a gone writer left.

A manager closed lets go in ``close()``. One dropped without ``close()`` lets go on a thread of
its own: a finalizer runs on whatever thread collects the manager, the storage's event loop
included, where the release's I/O would deadlock. At interpreter exit the saves in flight end
first (committed, or cancelled on an exception), then the lease goes.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

from ..saving.asyncsave import at_shutdown, settle_at_exit
from ..storage import Storage
from .lease import LEASE_NAME, Lease, abandoned

log = logging.getLogger(__name__)


def hold(owner: Any, root: str, storage_options: dict[str, Any] | None, ttl: float) -> Lease:
    """Take ``root``'s lease for ``owner`` (a manager) and arrange its release (module docstring)."""
    lease = Lease(Storage(root, storage_options), ttl=ttl)
    lease.acquire()
    weakref.finalize(owner, _release_later, lease).atexit = False
    at_shutdown(functools.partial(_release_at_exit, lease))
    return lease


def collect(storage: Storage, root: str, own: Lease | None, dry_run: bool) -> list[str]:
    """The writer lease a gone writer left (a job killed, or ended without close()), for
    ``collect_garbage``; never ``own`` nor one whose writer may be alive."""
    gone = abandoned(storage)
    if gone is None or (own is not None and gone[0].id == own.me.id):
        return []
    holder, why = gone
    if not dry_run:
        storage.delete(LEASE_NAME)
        log.info("removed the writer lease of pid %d on %s under %s: %s", holder.pid, holder.host, root, why)
    return [f"{root}/{LEASE_NAME} (the writer lease of pid {holder.pid} on {holder.host}: {why})"]


def _release_later(lease: Lease) -> None:
    threading.Thread(target=lease.release, name="streamckpt-lease-release", daemon=True).start()


def _release_at_exit(lease: Lease) -> None:
    settle_at_exit()
    lease.release()  # a no-op once released
