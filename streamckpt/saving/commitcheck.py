"""The last check before a commit: every object the manifest lists is there, at its size.

A save's data files can vanish between their upload and the manifest: a ``collect_garbage``
or ``prune`` run elsewhere with a grace shorter than the save, a lifecycle rule, a person.
Committing then would publish a checkpoint that cannot be loaded. Rank 0 lists the save's own
``data/`` prefix once (sizes included) and asks for each referenced base file once (a HEAD):
a missing or short object fails the save on every rank, and nothing is committed.
"""

from __future__ import annotations

import logging

from ..core import manifest as mf
from ..errors import CheckpointError
from ..storage import Storage

log = logging.getLogger(__name__)


def check_present(storage: Storage, manifest: mf.Manifest) -> None:
    """Raise ``CheckpointError`` naming what is missing, unless every listed file is there.

    Costs one LIST of each prefix the checkpoint's own files lie under (``data/``) and one HEAD
    per file in a sibling checkpoint (an incremental save's references)."""
    own = {name: size for name, size in manifest.files.items() if mf.split_reference(name) is None}
    refs = sorted(name for name in manifest.files if mf.split_reference(name) is not None)
    found: dict[str, int] = {}
    for prefix in sorted({name.rpartition("/")[0] for name in own}):
        found.update((n, info.size) for n, info in storage.list_info(prefix).items())
    bad = [f"{name} ({'missing' if name not in found else f'{found[name]} bytes, expected {size}'})"
           for name, size in sorted(own.items()) if found.get(name) != size]
    bad += [f"{name} (missing)" for name in refs if storage.modified(name) is None]
    if bad:
        raise CheckpointError(
            f"not committing {storage.describe('')}: objects it lists changed after their upload: "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Something deleted them while the save ran "
            f"(collect_garbage / streamckpt gc or prune with an older_than shorter than a save, a lifecycle rule); "
            f"nothing was committed: save again, and give garbage collection a grace longer than any save")
