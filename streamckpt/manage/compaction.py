"""Compaction: a pruned checkpoint's data files, kept whole for the few shards later
(incremental) checkpoints still reference, rewritten down to those shards.

Frozen and trainable tensors share data files, so after the base of an incremental chain is
pruned its whole files stay alive for the frozen tensors the kept checkpoints reference. A
file that no committed checkpoint owns (its own checkpoint's manifest is gone) and whose size
is more than ``WASTE`` times the bytes kept checkpoints reference in it is compacted:

1. the referenced byte ranges (whole shards: their chunks' CRC32Cs and digests stay valid,
   the bytes are copied verbatim) are copied into a new file in the same prefix,
   ``compact-<id>.bin`` (raw shard bytes back to back, no header), by the store itself
   where it can (``storage.compose``);
2. each referencing manifest is rewritten to point at the new file and offsets (one PUT
   each: a manifest is replaced whole, never seen half-written);
3. the old file is deleted, once no manifest names it.

A kill at any point leaves every kept checkpoint loadable: before step 2 the new file is an
unreferenced object (garbage for ``collect_garbage``, after its grace); during step 2 the
manifests not yet rewritten still name the old file, which stays; after it, the old file is
unreferenced garbage. The next compaction finishes what one cut short left.
"""

from __future__ import annotations

import json
import logging
import posixpath
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..core.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from ..errors import CheckpointError
from ..storage import Storage
from ..storage.compose import Range, compose
from .index import Listing

log = logging.getLogger(__name__)

WASTE = 1.1  # a file is compacted when its size exceeds this times the bytes kept checkpoints reference in it


@dataclass(slots=True)
class Compacted:
    """What one compaction did (every count over all the files it rewrote)."""

    files: list[str] = field(default_factory=list)  # the old files replaced, relative to the root
    bytes_before: int = 0  # their sizes
    bytes_after: int = 0  # the new files' sizes
    client_bytes: int = 0  # bytes that went through this process (0: the store copied them all)
    manifests: list[str] = field(default_factory=list)  # the checkpoints whose manifests were rewritten


@dataclass(slots=True)
class _Use:
    """A referencing checkpoint's shards in one file: (tensor, shard index, byte offset, length)."""

    entry: str
    shards: list[tuple[str, int, int, int]] = field(default_factory=list)


def candidates(listing: Listing) -> list[str]:
    """Files referenced by committed checkpoints under a prefix that no committed checkpoint owns."""
    owners = {e.name for e in listing.entries}
    referenced = {n for e in listing.entries if e.error is None for n in e.objects if not n.endswith(MANIFEST_NAME)}
    return sorted(n for n in referenced if n.partition("/")[0] not in owners and n in listing.objects)


def compact(storage: Storage, listing: Listing) -> Compacted:
    """Compact the wasteful files under ``storage``'s root (see the module docstring)."""
    done = Compacted()
    files = candidates(listing)
    if not files:
        return done
    if any(e.error is not None for e in listing.entries):  # an unreadable manifest may reference them too
        log.info("compaction skipped under %s: a manifest there cannot be read", storage.describe(""))
        return done
    docs = _referencing_manifests(storage, listing, set(files))
    uses = _uses(docs, set(files))
    wasteful = []
    for name in files:
        kept = sum(b - a for a, b in _merged([(o, o + n) for u in uses.get(name, []) for *_, o, n in u.shards]))
        if kept and listing.objects[name].size > WASTE * kept:
            wasteful.append(name)
    if not wasteful:
        return done
    found = _stored_elsewhere(docs, set(wasteful))
    for name in wasteful:
        _compact_file(storage, name, listing.objects[name].size, uses[name], docs, found, done)
    if done.files:
        log.info("compacted %d file(s) under %s: %d -> %d bytes (%d through this process), %d manifest(s) "
                 "rewritten", len(done.files), storage.describe(""), done.bytes_before, done.bytes_after,
                 done.client_bytes, len(done.manifests))
    return done


def compact_after_prune(storage: Storage, listing: Listing, root: str) -> bool:
    """``compact`` after a prune's deletions: whether it rewrote anything. A failure is logged,
    not raised: the prune is done, every kept checkpoint still loads, the next prune tries again."""
    try:
        return bool(compact(storage, listing).files)
    except CheckpointError as e:
        log.warning("compaction under %s failed (every kept checkpoint still loads; the next prune tries again): %s",
                    root, e)
        return False


