"""Turning a URI into a ``Manifest``, whatever wrote the checkpoint.

Detection order: streamckpt (``manifest.json``), Hugging Face safetensors,
PyTorch DCP (``.metadata``). Readers only read metadata, never tensor data.
"""

from __future__ import annotations

import logging

from ..core.manifest import Manifest
from ..errors import CLI, PYTHON, CheckpointError, CheckpointNotFoundError, Hint
from ..results import plural
from ..storage import Storage
from .dcp import read_dcp_manifest
from .hf import read_hf_manifest
from .native import committed_children, natural_key, newest_of, read_native_manifest

log = logging.getLogger(__name__)


def read_manifest(storage: Storage, *, speculative: bool = False) -> Manifest:
    """The checkpoint at ``storage``'s prefix, as a validated Manifest (``speculative``:
    see ``read_foreign_manifest``)."""
    if storage.entry is not None:  # the URI named one Hugging Face file or index
        m = read_hf_manifest(storage, entry=storage.entry)
        if m is None:
            raise CheckpointNotFoundError(f"no such object: {storage.describe(storage.entry)}")
        return m
    m = read_native_manifest(storage)
    return m if m is not None else read_foreign_manifest(storage, speculative=speculative)


def read_foreign_manifest(storage: Storage, *, speculative: bool = False) -> Manifest:
    """A checkpoint that has no ``manifest.json`` (already looked for), from its Hugging Face
    or DCP metadata. ``speculative``: a DCP manifest may hold predicted byte offsets that
    the load must verify (``streamckpt.formats.speculation``); only ``loader.run_load`` asks."""
    m = read_hf_manifest(storage)
    if m is None:
        m = read_dcp_manifest(storage, speculative=speculative)
    if m is not None:
        return m
    run = _run_prefix(storage)
    if run is not None:
        raise run
    raise CheckpointNotFoundError(
        f"no checkpoint at {storage.describe('')}: expected manifest.json (streamckpt), "
        f"*.safetensors (Hugging Face) or .metadata (PyTorch DCP){storage.absent_hint()}"
    )


SHOWN_CHILDREN = 5  # names listed in the message about a run prefix


def _run_prefix(storage: Storage) -> CheckpointNotFoundError | None:
    """The error for a prefix that holds committed checkpoints but is none itself (a run's
    root, ``s3://bucket/run`` with ``step-3/``, ``step-6/``): it names them and the newest,
    and how to find the newest (``sc.latest`` / ``streamckpt latest``). None for any other prefix."""
    try:
        found = committed_children(storage)
        newest = newest_of(storage, found)
    except CheckpointError as e:  # the plain "no checkpoint" message says enough
        log.debug("looking for checkpoints under %s: %s", storage.describe(""), e)
        return None
    if newest is None:
        return None
    root = storage.describe("").rstrip("/")
    names = sorted((child for _, child in found), key=natural_key)
    shown = ", ".join(names[:SHOWN_CHILDREN]) + (", ..." if len(names) > SHOWN_CHILDREN else "")
    return CheckpointNotFoundError(
        f"no checkpoint at {root}/: it is a run prefix holding {plural(len(names), 'checkpoint')} ({shown}; "
        f"newest: {root}/{newest})",
        hint=Hint("give the URI of one of them (", {PYTHON: f"sc.latest({root!r}) returns the newest",
                                                     CLI: f"'streamckpt latest {root}' prints the newest"}, ")"))
