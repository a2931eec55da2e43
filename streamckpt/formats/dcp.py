"""PyTorch DCP checkpoints (``.metadata`` + ``*.distcp``) read in place, as a ``Manifest``.

``.metadata`` is parsed without running pickle code (``dcpmeta``). Each tensor chunk
is one ``torch.save`` record at a byte range of a ``.distcp`` file; its tensor's raw
bytes are located with a few small range reads of the record's ZIP directory and
headers (``dcpitem``), so any slice of a chunk is a range read.
``read_dcp_manifest(speculative=True)`` (what ``sc.load`` asks for) locates one
item this way and predicts the others' offsets (``dcpguess``); such a manifest
says so in ``metadata[SPECULATION_KEY]``, and the load verifies every predicted
item head it relies on, read with the tensor bytes, before returning, or
locates every item exactly and loads again (``formats.speculation``).
Non-tensor entries (``torch.save`` of Python objects: optimizer ``param_groups``
leaves, step counters, scheduler state) are read whole, unpickled with builtins
only, and kept when made of dicts, lists, tuples and scalars
(``core.values.unrestorable``); the rest are reported as unloadable, with a reason.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..core import tree as trees
from ..core.manifest import Manifest, TensorMeta, validate
from ..core.values import RESTORABLE, unrestorable
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage import Storage
from .dcpguess import guess_tensors
from .dcpitem import MAX_VALUE_ITEM_BYTES, RangeCache, TensorRef, _locating_windows, located_shard, read_value
from .dcpmeta import DcpMetadata, DcpTensor, parse_metadata

log = logging.getLogger(__name__)

KIND = "dcp"
METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 512 << 20
SPECULATION_KEY = "dcp_predicted_layout"  # manifest metadata: the template a load verifies against


def json_safe(value: Any) -> bool:
    """True for values that survive a JSON round trip unchanged."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value and _plain(value)
    except (TypeError, ValueError, RecursionError):
        return False


def _plain(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    return False


# ----------------------------------------------------------------- the reader


def read_dcp_manifest(storage: Storage, *, speculative: bool = False) -> Manifest | None:
    """The Manifest of a DCP checkpoint at ``storage``'s prefix, or None when the
    prefix has no ``.metadata``.

    ``speculative``: locate one item exactly and predict where the others' tensor
    bytes start (``dcpguess``); the manifest then says so in its metadata and a load
    must verify every predicted item it reads (``streamckpt.formats.speculation``)."""
    where = storage.describe(METADATA_NAME)
    try:  # one GET (its size is checked before the body is read), no HEAD first
        raw = storage.read_bytes(METADATA_NAME, max_bytes=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        return None
    md = parse_metadata(raw, where=where)
    items = [c[2] for t in md.tensors.values() for c in t.chunks] + list(md.values.values())
    files: dict[str, int] = {}

    def sizes() -> None:  # while the locating reads are in flight
        files.update({name: storage.size(name) for name in sorted({i.file for i in items})})
        for item in items:
            if item.offset + item.length > files[item.file]:
                raise CorruptCheckpointError(
                    f"{storage.describe(item.file)}: item [{item.offset}, {item.offset + item.length}) runs past "
                    f"the end of the {files[item.file]}-byte file"
                )

    cache = RangeCache(storage)
    parsed: dict[bytes, TensorRef] = {}
    metadata: dict[str, Any] = {"dcp_version": md.version}
    guessed = None
    if speculative:
        guessed = guess_tensors(cache, storage, md, parsed, meanwhile=sizes)
    if guessed is None:
        cache.prefetch(_locating_windows(md), meanwhile=None if files else sizes)
        tensors = {fqn: _tensor_meta(cache, storage, fqn, t, parsed) for fqn, t in md.tensors.items()}
    else:
        tensors, metadata[SPECULATION_KEY] = guessed
    values, unloadable = restorable_values(cache, storage, md)
    if unloadable:
        metadata["unloadable_keys"] = sorted(unloadable)
        metadata["unloadable_reasons"] = unloadable
    log.debug("DCP manifest: %d tensors, %d values; locating cost %d requests, %d bytes",
              len(tensors), len(values), cache.requests, cache.bytes_read)
    tree = trees.from_paths(md.paths, tensors, values) if md.paths else None
    manifest = Manifest(tensors=tensors, files=files, values=values, metadata=metadata, kind=KIND, tree=tree)
    validate(manifest, where=where)
    return manifest



def _tensor_meta(cache: RangeCache, storage: Storage, fqn: str, t: DcpTensor,
                 parsed: dict[bytes, TensorRef]) -> TensorMeta:
    shards = [located_shard(cache, storage, fqn, t, offs, sizes, item, parsed)[0] for offs, sizes, item in t.chunks]
    return TensorMeta(dtype=t.dtype, shape=t.shape, shards=tuple(shards))




def restorable_values(cache: RangeCache, storage: Storage, md: DcpMetadata) -> tuple[dict[str, Any], dict[str, str]]:
    """The non-tensor items restorable as plain data (read whole, builtins only), and why
    the others are not."""
    values: dict[str, Any] = {}
    unloadable: dict[str, str] = {}
    for fqn, item in md.values.items():
        where = f"{storage.describe(item.file)} [{item.offset}, {item.offset + item.length}) ({fqn!r})"
        if item.length > MAX_VALUE_ITEM_BYTES:
            unloadable[fqn] = f"{item.length}-byte value is larger than the {MAX_VALUE_ITEM_BYTES}-byte limit"
            continue
        try:
            value = read_value(cache, item, where=where)
        except CorruptCheckpointError as e:
            unloadable[fqn] = f"not restorable without running pickle code: {e}"
            continue
        why = unrestorable(value)
        if why is None:
            values[fqn] = value
        else:
            unloadable[fqn] = f"{why} is not JSON-safe nor made of restorable types ({RESTORABLE})"
    return values, unloadable
