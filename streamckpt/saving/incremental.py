"""Incremental saves: the shards a save need not upload because a base checkpoint holds them.

``read_base`` (rank 0) checks that ``base`` is a committed streamckpt checkpoint that is a
sibling of the checkpoint being written (same parent prefix, another name) and returns its
manifest's bytes and the manifest it parsed from them; rank 0 keeps that manifest
(``BaseShards.of``), the other ranks parse the broadcast bytes once (``BaseShards.parse``:
read once, parsed once per rank).
``split`` then decides, on each rank for its own shards, which ones to reference: a shard
whose key, dtype, global shape, box, flat range and codec equal a base shard's and whose
raw bytes have the same xxh3-128 digest is recorded with the base shard's address,
rewritten as seen from the new checkpoint (``../<sibling>/data/...``). A base shard that
itself references a sibling keeps pointing at the file that holds the bytes, so references
never chain. A candidate's digest is computed once: when its bytes differ from the base's,
the writer records that digest instead of hashing the shard again as it uploads it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import xxhash

from ..core import manifest as mf
from ..errors import CheckpointError, CheckpointNotFoundError
from ..storage import Storage
from .writer import ShardToWrite

log = logging.getLogger(__name__)

_Key = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, int] | None, str]


def norm_uri(uri: str) -> str:
    """A URI as compared here: no trailing slash; a local path made absolute."""
    uri = str(uri).rstrip("/")
    if "://" in uri:
        return uri
    return os.path.abspath(uri[len("file:"):] if uri.startswith("file:") else uri)


def sibling_name(uri: str, base: str) -> str:
    """The child name of ``base`` when it is a sibling of ``uri`` (same parent, another name).

    Raises:
        CheckpointError: ``base`` is ``uri`` itself or not under the same root.
    """
    here, there = norm_uri(uri), norm_uri(base)
    parent, _, own = here.rpartition("/")
    bparent, _, name = there.rpartition("/")
    if not parent or bparent != parent or not name:
        raise CheckpointError(
            f"base={base!r} is not a sibling of {uri!r}: an incremental save references a committed checkpoint "
            f"under the same root ({parent or uri}/<name>); save without base, or pass a checkpoint under that root")
    if name == own:
        raise CheckpointError(f"base={base!r} is the checkpoint being written; pass an earlier checkpoint as base")
    return name


def read_base(uri: str, base: str, storage_options: dict | None) -> tuple[bytes, mf.Manifest]:
    """Rank 0: the base's manifest bytes (for the other ranks) and the manifest parsed from
    them, checked (committed, streamckpt, a sibling of ``uri``).

    Raises:
        CheckpointError: the base is not a committed streamckpt checkpoint under the same root.
    """
    sibling_name(uri, base)
    storage = Storage(base, storage_options)
    try:
        data = storage.read_bytes(mf.MANIFEST_NAME, max_bytes=mf.MAX_MANIFEST_BYTES)
    except CheckpointNotFoundError:
        raise CheckpointError(
            f"base {storage.describe('')} is not a committed streamckpt checkpoint (it has no {mf.MANIFEST_NAME}: "
            f"deleted, never committed, or another format); pass a committed checkpoint as base, or none") from None
    finally:
        storage.close()
    manifest = mf.from_json(data, where=f"base {base}/{mf.MANIFEST_NAME}")
    if manifest.kind != mf.FORMAT_NAME:
        raise CheckpointError(f"base {base!r} is a {manifest.kind} checkpoint; a base must be a streamckpt checkpoint")
    return data, manifest


@dataclass
class BaseShards:
    """A base checkpoint's shards by region, their files named as seen from the new checkpoint."""

    name: str  # the base's child name under the root
    shards: dict[_Key, mf.Shard] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # referenced file -> size

    @staticmethod
    def parse(data: bytes, uri: str, base: str) -> "BaseShards":
        """From the manifest's bytes (the ranks that did not read it)."""
        return BaseShards.of(mf.from_json(data, where=f"base {base}/{mf.MANIFEST_NAME}"), uri, base)

    @staticmethod
    def of(m: mf.Manifest, uri: str, base: str) -> "BaseShards":
        """From the parsed manifest (rank 0, which read it)."""
        name = sibling_name(uri, base)
        own = norm_uri(uri).rpartition("/")[2]
        out = BaseShards(name)
        for key, t in m.tensors.items():
            for s in t.shards:
                ref = mf.split_reference(s.file)
                file = s.file if ref is not None else f"../{name}/{s.file}"  # the file holding the bytes
                if s.digest is None or (ref is not None and ref[0] == own):
                    continue  # no digest to compare, or bytes in the checkpoint being replaced
                out.shards[(key, t.dtype, t.shape, s.offset, s.shape, s.flat_range, s.codec)] = replace(s, file=file)
                out.sizes[file] = m.files[s.file]
        return out


def digest_of(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's raw bytes (row-major), as the writer records it."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128(memoryview(raw)).hexdigest()  # type: ignore[arg-type]


@dataclass
class Split:
    """An incremental save's decision for one rank's shards."""

    upload: list[int]  # indices into the rank's shards: written as usual
    reused: list[tuple[int, str, mf.Shard]]  # (index, key, base shard): referenced, not uploaded
    digests: dict[int, str] = field(default_factory=dict)  # an upload's digest, computed to compare


def split(mine: Sequence[ShardToWrite], base: BaseShards | None, compression: str | None) -> Split:
    """Which of ``mine`` to upload and which to reference. A candidate (a base shard with the
    same region and codec) is hashed here; when it differs, its digest goes to the writer
    (``Split.digests``), which then does not hash its bytes again."""
    if base is None:
        return Split(list(range(len(mine))), [])
    codec = "zstd" if compression else "raw"
    out = Split([], [])
    for i, it in enumerate(mine):
        sp = it.spec
        hit = base.shards.get((sp.key, sp.dtype, sp.global_shape, sp.offset, sp.shape, sp.flat_range, codec))
        if hit is None:
            out.upload.append(i)
            continue
        digest = digest_of(it.tensor)
        if hit.digest == digest:
            out.reused.append((i, sp.key, hit))
        else:
            out.upload.append(i)
            out.digests[i] = digest
    log.debug("incremental save against %s: %d shard(s) referenced, %d to upload (%d of them hashed to compare)",
              base.name, len(out.reused), len(out.upload), len(out.digests))
    return out
