"""Turning a URI into a ``Manifest``, whatever wrote the checkpoint.

Detection order: streamckpt (``manifest.json``), Hugging Face safetensors,
PyTorch DCP (``.metadata``). Readers only read metadata, never tensor data.
"""

from __future__ import annotations

import logging

from ..core.manifest import Manifest
from ..errors import CheckpointNotFoundError
from ..storage import Storage
from .dcp import read_dcp_manifest
from .hf import read_hf_manifest
from .native import read_native_manifest

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
    raise CheckpointNotFoundError(
        f"no checkpoint at {storage.describe('')}: expected manifest.json (streamckpt), "
        f"*.safetensors (Hugging Face) or .metadata (PyTorch DCP){storage.absent_hint()}"
    )
