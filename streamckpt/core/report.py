"""The progress contract of every call that moves bytes (``progress=`` of the public calls).

A progress callable is called with the bytes done since its previous call (always
positive, so the running sum only grows); one that has an ``add_total(nbytes)`` method
is told first how many bytes to expect (``expect_total``). ``streamckpt.progress`` draws
such a callable on a terminal or a log; the layers below only call it.
"""

from __future__ import annotations

from typing import Callable


def expect_total(progress: Callable[[int], None] | None, nbytes: int) -> None:
    """Tell a progress callable that shows a total (one with ``add_total``) that ``nbytes``
    more will be reported; a plain callable is not asked."""
    add_total = getattr(progress, "add_total", None)
    if add_total is not None:
        add_total(nbytes)