def _compact_file(storage: Storage, name: str, size: int, uses: list[_Use], docs: dict[str, dict[str, Any]],
                  found: dict[tuple[Any, ...], tuple[str, int]], done: Compacted) -> None:
    """Steps 1 to 3 of the module docstring for one file. A shard whose very bytes another kept
    file already holds (a compaction cut short copied them once) is pointed there, not copied."""
    where: dict[tuple[str, int], tuple[str, int]] = {}  # (entry, offset) -> (file, offset)
    copy = []
    for use in uses:
        for tensor, index, offset, _ in use.shards:
            hit = found.get(_key(docs[use.entry]["tensors"][tensor]["shards"][index]))
            if hit is not None:
                where[(use.entry, offset)] = hit
            else:
                copy.append((use.entry, tensor, index, offset))
    spans = _merged([(o, o + int(docs[e]["tensors"][t]["shards"][i]["byte_length"])) for e, t, i, o in copy])
    new, made_size = "", 0
    if spans:
        new = f"{posixpath.dirname(name)}/compact-{uuid.uuid4().hex[:12]}.bin"
        made = compose(storage, new, [Range(name, a, b) for a, b in spans])
        starts = [a for a, _ in spans]
        for e, t, i, o in copy:
            k = max(j for j, a in enumerate(starts) if a <= o)
            where[(e, o)] = (new, made.offsets[k] + o - starts[k])
            found[_key(docs[e]["tensors"][t]["shards"][i])] = where[(e, o)]
        made_size = made.size
        done.client_bytes += made.client_bytes
        done.bytes_after += made.size
    for use in uses:
        _repoint(storage, use, docs[use.entry], name, where)
        if use.entry not in done.manifests:
            done.manifests.append(use.entry)
    storage.delete(name)
    log.info("compacted %s (%d bytes) into %s (%d bytes): its checkpoint %s was deleted", storage.describe(name),
             size, storage.describe(new) if new else "files kept already", made_size, name.partition("/")[0])
    done.files.append(name)
    done.bytes_before += size


def _repoint(storage: Storage, use: _Use, doc: dict[str, Any], old: str, where: dict[tuple[str, int], tuple[str, int]]
             ) -> None:
    """Rewrite one manifest: its shards in ``old`` name their new place; one PUT."""
    files = doc["files"]
    for tensor, index, offset, _ in use.shards:
        target, at = where[(use.entry, offset)]
        shard = doc["tensors"][tensor]["shards"][index]
        shard["file"], shard["byte_offset"] = posixpath.relpath(target, use.entry), at
        if shard["file"] not in files:
            files[shard["file"]] = {"size": storage.size(target)}
    if not any(posixpath.normpath(posixpath.join(use.entry, s["file"])) == old
               for t in doc["tensors"].values() for s in t["shards"]):
        files.pop(posixpath.relpath(old, use.entry), None)
    storage.write_bytes(f"{use.entry}/{MANIFEST_NAME}",
                        json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def _key(shard: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two stored shards the same bytes: raw digest, codec, stored length, checksums."""
    return (shard.get("digest"), shard.get("codec"), int(shard["byte_length"]), tuple(shard.get("crc32c") or ()))


def _stored_elsewhere(docs: dict[str, dict[str, Any]], wasteful: set[str]) -> dict[tuple[Any, ...], tuple[str, int]]:
    """Shards (by ``_key``, with a digest) that kept files outside ``wasteful`` hold: file and offset."""
    out: dict[tuple[Any, ...], tuple[str, int]] = {}
    for entry, doc in docs.items():
        for t in doc.get("tensors", {}).values():
            for shard in t.get("shards", []):
                name = posixpath.normpath(posixpath.join(entry, shard["file"]))
                if shard.get("digest") and name not in wasteful:
                    out.setdefault(_key(shard), (name, int(shard["byte_offset"])))
    return out


def _referencing_manifests(storage: Storage, listing: Listing, files: set[str]) -> dict[str, dict[str, Any]]:
    """The parsed manifests of the committed checkpoints that reference any of ``files``."""
    out: dict[str, dict[str, Any]] = {}
    for e in listing.entries:
        if files & set(e.objects):
            raw = storage.read_bytes(f"{e.name}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
            try:
                out[e.name] = json.loads(raw)
            except ValueError as err:
                raise CheckpointError(f"{storage.describe(e.name)}: its manifest changed while compacting ({err}); "
                                      f"run prune again") from None
    return out


def _uses(docs: dict[str, dict[str, Any]], files: set[str]) -> dict[str, list[_Use]]:
    """For each file, which checkpoints' shards lie in it, and where."""
    out: dict[str, list[_Use]] = {}
    for entry, doc in docs.items():
        mine: dict[str, _Use] = {}
        for tensor, t in doc.get("tensors", {}).items():
            for i, shard in enumerate(t.get("shards", [])):
                name = posixpath.normpath(posixpath.join(entry, shard["file"]))
                if name in files:
                    use = mine.setdefault(name, _Use(entry))
                    use.shards.append((tensor, i, int(shard["byte_offset"]), int(shard["byte_length"])))
        for name, use in mine.items():
            out.setdefault(name, []).append(use)
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching ranges joined, ascending."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


__all__ = ["Compacted", "WASTE", "candidates", "compact", "compact_after_prune"]
